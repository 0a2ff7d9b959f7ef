"""torch.autocast for the product-type ops (dot_interaction, cross_layer, fm_compress, jagged_attention).

Inside ``torch.autocast(device_type, dtype)`` PyTorch runs matmul, linear and SDPA in the autocast
dtype and leaves the rest alone; a layer's parameters stay fp32 while its activations arrive in
bf16/fp16. These ops take the same rule: their floating-point operands are cast to the autocast dtype
(the products still accumulate in fp32), so a model under autocast calls them with mixed fp32
parameters and lower-precision activations instead of failing the same-dtype checks. The casts are
ordinary differentiable ops: an fp32 parameter gets an fp32 gradient. Outside autocast, and for
tensors of other dtypes (fp64 is rejected by the checks as before), nothing changes.

Every gem_kernels op also runs its kernel with autocast off (`run_kernels_without_autocast`): a
reference backend made of torch ops would otherwise be re-cast op by op inside (a different
computation from the same call outside autocast), and so would a backward run inside the region.
"""

from __future__ import annotations

import torch
from torch._library.custom_ops import CustomOpDef

from ._validate import FLOAT_DTYPES


def autocast_operands(*values):
    """``values`` with each fp32/fp16/bf16 tensor (also inside a tuple/list) in the autocast dtype of
    the first tensor's device when autocast is on there; unchanged otherwise."""
    if not torch._C._is_any_autocast_enabled():  # the usual case in one call (1.5 -> 0.1 us for 5 tensors)
        return values
    first = next((v for v in _tensors(values)), None)
    if first is None:
        return values
    device_type = first.device.type
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return values
    dtype = torch.get_autocast_dtype(device_type)

    def cast(v):
        if isinstance(v, torch.Tensor):
            return v.to(dtype) if v.dtype in FLOAT_DTYPES else v
        if isinstance(v, (tuple, list)):
            return type(v)(cast(x) for x in v)
        return v

    return tuple(cast(v) for v in values)


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from _tensors(v)


def run_kernels_without_autocast(*ops: CustomOpDef) -> None:
    """Register an autocast rule for each op (CPU and CUDA) that casts nothing and runs the op with
    the autocast dispatch key excluded: its kernel, and any torch op that kernel calls, then computes
    exactly as outside autocast. (torch.library.register_autocast does the same after casting every
    floating input to one fixed dtype; the public functions above cast to the region's dtype instead.)"""
    for op in ops:
        for device_type in ("cpu", "cuda"):
            key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
            excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

            def kernel(_keyset, *args, _op=op, _excluded=excluded, **kwargs):
                with torch._C._ExcludeDispatchKeyGuard(_excluded):
                    return _op._opoverload(*args, **kwargs)

            op._lib.impl(op._name, kernel, key, with_keyset=True)

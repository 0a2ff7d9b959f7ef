"""The linear family's front door: nn.Linear with its bias and ReLU fused, on one input or on the
concatenation of two that is never built.

``linear(x, weight, bias, relu=, x2=)`` = ``act(concat(x, x2) @ weight^T + bias)``. Its backward is one
op too: grad_x, grad_x2, grad_weight and grad_bias from one pass over the gradient (ReLU's mask, the
bias gradient's column sums and the two GEMMs, csrc/cpu/linear.cpp). Backends: ``cpu`` (float32) and
``reference`` (plain PyTorch, any device and dtype; what ``auto`` runs on every other device and dtype).
"""

from __future__ import annotations

import torch

from .._autocast import autocast_operands, run_kernels_without_autocast
from .._autograd import register_autograd
from .._backend import Family, resolve_backend
from .._validate import check_float64_on_reference, check_tensor, float_dtypes


def _reference_linear():
    from ..reference import linear
    return linear


def _no_triton():
    raise ValueError("the linear family has no triton kernels (backends: reference, cpu)")


FAMILY = Family(_reference_linear, _no_triton, implemented=("reference", "cpu"))


_NATIVE_OPS: dict[str, object] = {}


def _kernel(op: str, backend: str):
    """_backend.kernel for this family (which _backend.FAMILIES does not list: it has no triton module):
    the native schema torch.ops.gem_kernels.<op>_native on cpu, the reference twin's function otherwise."""
    if backend != "cpu":
        return getattr(FAMILY.module(backend), op)
    native = _NATIVE_OPS.get(op)
    if native is None:
        native = _NATIVE_OPS[op] = getattr(torch.ops.gem_kernels, f"{op}_native")
    return native


@torch.library.custom_op("gem_kernels::linear", mutates_args=())
def linear_op(x: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, relu: bool,
              backend: str) -> torch.Tensor:
    return _kernel("linear", backend)(x, x2, weight, bias, relu)


@linear_op.register_fake
def _linear_fake(x, x2, weight, bias, relu, backend):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("gem_kernels::linear_backward", mutates_args=())
def linear_backward_op(grad_out: torch.Tensor, x: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
                       out: torch.Tensor, relu: bool, backend: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _kernel("linear_backward", backend)(grad_out, x, x2, weight, out, relu)


@linear_backward_op.register_fake
def _linear_backward_fake(grad_out, x, x2, weight, out, relu, backend):
    return torch.empty_like(x), torch.empty_like(x2), torch.empty_like(weight), weight.new_empty((weight.shape[0],))


def _linear_setup(ctx, inputs, output):
    x, x2, weight, _bias, relu, backend = inputs
    # The output is the ReLU's mask; without ReLU the backward needs nothing of it.
    ctx.save_for_backward(x, x2, weight, output if relu else None)
    ctx.relu, ctx.backend = relu, backend


def _linear_backward(ctx, grad_out):
    x, x2, weight, out = ctx.saved_tensors
    if out is None:
        out = x.new_empty(0)
    grads = linear_backward_op(grad_out.contiguous(), x, x2, weight, out, ctx.relu, ctx.backend)
    return (*grads, None, None)


register_autograd(linear_op, _linear_backward, setup_context=_linear_setup)
run_kernels_without_autocast(linear_op, linear_backward_op)

if hasattr(torch.ops.gem_kernels, "linear_native"):

    @torch.library.register_fake("gem_kernels::linear_native")
    def _linear_native_fake(x, x2, weight, bias, relu):
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("gem_kernels::linear_backward_native")
    def _linear_backward_native_fake(grad_out, x, x2, weight, out, relu):
        return torch.empty_like(x), torch.empty_like(x2), torch.empty_like(weight), weight.new_empty((weight.shape[0],))


def rows_dense(t: torch.Tensor) -> torch.Tensor:
    """2-D t itself when its rows are dense and do not overlap (a column slice of a wider tensor is
    fine: the kernels read it in place), else a contiguous copy."""
    if (t.stride(1) == 1 or t.shape[1] <= 1) and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1]):
        return t
    return t.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, relu: bool = False,
           x2: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """``act(concat(x, x2) @ weight^T + bias)``: torch.nn.functional.linear with its bias, and the ReLU
    after it when ``relu``, in one op; with ``x2`` the input is the concatenation of x's and x2's
    columns, never built (weight's first K1 columns multiply x, the rest x2).

    Args:
        x: [R, K1] float32/float16/bfloat16; R = 0 is valid. Its rows may be strided (a column slice).
        weight: [N, K1 + K2] (nn.Linear's weight), x's dtype and device.
        bias: [N] or None (no bias), x's dtype and device.
        relu: apply ReLU to the result (its backward reads the output: no gradient where out <= 0,
            torch's threshold_backward convention).
        x2: [R, K2] or None (K2 = 0), x's dtype and device.
        backend: "reference" | "cpu" | "auto"; None uses ``use_backend``'s default. ``auto`` runs cpu on
            float32 CPU tensors and the reference (plain PyTorch) otherwise.

    Returns:
        [R, N] in x's dtype, differentiable w.r.t. x, x2, weight and bias.

    The cpu backend (float32) splits the rows between the threads and runs each block's GEMMs, bias and
    ReLU (backward: the mask, the bias gradient's sums and the GEMMs) on one thread while the block is
    in cache; grad_weight and grad_bias are summed per thread, so their rounding depends on the thread
    count. Under ``torch.autocast`` every operand is cast to the autocast dtype first (like nn.Linear).
    """
    if x2 is None:
        x2 = x.new_empty((x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0, 0))
    if bias is None:
        bias = weight.new_zeros((weight.shape[0],)) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else weight
    x, x2, weight, bias = autocast_operands(x, x2, weight, bias)
    dtypes = float_dtypes()
    check_tensor("x", x, dtypes=dtypes, dims=(2,))
    check_tensor("x2", x2, dims=(2,))
    check_tensor("weight", weight, dims=(2,))
    check_tensor("bias", bias, dims=(1,))
    for name, t in (("x2", x2), ("weight", weight), ("bias", bias)):
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must have x's dtype {x.dtype} and device {x.device}, got {t.dtype} on {t.device}")
    if x2.shape[0] != x.shape[0]:
        raise ValueError(f"x2 must have x's {x.shape[0]} rows, got shape {tuple(x2.shape)}")
    if weight.shape[1] != x.shape[1] + x2.shape[1]:
        raise ValueError(f"weight must have shape (N, {x.shape[1] + x2.shape[1]}) (x's columns plus x2's), "
                         f"got {tuple(weight.shape)}")
    if bias.shape[0] != weight.shape[0]:
        raise ValueError(f"bias must have shape ({weight.shape[0]},) (weight's rows), got {tuple(bias.shape)}")
    if not isinstance(relu, bool):
        raise ValueError(f"relu must be a bool, got {type(relu).__name__}")
    name = resolve_backend(backend, x.device, FAMILY)
    if name == "cpu" and x.dtype != torch.float32:
        if backend not in (None, "auto"):
            raise ValueError(f"backend 'cpu' computes float32 only, got x of dtype {x.dtype}; use 'reference' or 'auto'")
        name = "reference"
    check_float64_on_reference(name, x=x)
    return linear_op(rows_dense(x), rows_dense(x2), weight.contiguous(), bias.contiguous(), relu, name)

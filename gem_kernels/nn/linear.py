"""MLP: nn.Linear layers with ReLU between them, each Linear and the ReLU after it run as one
gem_kernels.linear op (GEMM, bias and ReLU forward; mask, bias gradient and the two GEMMs backward)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .._backend import get_backend
from ..ops.linear import linear, linear_op, rows_dense


_FUSABLE = (nn.Linear, nn.ReLU)


class MLP(nn.Sequential):
    """``Linear(sizes[0], sizes[1]), ReLU, ..., Linear(sizes[-2], sizes[-1])`` (and a last ReLU when
    ``final_activation``): an nn.Sequential with the same children, parameters and state_dict keys
    (``0.weight``, ``0.bias``, ``2.weight``, ...), so checkpoints of the plain Sequential load.

    ``forward(x)``: x a tensor, or a pair ``(x, x2)``: then the first Linear's input is ``concat(x, x2)``
    (its weight's first x.shape[1] columns multiply x), never built. One input, as nn.Sequential takes, so
    torch.fx.symbolic_trace with an MLP as the root traces its one-tensor form (a second, defaulted
    argument would be traced as given and fail when called without it). On 2-D float32 CPU tensors (outside autocast, children
    only nn.Linear and nn.ReLU, no forward hook on one, backend "auto" or "cpu", None meaning ``use_backend``'s default) each Linear runs
    with the ReLU after it as one gem_kernels.linear call on the cpu backend; otherwise the children run
    as nn.Sequential runs them (ReLUs in place on their Linear's output, which nothing else reads):
    the plain PyTorch twin, which "reference" pins, and what CUDA tensors run (cuBLAS's addmm with its
    bias epilogue; the linear family has no GPU kernels).
    """

    def __init__(self, sizes: Sequence[int], final_activation: bool = False, backend: str | None = None,
                 device=None, dtype=None):
        if len(sizes) < 2:
            raise ValueError(f"sizes must have at least 2 widths (input and output), got {list(sizes)}")
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(fan_in, fan_out, device=device, dtype=dtype))
            if final_activation or i < len(sizes) - 2:
                layers.append(nn.ReLU(inplace=True))
        super().__init__(*layers)
        self.backend = backend

    @classmethod
    def from_sequential(cls, seq: nn.Sequential, backend: str | None = None) -> "MLP":
        """An MLP holding seq's own Linear and ReLU children (the same parameters, not copies)."""
        new = cls.__new__(cls)
        nn.Sequential.__init__(new, *seq)
        new.backend = backend
        return new

    def _fuses(self, x) -> bool:
        if type(x) is not torch.Tensor or x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2:
            return False
        # The linear family's kernels are cpu and reference: a module pinned to reference, or to a GPU
        # backend that its float32 CPU input cannot use anyway (triton under TRITON_INTERPRET), runs its children.
        if (self.backend if self.backend is not None else get_backend()) not in ("auto", "cpu"):
            return False
        if torch._C._is_any_autocast_enabled() or nn.modules.module._global_forward_hooks or \
                nn.modules.module._global_forward_pre_hooks:
            return False
        # Only Linear and ReLU children (from_sequential may hold others), none with a hook.
        return all(type(m) in _FUSABLE and not (m._forward_hooks or m._forward_pre_hooks) for m in self)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x2 = None
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError(f"x must be a tensor or a pair (x, x2), got a {type(x).__name__} of {len(x)} items")
            x, x2 = x
        if not self._fuses(x):
            return self._run_children(x, x2)
        children = list(self)
        i = 0
        while i < len(children):
            layer = children[i]
            relu = i + 1 < len(children) and isinstance(children[i + 1], nn.ReLU)
            if layer.bias is None:
                x = linear(x, layer.weight, None, relu=relu, x2=x2, backend="cpu")
            else:
                # The op itself: its native kernel checks the operands (ValueError), and _fuses has
                # checked the input; the public function's Python checks cost ~15 us a layer.
                x = linear_op(rows_dense(x), x.new_empty((x.shape[0], 0)) if x2 is None else rows_dense(x2),
                              layer.weight, layer.bias, relu, "cpu")
            x2 = None
            i += 2 if relu else 1
        return x

    def _run_children(self, x: torch.Tensor, x2: torch.Tensor | None) -> torch.Tensor:
        children = list(self)
        if x2 is not None:
            # The first layer on [x, x2] as two GEMMs into one output, with no concatenated copy; the
            # weight's two column blocks by one split, whose backward is one cat of the two gradients.
            first = children[0]
            w, w2 = first.weight.split([x.shape[1], first.weight.shape[1] - x.shape[1]], dim=1)
            x = torch.addmm(F.linear(x2, w2, first.bias), x, w.t())
            children = children[1:]
        for m in children:
            x = m(x)
        return x

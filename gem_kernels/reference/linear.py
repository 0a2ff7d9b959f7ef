"""Reference linear layer: plain PyTorch, any device, the autograd-free twin of gem_kernels.ops.linear.

``out = act(concat(x, x2) W^T + b)`` (nn.Linear followed by an optional ReLU, on the concatenation of
two inputs that the op never builds), and its backward. Computes in fp32 (fp64 for fp64 inputs) and
casts back to the input dtype; the same signatures as the cpu backend's native schemas.
"""

from __future__ import annotations

import torch

from . import wide


def linear(x: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, relu: bool) -> torch.Tensor:
    k1 = x.shape[1]
    w = wide(weight)
    out = torch.addmm(wide(bias), wide(x), w[:, :k1].t())
    if x2.shape[1]:
        out = out.addmm(wide(x2), w[:, k1:].t())
    return (out.relu() if relu else out).to(x.dtype)


def linear_backward(grad_out: torch.Tensor, x: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
                    out: torch.Tensor, relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_x2, grad_weight, grad_bias); `out` (the forward's output) gives ReLU's mask, as
    torch's threshold_backward reads it: no gradient where out <= 0."""
    k1 = x.shape[1]
    g = wide(grad_out)
    if relu:
        g = g.masked_fill(out <= 0, 0)
    w = wide(weight)
    grad_weight = torch.cat([g.t() @ wide(x), g.t() @ wide(x2)], dim=1)
    return ((g @ w[:, :k1]).to(x.dtype), (g @ w[:, k1:]).to(x.dtype), grad_weight.to(weight.dtype),
            g.sum(0).to(weight.dtype))

"""Reference feature-interaction layers: plain PyTorch, any device, autograd-free twins of the ops.

Each function computes in fp32 and casts back to the input dtype (every tensor argument of an op
has that dtype), and has the signature of the
backend kernels in gem_kernels.ops.interaction (forward and backward), so tests and bench call it
like any other backend. The formulations are the published ones:

- dot_interaction: TorchRec's ``InteractionArch`` / DLRM: ``bmm(x, x^T)`` then a gather of the
  upper triangle in ``torch.triu_indices(F, F, offset)`` order.
- cross_layer: DCNv2 (TorchRec ``CrossNet`` / ``LowRankCrossNet``): ``x0 * (W xl + b) + xl`` with
  ``W = U V`` in the low-rank case.
- fm_compress: Wukong's optimised factorization machine ``flatten(X (X^T Y))`` followed by its
  LayerNorm over the flattened ``F * k`` features.
- feature_mix_norm: the rest of a Wukong layer, ``LayerNorm_D(M X + concat(FMB(X), 0))``: the
  linear compress block and the residual projection as one matrix M over the feature axis, the
  FMB rows added, then the LayerNorm over the embedding dim.
"""

from __future__ import annotations

import torch

from . import wide


def triu_pairs(num_features: int, self_interaction: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of the interaction pairs in output order: torch.triu_indices(F, F, 0 or 1)."""
    return torch.triu_indices(num_features, num_features, 0 if self_interaction else 1, device=device)


def dot_interaction(x: torch.Tensor, self_interaction: bool) -> torch.Tensor:
    """x [B, F, D] -> [B, P]: out[b, p] = <x[b, i_p], x[b, j_p]> for the triu pairs (i_p, j_p)."""
    xf = wide(x)
    gram = torch.bmm(xf, xf.transpose(1, 2))
    rows, cols = triu_pairs(x.shape[1], self_interaction, x.device)
    return gram[:, rows, cols].to(x.dtype)


def dot_interaction_backward(grad_out: torch.Tensor, x: torch.Tensor, self_interaction: bool) -> torch.Tensor:
    """grad_x = (G + G^T) x with G [B, F, F] the upper triangle scattered from grad_out."""
    B, F, _ = x.shape
    rows, cols = triu_pairs(F, self_interaction, x.device)
    grad = torch.zeros(B, F, F, dtype=wide(x).dtype, device=x.device)
    grad[:, rows, cols] = wide(grad_out)
    return torch.bmm(grad + grad.transpose(1, 2), wide(x)).to(x.dtype)


def cross_layer(x0: torch.Tensor, xl: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, z, p): p = xl V^T [B, r] (empty when v is an empty 1-D tensor: full rank), z = p U^T + b,
    out = x0 * z + xl. Low rank is told by v's shape [r, N], never by its size: at N = 0 it is empty."""
    xlf = wide(xl)
    low_rank = v.dim() == 2
    p = xlf @ wide(v).t() if low_rank else xlf.new_empty(0)
    z = torch.addmm(wide(bias), p if low_rank else xlf, wide(u).t())
    out = wide(x0) * z + xlf
    return out.to(xl.dtype), z.to(xl.dtype), p.to(xl.dtype)


def cross_layer_backward(grad_out: torch.Tensor, x0: torch.Tensor, xl: torch.Tensor, u: torch.Tensor,
                         v: torch.Tensor, z: torch.Tensor, p: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x0, grad_xl, grad_u, grad_v, grad_bias); grad_v is empty in the full-rank case."""
    g, x0f, xlf, uf = wide(grad_out), wide(x0), wide(xl), wide(u)
    grad_z = g * x0f
    grad_x0 = g * wide(z)
    grad_bias = grad_z.sum(0)
    if v.dim() == 2:
        pf = wide(p)
        grad_u = grad_z.t() @ pf
        grad_p = grad_z @ uf
        grad_v = grad_p.t() @ xlf
        grad_xl = g + grad_p @ wide(v)
    else:
        grad_u = grad_z.t() @ xlf
        grad_v = xlf.new_empty(0)
        grad_xl = g + grad_z @ uf
    dt = xl.dtype
    return grad_x0.to(dt), grad_xl.to(dt), grad_u.to(dt), grad_v.to(dt), grad_bias.to(dt)


def fm_compress(x: torch.Tensor, y: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                eps: float, save_products: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, mean, rstd, products): s = flatten(x (x^T y)) [B, F*k], out = (s - mean) * rstd * w + b
    per row; products is always empty [0, k*D + F*k] (the backward recomputes, see SAVES_PRODUCTS)."""
    xf = wide(x)
    s = torch.bmm(xf, torch.matmul(xf.transpose(1, 2), wide(y))).flatten(1)
    mean = s.mean(1)
    rstd = torch.rsqrt((s - mean[:, None]).square().mean(1) + eps)
    out = (s - mean[:, None]) * rstd[:, None] * wide(ln_weight) + wide(ln_bias)
    products = xf.new_empty((0, y.shape[1] * (x.shape[2] + x.shape[1])))
    return out.to(x.dtype), mean, rstd, products


def fm_compress_backward(grad_out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, ln_weight: torch.Tensor,
                         mean: torch.Tensor, rstd: torch.Tensor, products: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_y, grad_ln_weight, grad_ln_bias); recomputes x^T y and s from x and y
    (`products` is the forward's, always empty here)."""
    B, F, _ = x.shape
    k = y.shape[1]
    xf, yf, g = wide(x), wide(y), wide(grad_out)
    a = torch.matmul(xf.transpose(1, 2), yf)  # [B, D, k]
    s = torch.bmm(xf, a).flatten(1)
    xhat = (s - mean[:, None]) * rstd[:, None]
    grad_w = (g * xhat).sum(0)
    grad_b = g.sum(0)
    gh = g * wide(ln_weight)
    grad_s = rstd[:, None] * (gh - gh.mean(1, keepdim=True) - xhat * (gh * xhat).mean(1, keepdim=True))
    grad_s = grad_s.view(B, F, k)
    grad_a = torch.bmm(xf.transpose(1, 2), grad_s)  # [B, D, k]
    grad_x = torch.bmm(grad_s, a.transpose(1, 2)) + torch.matmul(yf, grad_a.transpose(1, 2))
    grad_y = torch.bmm(xf, grad_a).sum(0)
    return grad_x.to(x.dtype), grad_y.to(x.dtype), grad_w.to(x.dtype), grad_b.to(x.dtype)


def fm_compress_backward_accumulate(grad_out: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                                    ln_weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                                    products: torch.Tensor, grad_x: torch.Tensor
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fm_compress_backward with grad_x += its x gradient (in x's dtype, as autograd adds two gradients);
    returns (grad_y, grad_ln_weight, grad_ln_bias)."""
    dx, dy, dw, db = fm_compress_backward(grad_out, x, y, ln_weight, mean, rstd, products)
    grad_x.add_(dx)
    return dy, dw, db


def feature_mix_norm(x: torch.Tensor, mix: torch.Tensor, fm: torch.Tensor, ln_weight: torch.Tensor,
                     ln_bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, mean, rstd): s = mix @ x[b] [B, O, D] with fm [B, O_fm, D] added to its first O_fm rows,
    out = (s - mean) * rstd * w + b over D; mean and rstd fp32 [B, O]."""
    s = torch.matmul(wide(mix), wide(x))
    if fm.shape[1]:
        s[:, :fm.shape[1]] += wide(fm)
    mean = s.mean(-1)
    rstd = torch.rsqrt((s - mean[..., None]).square().mean(-1) + eps)
    out = (s - mean[..., None]) * rstd[..., None] * wide(ln_weight) + wide(ln_bias)
    return out.to(x.dtype), mean, rstd


def feature_mix_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, mix: torch.Tensor, fm: torch.Tensor,
                              ln_weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_mix, grad_fm, grad_ln_weight, grad_ln_bias); recomputes s from x, mix and fm."""
    xf, g = wide(x), wide(grad_out)
    s = torch.matmul(wide(mix), xf)
    if fm.shape[1]:
        s[:, :fm.shape[1]] += wide(fm)
    xhat = (s - mean[..., None]) * rstd[..., None]
    grad_w = (g * xhat).sum((0, 1))
    grad_b = g.sum((0, 1))
    gh = g * wide(ln_weight)
    grad_s = rstd[..., None] * (gh - gh.mean(-1, keepdim=True) - xhat * (gh * xhat).mean(-1, keepdim=True))
    grad_x = torch.matmul(wide(mix).t(), grad_s)
    grad_mix = torch.einsum("bod,bfd->of", grad_s, xf)
    grad_fm = grad_s[:, :fm.shape[1]].contiguous()
    return (grad_x.to(x.dtype), grad_mix.to(x.dtype), grad_fm.to(x.dtype), grad_w.to(x.dtype),
            grad_b.to(x.dtype))


# ---------------------------------------------------------------------------------------------
# Eager formulations differentiated by autograd (TorchRec / paper style, in the input dtype): the
# bench's "eager" baseline and the tests' oracle for the hand-written backward twins above.
# ---------------------------------------------------------------------------------------------


def eager_dot_interaction(x: torch.Tensor, self_interaction: bool = False) -> torch.Tensor:
    """TorchRec InteractionArch: bmm(x, x^T) then the triu gather."""
    rows, cols = triu_pairs(x.shape[1], self_interaction, x.device)
    return torch.bmm(x, x.transpose(1, 2))[:, rows, cols]


def eager_cross_layer(x0: torch.Tensor, xl: torch.Tensor, weight, bias: torch.Tensor) -> torch.Tensor:
    """TorchRec CrossNet / LowRankCrossNet layer: x0 * (W xl + b) + xl, W = U V when weight = (u, v)."""
    if isinstance(weight, (tuple, list)):
        u, v = weight
        z = torch.nn.functional.linear(torch.nn.functional.linear(xl, v), u, bias)
    else:
        z = torch.nn.functional.linear(xl, weight, bias)
    return x0 * z + xl


def eager_fm_compress(x: torch.Tensor, y: torch.Tensor, ln_weight: torch.Tensor | None = None,
                      ln_bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Wukong FMB's optimised FM and LayerNorm: layer_norm(flatten(bmm(x, x^T y)))."""
    s = torch.bmm(x, torch.matmul(x.transpose(1, 2), y)).flatten(1)
    return torch.nn.functional.layer_norm(s, (s.shape[1],), ln_weight, ln_bias, eps)


def eager_feature_mix_norm(x: torch.Tensor, mix: torch.Tensor, fm: torch.Tensor | None = None,
                           ln_weight: torch.Tensor | None = None, ln_bias: torch.Tensor | None = None,
                           eps: float = 1e-5) -> torch.Tensor:
    """Wukong's layer output: layer_norm(mix @ x + concat(fm, 0)) over the embedding dim (the
    concat of FMB and LCB plus the residual, with LCB and residual one matmul over the features)."""
    s = torch.matmul(mix, x)
    if fm is not None and fm.shape[1]:
        s = s + torch.nn.functional.pad(fm, (0, 0, 0, mix.shape[0] - fm.shape[1]))
    return torch.nn.functional.layer_norm(s, (x.shape[2],), ln_weight, ln_bias, eps)

"""Reference HSTU layer: generative-recommenders' ``STULayer`` written from its maths in plain PyTorch.

The twin of ``gem_kernels.nn.HSTULayer`` (and of GR's ``STULayer`` with its PyTorch kernels:
``hstu_compute_uqvk``, ``pytorch_hstu_mha``, ``pytorch_hstu_compute_output``). All maths in fp32
(fp64 kept as fp64: the float64 run is the ground truth of the FlashAttention-rule checks), cast
back to x's dtype; gradients by autograd. On jagged rows x [N, D] (``seq_offsets`` [B+1])::

    xn          = LayerNorm(x; norm_weight, norm_bias, eps)
    z           = xn @ uvqk_weight + uvqk_bias             # uvqk_weight [D, H*(2*Lh + 2*A)]
    u, v, q, k  = split(z, [H*Lh, H*Lh, H*A, H*A])
    u           = silu(u)                                  # silu_qkv: v, q, k too (the HSTU paper's form)
    a           = hstu_attention(q, k, v)                  # silu(alpha <q_i, k_j> + bias) / max_seq_len
    n           = LayerNorm(a) over H*Lh, or GroupNorm(a) with H groups of Lh (group_norm)
    y           = u * n
    c           = [u, a, y] (concat_u and concat_x), [u, y], [a, y] or y   # group_norm: both or neither
    out         = x + dropout(c) @ output_weight (+ output_bias)            # output_weight [K, D]

The two halves are also the op-level reference backend of ``gem_kernels.ops.hstu_layer``
(``hstu_uvqk_fwd/bwd``, ``hstu_output_fwd/bwd``); their backward is written in closed form (an op's
kernel runs below autograd) and checked against autograd through ``stu_layer``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import attention as ref_attention
from . import wide


def _norm_stats(x: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """[N, 2 * groups] fp32: the mean and 1 / sqrt(var + eps) of each row's groups (biased variance)."""
    if x.shape[0] == 0:  # var_mean warns on an empty batch
        return x.new_empty((0, 2 * groups), dtype=torch.float32)
    xg = x.float().reshape(x.shape[0], groups, x.shape[1] // groups)
    var, mean = torch.var_mean(xg, dim=-1, unbiased=False)
    return torch.cat([mean, torch.rsqrt(var + eps)], dim=1)


def uvqk(x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, num_heads, linear_dim, attention_dim, silu_qkv):
    """(u_pre [N, H*Lh], v [N, H, Lh], q [N, H, A], k [N, H, A]) in x's dtype: u before its SiLU (the
    output half applies it), v, q, k after theirs when silu_qkv. Differentiable."""
    n, h = x.shape[0], num_heads
    xn = F.layer_norm(wide(x), (x.shape[1],), wide(norm_weight), wide(norm_bias), eps)
    z = torch.addmm(wide(uvqk_bias), xn, wide(uvqk_weight))
    u, v, q, k = z.split([h * linear_dim, h * linear_dim, h * attention_dim, h * attention_dim], dim=1)
    if silu_qkv:
        v, q, k = F.silu(v), F.silu(q), F.silu(k)
    dtype = x.dtype
    return (u.to(dtype), v.reshape(n, h, linear_dim).to(dtype), q.reshape(n, h, attention_dim).to(dtype),
            k.reshape(n, h, attention_dim).to(dtype))


def output(attn, u_pre, x, norm_weight, norm_bias, eps, output_weight, output_bias, dropout_mask, num_heads,
           group_norm, concat_u, concat_x):
    """out [N, D] = x + (dropout_mask *) concat(...) @ output_weight (+ output_bias), in x's dtype.

    attn, u_pre [N, H*Lh]; dropout_mask [N, K] (0 or 1 / (1 - p)) or None. Differentiable."""
    a, u = wide(attn), F.silu(wide(u_pre))
    if group_norm:
        normed = F.group_norm(a.reshape(a.shape[0], num_heads, a.shape[1] // num_heads), num_heads, wide(norm_weight),
                              wide(norm_bias), eps).reshape(a.shape)
    else:
        normed = F.layer_norm(a, (a.shape[1],), wide(norm_weight), wide(norm_bias), eps)
    y = u * normed
    parts = ([u] if concat_u else []) + ([a] if concat_x else []) + [y]
    c = torch.cat(parts, dim=1)
    if dropout_mask is not None:
        c = c * wide(dropout_mask)
    out = torch.addmm(wide(x), c, wide(output_weight))
    if output_bias is not None:
        out = out + wide(output_bias)
    return out.to(x.dtype)


def stu_layer(x, seq_offsets, max_seq_len, num_targets, *, input_norm_weight, input_norm_bias, uvqk_weight,
              uvqk_bias, output_norm_weight, output_norm_bias, output_weight, output_bias=None, num_heads,
              linear_dim, attention_dim, attn_alpha=None, causal=True, contextual_len=0, max_attn_len=0,
              pos_bias=None, time_bias=None, timestamps=None, query_timestamps=None, silu_qkv=False,
              group_norm=False, concat_u=True, concat_x=True, dropout_mask=None, eps=1e-6):
    """The whole layer (module docstring), differentiable w.r.t. x and every weight."""
    u_pre, v, q, k = uvqk(x, input_norm_weight, input_norm_bias, eps, uvqk_weight, uvqk_bias, num_heads,
                          linear_dim, attention_dim, silu_qkv)
    scale = attn_alpha if attn_alpha is not None else ref_attention.default_scale(attention_dim)
    attn, _ = ref_attention.jagged_attention_with_lse(
        q, k, v, seq_offsets, max_seq_len, "hstu", causal, scale, num_targets, contextual_len, max_attn_len,
        pos_bias, time_bias, timestamps, query_timestamps)
    return output(attn.reshape(x.shape[0], num_heads * linear_dim), u_pre, x, output_norm_weight,
                  output_norm_bias, eps, output_weight, output_bias, dropout_mask, num_heads, group_norm,
                  concat_u, concat_x)


# ---------------------------------------------------------------------------------------------
# Op-level reference backend (same signatures as the native cpu/cuda schemas)
# ---------------------------------------------------------------------------------------------


def hstu_uvqk_fwd(x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, num_heads, linear_dim, attention_dim,
                  silu_qkv):
    """(u_pre, v, q, k, stats [N, 2] fp32 mean / rstd of x's rows)."""
    with torch.no_grad():
        parts = uvqk(x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, num_heads, linear_dim, attention_dim,
                     silu_qkv)
        # clone: the slices of one GEMM output alias each other, which an op's outputs may not
        return (*(t.clone(memory_format=torch.contiguous_format) for t in parts), _norm_stats(x, 1, eps))


def _silu_grad(z: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def _norm_backward(dnormed, xhat, rstd, weight, groups):
    """(dx, dweight, dbias) of normed = xhat * weight + bias over [N, G, gs] groups (weight per element
    [G*gs], or per group [G]); rstd [N, G]."""
    n = xhat.shape[0]
    dn = dnormed.reshape(n, groups, dnormed.shape[1] // groups)
    per_group = weight.numel() == groups
    w = wide(weight).reshape(1, groups, 1) if per_group else wide(weight).reshape(1, groups, -1)
    dxh = dn * w
    dx = rstd.unsqueeze(2) * (dxh - dxh.mean(2, keepdim=True) - xhat * (dxh * xhat).mean(2, keepdim=True))
    dims = (0, 2) if per_group else (0,)
    return dx.reshape(n, dnormed.shape[1]), (dn * xhat).sum(dims).reshape(-1), dn.sum(dims).reshape(-1)


def _normalized(x: torch.Tensor, groups: int, eps: float):
    """(xhat [N, G, gs], rstd [N, G]) in fp32."""
    xg = wide(x).reshape(x.shape[0], groups, x.shape[1] // groups)
    if x.shape[0] == 0:  # var_mean warns on an empty batch
        return xg, xg.new_empty((0, groups))
    var, mean = torch.var_mean(xg, dim=-1, unbiased=False, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    return (xg - mean) * rstd, rstd.squeeze(2)


def hstu_uvqk_bwd(grad_u, grad_v, grad_q, grad_k, x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, stats,
                  num_heads, linear_dim, attention_dim, silu_qkv, grad_residual=None):
    """(dx, dnorm_weight, dnorm_bias, duvqk_weight, duvqk_bias) in closed form (the tests check it
    against autograd through ``stu_layer``); stats unused (recomputed). grad_residual ([N, D], x's dtype)
    or None: added to dx after its rounding to x's dtype (the layer's residual gradient)."""
    del stats
    n, hl = x.shape[0], num_heads * linear_dim
    xhat, rstd = _normalized(x, 1, eps)
    xn = xhat.reshape(n, x.shape[1]) * wide(norm_weight) + wide(norm_bias)
    w = wide(uvqk_weight)
    dz = torch.cat([wide(g).reshape(n, g.shape[1:].numel()) for g in (grad_u, grad_v, grad_q, grad_k)], dim=1)
    if silu_qkv:
        z = torch.addmm(wide(uvqk_bias)[hl:], xn, w[:, hl:])
        dz = torch.cat([dz[:, :hl], dz[:, hl:] * _silu_grad(z)], dim=1)
    dxn = dz @ w.t()
    dx, dnw, dnb = _norm_backward(dxn, xhat, rstd, norm_weight, 1)
    dx = dx.to(x.dtype)
    if grad_residual is not None:
        dx = dx + grad_residual
    return (dx, dnw.to(norm_weight.dtype), dnb.to(norm_bias.dtype), (xn.t() @ dz).to(uvqk_weight.dtype),
            dz.sum(0).to(uvqk_bias.dtype))


def hstu_output_fwd(attn, u_pre, x, norm_weight, norm_bias, eps, output_weight, output_bias, dropout_mask,
                    num_heads, group_norm, concat_u, concat_x):
    """(out [N, D], stats [N, 2 * G] fp32 mean / rstd of attn's G norm groups, G = H or 1)."""
    with torch.no_grad():
        out = output(attn, u_pre, x, norm_weight, norm_bias, eps, output_weight, output_bias, dropout_mask,
                     num_heads, group_norm, concat_u, concat_x)
        return out, _norm_stats(attn, num_heads if group_norm else 1, eps)


def hstu_output_bwd(grad_out, attn, u_pre, norm_weight, norm_bias, eps, output_weight, has_output_bias, dropout_mask,
                    stats, num_heads, group_norm, concat_u, concat_x):
    """(dattn, du_pre, dnorm_weight, dnorm_bias, doutput_weight, doutput_bias or [0]) in closed form;
    x's gradient through this half is grad_out itself (the residual), which the caller adds. stats
    unused (recomputed)."""
    del stats
    n, width = attn.shape
    groups = num_heads if group_norm else 1
    g = wide(grad_out)
    u = wide(u_pre)
    s = F.silu(u)
    xhat, rstd = _normalized(attn, groups, eps)
    per_group = norm_weight.numel() == groups
    shape = (1, groups, 1) if per_group else (1, groups, -1)
    normed = (xhat * wide(norm_weight).reshape(shape) + wide(norm_bias).reshape(shape)).reshape(n, width)
    parts = ([s] if concat_u else []) + ([wide(attn)] if concat_x else []) + [s * normed]
    c = torch.cat(parts, dim=1)
    dc = g @ wide(output_weight).t()
    if dropout_mask is not None:
        c = c * wide(dropout_mask)
        dc = dc * wide(dropout_mask)
    dy = dc[:, -width:]
    du = dy * normed + (dc[:, :width] if concat_u else 0)
    da, dnw, dnb = _norm_backward(dy * s, xhat, rstd, norm_weight, groups)
    if concat_x:
        da = da + dc[:, width * concat_u:width * (concat_u + 1)]
    dob = g.sum(0).to(output_weight.dtype) if has_output_bias else grad_out.new_empty((0,))
    return (da.to(attn.dtype), (du * _silu_grad(u)).to(u_pre.dtype), dnw.to(norm_weight.dtype),
            dnb.to(norm_bias.dtype), (c.t() @ g).to(output_weight.dtype), dob)

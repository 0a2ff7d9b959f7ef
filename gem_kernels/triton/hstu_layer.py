"""Triton kernels of the HSTU layer's two projection halves (generative-recommenders' STULayer; the
attention between them is triton/attention.py). Maths: gem_kernels/reference/hstu_layer.py; the same
decomposition as csrc/cpu/hstu_layer.cpp, with a GEMM tile in place of its row block.

Work decomposition:
- `_norm_stats_kernel`: BLOCK_R (row, group) pairs per program, two passes over the group (mean,
  then the biased variance about it, as torch's norms): the fp32 [N, 2G] stats (mean, rstd).
- uvqk forward, `_hstu_uvqk_fwd_kernel`: a GEMM tile [BLOCK_M, BLOCK_N] of one of the four column
  slices (u, v, q, k; one launch each, so each writes its own output with no split copy). Its
  prologue normalises the x chunk [BLOCK_M, BLOCK_K] in registers from the row stats (no xn in
  memory), its epilogue adds the bias and applies SiLU (v, q, k when silu_qkv). FLOPs 2*N*D*O;
  minimum bytes s*(N*D + D*O + N*O).
- output forward, `_hstu_output_fwd_kernel`: a tile [BLOCK_M, BLOCK_N] of out = x + c @ W (+ bias),
  the accumulator starting from the residual; c = [silu(u)], [a], silu(u) * Norm(a) (times the
  dropout mask) is built chunk by chunk in registers by `_concat_chunk` from attn, u_pre and the
  attention norm's stats: no [N, K] concat in memory. FLOPs 2*N*K*D; minimum bytes
  s*(2*N*H*Lh + 2*N*D + K*D).
- backward (what it recomputes, as the cpu kernels): xn from x and its stats (`_norm_apply_kernel`),
  c from attn, u_pre and the stats (`_hstu_output_concat_kernel`), and with silu_qkv the
  pre-activations of v, q, k (`_hstu_uvqk_fwd_kernel` again, its epilogue multiplying the incoming
  gradient by silu'(z)). The plain GEMMs with no prologue (weight gradients, dxn = dz W^T,
  dc = g W^T) are torch.mm (cuBLAS), as the cpu kernels' are MKL. The norms' backward runs one
  program per BLOCK_M rows with the whole row in registers (`_uvqk_norm_bwd_kernel`,
  `_hstu_output_bwd_kernel`), writing dx and the program's fp32 partial sums of the norm-parameter
  gradients, reduced in program order in fp64 by torch (bit-identical run to run).

tl.dot operands are fp32 (exact for fp16/bf16 inputs; the CPU interpreter's bf16 dot is wrong), at
interaction's input precision (`_dot_precision`: 3xTF32 for fp32 inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interaction import _dot_precision

# GEMM tiles: 64 x 64 outputs, K in chunks of 32 (a 64 x 32 fp32 prologue chunk and a 32 x 64 weight
# chunk beside the accumulator, 4 warps). Chosen, not tuned: no GPU has run them. Compiled for sm_90a
# at the bench's dims (scripts/triton_compile_check.py, bf16 and fp32, triton 3.8): every kernel of
# this module at most 181 registers, no spills, at most 128.5 KiB of shared memory (the output GEMM).
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
# (row, group) pairs per stats program, and the chunk of a group read per step.
STATS_ROWS, STATS_COLS = 16, 64
# Rows per norm-backward program: the whole row (pow2(width) fp32) of several operands lives in
# registers, so few rows.
NORM_BWD_ROWS = 8


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(max(n, 1)))


@triton.jit
def _silu(z):
    return z / (1.0 + tl.exp(-z))


@triton.jit
def _silu_grad(z):
    s = 1.0 / (1.0 + tl.exp(-z))
    return s * (1.0 + z * (1.0 - s))


@triton.jit
def _group_stats(Stats_ptr, rows, row_ok, cols, group_size, G):
    """(mean, rstd) [BLOCK_M, BLOCK_C] of each element's norm group: stats is [N, 2G] (means, rstds)."""
    g = cols // group_size
    ok = row_ok[:, None] & (g[None, :] < G)
    mean = tl.load(Stats_ptr + rows[:, None] * 2 * G + g[None, :], mask=ok, other=0.0)
    rstd = tl.load(Stats_ptr + rows[:, None] * 2 * G + G + g[None, :], mask=ok, other=0.0)
    return mean, rstd


@triton.jit
def _norm_params(W_ptr, B_ptr, cols, col_ok, group_size, PER_GROUP: tl.constexpr):
    """The norm weight and bias at each column: per element, or per group (GroupNorm)."""
    idx = cols // group_size if PER_GROUP else cols
    w = tl.load(W_ptr + idx, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B_ptr + idx, mask=col_ok, other=0.0).to(tl.float32)
    return w, b


@triton.jit
def _norm_stats_kernel(X_ptr, Stats_ptr, N, G, group_size, eps, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Stats [N, 2G] of x [N, G * group_size]: program owns BLOCK_R (row, group) pairs."""
    pairs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = pairs < N * G
    row, g = pairs // G, pairs % G
    base = X_ptr + row.to(tl.int64) * G * group_size + g * group_size
    cols = tl.arange(0, BLOCK_C)
    total = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, group_size, BLOCK_C):
        m = ok[:, None] & (c0 + cols[None, :] < group_size)
        total += tl.sum(tl.load(base[:, None] + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32), 1)
    mean = total / group_size
    sq = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, group_size, BLOCK_C):
        m = ok[:, None] & (c0 + cols[None, :] < group_size)
        d = tl.load(base[:, None] + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32) - mean[:, None]
        sq += tl.sum(tl.where(m, d * d, 0.0), 1)
    rstd = 1.0 / tl.sqrt(sq / group_size + eps)
    tl.store(Stats_ptr + row * 2 * G + g, mean, mask=ok)
    tl.store(Stats_ptr + row * 2 * G + G + g, rstd, mask=ok)


def _norm_stats(x: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    n, width = x.shape
    stats = torch.empty((n, 2 * groups), dtype=torch.float32, device=x.device)
    if n:
        _norm_stats_kernel[(triton.cdiv(n * groups, STATS_ROWS),)](x, stats, n, groups, width // groups, eps,
                                                                   BLOCK_R=STATS_ROWS, BLOCK_C=STATS_COLS)
    return stats


@triton.jit
def _normalized_chunk(X_ptr, Stats_ptr, NW_ptr, NB_ptr, rows, row_ok, ks, D):
    """The LayerNorm of x [N, D] at rows x ks, fp32, 0 outside (the uvqk GEMM's prologue)."""
    k_ok = ks < D
    m = row_ok[:, None] & k_ok[None, :]
    x = tl.load(X_ptr + rows[:, None].to(tl.int64) * D + ks[None, :], mask=m, other=0.0).to(tl.float32)
    mean = tl.load(Stats_ptr + rows * 2, mask=row_ok, other=0.0)
    rstd = tl.load(Stats_ptr + rows * 2 + 1, mask=row_ok, other=0.0)
    w = tl.load(NW_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    b = tl.load(NB_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    xn = (x - mean[:, None]) * rstd[:, None] * w[None, :] + b[None, :]
    return tl.where(m, xn, 0.0)


@triton.jit
def _hstu_uvqk_fwd_kernel(
    X_ptr, Stats_ptr, NW_ptr, NB_ptr, W_ptr, Bias_ptr, Out_ptr, Grad_ptr,
    N, D, O, col0, width, stride_out, stride_grad,
    SILU: tl.constexpr,  # the epilogue applies SiLU (v, q, k with silu_qkv)
    SILU_GRAD: tl.constexpr,  # backward recompute: Out = Grad * silu'(z) instead of z
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Out[:, :width] = act(LayerNorm(x) @ W[:, col0:col0+width] + bias[col0:col0+width])."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < N, cols < width
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        xn = _normalized_chunk(X_ptr, Stats_ptr, NW_ptr, NB_ptr, rows, row_ok, k0 + ks, D)
        w = tl.load(W_ptr + (k0 + ks[:, None]).to(tl.int64) * O + col0 + cols[None, :],
                    mask=(k0 + ks[:, None] < D) & col_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(xn, w, input_precision=PRECISION)
    z = acc + tl.load(Bias_ptr + col0 + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    m = row_ok[:, None] & col_ok[None, :]
    if SILU_GRAD:
        g = tl.load(Grad_ptr + rows[:, None].to(tl.int64) * stride_grad + cols[None, :], mask=m, other=0.0)
        z = g.to(tl.float32) * _silu_grad(z)
    elif SILU:
        z = _silu(z)
    tl.store(Out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], z.to(Out_ptr.dtype.element_ty),
             mask=m)


def _uvqk_slices(num_heads: int, linear_dim: int, attention_dim: int) -> list[tuple[int, int]]:
    """(first column, width) of u, v, q, k in the UVQK GEMM's output."""
    hl, ha = num_heads * linear_dim, num_heads * attention_dim
    return [(0, hl), (hl, hl), (2 * hl, ha), (2 * hl + ha, ha)]


def _launch_uvqk(x, stats, norm_weight, norm_bias, uvqk_weight, uvqk_bias, out, col0, width, silu, grad=None):
    n, d = x.shape
    if n == 0 or width == 0:
        return
    grid = (triton.cdiv(n, BLOCK_M), triton.cdiv(width, BLOCK_N))
    _hstu_uvqk_fwd_kernel[grid](
        x, stats, norm_weight, norm_bias, uvqk_weight, uvqk_bias, out, out if grad is None else grad,
        n, d, uvqk_weight.shape[1], col0, width, out.stride(0), 0 if grad is None else grad.stride(0),
        SILU=silu, SILU_GRAD=grad is not None, PRECISION=_dot_precision(x.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def hstu_uvqk_fwd(x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, num_heads, linear_dim, attention_dim,
                  silu_qkv):
    """(u_pre, v, q, k, stats): reference.hstu_layer.hstu_uvqk_fwd's contract."""
    n = x.shape[0]
    stats = _norm_stats(x, 1, eps)
    outs = []
    for s, (col0, width) in enumerate(_uvqk_slices(num_heads, linear_dim, attention_dim)):
        out = torch.empty((n, width), dtype=x.dtype, device=x.device)
        _launch_uvqk(x, stats, norm_weight, norm_bias, uvqk_weight, uvqk_bias, out, col0, width, silu_qkv and s > 0)
        outs.append(out)
    u, v, q, k = outs
    return (u, v.view(n, num_heads, linear_dim), q.view(n, num_heads, attention_dim),
            k.view(n, num_heads, attention_dim), stats)


@triton.jit
def _norm_apply_kernel(X_ptr, Stats_ptr, NW_ptr, NB_ptr, Out_ptr, N, D,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Out = LayerNorm(x) in fp32 from the saved stats (the backward's recomputed xn)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    xn = _normalized_chunk(X_ptr, Stats_ptr, NW_ptr, NB_ptr, rows, rows < N, ks, D)
    tl.store(Out_ptr + rows[:, None].to(tl.int64) * D + ks[None, :], xn, mask=(rows[:, None] < N) & (ks[None, :] < D))


@triton.jit
def _row_norm_backward(dn, xhat, rstd, w, cols, width, group_size, G):
    """dx of normed = xhat * w + b for a [R, BLOCK_W] tile of rows, per norm group of group_size
    columns: rstd * (dn w - mean_g(dn w) - xhat * mean_g(dn w xhat)); rstd the per-element group rstd."""
    dxh = dn * w
    m1 = tl.zeros(dn.shape, tl.float32)
    m2 = tl.zeros(dn.shape, tl.float32)
    for g in range(0, G):
        in_g = ((cols // group_size) == g) & (cols < width)
        s1 = tl.sum(tl.where(in_g[None, :], dxh, 0.0), 1) / group_size
        s2 = tl.sum(tl.where(in_g[None, :], dxh * xhat, 0.0), 1) / group_size
        m1 = tl.where(in_g[None, :], s1[:, None], m1)
        m2 = tl.where(in_g[None, :], s2[:, None], m2)
    return rstd * (dxh - m1 - xhat * m2)


@triton.jit
def _uvqk_norm_bwd_kernel(DXN_ptr, X_ptr, Stats_ptr, NW_ptr, DX_ptr, Partial_ptr, N, D,
                          BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """The input LayerNorm's backward for BLOCK_M rows: dx, and the program's partial sums of the
    norm weight / bias gradients (Partial [programs, 2, D])."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_W)
    row_ok, col_ok = rows < N, cols < D
    m = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    dn = tl.load(DXN_ptr + offs, mask=m, other=0.0).to(tl.float32)
    x = tl.load(X_ptr + offs, mask=m, other=0.0).to(tl.float32)
    mean = tl.load(Stats_ptr + rows * 2, mask=row_ok, other=0.0)
    rstd = tl.load(Stats_ptr + rows * 2 + 1, mask=row_ok, other=0.0)
    xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
    w = tl.load(NW_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dx = _row_norm_backward(dn, xhat, rstd[:, None], w[None, :], cols, D, D, 1)
    tl.store(DX_ptr + offs, dx.to(DX_ptr.dtype.element_ty), mask=m)
    tl.store(Partial_ptr + pid * 2 * D + cols, tl.sum(dn * xhat, 0), mask=col_ok)
    tl.store(Partial_ptr + pid * 2 * D + D + cols, tl.sum(dn, 0), mask=col_ok)


def _reduce_partials(partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[programs, 2, width] fp32 partial sums -> (weight grad, bias grad) fp32 [width], summed in fp64
    (a norm weight's gradient sums N terms: fp32 accumulation drifted past FlashAttention's rule on
    the cpu kernels)."""
    sums = partials.double().sum(0).float()
    return sums[0].clone(), sums[1].clone()


def hstu_uvqk_bwd(grad_u, grad_v, grad_q, grad_k, x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, stats,
                  num_heads, linear_dim, attention_dim, silu_qkv, grad_residual=None):
    """(dx, dnorm_weight, dnorm_bias, duvqk_weight, duvqk_bias); xn recomputed from the saved stats,
    with silu_qkv z of v, q, k too (fused into dz's epilogue). grad_residual (x's shape and dtype) or
    None: added to dx after the norm backward kernel (one more pass; not folded into the kernel)."""
    n, d = x.shape
    slices = _uvqk_slices(num_heads, linear_dim, attention_dim)
    grads = [g.reshape(n, width) for g, (_, width) in zip((grad_u, grad_v, grad_q, grad_k), slices)]
    if silu_qkv:
        dz = torch.empty((n, uvqk_weight.shape[1]), dtype=torch.float32, device=x.device)
        dz[:, :slices[0][1]] = grads[0]
        for (col0, width), g in zip(slices[1:], grads[1:]):
            _launch_uvqk(x, stats, norm_weight, norm_bias, uvqk_weight, uvqk_bias, dz[:, col0:], col0, width, False,
                         grad=g)
    else:
        dz = torch.cat([g.float() for g in grads], dim=1)
    xn = torch.empty((n, d), dtype=torch.float32, device=x.device)
    if n:
        _norm_apply_kernel[(triton.cdiv(n, BLOCK_M), triton.cdiv(d, BLOCK_K))](
            x, stats, norm_weight, norm_bias, xn, n, d, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    dw = xn.t() @ dz
    db = dz.sum(0)
    dxn = dz @ uvqk_weight.float().t()
    dx = torch.empty_like(x)
    programs = triton.cdiv(n, NORM_BWD_ROWS)
    partials = torch.zeros((max(programs, 1), 2, d), dtype=torch.float32, device=x.device)
    if n:
        _uvqk_norm_bwd_kernel[(programs,)](dxn, x, stats, norm_weight, dx, partials, n, d,
                                           BLOCK_M=NORM_BWD_ROWS, BLOCK_W=_pow2(d))
    dnw, dnb = _reduce_partials(partials)
    if grad_residual is not None:
        dx.add_(grad_residual)
    return (dx, dnw.to(norm_weight.dtype), dnb.to(norm_bias.dtype), dw.to(uvqk_weight.dtype),
            db.to(uvqk_bias.dtype))


# ---------------------------------------------------------------------------------------------
# output half
# ---------------------------------------------------------------------------------------------


@triton.jit
def _concat_chunk(A_ptr, U_ptr, Stats_ptr, NW_ptr, NB_ptr, Mask_ptr, rows, row_ok, es, k_base, width, K,
                  group_size, G, PART: tl.constexpr, PER_GROUP: tl.constexpr, HAS_MASK: tl.constexpr):
    """Columns k_base + es of c (fp32 [BLOCK_M, BLOCK_K], 0 outside): part 0 silu(u), 1 a,
    2 silu(u) * Norm(a); es are columns of attn / u_pre (< width)."""
    e_ok = es < width
    m = row_ok[:, None] & e_ok[None, :]
    offs = rows[:, None].to(tl.int64) * width + es[None, :]
    if PART == 1:
        c = tl.load(A_ptr + offs, mask=m, other=0.0).to(tl.float32)
    else:
        c = _silu(tl.load(U_ptr + offs, mask=m, other=0.0).to(tl.float32))
        if PART == 2:
            a = tl.load(A_ptr + offs, mask=m, other=0.0).to(tl.float32)
            mean, rstd = _group_stats(Stats_ptr, rows, row_ok, es, group_size, G)
            w, b = _norm_params(NW_ptr, NB_ptr, es, e_ok, group_size, PER_GROUP)
            c = c * ((a - mean) * rstd * w[None, :] + b[None, :])
    if HAS_MASK:
        c *= tl.load(Mask_ptr + rows[:, None].to(tl.int64) * K + k_base + es[None, :], mask=m, other=0.0).to(
            tl.float32)
    return tl.where(m, c, 0.0)


@triton.jit
def _concat_part_dot(acc, A_ptr, U_ptr, Stats_ptr, NW_ptr, NB_ptr, Mask_ptr, W_ptr, rows, row_ok, cols, col_ok,
                     k_base, width, K, D, group_size, G, PART: tl.constexpr, PER_GROUP: tl.constexpr,
                     HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + c[:, k_base : k_base + width] @ W[k_base : k_base + width, cols]."""
    ks = tl.arange(0, BLOCK_K)
    for e0 in range(0, width, BLOCK_K):
        c = _concat_chunk(A_ptr, U_ptr, Stats_ptr, NW_ptr, NB_ptr, Mask_ptr, rows, row_ok, e0 + ks, k_base, width,
                          K, group_size, G, PART, PER_GROUP, HAS_MASK)
        w = tl.load(W_ptr + (k_base + e0 + ks[:, None]).to(tl.int64) * D + cols[None, :],
                    mask=(e0 + ks[:, None] < width) & col_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(c, w, input_precision=PRECISION)
    return acc


@triton.jit
def _hstu_output_fwd_kernel(
    A_ptr, U_ptr, X_ptr, Stats_ptr, NW_ptr, NB_ptr, W_ptr, OB_ptr, Mask_ptr, Out_ptr,
    N, D, width, K, group_size, G,
    CONCAT_U: tl.constexpr, CONCAT_X: tl.constexpr, PER_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[rows, cols] = x + c @ W (+ bias), c built in the K loop's prologue."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < N, cols < D
    m = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    acc = tl.load(X_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(OB_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    k_base = 0
    if CONCAT_U:
        acc = _concat_part_dot(acc, A_ptr, U_ptr, Stats_ptr, NW_ptr, NB_ptr, Mask_ptr, W_ptr, rows, row_ok, cols,
                               col_ok, k_base, width, K, D, group_size, G, 0, PER_GROUP, HAS_MASK, PRECISION,
                               BLOCK_K)
        k_base += width
    if CONCAT_X:
        acc = _concat_part_dot(acc, A_ptr, U_ptr, Stats_ptr, NW_ptr, NB_ptr, Mask_ptr, W_ptr, rows, row_ok, cols,
                               col_ok, k_base, width, K, D, group_size, G, 1, PER_GROUP, HAS_MASK, PRECISION,
                               BLOCK_K)
        k_base += width
    acc = _concat_part_dot(acc, A_ptr, U_ptr, Stats_ptr, NW_ptr, NB_ptr, Mask_ptr, W_ptr, rows, row_ok, cols, col_ok,
                           k_base, width, K, D, group_size, G, 2, PER_GROUP, HAS_MASK, PRECISION, BLOCK_K)
    tl.store(Out_ptr + offs, acc.to(Out_ptr.dtype.element_ty), mask=m)


def hstu_output_fwd(attn, u_pre, x, norm_weight, norm_bias, eps, output_weight, output_bias, dropout_mask,
                    num_heads, group_norm, concat_u, concat_x):
    """(out [N, D], stats [N, 2G]): reference.hstu_layer.hstu_output_fwd's contract."""
    n, width = attn.shape
    dim = x.shape[1]
    groups = num_heads if group_norm else 1
    stats = _norm_stats(attn, groups, eps)
    out = torch.empty_like(x)
    if n:
        grid = (triton.cdiv(n, BLOCK_M), triton.cdiv(dim, BLOCK_N))
        _hstu_output_fwd_kernel[grid](
            attn, u_pre, x, stats, norm_weight, norm_bias, output_weight,
            x if output_bias is None else output_bias, x if dropout_mask is None else dropout_mask, out,
            n, dim, width, output_weight.shape[0], width // groups, groups,
            CONCAT_U=concat_u, CONCAT_X=concat_x, PER_GROUP=group_norm, HAS_BIAS=output_bias is not None,
            HAS_MASK=dropout_mask is not None, PRECISION=_dot_precision(x.dtype),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out, stats


@triton.jit
def _hstu_output_concat_kernel(A_ptr, U_ptr, Stats_ptr, NW_ptr, NB_ptr, Mask_ptr, C_ptr, N, width, K, k_base,
                               group_size, G, PART: tl.constexpr, PER_GROUP: tl.constexpr, HAS_MASK: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[:, k_base : k_base + width] of one part, fp32 (the backward's recomputed concat)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    es = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    c = _concat_chunk(A_ptr, U_ptr, Stats_ptr, NW_ptr, NB_ptr, Mask_ptr, rows, rows < N, es, k_base, width, K,
                      group_size, G, PART, PER_GROUP, HAS_MASK)
    tl.store(C_ptr + rows[:, None].to(tl.int64) * K + k_base + es[None, :], c,
             mask=(rows[:, None] < N) & (es[None, :] < width))


@triton.jit
def _hstu_output_bwd_kernel(DC_ptr, A_ptr, U_ptr, Stats_ptr, NW_ptr, NB_ptr, Mask_ptr, DA_ptr, DU_ptr, Partial_ptr,
                            N, width, K, group_size, G, CONCAT_U: tl.constexpr, CONCAT_X: tl.constexpr,
                            PER_GROUP: tl.constexpr, HAS_MASK: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """For BLOCK_M rows, from dc = g W^T [N, K]: du_pre, dattn (the norm's backward per group), and
    the program's partial sums of the norm parameters' gradients per element (Partial [programs, 2, width])."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_W)
    row_ok, col_ok = rows < N, cols < width
    m = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None].to(tl.int64) * width + cols[None, :]
    dc_row = DC_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    mask_row = Mask_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    y_off = width * (CONCAT_U + CONCAT_X)
    dy = tl.load(dc_row + y_off, mask=m, other=0.0)
    if HAS_MASK:
        dy *= tl.load(mask_row + y_off, mask=m, other=0.0).to(tl.float32)
    a = tl.load(A_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + offs, mask=m, other=0.0).to(tl.float32)
    mean, rstd = _group_stats(Stats_ptr, rows, row_ok, cols, group_size, G)
    xhat = tl.where(m, (a - mean) * rstd, 0.0)
    w, b = _norm_params(NW_ptr, NB_ptr, cols, col_ok, group_size, PER_GROUP)
    normed = xhat * w[None, :] + b[None, :]
    du = dy * normed
    if CONCAT_U:
        dcu = tl.load(dc_row, mask=m, other=0.0)
        if HAS_MASK:
            dcu *= tl.load(mask_row, mask=m, other=0.0).to(tl.float32)
        du += dcu
    tl.store(DU_ptr + offs, (du * _silu_grad(u)).to(DU_ptr.dtype.element_ty), mask=m)
    dn = tl.where(m, dy * _silu(u), 0.0)
    da = _row_norm_backward(dn, xhat, rstd, w[None, :], cols, width, group_size, G)
    if CONCAT_X:
        dcx = tl.load(dc_row + width * CONCAT_U, mask=m, other=0.0)
        if HAS_MASK:
            dcx *= tl.load(mask_row + width * CONCAT_U, mask=m, other=0.0).to(tl.float32)
        da += dcx
    tl.store(DA_ptr + offs, da.to(DA_ptr.dtype.element_ty), mask=m)
    tl.store(Partial_ptr + pid * 2 * width + cols, tl.sum(dn * xhat, 0), mask=col_ok)
    tl.store(Partial_ptr + pid * 2 * width + width + cols, tl.sum(dn, 0), mask=col_ok)


def hstu_output_bwd(grad_out, attn, u_pre, norm_weight, norm_bias, eps, output_weight, has_output_bias, dropout_mask,
                    stats, num_heads, group_norm, concat_u, concat_x):
    """(dattn, du_pre, dnorm_weight, dnorm_bias, doutput_weight, doutput_bias or [0]); c recomputed
    from attn, u_pre and the forward's stats."""
    n, width = attn.shape
    k = output_weight.shape[0]
    groups = num_heads if group_norm else 1
    parts = ([0] if concat_u else []) + ([1] if concat_x else []) + [2]
    mask = attn if dropout_mask is None else dropout_mask
    g = grad_out.float()
    c = torch.empty((n, k), dtype=torch.float32, device=attn.device)
    if n:
        for i, part in enumerate(parts):
            _hstu_output_concat_kernel[(triton.cdiv(n, BLOCK_M), triton.cdiv(width, BLOCK_K))](
                attn, u_pre, stats, norm_weight, norm_bias, mask, c, n, width, k, i * width, width // groups, groups,
                PART=part, PER_GROUP=group_norm, HAS_MASK=dropout_mask is not None,
                BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    dw = c.t() @ g
    dob = g.sum(0).to(output_weight.dtype) if has_output_bias else grad_out.new_empty((0,))
    dc = g @ output_weight.float().t()
    dattn, du = torch.empty_like(attn), torch.empty_like(u_pre)
    programs = triton.cdiv(n, NORM_BWD_ROWS)
    partials = torch.zeros((max(programs, 1), 2, width), dtype=torch.float32, device=attn.device)
    if n:
        _hstu_output_bwd_kernel[(programs,)](
            dc, attn, u_pre, stats, norm_weight, norm_bias, mask, dattn, du, partials, n, width, k,
            width // groups, groups, CONCAT_U=concat_u, CONCAT_X=concat_x, PER_GROUP=group_norm,
            HAS_MASK=dropout_mask is not None, BLOCK_M=NORM_BWD_ROWS, BLOCK_W=_pow2(width))
    if group_norm:
        partials = partials.view(partials.shape[0], 2, groups, width // groups).sum(3)
    dnw, dnb = _reduce_partials(partials)
    return (dattn, du, dnw.to(norm_weight.dtype), dnb.to(norm_bias.dtype), dw.to(output_weight.dtype), dob)

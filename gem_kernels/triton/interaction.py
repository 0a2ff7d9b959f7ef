"""Triton kernels of the interaction family: dot interaction, the cross layer's epilogues, fm_compress.

Work decomposition:
- dot_interaction: one program per sample. It walks D in BLOCK_D chunks, accumulating the gram
  X X^T [BLOCK_F, BLOCK_F] in registers with tl.dot (fp32), then stores only the upper triangle
  at its packed index p(i, j) = i (F - off) - i (i - 1) / 2 + j - i - off. The backward rebuilds
  sym(G) [BLOCK_F, BLOCK_F] in registers from the packed gradient and computes grad_x = sym(G) X
  chunk by chunk: no [B, F, F] tensor exists in either direction.
- cross_layer: the matmuls are torch.addmm/mm (cuBLAS); the fused epilogue out = x0 * z + xl, and
  in the backward grad_z = g * x0, grad_x0 = g * z, are one elementwise kernel each (BLOCK
  elements per program).
- fm_compress: one program per sample. S = X (X^T Y) = sum over D chunks of X_c (X_c^T Y), so X is
  read once, chunk by chunk; the LayerNorm over the F*k values of S runs in registers and the
  program writes the normalised row, its mean and rstd. The backward recomputes S, applies the
  LayerNorm backward in registers, then per D chunk forms grad_A_c = X_c^T grad_S and writes
  grad_X_c = grad_S A_c^T + Y grad_A_c^T; per-sample grad_Y and LayerNorm-parameter partials are
  summed over the batch by torch.

Roofline: dot_interaction fwd 2*B*P*D FLOPs, B*(F*D + P)*s bytes; fm_compress fwd 4*B*F*D*k FLOPs,
(B*F*D + B*F*k)*s bytes (see gem_kernels.flops). Both are memory bound for D <= ~128 on an H100/H200.

tl.dot operands are upcast to fp32 (exact for fp16/bf16 inputs; the CPU interpreter also needs it).
"""

import torch
import triton
import triton.language as tl

# D chunk per tl.dot: 64 fp32 columns x up to 128 rows keeps the X tile at 32 KiB of registers.
MAX_BLOCK_D = 64
# Elements per program of the cross-layer epilogues.
EPILOGUE_BLOCK = 1024


def _pow2(n: int, floor: int = 16) -> int:
    """tl.dot needs every dimension >= 16."""
    return max(floor, triton.next_power_of_2(max(n, 1)))


@triton.jit
def _pair_index(i, j, F, off):
    return i * (F - off) - (i * (i - 1)) // 2 + j - i - off


@triton.jit
def _dot_interaction_fwd_kernel(
    X_ptr, Out_ptr, F, D, P, off,
    BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_F)
    cols = tl.arange(0, BLOCK_D)
    x_base = X_ptr + b * F * D
    gram = tl.zeros((BLOCK_F, BLOCK_F), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        mask = (rows[:, None] < F) & (d0 + cols[None, :] < D)
        x = tl.load(x_base + rows[:, None] * D + d0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gram += tl.dot(x, tl.trans(x))
    i = rows[:, None]
    j = rows[None, :]
    keep = (j >= i + off) & (j < F)
    p = _pair_index(i, j, F, off)
    tl.store(Out_ptr + b * P + p, gram.to(Out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _dot_interaction_bwd_kernel(
    G_ptr, X_ptr, DX_ptr, F, D, P, off,
    BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_F)
    cols = tl.arange(0, BLOCK_D)
    i = rows[:, None]
    j = rows[None, :]
    lo = tl.minimum(i, j)
    hi = tl.maximum(i, j)
    valid = (hi >= lo + off) & (hi < F)
    g = tl.load(G_ptr + b * P + _pair_index(lo, hi, F, off), mask=valid, other=0.0).to(tl.float32)
    sym = tl.where(i == j, 2.0 * g, g)  # d<x_i, x_i>/dx_i = 2 x_i
    for d0 in range(0, D, BLOCK_D):
        mask = (rows[:, None] < F) & (d0 + cols[None, :] < D)
        offs = b * F * D + rows[:, None] * D + d0 + cols[None, :]
        x = tl.load(X_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dx = tl.dot(sym, x)
        tl.store(DX_ptr + offs, dx.to(DX_ptr.dtype.element_ty), mask=mask)


def _block_d(D: int) -> int:
    return min(MAX_BLOCK_D, _pow2(D))


def dot_interaction(x: torch.Tensor, self_interaction: bool) -> torch.Tensor:
    B, F, D = x.shape
    off = 0 if self_interaction else 1
    P = F * (F + 1) // 2 if self_interaction else F * (F - 1) // 2
    out = x.new_empty((B, P))
    if out.numel() == 0:
        return out
    _dot_interaction_fwd_kernel[(B,)](x, out, F, D, P, off, BLOCK_F=_pow2(F), BLOCK_D=_block_d(D))
    return out


def dot_interaction_backward(grad_out: torch.Tensor, x: torch.Tensor, self_interaction: bool) -> torch.Tensor:
    B, F, D = x.shape
    off = 0 if self_interaction else 1
    grad_x = torch.empty_like(x)
    if grad_x.numel() == 0:
        return grad_x
    if grad_out.shape[1] == 0:
        return grad_x.zero_()
    _dot_interaction_bwd_kernel[(B,)](grad_out, x, grad_x, F, D, grad_out.shape[1], off,
                                      BLOCK_F=_pow2(F), BLOCK_D=_block_d(D))
    return grad_x


@triton.jit
def _cross_layer_fwd_kernel(X0_ptr, Z_ptr, XL_ptr, Out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x0 = tl.load(X0_ptr + offs, mask=mask).to(tl.float32)
    z = tl.load(Z_ptr + offs, mask=mask).to(tl.float32)
    xl = tl.load(XL_ptr + offs, mask=mask).to(tl.float32)
    tl.store(Out_ptr + offs, (x0 * z + xl).to(Out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cross_layer_bwd_kernel(G_ptr, X0_ptr, Z_ptr, DZ_ptr, DX0_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G_ptr + offs, mask=mask).to(tl.float32)
    x0 = tl.load(X0_ptr + offs, mask=mask).to(tl.float32)
    z = tl.load(Z_ptr + offs, mask=mask).to(tl.float32)
    tl.store(DZ_ptr + offs, (g * x0).to(DZ_ptr.dtype.element_ty), mask=mask)
    tl.store(DX0_ptr + offs, (g * z).to(DX0_ptr.dtype.element_ty), mask=mask)


def cross_layer(x0, xl, u, v, bias):
    low_rank = v.numel() > 0
    p = xl @ v.t() if low_rank else xl.new_empty(0)
    z = torch.addmm(bias, p if low_rank else xl, u.t())
    out = torch.empty_like(xl)
    n = out.numel()
    if n:
        _cross_layer_fwd_kernel[(triton.cdiv(n, EPILOGUE_BLOCK),)](x0, z, xl, out, n, BLOCK=EPILOGUE_BLOCK)
    return out, z, p


def cross_layer_backward(grad_out, x0, xl, u, v, z, p):
    grad_z = torch.empty_like(x0)
    grad_x0 = torch.empty_like(x0)
    n = grad_z.numel()
    if n:
        _cross_layer_bwd_kernel[(triton.cdiv(n, EPILOGUE_BLOCK),)](grad_out, x0, z, grad_z, grad_x0, n,
                                                                   BLOCK=EPILOGUE_BLOCK)
    grad_bias = grad_z.float().sum(0).to(x0.dtype)
    if v.numel():
        grad_u = grad_z.t() @ p
        grad_p = grad_z @ u
        grad_v = grad_p.t() @ xl
        grad_xl = torch.addmm(grad_out, grad_p, v)
    else:
        grad_u = grad_z.t() @ xl
        grad_v = xl.new_empty(0)
        grad_xl = torch.addmm(grad_out, grad_z, u)
    return grad_x0, grad_xl, grad_u, grad_v, grad_bias


@triton.jit
def _fm_products(x_base, Y_ptr, F, D, k, rows, kcols, dcols,
                 BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """(S = X (X^T Y) [BLOCK_F, BLOCK_K] in fp32, Y [BLOCK_F, BLOCK_K] in fp32)."""
    y = tl.load(Y_ptr + rows[:, None] * k + kcols[None, :], mask=(rows[:, None] < F) & (kcols[None, :] < k),
                other=0.0).to(tl.float32)
    s = tl.zeros((BLOCK_F, BLOCK_K), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        mask = (rows[:, None] < F) & (d0 + dcols[None, :] < D)
        x = tl.load(x_base + rows[:, None] * D + d0 + dcols[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.dot(tl.trans(x), y)  # [BLOCK_D, BLOCK_K]: this chunk's rows of X^T Y
        s += tl.dot(x, a)
    return s, y


@triton.jit
def _fm_compress_fwd_kernel(
    X_ptr, Y_ptr, W_ptr, Bias_ptr, Out_ptr, Mean_ptr, Rstd_ptr, F, D, k, eps,
    BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_F)
    kcols = tl.arange(0, BLOCK_K)
    dcols = tl.arange(0, BLOCK_D)
    s, _y = _fm_products(X_ptr + b * F * D, Y_ptr, F, D, k, rows, kcols, dcols, BLOCK_F, BLOCK_K, BLOCK_D)
    valid = (rows[:, None] < F) & (kcols[None, :] < k)
    n = F * k
    mean = tl.sum(tl.sum(tl.where(valid, s, 0.0), 1), 0) / n
    centred = tl.where(valid, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(centred * centred, 1), 0) / n + eps)
    e = rows[:, None] * k + kcols[None, :]
    w = tl.load(W_ptr + e, mask=valid, other=0.0).to(tl.float32)
    bias = tl.load(Bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    tl.store(Out_ptr + b * n + e, (centred * rstd * w + bias).to(Out_ptr.dtype.element_ty), mask=valid)
    tl.store(Mean_ptr + b, mean)
    tl.store(Rstd_ptr + b, rstd)


@triton.jit
def _fm_compress_bwd_kernel(
    G_ptr, X_ptr, Y_ptr, W_ptr, Mean_ptr, Rstd_ptr, DX_ptr, DYp_ptr, DWp_ptr, DBp_ptr, F, D, k,
    BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_F)
    kcols = tl.arange(0, BLOCK_K)
    dcols = tl.arange(0, BLOCK_D)
    x_base = X_ptr + b * F * D
    s, y = _fm_products(x_base, Y_ptr, F, D, k, rows, kcols, dcols, BLOCK_F, BLOCK_K, BLOCK_D)
    valid = (rows[:, None] < F) & (kcols[None, :] < k)
    n = F * k
    e = rows[:, None] * k + kcols[None, :]
    mean = tl.load(Mean_ptr + b)
    rstd = tl.load(Rstd_ptr + b)
    xhat = tl.where(valid, (s - mean) * rstd, 0.0)
    g = tl.load(G_ptr + b * n + e, mask=valid, other=0.0).to(tl.float32)
    w = tl.load(W_ptr + e, mask=valid, other=0.0).to(tl.float32)
    tl.store(DWp_ptr + b * n + e, g * xhat, mask=valid)
    tl.store(DBp_ptr + b * n + e, g, mask=valid)
    gh = g * w
    c1 = tl.sum(tl.sum(gh, 1), 0) / n
    c2 = tl.sum(tl.sum(gh * xhat, 1), 0) / n
    ds = tl.where(valid, rstd * (gh - c1 - xhat * c2), 0.0)  # grad of S [BLOCK_F, BLOCK_K]
    dy = tl.zeros((BLOCK_F, BLOCK_K), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        mask = (rows[:, None] < F) & (d0 + dcols[None, :] < D)
        offs = rows[:, None] * D + d0 + dcols[None, :]
        x = tl.load(x_base + offs, mask=mask, other=0.0).to(tl.float32)
        xt = tl.trans(x)
        a = tl.dot(xt, y)    # A_c = X_c^T Y       [BLOCK_D, BLOCK_K]
        da = tl.dot(xt, ds)  # grad A_c = X_c^T dS [BLOCK_D, BLOCK_K]
        dx = tl.dot(ds, tl.trans(a)) + tl.dot(y, tl.trans(da))
        tl.store(DX_ptr + b * F * D + offs, dx.to(DX_ptr.dtype.element_ty), mask=mask)
        dy += tl.dot(x, da)
    tl.store(DYp_ptr + b * n + e, dy, mask=valid)


def _fm_blocks(F: int, D: int, k: int) -> dict:
    return dict(BLOCK_F=_pow2(F), BLOCK_K=_pow2(k), BLOCK_D=_block_d(D))


def fm_compress(x, y, ln_weight, ln_bias, eps, save_products):
    """`products` is always empty [0, k*D + F*k]: these memory-bound kernels recompute X^T Y and S in
    the backward rather than write and read them back (see ops.interaction.SAVES_PRODUCTS)."""
    B, F, D = x.shape
    k = y.shape[1]
    out = x.new_empty((B, F * k))
    mean = x.new_empty((B,), dtype=torch.float32)
    rstd = x.new_empty((B,), dtype=torch.float32)
    if B:
        _fm_compress_fwd_kernel[(B,)](x, y, ln_weight, ln_bias, out, mean, rstd, F, D, k, eps, **_fm_blocks(F, D, k))
    return out, mean, rstd, x.new_empty((0, k * (D + F)), dtype=torch.float32)


def fm_compress_backward(grad_out, x, y, ln_weight, mean, rstd, products):
    B, F, D = x.shape
    k = y.shape[1]
    grad_x = torch.empty_like(x)
    # Per-sample fp32 partials, summed over the batch below.
    partial_y = x.new_empty((B, F, k), dtype=torch.float32)
    partial_w = x.new_empty((B, F * k), dtype=torch.float32)
    partial_b = x.new_empty((B, F * k), dtype=torch.float32)
    if B:
        _fm_compress_bwd_kernel[(B,)](grad_out, x, y, ln_weight, mean, rstd, grad_x, partial_y, partial_w, partial_b,
                                      F, D, k, **_fm_blocks(F, D, k))
    dt = x.dtype
    return grad_x, partial_y.sum(0).to(dt), partial_w.sum(0).to(dt), partial_b.sum(0).to(dt)

"""Triton kernels of the interaction family: dot interaction, the cross layer's epilogues, fm_compress,
feature_mix_norm.

Work decomposition:
- dot_interaction: the F features of a sample are cut into T = cdiv(F, BLOCK_T) tiles of BLOCK_T =
  min(pow2(F), MAX_BLOCK_F) rows, so no program holds more than a [BLOCK_T, BLOCK_T] fp32 tile
  whatever F is (F = 256 as one tile would be 256 KiB of registers).
  Forward: grid (B, T (T + 1) / 2), one program per sample and upper-triangle tile pair ti <= tj.
  It walks D in BLOCK_D chunks, accumulating X[ti] X[tj]^T [BLOCK_T, BLOCK_T] with tl.dot (fp32),
  and stores the pairs j >= i + off of its tile at the packed index
  p(i, j) = i (F - off) - i (i - 1) / 2 + j - i - off.
  Backward: grid (B, T), one program per sample and row tile ti. Per D chunk it accumulates
  grad_x[ti, chunk] = sum_tj sym(G)[ti, tj] X[tj, chunk] in a [BLOCK_T, BLOCK_D] fp32 tile, each
  sym(G) tile rebuilt from the packed gradient (diagonal doubled). No [B, F, F] tensor exists in
  either direction. When F fits one tile (pow2(F) <= MAX_BLOCK_F) a program owns the whole
  sample as before: the forward loads each X chunk once and the backward builds sym(G) once.
- cross_layer: the matmuls are torch.addmm/mm (cuBLAS); the fused epilogue out = x0 * z + xl, and
  in the backward grad_z = g * x0, grad_x0 = g * z, are one elementwise kernel each (BLOCK
  elements per program).
- fm_compress: the forward runs one program per sample. S = X (X^T Y) = sum over D chunks of
  X_c (X_c^T Y), so X is read once, chunk by chunk; the LayerNorm over the F*k values of S runs in
  registers and the program writes the normalised row, its mean and rstd. The backward runs
  min(B, FM_BWD_MAX_PROGRAMS) programs, each owning a contiguous range of samples (a fixed
  partition for a given B, so the sums are deterministic). Per sample it recomputes S, applies the
  LayerNorm backward in registers, then per D chunk forms grad_A_c = X_c^T grad_S and writes
  grad_X_c = grad_S A_c^T + Y grad_A_c^T; grad_Y and grad of the LayerNorm weight accumulate in
  [BLOCK_F, BLOCK_K] fp32 registers over the program's samples and are written once per program,
  [programs, F, k] each, summed by torch. grad of the LayerNorm bias is grad_out summed over the
  batch (torch). The X chunk [BLOCK_F, BLOCK_D] is bounded by FM_TILE_ELEMS (BLOCK_D is 16 from
  F = 33 up); S, Y, grad_S and the accumulators are [pow2(F), pow2(k) >= 16] each, so very wide F
  spills registers (measured figures: bench/results/notes-interaction.md).

- feature_mix_norm: one program per (sample, BLOCK_O rows of the O outputs), BLOCK_D = pow2(D)
  columns (the LayerNorm spans a whole row): S = M X_b accumulates over F in BLOCK_F chunks with
  tl.dot, the fm rows are added, the rows are layer-normed in registers. The backward recomputes
  the tile, applies the LayerNorm backward in registers and writes grad_S (fp32 [B, O, D]), grad_fm
  (its first O_fm rows) and per-program fp32 partials of the LayerNorm parameter gradients; then
  grad_X = M^T grad_S and grad_M = sum_b grad_S X_b^T are torch matmuls (cuBLAS). That costs
  grad_S's 4*B*O*D bytes written and read twice more than a fully fused backward.

Roofline (s = element bytes, P pairs, T tiles): dot_interaction fwd 2*B*P*D FLOPs,
B*(F*D + P)*s bytes; bwd 4*B*P*D FLOPs, B*(P + 2*F*D)*s bytes. With T > 1 the forward reads each
X tile once per tile pair it is in (T + 1 times) and the backward reads all of a sample's X and
sym(G) once per row tile and D chunk (X T times, G 2T times per D chunk): re-reads of one sample's
F*D + P elements that L2 serves, not DRAM traffic. fm_compress fwd 4*B*F*D*k FLOPs,
(B*F*D + B*F*k)*s bytes; bwd 8*B*F*D*k FLOPs plus the recomputed 4*B*F*D*k, B*(F*k + 2*F*D)*s
bytes plus 2*programs*F*k*4 bytes of fp32 partials, independent of B (per-sample partials would be
3*B*F*k*4 bytes written and read back, more than X itself at small D). feature_mix_norm fwd
2*B*O*F*D (+ ~8*B*O*D) FLOPs, (B*F*D + B*O_fm*D + B*O*D + O*F + 2*D)*s bytes; bwd 4*B*O*F*D FLOPs
(+ the recomputed S), about twice the forward's bytes plus grad_S's. See gem_kernels.flops.
All are memory bound for D <= ~128 on an H100/H200.

tl.dot operands are upcast to fp32 (exact for fp16/bf16 inputs; the CPU interpreter also needs it).
Every tl.dot names its input precision: Triton's NVIDIA default for fp32 operands is one-pass TF32
(10 mantissa bits, ~1e-3 relative error), while the interpreter multiplies exactly, so the default
would pass the CPU tests and fail the GPU's fp32 tolerances. fp32 inputs take "tf32x3" (3xTF32:
about fp32's accuracy, still on the tensor cores). fp16/bf16 inputs keep one-pass "tf32": their values
are exact in TF32, and fm_compress's fp32 intermediates (X^T Y, grad S) lose no more in TF32's 10
mantissa bits than eager fp16/bf16, which rounds them to 10 or 7. tf32x3 costs the fp32
fm_compress kernels registers (they spill at F >= 128; figures in bench/results/notes-interaction.md):
fp32 there is for checking, bf16 for speed.
"""

import torch
import triton
import triton.language as tl

# D chunk per tl.dot: 64 fp32 columns.
MAX_BLOCK_D = 64
# Feature rows per dot_interaction tile: a [64, 64] fp32 gram / sym(G) tile is 16 KiB of registers,
# past that a GPU program spills. Tests lower it to exercise tiling at small F.
MAX_BLOCK_F = 64
# Bounds on a [rows, BLOCK_D] X chunk: BLOCK_D shrinks as the row block grows. Set from ptxas
# (sm_90a, compiled without a GPU): the dot_interaction backward holds the chunk, the sym(G) tile and
# the grad_x accumulator, and at 64 x 64 with 4 warps spills 1.3 KB (fp32); 64 x 32 with 8 warps
# does not. The fm_compress backward also holds S, Y, W, grad_S, x_hat and two accumulators of
# [BLOCK_F, BLOCK_K]: at F = 27 a 32 x 64 chunk spills, 32 x 32 does not.
DOT_TILE_ELEMS = 2048
FM_TILE_ELEMS = 1024
# Programs of the fm_compress backward: 4 per SM of an H100/H200 (132 SMs) keeps every SM busy
# while the per-program partials stay [528, F, k] whatever B is.
FM_BWD_MAX_PROGRAMS = 4 * 132
# Elements per program of the cross-layer epilogues.
EPILOGUE_BLOCK = 1024


def _dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision for inputs of `dtype` (see the module docstring)."""
    return "tf32" if dtype in (torch.float16, torch.bfloat16) else "tf32x3"


def _pow2(n: int, floor: int = 16) -> int:
    """tl.dot needs every dimension >= 16."""
    return max(floor, triton.next_power_of_2(max(n, 1)))


def _block_d(D: int, block_rows: int, tile_elems: int) -> int:
    """D chunk for a [block_rows, BLOCK_D] tile: at most MAX_BLOCK_D and tile_elems / block_rows
    columns, at least 16 (tl.dot)."""
    return max(16, min(MAX_BLOCK_D, _pow2(D), tile_elems // block_rows))


def _num_warps(block_rows: int) -> int:
    """8 warps from 64 rows up: the [64, 64] fp32 tiles need the registers of 256 threads."""
    return 8 if block_rows >= 64 else 4


@triton.jit
def _pair_index(i, j, F, off):
    return i * (F - off) - (i * (i - 1)) // 2 + j - i - off


@triton.jit
def _dot_interaction_fwd_kernel(
    X_ptr, Out_ptr, F, D, P, off,
    BLOCK_T: tl.constexpr,  # feature rows per tile: min(pow2(F), MAX_BLOCK_F)
    BLOCK_D: tl.constexpr,  # D chunk, [BLOCK_T, BLOCK_D] bounded by DOT_TILE_ELEMS (see _block_d)
    SINGLE_TILE: tl.constexpr,  # F fits one tile: X[ti] is X[tj], load it once
    PRECISION: tl.constexpr,  # tl.dot input precision, _dot_precision(dtype)
):
    b = tl.program_id(0).to(tl.int64)
    # Tile pairs are numbered column by column: t = tj (tj + 1) / 2 + ti, 0 <= ti <= tj. The fp32
    # sqrt (exact inputs, t < 2^20) can land one below an exact root only: one step up fixes it.
    t = tl.program_id(1)
    tj = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    tj += ((tj + 1) * (tj + 2) // 2 <= t).to(tl.int32)
    ti = t - tj * (tj + 1) // 2
    rows_i = ti * BLOCK_T + tl.arange(0, BLOCK_T)
    rows_j = tj * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    x_base = X_ptr + b * F * D
    gram = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        in_d = d0 + cols[None, :] < D
        xi = tl.load(x_base + rows_i[:, None] * D + d0 + cols[None, :], mask=(rows_i[:, None] < F) & in_d,
                     other=0.0).to(tl.float32)
        if SINGLE_TILE:
            xj = xi
        else:
            xj = tl.load(x_base + rows_j[:, None] * D + d0 + cols[None, :], mask=(rows_j[:, None] < F) & in_d,
                         other=0.0).to(tl.float32)
        gram += tl.dot(xi, tl.trans(xj), input_precision=PRECISION)
    i = rows_i[:, None]
    j = rows_j[None, :]
    keep = (j >= i + off) & (j < F)
    tl.store(Out_ptr + b * P + _pair_index(i, j, F, off), gram.to(Out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _sym_grad_tile(g_base, rows_i, rows_j, F, off):
    """sym(G)[rows_i, rows_j] in fp32 from the packed gradient; d<x_i, x_i>/dx_i = 2 x_i doubles the
    diagonal."""
    i = rows_i[:, None]
    j = rows_j[None, :]
    lo = tl.minimum(i, j)
    hi = tl.maximum(i, j)
    valid = (hi >= lo + off) & (hi < F)
    g = tl.load(g_base + _pair_index(lo, hi, F, off), mask=valid, other=0.0).to(tl.float32)
    return tl.where(i == j, 2.0 * g, g)


@triton.jit
def _dot_interaction_bwd_kernel(
    G_ptr, X_ptr, DX_ptr, F, D, P, off, num_tiles,
    BLOCK_T: tl.constexpr,  # feature rows per tile: min(pow2(F), MAX_BLOCK_F)
    BLOCK_D: tl.constexpr,  # D chunk, [BLOCK_T, BLOCK_D] bounded by DOT_TILE_ELEMS (see _block_d)
    SINGLE_TILE: tl.constexpr,  # F fits one tile: build sym(G) once, not per D chunk
    PRECISION: tl.constexpr,  # tl.dot input precision, _dot_precision(dtype)
):
    b = tl.program_id(0).to(tl.int64)
    rows_i = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    g_base = G_ptr + b * P
    x_base = X_ptr + b * F * D
    if SINGLE_TILE:
        sym = _sym_grad_tile(g_base, rows_i, rows_i, F, off)
    for d0 in range(0, D, BLOCK_D):
        in_d = d0 + cols[None, :] < D
        if SINGLE_TILE:
            x = tl.load(x_base + rows_i[:, None] * D + d0 + cols[None, :], mask=(rows_i[:, None] < F) & in_d,
                        other=0.0).to(tl.float32)
            dx = tl.dot(sym, x, input_precision=PRECISION)
        else:
            dx = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            for tj in range(0, num_tiles):
                rows_j = tj * BLOCK_T + tl.arange(0, BLOCK_T)
                x = tl.load(x_base + rows_j[:, None] * D + d0 + cols[None, :], mask=(rows_j[:, None] < F) & in_d,
                            other=0.0).to(tl.float32)
                dx += tl.dot(_sym_grad_tile(g_base, rows_i, rows_j, F, off), x, input_precision=PRECISION)
        offs = rows_i[:, None] * D + d0 + cols[None, :]
        tl.store(DX_ptr + b * F * D + offs, dx.to(DX_ptr.dtype.element_ty), mask=(rows_i[:, None] < F) & in_d)


def _dot_blocks(F: int, D: int, dtype: torch.dtype) -> tuple[int, dict]:
    """(number of feature tiles, the kernels' constexprs)."""
    block_t = min(_pow2(F), MAX_BLOCK_F)
    num_tiles = triton.cdiv(F, block_t)
    return num_tiles, dict(BLOCK_T=block_t, BLOCK_D=_block_d(D, block_t, DOT_TILE_ELEMS),
                           SINGLE_TILE=num_tiles == 1, PRECISION=_dot_precision(dtype),
                           num_warps=_num_warps(block_t))


def dot_interaction(x: torch.Tensor, self_interaction: bool) -> torch.Tensor:
    B, F, D = x.shape
    off = 0 if self_interaction else 1
    P = F * (F + 1) // 2 if self_interaction else F * (F - 1) // 2
    out = x.new_empty((B, P))
    if out.numel() == 0:
        return out
    num_tiles, blocks = _dot_blocks(F, D, x.dtype)
    grid = (B, num_tiles * (num_tiles + 1) // 2)
    _dot_interaction_fwd_kernel[grid](x, out, F, D, P, off, **blocks)
    return out


def dot_interaction_backward(grad_out: torch.Tensor, x: torch.Tensor, self_interaction: bool) -> torch.Tensor:
    B, F, D = x.shape
    off = 0 if self_interaction else 1
    grad_x = torch.empty_like(x)
    if grad_x.numel() == 0:
        return grad_x
    if grad_out.shape[1] == 0:
        return grad_x.zero_()
    num_tiles, blocks = _dot_blocks(F, D, x.dtype)
    _dot_interaction_bwd_kernel[(B, num_tiles)](grad_out, x, grad_x, F, D, grad_out.shape[1], off, num_tiles,
                                                **blocks)
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
    low_rank = v.dim() == 2  # full rank passes an empty 1-D v; a low-rank v [r, N] may be empty (N = 0)
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
    if v.dim() == 2:
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
def _load_fk(ptr, rows, kcols, F, k):
    """A row-major [F, k] operand (Y, the LayerNorm parameters) as a [BLOCK_F, BLOCK_K] fp32 tile."""
    return tl.load(ptr + rows[:, None] * k + kcols[None, :], mask=(rows[:, None] < F) & (kcols[None, :] < k),
                   other=0.0).to(tl.float32)


@triton.jit
def _fm_products(x_base, y, F, D, rows, dcols, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """S = X (X^T Y) [BLOCK_F, BLOCK_K] in fp32, y the fp32 [BLOCK_F, BLOCK_K] tile of Y."""
    s = tl.zeros((BLOCK_F, BLOCK_K), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        mask = (rows[:, None] < F) & (d0 + dcols[None, :] < D)
        x = tl.load(x_base + rows[:, None] * D + d0 + dcols[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.dot(tl.trans(x), y, input_precision=PRECISION)  # [BLOCK_D, BLOCK_K]: the chunk's rows of X^T Y
        s += tl.dot(x, a, input_precision=PRECISION)
    return s


@triton.jit
def _fm_compress_fwd_kernel(
    X_ptr, Y_ptr, W_ptr, Bias_ptr, Out_ptr, Mean_ptr, Rstd_ptr, F, D, k, eps,
    BLOCK_F: tl.constexpr,  # pow2(F): the LayerNorm spans all F*k values of a sample
    BLOCK_K: tl.constexpr,  # pow2(k)
    BLOCK_D: tl.constexpr,  # D chunk, [BLOCK_F, BLOCK_D] bounded by FM_TILE_ELEMS (see _block_d)
    PRECISION: tl.constexpr,  # tl.dot input precision, _dot_precision(dtype)
):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_F)
    kcols = tl.arange(0, BLOCK_K)
    dcols = tl.arange(0, BLOCK_D)
    y = _load_fk(Y_ptr, rows, kcols, F, k)
    s = _fm_products(X_ptr + b * F * D, y, F, D, rows, dcols, BLOCK_F, BLOCK_K, BLOCK_D, PRECISION)
    valid = (rows[:, None] < F) & (kcols[None, :] < k)
    n = F * k
    mean = tl.sum(tl.sum(tl.where(valid, s, 0.0), 1), 0) / n
    centred = tl.where(valid, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(centred * centred, 1), 0) / n + eps)
    w = _load_fk(W_ptr, rows, kcols, F, k)
    bias = _load_fk(Bias_ptr, rows, kcols, F, k)
    e = rows[:, None] * k + kcols[None, :]
    tl.store(Out_ptr + b * n + e, (centred * rstd * w + bias).to(Out_ptr.dtype.element_ty), mask=valid)
    tl.store(Mean_ptr + b, mean)
    tl.store(Rstd_ptr + b, rstd)


@triton.jit
def _fm_compress_bwd_kernel(
    G_ptr, X_ptr, Y_ptr, W_ptr, Mean_ptr, Rstd_ptr, DX_ptr, DYp_ptr, DWp_ptr, B, F, D, k, samples_per_program,
    BLOCK_F: tl.constexpr,  # pow2(F): the LayerNorm spans all F*k values of a sample
    BLOCK_K: tl.constexpr,  # pow2(k)
    BLOCK_D: tl.constexpr,  # D chunk, [BLOCK_F, BLOCK_D] bounded by FM_TILE_ELEMS (see _block_d)
    PRECISION: tl.constexpr,  # tl.dot input precision, _dot_precision(dtype)
):
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * samples_per_program
    last = tl.minimum(first + samples_per_program, B)
    rows = tl.arange(0, BLOCK_F)
    kcols = tl.arange(0, BLOCK_K)
    dcols = tl.arange(0, BLOCK_D)
    valid = (rows[:, None] < F) & (kcols[None, :] < k)
    n = F * k
    e = rows[:, None] * k + kcols[None, :]
    y = _load_fk(Y_ptr, rows, kcols, F, k)
    w = _load_fk(W_ptr, rows, kcols, F, k)
    dy = tl.zeros((BLOCK_F, BLOCK_K), dtype=tl.float32)  # sum over this program's samples
    dw = tl.zeros((BLOCK_F, BLOCK_K), dtype=tl.float32)
    for b in range(first, last):
        x_base = X_ptr + b * F * D
        s = _fm_products(x_base, y, F, D, rows, dcols, BLOCK_F, BLOCK_K, BLOCK_D, PRECISION)
        rstd = tl.load(Rstd_ptr + b)
        xhat = tl.where(valid, (s - tl.load(Mean_ptr + b)) * rstd, 0.0)
        g = tl.load(G_ptr + b * n + e, mask=valid, other=0.0).to(tl.float32)
        dw += g * xhat
        gh = g * w
        c1 = tl.sum(tl.sum(gh, 1), 0) / n
        c2 = tl.sum(tl.sum(gh * xhat, 1), 0) / n
        ds = tl.where(valid, rstd * (gh - c1 - xhat * c2), 0.0)  # grad of S [BLOCK_F, BLOCK_K]
        for d0 in range(0, D, BLOCK_D):
            mask = (rows[:, None] < F) & (d0 + dcols[None, :] < D)
            offs = rows[:, None] * D + d0 + dcols[None, :]
            x = tl.load(x_base + offs, mask=mask, other=0.0).to(tl.float32)
            xt = tl.trans(x)
            a = tl.dot(xt, y, input_precision=PRECISION)    # A_c = X_c^T Y       [BLOCK_D, BLOCK_K]
            da = tl.dot(xt, ds, input_precision=PRECISION)  # grad A_c = X_c^T dS [BLOCK_D, BLOCK_K]
            dx = (tl.dot(ds, tl.trans(a), input_precision=PRECISION)
                  + tl.dot(y, tl.trans(da), input_precision=PRECISION))
            tl.store(DX_ptr + b * F * D + offs, dx.to(DX_ptr.dtype.element_ty), mask=mask)
            dy += tl.dot(x, da, input_precision=PRECISION)
    tl.store(DYp_ptr + pid * n + e, dy, mask=valid)
    tl.store(DWp_ptr + pid * n + e, dw, mask=valid)


def _fm_blocks(F: int, D: int, k: int, dtype: torch.dtype) -> dict:
    block_f = _pow2(F)
    return dict(BLOCK_F=block_f, BLOCK_K=_pow2(k), BLOCK_D=_block_d(D, block_f, FM_TILE_ELEMS),
                PRECISION=_dot_precision(dtype), num_warps=_num_warps(block_f))


def fm_compress(x, y, ln_weight, ln_bias, eps, save_products):
    """`products` is always empty [0, k*D + F*k]: these memory-bound kernels recompute X^T Y and S in
    the backward rather than write and read them back (see ops.interaction.SAVES_PRODUCTS)."""
    B, F, D = x.shape
    k = y.shape[1]
    out = x.new_empty((B, F * k))
    mean = x.new_empty((B,), dtype=torch.float32)
    rstd = x.new_empty((B,), dtype=torch.float32)
    if B:
        _fm_compress_fwd_kernel[(B,)](x, y, ln_weight, ln_bias, out, mean, rstd, F, D, k, eps,
                                      **_fm_blocks(F, D, k, x.dtype))
    return out, mean, rstd, x.new_empty((0, k * (D + F)), dtype=torch.float32)


def fm_compress_backward(grad_out, x, y, ln_weight, mean, rstd, products):
    B, F, D = x.shape
    k = y.shape[1]
    dt = x.dtype
    grad_x = torch.empty_like(x)
    if B == 0:
        return grad_x, torch.zeros_like(y), torch.zeros_like(ln_weight), torch.zeros_like(ln_weight)
    # Each program owns samples_per_program consecutive samples (the last one fewer) and writes one
    # fp32 partial of grad_Y and grad_W; the split depends on B only, so the sums are deterministic.
    samples_per_program = triton.cdiv(B, min(B, FM_BWD_MAX_PROGRAMS))
    programs = triton.cdiv(B, samples_per_program)
    partial_y = x.new_empty((programs, F, k), dtype=torch.float32)
    partial_w = x.new_empty((programs, F * k), dtype=torch.float32)
    _fm_compress_bwd_kernel[(programs,)](grad_out, x, y, ln_weight, mean, rstd, grad_x, partial_y, partial_w,
                                         B, F, D, k, samples_per_program, **_fm_blocks(F, D, k, x.dtype))
    grad_b = grad_out.sum(0, dtype=torch.float32)  # fp32 accumulation without an fp32 copy of grad_out
    return grad_x, partial_y.sum(0).to(dt), partial_w.sum(0).to(dt), grad_b.to(dt)


# ---------------------------------------------------------------------------------------------
# feature_mix_norm
# ---------------------------------------------------------------------------------------------

# Bound on a program's [BLOCK_O, BLOCK_D] fp32 tile: BLOCK_O shrinks as D grows (down to tl.dot's 16).
MIX_TILE_ELEMS = 4096
MIX_BLOCK_F = 16


@triton.jit
def _mix_tile(X_ptr, M_ptr, FM_ptr, b, rows, cols, F, D, O, Ofm, BLOCK_O: tl.constexpr, BLOCK_F: tl.constexpr,
              BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """S [BLOCK_O, BLOCK_D] fp32 = M[rows] X_b, plus fm_b on rows < O_fm (zero outside O x D)."""
    fo = tl.arange(0, BLOCK_F)
    acc = tl.zeros((BLOCK_O, BLOCK_D), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        fs = f0 + fo
        m = tl.load(M_ptr + rows[:, None] * F + fs[None, :], mask=(rows[:, None] < O) & (fs[None, :] < F),
                    other=0.0).to(tl.float32)
        x = tl.load(X_ptr + b * F * D + fs[:, None] * D + cols[None, :], mask=(fs[:, None] < F) & (cols[None, :] < D),
                    other=0.0).to(tl.float32)
        acc += tl.dot(m, x, input_precision=PRECISION)
    fm_mask = (rows[:, None] < Ofm) & (cols[None, :] < D)
    acc += tl.load(FM_ptr + (b * Ofm + rows[:, None]) * D + cols[None, :], mask=fm_mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _feature_mix_norm_fwd_kernel(X_ptr, M_ptr, FM_ptr, W_ptr, Bias_ptr, Out_ptr, Mean_ptr, Rstd_ptr, F, D, O, Ofm,
                                 row_blocks, eps, BLOCK_O: tl.constexpr, BLOCK_F: tl.constexpr,
                                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // row_blocks).to(tl.int64)
    rows = (pid % row_blocks) * BLOCK_O + tl.arange(0, BLOCK_O)
    cols = tl.arange(0, BLOCK_D)
    s = _mix_tile(X_ptr, M_ptr, FM_ptr, b, rows, cols, F, D, O, Ofm, BLOCK_O, BLOCK_F, BLOCK_D, PRECISION)
    valid = (rows[:, None] < O) & (cols[None, :] < D)
    mean = tl.sum(tl.where(valid, s, 0.0), 1) / D
    centred = tl.where(valid, s - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, 1) / D + eps)
    w = tl.load(W_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    bias = tl.load(Bias_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    out = centred * rstd[:, None] * w[None, :] + bias[None, :]
    tl.store(Out_ptr + (b * O + rows[:, None]) * D + cols[None, :], out.to(Out_ptr.dtype.element_ty), mask=valid)
    tl.store(Mean_ptr + b * O + rows, mean, mask=rows < O)
    tl.store(Rstd_ptr + b * O + rows, rstd, mask=rows < O)


@triton.jit
def _feature_mix_norm_bwd_kernel(G_ptr, X_ptr, M_ptr, FM_ptr, W_ptr, Mean_ptr, Rstd_ptr, DS_ptr, DFM_ptr, Part_ptr,
                                 F, D, O, Ofm, row_blocks, BLOCK_O: tl.constexpr, BLOCK_F: tl.constexpr,
                                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // row_blocks).to(tl.int64)
    rows = (pid % row_blocks) * BLOCK_O + tl.arange(0, BLOCK_O)
    cols = tl.arange(0, BLOCK_D)
    s = _mix_tile(X_ptr, M_ptr, FM_ptr, b, rows, cols, F, D, O, Ofm, BLOCK_O, BLOCK_F, BLOCK_D, PRECISION)
    valid = (rows[:, None] < O) & (cols[None, :] < D)
    mean = tl.load(Mean_ptr + b * O + rows, mask=rows < O, other=0.0)
    rstd = tl.load(Rstd_ptr + b * O + rows, mask=rows < O, other=0.0)
    xhat = tl.where(valid, (s - mean[:, None]) * rstd[:, None], 0.0)
    offs = (b * O + rows[:, None]) * D + cols[None, :]
    g = tl.load(G_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    w = tl.load(W_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    gh = g * w[None, :]
    c1 = tl.sum(gh, 1) / D
    c2 = tl.sum(gh * xhat, 1) / D
    ds = tl.where(valid, rstd[:, None] * (gh - c1[:, None] - xhat * c2[:, None]), 0.0)
    tl.store(DS_ptr + offs, ds, mask=valid)
    fm_mask = (rows[:, None] < Ofm) & (cols[None, :] < D)
    tl.store(DFM_ptr + (b * Ofm + rows[:, None]) * D + cols[None, :], ds.to(DFM_ptr.dtype.element_ty), mask=fm_mask)
    part = Part_ptr + pid.to(tl.int64) * 2 * D + cols
    tl.store(part, tl.sum(g * xhat, 0), mask=cols < D)
    tl.store(part + D, tl.sum(g, 0), mask=cols < D)


def _mix_blocks(O: int, D: int, dtype: torch.dtype) -> dict:
    block_d = _pow2(D)
    block_o = max(16, min(_pow2(O), MIX_TILE_ELEMS // block_d))
    return dict(BLOCK_O=block_o, BLOCK_F=MIX_BLOCK_F, BLOCK_D=block_d, PRECISION=_dot_precision(dtype),
                num_warps=4 if block_o * block_d <= 2048 else 8)


def feature_mix_norm(x, mix, fm, ln_weight, ln_bias, eps):
    B, F, D = x.shape
    O, Ofm = mix.shape[0], fm.shape[1]
    out = x.new_empty((B, O, D))
    mean = x.new_empty((B, O), dtype=torch.float32)
    rstd = x.new_empty((B, O), dtype=torch.float32)
    if B:
        blocks = _mix_blocks(O, D, x.dtype)
        row_blocks = triton.cdiv(O, blocks["BLOCK_O"])
        _feature_mix_norm_fwd_kernel[(B * row_blocks,)](x, mix, fm, ln_weight, ln_bias, out, mean, rstd, F, D, O, Ofm,
                                                        row_blocks, eps, **blocks)
    return out, mean, rstd


def feature_mix_norm_backward(grad_out, x, mix, fm, ln_weight, mean, rstd):
    B, F, D = x.shape
    O, Ofm = mix.shape[0], fm.shape[1]
    dt = x.dtype
    grad_fm = torch.empty_like(fm)
    if B == 0:
        return (torch.empty_like(x), torch.zeros_like(mix), grad_fm, torch.zeros_like(ln_weight),
                torch.zeros_like(ln_weight))
    blocks = _mix_blocks(O, D, dt)
    row_blocks = triton.cdiv(O, blocks["BLOCK_O"])
    programs = B * row_blocks
    grad_s = x.new_empty((B, O, D), dtype=torch.float32)
    part = x.new_empty((programs, 2, D), dtype=torch.float32)
    _feature_mix_norm_bwd_kernel[(programs,)](grad_out, x, mix, fm, ln_weight, mean, rstd, grad_s, grad_fm, part,
                                              F, D, O, Ofm, row_blocks, **blocks)
    grad_x = torch.matmul(mix.float().t(), grad_s).to(dt)
    grad_mix = torch.einsum("bod,bfd->of", grad_s, x.float()).to(dt)
    return grad_x, grad_mix, grad_fm, part[:, 0].sum(0).to(dt), part[:, 1].sum(0).to(dt)

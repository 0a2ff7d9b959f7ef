"""Triton kernels of the jagged family: jagged <-> padded copies.

Work decomposition: a 2-D grid (B, position blocks). Program (b, j) owns padded positions
[j*BLOCK_L, (j+1)*BLOCK_L) of sequence b, then strides by the grid's position blocks (axis 1 stops
at MAX_POSITION_BLOCKS = 65535, CUDA's limit: ~1M positions at BLOCK_L = 16), and walks the feature
dim in BLOCK_D chunks; each output element is written by exactly one program. padded_to_jagged's
programs also cover the rows of sequences longer than max_len that way, to write their zero gradient.

Roofline: 0 FLOPs. Minimum bytes, jagged_to_padded: read sum_b min(L_b, max_len)*D*s, write
B*max_len*D*s. padded_to_jagged: read sum_b min(L_b, max_len)*D*s, write N*D*s.
"""

import torch
import triton
import triton.language as tl

# 16 rows x 128 features: an 8 KiB fp32 tile per program, enough bytes in flight per SM while
# keeping the grid large for short sequences.
BLOCK_L = 16
MAX_BLOCK_D = 128
# CUDA's limit on grid axes 1 and 2; the kernels grid-stride past it. Tests lower it.
MAX_POSITION_BLOCKS = 65535


@triton.jit
def _jagged_to_padded_fwd_kernel(
    values_ptr, offsets_ptr, out_ptr,
    max_len, D, pad_value,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + b).to(tl.int64)
    length = tl.minimum(tl.load(offsets_ptr + b + 1).to(tl.int64) - start, max_len)
    step = tl.num_programs(1) * BLOCK_L
    for p0 in range(tl.program_id(1) * BLOCK_L, max_len, step):
        pos = p0 + tl.arange(0, BLOCK_L)
        row_out = pos < max_len
        row_in = pos < length
        src_rows = values_ptr + (start + pos)[:, None] * D
        dst_rows = out_ptr + (b * max_len + pos)[:, None] * D
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            col = d[None, :] < D
            x = tl.load(src_rows + d[None, :], mask=row_in[:, None] & col, other=0.0)
            # In fp32: exact for every I/O dtype, and the interpreter cannot make a bf16 scalar.
            x = tl.where(row_in[:, None], x.to(tl.float32), pad_value)
            tl.store(dst_rows + d[None, :], x.to(out_ptr.dtype.element_ty), mask=row_out[:, None] & col)


@triton.jit
def _padded_to_jagged_fwd_kernel(
    padded_ptr, offsets_ptr, out_ptr,
    max_len, D,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + b).to(tl.int64)
    full = tl.load(offsets_ptr + b + 1).to(tl.int64) - start
    step = tl.num_programs(1) * BLOCK_L
    for p0 in range(tl.program_id(1) * BLOCK_L, full, step):
        pos = p0 + tl.arange(0, BLOCK_L)
        row_out = pos < full
        row_in = pos < tl.minimum(full, max_len)
        src_rows = padded_ptr + (b * max_len + pos)[:, None] * D
        dst_rows = out_ptr + (start + pos)[:, None] * D
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            col = d[None, :] < D
            x = tl.load(src_rows + d[None, :], mask=row_in[:, None] & col, other=0.0)
            tl.store(dst_rows + d[None, :], x, mask=row_out[:, None] & col)


def _block_d(D: int) -> int:
    return min(MAX_BLOCK_D, triton.next_power_of_2(max(D, 1)))


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int, pad_value: float) -> torch.Tensor:
    B, D = offsets.numel() - 1, values.shape[1]
    out = values.new_empty((B, max_len, D))
    if out.numel() == 0:
        return out
    grid = (B, min(triton.cdiv(max_len, BLOCK_L), MAX_POSITION_BLOCKS))
    _jagged_to_padded_fwd_kernel[grid](values, offsets, out, max_len, D, pad_value,
                                       BLOCK_L=BLOCK_L, BLOCK_D=_block_d(D))
    return out


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total_len: int) -> torch.Tensor:
    B, max_len, D = padded.shape
    out = padded.new_empty((total_len, D))
    if out.numel() == 0:
        return out
    # Enough position blocks to cover max_len (or the mean length when sequences run past it);
    # longer sequences are covered by the in-kernel grid-stride loop.
    rows = max(min(max_len, total_len), triton.cdiv(total_len, max(B, 1)), 1)
    grid = (B, min(triton.cdiv(rows, BLOCK_L), MAX_POSITION_BLOCKS))
    _padded_to_jagged_fwd_kernel[grid](padded, offsets, out, max_len, D,
                                       BLOCK_L=BLOCK_L, BLOCK_D=_block_d(D))
    return out

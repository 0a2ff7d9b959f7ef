"""Triton kernel of the quantized embedding bag (inference): FBGEMM IntNBit rows, dequantized and pooled in fp32.

Work decomposition: one program per (table, bag), as the float forward (triton/embedding_bag.py):
it walks the bag's indices and accumulates one BLOCK_D tile of fp32 covering the table's D, so every
output slice is written by one program; pooling "none" writes each looked-up row instead. A row is
read as bytes and decoded in registers by the table's type (a run-time branch, since one launch
holds tables of every type): int8/int4/int2 element j is bits [(j*n) % 8, +n) of byte 4 + j*n/8
times the row's fp16 scale plus its fp16 bias; fp16/fp32 values are assembled from their 2/4 bytes
and bitcast; fp8 (HFP8) moves its 7 magnitude bits into fp32's exponent and mantissa and scales by
2^(127 - bias). acc = (acc + w*bias) + (w*scale) * q, FBGEMM's order (the fma may be split in two roundings).

The caller (ops/quant_embedding_bag.py) checks offsets and bounds on the host first; the kernel
drops out-of-range indices. The fp32 result is cast to the output dtype on the host (one rounding).

Roofline: FLOPs 2 * N * D; bytes N * row_bytes + B * sum D * 4 + indices. Run here in the
interpreter only (TRITON_INTERPRET=1): not run on a GPU.
"""

import torch
import triton
import triton.language as tl

from .._embedding_bag import MEAN, NONE

POOL_MEAN: tl.constexpr = tl.constexpr(MEAN)
POOL_NONE: tl.constexpr = tl.constexpr(NONE)
TY_FP32: tl.constexpr = tl.constexpr(0)
TY_FP16: tl.constexpr = tl.constexpr(1)
TY_FP8: tl.constexpr = tl.constexpr(6)


@triton.jit
def _load_row(row_ptr, ty, d, col, w, fp8_shift, fp8_multiplier):
    """w * the dequantized row's elements d (masked by col), as (w*scale * q, w*bias) or (w * value, 0)."""
    if ty == TY_FP32:
        b0 = tl.load(row_ptr + 4 * d, mask=col, other=0).to(tl.uint32)
        b1 = tl.load(row_ptr + 4 * d + 1, mask=col, other=0).to(tl.uint32)
        b2 = tl.load(row_ptr + 4 * d + 2, mask=col, other=0).to(tl.uint32)
        b3 = tl.load(row_ptr + 4 * d + 3, mask=col, other=0).to(tl.uint32)
        x = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
        return w * x, 0.0
    elif ty == TY_FP16:
        lo = tl.load(row_ptr + 2 * d, mask=col, other=0).to(tl.uint16)
        hi = tl.load(row_ptr + 2 * d + 1, mask=col, other=0).to(tl.uint16)
        x = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        return w * x, 0.0
    elif ty == TY_FP8:
        q = tl.load(row_ptr + d, mask=col, other=0).to(tl.uint32)
        magnitude = ((q & 0x7F) << fp8_shift).to(tl.float32, bitcast=True) * fp8_multiplier
        x = tl.where((q & 0x80) != 0, -magnitude, magnitude)
        return w * x, 0.0
    else:
        bits = tl.where(ty == 2, 8, tl.where(ty == 3, 4, 2))
        s = (tl.load(row_ptr).to(tl.uint16) | (tl.load(row_ptr + 1).to(tl.uint16) << 8)).to(tl.float16, bitcast=True)
        b = (tl.load(row_ptr + 2).to(tl.uint16) | (tl.load(row_ptr + 3).to(tl.uint16) << 8)).to(tl.float16,
                                                                                            bitcast=True)
        bit = d * bits
        byte = tl.load(row_ptr + 4 + bit // 8, mask=col, other=0).to(tl.int32)
        q = ((byte >> (bit % 8)) & ((1 << bits) - 1)).to(tl.float32)
        return (w * s.to(tl.float32)) * q, w * b.to(tl.float32)


@triton.jit
def _quant_embedding_bag_fwd_kernel(
    weights_ptr, w_off_ptr, d_off_ptr, r_off_ptr, tys_ptr, stride_ptr, indices_ptr, offsets_ptr, psw_ptr, out_ptr,
    B, output_dim, fp8_shift, fp8_multiplier,
    POOLING: tl.constexpr, HAS_PSW: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of 2 of the widest table's D: one tile holds a whole row
):
    tb = tl.program_id(0).to(tl.int64)
    t = tb // B
    b = tb - t * B
    d_begin = tl.load(d_off_ptr + t)
    D = tl.load(d_off_ptr + t + 1) - d_begin
    rows = tl.load(r_off_ptr + t + 1) - tl.load(r_off_ptr + t)
    table_ptr = weights_ptr + tl.load(w_off_ptr + t)
    ty = tl.load(tys_ptr + t)
    row_stride = tl.load(stride_ptr + t)
    start = tl.load(offsets_ptr + tb).to(tl.int64)
    stop = tl.load(offsets_ptr + tb + 1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    col = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    kept = 0
    for p in range(start, stop):
        idx = tl.load(indices_ptr + p).to(tl.int64)
        if (idx >= 0) & (idx < rows):
            w = tl.load(psw_ptr + p) if HAS_PSW else 1.0
            scaled, bias = _load_row(table_ptr + idx * row_stride, ty, d, col, w, fp8_shift, fp8_multiplier)
            if POOLING == POOL_NONE:
                tl.store(out_ptr + p * output_dim + d, bias + scaled, mask=col)
            else:
                acc = (acc + bias) + scaled
                kept += 1
    if POOLING != POOL_NONE:
        if POOLING == POOL_MEAN:
            acc = acc * (1.0 / tl.maximum(kept, 1).to(tl.float32))
        tl.store(out_ptr + b * output_dim + d_begin + d, acc, mask=col)


def quant_embedding_bag_forward(weights, weights_offsets, D_offsets, rows_offsets, weights_tys, row_bytes, indices,
                                offsets, per_sample_weights, output_dim, pooling, bounds_check, output_dtype,
                                fp8_exponent_bits, fp8_exponent_bias):
    num_tables = weights_offsets.numel()
    batch = (offsets.numel() - 1) // num_tables
    rows_out = indices.numel() if pooling == NONE else batch
    out = torch.zeros((rows_out, output_dim), dtype=torch.float32, device=weights.device)  # zeros: dropped rows
    if num_tables * batch == 0 or out.numel() == 0:
        return out.to(output_dtype)
    has_psw = per_sample_weights.numel() > 0
    block_d = triton.next_power_of_2(max(int(D_offsets.diff().max()), 1))
    _quant_embedding_bag_fwd_kernel[(num_tables * batch,)](
        weights, weights_offsets, D_offsets, rows_offsets, weights_tys, row_bytes, indices, offsets,
        per_sample_weights if has_psw else out, out, batch, output_dim, 16 + fp8_exponent_bits,
        2.0 ** (127 - fp8_exponent_bias), POOLING=pooling, HAS_PSW=has_psw, BLOCK_D=block_d)
    return out.to(output_dtype)

"""Plain-PyTorch twin of the quantized embedding bag: dequantize the looked-up rows, then pool in fp32.

Ground truth for the tests and the bench; the row format and the dequantization are those of
``gem_kernels.ops.quant_embedding_bag`` (FBGEMM's IntNBit rows).
"""

from __future__ import annotations

import torch

from .._embedding_bag import MEAN, NONE, SKIP, kept_mask
from ..ops.quant_embedding_bag import dequantize_rows


def quant_embedding_bag_forward(weights, weights_offsets, D_offsets, rows_offsets, weights_tys, row_bytes, indices,
                                offsets, per_sample_weights, output_dim, pooling, bounds_check, output_dtype,
                                fp8_exponent_bits, fp8_exponent_bias):
    num_tables = weights_offsets.numel()
    num_bags = offsets.numel() - 1
    batch = num_bags // num_tables
    kept, bag_ids = kept_mask(rows_offsets, indices, offsets, SKIP)  # the op checked the bounds mode already
    w_off, d_off, r_off, tys, strides = (m.tolist() for m in (weights_offsets, D_offsets, rows_offsets, weights_tys,
                                                               row_bytes))
    n = indices.numel()
    rows_out = n if pooling == NONE else batch
    out = torch.zeros(rows_out, output_dim, dtype=torch.float32, device=weights.device)
    scale = per_sample_weights.float() if per_sample_weights.numel() else torch.ones(n, device=weights.device)
    offsets = offsets.long()
    for t in range(num_tables):
        begin, end = int(offsets[t * batch]), int(offsets[(t + 1) * batch])
        keep = kept[begin:end]
        positions = torch.arange(begin, end, device=weights.device)[keep]
        dim, rows = d_off[t + 1] - d_off[t], r_off[t + 1] - r_off[t]
        table = weights[w_off[t]:w_off[t] + rows * strides[t]].view(rows, strides[t])
        values = dequantize_rows(table[indices[positions].long()], dim, tys[t], fp8_exponent_bits, fp8_exponent_bias)
        values = values * scale[positions, None]
        cols = slice(0, dim) if pooling == NONE else slice(d_off[t], d_off[t + 1])
        target = positions if pooling == NONE else bag_ids[positions] - t * batch
        out[:, cols].index_add_(0, target, values)
    if pooling == MEAN and batch:
        counts = torch.zeros(num_bags, device=weights.device).index_add_(0, bag_ids, kept.float()).view(num_tables,
                                                                                                      batch)
        inv = 1.0 / counts.clamp(min=1)
        widths = torch.tensor([d_off[t + 1] - d_off[t] for t in range(num_tables)], device=weights.device)
        out *= inv.t().repeat_interleave(widths, dim=1, output_size=output_dim)
    return out.to(output_dtype)

"""Analytic FLOPs and minimum bytes of every op: the two numbers of each kernel's roofline.

Minimum bytes count what any implementation must move between memory and the chip: each input
element read once, each output element written once, nothing for padding a kernel never touches.
The bench divides them by the measured time to report TFLOP/s and GB/s.
"""

from __future__ import annotations

import torch


def _lengths(offsets: torch.Tensor) -> torch.Tensor:
    return offsets.long().diff()


def jagged_to_padded(offsets: torch.Tensor, max_len: int, dim: int, elem_bytes: int) -> tuple[int, int]:
    """(flops, bytes): read sum_b min(L_b, max_len) rows, write B*max_len rows, plus the offsets."""
    kept = int(_lengths(offsets).clamp(max=max_len).sum())
    num_seqs = offsets.numel() - 1
    return 0, (kept + num_seqs * max_len) * dim * elem_bytes + offsets.numel() * offsets.element_size()


def padded_to_jagged(offsets: torch.Tensor, max_len: int, dim: int, elem_bytes: int) -> tuple[int, int]:
    """(flops, bytes): read sum_b min(L_b, max_len) padded rows, write all N jagged rows, plus the offsets."""
    lengths = _lengths(offsets)
    kept = int(lengths.clamp(max=max_len).sum())
    total = int(lengths.sum())
    return 0, (kept + total) * dim * elem_bytes + offsets.numel() * offsets.element_size()


def embedding_bag(lookups: list[int], dims: list[int], batch: int, elem_bytes: int, index_bytes: int) -> tuple[int, int]:
    """(flops, bytes) of a pooled multi-table lookup, FBGEMM's minimum bytes: every looked-up row read
    once, the [B, sum D] output written once, plus the indices and offsets. lookups[t]: indices of table t."""
    rows_read = sum(n * d for n, d in zip(lookups, dims))
    indices = sum(lookups) * index_bytes + (len(dims) * batch + 1) * index_bytes
    return 2 * rows_read, (rows_read + batch * sum(dims)) * elem_bytes + indices


def embedding_bag_backward_rowwise_adagrad(lookups: list[int], unique_rows: list[int], dims: list[int], batch: int,
                                           elem_bytes: int, index_bytes: int) -> tuple[int, int]:
    """(flops, bytes) of the backward with the row-wise Adagrad update fused: grad_output [B, sum D] read
    once, every unique row read and written once with its fp32 state, plus the indices and offsets.
    FLOPs: 2 per looked-up element (the duplicate sums) + 6 per updated element (g^2, mean, scale, update)."""
    updated = sum(u * d for u, d in zip(unique_rows, dims))
    indices = sum(lookups) * index_bytes + (len(dims) * batch + 1) * index_bytes
    grad_read = batch * sum(dims) * elem_bytes
    flops_ = 2 * sum(n * d for n, d in zip(lookups, dims)) + 6 * updated
    return flops_, grad_read + 2 * updated * elem_bytes + 2 * sum(unique_rows) * 4 + indices

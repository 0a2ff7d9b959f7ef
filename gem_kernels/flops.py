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

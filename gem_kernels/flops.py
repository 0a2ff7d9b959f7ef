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


def jagged_attention(offsets: torch.Tensor, num_heads: int, dim_qk: int, dim_v: int, elem_bytes: int, *,
                     causal: bool = True, backward: bool = False) -> tuple[int, int]:
    """(flops, bytes) of jagged attention over the real (unpadded) sequences.

    FLOPs (FlashAttention's convention): the two products Q K^T and P V cost 2 * sum_b L_b^2 * H *
    (Dqk + Dv) = 4 * sum L^2 * H * D when Dqk = Dv = D, halved when causal (only the visible half
    is work); the backward costs 2.5x the forward. backward=True gives forward + backward.
    Bytes: q, k, v read and out written once (N * H * (2 * Dqk + 2 * Dv)); the backward adds reading
    q, k, v, out, dout and writing dq, dk, dv.
    """
    lengths = _lengths(offsets)
    total = int(lengths.sum())
    pairs = int((lengths * lengths).sum())
    flops = 2 * pairs * num_heads * (dim_qk + dim_v)
    if causal:
        flops //= 2
    nbytes = total * num_heads * (2 * dim_qk + 2 * dim_v) * elem_bytes
    if backward:
        flops = int(flops * 3.5)
        nbytes += total * num_heads * (4 * dim_qk + 4 * dim_v) * elem_bytes
    return flops, nbytes

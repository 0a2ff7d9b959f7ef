"""generative-recommenders' relative attention bias of the research HSTU, as a formula.

`RelativeBucketedTimeAndPositionBasedBias` (generative_recommenders/research/modeling/sequential/hstu.py,
meta-recsys/generative-recommenders) turns padded timestamps [B, N] (N = its max_seq_len, the padded
length) into a bias [B, N, N] that is added to q k^T before the HSTU (or softmax) weights:

    bias[b, i, j] = pos_w[j - i + N - 1] + ts_w[clamp(bucketize(next_ts[b, i] - ts[b, j]), 0, num_buckets)]
    next_ts[b, i] = ts[b, i + 1] for i < N - 1, and ts[b, N - 1] for the last column
    bucketize(dt) = long(ln(max(|dt|, 1)) / 0.301), in fp32 (torch.log of an int64 tensor)

The position part is its pad-repeat-reshape of pos_w, written out: row i of the (N, 3N-2) view is the
periodic sequence [pos_w, 0 * N] read from offset i * (3N-2) = i * (3N-1) - i, and column c + (N-1) of
it holds pos_w[c - i + N - 1]. "next" is a padded neighbour: for a sequence shorter than N its last
item's next timestamp is the padding (0 in GR's batches), not its own.

Written independently from that module's formula, so that `gem_kernels.jagged_attention`'s
`query_timestamps` can be tested against it (tests/test_attention.py).
"""

from __future__ import annotations

import torch


def gr_bucketize(dt: torch.Tensor) -> torch.Tensor:
    """generative-recommenders' default bucketization_fn: (ln(max(|dt|, 1)) / 0.301).long(), in fp32."""
    return (torch.log(dt.abs().clamp(min=1).float()) / 0.301).long()


def next_timestamps(timestamps: torch.Tensor) -> torch.Tensor:
    """[B, N] -> the padded next timestamp of every column; the last column repeats its own."""
    return torch.cat([timestamps[:, 1:], timestamps[:, -1:]], dim=1)


def relative_bucketed_time_and_position_bias(timestamps: torch.Tensor, pos_w: torch.Tensor, ts_w: torch.Tensor,
                                             bucketize=gr_bucketize) -> torch.Tensor:
    """bias [B, N, N] from padded timestamps [B, N], pos_w [2N-1] and ts_w [num_buckets+1] (see the module doc)."""
    num_rows = timestamps.shape[1]
    if pos_w.shape != (2 * num_rows - 1,):
        raise ValueError(f"pos_w must have 2N-1 = {2 * num_rows - 1} entries, got shape {tuple(pos_w.shape)}")
    num_buckets = ts_w.shape[0] - 1
    dt = next_timestamps(timestamps).unsqueeze(2) - timestamps.unsqueeze(1)  # [B, N(query), N(key)]
    buckets = bucketize(dt).clamp(min=0, max=num_buckets)
    pos = torch.arange(num_rows, device=timestamps.device)
    rel = pos.view(1, -1) - pos.view(-1, 1) + num_rows - 1  # [i, j] -> j - i + N - 1
    return pos_w[rel].unsqueeze(0) + ts_w[buckets]


def padded_attention_with_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                               lengths: torch.Tensor, kind: str) -> torch.Tensor:
    """GR's padded attention with that bias: q, k [B, N, H, D], v [B, N, H, Dv], bias [B, N, N], causal.

    hstu: out_i = sum_{j <= i} silu(<q_i, k_j> + bias_ij) / N * v_j (no 1/sqrt(D): GR's HSTU has none);
    softmax: the same scores, softmax over j <= i. Rows past a sequence's length are garbage to drop."""
    num_rows = q.shape[1]
    scores = torch.einsum("bihd,bjhd->bhij", q.float(), k.float()) + bias.float().unsqueeze(1)
    causal = torch.ones(num_rows, num_rows, dtype=torch.bool, device=q.device).tril()
    in_seq = torch.arange(num_rows, device=q.device).view(1, -1) < lengths.view(-1, 1)
    valid = (causal.unsqueeze(0) & in_seq.unsqueeze(1)).unsqueeze(1)  # [B, 1, N(query), N(key)]
    if kind == "hstu":
        weights = torch.where(valid, torch.nn.functional.silu(scores) / num_rows, 0.0)
    else:
        weights = torch.softmax(torch.where(valid, scores, float("-inf")), dim=-1)
        weights = torch.where(valid, weights, 0.0)
    return torch.einsum("bhij,bjhd->bihd", weights, v.float())

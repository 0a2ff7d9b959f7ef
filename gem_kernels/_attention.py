"""Host-side facts of the attention family, one home for every backend (the twin of _embedding_bag.py).

The log-time bias buckets follow generative-recommenders:
    bucket(dt) = min(num_buckets, floor(ln(max(|dt|, 1)) / TIME_BUCKET_DIVISOR))
The C++/CUDA kernels keep the same divisor in csrc/include/gem_kernels/attention.h (kTimeBucketDivisor);
tests/test_attention.py::test_time_buckets_over_a_wide_range checks every backend against
time_buckets over a range that reaches the clamp.
"""
from __future__ import annotations

import torch

# generative-recommenders' log-time bucketing divisor.
TIME_BUCKET_DIVISOR = 0.301


def time_buckets(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """bucket(dt) = min(num_buckets, floor(ln(max(|dt|, 1)) / 0.301)), computed in fp64."""
    x = dt.abs().clamp(min=1).double()
    return (torch.log(x) / TIME_BUCKET_DIVISOR).floor().clamp(max=num_buckets).long()


def bucket_thresholds(num_buckets: int, device) -> torch.Tensor:
    """thr[m-1] = the smallest |dt| whose bucket is >= m (m = 1..num_buckets), int64 on `device`.

    Kernels that compare |dt| with integer thresholds (Triton) give exactly time_buckets' answer: each
    threshold is searched around exp(divisor * m) with time_buckets itself, so fp rounding of the log
    cannot move a boundary.
    """
    thresholds = []
    for m in range(1, num_buckets + 1):
        guess = min(int(torch.tensor(TIME_BUCKET_DIVISOR * m, dtype=torch.float64).exp()), 2**62)
        x = torch.arange(max(1, guess - 2), guess + 4, dtype=torch.int64)
        hits = x[time_buckets(x, num_buckets) >= m]
        thresholds.append(int(hits[0]) if hits.numel() else 2**62)
    return torch.tensor(thresholds or [0], dtype=torch.int64, device=device)

"""Plain PyTorch twins of every op: the ground truth that tests and the bench compare against."""

import contextlib

import torch


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the twins' compute dtype: fp32 for fp32/fp16/bf16 inputs (the kernels' accumulation
    dtype), fp64 kept as fp64. The fp64 run of a twin is the ground truth of the FlashAttention-rule
    checks (bench/harness.py, tests): an fp64 input computed in fp32 would carry fp32 rounding."""
    return t if t.dtype == torch.float64 else t.float()


@contextlib.contextmanager
def float64_ground_truth():
    """Let the ops take float64 inputs on the reference backend while inside (elsewhere float64 is
    refused, as a dtype no kernel computes): the float64 run of the eager side that the bench's
    FlashAttention rule (bench/harness.py) measures every impl's error against."""
    from .._validate import FLOAT64_GROUND_TRUTH

    token = FLOAT64_GROUND_TRUTH.set(True)
    try:
        yield
    finally:
        FLOAT64_GROUND_TRUTH.reset(token)

"""Argument checks shared by every op family. Each raises ValueError naming the argument and the bad value."""

from __future__ import annotations

import contextvars
import math

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Inside gem_kernels.reference.float64_ground_truth() (the bench's and the tests' accuracy checks),
# the ops also take float64, which only the reference backend computes (check_float64_on_reference).
FLOAT64_GROUND_TRUTH = contextvars.ContextVar("gem_kernels_float64_ground_truth", default=False)


def float_dtypes() -> tuple:
    """The float dtypes the ops take here: FLOAT_DTYPES, and float64 inside float64_ground_truth()."""
    return FLOAT_DTYPES + (torch.float64,) if FLOAT64_GROUND_TRUTH.get() else FLOAT_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t, *, dtypes=None, dims=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if dims is not None and t.dim() not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dims, got shape {tuple(t.shape)}")


def check_float64_on_reference(backend: str, **tensors) -> None:
    """float64 (inside float64_ground_truth()) runs on the reference backend only: it is the ground
    truth that the bench's FlashAttention rule measures every backend's error against; no kernel is
    built for it."""
    for name, t in tensors.items():
        if t is not None and t.dtype == torch.float64 and backend != "reference":
            raise ValueError(f"{name} is float64, which only the reference backend computes (the ground truth "
                             f"of the accuracy checks), got backend {backend!r}; use "
                             f"{[str(d) for d in FLOAT_DTYPES]} on the other backends")


def per_sample_weights_arg(per_sample_weights, indices: torch.Tensor, device) -> torch.Tensor:
    """per_sample_weights as the embedding-bag ops take them: fp32 [len(indices)], or an empty fp32
    tensor on `device` for None."""
    if per_sample_weights is None:
        return torch.empty(0, dtype=torch.float32, device=device)
    check_tensor("per_sample_weights", per_sample_weights, dtypes=FLOAT_DTYPES + (torch.float64,), dims=(1,))
    if per_sample_weights.shape[0] != indices.shape[0]:
        raise ValueError(f"per_sample_weights must have indices' length {indices.shape[0]}, got "
                         f"{per_sample_weights.shape[0]}")
    return per_sample_weights.float()


def check_same_device(**tensors: torch.Tensor) -> None:
    (first_name, first), *rest = tensors.items()
    for name, t in rest:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; they must match")


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_int64(name: str, value) -> None:
    """A Python int outside int64 would reach a torch.library schema's `int` and fail there with
    "Expected a value of type 'int' ... found type 'int'": name it here instead."""
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} is out of range: it must fit in int64 ([-2**63, 2**63 - 1]), got {value}")


def check_nonnegative_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    check_int64(name, value)
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_pad_value(name: str, value, dtype: torch.dtype) -> None:
    """A float that `dtype` can hold: finite values within its range (torch's own rule for filling a
    tensor with a Python scalar), or +-inf / NaN, which every float dtype has."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float, got {type(value).__name__}")
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond float64's range
        raise ValueError(f"{name} is out of range for {dtype}, got {value}") from None
    info = torch.finfo(dtype)
    if math.isfinite(as_float) and not info.min <= as_float <= info.max:
        raise ValueError(f"{name} is out of range for {dtype} (finite values in [{info.min}, {info.max}]), "
                         f"got {value}")


def check_offsets_meta(name: str, offsets) -> None:
    """Shape/dtype of an offsets tensor: 1-D int32/int64 with at least one element."""
    check_tensor(name, offsets, dtypes=INDEX_DTYPES, dims=(1,))
    if offsets.numel() < 1:
        raise ValueError(f"{name} must have at least one element (offsets[0] == 0), got shape {tuple(offsets.shape)}")


def offsets_summary(offsets: torch.Tensor) -> torch.Tensor:
    """[offsets[0], number of decreasing steps, offsets[-1]] as one int64 tensor on offsets' device
    (computed there, not read): what check_offsets_values needs, for one device-to-host copy."""
    o = offsets.long()
    return torch.stack([o[0], (o[1:] < o[:-1]).sum(), o[-1]])


def check_offsets_values(name: str, offsets: torch.Tensor, total: int | None,
                         summary: list[int] | None = None) -> None:
    """Data checks: offsets[0] == 0, nondecreasing, offsets[-1] == total (when given).

    Reads the tensor once (one device sync on GPU; more only to word an error): called inside the
    ops' real kernels only, never while tracing, so torch.compile sees no data-dependent branch.
    `summary`: offsets_summary(offsets) already read by the caller (read together with its own
    values, so that the whole check costs one sync).
    """
    first, decreasing, last = offsets_summary(offsets).tolist() if summary is None else summary
    if first != 0:
        raise ValueError(f"{name}[0] must be 0, got {first}")
    if decreasing:
        i = int((offsets[1:] < offsets[:-1]).nonzero()[0, 0])
        raise ValueError(
            f"{name} must be nondecreasing, but {name}[{i + 1}] = {int(offsets[i + 1])} < {name}[{i}] = {int(offsets[i])}"
        )
    if total is not None and last != total:
        raise ValueError(f"{name}[-1] must equal the number of rows {total}, got {last}")

"""CUDA kernels, in plain PyTorch, for the FBGEMM index ops that TorchRec's KeyedJaggedTensor and
input distribution call, for a machine whose FBGEMM is the CPU build (the GPU machine: the CUDA
fbgemm-gpu wheel for its torch is 465 MB, the carry limit 64 MiB; docs/gpu.md).

``register()`` adds a CUDA kernel for each op below that exists (``import fbgemm_gpu`` defined it)
and has none yet, so a real CUDA FBGEMM is never overridden. The functions are device-agnostic:
tests/test_gpu_check.py compares each with FBGEMM's own CPU kernel on CPU tensors. They are index
bookkeeping (no autograd); the embedding and pooling math of the model runs in gem_kernels' kernels.
Loaded by scripts/gpu_site/sitecustomize.py, i.e. only where scripts/gpu_check.sh puts that folder
on PYTHONPATH (its TorchRec steps).
"""

from __future__ import annotations

import torch


def _cumsum(t: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t, dim=-1).to(t.dtype)  # torch.cumsum widens int32 to int64; FBGEMM keeps it


def asynchronous_inclusive_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    return _cumsum(t_in)


def asynchronous_exclusive_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    return _cumsum(t_in) - t_in


def asynchronous_complete_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((*t_in.shape[:-1], 1), dtype=t_in.dtype, device=t_in.device)
    return torch.cat([zero, _cumsum(t_in)], dim=-1)


def _segment_arange(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """starts[i] + j for j < lengths[i], every segment in order (int64, ``total`` elements)."""
    lengths = lengths.to(torch.int64)
    out_starts = torch.cumsum(lengths, 0) - lengths
    shift = torch.repeat_interleave(starts.to(torch.int64) - out_starts, lengths, output_size=total)
    return torch.arange(total, device=starts.device) + shift


def offsets_range(offsets: torch.Tensor, range_size: int) -> torch.Tensor:
    ends = torch.cat([offsets[1:], offsets.new_tensor([range_size])])
    zeros = torch.zeros_like(offsets)
    return _segment_arange(zeros, ends - offsets, int(range_size)).to(offsets.dtype)


def segment_sum_csr(batch_size: int, csr_seg: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    bounds = csr_seg.to(torch.int64) * batch_size
    prefix = torch.cat([values.new_zeros(1), torch.cumsum(values, 0)])
    return (prefix[bounds[1:]] - prefix[bounds[:-1]]).to(values.dtype)


def invert_permute(permute: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permute)
    inverse[permute.long()] = torch.arange(permute.numel(), dtype=permute.dtype, device=permute.device)
    return inverse


def _permute_segments(permute, seg_lengths, values, weights, permuted_lengths_sum):
    """Segments of ``values`` (lengths ``seg_lengths``, 1D) reordered by ``permute``."""
    p = permute.long()
    seg_lengths64 = seg_lengths.to(torch.int64)
    starts = torch.cumsum(seg_lengths64, 0) - seg_lengths64
    out_lengths = seg_lengths64[p]
    total = int(permuted_lengths_sum) if permuted_lengths_sum is not None else int(out_lengths.sum())
    index = _segment_arange(starts[p], out_lengths, total)
    return values[index], (weights[index] if weights is not None else None)


def permute_2D_sparse_data(permute, lengths, values, weights=None, permuted_lengths_sum=None):
    permuted_lengths = lengths[permute.long()]
    out_values, out_weights = _permute_segments(permute, lengths.sum(dim=1), values, weights, permuted_lengths_sum)
    return permuted_lengths, out_values, out_weights


def permute_1D_sparse_data(permute, lengths, values, weights=None, permuted_lengths_sum=None):
    permuted_lengths = lengths[permute.long()]
    out_values, out_weights = _permute_segments(permute, lengths, values, weights, permuted_lengths_sum)
    return permuted_lengths, out_values, out_weights


def expand_into_jagged_permute(permute, input_offset, output_offset, output_size: int):
    lengths = output_offset[1:] - output_offset[:-1]
    return _segment_arange(input_offset[permute.long()], lengths, int(output_size)).to(permute.dtype)


OPS = {f.__name__: f for f in (
    asynchronous_inclusive_cumsum, asynchronous_exclusive_cumsum, asynchronous_complete_cumsum, offsets_range,
    segment_sum_csr, invert_permute, permute_2D_sparse_data, permute_1D_sparse_data, expand_into_jagged_permute,
)}
_LIBRARY = None


def register() -> list[str]:
    """Registers the CUDA kernels that are missing; returns the ops it registered."""
    global _LIBRARY
    import fbgemm_gpu  # noqa: F401  (defines torch.ops.fbgemm.*)

    missing = [name for name in OPS if hasattr(torch.ops.fbgemm, name)
               and not torch._C._dispatch_has_kernel_for_dispatch_key(f"fbgemm::{name}", "CUDA")]
    if missing and _LIBRARY is None:
        _LIBRARY = torch.library.Library("fbgemm", "IMPL")
    for name in missing:
        _LIBRARY.impl(name, OPS[name], "CUDA")
    return missing

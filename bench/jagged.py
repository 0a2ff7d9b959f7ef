"""Bench of the jagged family: jagged_to_padded and padded_to_jagged (each is the other's backward).

Workload (issue 2): B sequences with lognormal lengths of mean 100 capped at max_len = 512 (fixed
seed), D = 128; B = 2048 fp32 on CPU, B = 8192 bf16 and fp32 on GPU. Forward only for the two ops,
plus a small forward+backward case of each. Impls: every gem_kernels backend for the device, and the
baselines: a per-sequence torch loop ("eager-loop"), aten's _jagged_to_padded_dense_forward /
_padded_dense_to_jagged_forward ("aten", the speedup baseline) and fbgemm's jagged_to_padded_dense /
dense_to_jagged ("fbgemm", when fbgemm_gpu imports). Every impl is checked to equal the reference
backend exactly before it is timed (these are copies).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

import gem_kernels as gk
from gem_kernels import flops

from .harness import Case, rotate

MAX_LEN = 512
MEAN_LEN = 100
SIGMA = 1.0  # lognormal shape: about 2% of sequences reach the cap
SEED = 0


def lognormal_offsets(num_seqs: int, seed: int = SEED, mean: float = MEAN_LEN, max_len: int = MAX_LEN) -> torch.Tensor:
    """int64 offsets [B+1] of lengths ~ round(LogNormal(mu, SIGMA)) with E = mean, capped at max_len."""
    gen = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - SIGMA**2 / 2
    lengths = torch.exp(mu + SIGMA * torch.randn(num_seqs, generator=gen, dtype=torch.float64))
    lengths = lengths.round().clamp(0, max_len).long()
    offsets = torch.zeros(num_seqs + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    return offsets


def _backends(device: torch.device) -> list[str]:
    # On the CPU only cpu and reference: the Triton interpreter is a correctness tool, far too slow here.
    wanted = ("cuda", "triton", "reference") if device.type == "cuda" else ("cpu", "reference")
    available = gk.available_backends()
    return [b for b in wanted if b in available]


def _fbgemm_reason(device: torch.device) -> str | None:
    """None when fbgemm's jagged ops run on `device`, else why not."""
    try:
        import fbgemm_gpu  # noqa: F401
    except Exception as exc:
        return f"fbgemm omitted: fbgemm_gpu does not import ({type(exc).__name__}: {exc})"
    try:
        values = torch.ones(3, 2, device=device)
        offsets = torch.tensor([0, 1, 3], device=device)
        torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [2], 0.0)
        torch.ops.fbgemm.dense_to_jagged(torch.ones(2, 2, 2, device=device), [offsets], 3)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"fbgemm omitted: its jagged ops do not run on {device.type} here ({type(exc).__name__}: {first})"
    return None


# Eager baselines: what a user writes without a fused op, a Python loop over sequences (lengths
# read on the host beforehand so no per-sequence device sync is timed). The autograd versions use
# split/unbind + pad/cat, whose backward is one cat/stack; in-place slice writes or slices of the
# whole tensor would make autograd materialise a full-size gradient per sequence.


def _loop_jagged_to_padded(values: torch.Tensor, starts: list[int], kept: list[int], max_len: int) -> torch.Tensor:
    padded = values.new_zeros((len(starts), max_len, values.shape[1]))
    for b, (start, n) in enumerate(zip(starts, kept)):
        if n:
            padded[b, :n] = values[start:start + n]
    return padded


def _loop_jagged_to_padded_autograd(values: torch.Tensor, lengths: list[int], max_len: int) -> torch.Tensor:
    rows = [F.pad(seq[:max_len], (0, 0, 0, max_len - min(n, max_len))) for seq, n in zip(values.split(lengths), lengths)]
    return torch.stack(rows)


def _loop_padded_to_jagged(padded: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    # Lengths never exceed max_len in this workload, so nothing is truncated.
    return torch.cat([row[:n] for row, n in zip(padded.unbind(0), lengths)])


def _j2p_impls(device: torch.device, offsets: torch.Tensor, max_len: int, fbgemm_ok: bool,
               autograd: bool = False) -> dict[str, Callable]:
    """impl -> fn(values) -> padded."""
    host = offsets.cpu()
    starts = host[:-1].tolist()
    lengths = host.diff().tolist()
    kept = [min(n, max_len) for n in lengths]
    impls: dict[str, Callable] = {}
    for backend in _backends(device):
        impls[backend] = lambda v, b=backend: gk.jagged_to_padded(v, offsets, max_len, backend=b)
    if autograd:
        impls["eager-loop"] = lambda v: _loop_jagged_to_padded_autograd(v, lengths, max_len)
    else:
        impls["eager-loop"] = lambda v: _loop_jagged_to_padded(v, starts, kept, max_len)
    impls["aten"] = lambda v: torch.ops.aten._jagged_to_padded_dense_forward(v, [offsets], [max_len], 0.0)
    if fbgemm_ok:
        impls["fbgemm"] = lambda v: torch.ops.fbgemm.jagged_to_padded_dense(v, [offsets], [max_len], 0.0)
    return impls


def _p2j_impls(device: torch.device, offsets: torch.Tensor, total_len: int, fbgemm_ok: bool) -> dict[str, Callable]:
    """impl -> fn(padded) -> values."""
    lengths = offsets.cpu().diff().tolist()
    impls: dict[str, Callable] = {}
    for backend in _backends(device):
        impls[backend] = lambda p, b=backend: gk.padded_to_jagged(p, offsets, total_len, backend=b)
    impls["eager-loop"] = lambda p: _loop_padded_to_jagged(p, lengths)
    impls["aten"] = lambda p: torch.ops.aten._padded_dense_to_jagged_forward(p, [offsets], total_len)
    if fbgemm_ok:
        impls["fbgemm"] = lambda p: torch.ops.fbgemm.dense_to_jagged(p, [offsets], total_len)[0]
    return impls


def _fwd_bwd(forward: Callable, x: torch.Tensor, grad_out: torch.Tensor):
    """One forward + backward through autograd: returns (output, grad of x)."""
    out = forward(x)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    return out.detach(), grad


def _shape(offsets: torch.Tensor, max_len: int, dim: int) -> str:
    lengths = offsets.diff().float()
    return f"B={offsets.numel() - 1} L~{lengths.mean():.0f} max_len={max_len} D={dim}"


def cases(quick: bool, device: torch.device) -> Iterator[Case]:
    if device.type == "cuda":
        num_seqs, dim, dtypes = (1024, 128, (torch.bfloat16,)) if quick else (8192, 128, (torch.bfloat16, torch.float32))
        small_seqs, small_dim = (128, 64) if quick else (512, 128)
    else:
        num_seqs, dim, dtypes = (128, 64, (torch.float32,)) if quick else (2048, 128, (torch.float32,))
        small_seqs, small_dim = (32, 32) if quick else (256, 64)
    # Input sets rotated per impl: 2 for the large inputs (each far larger than any cache), 3 for the small.
    num_sets, small_sets = 2, (2 if quick else 3)
    fbgemm_why = _fbgemm_reason(device)
    notes = [fbgemm_why] if fbgemm_why else []
    max_len = MAX_LEN
    gen = torch.Generator(device=device).manual_seed(SEED + 1)

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    def pad(values):
        # Inputs of padded_to_jagged: zero past each length, as a real padded batch (aten: fast, and
        # independent of the kernels under test).
        return torch.ops.aten._jagged_to_padded_dense_forward(values, [offsets], [max_len], 0.0)

    offsets = lognormal_offsets(num_seqs).to(device)
    total_len = int(offsets[-1])
    for dtype in dtypes:
        elem = torch.empty((), dtype=dtype).element_size()
        value_sets = [(randn(total_len, dim, dtype=dtype),) for _ in range(num_sets)]
        case_flops, case_bytes = flops.jagged_to_padded(offsets, max_len, dim, elem)
        impls = {name: rotate(value_sets, fn) for name, fn in _j2p_impls(device, offsets, max_len, not fbgemm_why).items()}
        yield Case(op="jagged_to_padded", shape=_shape(offsets, max_len, dim), dtype=dtype, flops=case_flops,
                   bytes=case_bytes, impls=impls, baseline="aten", peak="bandwidth", notes=list(notes),
                   reference="reference", exact=True)
        del impls, value_sets

        padded_sets = [(pad(randn(total_len, dim, dtype=dtype)),) for _ in range(num_sets)]
        case_flops, case_bytes = flops.padded_to_jagged(offsets, max_len, dim, elem)
        impls = {name: rotate(padded_sets, fn) for name, fn in _p2j_impls(device, offsets, total_len, not fbgemm_why).items()}
        yield Case(op="padded_to_jagged", shape=_shape(offsets, max_len, dim), dtype=dtype, flops=case_flops,
                   bytes=case_bytes, impls=impls, baseline="aten", peak="bandwidth", notes=list(notes),
                   reference="reference", exact=True)
        del impls, padded_sets

    # Small forward+backward cases, fp32: the backward of each op is the other op.
    dtype = torch.float32
    offsets = lognormal_offsets(small_seqs, seed=SEED + 2).to(device)
    total_len = int(offsets[-1])
    j2p_bytes = flops.jagged_to_padded(offsets, max_len, small_dim, 4)[1]
    p2j_bytes = flops.padded_to_jagged(offsets, max_len, small_dim, 4)[1]
    aten_note = "aten has no autograd for these ops: its fwd+bwd calls the forward op, then the adjoint op directly"

    def aten_j2p_fwd_bwd(values, grad_padded):
        out = torch.ops.aten._jagged_to_padded_dense_forward(values.detach(), [offsets], [max_len], 0.0)
        return out, torch.ops.aten._padded_dense_to_jagged_forward(grad_padded, [offsets], total_len)

    sets = [(randn(total_len, small_dim, dtype=dtype).requires_grad_(), randn(small_seqs, max_len, small_dim, dtype=dtype))
            for _ in range(small_sets)]
    impls = {name: rotate(sets, lambda v, g, fn=fn: _fwd_bwd(fn, v, g))
             for name, fn in _j2p_impls(device, offsets, max_len, not fbgemm_why, autograd=True).items()
             if name != "aten"}
    impls["aten"] = rotate(sets, aten_j2p_fwd_bwd)
    yield Case(op="jagged_to_padded fwd+bwd", shape=_shape(offsets, max_len, small_dim), dtype=dtype, flops=0,
               bytes=j2p_bytes + p2j_bytes, impls=impls, baseline="aten", peak="bandwidth",
               notes=notes + [aten_note], reference="reference", exact=True)

    def aten_p2j_fwd_bwd(padded, grad_values):
        out = torch.ops.aten._padded_dense_to_jagged_forward(padded.detach(), [offsets], total_len)
        return out, torch.ops.aten._jagged_to_padded_dense_forward(grad_values, [offsets], [max_len], 0.0)

    sets = [(pad(randn(total_len, small_dim, dtype=dtype)).requires_grad_(), randn(total_len, small_dim, dtype=dtype))
            for _ in range(small_sets)]
    impls = {name: rotate(sets, lambda p, g, fn=fn: _fwd_bwd(fn, p, g))
             for name, fn in _p2j_impls(device, offsets, total_len, not fbgemm_why).items() if name != "aten"}
    impls["aten"] = rotate(sets, aten_p2j_fwd_bwd)
    yield Case(op="padded_to_jagged fwd+bwd", shape=_shape(offsets, max_len, small_dim), dtype=dtype, flops=0,
               bytes=p2j_bytes + j2p_bytes, impls=impls, baseline="aten", peak="bandwidth",
               notes=notes + [aten_note], reference="reference", exact=True)

"""The machine's measured peaks, before and after the kernels: the roofs that every row's % of peak
is relative to are the better of the two measurements (``measure_peaks_again``).

- matmul TFLOP/s per dtype: a large square matmul (2*n^3 FLOPs), fp32 on CPU; fp32, tf32, bf16 and
  fp16 on GPU (tf32 = fp32 inputs with TF32 tensor cores allowed);
- copy GB/s: ``dst.copy_(src)`` of a tensor far larger than the caches, counting read + write bytes
  (2 * nbytes), which is how the bandwidth-bound ops' minimum bytes are counted too;
- gather GB/s (``gather_roof``, per case: the embedding-bag family's roof): reading the case's own
  looked-up rows from its own tables in its own order, the access pattern a pooled lookup cannot avoid,
  the best of ATen's index_select (``gather_gbps``) and a prefetching C++ reader at several prefetch
  distances (``prefetched_gather_gbps``). ``gather_roof_call`` gives the best reader as a call, which
  the bench times again interleaved with the case's impls: their % of the roof is the ratio of the
  two medians from that one run.
On CPU torch uses all cores (the bench sets the thread count once for the whole run).
The bench (bench/peaks.py) and the model's MFU (model/train.py) both use them: they live in the package
so that neither of the two imports the other.
"""

from __future__ import annotations

import os
import time

import torch

from .. import _backend
from .timing import Settings, dtype_name, log, measure, percentile

# (matmul n, copy MiB) per device kind and mode: large enough to reach the roof, small enough for
# the budget (a 2048^3 fp32 matmul is ~17 GFLOP, ~0.2 s on 2 cores).
_SIZES = {
    ("cpu", False): (2048, 512),
    ("cpu", True): (1024, 128),
    ("cuda", False): (8192, 2048),
    ("cuda", True): (4096, 1024),
}


def _matmul_tflops(n: int, dtype: torch.dtype, device: torch.device, settings: Settings) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    timing = measure(lambda: torch.mm(a, b), device, settings)
    # The best (p10) rather than the median: a peak is what the machine can do.
    return 2 * n**3 / (timing.p10_ms / 1e3) / 1e12


def _copy_gbps(mib: int, device: torch.device, settings: Settings) -> float:
    src = torch.randn(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    timing = measure(lambda: dst.copy_(src), device, settings)
    return 2 * src.nbytes / (timing.p10_ms / 1e3) / 1e9


# Lookups gathered per index_select: the output block (<= 2 MiB at D = 128) is reused and stays in
# cache, so the gather's time is the rows' reads, not the writes of a copy the size of the reads; 4096
# keeps the per-call cost (~2 us of dispatch) to a few % of the chunk's reads.
_GATHER_CHUNK = 4096


def gather_gbps(tables: list[torch.Tensor], ids: list[torch.Tensor], device: torch.device,
                settings: Settings | None = None) -> float:
    """The gather peak of a lookup pattern (GB/s): table t's rows ``ids[t]`` read in that order with
    ``torch.index_select`` into a small reused block (_GATHER_CHUNK rows), bytes = every looked-up
    row once (sum len(ids[t]) * row bytes; a repeated row counts each time, as FBGEMM's formula
    counts it). It is the time any embedding bag must spend reading its rows from memory in this
    order, so an embedding-bag row's GB/s by FBGEMM's formula (these reads plus its small output)
    over it is its % of the gather peak. The gather is ATen's, one row after another with no
    software prefetch: random rows are latency-bound, and a kernel that prefetches the next bags'
    rows overlaps more misses than it does (measured 2026-12-05, 2-core Xeon, 1 thread, the bench's
    full CPU shape: the fused forward at 179 % of it), so it is the roof of an unprefetched gather,
    not of the memory system."""
    settings = settings or Settings(min_repeats=3, min_time=0.2, max_time=2.0, warmup_time=0.05)
    nbytes = sum(i.numel() * t.shape[1] * t.element_size() for t, i in zip(tables, ids))
    timing = measure(_aten_gather(tables, ids, device), device, settings)
    return nbytes / (timing.p10_ms / 1e3) / 1e9


def _aten_gather(tables: list[torch.Tensor], ids: list[torch.Tensor], device: torch.device):
    """gather_gbps's timed call: the rows read with index_select into small reused blocks."""
    chunks = [(table, part) for table, table_ids in zip(tables, ids)
              for part in table_ids.to(device).split(_GATHER_CHUNK)]
    blocks = {(t.shape[1], t.dtype): torch.empty(_GATHER_CHUNK, t.shape[1], dtype=t.dtype, device=device)
              for t in tables}

    def gather():
        for table, part in chunks:
            block = blocks[(table.shape[1], table.dtype)]
            torch.index_select(table, 0, part, out=block[:part.numel()])

    return gather


# Prefetch distances (ids ahead, within a work item's ids; 0 = no software prefetch) the prefetching
# reader tries: the best is the roof, whichever distance this core's memory latency and fill buffers
# favour (the embedding-bag forward uses 16, FBGEMM's default).
PREFETCH_DISTANCES = (0, 4, 8, 16, 32, 64)


def prefetched_gather_gbps(tables: list[torch.Tensor], ids: list[torch.Tensor],
                           settings: Settings | None = None) -> dict[int, float]:
    """{prefetch distance: GB/s} of gem_kernels._C.gather_rows_read (csrc/cpu/gather_peak.cpp): the
    rows ``ids[t]`` of ``tables[t]`` (CPU) read in order, split and scheduled over the threads as the
    embedding-bag forward splits its bags, each row's cache lines prefetched ``distance`` ids ahead,
    XOR-ed into registers (no output, no bag bookkeeping, no index checks in the timed loop beyond a
    range test). The distances are timed round-robin (interleaved_seconds), each one's GB/s from its
    p10 time. Bytes as ``gather_gbps``: every looked-up row once."""
    ext = _backend._C
    if ext is None:
        raise RuntimeError("prefetched_gather_gbps needs the gem_kernels extension (gem_kernels._C), "
                           "which is not built")
    settings = settings or Settings(min_repeats=3, min_time=0.2, max_time=2.0, warmup_time=0.05)
    tables = [t.contiguous() for t in tables]
    ids = [i.cpu().contiguous() for i in ids]
    nbytes = sum(i.numel() * t.shape[1] * t.element_size() for t, i in zip(tables, ids))
    reads = {d: (lambda d=d: ext.gather_rows_read(tables, ids, d)) for d in PREFETCH_DISTANCES}
    seconds = interleaved_seconds(reads, settings)
    return {d: nbytes / percentile(seconds[d], 10) / 1e9 for d in PREFETCH_DISTANCES}


def interleaved_seconds(calls: dict, settings: Settings) -> dict:
    """{key: [seconds of each timed call]} of zero-arg CPU ``calls`` timed round-robin: one warm-up
    call each, then every call once per round until each has ``settings.min_repeats`` times and the
    rounds have taken ``min_time`` seconds per call, or ``max_time`` seconds per call have passed
    (one round whatever the limits). The candidates of one roof are compared so, not one after the
    other: on a VM whose speed drifts within seconds (the 2-core AMD EPYC: the roof's reader at
    distance 32 was 1.04-1.05x faster than at 16 or 64 when interleaved, 2026-12-08, yet measured in
    turn the bench picked 64, 16 and 64 in three runs, bench/results/notes-amd17.md) a sequential
    measurement crowns whichever ran during a fast spell."""
    for fn in calls.values():
        fn()
    seconds: dict = {key: [] for key in calls}
    start = time.perf_counter()
    while True:
        for key, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            seconds[key].append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - start
        rounds = len(seconds[next(iter(seconds))]) if seconds else 0
        if (rounds >= settings.min_repeats and elapsed >= settings.min_time * len(calls)) or \
                elapsed >= settings.max_time * len(calls) or not calls:
            return seconds


def gather_roof(tables: list[torch.Tensor], ids: list[torch.Tensor], device: torch.device,
                settings: Settings | None = None) -> dict:
    """The roof of a pooled lookup of rows ``ids[t]`` of ``tables[t]`` in that order (GB/s, bytes: every
    looked-up row once): {"gbps": the best of the measurements below, "aten_gbps": gather_gbps,
    "prefetched_gbps": prefetched_gather_gbps by distance (None off the CPU or without the
    extension), "best": the name of the best ("aten" or "prefetch <distance>")}. On the CPU it is an
    upper bound of the embedding-bag forward: the same reads in the same order at the best prefetch
    distance, without the forward's other work."""
    aten = gather_gbps(tables, ids, device, settings)
    prefetched = (prefetched_gather_gbps(tables, ids, settings)
                  if device.type == "cpu" and _backend._C is not None else None)
    candidates = {"aten": aten, **{f"prefetch {d}": g for d, g in (prefetched or {}).items()}}
    best = max(candidates, key=candidates.get)
    log(f"[peaks] gather roof {candidates[best]:.1f} GB/s ({best}); aten {aten:.1f}"
        + ("".join(f", prefetch {d}: {g:.1f}" for d, g in prefetched.items()) if prefetched else ""))
    return {"gbps": candidates[best], "aten_gbps": aten, "prefetched_gbps": prefetched, "best": best}


def gather_roof_call(tables: list[torch.Tensor], ids: list[torch.Tensor], best: str, device: torch.device):
    """A zero-arg call reading rows ``ids[t]`` of ``tables[t]`` the way ``gather_roof``'s reader
    ``best`` ("aten" or "prefetch <distance>") did: what the bench times interleaved with a case's
    impls (bench.harness.Case.gather_roof), so that the roof and the impls run under the same load
    and the same cache and TLB state rather than minutes apart."""
    if best == "aten":
        return _aten_gather(tables, ids, device)
    kind, _, distance = best.partition(" ")
    if kind != "prefetch" or not distance.isdigit():
        raise ValueError(f"best must be 'aten' or 'prefetch <distance>', got {best!r}")
    if device.type != "cpu" or _backend._C is None:
        raise ValueError(f"the prefetching reader ({best!r}) runs on the CPU with gem_kernels._C built, "
                         f"not on {device}{'' if _backend._C is not None else ' (extension not built)'}")
    tables = [t.contiguous() for t in tables]
    ids = [i.cpu().contiguous() for i in ids]
    read, d = _backend._C.gather_rows_read, int(distance)
    return lambda: read(tables, ids, d)


def _settings(quick: bool) -> Settings:
    return Settings(min_repeats=3, min_time=0.1 if quick else 0.4, max_time=1.0 if quick else 3.0, warmup_time=0.05)


def matmul_peak_tflops(dtype: torch.dtype, device: torch.device, quick: bool = True) -> float:
    """The measured dense matmul peak of one dtype on `device` (TFLOP/s): the roof of the model's
    MFU (model/train.py), measured as ``measure_peaks`` measures it in the same mode (the same matmul,
    size and repeats). bf16 on a CPU measures what torch's CPU bf16 matmul reaches."""
    n, _ = _SIZES[(device.type, quick)]
    return _matmul_tflops(n, dtype, device, _settings(quick))


def mfu(flops: float, ms: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: ``flops`` done in ``ms`` milliseconds over a peak of ``peak_tflops``
    TFLOP/s (a fraction). The one definition of the figure: model.train's MFU (and mfu_by_component) and
    the bench's % of the matmul peak (bench/harness.py pct_of_peak, times 100) both call it."""
    return flops / (ms / 1e3) / (peak_tflops * 1e12)


def measure_peaks(device: torch.device, quick: bool) -> dict:
    """{"matmul_tflops": {dtype: TFLOP/s}, "copy_gbps": GB/s, "sizes": ..., "threads": ...}."""
    n, mib = _SIZES[(device.type, quick)]
    settings = _settings(quick)
    peaks: dict = {"matmul_tflops": {}, "sizes": {"matmul_n": n, "copy_mib": mib},
                   "threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        previous = torch.backends.cuda.matmul.allow_tf32
        try:
            torch.backends.cuda.matmul.allow_tf32 = False
            peaks["matmul_tflops"]["float32"] = _matmul_tflops(n, torch.float32, device, settings)
            torch.backends.cuda.matmul.allow_tf32 = True
            peaks["matmul_tflops"]["tf32"] = _matmul_tflops(n, torch.float32, device, settings)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
        for dtype in (torch.bfloat16, torch.float16):
            peaks["matmul_tflops"][dtype_name(dtype)] = _matmul_tflops(n, dtype, device, settings)
    else:
        peaks["matmul_tflops"]["float32"] = _matmul_tflops(n, torch.float32, device, settings)
    peaks["copy_gbps"] = _copy_gbps(mib, device, settings)
    mm = ", ".join(f"{k} {v:.2f}" for k, v in peaks["matmul_tflops"].items())
    log(f"[peaks] matmul TFLOP/s (n={n}): {mm}; copy {peaks['copy_gbps']:.1f} GB/s ({mib} MiB, read+write)")
    return peaks


def measure_peaks_again(first: dict, second: dict) -> dict:
    """The better of two measurements of each peak, with both kept under "measurements"."""
    merged = dict(first)
    merged["matmul_tflops"] = {k: max(v, second["matmul_tflops"].get(k, 0.0)) for k, v in first["matmul_tflops"].items()}
    merged["copy_gbps"] = max(first["copy_gbps"], second["copy_gbps"])
    merged["measurements"] = [{"matmul_tflops": m["matmul_tflops"], "copy_gbps": m["copy_gbps"]} for m in (first, second)]
    log(f"[peaks] kept the better of start and end: matmul {merged['matmul_tflops']}, copy {merged['copy_gbps']:.1f} GB/s")
    return merged

"""Timing one callable on the host or a GPU: what the bench harness and the peak probes share.

``measure`` warms up, then repeats until a minimum count and a minimum time are reached, or a
maximum time is; ``time.perf_counter`` per call on the CPU, CUDA events on a GPU. It lives in the
package (not in bench/) so that model/ and bench/ both use it without one importing the other.
"""

from __future__ import annotations

import gc
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


class RecompileError(RuntimeError):
    """A compiled impl compiled again during its timed calls: the timing would include compilation."""


def compile_count() -> int:
    """Frames torch.compile has compiled so far in this process (recompiles included)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # a torch without dynamo compiles nothing
        return 0
    return int(counters["frames"]["total"])


@dataclass
class Settings:
    """How hard to time: per-impl repeats and times (seconds)."""

    min_repeats: int
    min_time: float
    max_time: float
    warmup_time: float

    @staticmethod
    def for_run(quick: bool, repeats: int | None = None) -> "Settings":
        if quick:
            s = Settings(min_repeats=5, min_time=0.05, max_time=0.25, warmup_time=0.02)
        else:
            s = Settings(min_repeats=10, min_time=0.5, max_time=3.0, warmup_time=0.1)
        if repeats is not None:
            s.min_repeats = repeats
        return s


@dataclass
class Timing:
    times: list[float]  # seconds, one per timed call
    capped: bool  # stopped by the maximum time before the minimum count/time was reached
    page_faults: float | None = None  # CPU: mean minor page faults per timed call (fresh output pages)

    @property
    def repeats(self) -> int:
        return len(self.times)

    @property
    def median_ms(self) -> float:
        return percentile(self.times, 50) * 1e3

    @property
    def p10_ms(self) -> float:
        return percentile(self.times, 10) * 1e3

    @property
    def p90_ms(self) -> float:
        return percentile(self.times, 90) * 1e3

    @property
    def p99_ms(self) -> float:
        """Serving's tail latency; with n timed calls it is the max once n < 100 (see `repeats`)."""
        return percentile(self.times, 99) * 1e3


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], Any], device: torch.device, settings: Settings, max_time: float | None = None,
            warmed: float | None = None, min_calls: int = 0) -> Timing:
    """Time ``fn``: warm-up, then repeats until ``min_repeats`` calls AND ``min_time`` seconds are
    reached, or ``max_time`` seconds (warm-up included) have passed; one timed call whatever the
    limits. ``warmed`` is the duration (s) of a call that already ran (the verification call): it
    stands in for the first warm-up call, and a call that slow gets no more warm-up.

    CPU: each call timed with ``time.perf_counter``. CUDA: a pair of events around each call,
    launched back to back and synchronised once per chunk (so launch latency overlaps as in a real
    program); the wall-clock limit is checked between chunks. ``min_calls`` timed calls are made
    whatever ``max_time`` (compiled impls: a speedup needs MIN_REPEATS_FOR_GOALS of them). A compile
    during the timed calls raises ``RecompileError``.
    """
    max_time = settings.max_time if max_time is None else max_time
    # Once before the clock starts: the first call imports torch._dynamo (seconds on a busy host),
    # which would otherwise spend the impl's max_time before its first timed call.
    compile_count()
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        last = warmed
        while True:
            elapsed = time.perf_counter() - start
            if last is not None and (elapsed >= settings.warmup_time or elapsed + last >= max_time / 4):
                break
            t0 = time.perf_counter()
            fn()
            sync(device)
            last = time.perf_counter() - t0
        estimate = last
        compiles = compile_count()
        if device.type == "cuda":
            timing = _measure_cuda(fn, device, settings, start + max_time, estimate, min_calls)
        else:
            timing = _measure_cpu(fn, settings, start + max_time, min_calls)
        if compile_count() != compiles:
            raise RecompileError(f"compiled {compile_count() - compiles} frame(s) during its timed calls")
        return timing
    finally:
        if gc_was_enabled:
            gc.enable()


def _measure_cpu(fn, settings: Settings, deadline: float, min_calls: int = 0) -> Timing:
    times: list[float] = []
    begin = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if len(times) >= settings.min_repeats and t1 - begin >= settings.min_time:
            return Timing(times, capped=False)
        if t1 >= deadline and len(times) >= min_calls:
            return Timing(times, capped=True)


def _measure_cuda(fn, device: torch.device, settings: Settings, deadline: float, estimate: float | None,
                  min_calls: int = 0) -> Timing:
    # Chunk size from the warm-up estimate: about 20 ms of work between wall-clock checks.
    chunk = 1 if not estimate else max(1, min(100, int(0.02 / max(estimate, 1e-6))))
    times: list[float] = []
    begin = time.perf_counter()
    while True:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(chunk)]
        for ev_start, ev_end in events:
            ev_start.record()
            fn()
            ev_end.record()
        torch.cuda.synchronize(device)
        times.extend(ev_start.elapsed_time(ev_end) / 1e3 for ev_start, ev_end in events)
        now = time.perf_counter()
        if len(times) >= settings.min_repeats and now - begin >= settings.min_time:
            return Timing(times, capped=False)
        if now >= deadline and len(times) >= min_calls:
            return Timing(times, capped=True)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)

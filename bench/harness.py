"""The shared bench harness: what a case is, how an impl is timed, how rows are made.

Every family module (bench/<family>.py) exposes ``cases(quick, device)``, a generator of ``Case``
objects (see bench/__init__.py for the contract). The harness, per case:
  1. verifies: when ``Case.reference`` names an impl, calls every impl once and compares its output
     (fwd+bwd impls return their gradients too) and, when ``Case.state`` reads one, its state after the
     call (updated tables, optimizer state) with the reference's; a mismatch or an exception fails that
     impl: it gets a failed row with the reason and is not timed (a bench that times wrong answers is
     worse than none). A case without a reference must say why in ``Case.unverified``;
  2. primes every compiled impl (``Case.compiled``) on every input set it will be timed on, untimed:
     the seconds this takes (compilation included) are the row's ``compile_s``; a compile during the
     timed calls afterwards raises ``RecompileError`` naming the case and fails the impl;
  3. times every remaining impl: warm-up, then repeats until both a minimum count and a minimum
     time are reached, or a maximum time is (fewer repeats rather than a hang); the garbage collector
     off while timing. CPU (``measure_interleaved``): ``time.perf_counter`` per call, the impls
     interleaved round-robin so load from other processes hits all alike; GPU (``measure``): one impl
     after the other, CUDA events around each call;
  4. turns the timings into rows (``make_row``): ms median/p10/p90, TFLOP/s and GB/s from the case's
     analytic flops and minimum bytes (the floor; ``formula_bytes`` gives a second GB/s figure by a
     published formula, FBGEMM's for embedding bags), % of the measured peak against the floor,
     speedup vs the case's baseline.
A family runs under a time budget (``Budget``): each impl's maximum time shrinks to what is left, and
cases past the budget are skipped with a note, so one slow family cannot blow the whole run.
"""

from __future__ import annotations

import gc
import itertools
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

PEAK_KINDS = ("bandwidth", "matmul")


class SkipFamily(Exception):
    """Raised by a family's ``cases()`` when the family cannot run here (the message says why)."""


class RecompileError(RuntimeError):
    """A compiled impl compiled again during its timed calls: the timing would include compilation."""


def _compile_count() -> int:
    """Frames torch.compile has compiled so far in this process (recompiles included)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # a torch without dynamo compiles nothing
        return 0
    return int(counters["frames"]["total"])


@dataclass
class Case:
    """One benchmarked computation and the implementations that compete on it.

    ``impls`` maps an impl name (a gem_kernels backend or a baseline such as "aten") to a zero-arg
    callable doing one iteration (fwd+bwd impls do both). ``flops`` and ``bytes`` are the analytic
    work and the floor of memory traffic of one iteration (gem_kernels.flops). ``formula_bytes``, when
    set, is a second byte count by a published benchmark formula (FBGEMM's for embedding bags, which
    counts every lookup): its GB/s is shown beside the floor's, and % of peak always uses the floor.
    ``peak`` says which measured peak ``pct_peak`` is relative to: "bandwidth" (copy GB/s) or "matmul"
    (TFLOP/s of ``dtype``).

    Verification: ``reference`` names the impl whose output every other impl's must match (within
    ``tolerance``; exact for copies is up to the family: pass dict(atol=0, rtol=0)). fwd+bwd impls
    return their gradients with the output, so those are compared too. ``state`` maps impls to a
    zero-arg reader of what the verification call changed (updated tables, optimizer state),
    compared with the reference's reader; every impl of the case needs one when it is given (a reader
    may return a dict: then only the keys it returns are compared, each must be in the reference's).
    A case that cannot be verified says why in ``unverified`` instead, and the table shows it.

    ``compiled`` names the impls that are torch.compile'd: the harness calls each once per input set
    (``rotate``'s ``num_sets``) before timing, records that time as ``compile_s``, times at least
    MIN_REPEATS_FOR_GOALS calls of each (and of the baseline) whatever the time cap, and fails one
    that compiles again while timed (``RecompileError``).
    """

    op: str
    shape: str
    dtype: torch.dtype
    flops: int
    bytes: int
    impls: dict[str, Callable[[], Any]]
    baseline: str
    peak: str = "bandwidth"
    notes: list[str] = field(default_factory=list)
    reference: str | None = None
    tolerance: dict[str, float] | None = None
    unverified: str | None = None
    state: dict[str, Callable[[], Any]] | None = None
    compiled: tuple[str, ...] = ()
    formula_bytes: int | None = None
    examples: int | None = None  # examples (users, samples) one call processes: the row gets examples_per_s
    # The case's measured gather peak (bench.peaks.gather_gbps, GB/s of reading its looked-up rows in its
    # order): rows get pct_gather_peak = GB/s by formula_bytes over it (embedding-bag forward).
    gather_gbps: float | None = None

    def __post_init__(self) -> None:
        if self.peak not in PEAK_KINDS:
            raise ValueError(f"peak must be one of {PEAK_KINDS}, got {self.peak!r}")
        if not self.impls:
            raise ValueError(f"case {self.op!r} has no impls")
        if self.reference is not None and self.reference not in self.impls:
            raise ValueError(f"reference must be a key of impls {list(self.impls)}, got {self.reference!r}")
        if (self.reference is None) == (self.unverified is None):
            raise ValueError(f"case {self.op!r}: give either a reference impl or an unverified='why' reason "
                             f"(got reference={self.reference!r}, unverified={self.unverified!r})")
        if self.state is not None and set(self.state) != set(self.impls):
            raise ValueError(f"case {self.op!r}: state readers for {sorted(self.state)}, impls {sorted(self.impls)}")
        self.compiled = tuple(self.compiled)
        unknown = [name for name in self.compiled if name not in self.impls]
        if unknown:
            raise ValueError(f"case {self.op!r}: compiled impls {unknown} are not in impls {list(self.impls)}")


def rotate(arg_sets: Iterable[tuple], fn: Callable[..., Any]) -> Callable[[], Any]:
    """A zero-arg callable that calls ``fn(*args)`` with the next of the pre-built argument tuples,
    cycling, so consecutive iterations read different memory and caches do not flatter.

    Every call starts with the first set after construction, so impls built from the same sets see
    the same inputs in the same order (the verification call compares like with like).
    """
    sets = [tuple(args) for args in arg_sets]
    if not sets:
        raise ValueError("rotate needs at least one argument tuple")
    cycle = itertools.cycle(sets)

    def call():
        return fn(*next(cycle))

    call.num_sets = len(sets)  # priming a compiled impl calls it this many times: once per set
    return call


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


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


def _sync(device: torch.device) -> None:
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
            _sync(device)
            last = time.perf_counter() - t0
        estimate = last
        compiles = _compile_count()
        if device.type == "cuda":
            timing = _measure_cuda(fn, device, settings, start + max_time, estimate, min_calls)
        else:
            timing = _measure_cpu(fn, settings, start + max_time, min_calls)
        if _compile_count() != compiles:
            raise RecompileError(f"compiled {_compile_count() - compiles} frame(s) during its timed calls")
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


def measure_interleaved(fns: dict[str, Callable[[], Any]], settings: Settings, max_times: dict[str, float],
                        warmed: dict[str, float] | None = None, min_calls: dict[str, int] | None = None,
                        ) -> tuple[dict[str, Timing], dict[str, Exception]]:
    """CPU: time several impls round-robin, one call each per round, so that load from other
    processes (which drifts over seconds on a shared machine) hits every impl alike and the
    speedups stay fair. Each impl gets its own warm-up and stops on its own (``min_repeats`` calls
    AND ``min_time`` seconds of its calls, or ``max_times[name]`` seconds of its own time, warm-up
    included; never before ``min_calls[name]`` timed calls). A timed call that compiles raises
    ``RecompileError`` for its impl. Returns the timings and the exceptions of impls that raised
    (those are dropped)."""
    warmed = warmed or {}
    min_calls = min_calls or {}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    times: dict[str, list[float]] = {name: [] for name in fns}
    faults: dict[str, int] = {name: 0 for name in fns}
    spent: dict[str, float] = {name: 0.0 for name in fns}
    capped: dict[str, bool] = {name: False for name in fns}
    failed: dict[str, Exception] = {}
    try:
        for name, fn in fns.items():  # warm-up, as in measure()
            last = warmed.get(name)
            try:
                while not (last is not None and (spent[name] >= settings.warmup_time
                                                 or spent[name] + last >= max_times[name] / 4)):
                    t0 = time.perf_counter()
                    fn()
                    last = time.perf_counter() - t0
                    spent[name] += last
            except Exception as exc:
                failed[name] = exc
        active = [name for name in fns if name not in failed]
        while active:
            for name in list(active):
                compiles = _compile_count()
                f0 = _minor_faults()
                t0 = time.perf_counter()
                try:
                    fns[name]()
                    dt = time.perf_counter() - t0
                    if _compile_count() != compiles:
                        raise RecompileError(f"compiled {_compile_count() - compiles} frame(s) in timed call "
                                             f"{len(times[name]) + 1}")
                except Exception as exc:
                    failed[name] = exc
                    active.remove(name)
                    continue
                faults[name] += _minor_faults() - f0
                times[name].append(dt)
                spent[name] += dt
                if len(times[name]) >= settings.min_repeats and sum(times[name]) >= settings.min_time:
                    active.remove(name)
                elif spent[name] >= max_times[name] and len(times[name]) >= min_calls.get(name, 0):
                    capped[name] = True
                    active.remove(name)
    finally:
        if gc_was_enabled:
            gc.enable()
    timings = {name: Timing(times[name], capped[name], faults[name] / len(times[name]))
               for name in fns if name not in failed}
    return timings, failed


def _minor_faults() -> int:
    """Minor page faults of this process so far: first touches of freshly mapped memory. On CPU a
    large output (glibc mmaps every block over 32 MiB and unmaps it on free) faults in every page
    on every call, which can cost more than the copy itself; the rows record it per call."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ---------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------


def _flatten(out: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """(where, tensor) pairs of a nest: where is the index/key path, e.g. "[1]['momentum'][3]"."""
    if isinstance(out, torch.Tensor):
        return [(path, out)]
    if isinstance(out, (int, float)):
        return [(path, torch.tensor(float(out)))]
    if isinstance(out, (tuple, list)):
        return [t for i, item in enumerate(out) for t in _flatten(item, f"{path}[{i}]")]
    if isinstance(out, dict):
        return [t for key in sorted(out) for t in _flatten(out[key], f"{path}[{key!r}]")]
    raise TypeError(f"cannot compare an output of type {type(out).__name__}")


DEFAULT_TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def _align(actual: Any, expected: Any) -> Any:
    """``expected`` with each dict cut to the keys of ``actual``'s dict at the same place (an impl's
    state reader returns the parts its update rule shares with the reference's); KeyError when
    ``actual`` has a key the reference lacks."""
    if isinstance(actual, dict) and isinstance(expected, dict):
        missing = [key for key in actual if key not in expected]
        if missing:
            raise KeyError(f"the reference has no {missing}")
        return {key: _align(actual[key], expected[key]) for key in actual}
    if isinstance(actual, (tuple, list)) and isinstance(expected, (tuple, list)) and len(actual) == len(expected):
        return [_align(a, e) for a, e in zip(actual, expected)]
    return expected


def compare(actual: Any, expected: Any, tolerance: dict[str, float] | None, dtype: torch.dtype) -> str | None:
    """None when ``actual`` matches ``expected`` (tensors, numbers, or nests of them), else why not.
    Where both hold a dict, only the keys of ``actual``'s are compared (see ``_align``). ``tolerance``:
    atol, rtol as torch.isclose, and optionally atol_per_max: atol is at least that fraction of each
    expected tensor's largest |value| (for sums over a batch, whose small elements carry the
    reassociation error of large terms)."""
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCE.get(dtype, dict(atol=1e-4, rtol=1e-4))
    try:
        got, want = _flatten(actual), _flatten(_align(actual, expected))
    except (TypeError, KeyError) as exc:
        return str(exc)
    if len(got) != len(want):
        return f"{len(got)} output tensors, reference has {len(want)}"
    for i, ((where, g), (_, w)) in enumerate(zip(got, want)):
        i = f"{i} {where}" if where else i
        g, w = g.detach(), w.detach()
        if g.shape != w.shape:
            return f"output {i}: shape {tuple(g.shape)}, reference {tuple(w.shape)}"
        g64, w64 = g.double().cpu(), w.double().cpu()
        atol = tol["atol"]
        if tol.get("atol_per_max") and w64.numel():
            atol = max(atol, tol["atol_per_max"] * float(w64.abs().max()))
        bad = ~torch.isclose(g64, w64, atol=atol, rtol=tol["rtol"], equal_nan=False)
        if bad.any():
            diff = (g64 - w64).abs()
            diff[diff.isnan()] = float("inf")
            # Which rows (first index) hold the bad elements: one sample's worth points at a race or
            # a per-sample indexing bug, all of them at a tolerance or formula problem.
            rows = bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist() if bad.dim() else []
            where = f"; rows {rows[:8]}{' ...' if len(rows) > 8 else ''} ({len(rows)} of {bad.shape[0]})" if rows else ""
            return (f"output {i}: {int(bad.sum())} of {g.numel()} elements differ "
                    f"(max abs err {float(diff.max()):.3g}, atol={atol:.3g}, rtol={tol['rtol']}){where}")
    return None


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _base_row(family: str, case: Case, impl: str, device: torch.device, git_sha: str, timestamp: str) -> dict:
    return {
        "family": family,
        "op": case.op,
        "shape": case.shape,
        "dtype": dtype_name(case.dtype),
        "device": device.type,
        "impl": impl,
        "status": "ok",
        "failed": None,
        "verified_against": case.reference if impl != case.reference else None,
        "unverified": case.unverified,
        "compiled": impl in case.compiled,
        "compile_s": None,
        "ms": None,
        "ms_p10": None,
        "ms_p90": None,
        "repeats": 0,
        "capped": False,
        "page_faults_per_call": None,
        "flops": case.flops,
        "bytes": case.bytes,
        "formula_bytes": case.formula_bytes,
        "tflops": None,
        "gbps": None,
        "gbps_formula": None,
        "peak": case.peak,
        "pct_peak": None,
        "pct_gather_peak": None,
        "speedup_vs_baseline": None,
        "baseline": case.baseline,
        "git_sha": git_sha,
        "timestamp": timestamp,
    }


def make_row(family: str, case: Case, impl: str, timing: Timing, device: torch.device, peaks: dict,
             git_sha: str, timestamp: str, compile_s: float | None = None) -> dict:
    """A result row. TFLOP/s and GB/s are None for a case with no flops / no byte count; pct_peak is
    None when the machine has no measured peak of that kind (e.g. a dtype without a matmul peak).
    ``gbps`` divides the floor bytes, ``gbps_formula`` the case's formula bytes (None without them)."""
    seconds = timing.median_ms / 1e3
    row = _base_row(family, case, impl, device, git_sha, timestamp)
    row.update({
        "compile_s": compile_s,
        "ms": timing.median_ms,
        "ms_p10": timing.p10_ms,
        "ms_p90": timing.p90_ms,
        "repeats": timing.repeats,
        "capped": timing.capped,
        "page_faults_per_call": timing.page_faults,
        "tflops": case.flops / seconds / 1e12 if case.flops and seconds > 0 else None,
        "gbps": case.bytes / seconds / 1e9 if case.bytes and seconds > 0 else None,
        "gbps_formula": case.formula_bytes / seconds / 1e9 if case.formula_bytes and seconds > 0 else None,
        "examples_per_s": case.examples / seconds if case.examples and seconds > 0 else None,
    })
    row["pct_peak"] = pct_of_peak(row, peaks)
    if case.gather_gbps and row["gbps_formula"] is not None:
        row["pct_gather_peak"] = 100 * row["gbps_formula"] / case.gather_gbps
    return row


def failed_row(family: str, case: Case, impl: str, why: str, device: torch.device, git_sha: str,
               timestamp: str, compile_s: float | None = None) -> dict:
    """The row of an impl that failed verification, priming or timing: no time, the reason in ``failed``."""
    row = _base_row(family, case, impl, device, git_sha, timestamp)
    row.update(status="failed", failed=why, compile_s=compile_s)
    return row


def pct_of_peak(row: dict, peaks: dict) -> float | None:
    """A row's % of the measured peak of its kind: copy GB/s ("bandwidth") or its dtype's matmul
    TFLOP/s ("matmul"); None without a figure or without a measured peak of that kind."""
    if row["peak"] == "bandwidth" and row["gbps"] is not None and peaks.get("copy_gbps"):
        return 100 * row["gbps"] / peaks["copy_gbps"]
    if row["peak"] == "matmul" and row["tflops"] is not None:
        peak = peaks.get("matmul_tflops", {}).get(row["dtype"])
        if peak:
            return 100 * row["tflops"] / peak
    return None


# A median of fewer timed calls than this is flagged in the table and gives no speedup for a goal.
MIN_REPEATS_FOR_GOALS = 5


def fill_speedups(rows: list[dict]) -> None:
    """speedup_vs_baseline = baseline's median ms / this impl's median ms, within each case's rows.
    speedup_for_goals: the same, only when both medians come from >= MIN_REPEATS_FOR_GOALS calls
    (else None; the row's few_repeats flag says why)."""
    by_impl = {row["impl"]: row for row in rows if row["ms"] is not None}
    for row in rows:
        base = by_impl.get(row["baseline"])
        timed = row["ms"] is not None and row["ms"] > 0
        row["speedup_vs_baseline"] = base["ms"] / row["ms"] if base and timed else None
        row["few_repeats"] = timed and row["repeats"] < MIN_REPEATS_FOR_GOALS
        trusted = (base is not None and timed and not row["few_repeats"] and base["repeats"] >= MIN_REPEATS_FOR_GOALS)
        row["speedup_for_goals"] = row["speedup_vs_baseline"] if trusted else None


# ---------------------------------------------------------------------------------------------
# Running a family
# ---------------------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget (seconds) of one family."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()


@dataclass
class FamilyResult:
    name: str
    status: str  # "ok" | "skipped" | "failed" | "partial" | "interrupted"
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)  # impls whose output differed from the reference's
    seconds: float = 0.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_family(name: str, cases: Iterator[Case], device: torch.device, settings: Settings, budget: Budget,
               peaks: dict, git_sha: str, timestamp: str) -> FamilyResult:
    """Verify and time every case of a family within its budget."""
    result = FamilyResult(name, "ok")
    start = time.perf_counter()
    cases = iter(cases)
    case_no = 0
    try:
        while True:
            # Drop the previous case (its inputs) before the generator builds the next one.
            case = None
            case = next(cases, None)
            if case is None:
                break
            case_no += 1
            if budget.left() <= 0:
                msg = (f"time budget of {budget.seconds:.0f} s spent: case {case_no} ({case.op} [{case.shape}]) "
                       f"and any after it were skipped")
                result.notes.append(msg)
                log(f"[{name}] {msg}")
                result.status = "partial"
                break
            for note in case.notes:
                result.notes.append(f"{case.op} [{case.shape}]: {note}")
                log(f"[{name} {case_no}] note: {note}")
            rows = _run_case(name, case_no, case, device, settings, budget, peaks, git_sha, timestamp, result)
            result.rows.extend(rows)
            if case.examples:
                rates = ", ".join(f"{r['impl']} {r['examples_per_s']:,.0f}" for r in rows if r.get("examples_per_s"))
                result.notes.append(f"{case.op} [{case.shape}]: examples/s ({case.examples} per call): {rates}")
    except SkipFamily as exc:
        result.status = "skipped" if not result.rows else "partial"
        result.notes.append(f"skipped: {exc}")
        log(f"[{name}] skipped: {exc}")
    except Exception as exc:  # a broken family is reported, never crashes the run
        result.status = "failed" if not result.rows else "partial"
        result.errors.append(f"{name}: cases() raised {type(exc).__name__}: {exc}")
        log(f"[{name}] ERROR: cases() raised {type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        # SIGINT (Ctrl-C, or `timeout -s INT` in scripts/gpu_check.sh): keep the rows measured so far;
        # the caller stops the run and still writes them.
        result.status = "interrupted"
        result.errors.append(f"{name}: interrupted in case {case_no}: its rows and any after it are missing")
        log(f"[{name}] interrupted in case {case_no}")
    finally:
        close = getattr(cases, "close", None)
        if close is not None:
            close()
    result.seconds = time.perf_counter() - start
    return result


def _timed_call(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _with_state(case: Case, impl: str, out: Any) -> Any:
    """What verification compares: the output, and the impl's state after the call when the case reads one."""
    return out if case.state is None else (out, case.state[impl]())


def _no_recompiles():
    """A context in which torch.compile raises on a recompile (torch._dynamo's error_on_recompile)
    rather than compiling inside a timed call; a null context on a torch without dynamo."""
    import contextlib

    try:
        import torch._dynamo
    except ImportError:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(error_on_recompile=True)


def _run_case(family: str, case_no: int, case: Case, device: torch.device, settings: Settings, budget: Budget,
              peaks: dict, git_sha: str, timestamp: str, result: FamilyResult) -> list[dict]:
    tag = f"[{family} {case_no}]"
    what = f"{case.op} [{case.shape}, {dtype_name(case.dtype)}]"
    impls = dict(case.impls)
    warmed: dict[str, float] = {}  # impl -> seconds its verification call took (not for compiled impls)
    calls: dict[str, int] = {}  # impl -> untimed calls so far (verification)
    spent: dict[str, float] = {}  # impl -> seconds of those calls
    failed: dict[str, str] = {}  # impl -> why it gets a failed row
    compile_s: dict[str, float] = {}

    def fail(impl: str, why: str, mismatch: bool = False) -> None:
        msg = f"{what} impl {impl!r} {why}; not timed"
        result.errors.append(msg)
        if mismatch:
            result.mismatches.append(f"{what} {impl}: {why}")
        log(f"{tag} !!!!! {msg}")
        failed[impl] = why
        del impls[impl]

    if case.reference is not None:
        # One output alive at a time besides the reference's: padded batches can be large.
        try:
            expected, seconds = _timed_call(impls[case.reference], device)
            expected = _with_state(case, case.reference, expected)
            calls[case.reference], spent[case.reference] = 1, seconds
        except Exception as exc:
            expected = exc
        for impl in list(impls):
            if impl == case.reference and not isinstance(expected, Exception):
                continue
            if isinstance(expected, Exception):
                fail(impl, f"not verified: the reference {case.reference!r} raised "
                           f"{type(expected).__name__}: {_first_line(expected)}")
                continue
            try:
                out, seconds = _timed_call(impls[impl], device)
                calls[impl], spent[impl] = 1, seconds
                why = compare(_with_state(case, impl, out), expected, case.tolerance, case.dtype)
                del out
                if why is not None:
                    fail(impl, f"MISMATCH vs {case.reference!r}: {why}", mismatch=True)
            except Exception as exc:
                fail(impl, f"raised {type(exc).__name__}: {_first_line(exc)}")
        del expected
    for impl in list(impls):
        if impl not in case.compiled:
            if impl in spent:
                warmed[impl] = spent[impl]
            continue
        # Prime: every input set once (the verification call was the first), compiling what it must.
        sets = getattr(impls[impl], "num_sets", 1)
        try:
            for _ in range(max(0, sets - calls.get(impl, 0))):
                spent[impl] = spent.get(impl, 0.0) + _timed_call(impls[impl], device)[1]
        except Exception as exc:
            compile_s[impl] = spent.get(impl, 0.0)
            fail(impl, f"raised while priming (compiling): {type(exc).__name__}: {_first_line(exc)}")
            continue
        compile_s[impl] = spent.get(impl, 0.0)
        log(f"{tag} {case.op} {impl}: compiled and primed on {sets} input set(s) in {compile_s[impl]:.1f} s")
    rows = [failed_row(family, case, impl, why, device, git_sha, timestamp, compile_s.get(impl))
            for impl, why in failed.items()]
    names = list(impls)
    # A compiled impl's speedup is what it is timed for: it and the baseline it divides get enough
    # calls for a goal whatever the time cap.
    min_calls = {n: MIN_REPEATS_FOR_GOALS for n in names
                 if n in case.compiled or (case.compiled and n == case.baseline)}

    def add_row(i: int, impl: str, timing: Timing) -> None:
        row = make_row(family, case, impl, timing, device, peaks, git_sha, timestamp, compile_s.get(impl))
        rows.append(row)
        extra = f" {row['gbps']:.1f} GB/s" if row["gbps"] is not None else ""
        extra += f" {row['tflops']:.3g} TFLOP/s" if row["tflops"] is not None else ""
        log(f"{tag} {i + 1}/{len(names)} {case.op} {dtype_name(case.dtype)} {impl}: {row['ms']:.3f} ms "
            f"(p10 {row['ms_p10']:.3f}, p90 {row['ms_p90']:.3f}, n={row['repeats']}"
            f"{', capped' if timing.capped else ''}){extra}"
            + (f", {timing.page_faults:.0f} page faults/call" if timing.page_faults else ""))

    def timing_error(i: int, impl: str, exc: Exception) -> None:
        if isinstance(exc, RecompileError) or type(exc).__name__ == "RecompileError":
            why = f"RecompileError: {case.op} [{case.shape}] impl {impl!r}: {_first_line(exc)}"
        else:
            why = f"raised while timing: {type(exc).__name__}: {_first_line(exc)}"
        result.errors.append(f"{case.op} [{case.shape}] impl {impl!r} {why}")
        log(f"{tag} {i + 1}/{len(names)} {case.op} {impl}: ERROR {why}")
        rows.append(failed_row(family, case, impl, why, device, git_sha, timestamp, compile_s.get(impl)))

    if device.type == "cpu" and names:
        # Interleaved; each impl's cap is an even share of what is left, keeping about one more
        # case's worth for the cases after this one.
        cap = max(1e-3, min(settings.max_time, max(budget.left(), 0.0) / (2 * len(names))))
        log(f"{tag} timing {case.op} {dtype_name(case.dtype)} [{case.shape}]: {', '.join(names)} (interleaved)")
        with _no_recompiles():
            timings, errors = measure_interleaved({n: impls[n] for n in names}, settings, {n: cap for n in names},
                                                  warmed, min_calls)
        for i, impl in enumerate(names):
            if impl in errors:
                timing_error(i, impl, errors[impl])
            else:
                add_row(i, impl, timings[impl])
    else:
        for i, impl in enumerate(names):
            # An even share of what is left, keeping about one more case's worth for later cases.
            max_time = min(settings.max_time, max(budget.left(), 0.0) / (len(names) - i + len(names)))
            try:
                with _no_recompiles():
                    timing = measure(impls[impl], device, settings, max_time=max(max_time, 1e-3),
                                     warmed=warmed.get(impl), min_calls=min_calls.get(impl, 0))
            except Exception as exc:
                timing_error(i, impl, exc)
                continue
            add_row(i, impl, timing)
    order = {name: i for i, name in enumerate(case.impls)}
    rows.sort(key=lambda row: order[row["impl"]])
    fill_speedups(rows)
    if case.baseline not in {row["impl"] for row in rows if row["ms"] is not None}:
        msg = f"baseline {case.baseline!r} was not timed, so no speedups"
        result.notes.append(f"{case.op} [{case.shape}]: {msg}")
    return rows

"""The shared bench harness: what a case is, how an impl is timed, how rows are made.

Every family module (bench/<family>.py) exposes ``cases(quick, device)``, a generator of ``Case``
objects (see bench/__init__.py for the contract). The harness, per case:
  1. verifies: when ``Case.reference`` names an impl (the eager side), calls every impl once and
     holds its output (fwd+bwd impls return their gradients too) and, when ``Case.state`` reads one,
     its state after the call (gradients, updated tables, optimizer state) to FlashAttention's rule
     against ``Case.fp64``, the eager side run in float64: at most twice the eager side's own error,
     plus a rounding-sized atol (``compare``; copies: exactly equal, ``compare_exact``). The rule
     depends on no CPU, thread count or summation order. A mismatch or an exception fails that impl:
     it gets a failed row with the reason and is not timed (a bench that times wrong answers is
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
cases past the budget are skipped with a note, so one slow family cannot blow the whole run; its
first case always runs, so every family verifies something.
"""

from __future__ import annotations

import gc
import itertools
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

# The timing core lives in the package (model/ uses the peak probes too); the bench's names stay.
from gem_kernels.testing.peaks import mfu
from gem_kernels.testing.timing import (RecompileError, Settings, Timing, compile_count, dtype_name, log, measure,
                                        percentile, sync)

PEAK_KINDS = ("bandwidth", "matmul")
# The name under which a case's gather roof (Case.gather_roof) is timed among its impls.
GATHER_ROOF = "(gather roof)"
# The name under which a case's GEMM roof (Case.gemm_roof) is timed among its impls.
GEMM_ROOF = "(GEMM roof)"


class SkipFamily(Exception):
    """Raised by a family's ``cases()`` when the family cannot run here (the message says why)."""


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

    Verification: ``reference`` names the eager side, and ``fp64`` runs the eager side's computation
    in float64 on the verification call's inputs (the first input set). Every impl's output is held
    to FlashAttention's rule (``compare``): its max error against the float64 result is at most twice
    the reference's, plus a rounding-sized atol; the ReLUs of the float64 run take the branches the
    impl's run took (``ReluBranches``), so ``fp64`` must compute from the same initial state each time
    it is called (once per distinct set of branches). fwd+bwd impls return their gradients with the
    output, so those are compared too. ``state`` maps impls to a zero-arg reader of what the
    verification call changed (updated tables, optimizer state), compared the same way (``fp64``
    then returns ``(output, state)``); every impl of the case needs one when it is given (a reader
    may return a dict: then only the keys it returns are compared, each must be in the reference's).
    State after an optimizer step is comparable only where the update is Lipschitz in the gradient:
    SGD, or Adagrad/Adam from a warm state (their first step, lr * g / |g| elementwise, turns a
    rounding-sized change of a near-zero gradient into a change of up to 2 lr). Families read
    gradients where they can, and start Adagrad/Adam from a non-zero state where they read updated
    weights. Copies and gathers, which round nothing, say ``exact=True`` instead of giving ``fp64``:
    every impl must then equal the reference element for element. A case that cannot be verified
    says why in ``unverified`` instead, and the table shows it.

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
    fp64: Callable[[], Any] | None = None
    exact: bool = False
    unverified: str | None = None
    state: dict[str, Callable[[], Any]] | None = None
    compiled: tuple[str, ...] = ()
    formula_bytes: int | None = None
    examples: int | None = None  # examples (users, samples) one call processes: the row gets examples_per_s
    # The case's measured gather peak (bench.peaks.gather_gbps, GB/s of reading its looked-up rows in its
    # order): rows get pct_gather_peak = GB/s by formula_bytes over it (embedding-bag forward).
    gather_gbps: float | None = None
    # CPU: the gather roof as a zero-arg call (bench.peaks.gather_roof_call: its best reader, reading the
    # rows each impl call reads, rotating over the same input sets). The harness times it interleaved
    # with the impls, round-robin (GATHER_ROOF), so it runs under the same load from other processes
    # and in the same cache and TLB state; rows then get pct_gather_peak = 100 x its median time over
    # the impl's (the same rows read: a time ratio) and gather_roof_ms, and gather_gbps only names
    # the pre-measured peak in the notes. A roof measured minutes apart on a shared machine is not
    # the same-access-pattern roof (measured: 54 % against it, 74-77 % interleaved, same build).
    gather_roof: Callable[[], Any] | None = None
    # CPU: the case's matrix products alone, as a zero-arg call (the same GEMMs at the same shapes and
    # layouts, on the same rotating input sets, nothing else: no elementwise work, no extra bytes).
    # Timed interleaved with the impls like the gather roof (GEMM_ROOF); rows get gemm_roof_ms and
    # pct_gemm_roof = 100 x its median over the impl's: how close an op built around BLAS calls comes
    # to the BLAS library's own rate at its shapes, beside pct_peak (the square-GEMM peak).
    gemm_roof: Callable[[], Any] | None = None

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
        if self.reference is not None and (self.fp64 is None) == (not self.exact):
            raise ValueError(f"case {self.op!r}: a verified case gives either fp64 (its reference run in float64, "
                             f"for FlashAttention's rule) or exact=True (a copy), got fp64="
                             f"{'given' if self.fp64 is not None else None}, exact={self.exact}")
        if self.state is not None and set(self.state) != set(self.impls):
            raise ValueError(f"case {self.op!r}: state readers for {sorted(self.state)}, impls {sorted(self.impls)}")
        if GATHER_ROOF in self.impls:
            raise ValueError(f"case {self.op!r}: {GATHER_ROOF!r} is the name of the interleaved gather roof, not an impl")
        if GEMM_ROOF in self.impls:
            raise ValueError(f"case {self.op!r}: {GEMM_ROOF!r} is the name of the interleaved GEMM roof, not an impl")
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
                compiles = compile_count()
                f0 = _minor_faults()
                t0 = time.perf_counter()
                try:
                    fns[name]()
                    dt = time.perf_counter() - t0
                    if compile_count() != compiles:
                        raise RecompileError(f"compiled {compile_count() - compiles} frame(s) in timed call "
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


# The atol of the FlashAttention rule, in units in the last place of a tensor's largest |value|: for
# outputs where the eager side happens to round almost exactly (a scalar loss, a short sum), whose
# "2 x eager's error" alone would ask another summation order for less than one rounding. Relative
# to the tensor, unlike FlashAttention's 2 * |(t + 0.3 - 0.3) - t|, which is absolute for |t| < 0.3
# and would let a gradient of magnitude 1e-4 be 3e-4 off in fp32.
ATOL_ULPS = {torch.float32: 4, torch.float64: 4, torch.float16: 2, torch.bfloat16: 2}


def rounding_atol(truth: torch.Tensor, dtype: torch.dtype) -> float:
    """The rule's atol for a result of ``dtype`` whose float64 value is ``truth``: ATOL_ULPS units of
    ``dtype`` at the largest finite |value|."""
    finite = truth[truth.isfinite()]
    if not finite.numel():
        return 0.0
    return ATOL_ULPS.get(dtype, 4) * torch.finfo(dtype).eps * float(finite.abs().max())


def _rows_of(bad: torch.Tensor) -> str:
    """Which rows (first index) hold the bad elements: one sample's worth points at a race or a
    per-sample indexing bug, all of them at a formula problem."""
    if not bad.dim():
        return ""
    rows = bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist()
    return f"; rows {rows[:8]}{' ...' if len(rows) > 8 else ''} ({len(rows)} of {bad.shape[0]})" if rows else ""


def _flatten_aligned(actual: Any, *others: Any) -> list[list[tuple[str, torch.Tensor]]] | str:
    try:
        flat = [_flatten(actual)] + [_flatten(_align(actual, other)) for other in others]
    except (TypeError, KeyError) as exc:
        return str(exc)
    for other in flat[1:]:
        if len(other) != len(flat[0]):
            return f"{len(flat[0])} output tensors, reference has {len(other)}"
    return flat


def compare_exact(actual: Any, expected: Any) -> str | None:
    """None when ``actual`` equals ``expected`` element for element (NaN where NaN), else why not: the
    rule of copies and gathers, which round nothing, so every correct impl gives the same bits."""
    flat = _flatten_aligned(actual, expected)
    if isinstance(flat, str):
        return flat
    for i, ((where, g), (_, w)) in enumerate(zip(*flat)):
        label = f"{i} {where}" if where else i
        g, w = g.detach().cpu(), w.detach().cpu()
        if g.shape != w.shape:
            return f"output {label}: shape {tuple(g.shape)}, reference {tuple(w.shape)}"
        bad = ~((g == w) | (g.isnan() & w.isnan())) if g.is_floating_point() else g != w
        if bad.any():
            diff = (g.double() - w.double()).abs()
            diff[diff.isnan()] = float("inf")
            return (f"output {label}: {int(bad.sum())} of {g.numel()} elements differ (max abs err "
                    f"{float(diff.max()):.3g}, exact comparison){_rows_of(bad)}")
    return None


def compare(actual: Any, eager: Any, truth: Any, eager_truth: Any = None) -> str | None:
    """FlashAttention's rule. None when every tensor of ``actual`` is at most twice as far from the
    float64 ``truth`` as the eager side's result ``eager`` is from ``eager_truth`` (default
    ``truth``; another one where the eager side's ReLUs took other branches, see ReluBranches), by
    max |error| over the tensor, plus ``rounding_atol``; else why not. Nests of tensors and numbers; where ``actual`` holds a dict,
    only its keys are compared (see ``_align``). Integer and bool tensors (row ids, masks) must equal
    the truth. Where the truth is NaN or infinite, ``actual`` must be the same."""
    flat = _flatten_aligned(actual, eager, truth, truth if eager_truth is None else eager_truth)
    if isinstance(flat, str):
        return flat
    for i, ((where, g), (_, e), (_, t), (_, et)) in enumerate(zip(*flat)):
        label = f"{i} {where}" if where else i
        g, e, t, et = g.detach().cpu(), e.detach().cpu(), t.detach().cpu(), et.detach().cpu()
        if g.shape != t.shape or e.shape != t.shape or et.shape != t.shape:
            return f"output {label}: shape {tuple(g.shape)}, eager {tuple(e.shape)}, float64 {tuple(t.shape)}"
        if not g.is_floating_point():
            bad = g != t.to(g.dtype)
            if bad.any():
                return f"output {label}: {int(bad.sum())} of {g.numel()} entries differ from the reference's{_rows_of(bad)}"
            continue
        g64, e64, t64 = g.double(), e.double(), t.double()
        finite = t64.isfinite()
        special = ~finite & ~((g64 == t64) | (g64.isnan() & t64.isnan()))
        if special.any():
            return (f"output {label}: {int(special.sum())} elements differ from the float64 run's NaN/inf"
                    f"{_rows_of(special)}")
        if not finite.any():
            continue
        err = (g64 - t64).abs().where(finite, 0.0).nan_to_num(nan=float("inf"))
        et64 = et.double()
        eager_err = float((e64 - et64).abs().where(et64.isfinite(), 0.0).nan_to_num(nan=float("inf")).max())
        atol = rounding_atol(t64, g.dtype)
        bound = 2 * eager_err + atol
        if float(err.max()) > bound:
            bad = err > bound
            return (f"output {label}: max |error| vs float64 {float(err.max()):.3g} > 2 x eager's {eager_err:.3g} "
                    f"+ atol {atol:.3g} (FlashAttention's rule; {int(bad.sum())} of {g.numel()} elements past it, "
                    f"largest |value| {float(t64.abs().where(finite, 0.0).max()):.3g}){_rows_of(bad)}")
    return None


# ---------------------------------------------------------------------------------------------
# ReLU kinks: the float64 run follows the branch each impl took
# ---------------------------------------------------------------------------------------------

# A ReLU unit whose pre-activation rounds to the other side of 0 in one run than in another has a
# gradient of 0 in one and of its whole upstream value in the other: not a rounding difference, so
# no tolerance covers it, and with 1e5-1e6 units per step one such unit is common (measured: the
# GEM model's fused step under ATEN_CPU_CAPABILITY=default flips 1 of 149k units of a Wukong MLP,
# which moves its weight gradients by 2e-3 of their largest value). So the float64 run of each impl
# takes the branch that impl's own run took at every ReLU unit (both are then the same piecewise
# linear function), and the branches may differ from the float64 run's own only where its
# pre-activation is within KINK_MARGIN of the call's largest |pre-activation| from 0: further away,
# the impl's forward is wrong.
KINK_MARGIN = 1e-3
_RELU = (torch.relu, torch.relu_, torch.nn.functional.relu, torch.nn.functional.relu_, torch.Tensor.relu,
         torch.Tensor.relu_)


class ReluBranches(torch.overrides.TorchFunctionMode):
    """Records which side of 0 every ReLU unit is on (``masks``, one bool tensor per call, in call
    order), or, given ``replay`` (another run's masks), makes every ReLU call take those branches:
    relu(x) becomes where(mask, x, 0). Sees the ReLUs of Python code (nn.ReLU, F.relu, torch.relu,
    Tensor.relu, TorchRec's MLPs), not those inside a compiled graph or a C++ kernel. In a replay,
    ``structure_mismatch`` says why the calls could not be paired (another count or shape), and
    ``far_flips`` lists the calls where a branch differs from this run's own far from 0."""

    def __init__(self, replay: list[torch.Tensor] | None = None):
        super().__init__()
        self.replay = replay
        self.masks: list[torch.Tensor] = []
        self.structure_mismatch: str | None = None
        self.far_flips: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _RELU:
            return func(*args, **kwargs)
        x = args[0]
        natural = x.detach() > 0
        if self.replay is None:
            self.masks.append(natural)
            return func(*args, **kwargs)
        call = len(self.masks)
        self.masks.append(natural)
        if call >= len(self.replay) or self.replay[call].shape != natural.shape:
            self.structure_mismatch = self.structure_mismatch or (
                f"ReLU call {call} of shape {tuple(natural.shape)} has no counterpart in the impl's run "
                f"({len(self.replay)} calls)")
            return func(*args, **kwargs)
        mask = self.replay[call].to(natural.device)
        flipped = mask != natural
        if flipped.any():
            scale = float(x.detach().abs().max())
            worst = float(x.detach()[flipped].abs().max())
            if worst > KINK_MARGIN * scale:
                self.far_flips.append(f"ReLU call {call}: {int(flipped.sum())} of {natural.numel()} units on the other "
                                      f"side, |pre-activation| up to {worst:.3g} (margin {KINK_MARGIN * scale:.3g})")
        inplace = kwargs.get("inplace", args[1] if len(args) > 1 else False)
        if func in (torch.relu_, torch.nn.functional.relu_, torch.Tensor.relu_) or inplace:
            return x.masked_fill_(~mask, 0)
        return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------


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
        "ms_p99": None,
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
        "gather_roof_ms": None,
        "pct_gemm_roof": None,
        "gemm_roof_ms": None,
        "speedup_vs_baseline": None,
        "baseline": case.baseline,
        "git_sha": git_sha,
        "timestamp": timestamp,
    }


def make_row(family: str, case: Case, impl: str, timing: Timing, device: torch.device, peaks: dict,
             git_sha: str, timestamp: str, compile_s: float | None = None, roof: Timing | None = None,
             gemm_roof: Timing | None = None) -> dict:
    """A result row. TFLOP/s and GB/s are None for a case with no flops / no byte count; pct_peak is
    None when the machine has no measured peak of that kind (e.g. a dtype without a matmul peak).
    ``gbps`` divides the floor bytes, ``gbps_formula`` the case's formula bytes (None without them).
    ``roof``: the case's gather roof timed in the same interleaved run (Case.gather_roof): then
    pct_gather_peak is its median time over the impl's; without it, GB/s by formula over gather_gbps.
    ``gemm_roof``: the case's GEMMs alone timed in the same run (Case.gemm_roof): pct_gemm_roof."""
    seconds = timing.median_ms / 1e3
    row = _base_row(family, case, impl, device, git_sha, timestamp)
    row.update({
        "compile_s": compile_s,
        "ms": timing.median_ms,
        "ms_p10": timing.p10_ms,
        "ms_p90": timing.p90_ms,
        "ms_p99": timing.p99_ms,
        "repeats": timing.repeats,
        "capped": timing.capped,
        "page_faults_per_call": timing.page_faults,
        "tflops": case.flops / seconds / 1e12 if case.flops and seconds > 0 else None,
        "gbps": case.bytes / seconds / 1e9 if case.bytes and seconds > 0 else None,
        "gbps_formula": case.formula_bytes / seconds / 1e9 if case.formula_bytes and seconds > 0 else None,
        "examples_per_s": case.examples / seconds if case.examples and seconds > 0 else None,
    })
    row["pct_peak"] = pct_of_peak(row, peaks)
    if roof is not None and timing.median_ms > 0:
        row["gather_roof_ms"] = roof.median_ms
        row["pct_gather_peak"] = 100 * roof.median_ms / timing.median_ms
    elif case.gather_gbps and row["gbps_formula"] is not None:
        row["pct_gather_peak"] = 100 * row["gbps_formula"] / case.gather_gbps
    if gemm_roof is not None and timing.median_ms > 0:
        row["gemm_roof_ms"] = gemm_roof.median_ms
        row["pct_gemm_roof"] = 100 * gemm_roof.median_ms / timing.median_ms
    return row


def failed_row(family: str, case: Case, impl: str, why: str, device: torch.device, git_sha: str,
               timestamp: str, compile_s: float | None = None) -> dict:
    """The row of an impl that failed verification, priming or timing: no time, the reason in ``failed``."""
    row = _base_row(family, case, impl, device, git_sha, timestamp)
    row.update(status="failed", failed=why, compile_s=compile_s)
    return row


def pct_of_peak(row: dict, peaks: dict) -> float | None:
    """A row's % of the measured peak of its kind: copy GB/s ("bandwidth") or its dtype's matmul
    TFLOP/s ("matmul": the MFU of its FLOPs in its median time, gem_kernels.testing.peaks.mfu, which
    model.train prints too); None without a figure or without a measured peak of that kind."""
    if row["peak"] == "bandwidth" and row["gbps"] is not None and peaks.get("copy_gbps"):
        return 100 * row["gbps"] / peaks["copy_gbps"]
    if row["peak"] == "matmul" and row["tflops"] is not None:
        peak = peaks.get("matmul_tflops", {}).get(row["dtype"])
        if peak:
            return 100 * mfu(row["flops"], row["ms"], peak)
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
    # The same for the torch.compile'd peers (Case.compiled: inductor's rewrite of the eager code, FlexAttention):
    # reported and not timed, but not a failed run. Inductor sums a reduction in its own vectorised order
    # (measured: a 4096-row bias gradient 14 ulp off float64 at 2 threads on AVX-512, where ATen's cascade
    # sum is 1.3 ulp off), which a rule calibrated on the eager side can reject; it is not our kernels' defect.
    peer_mismatches: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


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
            # The first case runs whatever is left (verified, timed at the smallest cap): on a loaded
            # machine, building a family's inputs can eat its budget, and a family that verified
            # nothing would pass the run while proving nothing.
            if budget.left() <= 0 and case_no > 1:
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
    sync(device)
    return out, time.perf_counter() - t0


def _with_state(case: Case, impl: str, out: Any) -> Any:
    """What verification compares: the output, and the impl's state after the call when the case reads one."""
    return out if case.state is None else (out, case.state[impl]())


def _verification_call(case: Case, impl: str, fn: Callable[[], Any], device: torch.device):
    """(what verification compares, seconds of the call, the ReLU branches the call took or None).
    A compiled impl runs without the recording mode: a torch function mode active during its first
    call would be part of what dynamo guards on, and the timed calls after it would recompile."""
    if case.exact or impl in case.compiled:
        out, seconds = _timed_call(fn, device)
        return _with_state(case, impl, out), seconds, None
    with ReluBranches() as branches:
        out, seconds = _timed_call(fn, device)
    return _with_state(case, impl, out), seconds, branches.masks


class _Truths:
    """The float64 results of a case's ``fp64`` run: its own (ReLUs on their natural branches),
    computed once, and one per other set of branches an impl took."""

    def __init__(self, case: Case):
        self.case = case
        self.natural: Any = None
        self.natural_masks: list[torch.Tensor] | None = None

    def _run(self, replay: list[torch.Tensor] | None) -> tuple[Any, ReluBranches]:
        from gem_kernels.reference import float64_ground_truth

        with float64_ground_truth(), ReluBranches(replay) as branches:  # the reference backend takes float64
            return self.case.fp64(), branches

    def _natural(self) -> Any:
        if self.natural_masks is None:
            self.natural, branches = self._run(None)
            self.natural_masks = branches.masks
        return self.natural

    def for_branches(self, masks: list[torch.Tensor] | None) -> Any:
        """The float64 result on ``masks``' branches (None: the natural ones), or why there is none:
        the impl's forward took a branch far from a kink (wrong before any gradient is compared)."""
        natural = self._natural()
        if masks is None or _same_masks(masks, self.natural_masks):
            return natural
        truth, branches = self._run(masks)
        if branches.structure_mismatch or len(branches.masks) != len(masks):
            # Its ReLUs are not the float64 run's (another count or shape): compare with the natural run.
            return natural
        if branches.far_flips:
            return "the forward took the other side of a ReLU far from 0: " + "; ".join(branches.far_flips[:3])
        return truth


def _same_masks(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


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
            (result.peer_mismatches if impl in case.compiled else result.mismatches).append(f"{what} {impl}: {why}")
        log(f"{tag} !!!!! {msg}")
        failed[impl] = why
        del impls[impl]

    if case.reference is not None:
        truths = _Truths(case)
        # One output alive at a time besides the reference's: padded batches can be large.
        try:
            expected, seconds, branches = _verification_call(case, case.reference, impls[case.reference], device)
            calls[case.reference], spent[case.reference] = 1, seconds
            expected_truth = None if case.exact else truths.for_branches(branches)
            if isinstance(expected_truth, str):
                raise RuntimeError(f"its own float64 run: {expected_truth}")
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
                out, seconds, branches = _verification_call(case, impl, impls[impl], device)
                calls[impl], spent[impl] = 1, seconds
                if case.exact:
                    why = compare_exact(out, expected)
                else:
                    truth = truths.for_branches(branches)
                    why = truth if isinstance(truth, str) else compare(out, expected, truth, expected_truth)
                del out
                if why is not None:
                    fail(impl, f"MISMATCH vs {case.reference!r}{'' if case.exact else ' (float64 run)'}: {why}",
                         mismatch=True)
            except Exception as exc:
                fail(impl, f"raised {type(exc).__name__}: {_first_line(exc)}")
        del expected, truths
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

    roof: Timing | None = None
    gemm_roof: Timing | None = None

    def add_row(i: int, impl: str, timing: Timing) -> None:
        row = make_row(family, case, impl, timing, device, peaks, git_sha, timestamp, compile_s.get(impl), roof,
                       gemm_roof)
        rows.append(row)
        extra = f" {row['gbps']:.1f} GB/s" if row["gbps"] is not None else ""
        extra += f" {row['tflops']:.3g} TFLOP/s" if row["tflops"] is not None else ""
        log(f"{tag} {i + 1}/{len(names)} {case.op} {dtype_name(case.dtype)} {impl}: {row['ms']:.3f} ms "
            f"(p10 {row['ms_p10']:.3f}, p90 {row['ms_p90']:.3f}, p99 {row['ms_p99']:.3f}, n={row['repeats']}"
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
        # Interleaved, the gather roof among them; each one's cap is an even share of what is left,
        # keeping about one more case's worth for the cases after this one.
        fns = {n: impls[n] for n in names}
        if case.gather_roof is not None:
            fns[GATHER_ROOF] = case.gather_roof
        if case.gemm_roof is not None:
            fns[GEMM_ROOF] = case.gemm_roof
        cap = max(1e-3, min(settings.max_time, max(budget.left(), 0.0) / (2 * len(fns))))
        log(f"{tag} timing {case.op} {dtype_name(case.dtype)} [{case.shape}]: {', '.join(fns)} (interleaved)")
        with _no_recompiles():
            timings, errors = measure_interleaved(fns, settings, {n: cap for n in fns}, warmed, min_calls)
        def take_roof(name: str, label: str, what: str) -> Timing | None:
            # The roof's timing out of the interleaved run, with a note; an error of the run if it raised.
            timing = timings.pop(name, None)
            if timing is None:
                exc = errors.pop(name)
                why = f"the {label} raised while timed: {type(exc).__name__}: {_first_line(exc)}"
                result.errors.append(f"{case.op} [{case.shape}]: {why}")
                log(f"{tag} ERROR {why}")
                return None
            result.notes.append(
                f"{case.op} [{case.shape}]: {label}{what} timed interleaved with the impls: {timing.median_ms:.3f} ms "
                f"(p10-p90 {timing.p10_ms:.3f}-{timing.p90_ms:.3f}, n={timing.repeats}, "
                f"{timing.page_faults or 0:.0f} faults/call); '% of {'gather' if name == GATHER_ROOF else 'its GEMMs'}' "
                f"= its median / the impl's")
            log(f"{tag} {label} (interleaved): {timing.median_ms:.3f} ms (p10 {timing.p10_ms:.3f}, "
                f"p90 {timing.p90_ms:.3f}, n={timing.repeats})")
            return timing

        if case.gather_roof is not None:
            roof = take_roof(GATHER_ROOF, "gather roof", "")
        if case.gemm_roof is not None:
            gemm_roof = take_roof(GEMM_ROOF, "GEMM roof", " (its matrix products alone, same shapes and layouts)")
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

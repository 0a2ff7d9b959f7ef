"""The bench harness: rotate, timing statistics, verification, rows, and an end-to-end quick run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import harness
from bench.__main__ import FAMILIES, load_family
from gem_kernels import _backend as gk_backend

REPO = Path(__file__).resolve().parent.parent
ROW_FIELDS = ("op", "shape", "dtype", "device", "impl", "ms", "ms_p10", "ms_p90", "ms_p99", "tflops", "gbps",
              "pct_peak", "speedup_vs_baseline", "baseline", "git_sha", "timestamp")


def _run_bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------


def test_rotate_cycles_through_the_sets_in_order():
    seen = []
    fn = harness.rotate([(1, "a"), (2, "b"), (3, "c")], lambda x, y: seen.append((x, y)) or x)
    assert [fn() for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert seen[:3] == [(1, "a"), (2, "b"), (3, "c")]
    # Independent rotations start from the first set each.
    assert harness.rotate([(5,), (6,)], lambda x: x)() == 5


def test_rotate_rejects_no_sets():
    with pytest.raises(ValueError, match="at least one"):
        harness.rotate([], lambda: None)


def test_percentile_interpolates_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert harness.percentile(values, 50) == 3.0
    assert harness.percentile(values, 0) == 1.0
    assert harness.percentile(values, 100) == 5.0
    assert harness.percentile(values, 10) == pytest.approx(1.4)
    assert harness.percentile(values, 90) == pytest.approx(4.6)
    assert harness.percentile([7.0], 10) == 7.0
    with pytest.raises(ValueError):
        harness.percentile([], 50)


def test_timing_statistics_in_ms():
    timing = harness.Timing(times=[0.004, 0.001, 0.003, 0.002, 0.010], capped=False)
    assert timing.repeats == 5
    assert timing.median_ms == pytest.approx(3.0)
    assert timing.p10_ms == pytest.approx(1.4)
    assert timing.p90_ms == pytest.approx(7.6)


def test_measure_reaches_min_repeats_and_min_time():
    calls = []
    settings = harness.Settings(min_repeats=7, min_time=0.02, max_time=5.0, warmup_time=0.0)
    timing = harness.measure(lambda: calls.append(1), torch.device("cpu"), settings)
    assert not timing.capped
    assert timing.repeats >= 7
    assert sum(timing.times) <= 0.02 + 0.5  # stopped soon after min_time, not at max_time
    assert len(calls) >= timing.repeats + 1  # at least one warm-up call


def test_measure_stops_at_max_time_with_fewer_repeats():
    settings = harness.Settings(min_repeats=1000, min_time=10.0, max_time=0.15, warmup_time=0.0)
    start = time.perf_counter()
    timing = harness.measure(lambda: time.sleep(0.02), torch.device("cpu"), settings)
    # Ignoring max_time would take >= 10 s (min_time); the margin above 0.15 s is for a busy host
    # (the gc.collect before the clock, scheduling), where 1 s failed in CI.
    assert time.perf_counter() - start < 5.0
    assert timing.capped
    assert 1 <= timing.repeats < 1000
    assert all(t >= 0.02 for t in timing.times)
    assert timing.median_ms >= 20.0


def test_measure_makes_one_timed_call_when_a_single_call_exceeds_max_time():
    settings = harness.Settings(min_repeats=10, min_time=1.0, max_time=0.01, warmup_time=0.0)
    calls = []
    timing = harness.measure(lambda: calls.append(time.sleep(0.03)), torch.device("cpu"), settings, warmed=0.03)
    assert timing.repeats == 1 and timing.capped
    assert len(calls) == 1  # the verification call already warmed it up: no extra warm-up


def test_measure_interleaved_alternates_impls_and_stops_each_on_its_own():
    order = []

    def make(name, seconds):
        def fn():
            order.append(name)
            time.sleep(seconds)
        return fn

    def broken():
        raise RuntimeError("boom")

    settings = harness.Settings(min_repeats=4, min_time=0.0, max_time=5.0, warmup_time=0.0)
    fns = {"a": make("a", 0.001), "b": make("b", 0.001), "slow": make("slow", 0.05), "broken": broken}
    timings, failed = harness.measure_interleaved(fns, settings, {"a": 5.0, "b": 5.0, "slow": 0.12, "broken": 5.0})
    assert set(failed) == {"broken"} and "boom" in str(failed["broken"])
    assert timings["a"].repeats == 4 and timings["b"].repeats == 4 and not timings["a"].capped
    timed = order[3:]  # after one warm-up call each of a, b, slow
    assert timed[:3] == ["a", "b", "slow"] and timed[3:6] == ["a", "b", "slow"]  # round-robin
    assert timings["slow"].capped and 1 <= timings["slow"].repeats < 4


def test_compare_exact_reports_mismatches():
    a = torch.arange(6.0).view(2, 3)
    assert harness.compare_exact(a.clone(), a) is None
    b = a.clone()
    b[1, 2] += 1e-3
    assert "1 of 6 elements differ" in harness.compare_exact(b, a)
    assert "rows [1] (1 of 2)" in harness.compare_exact(b, a)
    assert "shape" in harness.compare_exact(a[:1], a)
    assert harness.compare_exact((a, 2.0), (a, 2.0)) is None
    nan = a.clone()
    nan[0, 0] = float("nan")
    assert harness.compare_exact(nan, a) is not None
    assert harness.compare_exact(nan, nan.clone()) is None  # NaN where NaN


def test_compare_is_flashattention_rule_against_float64():
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(1000, generator=g, dtype=torch.float64)
    eager = truth.float()  # one rounding: eager's error is at most half an ulp
    eager_err = float((eager.double() - truth).abs().max())
    atol = harness.rounding_atol(truth, torch.float32)
    assert harness.compare(eager.clone(), eager, truth) is None
    near = eager.clone()
    near[17] = float(truth[17]) + 0.9 * (2 * eager_err + atol)  # within twice eager's error plus the atol
    assert harness.compare(near, eager, truth) is None
    off = eager.clone()
    off[17] = float(truth[17]) + 1.2 * (2 * eager_err + atol)  # past it
    why = harness.compare(off, eager, truth)
    assert "FlashAttention's rule" in why and "rows [17]" in why
    # A scalar whose eager result happens to round exactly: the atol floor (ATOL_ULPS) lets another
    # summation order be a few units in the last place away, not more.
    loss = torch.tensor(0.6931471805599453, dtype=torch.float64)
    exact = loss.float()
    ulp = torch.finfo(torch.float32).eps * 0.6931
    assert harness.compare(exact + 2 * ulp, exact, loss) is None
    assert harness.compare(exact + 20 * ulp, exact, loss) is not None
    # Integers (row ids) are equal or wrong; NaN where the float64 run has NaN.
    assert "entries differ" in harness.compare(torch.tensor([1, 2]), torch.tensor([1, 2]), torch.tensor([1, 3]))
    nan = torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    assert harness.compare(nan.float(), nan.float(), nan) is None
    assert "NaN/inf" in harness.compare(torch.tensor([0.0, 1.0]), nan.float(), nan)


def _case(impls, **kw):
    defaults = dict(op="copy", shape="n=8", dtype=torch.float32, flops=0, bytes=64, impls=impls, baseline="slow",
                    reference="slow", exact=True)
    defaults.update(kw)
    return harness.Case(**defaults)


def test_run_family_drops_wrong_impls_and_computes_speedups():
    x = torch.arange(8.0)

    def slow():
        time.sleep(0.004)
        return x.clone()

    def wrong():
        return x + 1

    def broken():
        raise RuntimeError("no kernel here")

    settings = harness.Settings(min_repeats=3, min_time=0.0, max_time=0.5, warmup_time=0.0)
    peaks = {"copy_gbps": 10.0, "matmul_tflops": {"float32": 1.0}}
    result = harness.run_family(
        "fake", iter([_case({"slow": slow, "fast": lambda: x.clone(), "wrong": wrong, "broken": broken})]),
        torch.device("cpu"), settings, harness.Budget(30.0), peaks, "sha", "ts")
    assert result.status == "ok"
    by_impl = {row["impl"]: row for row in result.rows if row["status"] == "ok"}
    assert set(by_impl) == {"slow", "fast"}
    assert len(result.mismatches) == 1 and "wrong" in result.mismatches[0]
    assert any("broken" in e and "no kernel here" in e for e in result.errors)
    # The failed impls keep a row, with the reason and no time.
    failed = {row["impl"]: row for row in result.rows if row["status"] == "failed"}
    assert set(failed) == {"wrong", "broken"}
    assert "MISMATCH" in failed["wrong"]["failed"] and "no kernel here" in failed["broken"]["failed"]
    assert all(row["ms"] is None and row["speedup_vs_baseline"] is None for row in failed.values())
    assert by_impl["fast"]["verified_against"] == "slow" and by_impl["slow"]["verified_against"] is None
    slow_row, fast_row = by_impl["slow"], by_impl["fast"]
    assert slow_row["speedup_vs_baseline"] == pytest.approx(1.0)
    assert fast_row["speedup_vs_baseline"] == pytest.approx(slow_row["ms"] / fast_row["ms"])
    assert fast_row["speedup_vs_baseline"] > 1
    assert fast_row["gbps"] == pytest.approx(64 / (fast_row["ms"] / 1e3) / 1e9)
    assert fast_row["pct_peak"] == pytest.approx(100 * fast_row["gbps"] / 10.0)
    assert fast_row["tflops"] is None
    for field in ROW_FIELDS:
        assert field in fast_row


def test_a_compiled_peer_outside_the_rule_is_reported_apart():
    """A torch.compile'd peer (Case.compiled) that falls outside the rule is dropped and reported in
    peer_mismatches, which do not fail the run; our impl outside it is a mismatch, which does."""
    x = torch.arange(8.0)
    settings = harness.Settings(min_repeats=2, min_time=0.0, max_time=0.1, warmup_time=0.0)
    case = _case({"slow": lambda: x.clone(), "wrong": lambda: x + 1, "compile": lambda: x + 2}, compiled=("compile",))
    result = harness.run_family("peers", iter([case]), torch.device("cpu"), settings, harness.Budget(30.0),
                                {"copy_gbps": 10.0, "matmul_tflops": {"float32": 1.0}}, "sha", "ts")
    assert len(result.mismatches) == 1 and "wrong" in result.mismatches[0], result.mismatches
    assert len(result.peer_mismatches) == 1 and "compile" in result.peer_mismatches[0], result.peer_mismatches
    failed = {row["impl"] for row in result.rows if row["status"] == "failed"}
    assert failed == {"wrong", "compile"}


def test_run_family_matmul_peak_and_skip_and_budget():
    settings = harness.Settings(min_repeats=2, min_time=0.0, max_time=0.1, warmup_time=0.0)
    peaks = {"copy_gbps": 10.0, "matmul_tflops": {"float32": 2.0}}
    case = _case({"slow": lambda: time.sleep(0.002)}, flops=10**9, bytes=0, peak="matmul", reference=None,
                 unverified="sleeps, returns nothing")
    result = harness.run_family("mm", iter([case]), torch.device("cpu"), settings, harness.Budget(30.0), peaks,
                                "sha", "ts")
    (row,) = result.rows
    assert row["gbps"] is None
    assert row["pct_peak"] == pytest.approx(100 * row["tflops"] / 2.0)

    def skipping():
        raise harness.SkipFamily("no model here")
        yield  # pragma: no cover

    result = harness.run_family("skip", skipping(), torch.device("cpu"), settings, harness.Budget(30.0), peaks,
                                "sha", "ts")
    assert result.status == "skipped" and "no model here" in result.notes[0]

    result = harness.run_family("late", iter([case, case]), torch.device("cpu"), settings, harness.Budget(0.0),
                                peaks, "sha", "ts")
    assert result.status == "partial" and len(result.rows) == 1  # the first case runs whatever the budget
    assert "budget" in result.notes[-1] and "case 2" in result.notes[-1]


def test_a_family_past_its_budget_still_verifies_its_first_case():
    """On a loaded machine a family's budget can be spent before its first case (building the
    inputs): the run then verified nothing and exited 0. The first case is verified anyway."""
    x = torch.arange(8.0)
    settings = harness.Settings(min_repeats=2, min_time=0.0, max_time=0.1, warmup_time=0.0)
    case = _case({"slow": lambda: x.clone(), "wrong": lambda: x + 1})
    result = harness.run_family("late", iter([case]), torch.device("cpu"), settings, harness.Budget(0.0),
                                {"copy_gbps": 10.0, "matmul_tflops": {"float32": 1.0}}, "sha", "ts")
    assert len(result.mismatches) == 1 and "wrong" in result.mismatches[0], result.mismatches


def test_load_family_reports_missing_and_broken_modules(tmp_path, monkeypatch):
    (tmp_path / "gk_broken_family.py").write_text("raise ImportError('needs gem_kernels.not_there')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(FAMILIES, "broken", "gk_broken_family")
    monkeypatch.setitem(FAMILIES, "missing", "gk_no_such_family")
    module, why = load_family("broken")
    assert module is None and "failed to import" in why and "not_there" in why
    module, why = load_family("missing")
    assert module is None and why.endswith("does not exist yet")
    assert load_family("jagged")[0] is not None


def test_lognormal_workload_is_fixed_and_capped():
    from bench.jagged import MAX_LEN, lognormal_offsets

    offsets = lognormal_offsets(2048)
    lengths = offsets.diff()
    assert torch.equal(offsets, lognormal_offsets(2048))
    assert int(lengths.max()) <= MAX_LEN and int(lengths.min()) >= 0
    assert 85 <= float(lengths.float().mean()) <= 105  # mean 100 before the cap


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


def test_list_names_every_family():
    proc = _run_bench("--list", "--quick")
    assert proc.returncode == 0, proc.stderr
    for name in FAMILIES:
        assert f"{name}:" in proc.stdout
    assert "jagged_to_padded" in proc.stdout and "padded_to_jagged" in proc.stdout


def test_quick_jagged_run_writes_results(tmp_path):
    proc = _run_bench("jagged", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jsons = [p for p in tmp_path.glob("cpu-*.json")]
    assert len(jsons) == 1
    stem = jsons[0].with_suffix("")
    for ext in ("md", "png"):
        assert stem.with_suffix(f".{ext}").stat().st_size > 0
        assert (tmp_path / f"latest-cpu.{ext}").exists()
    assert (tmp_path / f"{stem.name}-speedup.png").stat().st_size > 0
    assert (tmp_path / "latest-cpu-speedup.png").exists()
    result = json.loads(jsons[0].read_text())
    peaks = result["peaks"]
    assert peaks["copy_gbps"] > 0 and peaks["matmul_tflops"]["float32"] > 0
    # Measured before and after the kernels; the roof is the better of the two, and every row's % of
    # peak is relative to that roof.
    before, after = peaks["measurements"]
    assert peaks["copy_gbps"] == max(before["copy_gbps"], after["copy_gbps"])
    assert peaks["matmul_tflops"]["float32"] == max(before["matmul_tflops"]["float32"],
                                                    after["matmul_tflops"]["float32"])
    for row in result["rows"]:
        assert row["pct_peak"] == pytest.approx(100 * row["gbps"] / peaks["copy_gbps"])
    assert result["machine"]["cpu_cores"] >= 1 and result["git_sha"]
    rows = result["rows"]
    assert rows
    for row in rows:
        for field in ROW_FIELDS:
            assert field in row, field
        assert row["ms"] > 0 and row["ms_p10"] <= row["ms"] <= row["ms_p90"] <= row["ms_p99"]
        assert row["device"] == "cpu" and row["baseline"] == "aten"
        assert row["gbps"] > 0
        assert row["page_faults_per_call"] is not None and row["page_faults_per_call"] >= 0
        assert row["status"] == "ok" and row["verified_against"] in ("reference", None)
        assert row["compile_s"] is None and row["gbps_formula"] is None
    cpu_rows = [r for r in rows if r["impl"] == "cpu" and r["op"] == "jagged_to_padded"]
    assert cpu_rows, "the cpu backend was not timed"
    aten = {(r["op"], r["shape"], r["dtype"]): r["ms"] for r in rows if r["impl"] == "aten"}
    checked = 0
    for row in rows:
        key = (row["op"], row["shape"], row["dtype"])
        if key in aten:
            assert row["speedup_vs_baseline"] == pytest.approx(aten[key] / row["ms"])
            checked += 1
    assert checked >= 2
    assert not [m for f in result["families"] for m in f["mismatches"]]
    assert "| jagged | jagged_to_padded |" in proc.stdout


@pytest.mark.parametrize("inherited", [signal.default_int_handler, signal.SIG_IGN], ids=["foreground", "background"])
def test_interrupted_run_still_writes_what_it_measured(tmp_path, monkeypatch, inherited):
    """SIGINT (`timeout -s INT` in scripts/gpu_check.sh) mid-family: the rows measured so far are
    written, the family is marked interrupted, later families are skipped, and the exit status is 130.

    "background": a process started with `&` by a non-interactive shell inherits SIGINT ignored (the
    cause of this test's one failure: run that way, the fake impl's SIGINT was ignored 12,569 times and
    the run exited 0); the bench installs its handler explicitly, and restores the inherited one."""
    import bench.__main__ as bench_main

    (tmp_path / "gk_fake_families.py").write_text(
        "import os, signal, torch\n"
        "from bench import harness\n"
        "def case(impl):\n"
        "    return harness.Case(op='copy', shape='n=8', dtype=torch.float32, flops=0, bytes=64,\n"
        "                        impls={'eager': impl}, baseline='eager', reference='eager',\n"
        "                        exact=True)\n"
        "def interrupt():\n"
        "    signal.raise_signal(signal.SIGINT)  # runs the Python handler before returning\n"
        "    raise AssertionError('SIGINT was ignored')\n"
        # Budgets no load can spend before the interrupting case: under a load of ~8 on 2 cores the
        # quick run's 7 s share went to the first case and the interrupting one was skipped (exit 0).
        "BUDGET = {True: 600.0, False: 600.0}\n"
        "class done:\n"
        "    FAMILY_BUDGET = BUDGET\n"
        "    cases = staticmethod(lambda quick, device: iter([case(lambda: torch.zeros(8))]))\n"
        "class interrupted:\n"
        "    FAMILY_BUDGET = BUDGET\n"
        "    cases = staticmethod(lambda quick, device: iter([case(lambda: torch.zeros(8)), case(interrupt)]))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fake = __import__("gk_fake_families")
    monkeypatch.setattr(bench_main, "FAMILIES", {"done": "x", "interrupted": "x", "after": "x"})
    monkeypatch.setattr(bench_main, "load_family",
                        lambda name: (getattr(fake, name, fake.done), None))
    previous = signal.signal(signal.SIGINT, inherited)
    try:
        assert bench_main.main(["--quick", "--no-thp", "--budget", "1800", "--out", str(tmp_path)]) == 130
        assert signal.getsignal(signal.SIGINT) is inherited
    finally:
        signal.signal(signal.SIGINT, previous)
    (path,) = tmp_path.glob("cpu-*.json")
    result = json.loads(path.read_text())
    status = {f["name"]: f["status"] for f in result["families"]}
    assert status == {"done": "ok", "interrupted": "interrupted", "after": "skipped"}
    assert len(result["rows"]) == 2  # done's case and interrupted's first case


def test_rows_above_their_peak_are_explained():
    from bench import report

    def row(op, peak, pct):
        return {"op": op, "shape": "n=8", "impl": "gem_kernels", "peak": peak, "pct_peak": pct}

    # At or below the roof, or without one: nothing to explain.
    assert report._above_peak([row("a", "bandwidth", 100.0), row("b", "matmul", None)]) == []
    rows = [row("gather", "bandwidth", 250.0), row("mm", "matmul", 140.0), row("copy", "bandwidth", 99.0)]
    (line,) = report._above_peak(rows)
    # Each row above is named with its figure, the one below is not, and each kind present is explained.
    assert line.startswith("- 2 rows are above 100 % of their measured peak")
    assert "gather [n=8] gem_kernels 250 %" in line and "mm [n=8] gem_kernels 140 %" in line
    assert "copy" not in line
    assert "bandwidth rows:" in line and "matmul rows:" in line
    (line,) = report._above_peak(rows[:1])
    assert line.startswith("- 1 rows") and "matmul rows:" not in line and "bandwidth rows:" in line


def test_rows_with_few_repeats_are_flagged_and_give_no_goal_speedup():
    from bench import report

    def row(impl, ms, repeats):
        return {"family": "f", "op": "op", "shape": "n=8", "dtype": "fp32", "impl": impl, "baseline": "eager",
                "ms": ms, "ms_p10": ms, "ms_p90": ms, "repeats": repeats, "capped": repeats < 5, "tflops": None,
                "gbps": None, "pct_peak": None, "peak": None}

    rows = [row("eager", 4.0, 10), row("fused", 1.0, 10), row("slow_timed", 2.0, 3)]
    harness.fill_speedups(rows)
    assert [r["speedup_vs_baseline"] for r in rows] == [1.0, 4.0, 2.0]
    assert [r["few_repeats"] for r in rows] == [False, False, True]
    assert [r["speedup_for_goals"] for r in rows] == [1.0, 4.0, None]
    lines = report.table_lines(rows)
    assert "| 3* (few) |" in lines[-1] and "(few)" not in lines[-2]
    # A baseline timed too few times makes every speedup of its case unusable for a goal.
    rows = [row("eager", 4.0, 2), row("fused", 1.0, 10)]
    harness.fill_speedups(rows)
    assert [r["speedup_for_goals"] for r in rows] == [None, None]


# ---------------------------------------------------------------------------------------------
# Issue 18: compiled impls, the embedding floor, verification of fwd+bwd and state, figures
# ---------------------------------------------------------------------------------------------

PEAKS = {"copy_gbps": 10.0, "matmul_tflops": {"float32": 1.0}}


def _run(cases, settings=None):
    settings = settings or harness.Settings(min_repeats=3, min_time=0.0, max_time=0.2, warmup_time=0.0)
    return harness.run_family("fake", iter(cases), torch.device("cpu"), settings, harness.Budget(60.0), PEAKS,
                              "sha", "ts")


def _compiled_double():
    torch._dynamo.reset()
    return torch.compile(lambda x: x * 2, backend="eager", dynamic=False)


def test_compiled_impl_is_primed_on_every_input_set_and_reaches_five_repeats():
    fn = _compiled_double()
    sets = [(torch.ones(3),), (torch.ones(5),)]  # a graph per shape (dynamic=False)
    # A time cap far below one call's worth: the compiled impl still gets MIN_REPEATS_FOR_GOALS calls.
    settings = harness.Settings(min_repeats=50, min_time=10.0, max_time=1e-6, warmup_time=0.0)
    case = _case({"slow": harness.rotate(sets, lambda x: x * 2), "compiled": harness.rotate(sets, fn)},
                 compiled=["compiled"])
    result = _run([case], settings)
    rows = {row["impl"]: row for row in result.rows}
    assert not result.errors, result.errors
    assert rows["compiled"]["status"] == "ok" and rows["compiled"]["compiled"]
    assert rows["compiled"]["compile_s"] > 0 and rows["slow"]["compile_s"] is None
    assert rows["compiled"]["repeats"] >= harness.MIN_REPEATS_FOR_GOALS
    assert rows["slow"]["repeats"] >= harness.MIN_REPEATS_FOR_GOALS  # the baseline its speedup divides
    assert rows["compiled"]["speedup_for_goals"] is not None


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "unmarked"])
def test_compiled_impl_that_recompiles_while_timed_fails_with_recompile_error(marked):
    fn = _compiled_double()
    size = iter(range(2, 10_000))  # a new shape every call: a compile on every call, timed ones included
    case = _case({"slow": lambda: torch.ones(3), "compiled": lambda: fn(torch.ones(next(size)))[:0] + 1},
                 reference=None, unverified="a shape-changing fake", compiled=["compiled"] if marked else [])
    result = _run([case])
    rows = {row["impl"]: row for row in result.rows}
    assert rows["slow"]["status"] == "ok"
    assert rows["compiled"]["status"] == "failed" and rows["compiled"]["ms"] is None
    assert rows["compiled"]["failed"].startswith("RecompileError: copy [n=8] impl 'compiled'")


def test_run_exits_nonzero_when_a_row_recompiled(tmp_path, monkeypatch):
    import bench.__main__ as bench_main

    class fake:
        @staticmethod
        def cases(quick, device):
            fn = _compiled_double()
            size = iter(range(2, 10_000))
            yield _case({"slow": lambda: torch.ones(3), "compiled": lambda: fn(torch.ones(next(size)))[:0] + 1},
                        reference=None, unverified="fake", compiled=["compiled"])

    monkeypatch.setattr(bench_main, "FAMILIES", {"fake": "x"})
    monkeypatch.setattr(bench_main, "load_family", lambda name: (fake, None))
    assert bench_main.main(["--quick", "--no-thp", "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("where", ["cases", "first case"])
def test_run_exits_nonzero_when_a_family_fails(tmp_path, monkeypatch, capsys, where):
    """A family whose cases() raises verified nothing, so the run fails (bench.sh --quick in CI exited 0
    while the inference family died on a Case argument the harness no longer takes)."""
    import bench.__main__ as bench_main

    class broken:
        @staticmethod
        def cases(quick, device):
            if where == "cases":
                raise TypeError("cases() broke")
            yield _case({"impl": lambda: torch.ones(3)}, tolerance=1)

    monkeypatch.setattr(bench_main, "FAMILIES", {"broken": "x"})
    monkeypatch.setattr(bench_main, "load_family", lambda name: (broken, None))
    assert bench_main.main(["--quick", "--no-thp", "--out", str(tmp_path)]) == 1
    assert "!!! family broken failed" in capsys.readouterr().err


def test_case_needs_a_reference_or_an_unverified_reason():
    with pytest.raises(ValueError, match="unverified"):
        _case({"slow": lambda: 1.0}, reference=None)
    with pytest.raises(ValueError, match="unverified"):
        _case({"slow": lambda: 1.0}, unverified="both given")
    with pytest.raises(ValueError, match="compiled"):
        _case({"slow": lambda: 1.0}, compiled=["missing"])
    # A verified case names its float64 run (FlashAttention's rule) or says it is a copy (exact).
    with pytest.raises(ValueError, match="fp64"):
        _case({"slow": lambda: 1.0}, exact=False)
    with pytest.raises(ValueError, match="fp64"):
        _case({"slow": lambda: 1.0}, fp64=lambda: 1.0)
    result = _run([_case({"slow": lambda: 1.0}, reference=None, exact=False,
                         unverified="returns nothing comparable")])
    (row,) = result.rows
    assert row["unverified"] == "returns nothing comparable" and row["verified_against"] is None
    from bench import report

    assert "UNVERIFIED: returns nothing comparable" in report.table_lines(result.rows)[-1]


def _fwd_bwd_impl(grad_error=0.0, dtype=torch.float32):
    x = torch.linspace(0.1, 3.0, 64, dtype=dtype, requires_grad=True)

    def step():
        out = (x.exp() * x).sum()
        (grad,) = torch.autograd.grad(out, [x])
        return out.detach(), [grad + grad_error]
    return step


def test_a_wrong_gradient_fails_the_case_before_timing():
    calls = {"wrong": 0}
    wrong = _fwd_bwd_impl(grad_error=1e-4)

    def counted():
        calls["wrong"] += 1
        return wrong()

    result = _run([_case({"slow": _fwd_bwd_impl(), "ok": _fwd_bwd_impl(), "wrong": counted}, exact=False,
                         fp64=_fwd_bwd_impl(dtype=torch.float64))])
    rows = {row["impl"]: row for row in result.rows}
    assert rows["ok"]["status"] == "ok" and rows["ok"]["verified_against"] == "slow"
    assert rows["wrong"]["status"] == "failed" and "MISMATCH" in rows["wrong"]["failed"]
    assert "[1][0]" in rows["wrong"]["failed"]  # the path of the gradient in the output
    assert calls["wrong"] == 1  # verified once, never timed


def test_a_wrong_state_after_the_update_fails_the_case():
    tables = {name: torch.zeros(4) for name in ("slow", "ok", "wrong")}

    def update(name, step):
        def run():
            tables[name] += step
            return torch.ones(2)  # the outputs agree; only the update differs
        return run

    state = {name: (lambda name=name: {"table": tables[name]}) for name in tables}
    result = _run([_case({"slow": update("slow", 1.0), "ok": update("ok", 1.0), "wrong": update("wrong", 2.0)},
                         state=state)])
    rows = {row["impl"]: row for row in result.rows}
    assert rows["ok"]["status"] == "ok"
    assert rows["wrong"]["status"] == "failed" and "['table']" in rows["wrong"]["failed"]


def _relu_case(shift_unit: int, shift: float):
    """pre-activations p -> sum(relu(p) * c), gradient of p: eager in fp32, float64 truth, and an
    impl whose pre-activation of one unit is moved by ``shift`` (as another summation order moves a
    unit near 0 across it, or a wrong forward moves one far)."""
    g = torch.Generator().manual_seed(3)
    p64 = torch.randn(64, generator=g, dtype=torch.float64)
    p64[0] = 0.5
    p64[5] = 4e-8  # a unit within rounding of the kink
    c64 = torch.randn(64, generator=g, dtype=torch.float64)

    def run(dtype, delta=0.0):
        def call():
            p = p64.to(dtype).clone().requires_grad_()
            pre = p + torch.nn.functional.one_hot(torch.tensor(shift_unit), 64).to(dtype) * delta
            out = (torch.relu(pre) * c64.to(dtype)).sum()
            (grad,) = torch.autograd.grad(out, [p])
            return out.detach(), [grad]
        return call

    return _case({"eager": run(torch.float32), "impl": run(torch.float32, shift)}, reference="eager", exact=False,
                 baseline="eager", fp64=run(torch.float64))


def test_relu_kink_crossed_by_rounding_is_followed_by_the_float64_run():
    # The impl's unit 5 lands at -6e-8 (another summation order): its gradient there is 0, eager's and
    # the float64 run's c[5]. Not a rounding difference, yet both are right: the float64 run of the
    # impl takes the impl's branch, and the impl passes.
    result = _run([_relu_case(5, -1e-7)])
    rows = {row["impl"]: row for row in result.rows}
    assert rows["impl"]["status"] == "ok", rows["impl"]["failed"]
    # Without the replay (the float64 run on its own branches) the same impl fails on the gradient.
    flat = _relu_case(5, -1e-7)
    out = flat.impls["impl"]()
    with harness.ReluBranches() as natural:
        truth = flat.fp64()
    assert natural.masks[0][5]
    assert "[1][0]" in harness.compare(out, flat.impls["eager"](), truth)


def test_relu_branch_taken_far_from_the_kink_fails():
    result = _run([_relu_case(0, -10.0)])  # a wrong forward: unit 0 moved by 10, far past the margin
    rows = {row["impl"]: row for row in result.rows}
    assert rows["impl"]["status"] == "failed"
    assert "other side of a ReLU far from 0" in rows["impl"]["failed"], rows["impl"]["failed"]


def test_relu_branches_follow_modules_functional_and_inplace_calls():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(True))
    x = torch.randn(32, 8)
    with harness.ReluBranches() as rec:
        out = torch.nn.functional.relu(mlp(x)) + x.relu().sum()
    assert [m.shape for m in rec.masks] == [(32, 16), (32, 16), (32, 16), (32, 8)]
    flipped = [m.clone() for m in rec.masks]
    flipped[0][0, 0] = ~flipped[0][0, 0]
    with harness.ReluBranches(replay=flipped) as replay:
        again = torch.nn.functional.relu(mlp(x)) + x.relu().sum()
    assert replay.structure_mismatch is None and len(replay.masks) == 4
    assert not torch.equal(again, out) or bool(replay.far_flips)  # the forced branch changed the result
    with harness.ReluBranches(replay=rec.masks[:1]) as short:
        mlp(x)
    assert "no counterpart" in short.structure_mismatch


def test_reference_backend_computes_float64_for_the_ground_truth_only():
    """The float64 ground truth of the bench's rule: inside float64_ground_truth() the reference twins
    keep float64 (they used to cast to fp32); the other backends refuse it by name, and outside the
    context every backend refuses it as before."""
    import gem_kernels as gk
    from gem_kernels.reference import float64_ground_truth
    from gem_kernels.reference import interaction as eager_ref

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    q, k, v = (torch.randn(7, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    offsets = torch.tensor([0, 3, 7])
    with float64_ground_truth():
        out = gk.fm_compress(x, y, backend="reference")
        att = gk.jagged_attention(q, k, v, offsets, 4, kind="softmax", causal=False, backend="reference")
        with pytest.raises(ValueError, match="only the reference backend computes"):
            gk.fm_compress(x.detach(), y.detach(), backend="cpu")
        with pytest.raises(ValueError, match="only the reference backend computes"):
            gk.jagged_attention(q, k, v, offsets, 4, kind="softmax", causal=False, backend="cpu")
    want = eager_ref.eager_fm_compress(x, y)
    assert out.dtype == torch.float64 and float((out - want).detach().abs().max()) < 1e-12
    grads = torch.autograd.grad(out.square().sum(), [x, y])
    want_grads = torch.autograd.grad(want.square().sum(), [x, y])
    assert all(float((a - b).abs().max()) < 1e-10 for a, b in zip(grads, want_grads))
    for b in range(2):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        qb, kb, vb = (t[lo:hi].transpose(0, 1) for t in (q, k, v))
        w = torch.softmax(qb @ kb.transpose(1, 2) / 2.0, -1)
        assert float((att[lo:hi] - (w @ vb).transpose(0, 1)).abs().max()) < 1e-13
    for backend in ("reference", "cpu"):
        with pytest.raises(ValueError, match="x must have dtype"):
            gk.fm_compress(x.detach(), y.detach(), backend=backend)


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability(), reason="no ATen CPU capability to pin")
def test_model_case_verifies_on_other_cpu_code_paths():
    """The failure first seen on an AMD EPYC (`bash scripts/bench.sh` exit 1: the fused model step
    "MISMATCH vs 'eager'", 7 of 32768 elements of a Wukong MLP weight 9e-4 apart after Adam's first
    step) reproduces here with ATen's portable kernels (ATEN_CPU_CAPABILITY=default), exactly: the
    gradients before the step agree with float64 (one ReLU unit of 149k takes the other branch, by
    rounding), and Adam's first step, lr * g / (|g| + eps), turns the gradient elements near eps into
    updates up to 2 lr apart. The rule now compares gradients against float64 on the impl's own
    branches and no state after Adam's first step: the case verifies, at 1 thread and at 2."""
    pytest.importorskip("torchrec")
    code = (
        "import torch\n"
        "from bench import harness, model\n"
        "settings = harness.Settings(min_repeats=1, min_time=0.0, max_time=0.0, warmup_time=0.0)\n"
        "r = harness.run_family('model', model.cases(False, torch.device('cpu')), torch.device('cpu'), settings,\n"
        "                       harness.Budget(600.0), {}, 'sha', 'ts')\n"
        "print('ERRORS', r.errors)\n"
        "print('ROWS', [(row['impl'], row['status']) for row in r.rows])\n")
    for threads in ("1", "2"):
        env = dict(os.environ, ATEN_CPU_CAPABILITY="default", OMP_NUM_THREADS=threads,
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr
        assert "ERRORS []" in proc.stdout, proc.stdout
        assert "('fused', 'ok')" in proc.stdout and "('eager', 'ok')" in proc.stdout, proc.stdout


def test_compare_reads_only_the_keys_an_impl_returns():
    want = {"a": torch.ones(2, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}
    eager = {k: v.float() for k, v in want.items()}
    assert harness.compare({"a": torch.ones(2)}, eager, want) is None
    assert "reference has no" in harness.compare({"c": torch.ones(2)}, eager, want)
    assert "['b']" in harness.compare({"b": torch.ones(2)}, eager, want)


def test_embedding_bag_floor_counts_each_distinct_row_once():
    from gem_kernels import flops

    # 2 tables (D 4 and 8), B = 2: table 0 bags [1, 1, 2] and [1], table 1 bags [] and [5, 5].
    indices = torch.tensor([1, 1, 2, 1, 5, 5])
    offsets = torch.tensor([0, 3, 4, 4, 6])
    dims, batch, elem = [4, 8], 2, 4
    assert flops.embedding_bag_distinct_rows(indices, offsets, 2, batch) == [2, 1]
    rows = (2 * 4 + 1 * 8) * elem  # rows 1 and 2 of table 0, row 5 of table 1: once each
    output = batch * (4 + 8) * elem
    index = 6 * 8 + 5 * 8
    assert flops.embedding_bag_floor(indices, offsets, dims, batch, elem) == rows + output + index
    # FBGEMM's formula reads a row per lookup: 4 lookups of D 4, 2 of D 8.
    _, formula = flops.embedding_bag([4, 2], dims, batch, elem, 8)
    assert formula == (4 * 4 + 2 * 8) * elem + output + index
    assert flops.embedding_bag_floor(indices, offsets, dims, batch, elem) < formula
    # Distinct ids (table 0 rows 1-4, table 1 rows 5-6): the floor is the formula.
    distinct = torch.tensor([1, 2, 3, 4, 5, 6])
    assert flops.embedding_bag_floor(distinct, offsets, dims, batch, elem) == formula
    # With the fused row-wise Adagrad step: grad_output read, each distinct row and its fp32 state
    # read and written once, the indices again.
    backward = output + 2 * (2 * 4 + 1 * 8) * elem + 2 * 3 * 4 + index
    assert flops.embedding_bag_floor(indices, offsets, dims, batch, elem, rowwise_adagrad=True) == (
        rows + output + index + backward)


def test_embedding_bag_bench_rows_use_the_floor_for_pct_of_peak():
    from bench import embedding_bag

    fwd = next(embedding_bag.cases(True, torch.device("cpu")))
    assert fwd.formula_bytes > fwd.bytes > 0  # Zipf ids repeat: the floor is below FBGEMM's formula
    if gk_backend._C is not None:  # the roof is bench.peaks.gather_roof's, the prefetching reader among its tries
        assert fwd.gather_gbps > 0 and any("prefetching reader distance 0:" in note for note in fwd.notes)
    timing = harness.Timing([1e-3] * 5, capped=False)
    row = harness.make_row("embedding_bag", fwd, "cpu", timing, torch.device("cpu"), PEAKS, "sha", "ts")
    assert row["gbps"] == pytest.approx(fwd.bytes / 1e-3 / 1e9)
    assert row["gbps_formula"] == pytest.approx(fwd.formula_bytes / 1e-3 / 1e9)
    assert row["pct_peak"] == pytest.approx(100 * row["gbps"] / PEAKS["copy_gbps"])


def test_attention_fwd_bwd_impls_return_gradients_and_are_verified():
    from bench import attention

    cases = attention.cases(True, torch.device("cpu"))
    next(cases)
    fwd_bwd = next(cases)
    assert fwd_bwd.op.endswith("fwd_bwd") and fwd_bwd.reference == "sdpa"  # softmax's eager side
    out, grads = fwd_bwd.impls["sdpa"]()
    assert out.dim() == 3 and len(grads) == 3 and all(g.shape == out.shape for g in grads)  # jagged layout
    out64, grads64 = fwd_bwd.fp64()  # SDPA in float64 on the first input set, the same layout
    assert out64.dtype == torch.float64 and out64.shape == out.shape
    assert [g.shape for g in grads64] == [g.shape for g in grads]
    cases.close()


def _fake_result(tmp_path):
    def row(op, impl, ms, status="ok", **kw):
        r = {"family": "fam", "op": op, "shape": "n=8", "dtype": "float32", "device": "cpu", "impl": impl,
             "status": status, "failed": kw.get("failed"), "verified_against": kw.get("against", "eager"),
             "unverified": kw.get("unverified"), "compiled": impl == "compile", "compile_s": kw.get("compile_s"),
             "ms": ms, "ms_p10": ms, "ms_p90": ms, "repeats": 10 if ms else 0, "capped": False,
             "page_faults_per_call": None, "flops": kw.get("flops", 0), "bytes": 1000, "formula_bytes": kw.get("fb"),
             "tflops": kw.get("flops", 0) / ms / 1e9 if ms and kw.get("flops") else None,
             "gbps": 1000 / ms / 1e6 if ms else None, "gbps_formula": kw["fb"] / ms / 1e6 if ms and kw.get("fb") else None,
             "peak": "bandwidth", "pct_peak": 10.0 if ms else None, "baseline": "eager"}
        return r

    rows = [row("gather", "eager", 2.0, against=None, fb=5000), row("gather", "cpu", 1.0, fb=5000),
            row("gather", "compile", 1.5, compile_s=12.5, fb=5000),
            row("gather", "wrong", None, status="failed", failed="MISMATCH vs 'eager': output 0 differs"),
            row("mm", "eager", 4.0, against=None, flops=10**9), row("mm", "cpu", 1.0, flops=10**9),
            row("step", "eager", 3.0, against=None, unverified="no reference here"),
            row("step", "fused", 2.0, against=None, unverified="no reference here")]
    harness.fill_speedups(rows[:4])
    harness.fill_speedups(rows[4:6])
    harness.fill_speedups(rows[6:])
    result = {"timestamp": "20261205T000000Z", "git_sha": "sha", "quick": True, "argv": [],
              "machine": {"device": "cpu", "cpu_model": "fake", "cpu_cores": 2, "torch_threads": 2, "gpu": None,
                          "torch": "2", "torch_cuda": None, "triton": None, "fbgemm_gpu": None, "gem_kernels": "0",
                          "gem_kernels_backends": ["cpu"]},
              "peaks": {"copy_gbps": 10.0, "matmul_tflops": {"float32": 1.0}, "sizes": {"matmul_n": 8, "copy_mib": 1}},
              "settings": {}, "loadavg_1min": {"start": 0.5, "end": 0.5}, "thp_mem_alloc": True,
              "families": [{"name": "fam", "status": "ok", "seconds": 1.0, "notes": [], "errors": [], "mismatches": []}],
              "rows": rows}
    return result


def test_report_writes_two_figures_and_redraws_them_from_the_json(tmp_path):
    from bench import report

    paths = report.write(_fake_result(tmp_path), tmp_path)
    stem = "cpu-20261205T000000Z"
    assert paths["png"] == tmp_path / f"{stem}.png" and paths["speedup_png"] == tmp_path / f"{stem}-speedup.png"
    for name in (f"{stem}.png", f"{stem}-speedup.png", "latest-cpu.png", "latest-cpu-speedup.png", "latest-cpu.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    md = paths["md"].read_text()
    for text in ("GB/s (floor)", "GB/s (FBGEMM formula)", "compile_s", "| 12.5 |", "FAILED: MISMATCH",
                 "UNVERIFIED: no reference here", "| vs eager |", "| (is the reference) |", "-speedup.png"):
        assert text in md, text
    # Redraw from the JSON alone, through the command line.
    for path in (paths["png"], paths["speedup_png"], paths["md"]):
        path.unlink()
    assert report.main([str(paths["json"])]) == 0
    assert paths["png"].stat().st_size > 0 and paths["speedup_png"].stat().st_size > 0
    assert paths["md"].read_text() == md


def test_report_names_the_cpu_rows_the_kernels_run(tmp_path, monkeypatch):
    """A run with GEM_KERNELS_NO_AVX512 set (the AVX2 rows, what a CPU without AVX-512 runs) says so in
    its header, as the kernels decide it: any value of the variable, "0" too, turns AVX-512 off."""
    import platform

    from bench import report

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    avx512 = {"avx2", "fma", "avx512f"}
    assert report.cpu_vector_rows(avx512, {}).startswith("AVX-512")
    for value in ("1", "0", ""):
        assert report.cpu_vector_rows(avx512, {"GEM_KERNELS_NO_AVX512": value}).startswith("AVX2 (AVX-512 off")
    assert report.cpu_vector_rows({"avx2", "fma"}, {}) == "AVX2 (no AVX-512F on this CPU)"
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert report.cpu_vector_rows(avx512, {}) == "portable loops (aarch64)"
    result = _fake_result(tmp_path)
    result["machine"]["cpu_vector_rows"] = "AVX2 (AVX-512 off: GEM_KERNELS_NO_AVX512 is set)"
    md = report.write(result, tmp_path)["md"].read_text()
    assert "gem_kernels' CPU rows: AVX2 (AVX-512 off: GEM_KERNELS_NO_AVX512 is set); GPU: none" in md
    # A JSON from before the field redraws as it was written.
    del result["machine"]["cpu_vector_rows"]
    md = report.write(result, tmp_path)["md"].read_text()
    assert "2 cores (torch threads 2); GPU: none" in md


# ---------------------------------------------------------------------------------------------
# bench.swap_loss loss curves (python -m bench.swap_loss --loss-steps N)
# ---------------------------------------------------------------------------------------------


def test_swap_loss_rule():
    from bench import swap_loss as swap

    g = torch.Generator().manual_seed(0)
    base = (0.7 + 0.01 * torch.randn(50, generator=g, dtype=torch.float64)).tolist()
    same = [b + 1e-7 for b in base]
    stats = swap._curve_stats(same, base)
    assert stats["verdict"] == "pass" and stats["tail_steps"] == 10
    assert stats["max_abs_diff"] == pytest.approx(1e-7, rel=1e-3)
    assert stats["diff_at_steps"].keys() == {1, 2, 3, 5, 10, 20, 50}
    off_at_start = [base[0] + 1e-3] + same[1:]  # the forward differs: more than fp32 rounding
    assert not swap._curve_stats(off_at_start, base)["checks"]["step1_equal_to_fp32_rounding"]
    shifted = base[:40] + [b + 0.05 for b in base[40:]]  # tail mean 0.05 up, 2 SE ~ 0.009
    assert not swap._curve_stats(shifted, base)["checks"]["tail_within_noise"]
    diverged = base[:-1] + [float("nan")]
    assert swap._curve_stats(diverged, base)["verdict"] == "FAIL"


def test_swap_loss_curves_learn_and_the_frozen_table_control_fails(tmp_path):
    """The loss curves train on labels with a learnable signal (a planted teacher on four tables), so
    the rule can fail: the negative control, whose tables never move, must FAIL it, while the
    swapped impls pass against the baselines with their update rules. On RandomRecDataset's coin-flip
    labels every curve went to ln 2 and a frozen-table run passed."""
    pytest.importorskip("torchrec")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "bench.swap_loss", "--loss-steps", "100", "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "swap-loss-cpu.json").read_text())
    assert list(result["curves"]) == ["torchrec_adagrad", "torchrec_rowwise", "swap_rowwise", "swap_none",
                                      "frozen_tables"]
    assert all(len(c) == 100 for c in result["curves"].values())
    stats = result["stats"]
    # Step 1 runs every impl on the same initial weights and batch.
    assert all(s["checks"]["step1_equal_to_fp32_rounding"] for s in stats.values())
    assert stats["swap_none"]["verdict"] == "pass" and stats["swap_rowwise"]["verdict"] == "pass"
    assert stats["frozen_tables"]["verdict"] == "FAIL" and not stats["frozen_tables"]["checks"]["tail_within_noise"]
    assert result["negative_control"] == "frozen_tables" and result["verdict"] == "pass"
    # The baselines learnt: their tail is well below the first steps' loss (ln 2 on coin flips).
    base = result["curves"]["torchrec_adagrad"]
    assert sum(base[-20:]) / 20 < sum(base[:10]) / 10 - 0.05
    md = (tmp_path / "swap-loss-cpu.md").read_text()
    assert "| frozen_tables | torchrec_adagrad |" in md and "FAIL (expected: FAIL)" in md


def test_swap_loss_verdict_needs_the_control_to_fail():
    from bench import swap_loss as swap

    passing = {"checks": {}, "verdict": "pass"}
    failing = {"checks": {}, "verdict": "FAIL"}
    assert swap.loss_verdict({"swap_none": passing, "swap_rowwise": passing, "frozen_tables": failing}) == "pass"
    assert swap.loss_verdict({"swap_none": passing, "swap_rowwise": passing, "frozen_tables": passing}) == "FAIL"
    assert swap.loss_verdict({"swap_none": failing, "swap_rowwise": passing, "frozen_tables": failing}) == "FAIL"


def test_swap_teacher_labels_depend_on_the_teacher_tables_only():
    pytest.importorskip("torchrec")
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from bench import swap, swap_loss

    batch = next(iter(swap._dataset(True, 1, 1)))
    labels = swap_loss.Teacher(True)(batch).labels
    assert labels.shape == batch.labels.shape and set(labels.unique().tolist()) <= {0, 1}
    assert 0.2 < labels.float().mean() < 0.8
    # Other ids in a table outside TEACHER_TABLES and other dense features: the same labels (a fresh
    # Teacher draws the same Bernoulli samples); other ids in a teacher table: other labels.
    kjt = batch.sparse_features

    def with_ids_of(table):
        values = kjt.values().clone()
        start = int(kjt.offset_per_key()[table])
        end = int(kjt.offset_per_key()[table + 1])
        values[start:end] = values[start:end].flip(0)
        return type(batch)(dense_features=torch.randn_like(batch.dense_features),
                           sparse_features=KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths()),
                           labels=batch.labels)

    other = next(t for t in range(26) if t not in swap_loss.TEACHER_TABLES)
    assert torch.equal(swap_loss.Teacher(True)(with_ids_of(other)).labels, labels)
    assert not torch.equal(swap_loss.Teacher(True)(with_ids_of(swap_loss.TEACHER_TABLES[0])).labels, labels)


# ---------------------------------------------------------------------------------------------
# CLI: odd values are refused before anything runs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["nan", "inf", "-inf", "0", "-3"])
def test_cli_rejects_a_budget_that_is_not_a_finite_positive_number(budget, capsys):
    from bench.__main__ import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["jagged", "--quick", f"--budget={budget}"])
    assert exc.value.code == 2
    assert "--budget must be a finite number of seconds > 0" in capsys.readouterr().err


def test_cli_rejects_unknown_flags_of_the_distributed_bench():
    # Rejected by argparse before any process starts (parse_known_args used to ignore the flag and
    # run the whole distributed bench, writing into bench/results/).
    proc = _run_bench("distributed", "--bogus-flag", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unrecognized arguments: --bogus-flag" in proc.stderr


@pytest.mark.parametrize("cli", [["bench", "jagged", "--quick"], ["bench", "distributed", "--quick"],
                                 ["bench.swap_loss", "--loss-steps", "1", "--quick"]], ids=["bench", "distributed", "swap"])
def test_cli_unwritable_out_fails_before_the_run(tmp_path, cli):
    # A folder inside a regular file: no user can create it, root included (a read-only folder would
    # not stop root, and CI may run as root).
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", *cli, "--out", str(blocker / "results")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot write results there" in proc.stderr, proc.stderr
    assert "[bench]" not in proc.stderr and "[swap loss]" not in proc.stderr  # nothing ran
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize("cli", ["bench", "distributed", "swap_loss"])
def test_cli_out_in_proc_fails_before_the_run(cli, capsys):
    """Issue 30 item 26 as root (root passes os.access everywhere, and CI may run as root): /proc takes
    no new file from anyone; each CLI's parse step refuses it."""
    if cli == "bench":
        from bench.__main__ import parse_args as run
        argv = ["jagged", "--quick", "--out", "/proc/gk-results"]
    elif cli == "distributed":
        from bench.distributed import main as run
        argv = ["--quick", "--out", "/proc/gk-results"]
    else:
        from bench.swap_loss import main as run
        argv = ["--loss-steps", "1", "--quick", "--out", "/proc/gk-results"]
    with pytest.raises(SystemExit) as exc:
        run(argv)
    assert exc.value.code == 2
    assert "--out /proc/gk-results: cannot write results there" in capsys.readouterr().err


def test_cli_respects_omp_num_threads(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "bench", "jagged", "--quick", "--budget", "3", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert "torch threads 1" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------
# The README's TorchRec install line, against requirements-torchrec.txt
# ---------------------------------------------------------------------------------------------


def _pins(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _torchrec_install_lines() -> dict[str, str]:
    """where -> every TorchRec install line a user is shown: the README's backticked spans, and the
    ImportError hint of gem_kernels.torchrec."""
    import re

    found = {f"README.md span {i}": span for i, span in
             enumerate(re.findall(r"`([^`]*pip install[^`]*torchrec==[^`]*)`", (REPO / "README.md").read_text()))}
    hint = (REPO / "gem_kernels" / "torchrec" / "__init__.py").read_text()
    match = re.search(r"INSTALL_HINT = \((.*?)\n\)", hint, re.S)
    text = "".join(re.findall(r'"([^"]*)"', match.group(1)))
    found["gem_kernels.torchrec.INSTALL_HINT"] = text[text.index("pip install"):text.index(" (plain")]
    return found


def test_readme_torchrec_install_line_matches_requirements():
    """--no-deps applies to every package of its pip command: it may carry TorchRec alone (which must
    not pull the CUDA fbgemm-gpu); its dependencies go in another command that installs theirs
    (tensordict needs pyvers: the old line left `import torchrec` failing in a fresh venv)."""
    torchrec_pin = [p for p in _pins(REPO / "requirements-torchrec.txt") if p.startswith("torchrec==")]
    deps = {p for p in _pins(REPO / "requirements-torchrec.txt") if not p.startswith("torchrec==")}
    fbgemm = {p for p in _pins(REPO / "requirements-peers.txt") if p.startswith("fbgemm-gpu-cpu==")}
    assert len(torchrec_pin) == 1 and len(fbgemm) == 1 and deps
    lines = _torchrec_install_lines()
    assert len(lines) >= 3, lines  # the README shows it twice, the ImportError once
    for where, line in lines.items():
        commands = [c.split() for c in line.split("&&")]
        assert all(c[:2] == ["pip", "install"] for c in commands), (where, line)
        no_deps = [c for c in commands if "--no-deps" in c]
        assert [c[2:] for c in no_deps] == [["--no-deps", *torchrec_pin]], (where, line)
        with_deps = [p for c in commands if "--no-deps" not in c for p in c[2:]]
        assert not [p for p in with_deps if p.startswith("-")], (where, line)
        assert sorted(with_deps) == sorted(deps | fbgemm), (where, line)


def test_setup_env_installs_torchrec_dependencies_with_theirs():
    script = (REPO / "scripts" / "setup_env.sh").read_text()
    deps_line = next(line for line in script.splitlines() if "grep -v -e '^#' -e '^torchrec=='" in line)
    torchrec_line = next(line for line in script.splitlines() if "grep '^torchrec=='" in line)
    assert "--no-deps" not in deps_line and "--no-deps" in torchrec_line


def test_requirements_torchrec_lists_every_dependency_torchrec_declares():
    import importlib.metadata
    import re

    pytest.importorskip("torchrec")
    declared = {re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower() for r in importlib.metadata.requires("torchrec") or []
                if "extra ==" not in r}
    listed = {p.split("==")[0].lower() for p in _pins(REPO / "requirements-torchrec.txt")}
    # fbgemm-gpu (the CUDA build) is replaced by fbgemm-gpu-cpu from requirements-peers.txt.
    assert declared - {"fbgemm-gpu"} <= listed, declared - listed
    assert importlib.metadata.version("torchrec") == next(p for p in _pins(REPO / "requirements-torchrec.txt")
                                                         if p.startswith("torchrec==")).split("==")[1]


def test_ci_runs_the_quick_bench_at_one_and_two_threads():
    """scripts/test.sh (what .ci/run runs) ends with `python -m bench --quick` at OMP_NUM_THREADS=1
    and 2, whose exit status fails CI on a verification mismatch; bench.sh passes its arguments on."""
    script = (REPO / "scripts" / "test.sh").read_text()
    assert "for threads in 1 2; do" in script
    assert 'OMP_NUM_THREADS=$threads python -m bench --quick' in script
    assert "set -euo pipefail" in script
    assert 'python -m bench "$@"' in (REPO / "scripts" / "bench.sh").read_text()


def test_plots_draw_gem_kernels_own_impls_solid():
    """The speedup plot hatches peers only: the HSTU layer's "attn-only" (torch ops around gem_kernels'
    attention), the quantized family's gk-torchrec / fp32-fused and the ranking's rank/uncached/alone
    rows are gem_kernels' own (they were drawn as peers); eager, TorchRec and FBGEMM stay peers."""
    from bench.report import is_gem_kernels

    for impl in ("cpu", "attn-only", "gk-torchrec", "fp32-fused", "rank m=16", "rank m=64 warm", "uncached", "alone"):
        assert is_gem_kernels(impl), impl
    for impl in ("eager", "torchrec-quant", "nn.EmbeddingBag", "torchrec_mch", "fbgemm", "reference", "compile"):
        assert not is_gem_kernels(impl), impl

"""The standing bad-input fuzz (issue 19): every case of tests/fuzz_cases.py on every backend this
machine runs, each in a forked child with a time and a memory limit, so that a crash or a hang
fails its case instead of the run.

Children are forked from a forkserver that has imported torch, gem_kernels and the cases once (and
never ran a kernel, so no OpenMP pool is forked). A child runs a batch of cases one after another
and reports each outcome as it finishes: a child that dies (a signal, an abort) is charged to the
case it was running, a case that runs past CASE_TIMEOUT_S is a hang; the rest of the batch then
runs in a fresh child. Two children run at a time (this machine's cores).

Outcome classes (tests/fuzz_cases.py): error_named, equal_reference, nan_inf_rule, native_rejected,
native_returned are right; crash, hang, unclear_error, accepted_bad_input, rejected_valid_input and
garbage fail the test, which lists every such case with its detail. The counts per class are
printed at the end of the pytest run (tests/conftest.py) and written to build/fuzz_counts_<id>.json.

The front-door section (test_fuzz_front, tests/fuzz_front.py) runs its cases through the same
children, with its own outcome classes and a time limit per case.

Test ids name no "cpu" (`fuzz-host` runs the cpu backend), so CI's GK_CUDA_EMU=1 pass, which selects
ids containing "cpu", does not run the fuzz a second time: the CUDA kernels are fuzzed on a GPU
(`fuzz-cuda-cuda`, scripts/gpu_check.sh). The children run on one thread each and WORKERS at a time.
"""

from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import resource
import time
from multiprocessing.connection import wait
from pathlib import Path

import pytest
import torch

from .utils import _skip_reason

ROOT = Path(__file__).resolve().parents[1]
CASE_TIMEOUT_S = float(os.environ.get("GK_FUZZ_CASE_TIMEOUT", "30"))
# Address space a child may add to what it inherits: the cases need a few MB; a kernel that sizes
# an allocation from a bad argument gets a MemoryError-like failure instead of taking the machine.
MEMORY_LIMIT_BYTES = int(os.environ.get("GK_FUZZ_MEMORY_MB", "1536")) << 20
BATCH = 150  # cases per child: a fork and its first calls cost more than a case
WORKERS = max(1, min(4, os.cpu_count() or 1))

SUMMARY: list[str] = []  # printed by tests/conftest.py's terminal summary


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) << 10
    return 0


def _child(names: list[str], backend: str, device: str, conn, cases_module: str = "tests.fuzz_cases") -> None:
    if device == "cpu":  # a CUDA context reserves far more address space than it uses: no limit there
        limit = _vm_size() + MEMORY_LIMIT_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    torch.set_num_threads(1)
    import importlib
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)  # TorchRec's planner logs to stderr, around the case's own redirect
    cases = importlib.import_module(cases_module)

    for name in names:
        conn.send(("start", name))
        outcome, detail = cases.run_case(cases.CASES[name], backend, device)
        conn.send(("done", name, outcome, detail))
        if device == "cuda" and "CUDA error" in detail:
            os._exit(0)  # a faulted CUDA context fails every later call: the rest runs in a fresh child
    conn.send(("end",))
    conn.close()


def run_all(backend: str, device: str, names: list[str], cases_module: str = "tests.fuzz_cases",
            timeout_s=None, batch: int = BATCH) -> dict[str, tuple[str, str]]:
    """{case name: (outcome, detail)} for every name of ``cases_module``'s CASES, run in forked
    children; a case running past ``timeout_s(name)`` (default CASE_TIMEOUT_S) is a hang."""
    timeout_s = timeout_s or (lambda name: CASE_TIMEOUT_S)
    # The forkserver inherits this: torch.cuda.is_available() there then does not initialise CUDA,
    # which would make every forked child's CUDA calls fail.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.fuzz_server"])
    pending = collections.deque(names[i:i + batch] for i in range(0, len(names), batch))
    results: dict[str, tuple[str, str]] = {}
    running = {}  # conn -> [process, batch, index of the case running, its start time]

    def launch(batch):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(batch, backend, device, child, cases_module), daemon=True)
        proc.start()
        child.close()
        running[parent] = [proc, batch, None, time.monotonic()]

    def finish(conn, outcome_of_current: str | None, detail: str):
        proc, batch, current, _ = running.pop(conn)
        conn.close()
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        if current is not None and outcome_of_current is not None:
            if batch[current] not in results:  # (a child that ended itself after reporting keeps its result)
                results[batch[current]] = (outcome_of_current, detail.format(code=proc.exitcode))
            rest = batch[current + 1:]
        else:
            rest = [n for n in batch if n not in results]
        if rest:
            pending.appendleft(rest)

    while pending or running:
        while pending and len(running) < WORKERS:
            launch(pending.popleft())
        ready = wait(list(running), timeout=1.0)
        for conn in ready:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                state = running[conn]
                state[0].join(5)
                finish(conn, "crash", "the child died (exit code {code}) in this case")
                continue
            state = running[conn]
            if msg[0] == "start":
                state[2] = state[1].index(msg[1])
                state[3] = time.monotonic()
            elif msg[0] == "done":
                results[msg[1]] = (msg[2], msg[3])
            else:  # end
                state[2] = None
                finish(conn, None, "")
        now = time.monotonic()
        for conn in [c for c, s in running.items() if s[2] is not None and now - s[3] > timeout_s(s[1][s[2]])]:
            state = running[conn]
            finish(conn, "hang", f"no result after {timeout_s(state[1][state[2]]):.0f} s")
    return results


def _params():
    from tests import fuzz_cases  # noqa: F401  (fails collection loudly if a case cannot be built)

    params = []
    for backend, device in (("reference", "cpu"), ("cpu", "cpu"), ("triton", "cuda"), ("cuda", "cuda"),
                            ("reference", "cuda")):
        reason = _skip_reason(device, backend)
        if backend == "cpu":
            test_id = "fuzz-host"
        else:
            test_id = f"fuzz-{backend}-{device}" if device == "cuda" else f"fuzz-{backend}"
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        if backend == "triton" and device == "cpu":
            continue  # the interpreter: covered by the GPU run, too slow for the 2-minute budget
        params.append(pytest.param(backend, device, marks=marks, id=test_id))
    return params


@pytest.mark.parametrize("backend,device", _params())
def test_fuzz(backend, device, request):
    from tests import fuzz_cases

    names = fuzz_cases.cases_for(backend)
    start = time.monotonic()
    results = run_all(backend, device, names)
    elapsed = time.monotonic() - start
    missing = [n for n in names if n not in results]
    assert not missing, f"{len(missing)} cases never reported: {missing[:5]}"
    counts = collections.Counter(outcome for outcome, _ in results.values())
    line = (f"fuzz {backend} on {device}: {len(names)} cases in {elapsed:.0f} s: " + ", ".join(
                f"{cls} {counts.get(cls, 0)}"
                for cls in fuzz_cases.OK_CLASSES + fuzz_cases.KNOWN_CLASSES + fuzz_cases.FAIL_CLASSES))
    known = sorted(n for n, r in results.items() if r[0] in fuzz_cases.KNOWN_CLASSES)
    if known:
        line += f"\n  known issues ({len(known)}, GK_FUZZ_STRICT=1 fails them): " + ", ".join(known)
    SUMMARY.append(line)
    print("\n" + line)
    out = ROOT / "build"
    out.mkdir(exist_ok=True)
    (out / f"fuzz_counts_{request.node.callspec.id}.json").write_text(json.dumps(
        dict(backend=backend, device=device, seconds=round(elapsed, 1), counts=counts,
             failures={n: r for n, r in results.items() if r[0] in fuzz_cases.FAIL_CLASSES},
             known_issues={n: r for n, r in results.items() if r[0] in fuzz_cases.KNOWN_CLASSES}), indent=1))
    failures = sorted((n, r) for n, r in results.items() if r[0] in fuzz_cases.FAIL_CLASSES)
    assert not failures, f"{len(failures)} fuzz cases failed on {backend}:\n" + "\n".join(
        f"  {cls:22s} {name}: {detail}" for name, (cls, detail) in failures)


def test_fuzz_front():
    """The front-door section (tests/fuzz_front.py, issue 30): gk.swap, the TorchRec collections, the
    sharders and sharding_plan, python -m model.train and python -m bench, checkpoints. Its own
    outcome classes; every crash, hang, silent accept or wrong result, rejected valid input and
    unclear error fails, listed with its detail. Id without "cpu": the CUDA-emulation pass skips it."""
    from tests import fuzz_front

    names = [n for n, c in fuzz_front.CASES.items() if fuzz_front.HAVE_TORCHREC or not c.torchrec]
    skipped = len(fuzz_front.CASES) - len(names)
    start = time.monotonic()
    # Four children, each with every fourth case: the slow ones (model.train runs, a subprocess) sit
    # together at the end of the list and would otherwise all land in one child.
    children = 4
    dealt = [n for j in range(children) for n in names[j::children]]
    results = run_all("front", "cpu", dealt, "tests.fuzz_front", lambda n: fuzz_front.CASES[n].timeout_s,
                      batch=-(-len(names) // children))
    elapsed = time.monotonic() - start
    missing = [n for n in names if n not in results]
    assert not missing, f"{len(missing)} cases never reported: {missing[:5]}"
    classes = fuzz_front.OK_CLASSES + fuzz_front.FAIL_CLASSES
    counts = collections.Counter(outcome for outcome, _ in results.values())
    line = (f"fuzz front door: {len(names)} cases in {elapsed:.0f} s: "
            + ", ".join(f"{cls} {counts.get(cls, 0)}" for cls in classes)
            + (f" ({skipped} TorchRec cases not run: torchrec is not installed)" if skipped else ""))
    by_surface = collections.defaultdict(collections.Counter)
    for name, (outcome, _) in results.items():
        by_surface[fuzz_front.CASES[name].surface][outcome] += 1
    line += "\n  " + "; ".join(f"{surface}: " + ", ".join(f"{cls} {c[cls]}" for cls in classes if c[cls])
                                for surface, c in sorted(by_surface.items()))
    SUMMARY.append(line)
    print("\n" + line)
    out = ROOT / "build"
    out.mkdir(exist_ok=True)
    failures = sorted((n, r) for n, r in results.items() if r[0] in fuzz_front.FAIL_CLASSES)
    (out / "fuzz_counts_front.json").write_text(
        json.dumps(dict(section="front door", seconds=round(elapsed, 1), counts=counts,
                        by_surface=by_surface, failures=dict(failures)), indent=1))
    assert not failures, f"{len(failures)} front-door fuzz cases failed:\n" + "\n".join(
        f"  {cls:16s} {name}: {detail}" for name, (cls, detail) in failures)


def test_front_door_outcome_classes():
    """The front door's classifier on cases whose right class is known: each failing class is
    reachable, so the section can fail."""
    import sys as _sys

    from tests.fuzz_front import Crash, FrontCase, Hang, run_case

    def raises(error):
        def run():
            raise error
        return run

    def cli_error():
        print("usage: x\nx: error: --steps must be >= 1, got 0", file=_sys.stderr)
        raise SystemExit(2)

    def wrong(result):
        assert result == 2, "1 != 2"

    expected = {
        "clear_error": FrontCase("swap/a", "bad", raises(ValueError("backend must be ..., got 'x'")), ("backend",)),
        "unclear_error": FrontCase("swap/b", "bad", raises(ValueError("shape '[2, 1]' is invalid")), ("lengths",)),
        "silent_or_wrong": FrontCase("swap/c", "bad", lambda: 1, ("backend",)),
        "rejected_valid": FrontCase("swap/d", "valid", raises(RuntimeError("no")), check=wrong),
        "valid_correct": FrontCase("swap/e", "valid", lambda: 2, check=wrong),
        "crash": FrontCase("swap/f", "bad", raises(Crash("signal 11")), ("x",)),
        "hang": FrontCase("swap/g", "bad", raises(Hang("no exit")), ("x",)),
    }
    for cls, case in expected.items():
        assert run_case(case)[0] == cls, (cls, run_case(case))
    assert run_case(FrontCase("train_cli/a", "bad", cli_error, ("--steps",)))[0] == "clear_error"
    assert run_case(FrontCase("train_cli/b", "bad", cli_error, ("--warmup",)))[0] == "unclear_error"
    assert run_case(FrontCase("swap/h", "valid", lambda: 1, check=wrong))[0] == "silent_or_wrong"
    assert run_case(FrontCase("swap/i", "bad", raises(AttributeError("'NoneType' object")), ("x",)))[0] == "unclear_error"

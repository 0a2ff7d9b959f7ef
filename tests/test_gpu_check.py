"""scripts/gpu_check.sh (issue 25): the plan, its time boxes and its order, checked by --dry-run here;
one real step run end to end (summary and packed logs written); and scripts/gpu_site's CUDA shim for
FBGEMM's index ops, compared with FBGEMM's own CPU kernels."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
ORDER = ["facts", "build", "raise", "tests", "bench:attention", "bench:jagged", "bench:embedding_bag",
         "bench:interaction", "torchrec", "model", "grstu", "swap", "dmp", "fuzz"]


def _run(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def _plan(stdout: str) -> dict[str, str]:
    rows = {}
    for line in stdout.splitlines()[2:]:
        rows[line[:22].strip()] = line[23:38].strip()  # printf '%-22s %-14s %s'

    return rows


def test_dry_run_prints_the_plan_in_order_of_value():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    plan = _plan(proc.stdout)
    names = [n for n in plan if n in ORDER]
    assert names == ORDER  # correctness before speed; the fuzz last
    assert plan["build"] == "170s" and plan["fuzz"] == "rest"
    assert plan["tests"] == f"until {550 * 38 // 100}s"  # the tests stop at 38 % of the budget
    for name in ORDER:
        assert plan[name] == "rest" or re.fullmatch(r"(until )?\d+s", plan[name]), (name, plan[name])


def test_default_boxes_leave_time_for_the_fuzz():
    """With the default budget the fuzz still gets 25 s when every step before it uses its whole box
    (a smaller --budget cuts the later steps' boxes at run time instead)."""
    plan = _plan(_run("--dry-run").stdout)
    tests_end = int(plan["tests"].split()[1][:-1])
    after = sum(int(plan[n][:-1]) for n in ORDER[4:-1] if plan[n] != "skip")
    assert tests_end + after + 8 + 25 <= 550  # 8 s: the reserve for packing


def test_bench_families_that_do_not_exist_are_skipped_with_the_reason():
    plan_text = _run("--dry-run").stdout
    from bench.__main__ import FAMILIES

    for family in ("hstu_layer", "inference", "ranking", "hashed"):
        line = next(line for line in plan_text.splitlines() if line.startswith(f"bench:{family} "))
        if family in FAMILIES:
            assert "skipped" not in line
        else:
            assert "[skipped: not a family of python -m bench]" in line


def test_only_and_skip_select_steps():
    plan = _plan(_run("--dry-run", "--only", "tests,bench").stdout)
    chosen = [n for n, box in plan.items() if box != "skip"]
    # Every bench family that bench/__main__.py lists runs.
    assert chosen == ["tests", "bench:attention", "bench:jagged", "bench:embedding_bag", "bench:interaction",
                      "bench:hstu_layer", "bench:inference", "bench:ranking", "bench:hashed"]
    plan = _plan(_run("--dry-run", "--skip", "fuzz,build").stdout)
    assert plan["fuzz"] == "skip" and plan["build"] == "skip" and plan["tests"] != "skip"


@pytest.mark.parametrize("args", [("--budget", "5"), ("--budget", "abc"), ("--frobnicate",)])
def test_bad_arguments_are_refused(args):
    proc = _run("--dry-run", *args)
    assert proc.returncode == 2 and "gpu_check:" in proc.stderr


def test_a_real_step_writes_the_summary_and_the_packed_logs(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = _run("--only", "facts", "--budget", "90",
                env={"OUT": str(out), "GPU_CHECK_WORK": str(work), "PYTHON": sys.executable}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = (out / "summary.txt").read_text()
    # PASS, or TIMEOUT on a busy machine: either way the line is written and the log packed
    assert re.search(r"^facts +(PASS +rc=0|TIMEOUT +rc=124) ", summary, re.MULTILINE), summary
    assert re.search(r"^build +SKIP +not selected", summary, re.MULTILINE), summary
    assert "torch " + torch.__version__ in summary and "finished" in summary
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert "logs/facts.log" in tar.getnames()


def test_a_killed_run_leaves_the_plan_and_the_running_step(tmp_path):
    """The device tool may kill the call: what was written before survives (summary and tarball)."""
    import signal
    import time

    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.Popen(["bash", str(SCRIPT), "--only", "facts", "--budget", "90"], cwd=ROOT, start_new_session=True,
                            env={**os.environ, "OUT": str(out), "GPU_CHECK_WORK": str(work), "PYTHON": sys.executable},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = out / "summary.txt"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (summary.exists() and "facts " in summary.read_text().split("started", 1)[-1]):
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    text = summary.read_text()
    assert "gpu_check plan: budget 90s" in text and re.search(r"^facts +\.\.\. +box \d+s", text, re.MULTILINE), text
    assert "finished" not in text
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert "logs" in tar.getnames()


# ------------------------------------------------------------ the FBGEMM index ops shim
sys.path.insert(0, str(ROOT / "scripts" / "gpu_site"))
import gk_fbgemm_cuda as shim  # noqa: E402  (imports torch only)

FB = torch.ops.fbgemm


@pytest.fixture
def fbgemm():
    """FBGEMM's CPU kernels, the oracle of the shim (a skip only for the shim's tests)."""
    pytest.importorskip("fbgemm_gpu", reason="FBGEMM (fbgemm-gpu-cpu) is not installed")


def _equal(a, b):
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weighted", [False, True])
def test_shim_permutes_match_fbgemm(fbgemm, dtype, weighted):
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 4, (5, 7), generator=gen).to(dtype)
    lengths[2] = 0  # an empty feature
    n = int(lengths.sum())
    values = torch.randint(0, 1000, (n,), generator=gen).to(dtype)
    weights = torch.rand(n, generator=gen) if weighted else None
    permute = torch.tensor([4, 0, 2, 3, 1, 4], dtype=torch.int32)  # a repeated feature too (FBGEMM: int32)
    assert _equal(shim.permute_2D_sparse_data(permute, lengths, values, weights),
                  FB.permute_2D_sparse_data(permute, lengths, values, weights))
    flat = lengths.flatten()
    segments = torch.tensor([30, 0, 5, 12, 5, 29], dtype=torch.int32)
    assert _equal(shim.permute_1D_sparse_data(segments, flat, values, weights),
                  FB.permute_1D_sparse_data(segments, flat, values, weights))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_shim_offsets_ops_match_fbgemm(fbgemm, dtype):
    gen = torch.Generator().manual_seed(4)
    for size in (0, 1, 59):
        lengths = torch.randint(0, 5, (size,), generator=gen).to(dtype)
        for name in ("asynchronous_complete_cumsum", "asynchronous_exclusive_cumsum", "asynchronous_inclusive_cumsum"):
            assert _equal(getattr(shim, name)(lengths), getattr(FB, name)(lengths)), (name, size)
    offsets = torch.tensor([0, 2, 5, 5], dtype=dtype)
    assert _equal(shim.offsets_range(offsets, 7), FB.offsets_range(offsets, 7))
    permute = torch.tensor([2, 0, 3, 1], dtype=dtype)
    assert _equal(shim.invert_permute(permute), FB.invert_permute(permute))
    lens = torch.tensor([2, 0, 3, 1], dtype=dtype)
    inp, outp = FB.asynchronous_complete_cumsum(lens), FB.asynchronous_complete_cumsum(lens[permute.long()])
    assert _equal(shim.expand_into_jagged_permute(permute, inp, outp, 6), FB.expand_into_jagged_permute(permute, inp, outp, 6))
    csr = torch.tensor([0, 1, 1, 3], dtype=dtype)
    vals = torch.rand(6, generator=gen)
    torch.testing.assert_close(shim.segment_sum_csr(2, csr, vals), FB.segment_sum_csr(2, csr, vals))

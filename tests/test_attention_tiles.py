"""scripts/attention_tiles.py (run by scripts/gpu_check.sh on a GPU) still runs against the kernels'
private launch code: its --smoke mode runs every config in the Triton interpreter, where each config's
output must match the shipped tiles' (the check that keeps a wrong config from being timed)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("triton")


def test_smoke_run_checks_every_config():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        from attention_tiles import BWD_CONFIGS, FWD_CONFIGS
    finally:
        sys.path.pop(0)
    proc = subprocess.run([sys.executable, "scripts/attention_tiles.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert len(lines) == 2 * len(FWD_CONFIGS) + len(BWD_CONFIGS), proc.stdout
    assert not [line for line in lines if "WRONG" in line or "FAILED" in line or "budget" in line], proc.stdout

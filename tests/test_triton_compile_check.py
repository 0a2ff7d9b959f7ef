"""scripts/triton_compile_check.py compiles Triton kernels for sm_90a without a GPU: its compile
step must report a kernel that fits, and must report one that does not compile as a failure."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

triton = pytest.importorskip("triton")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _compile(entry: dict) -> dict:
    # A child without TRITON_INTERPRET: in this process (conftest) the kernels are interpreted
    # functions, which the GPU compiler cannot take.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, 'scripts'); from triton_compile_check import compile_one; "
            f"print(json.dumps(compile_one(json.loads({json.dumps(json.dumps(entry))}), 90)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cross_layer_entry(block: int) -> dict:
    pointer = ["tensor", "torch.float32", True]
    return dict(module="gem_kernels.triton.interaction", name="_cross_layer_fwd_kernel", options={},
                params={"X0_ptr": pointer, "Z_ptr": pointer, "XL_ptr": pointer, "Out_ptr": pointer,
                        "n": ["int", 4096], "BLOCK": ["int", block]})


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this triton wheel has no bundled ptxas")
def test_compile_check_reports_fit_and_failure():
    ok = _compile(_cross_layer_entry(1024))
    assert ok["status"] == "ok", ok
    assert 0 < ok["registers"] <= 255 and ok["spill_stores"] == 0
    assert ok["dtypes"] == ["fp32"] and ok["constexprs"] == {"BLOCK": 1024}
    bad = _compile(_cross_layer_entry(1000))  # tl.arange needs a power of two
    assert bad["status"].startswith("compile error"), bad

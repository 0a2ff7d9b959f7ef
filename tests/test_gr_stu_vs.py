"""scripts/gr_stu_vs.py (issue 26's GPU goal: gem_kernels' fused HSTU layers against generative-recommenders'
STULayer at dlrm_v3's shape, side by side): its --smoke run on the CPU, with and without GR, and a gem_kernels
layer that computes another function failing the verification (not timed, exit 1)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gr_stu_vs  # noqa: E402

GR_PATH = os.environ.get("GENERATIVE_RECOMMENDERS_PATH", "/tmp/gr")


def _run(tmp_path, *extra):
    rc = gr_stu_vs.main(["--smoke", "--device", "cpu", "--repeats", "3", "--out", str(tmp_path), *extra])
    return rc, json.loads((tmp_path / "gr-stu.json").read_text()), (tmp_path / "gr-stu.md").read_text()


def test_without_gr_the_layers_are_still_verified_and_timed(tmp_path, monkeypatch):
    def no_gr(path):
        raise ImportError(f"no generative_recommenders at {path}")

    monkeypatch.setattr(gr_stu_vs, "import_gr", no_gr)
    rc, result, table = _run(tmp_path)
    assert rc == 0
    assert result["gr_error"].startswith("import/build: ImportError") and "GR: not run" in table
    assert result["status"] == "done"
    assert result["rule_eager_side"] == "gem_kernels reference"
    (entry,) = result["impls"].values()
    assert entry["verified"] is True and entry["ms"] > 0 and entry["rounds"] == 3
    assert result["shape"]["layers"] == gr_stu_vs.SMOKE["layers"] and result["tokens"] > 0


def test_a_layer_computing_something_else_fails_and_is_not_timed(tmp_path, monkeypatch):
    monkeypatch.setattr(gr_stu_vs, "import_gr", lambda path: (_ for _ in ()).throw(ImportError("none")))
    real = gr_stu_vs.gk_layers

    def perturbed(master, backend, device, dtype):
        layers = real(master, backend, device, dtype)
        if backend == "cpu":
            with torch.no_grad():
                layers[-1].out.weight.mul_(1.001)
        return layers

    monkeypatch.setattr(gr_stu_vs, "gk_layers", perturbed)
    rc, result, table = _run(tmp_path)
    assert rc == 1
    (entry,) = result["impls"].values()
    assert entry["verified"] is False and "FlashAttention's rule" in entry["failed"] and "ms" not in entry
    assert "FlashAttention's rule" in table


def test_the_cpu_defaults_to_the_small_shape():
    assert gr_stu_vs.parse_args(["--device", "cpu"]).embedding_dim == gr_stu_vs.SMOKE["embedding_dim"]
    full = gr_stu_vs.parse_args(["--device", "cpu", "--dlrm-v3"])
    assert (full.embedding_dim, full.layers, full.batch) == (512, 5, 32)
    assert gr_stu_vs.parse_args(["--device", "cuda"]).batch == gr_stu_vs.DLRM_V3["batch"]


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        gr_stu_vs.parse_args(["--smoke", "--layers", "0"])


def test_against_generative_recommenders_own_layers(tmp_path):
    """With generative-recommenders (installed or at GENERATIVE_RECOMMENDERS_PATH) and fbgemm_gpu's CPU ops:
    GR's STULayers run (PyTorch path), gem_kernels' copies pass the rule against them, both are timed."""
    pytest.importorskip("fbgemm_gpu")
    if importlib.util.find_spec("generative_recommenders") is None and \
            not os.path.isdir(os.path.join(GR_PATH, "generative_recommenders")):
        pytest.skip(f"generative-recommenders is neither installed nor checked out at {GR_PATH}")
    rc, result, table = _run(tmp_path, "--gr-path", GR_PATH)
    assert rc == 0 and result["gr_error"] is None, result["gr_error"]
    assert result["rule_eager_side"] == "generative-recommenders"
    assert result["impls"]["gem_kernels cpu"]["verified"] is True
    assert result["impls"]["generative-recommenders"]["ms"] > 0
    assert result["impls"]["gem_kernels cpu"]["speedup_vs_gr"] > 0


def test_an_interrupted_timing_keeps_the_rounds_done(tmp_path, monkeypatch):
    """gpu_check stops a step with SIGINT at its time box: the rounds timed so far are reported, with why."""
    monkeypatch.setattr(gr_stu_vs, "import_gr", lambda path: (_ for _ in ()).throw(ImportError("none")))
    real = gr_stu_vs.timed_rounds

    def two_rounds_then_interrupt(fns, rounds, device, times):
        real(fns, 2, device, times)
        raise KeyboardInterrupt

    monkeypatch.setattr(gr_stu_vs, "timed_rounds", two_rounds_then_interrupt)
    rc, result, table = _run(tmp_path)
    assert rc == 0 and result["interrupted"] == "after 2 full rounds" and "timing interrupted" in table
    assert result["status"] == "timing interrupted"
    (entry,) = result["impls"].values()
    assert entry["rounds"] == 2 and entry["ms"] > 0

"""bench.profile_step: the per-phase, per-category split of a model step."""

from __future__ import annotations

import pytest

from bench import profile_step


def test_category_of_ops():
    assert profile_step.category("gem_kernels::jagged_attention_bwd_native") == "attention kernels"
    assert profile_step.category("aten::addmm") == "matmuls" and profile_step.category("aten::mm") == "matmuls"
    assert profile_step.category("aten::mul") == "norms, activations, elementwise"
    assert profile_step.category("aten::_foreach_add_") == "optimizer kernels"
    assert profile_step.category("aten::index_select") == "copies, fills, indexing"
    assert profile_step.category("aten::empty_strided") == "allocation"
    assert profile_step.category("autograd::engine::evaluate_function: MulBackward0") == profile_step.OTHER


def test_profile_of_the_tiny_model_splits_every_phase(capsys):
    result = profile_step.main(["--config", "tiny", "--steps", "1", "--warmup", "1", "--top", "3"])
    phases = result["phases"]
    assert set(phases) == set(profile_step.PHASES) and result["step_ms"] > 0
    for data in phases.values():
        assert data["ms"] > 0 and sum(data["categories"].values()) == pytest.approx(data["ms"])
        assert sum(data["ops"].values()) == pytest.approx(data["ms"])
    # The fused model's HSTU attention runs in the forward and its backward in the backward; Adam in the optimizer.
    assert phases["forward"]["categories"]["attention kernels"] > 0
    assert phases["backward"]["categories"]["attention kernels"] > 0
    assert phases["optimizer"]["categories"]["optimizer kernels"] > 0
    # The phases' self times are parts of the step (the profiler's own overhead aside).
    assert sum(d["ms"] for d in phases.values()) < 1.5 * result["step_ms"]
    assert "backward:" in capsys.readouterr().out


def test_rejects_bad_step_counts():
    with pytest.raises(SystemExit):
        profile_step.main(["--steps", "0"])

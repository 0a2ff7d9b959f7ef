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


def test_compare_threads_profiles_both_counts_and_splits_by_scaling(capsys):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = profile_step.main(["--config", "tiny", "--steps", "1", "--warmup", "1", "--top", "3",
                                    "--compare-threads", "1,2"])
        assert torch.get_num_threads() == 1  # the caller's thread count is restored (the run ended at 2)
    finally:
        torch.set_num_threads(before)
    assert result["threads"] == (1, 2) and len(result["step_ms"]) == 2 and min(result["step_ms"]) > 0
    assert all(len(v) == 2 for v in result["ops"].values())
    assert any(a > 0 and b > 0 for a, b in result["ops"].values())
    # Every op's 2-thread time lands in exactly one of the two sums.
    assert result["scaling_ms"] + result["not_scaling_ms"] == pytest.approx(sum(b for _, b in result["ops"].values()))
    # The attention kernels ran at both thread counts.
    assert all(t > 0 for t in result["ops"]["gem_kernels::jagged_attention_fwd_native"])
    out = capsys.readouterr().out
    assert "at 1 threads" in out and "in ops that scale" in out


@pytest.mark.parametrize("value", ["2,1", "1", "1,2,4", "a,b", "0,2", "2,2"])
def test_compare_threads_rejects_bad_counts(value, capsys):
    with pytest.raises(SystemExit):
        profile_step.main(["--config", "tiny", "--compare-threads", value])
    assert "--compare-threads" in capsys.readouterr().err

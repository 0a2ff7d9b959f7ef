"""``python -m bench distributed`` compares like with like (issue 24 item 9): both sides start from
the same tables, see the same batches, and their per-step losses are verified before any time is
reported."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")


def test_quick_distributed_bench_verifies_equal_losses(tmp_path):
    from bench import distributed

    result = distributed.run(quick=True, out=tmp_path)
    assert set(result["loss_max_abs_diff"]) == {"world1_rank0", "world2_rank0", "world2_rank1"}
    assert max(result["loss_max_abs_diff"].values()) <= distributed.LOSS_ATOL
    for world in (1, 2):  # the same first loss on both sides: the same starting weights
        first = {r["kernel"]: r["loss_first"] for r in result["rows"] if r["world"] == world and r["rank"] == 0}
        assert first["gem_kernels"] == pytest.approx(first["torchrec_fbgemm"], abs=1e-6)

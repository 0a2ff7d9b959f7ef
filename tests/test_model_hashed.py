"""The GEM-like model on raw hashed ids (issue 28, "Model"): GemConfig(hashed_ids=True) feeds raw
64-bit ids with drift through zero-collision hashed tables; training fills and evicts them, and
model.train's checkpoint / --resume restores the identity tables exactly; ``--distributed`` shards
them table-wise (torchrun, gloo): 1 and 2 ranks give the same losses, a 2-rank checkpoint resumes on
1 rank with the identity tables of the uninterrupted run."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import gem_kernels as gk
from gem_kernels.torchrec import ZchEmbeddingBagCollection
from model.config import GemConfig
from model.data import SyntheticBatches
from model.gem import GemModel
from model.train import CHECKPOINT_FILE, main, train_step

# Small tables (and a population twice their size) so that a few steps of batch 32 fill them and evict.
HASHED = dataclasses.replace(GemConfig.tiny(), num_embeddings_per_table=(40, 24), hashed_ids=True)


def test_hashed_data_are_raw_ids_that_drift():
    data = SyntheticBatches(HASHED, 64, seed=0)
    first, later = data[0].sparse_values, data[30].sparse_values
    assert first.dtype == torch.int64
    # Raw 64-bit ids, not rows: far outside [0, num_embeddings), of both signs.
    assert int(first.abs().min()) > 2**32 and (first < 0).any() and (first > 0).any()
    assert torch.equal(first, SyntheticBatches(HASHED, 64, seed=0)[0].sparse_values)
    # Drift: 30 batches on, most of the population is new (the window slid by 30/16 of it).
    old = set(first.tolist())
    assert sum(v in old for v in later.tolist()) < 0.2 * later.numel()
    # The ids of batch i+1 not in batch i: new ids arrive each batch.
    assert any(v not in set(data[1].sparse_values.tolist()) for v in data[2].sparse_values.tolist())
    plain = dataclasses.replace(HASHED, hashed_ids=False)
    assert int(SyntheticBatches(plain, 64, seed=0)[0].sparse_values.max()) < 40


def test_hashed_ids_needs_a_default_row():
    with pytest.raises(ValueError, match="hashed_ids needs num_embeddings_per_table >= 2"):
        dataclasses.replace(HASHED, num_embeddings_per_table=(1, 5))
    with pytest.raises(ValueError, match="hashed_ids must be a bool"):
        dataclasses.replace(HASHED, hashed_ids=1)


def test_fused_model_trains_and_fills_the_identity_tables():
    model = GemModel(HASHED, "fused")
    ebc = model.sparse_arch.ebc
    assert isinstance(ebc, ZchEmbeddingBagCollection) and model.kernels == "fused"
    optimizers = model.make_optimizers()
    data = SyntheticBatches(HASHED, 32, seed=1)
    losses = [float(train_step(model, data[i], optimizers)) for i in range(6)]
    assert all(math.isfinite(x) for x in losses)
    stats = ebc.zch.stats()
    # Every slot holds an id (the default row aside), and the drifting population forced evictions.
    assert stats["used"] == [39, 23]
    assert min(stats["evictions"]) > 0 and min(stats["hits"]) > 0
    held = ebc.zch.table_ids(0)[ebc.zch.table_used(0)]
    assert held.unique().numel() == 39  # zero collisions: one slot per id
    seen = torch.cat([data[i].sparse_values for i in range(6)])
    assert torch.isin(held, seen).all()


def test_eager_model_is_torchrec_mc_ebc_and_swaps_to_the_hashed_table():
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

    eager = GemModel(HASHED, "eager")
    assert isinstance(eager.sparse_arch.ebc, ManagedCollisionEmbeddingBagCollection)
    batch = SyntheticBatches(HASHED, 16, seed=2)[0]
    assert math.isfinite(float(train_step(eager, batch, eager.make_optimizers())))
    gk.swap(eager, optimizer=gk.optim.ExactRowwiseAdagrad(lr=HASHED.sparse_lr))
    assert isinstance(eager.sparse_arch.ebc, ZchEmbeddingBagCollection) and eager.kernels == "fused"
    assert math.isfinite(float(train_step(eager, batch, eager.make_optimizers())))


def test_checkpoint_resume_restores_the_identity_tables_exactly(tmp_path):
    common = ["--config", "tiny", "--kernels", "fused", "--batch-size", "16", "--no-progress", "--eval-batches", "1",
              "--warmup", "0", "--hashed-ids"]
    full = main(common + ["--steps", "6", "--checkpoint", str(tmp_path / "full")])
    main(common + ["--steps", "3", "--checkpoint", str(tmp_path / "resumed")])
    halfway = torch.load(tmp_path / "resumed" / CHECKPOINT_FILE, weights_only=False)["model"]
    resumed = main(common + ["--steps", "6", "--checkpoint", str(tmp_path / "resumed"), "--resume"])
    assert resumed["losses"] == full["losses"]  # bit-identical on the CPU
    a = torch.load(tmp_path / "full" / CHECKPOINT_FILE, weights_only=False)["model"]
    b = torch.load(tmp_path / "resumed" / CHECKPOINT_FILE, weights_only=False)["model"]
    zch_keys = [k for k in a if ".zch." in k]
    assert {"sparse_arch.ebc.zch.slot_meta", "sparse_arch.ebc.zch.index", "sparse_arch.ebc.zch.step"} <= set(zch_keys)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # The tables moved between step 3 and step 6, so the equality above is not of untouched state.
    assert not torch.equal(halfway["sparse_arch.ebc.zch.slot_meta"], a["sparse_arch.ebc.zch.slot_meta"])


def test_hashed_ids_with_distributed_column_wise_is_refused(capsys):
    from model.train import parse_args

    assert parse_args(["--hashed-ids", "--distributed"]).hashed_ids
    with pytest.raises(SystemExit):
        parse_args(["--hashed-ids", "--distributed", "--plan", "column_wise"])
    assert "the hashed tables shard table-wise only" in capsys.readouterr().err


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory):
    """torchrun launches of ``model.train --hashed-ids --distributed`` (3 steps, global batch 8):
    1 rank; 2 ranks; 2 ranks stopped at step 2 with a checkpoint; 1 rank resuming that checkpoint."""
    pytest.importorskip("torchrec")
    from .test_distributed_cli import _torchrun

    root = tmp_path_factory.mktemp("hashed_dist")
    runs = {name: _torchrun(world, root / f"{name}.json", "--hashed-ids", "--steps", str(steps), *extra)[0]
            for name, world, steps, extra in (
                ("one", 1, 3, ("--checkpoint", str(root / "one"))),
                ("two", 2, 3, ()),
                ("two_halfway", 2, 2, ("--checkpoint", str(root / "resumed"))),
                ("resumed_on_one", 1, 3, ("--checkpoint", str(root / "resumed"), "--resume")))}
    return runs, root


def test_distributed_hashed_one_rank_equals_two_ranks(distributed_runs):
    """Each table's owner remaps the global batch's ids in the unsharded order: the losses of 1 and
    2 ranks agree over 3 steps (fp32 sums in another order: 1e-5)."""
    runs, _ = distributed_runs
    one, two = runs["one"]["losses"], runs["two"]["losses"]
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-5, (one, two)


def _dcp_state(directory) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = directory.parent / f"{directory.name}.pt"
    dcp_to_torch_save(directory, path)
    return torch.load(path, weights_only=False)["model"]


def test_distributed_hashed_checkpoint_resumes_on_another_world_size(distributed_runs):
    """A 2-rank checkpoint at step 2, resumed on 1 rank to step 3: the losses are the uninterrupted
    1-rank run's, and its final checkpoint holds the same identity tables and eviction state (the
    zch.* keys of the sharded state_dict, resharded 2 -> 1 by torch.distributed.checkpoint)."""
    runs, root = distributed_runs
    resumed, one = runs["resumed_on_one"]["losses"], runs["one"]["losses"]
    assert len(resumed) == 3
    for a, b in zip(resumed, one):
        assert abs(a - b) <= 1e-5, (resumed, one)
    # the resumed run's final (step 3) checkpoint replaced the step-2 one
    want, got = _dcp_state(root / "one"), _dcp_state(root / "resumed")
    zch = [k for k in want if ".zch." in k]
    assert {k.rsplit(".", 1)[1] for k in zch} == {"slot_meta", "heap", "index", "pending", "table_state", "step"}
    for key in zch:
        assert torch.equal(got[key], want[key]), key
    # the clock: 3 training steps after from_torchrec's carry-over (one training call of it)
    assert int(want[next(k for k in zch if k.endswith("zch.step"))]) == 1 + 3
    assert int((want[next(k for k in zch if k.endswith("zch.slot_meta"))][:, 1] > 0).sum()) > 0  # ids were admitted

"""The GEM-like model on raw hashed ids (issue 28, "Model"): GemConfig(hashed_ids=True) feeds raw
64-bit ids with drift through zero-collision hashed tables; training fills and evicts them, and
model.train's checkpoint / --resume restores the identity tables exactly."""

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


def test_hashed_ids_with_distributed_is_refused(capsys):
    from model.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--hashed-ids", "--distributed"])
    assert "--hashed-ids with --distributed" in capsys.readouterr().err

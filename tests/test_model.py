"""The GEM-like model of model/: synthetic data, the eager and fused paths, training, FLOPs, the CLI."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gem_kernels
from model import Batch, GemConfig, GemModel, make_batch, train_step
from model.archs import (
    DOT_INTERACTION,
    JAGGED_ATTENTION,
    POOLED_EMBEDDINGS,
    attention_mask,
    dot_interaction_eager,
    jagged_attention_eager,
    pooled_embeddings_eager,
)
from .utils import assert_close, offsets_from_lengths

REPO = Path(__file__).resolve().parents[1]
SMALL = GemConfig.small()
WUKONG = dataclasses.replace(SMALL, interaction="wukong")
CONFIGS = [pytest.param(SMALL, id="dot"), pytest.param(WUKONG, id="wukong")]


@pytest.fixture(autouse=True)
def _one_thread():
    """These shapes are tiny: on a shared 2-core machine two OpenMP threads mostly wait on each other
    (10x slower under load), so the model tests run single-threaded."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _check_offsets(offsets: torch.Tensor, count: int, total: int) -> None:
    assert offsets.dtype == torch.int64 and offsets.shape == (count + 1,)
    assert int(offsets[0]) == 0 and int(offsets[-1]) == total
    assert bool((offsets.diff() >= 0).all())


# --------------------------------------------------------------------------------------------- data


def test_make_batch_layout():
    batch_size = 97
    b = make_batch(SMALL, batch_size, seed=0)
    T = SMALL.num_tables
    assert b.batch_size == batch_size
    assert b.dense.shape == (batch_size, SMALL.num_dense) and b.dense.dtype == torch.float32
    assert b.labels.shape == (batch_size, SMALL.num_tasks) and b.labels.dtype == torch.float32
    assert set(b.labels.unique().tolist()) == {0.0, 1.0}

    assert b.sparse_indices.dtype == torch.int64 and b.sparse_indices.dim() == 1
    _check_offsets(b.sparse_offsets, T * batch_size, b.sparse_indices.numel())
    bag_lengths = b.sparse_offsets.diff()
    assert int(bag_lengths.max()) <= SMALL.max_bag_size
    for t, rows in enumerate(SMALL.num_embeddings_per_table):
        ids = b.sparse_indices[b.sparse_offsets[t * batch_size]:b.sparse_offsets[(t + 1) * batch_size]]
        assert ids.numel() > 0 and int(ids.min()) >= 0 and int(ids.max()) < rows

    for name in ("seq_ids", "seq_timestamps", "seq_offsets", "num_targets"):
        assert getattr(b, name).dtype == torch.int64, name
    _check_offsets(b.seq_offsets, batch_size, b.seq_ids.numel())
    assert b.seq_timestamps.shape == b.seq_ids.shape
    lengths = b.seq_offsets.diff()
    assert int(lengths.max()) <= SMALL.max_seq_len
    assert int(b.seq_ids.min()) >= 0 and int(b.seq_ids.max()) < SMALL.num_items
    assert b.num_targets.shape == (batch_size,)
    assert bool((b.num_targets >= 0).all()) and bool((b.num_targets <= lengths).all())
    assert bool((b.num_targets <= SMALL.max_num_targets).all()) and int(b.num_targets.max()) > 0
    for start, end in zip(b.seq_offsets[:-1].tolist(), b.seq_offsets[1:].tolist()):
        assert bool((b.seq_timestamps[start:end].diff() > 0).all())

    # The edge cases the kernels must handle occur in the small config.
    assert int((bag_lengths == 0).sum()) > 0, "no empty bag"
    assert int((lengths == 0).sum()) > 0, "no zero-length sequence"
    assert int(lengths.max()) == SMALL.max_seq_len, "no sequence at the cap"


def test_make_batch_ids_are_skewed():
    b = make_batch(SMALL, 512, seed=1)
    rows = SMALL.num_embeddings_per_table[0]
    ids = b.sparse_indices[: int(b.sparse_offsets[512])]
    # Zipf-like: the most popular 1% of ids take far more than 1% of the lookups.
    assert float((ids < rows // 100).float().mean()) > 0.2


def test_make_batch_deterministic_per_seed():
    a, b, c = make_batch(SMALL, 33, seed=5), make_batch(SMALL, 33, seed=5), make_batch(SMALL, 33, seed=6)
    for field in dataclasses.fields(Batch):
        torch.testing.assert_close(getattr(a, field.name), getattr(b, field.name), rtol=0, atol=0)
    assert not torch.equal(a.dense, c.dense)


def test_labels_follow_the_teacher():
    """Labels depend on the features (a learnable signal): the teacher's logit separates them."""
    from model.data import teacher_logits

    b = make_batch(SMALL, 2048, seed=3)
    logits = teacher_logits(SMALL, b.dense, b.sparse_indices, b.sparse_offsets, b.seq_ids, b.seq_offsets,
                            b.num_targets)
    positive = logits[b.labels.bool()].mean()
    negative = logits[~b.labels.bool()].mean()
    assert float(positive - negative) > 0.5


def test_batch_to_moves_every_field():
    b = make_batch(SMALL, 4, seed=0).to("meta")
    assert all(getattr(b, f.name).device.type == "meta" for f in dataclasses.fields(Batch))


def test_gpu_preset_is_valid_and_bigger():
    gpu = GemConfig.gpu()
    assert gpu.num_tables > SMALL.num_tables and gpu.max_seq_len > SMALL.max_seq_len
    assert gpu.embedding_dim > SMALL.embedding_dim
    assert min(gpu.num_embeddings_per_table) > max(SMALL.num_embeddings_per_table)
    b = make_batch(gpu, 3, seed=0)
    _check_offsets(b.sparse_offsets, gpu.num_tables * 3, b.sparse_indices.numel())


@pytest.mark.parametrize("field, value", [("embedding_dim", 0), ("num_heads", 3), ("max_seq_len", -1),
                                          ("num_embeddings_per_table", ()), ("empty_seq_prob", 1.5),
                                          ("interaction", "cross"), ("wukong_fm_rank", 0), ("wukong_lcb_out", -1)])
def test_config_rejects_bad_sizes(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(WUKONG, **{field: value})


def test_bad_arguments():
    with pytest.raises(ValueError, match="kernels"):
        GemModel(SMALL, kernels="triton")
    with pytest.raises(ValueError, match="batch_size"):
        make_batch(SMALL, -1)


# ------------------------------------------------------------------------------ eager building blocks


def test_pooled_embeddings_eager_matches_a_loop():
    generator = torch.Generator().manual_seed(0)
    rows_per_table, batch_size, dim = (5, 7, 3), 4, 6
    weight = torch.randn(sum(rows_per_table), dim, generator=generator)
    row_offsets = torch.tensor([0, 5, 12])
    lengths = torch.tensor([2, 0, 3, 1, 0, 0, 4, 1, 1, 2, 0, 3])
    offsets = offsets_from_lengths(lengths)
    table = torch.arange(3).repeat_interleave(batch_size).repeat_interleave(lengths)
    indices = (torch.rand(int(lengths.sum()), generator=generator) * torch.tensor(rows_per_table)[table]).long()
    out = pooled_embeddings_eager(weight, row_offsets, indices, offsets, 3, batch_size)
    assert out.shape == (batch_size, 3, dim)
    for t in range(3):
        for b in range(batch_size):
            bag = slice(int(offsets[t * batch_size + b]), int(offsets[t * batch_size + b + 1]))
            expected = weight[row_offsets[t] + indices[bag]].sum(0)
            assert_close(out[b, t], expected)


def test_dot_interaction_eager_matches_a_loop():
    features = torch.randn(3, 5, 4)
    out = dot_interaction_eager(features)
    expected = torch.stack([torch.stack([features[b, i] @ features[b, j] for i in range(5) for j in range(i + 1, 5)])
                            for b in range(3)])
    assert_close(out, expected)


def _attention_loop(q, k, v, seq_offsets, num_targets):
    """Causal target-aware softmax attention, one query at a time (the semantics, not the padding)."""
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    for b in range(seq_offsets.numel() - 1):
        start, end = int(seq_offsets[b]), int(seq_offsets[b + 1])
        history_end = end - int(num_targets[b])
        for i in range(start, end):
            keys = [j for j in range(start, i + 1) if j < history_end or j == i]
            scores = torch.einsum("hd,khd->hk", q[i], k[keys]) * scale
            out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[keys])
    return out


@pytest.mark.parametrize("kernels", ["eager", "fused"])
def test_jagged_attention_matches_a_loop(kernels):
    lengths = torch.tensor([3, 0, 5, 1, 4])
    num_targets = torch.tensor([1, 0, 2, 1, 0])
    seq_offsets = offsets_from_lengths(lengths)
    q, k, v = (torch.randn(int(lengths.sum()), 2, 4, requires_grad=True) for _ in range(3))
    out = JAGGED_ATTENTION[kernels](q, k, v, seq_offsets, num_targets, 6)  # max_len > longest: extra padding
    expected = _attention_loop(q, k, v, seq_offsets, num_targets)
    assert_close(out, expected)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for g, w in zip(got, want):
        assert_close(g, w)


def test_attention_mask_targets_see_history_and_themselves():
    mask = attention_mask(torch.tensor([4]), torch.tensor([2]), 5)[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [1, 1, 1, 0, 0],   # first target: history + itself
                             [1, 1, 0, 1, 0],   # second target: history + itself, not the first target
                             [1, 1, 0, 0, 1]],  # padding: only what keeps the softmax row non-empty
                            dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_every_arch_has_both_kernels():
    for table in (POOLED_EMBEDDINGS, JAGGED_ATTENTION, DOT_INTERACTION):
        assert set(table) == {"eager", "fused"}
    assert JAGGED_ATTENTION["fused"] is not jagged_attention_eager
    assert DOT_INTERACTION["fused"] is gem_kernels.dot_interaction
    assert POOLED_EMBEDDINGS["fused"] is not pooled_embeddings_eager


# ----------------------------------------------------------------------------------------- the model


def _loss_and_grads(kernels: str, batch: Batch, cfg: GemConfig = SMALL):
    model = GemModel(cfg, kernels=kernels, seed=0)
    loss = model.loss(batch)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return model, loss.detach(), grads


def test_forward_shapes():
    model = GemModel(SMALL, kernels="fused")
    batch = make_batch(SMALL, 37, seed=0)
    assert model(batch).shape == (37, SMALL.num_tasks)
    assert model.sparse_arch(batch.sparse_indices, batch.sparse_offsets, 37).shape == (37, SMALL.num_tables,
                                                                                       SMALL.embedding_dim)
    user = model.sequence_arch(batch.seq_ids, batch.seq_timestamps, batch.seq_offsets, batch.num_targets)
    assert user.shape == (37, SMALL.embedding_dim)
    empty = batch.seq_offsets.diff() == 0
    assert bool(empty.any()) and bool((user[empty] == 0).all()) and bool((user[~empty] != 0).any(1).all())


def test_same_seed_same_parameters():
    eager, fused = GemModel(SMALL, kernels="eager", seed=3), GemModel(SMALL, kernels="fused", seed=3)
    other = GemModel(SMALL, kernels="eager", seed=4)
    for (name, a), (_, b) in zip(eager.named_parameters(), fused.named_parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(eager.sparse_arch.weight, other.sparse_arch.weight)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("batch_size", [64, 1])
def test_eager_and_fused_agree(batch_size, cfg):
    batch = make_batch(cfg, batch_size, seed=11)
    _, loss_eager, grads_eager = _loss_and_grads("eager", batch, cfg)
    model, loss_fused, grads_fused = _loss_and_grads("fused", batch, cfg)
    assert torch.isfinite(loss_eager)
    assert_close(loss_fused, loss_eager, dtype=torch.float32)
    assert grads_eager.keys() == grads_fused.keys()
    for name in grads_eager:
        assert grads_eager[name] is not None and grads_fused[name] is not None, name
        assert_close(grads_fused[name], grads_eager[name], dtype=torch.float32)
    # Every arch got a gradient signal (nothing silently detached).
    assert int(batch.seq_offsets[-1]) > 0
    for name in ("dense_arch.0.weight", "sparse_arch.weight", "sequence_arch.item_embedding",
                 "sequence_arch.time_embedding", "sequence_arch.layers.0.qkv.weight",
                 "interaction_arch.task_heads.weight"):
        assert float(grads_eager[name].abs().sum()) > 0, name
    if cfg.interaction == "wukong":
        wukong = [name for name in grads_eager if name.startswith("interaction_arch.wukong.")]
        assert len(wukong) > 10 and all(float(grads_eager[name].abs().sum()) > 0 for name in wukong)


def test_all_sequences_empty():
    batch = make_batch(SMALL, 8, seed=2)
    batch = dataclasses.replace(batch, seq_ids=batch.seq_ids[:0], seq_timestamps=batch.seq_timestamps[:0],
                                seq_offsets=torch.zeros_like(batch.seq_offsets),
                                num_targets=torch.zeros_like(batch.num_targets))
    _, loss_eager, grads_eager = _loss_and_grads("eager", batch)
    _, loss_fused, grads_fused = _loss_and_grads("fused", batch)
    assert torch.isfinite(loss_eager)
    assert_close(loss_fused, loss_eager)
    for name in grads_eager:
        assert bool(torch.isfinite(grads_fused[name]).all()), name
        assert_close(grads_fused[name], grads_eager[name])
    assert float(grads_eager["sequence_arch.item_embedding"].abs().sum()) == 0


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("kernels", ["eager", "fused"])
def test_training_decreases_loss(kernels, cfg):
    model = GemModel(cfg, kernels=kernels, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    held_out = make_batch(cfg, 512, seed=10_000)
    with torch.no_grad():
        before = float(model.loss(held_out))
    losses = [train_step(model, make_batch(cfg, 128, seed=step), optimizer) for step in range(20)]
    assert all(isinstance(loss, float) for loss in losses)
    with torch.no_grad():
        after = float(model.loss(held_out))
    # Fresh batches every step, judged on a batch never trained on: this is learning the teacher.
    assert after < before - 0.05, (before, after)


def test_flops_per_step_wukong_counts_its_layers():
    batch = make_batch(SMALL, 16, seed=0)
    dot, wukong = GemModel(SMALL, kernels="eager"), GemModel(WUKONG, kernels="eager")
    num_in, layers = SMALL.num_features, 0
    for _ in range(WUKONG.wukong_layers):
        layers += gem_kernels.flops.wukong_layer(16, num_in, WUKONG.wukong_fm_out, WUKONG.wukong_lcb_out,
                                                 WUKONG.embedding_dim, WUKONG.wukong_fm_rank,
                                                 list(WUKONG.wukong_mlp), 4)[0]
        num_in = WUKONG.wukong_fm_out + WUKONG.wukong_lcb_out
    dot_products = 16 * SMALL.num_interactions * 2 * SMALL.embedding_dim
    # Only the over arch's first layer sees the wider interaction output.
    over_first_layer = 2 * 16 * (WUKONG.interaction_width - SMALL.num_interactions) * SMALL.over_arch_layers[0]
    expected = 3 * (layers - dot_products + over_first_layer)
    assert wukong.flops_per_step(batch) - dot.flops_per_step(batch) == expected


@pytest.mark.parametrize("length", [0, 6])
def test_flops_per_step(length):
    """The analytic count against torch's FlopCounterMode on the eager forward (an independent count
    of every matmul the step runs). Every history has the same length (no padding), SDPA runs its
    math path (so its two matmuls are counted), and the two conventions of flops_per_step are added
    back: eager attention computes all of QK^T and PV, 4 * B * L^2 * dim per layer (the count takes
    the causal half; eager pads an empty history to one position), and eager's gram bmm computes all F^2 products where
    the count takes the F(F-1)/2 pairs. A step is 3x the forward by the count's convention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = GemModel(SMALL, kernels="eager")
    batch = make_batch(SMALL, 8, seed=0)
    B, D, F = batch.batch_size, SMALL.embedding_dim, SMALL.num_features
    batch = dataclasses.replace(batch, seq_offsets=torch.arange(B + 1, dtype=torch.int64) * length,
                                seq_ids=torch.zeros(B * length, dtype=batch.seq_ids.dtype),
                                seq_timestamps=torch.arange(B * length, dtype=batch.seq_timestamps.dtype),
                                num_targets=torch.zeros_like(batch.num_targets))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.loss(batch)
    # Eager pads the histories to at least one position, so empty ones still cost one padded row.
    padded = max(length, 1)
    masked_half = (4 * padded * padded - 2 * length * length) * B * D * SMALL.num_attention_layers
    gram_extra = 2 * B * D * (F * F - SMALL.num_interactions)
    counted = model.flops_per_step(batch)
    assert isinstance(counted, int) and counted % 3 == 0
    assert counted // 3 + masked_half + gram_extra == counter.get_total_flops()


@pytest.mark.parametrize("amp", ["none", "bf16"])
def test_train_cli_runs(amp):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-m", "model.train", "--steps", "3", "--batch-size", "8", "--amp", amp],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"amp={amp}" in out and "steps=3" in out
    # The first loss it prints is this model's loss on the first batch, computed here independently.
    printed = [float(v) for v in re.findall(r"step\s+(?:0|2)\s+loss (\S+)", out)]
    assert len(printed) == 2, out
    model = GemModel(SMALL, kernels="fused", seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
        expected = float(model.loss(make_batch(SMALL, 8, seed=0)))
    assert abs(printed[0] - expected) <= 1e-4 + 1e-3 * abs(expected), (printed[0], expected)
    assert all(math.isfinite(v) for v in printed)
    # Its two throughput figures describe one clock: examples/s x s/step = the batch size.
    m = re.search(r"throughput (\S+) examples/s\s+\((\S+) ms/step", out)
    assert m, out
    assert float(m.group(1)) * float(m.group(2)) / 1e3 == pytest.approx(8, rel=2e-2)

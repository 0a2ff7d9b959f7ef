"""The GEM-like model of model/: synthetic data, eager vs fused, learning, compile, checkpoints, FLOPs, JSON, CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gem_kernels
from model import Batch, GemConfig, GemModel, PhaseTimer, SyntheticBatches
from model.archs import RowwiseAdagrad, SequenceLayout
from model.data import teacher_logits
from model.gem import PHASES
from model.train import auc, evaluate, load_checkpoint, main, parse_args, save_checkpoint, train_step
from .utils import assert_close

REPO = Path(__file__).resolve().parents[1]
TINY = GemConfig.tiny()
DOT = dataclasses.replace(TINY, interaction="dot")
CONFIGS = [pytest.param(TINY, id="wukong"), pytest.param(DOT, id="dot")]
JSON_FIELDS = {"config", "kernels", "steps", "step_ms", "examples_per_s", "tflops", "peak_tflops", "mfu", "auc",
               "components_ms", "loss_first", "loss_last"}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny shapes on a shared 2-core machine: two OpenMP threads mostly wait on each other."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _offsets_ok(offsets: torch.Tensor, count: int, total: int) -> None:
    assert offsets.dtype == torch.int64 and offsets.shape == (count + 1,)
    assert int(offsets[0]) == 0 and int(offsets[-1]) == total and bool((offsets.diff() >= 0).all())


# --------------------------------------------------------------------------------------------- data


def test_batch_layout():
    cfg = TINY
    b = SyntheticBatches(cfg, 97, seed=0)[0]
    B, T = 97, cfg.num_tables
    assert b.dense.shape == (B, cfg.num_dense) and b.dense.dtype == torch.float32
    assert b.sparse_lengths.shape == (T * B,) and int(b.sparse_lengths.sum()) == b.sparse_values.numel()
    assert int(b.sparse_lengths.max()) <= cfg.max_bag_size and int((b.sparse_lengths == 0).sum()) > 0
    for t, rows in enumerate(cfg.num_embeddings_per_table):
        ids = b.sparse_values[int(b.sparse_offsets[t * B]):int(b.sparse_offsets[(t + 1) * B])]
        assert int(ids.min()) >= 0 and int(ids.max()) < rows
    kjt = b.sparse_features()
    assert kjt.keys() == [f"sparse_{t}" for t in range(T)] and torch.equal(kjt.values(), b.sparse_values)
    _offsets_ok(b.history_offsets, B, b.history_ids.numel())
    lengths = b.history_offsets.diff()
    assert int(lengths.max()) <= cfg.max_seq_len and int((lengths == 0).sum()) > 0
    assert int((lengths == cfg.max_seq_len).sum()) > 0, "no history at the cap"
    for name in ("history_actions", "history_timestamps"):
        assert getattr(b, name).shape == b.history_ids.shape
    assert 0 <= int(b.history_actions.min()) and int(b.history_actions.max()) < cfg.num_actions
    for user, (start, end) in enumerate(zip(b.history_offsets[:-1].tolist(), b.history_offsets[1:].tolist())):
        assert bool((b.history_timestamps[start:end].diff() > 0).all())
        if end > start:
            assert int(b.history_timestamps[end - 1]) < int(b.request_timestamps[user])
    k = b.num_candidates
    assert int(k.min()) >= 1 and int(k.max()) == cfg.max_num_candidates and int(k.min()) < int(k.max())
    assert b.candidate_ids.numel() == int(k.sum()) and b.labels.shape == (int(k.sum()), cfg.num_tasks)
    assert set(b.labels.unique().tolist()) == {0.0, 1.0}


def test_lengths_are_lognormal_and_ids_skewed():
    cfg = dataclasses.replace(TINY, max_seq_len=1000, seq_len_median=20.0)
    b = SyntheticBatches(cfg, 2000, seed=1)[0]
    log_len = b.history_offsets.diff().clamp(min=1).double().log()
    assert abs(float(log_len.median()) - math.log(20)) < 0.15
    assert abs(float(log_len.std()) - cfg.seq_len_sigma) < 0.1
    # Zipf: the most popular 1% of item ids take far more than 1% of the history.
    assert float((b.history_ids < cfg.num_items // 100).float().mean()) > 0.2


def test_batches_deterministic_and_held_out_distinct():
    a, b = SyntheticBatches(TINY, 33, seed=5), SyntheticBatches(TINY, 33, seed=5)
    for field in dataclasses.fields(Batch):
        assert torch.equal(getattr(a[2], field.name), getattr(b[2], field.name)), field.name
    assert not torch.equal(a[2].dense, a[3].dense)
    assert not torch.equal(a[2].dense, a.held_out(2).dense)
    assert not torch.equal(a[2].dense, SyntheticBatches(TINY, 33, seed=6)[2].dense)


def test_teacher_uses_the_history():
    """The labels follow the teacher, and its history terms matter: shuffling the histories across
    users changes the logits a lot (so a model blind to the sequence cannot reach the teacher)."""
    b = SyntheticBatches(TINY, 2048, seed=3)[0]
    logits = teacher_logits(TINY, b)
    assert float(logits[b.labels.bool()].mean() - logits[~b.labels.bool()].mean()) > 0.5
    assert auc(logits[:, 0], b.labels[:, 0]) > 0.7
    perm = torch.randperm(b.batch_size, generator=torch.Generator().manual_seed(0))
    lengths = b.history_offsets.diff()[perm]
    rows = torch.cat([torch.arange(int(b.history_offsets[i]), int(b.history_offsets[i + 1])) for i in perm.tolist()])
    shuffled = dataclasses.replace(b, history_ids=b.history_ids[rows], history_actions=b.history_actions[rows],
                                   history_timestamps=b.history_timestamps[rows],
                                   history_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
    assert float((teacher_logits(TINY, shuffled) - logits).abs().mean()) > 0.3


def test_presets_valid():
    small, large = GemConfig.small(), GemConfig.large()
    assert TINY.num_items < small.num_items < large.num_items
    assert TINY.max_seq_len < small.max_seq_len < large.max_seq_len
    b = SyntheticBatches(large, 3, seed=0)[0]
    assert b.labels.shape[0] == int(b.num_candidates.sum())


@pytest.mark.parametrize("field, value", [("embedding_dim", 0), ("max_seq_len", 0), ("num_embeddings_per_table", ()),
                                          ("interaction", "cross"), ("wukong_fm_rank", 0), ("contextual_len", -1),
                                          ("max_num_candidates", 0), ("seq_len_median", 0.0), ("sparse_lr", 0.0)])
def test_config_rejects_bad_sizes(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(TINY, **{field: value})


def test_bad_arguments():
    with pytest.raises(ValueError, match="kernels"):
        GemModel(TINY, kernels="triton")
    with pytest.raises(ValueError, match="batch_size"):
        SyntheticBatches(TINY, 0)
    with pytest.raises(ValueError, match="index"):
        SyntheticBatches(TINY, 4)[-1]


# ------------------------------------------------------------------------------------- the layout


def test_sequence_layout():
    """[context | history | candidates] per user; candidate rows, timestamps and query timestamps."""
    b = SyntheticBatches(TINY, 5, seed=7)[0]
    c = TINY.contextual_len
    layout = SequenceLayout(b, c)
    lengths = b.history_offsets.diff()
    assert torch.equal(layout.seq_offsets.diff(), c + lengths + b.num_candidates)
    assert sorted(layout.rows.tolist()) == list(range(layout.total))
    row = 0
    for u in range(5):
        start = int(layout.seq_offsets[u])
        hist = b.history_timestamps[int(b.history_offsets[u]):int(b.history_offsets[u + 1])]
        seq_ts = layout.timestamps[start:int(layout.seq_offsets[u + 1])]
        assert torch.equal(seq_ts[c:c + hist.numel()], hist)
        assert bool((seq_ts[:c] == b.request_timestamps[u]).all())
        assert bool((seq_ts[c + hist.numel():] == b.request_timestamps[u]).all())
        query = layout.query_timestamps[start + c:start + c + hist.numel()]
        assert torch.equal(query, torch.cat([hist[1:], b.request_timestamps[u:u + 1]]))
        for k in range(int(b.num_candidates[u])):
            assert int(layout.candidate_rows[row]) == start + c + hist.numel() + k
            row += 1


def test_sequence_layout_query_timestamps_of_a_user_without_candidates():
    """A user with history but no candidate (serving may ask for none): its last history item's query
    timestamp is its own request's, not the next row's (the next user's first token)."""
    import dataclasses

    b = SyntheticBatches(TINY, 4, seed=11)[0]
    lengths = b.history_offsets.diff()
    assert int(lengths[1]) > 0
    # Drop user 1's candidates.
    starts = torch.cat([b.num_candidates.new_zeros(1), b.num_candidates.cumsum(0)])
    keep = torch.ones(b.candidate_ids.numel(), dtype=torch.bool)
    keep[int(starts[1]):int(starts[2])] = False
    num_candidates = b.num_candidates.clone()
    num_candidates[1] = 0
    b = dataclasses.replace(b, candidate_ids=b.candidate_ids[keep], num_candidates=num_candidates,
                            labels=b.labels[keep])
    for c in (0, TINY.contextual_len):
        layout = SequenceLayout(b, c)
        for u in range(4):
            start = int(layout.seq_offsets[u]) + c
            hist = b.history_timestamps[int(b.history_offsets[u]):int(b.history_offsets[u + 1])]
            query = layout.query_timestamps[start:start + hist.numel()]
            assert torch.equal(query, torch.cat([hist[1:], b.request_timestamps[u:u + 1]])), (c, u)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_interaction_input_and_over_arch_without_the_concats(cfg):
    """The interaction arch's input is one jagged_broadcast_cat (model.gem.interaction_tokens) and the over arch's first
    layer runs on [dense token, interactions] without concatenating them: the tokens equal the concat of
    each row's user tokens and its candidate, and the output and every gradient equal the concatenated
    formulation's (the eager arch; fp32, so up to reassociation)."""
    from model.gem import interaction_tokens

    batch = SyntheticBatches(cfg, 7, seed=3)[0]
    layout = SequenceLayout(batch, cfg.contextual_len)
    g = torch.Generator().manual_seed(0)
    num_rows, dim = batch.candidate_ids.numel(), cfg.embedding_dim
    non_sequence = torch.randn(7, cfg.num_tables + 1, dim, generator=g, requires_grad=True)
    candidates = torch.randn(num_rows, dim, generator=g, requires_grad=True)
    arch = GemModel(cfg, "eager").interaction_arch
    inputs = [non_sequence, candidates, *arch.parameters()]

    tokens = interaction_tokens(non_sequence, candidates, layout)
    concat = torch.cat([non_sequence[layout.candidate_owner], candidates.unsqueeze(1)], dim=1)
    assert torch.equal(tokens, concat)
    out = arch(tokens)
    expected = arch.over_arch(torch.cat([concat[:, 0], arch.interaction(concat).flatten(1)], dim=1))
    assert_close(out, expected)
    grad_out = torch.randn(out.shape, generator=g)
    want = torch.autograd.grad(expected, inputs, grad_out)
    for g_got, g_want in zip(torch.autograd.grad(out, inputs, grad_out, retain_graph=True), want):
        assert_close(g_got, g_want)
    # The model hands the dense token from its own source (dense_out gathered per row): the same output,
    # and the gradient reaches the dense token through that source instead of through tokens[:, 0].
    dense_out = non_sequence[:, 0].detach().clone().requires_grad_()
    with_dense = arch(tokens, dense_out.index_select(0, layout.candidate_owner))
    assert_close(with_dense, out)
    got = torch.autograd.grad(with_dense, [dense_out, non_sequence, candidates, *arch.parameters()], grad_out)
    assert_close(got[0] + got[1][:, 0], want[0][:, 0])
    assert_close(got[1][:, 1:], want[0][:, 1:])
    for g_got, g_want in zip(got[2:], want[1:]):
        assert_close(g_got, g_want)


@pytest.mark.parametrize("which", ["model_mlp", "wukong_fm_mlp"])
def test_mlp_relus_run_in_place_with_the_same_gradients(which):
    """The MLPs' ReLUs overwrite their Linear's output (no second [rows, width] tensor per layer; the
    Linear's backward reads its input, not its output): the output and every gradient equal the
    out-of-place formulation's exactly."""
    from model.archs import mlp

    torch.manual_seed(0)
    net = mlp((6, 5, 4), final_activation=True) if which == "model_mlp" else \
        gem_kernels.nn.WukongLayer(3, 2, 1, 4, fm_rank=2, mlp_hidden=[5, 7]).fm_mlp
    linears = [m for m in net if isinstance(m, torch.nn.Linear)]
    outputs = {}
    for i, m in enumerate(linears):
        m.register_forward_hook(lambda mod, inp, out, i=i: outputs.__setitem__(i, out.data_ptr()))
    x = torch.randn(9, linears[0].in_features, requires_grad=True)
    out = net(x)
    relus = [i for i, m in enumerate(net) if isinstance(m, torch.nn.ReLU)]
    assert relus and all(net[i].inplace for i in relus)
    if isinstance(net[-1], torch.nn.ReLU):
        assert out.data_ptr() == outputs[len(linears) - 1]
    expected = x
    for m in net:
        expected = torch.relu(expected) if isinstance(m, torch.nn.ReLU) else m(expected)
    assert torch.equal(out, expected)
    grad = torch.randn(out.shape)
    inputs = [x, *net.parameters()]
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        assert torch.equal(got, want)


def test_over_arch_first_layer_backward_fills_no_weight_sized_zero():
    """The over arch's first layer reads its weight's two column blocks through one split: the weight's
    gradient is one cat of the blocks' gradients, with no zero [H, D + I] filled per block (what two
    slices' backward does, then an add of the two) and the same values as the full-weight formulation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    arch = GemModel(TINY, "fused").interaction_arch
    first = arch.over_arch[0]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(9, TINY.num_features, TINY.embedding_dim, generator=g, requires_grad=True)
    out = arch(tokens)
    grad_out = torch.randn(out.shape, generator=g)

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            # slice_backward: a zero of the sliced tensor's shape with the block copied in (one op here).
            if func.overloadpacket in (torch.ops.aten.zeros, torch.ops.aten.zeros_like, torch.ops.aten.fill_,
                                       torch.ops.aten.zero_, torch.ops.aten.new_zeros, torch.ops.aten.slice_backward):
                self.shapes.append(tuple(result.shape))
            return result

    with Fills() as fills:
        (got,) = torch.autograd.grad(out, [first.weight], grad_out)
    assert tuple(first.weight.shape) not in fills.shapes
    interactions = arch.interaction(tokens).flatten(1)
    expected = arch.over_arch(torch.cat([tokens[:, 0], interactions], dim=1))
    (want,) = torch.autograd.grad(expected, [first.weight], grad_out)
    assert_close(got, want)


# ------------------------------------------------------------------------------------- eager vs fused


def _model_pair(cfg=TINY, seed=0):
    return GemModel(cfg, kernels="eager", seed=seed), GemModel(cfg, kernels="fused", seed=seed)


def _tables(model: GemModel) -> list[torch.Tensor]:
    """Every embedding table's [rows, D] weight, in one order for both kernels (TorchRec's keys)."""
    state = model.state_dict()
    names = [f"sparse_arch.ebc.embedding_bags.table_{t}.weight" for t in range(model.cfg.num_tables)]
    names += [f"sequence_arch.embeddings.ec.embeddings.{t}.weight" for t in ("item_table", "action_table")]
    return [state[name] for name in names]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_eager_and_fused_same_loss_and_gradients(cfg):
    """Same seed -> same parameters; one batch -> same loss, same dense gradients, and the same
    embedding update (eager: row-wise Adagrad on the tables' dense gradient; fused: in the backward)."""
    batch = SyntheticBatches(cfg, 48, seed=11)[0]
    eager, fused = _model_pair(cfg)
    for a, b in zip(_tables(eager), _tables(fused)):
        assert torch.equal(a, b)
    assert list(eager.state_dict()) == list(fused.state_dict())  # TorchRec's keys both ways
    dense_names = [n for n, _ in eager.named_parameters() if "sparse_arch" not in n and ".ec." not in n]
    assert dense_names == [n for n, _ in fused.named_parameters() if "sparse_arch" not in n and ".ec." not in n]
    opt_eager, opt_fused = eager.make_optimizers(), fused.make_optimizers()
    assert len(opt_eager) == 2 and len(opt_fused) == 1  # fused: the tables' optimizer is in the backward
    loss_eager, loss_fused = eager.loss(batch), fused.loss(batch)
    assert torch.isfinite(loss_eager)
    assert_close(loss_fused, loss_eager, dtype=torch.float32)
    loss_eager.backward()
    loss_fused.backward()
    eager_params, fused_params = dict(eager.named_parameters()), dict(fused.named_parameters())
    for name in dense_names:
        assert eager_params[name].grad is not None and fused_params[name].grad is not None, name
        assert_close(fused_params[name].grad, eager_params[name].grad, dtype=torch.float32, msg=name)
        assert float(eager_params[name].grad.abs().sum()) > 0 or "pos_bias" in name, name
    # The tables: eager's update of its gradient equals fused's in-backward update.
    before = [t.detach().clone() for t in _tables(eager)]
    opt_eager[1].step()
    for t, (old, new_eager, new_fused) in enumerate(zip(before, _tables(eager), _tables(fused))):
        assert not torch.equal(old, new_fused), f"table {t} not updated"
        assert_close(new_fused, new_eager, dtype=torch.float32, msg=f"table {t}")


@pytest.mark.parametrize("cfg", CONFIGS)
def test_eager_and_fused_same_loss_after_three_steps(cfg):
    data = SyntheticBatches(cfg, 48, seed=2)
    eager, fused = _model_pair(cfg)
    opt_eager, opt_fused = eager.make_optimizers(), fused.make_optimizers()
    losses = [(float(train_step(eager, data[i], opt_eager)), float(train_step(fused, data[i], opt_fused)))
              for i in range(3)]
    final = data[3]
    with torch.no_grad():
        losses.append((float(eager.loss(final)), float(fused.loss(final))))
    for step, (a, b) in enumerate(losses):
        assert abs(a - b) <= 1e-4 * abs(a), (step, a, b)
    assert losses[-1][0] != losses[0][0]


def test_rowwise_adagrad_rule():
    w = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    opt = RowwiseAdagrad([w], lr=0.5, eps=0.0)
    w.grad = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    opt.step()
    # row 0: m = (9 + 16) / 2 = 12.5, w -= 0.5 * g / sqrt(12.5); row 1 untouched.
    expected = torch.tensor([[1 - 1.5 / 12.5 ** 0.5, 2 - 2 / 12.5 ** 0.5], [3.0, 4.0]])
    torch.testing.assert_close(w.detach(), expected)
    torch.testing.assert_close(opt.state[w]["sum"], torch.tensor([12.5, 0.0]))


def test_no_sequence_model_ignores_the_history():
    cfg = dataclasses.replace(TINY, use_sequence=False)
    b = SyntheticBatches(cfg, 16, seed=0)[0]
    model = GemModel(cfg, kernels="fused")
    empty = dataclasses.replace(b, history_ids=b.history_ids[:0], history_actions=b.history_actions[:0],
                                history_timestamps=b.history_timestamps[:0],
                                history_offsets=torch.zeros_like(b.history_offsets))
    with torch.no_grad():
        assert torch.equal(model(b), model(empty))
        full = GemModel(TINY, kernels="fused")
        assert not torch.allclose(full(b), full(empty))


def test_all_histories_empty():
    b = SyntheticBatches(TINY, 8, seed=2)[0]
    b = dataclasses.replace(b, history_ids=b.history_ids[:0], history_actions=b.history_actions[:0],
                            history_timestamps=b.history_timestamps[:0],
                            history_offsets=torch.zeros_like(b.history_offsets))
    eager, fused = _model_pair()
    assert_close(fused.loss(b), eager.loss(b), dtype=torch.float32)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_swap_turns_the_eager_model_into_the_fused_one(cfg):
    """gk.swap(eager GemModel, ExactRowwiseAdagrad) replaces every eager leaf with its fused twin:
    the same module types and state_dict keys as GemModel(kernels="fused"), and the same losses
    over two training steps."""
    eager, fused = _model_pair(cfg)
    report = gem_kernels.swap(eager, optimizer=gem_kernels.optim.ExactRowwiseAdagrad(lr=cfg.sparse_lr))
    paths = {path for path, _, _ in report.replaced}
    assert {"sparse_arch.ebc", "sequence_arch.embeddings.ec", "interaction_arch.interaction"} <= paths
    assert all(f"sequence_arch.layers.{i}" in paths for i in range(cfg.num_hstu_layers))
    assert eager.kernels == "fused" and not eager.embedding_parameters()
    assert [type(m) for m in eager.modules()] == [type(m) for m in fused.modules()]
    assert list(eager.state_dict()) == list(fused.state_dict())
    assert sorted(report.fused_parameters) == ["sequence_arch.embeddings.ec.weights", "sparse_arch.ebc.weights"]
    data = SyntheticBatches(cfg, 32, seed=9)
    opt_swapped, opt_fused = eager.make_optimizers(), fused.make_optimizers()
    for i in range(2):
        a, b = train_step(eager, data[i], opt_swapped), train_step(fused, data[i], opt_fused)
        assert_close(a, b, dtype=torch.float32)
    assert not gem_kernels.swap(eager).replaced  # a second swap changes nothing


# ----------------------------------------------------------------------------------- learning, AUC


def test_auc():
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert auc(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 1, 1])) == 0.5  # ties count half
    assert math.isnan(auc(torch.tensor([0.3, 0.2]), torch.tensor([1, 1])))
    scores = torch.randn(500, generator=torch.Generator().manual_seed(0))
    labels = (torch.rand(500, generator=torch.Generator().manual_seed(1)) < torch.sigmoid(2 * scores)).float()
    pairs = (scores[labels == 1].unsqueeze(1) > scores[labels == 0].unsqueeze(0)).double().mean()
    assert abs(auc(scores, labels) - float(pairs)) < 1e-12


def _train_tiny(cfg: GemConfig, steps: int) -> dict[str, float]:
    model = GemModel(cfg, kernels="fused", seed=0)
    optimizers = model.make_optimizers()
    data = SyntheticBatches(cfg, 64, seed=0)
    for step in range(steps):
        train_step(model, data[step], optimizers)
    return evaluate(model, [data.held_out(i) for i in range(6)])


def test_training_learns_and_the_sequence_arch_helps():
    """100 steps of tiny: held-out AUC of both tasks clearly above 0.5, and above the same model
    without the sequence arch (the teacher plants history terms only the sequence arch can see)."""
    with_seq = _train_tiny(TINY, 100)
    without = _train_tiny(dataclasses.replace(TINY, use_sequence=False), 100)
    for task in TINY.task_names:
        assert with_seq[task] > 0.6, (task, with_seq)
        assert with_seq[task] > without[task] + 0.02, (task, with_seq, without)


# --------------------------------------------------------------------------------------- compile


def test_compiled_fused_model_matches():
    """torch.compile of every dense arch of the fused model (aot_eager: dynamo + AOTAutograd through
    the gem_kernels ops' fake and autograd registrations, without a C++ toolchain): same loss and
    gradients as the uncompiled model, over two batches of different shapes."""
    data = SyntheticBatches(TINY, 24, seed=4)
    plain, compiled = GemModel(TINY, kernels="fused"), GemModel(TINY, kernels="fused")
    compiled.compile_arches(backend="aot_eager", dynamic=True)
    for i in range(2):
        a, b = plain.loss(data[i]), compiled.loss(data[i])
        assert_close(b, a, dtype=torch.float32)
        a.backward()
        b.backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), compiled.named_parameters()):
        if p.grad is not None:
            assert_close(q.grad, p.grad, dtype=torch.float32, msg=name)
    assert list(plain.state_dict()) == list(compiled.state_dict())


# ----------------------------------------------------------------------------- checkpoint, resume


@pytest.mark.parametrize("kernels", ["fused", "eager"])
def test_checkpoint_resume_gives_the_same_losses(kernels, tmp_path):
    common = ["--config", "tiny", "--kernels", kernels, "--batch-size", "24", "--no-progress", "--eval-batches", "1",
              "--warmup", "0"]
    full = main(common + ["--steps", "6", "--checkpoint", str(tmp_path / "full")])
    main(common + ["--steps", "3", "--checkpoint", str(tmp_path)])
    resumed = main(common + ["--steps", "6", "--checkpoint", str(tmp_path), "--resume"])
    assert resumed["losses"] == full["losses"]  # bit-identical on the CPU
    assert resumed["auc"] == full["auc"]
    # Exact replay: after 3 + 3 steps every parameter and every optimizer state (the fused tables'
    # in-backward row-wise Adagrad sums and step included) equals the uninterrupted run's.
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    straight = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)
    for part in ("model", "fused_optimizers", "optimizers"):
        _assert_identical(state[part], straight[part], part)
    # The checkpoint holds the fused tables' optimizer state (fused) or the eager table optimizer.
    if kernels == "fused":
        assert float(state["fused_optimizers"]["sparse_arch.ebc"]["momentum1"].abs().sum()) > 0
        assert float(state["fused_optimizers"]["sequence_arch.embeddings.ec"]["momentum1"].abs().sum()) > 0
    else:
        assert len(state["optimizers"]) == 2 and state["optimizers"][1]["state"]


def _assert_identical(got, want, path: str) -> None:
    """Nested dicts / lists of tensors and plain values (optimizer names, hyper-parameters) equal bit for bit."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            _assert_identical(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_identical(g, w, f"{path}[{i}]")
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{path}: {m}")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def test_checkpoint_of_another_model_is_refused(tmp_path):
    fused = GemModel(TINY, kernels="fused")
    save_checkpoint(tmp_path, fused, fused.make_optimizers(), 1, [0.7])
    eager = GemModel(TINY, kernels="eager")
    with pytest.raises(ValueError, match="kernels"):
        load_checkpoint(tmp_path, eager, eager.make_optimizers())


# ------------------------------------------------------------------------- FLOPs, timer, JSON, CLI


def test_flops_per_step_counts_the_real_jagged_work():
    """One HSTU layer more adds exactly that layer's FLOPs, computed here from the per-user lengths:
    3x its projections on the real tokens + jagged attention over sum L^2 (causal half, 3.5x for
    fwd+bwd); padding to max_len is not counted."""
    b = SyntheticBatches(TINY, 16, seed=0)[0]
    one, two = GemModel(TINY, "fused"), GemModel(dataclasses.replace(TINY, num_hstu_layers=2), "fused")
    c, d = TINY.contextual_len, TINY.embedding_dim
    h, dl, da = TINY.num_heads, TINY.hstu_linear_dim, TINY.hstu_attention_dim
    lengths = [c + int(L) + int(k) for L, k in zip(b.history_offsets.diff(), b.num_candidates)]
    tokens = sum(lengths)
    projections = 2 * tokens * d * h * (2 * dl + 2 * da) + 2 * tokens * h * dl * d
    attention = int(2 * sum(L * L for L in lengths) * h * (da + dl) // 2 * 3.5)
    assert two.flops_per_step(b) - one.flops_per_step(b) == 3 * projections + attention
    padded = int(2 * 16 * TINY.attention_max_len ** 2 * h * (da + dl) // 2 * 3.5)
    assert attention < padded / 2
    # Wukong vs dot over the same rows: the interaction's own counts.
    rows = int(b.num_candidates.sum())
    dot = GemModel(DOT, "fused")
    wukong_flops = gem_kernels.flops.wukong_layer(rows, TINY.num_features, TINY.wukong_fm_out, TINY.wukong_lcb_out,
                                                  d, TINY.wukong_fm_rank, list(TINY.wukong_mlp), 4, backward=True)[0]
    dot_flops = gem_kernels.flops.dot_interaction(rows, TINY.num_features, d, False, 4, backward=True)[0]
    over_first = 3 * 2 * rows * (TINY.interaction_width - DOT.interaction_width) * TINY.over_arch_layers[0]
    assert one.flops_per_step(b) - dot.flops_per_step(b) == wukong_flops - dot_flops + over_first


def _plain_wukong_layer(layer, x: torch.Tensor) -> torch.Tensor:
    """One WukongLayer in plain PyTorch on its parameters (FlopCounterMode cannot see inside the fused
    ops): the FMB's optimised FM, LayerNorm and MLP, the LCB plus the residual as the one projection
    M = feature_mix() [num_out, num_in], or the LCB rows alone plus the identity, and the LayerNorm."""
    fn = torch.nn.functional
    s = torch.bmm(x, torch.matmul(x.transpose(1, 2), layer.fm_y)).flatten(1)
    fm = layer.fm_mlp(fn.layer_norm(s, s.shape[1:], layer.fm_norm.weight, layer.fm_norm.bias, layer.fm_norm.eps))
    fm = fm.view(x.shape[0], layer.num_fm_out, layer.dim)
    if layer.residual_weight is None:
        mixed = x + torch.cat([fm, torch.matmul(layer.lcb_weight, x)], 1)
    else:
        mixed = torch.matmul(layer.feature_mix(), x) + fn.pad(fm, (0, 0, 0, layer.num_lcb_out))
    return fn.layer_norm(mixed, (layer.dim,), layer.norm.weight, layer.norm.bias, layer.norm.eps)


def test_flops_per_step_wukong_counts_its_layers():
    """flops.wukong_layer (what flops_per_step sums over the Wukong stack) against torch's
    FlopCounterMode on the layers' forward and backward in plain PyTorch: an independent count of
    every matmul. FlopCounterMode counts matmuls only, so the two LayerNorms of each layer are added
    at the count's written convention, 8 FLOPs per normalised element forward and 12 backward (over
    F*k per row for the FMB's, num_out*dim for the output's); bias adds, ReLUs and residual adds
    count in neither. Layer 1 projects its residual (5 -> 8 features), layer 2 adds it (8 -> 8)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = dataclasses.replace(TINY, wukong_layers=2)
    layers = GemModel(cfg, "fused").interaction_arch.interaction.layers
    assert layers[0].residual_weight is not None and layers[1].residual_weight is None
    rows = 7
    x = torch.randn(rows, cfg.num_features, cfg.embedding_dim, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        out = x
        for layer in layers:
            out = _plain_wukong_layer(layer, out)
        out.sum().backward()
    assert all(p.grad is not None for layer in layers for p in layer.parameters())
    norms = sum(rows * (layer.num_in * cfg.wukong_fm_rank + layer.num_out * layer.dim) * (8 + 12) for layer in layers)
    counted = sum(gem_kernels.flops.wukong_layer(rows, layer.num_in, cfg.wukong_fm_out, cfg.wukong_lcb_out,
                                                 cfg.embedding_dim, cfg.wukong_fm_rank, list(cfg.wukong_mlp), 4,
                                                 backward=True)[0] for layer in layers)
    assert counted == counter.get_total_flops() + norms
    # flops_per_step adds exactly these layers to the dot model's count, less the dot interaction.
    b = SyntheticBatches(cfg, 16, seed=0)[0]
    wukong_rows = int(b.num_candidates.sum())
    stack = sum(gem_kernels.flops.wukong_layer(wukong_rows, layer.num_in, cfg.wukong_fm_out, cfg.wukong_lcb_out,
                                               cfg.embedding_dim, cfg.wukong_fm_rank, list(cfg.wukong_mlp), 4,
                                               backward=True)[0] for layer in layers)
    dot_cfg = dataclasses.replace(cfg, interaction="dot")
    dot = gem_kernels.flops.dot_interaction(wukong_rows, cfg.num_features, cfg.embedding_dim, False, 4, backward=True)[0]
    over_first = 3 * 2 * wukong_rows * (cfg.interaction_width - dot_cfg.interaction_width) * cfg.over_arch_layers[0]
    assert (GemModel(cfg, "fused").flops_per_step(b) - GemModel(dot_cfg, "fused").flops_per_step(b)
            == stack - dot + over_first)


def test_flops_per_step_against_an_independent_count():
    """The whole step's model FLOPs against FlopCounterMode on the fused model's forward + backward
    (every nn.Linear: dense arch, contextual projection, Wukong MLP, over arch, heads) plus, by
    hand, what runs in gem_kernels' custom ops, which FlopCounterMode cannot see: the HSTU layers
    (their projections' GEMMs, and the attention: Q K^T and P V over the causal half of each user's L^2, backward 2.5x), Wukong's
    FM compression and feature mix with their LayerNorms, the embedding bags' pooling and gradient
    sums. The optimizer update is not model work: it is flops_by_component's "optimizer" alone."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = TINY
    model, b = GemModel(cfg, "fused"), SyntheticBatches(cfg, 16, seed=0)[0]
    with FlopCounterMode(display=False) as counter:
        model.loss(b).backward()
    d, h, dl, da = cfg.embedding_dim, cfg.num_heads, cfg.hstu_linear_dim, cfg.hstu_attention_dim
    lengths = [cfg.contextual_len + int(L) + int(k) for L, k in zip(b.history_offsets.diff(), b.num_candidates)]
    attention = cfg.num_hstu_layers * 3.5 * sum(2 * L * L * h * (da + dl) / 2 for L in lengths)
    # The HSTU layer's two projections run inside gem_kernels' fused hstu_layer ops too: the UVQK
    # and output GEMMs, forward and their two backward GEMMs each.
    attention += cfg.num_hstu_layers * 3 * sum(lengths) * (2 * d * h * (2 * dl + 2 * da) + 2 * h * dl * d)
    rows, wukong, num_in = int(b.num_candidates.sum()), 0, cfg.num_features
    for _ in range(cfg.wukong_layers):
        num_out, k = cfg.wukong_fm_out + cfg.wukong_lcb_out, cfg.wukong_fm_rank
        proj_rows = num_out if num_out != num_in else cfg.wukong_lcb_out
        fm = 4 * rows * num_in * d * k          # X^T Y, then X (X^T Y)
        mix = 2 * rows * proj_rows * num_in * d  # the LCB (+ residual) projection over features
        norms = rows * num_in * k + rows * num_out * d
        wukong += 3 * (fm + mix) + (8 + 12) * norms
        num_in = num_out
    lookups = b.sparse_values.numel()
    tokens = b.history_ids.numel() + b.candidate_ids.numel()
    embeddings = 2 * (2 * lookups * d) + 2 * (2 * tokens * d)  # pooling fwd + bwd; item and action grads
    assert model.flops_per_step(b) == counter.get_total_flops() + attention + wukong + embeddings
    components = model.flops_by_component(b)
    assert model.flops_per_step(b) == sum(v for k, v in components.items() if k != "optimizer")
    distinct = sum(int(v.unique().numel()) for v in b.sparse_values.split(
        b.sparse_lengths.view(cfg.num_tables, -1).sum(1).tolist()))
    distinct += int(torch.cat([b.history_ids, b.candidate_ids]).unique().numel())
    distinct += int(b.history_actions.unique().numel()) + 1
    dense = sum(p.numel() for p in model.dense_parameters())
    assert components["optimizer"] == 6 * distinct * d + 10 * dense


def test_vendor_peaks_by_part_and_tf32(monkeypatch):
    """H100 SXM / PCIe / NVL map to their own dense peaks; fp32 takes the TF32 peak when TF32 is on."""
    import model.train
    from model.train import vendor_peak

    cuda = torch.device("cuda")
    monkeypatch.setattr(model.train, "tf32_enabled", lambda device: False)
    assert vendor_peak(torch.device("cpu"), torch.float32) is None
    assert vendor_peak(cuda, torch.bfloat16, "NVIDIA H100 80GB HBM3") == 989.4
    assert vendor_peak(cuda, torch.bfloat16, "NVIDIA H100 PCIe") == 756.0
    assert vendor_peak(cuda, torch.bfloat16, "NVIDIA H100 NVL") == 835.5
    assert vendor_peak(cuda, torch.float32, "NVIDIA H100 PCIe") == 51.2
    assert vendor_peak(cuda, torch.float32, "NVIDIA H200") == 66.9
    assert vendor_peak(cuda, torch.float32, "Some Other GPU") is None
    monkeypatch.setattr(model.train, "tf32_enabled", lambda device: True)
    assert vendor_peak(cuda, torch.float32, "NVIDIA H100 80GB HBM3") == 494.7


def test_mfu_by_component_is_each_phase_over_its_time():
    from model.train import mfu, mfu_by_component

    flops = {"sparse": 1e9, "sequence": 2e9, "interaction": 0, "heads": 1e6, "backward": 4e9, "optimizer": 9e9}
    ms = {"sparse": 10.0, "sequence": 20.0, "interaction": 5.0, "heads": None, "backward_optimizer": 40.0}
    out = mfu_by_component(flops, ms, 0.5)
    assert out == {"sparse": pytest.approx(0.2), "sequence": pytest.approx(0.2), "interaction": 0.0, "heads": None,
                   "backward_optimizer": pytest.approx(0.2)}
    assert mfu(1e9, 10.0, 0.5) == pytest.approx(0.2)


def test_bench_model_row_and_train_agree_on_mfu(monkeypatch):
    """On the tiny config, `python -m bench model`'s row and model.train compute one MFU: the case's
    FLOPs are the mean flops_per_step of its batches, and the harness's % of peak for a step time
    and peak is model.train's mfu for the same time and peak."""
    import bench.model
    from bench import harness
    from model.train import mfu

    cpu = torch.device("cpu")
    monkeypatch.setattr(bench.model, "config_for", lambda device: ("tiny", TINY, None))
    case = next(bench.model.cases(quick=True, device=cpu))
    batch_size = max(TINY.batch_size // 4, 8)
    data = SyntheticBatches(TINY, batch_size, seed=0)
    model = GemModel(TINY, "fused")
    assert case.flops == sum(model.flops_per_step(data[i]) for i in range(2)) // 2
    assert any("components TFLOP/s" in note for note in case.notes)
    timing = harness.Timing(times=[0.004, 0.005, 0.006], capped=False)
    peaks = {"matmul_tflops": {"float32": 0.25}}
    row = harness.make_row("model", case, "fused", timing, cpu, peaks, "sha", "now")
    assert row["pct_peak"] == pytest.approx(100 * mfu(case.flops, timing.median_ms, 0.25))


def test_train_report_and_bench_row_agree_on_mfu(monkeypatch):
    """model.train's printed MFU and the bench's model row, fed the same step times, FLOPs and peak, are
    one number: one formula, one FLOP count, one median."""
    import model.train
    from bench import harness

    cpu = torch.device("cpu")
    data = SyntheticBatches(TINY, 16, seed=0)
    model_ = GemModel(TINY, "fused")
    step_ms = [4.0, 7.0, 5.0, 6.0]  # even: both medians interpolate
    run = {"losses": [0.7] * 4, "step_ms": step_ms, "components": {p: [1.0] * 4 for p in PHASES},
           "flops": [model_.flops_by_component(data[i]) for i in range(4)], "auc": {}, "auc_history": []}
    monkeypatch.setattr(model.train, "measured_peak", lambda device, dtype: 0.25)
    args = parse_args(["--config", "tiny", "--steps", "4"])
    reported = model.train.report(args, TINY, model_, run)
    flops = sum(model_.flops_per_step(data[i]) for i in range(4)) / 4
    case = harness.Case(op="step", shape="tiny", dtype=torch.float32, flops=flops, bytes=0,
                        impls={"fused": lambda: None}, baseline="fused", peak="matmul", unverified="a formula test")
    timing = harness.Timing(times=[ms / 1e3 for ms in step_ms], capped=False)
    row = harness.make_row("model", case, "fused", timing, cpu, {"matmul_tflops": {"float32": 0.25}}, "sha", "now")
    assert reported["step_ms"] == pytest.approx(row["ms"])
    assert reported["mfu"] == pytest.approx(row["pct_peak"] / 100, rel=1e-12)
    assert reported["tflops"] == pytest.approx(row["tflops"], rel=1e-12)


def _report_with_peak_reads(monkeypatch, reads):
    """model.train.report on fixed step times and FLOPs, measured_peak returning `reads` in turn."""
    import model.train

    data = SyntheticBatches(TINY, 16, seed=0)
    model_ = GemModel(TINY, "fused")
    run = {"losses": [0.7] * 4, "step_ms": [5.0] * 4, "components": {p: [1.0] * 4 for p in PHASES},
           "flops": [model_.flops_by_component(data[i]) for i in range(4)], "auc": {}, "auc_history": []}
    calls = iter(reads)
    monkeypatch.setattr(model.train, "measured_peak", lambda device, dtype: next(calls))
    args = parse_args(["--config", "tiny", "--steps", "4"])
    return model.train.report(args, TINY, model_, run)


def test_a_peak_read_below_the_steps_own_rate_is_read_again(monkeypatch):
    """A peak below the rate the step itself reached is a read taken on a busy host: model.train reads
    it again (at most PEAK_READS times) and keeps the best; a plausible first read is the only one."""
    import model.train

    first = _report_with_peak_reads(monkeypatch, [1.0])
    rate = first["tflops"]
    assert first["peak_tflops_reads"] == [1.0] and first["peak_tflops"] == 1.0
    again = _report_with_peak_reads(monkeypatch, [rate / 100, rate / 50, 4 * rate])
    assert again["peak_tflops_reads"] == [rate / 100, rate / 50, 4 * rate]
    assert again["peak_tflops"] == 4 * rate and again["mfu"] == pytest.approx(0.25)
    stays = _report_with_peak_reads(monkeypatch, [rate / 100, rate / 2, rate / 50, 9.0])
    assert len(stays["peak_tflops_reads"]) == model.train.PEAK_READS == 3
    assert stays["peak_tflops"] == rate / 2 and stays["mfu"] == pytest.approx(2.0)


def test_an_mfu_above_100_percent_is_printed_with_a_warning(monkeypatch, capsys, tmp_path):
    """model.train's printout flags an MFU no peak allows (every read of the peak below the step's rate)."""
    import model.train

    monkeypatch.setattr(model.train, "measured_peak", lambda device, dtype: 1e-9)
    model.train.main(["--config", "tiny", "--steps", "3", "--warmup", "1", "--no-progress", "--eval-batches", "1"])
    err = capsys.readouterr().err
    assert "warning: MFU above 100 %" in err and "host was busy" in err
    monkeypatch.setattr(model.train, "measured_peak", lambda device, dtype: 1e9)
    model.train.main(["--config", "tiny", "--steps", "3", "--warmup", "1", "--no-progress", "--eval-batches", "1"])
    assert "MFU above 100 %" not in capsys.readouterr().err


def test_train_measures_the_peak_as_the_full_bench_run_does(monkeypatch):
    """The roof of model.train's MFU is the matmul the bench's full run measures (size and repeats)."""
    import model.train
    from gem_kernels.testing import peaks

    calls = []
    monkeypatch.setattr(peaks, "_matmul_tflops",
                        lambda n, dtype, device, settings: calls.append((n, dtype, settings)) or 1.0)
    monkeypatch.setattr(peaks, "_copy_gbps", lambda mib, device, settings: 1.0)
    peaks.measure_peaks(torch.device("cpu"), quick=False)
    model.train.measured_peak(torch.device("cpu"), torch.float32)
    assert len(calls) == 2 and calls[0] == calls[1]


def test_phase_timer_marks_every_component():
    model = GemModel(TINY, kernels="fused")
    timer = PhaseTimer(torch.device("cpu"))
    train_step(model, SyntheticBatches(TINY, 16)[0], model.make_optimizers(), timer=timer)
    times = timer.read()
    assert list(times) == list(PHASES) and all(ms > 0 for ms in times.values())


def test_train_step_puts_an_eval_model_in_training_mode_and_keeps_a_frozen_submodule():
    """train_step trains a model left in eval mode (after evaluate), every submodule included; a model
    already in training mode is left as it is, so a submodule the user put in eval mode stays so."""
    model = GemModel(TINY, kernels="fused")
    optimizers = model.make_optimizers()
    batch = SyntheticBatches(TINY, 16)[0]
    model.eval()
    train_step(model, batch, optimizers)
    assert all(m.training for m in model.modules())
    model.task_heads.eval()
    train_step(model, batch, optimizers)
    assert model.training and not any(m.training for m in model.task_heads.modules())


def test_json_fields(tmp_path):
    path = tmp_path / "run.json"
    result = main(["--config", "tiny", "--steps", "6", "--warmup", "2", "--batch-size", "32", "--no-progress",
                   "--eval-batches", "2", "--json", str(path)])
    written = json.loads(path.read_text())
    assert JSON_FIELDS <= set(written) and written["config"] == "tiny" and written["kernels"] == "fused"
    assert written["steps"] == 6 and written["timed_steps"] == 4
    assert set(written["auc"]) == {"click", "conversion"} and all(0 < v < 1 for v in written["auc"].values())
    assert set(written["components_ms"]) == set(PHASES) and all(v > 0 for v in written["components_ms"].values())
    # Medians of the parts need not add up exactly, but they are the parts of one step.
    assert 0.5 * written["step_ms"] < sum(written["components_ms"].values()) < 1.5 * written["step_ms"]
    assert written["examples_per_s"] == pytest.approx(32 / (written["step_ms"] / 1e3))
    assert written["tflops"] == pytest.approx(written["flops_per_step"] / (written["step_ms"] / 1e3) / 1e12)
    assert 0 < written["mfu"] < 1 and written["mfu"] == pytest.approx(written["tflops"] / written["peak_tflops"])
    assert written["peak_tflops"] > 0 and written["dtype"] == "float32"
    assert written["tf32"] is None and written["mfu_vendor"] is None  # a CPU run
    assert set(written["mfu_by_component"]) == set(PHASES) and all(v > 0 for v in written["mfu_by_component"].values())
    assert written["optimizer_flops_per_step"] > 0
    assert written["flops_per_step"] == pytest.approx(sum(v for k, v in written["flops_by_component"].items()
                                                          if k != "optimizer"))
    assert written["loss_first"] == written["losses"][0] and written["loss_last"] == written["losses"][-1]
    assert written == json.loads(json.dumps(result))


def test_parse_args_rejects_bad_values():
    for argv in (["--steps", "0"], ["--resume"], ["--batch-size", "0"], ["--kernels", "triton"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


def test_train_cli_runs_bf16(tmp_path):
    """The CLI as a user runs it (a subprocess): bf16 autocast, JSON written, AUC and MFU printed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    path = tmp_path / "bf16.json"
    result = subprocess.run([sys.executable, "-m", "model.train", "--config", "tiny", "--steps", "4", "--amp", "bf16",
                             "--batch-size", "16", "--json", str(path), "--no-progress"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "amp=bf16" in result.stdout and "held-out AUC click" in result.stdout and "MFU" in result.stdout
    written = json.loads(path.read_text())
    assert written["dtype"] == "bfloat16" and math.isfinite(written["loss_last"]) and 0 < written["mfu"] < 1
    # the CLI applies its --malloc-keep-mib default (gem_kernels.testing.malloc; 0 where it is not glibc)
    from gem_kernels.testing import malloc
    assert written["malloc_keep_mib"] == (malloc.DEFAULT_KEEP_MIB if malloc._mallopt() is not None else 0)
    # the host's load around the loop, and the OpenMP wait policy it ran under (unset here)
    load = written["loadavg_1min"]
    assert set(load) == {"start", "end"} and all(v >= 0 for v in load.values())
    assert written["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY")


def test_cpu_contention_warning():
    """model.train warns when other processes' load leaves fewer idle cores than its threads while OpenMP
    spin-waits (a busy host made each 2-thread step 2-14x slower), and only then."""
    from model.train import cpu_contention_warning

    warning = cpu_contention_warning(2, 1.0, 2, None)
    assert warning and "load average is 1.0 on 2 cores" in warning and "OMP_WAIT_POLICY=PASSIVE" in warning
    assert cpu_contention_warning(2, 1.0, 2, "active")  # spinning too
    assert cpu_contention_warning(2, 1.0, 2, " passive") is None  # threads sleep at barriers: nothing to warn
    assert cpu_contention_warning(2, 0.3, 2, None) is None  # a quiet host
    assert cpu_contention_warning(1, 5.0, 2, None) is None  # one thread: no barrier to wait at
    assert cpu_contention_warning(4, 3.0, 8, None) is None  # enough idle cores
    assert cpu_contention_warning(8, 3.0, 8, None)
    assert cpu_contention_warning(2, 9.0, None, None) is None  # core count unknown


@pytest.mark.parametrize("load,warned", [(5.0, True), (0.0, False)])
def test_train_main_warns_on_a_busy_host(tmp_path, monkeypatch, capsys, load, warned):
    """The CLI's wiring of cpu_contention_warning: with the host's load average above its idle cores it
    prints the warning before training, and the JSON carries that load; a quiet host gets no warning."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        path = tmp_path / "run.json"
        main(["--config", "tiny", "--steps", "2", "--batch-size", "8", "--device", "cpu", "--no-progress",
              "--malloc-keep-mib", "0", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert ("warning: the 1-minute load average is 5.0 on 2 cores" in err) == warned, err
    written = json.loads(path.read_text())
    assert written["loadavg_1min"] == {"start": load, "end": load} and written["omp_wait_policy"] is None

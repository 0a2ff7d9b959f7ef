"""The unsharded TorchRec collections after gk.swap, checked the way TorchRec's own module tests check
its modules (torchrec/modules/tests/test_embedding_modules.py, test_crossnet.py,
torchrec/models/tests/test_dlrm.py: read, not copied), plus the odd-input items of issue 30.

On main: torchrec.fx.symbolic_trace raised "input must be a 1-D or 2-D tensor of ids, got Proxy",
torch.jit.script gave an opaque error, meta-built collections failed after to_empty, an optimizer built
before the swap silently stopped training the tables, a frozen EBC came out trainable, optimizer
state loaded onto other rows when the tables were in another order, and the KJT errors below were
"shape '[2, 1]' is invalid" / "allocated size does not match required size"-style messages.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import gem_kernels as gk

torchrec = pytest.importorskip("torchrec", reason="torchrec is not installed (see README: optional dependency)")
from torchrec.fx import symbolic_trace  # noqa: E402
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from gem_kernels.torchrec import FusedEmbeddingBagCollection, FusedEmbeddingCollection  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)


def _swapped(module: nn.Module, **kwargs) -> tuple[nn.Module, nn.Module]:
    """(eager copy, swapped module) of ``module``."""
    eager = copy.deepcopy(module)
    holder = nn.ModuleDict({"m": module})
    report = gk.swap(holder, **kwargs)
    assert [p for p, _, _ in report.replaced] == ["m"], str(report)
    return eager, holder["m"]


def _kjt(keys, values, offsets, weights=None, device=None):
    kw = dict(device=device)
    return KeyedJaggedTensor.from_offsets_sync(
        keys=keys, values=torch.tensor(values, **kw), offsets=torch.tensor(offsets, **kw),
        weights=None if weights is None else torch.tensor(weights, **kw))


def _assert_same_kt(got, want):
    assert got.keys() == want.keys()
    assert got.offset_per_key() == want.offset_per_key()
    torch.testing.assert_close(got.values(), want.values(), **TOL)


def _tables(weighted_feature_sets=(["f1", "f3"], ["f2"]), dims=(3, 4), rows=10, pooling=PoolingType.SUM):
    return [EmbeddingBagConfig(name=f"t{i + 1}", embedding_dim=d, num_embeddings=rows, feature_names=list(fs),
                               pooling=pooling) for i, (fs, d) in enumerate(zip(weighted_feature_sets, dims))]


WEIGHTED = dict(keys=["f1", "f3", "f2"], values=[1, 2, 4, 5, 4, 3, 2, 9, 1, 3, 4, 7],
                offsets=[0, 2, 4, 6, 8, 10, 12], weights=[0.1, 0.2, 0.4, 0.5, 0.4, 0.3, 0.2, 0.9, 0.1, 0.3, 0.4, 0.7])


# -- what TorchRec's module tests check ------------------------------------------------------------

@pytest.mark.parametrize("case", ["unweighted", "weighted", "shared_tables", "shared_features", "mean"])
def test_ebc_cases_equal_torchrec(case):
    torch.manual_seed(0)
    if case == "shared_tables":
        ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10,
                                                                feature_names=["f1", "f2"])])
        features = _kjt(["f1", "f2"], [0, 1, 2, 3, 4, 5, 6, 7], [0, 2, 2, 3, 4, 5, 8])
    elif case == "shared_features":
        ebc = EmbeddingBagCollection(tables=_tables((["f1"], ["f1"])))
        features = _kjt(["f1"], [0, 1, 2, 3, 4, 5, 6, 7], [0, 2, 2, 3, 4, 5, 8])
    else:
        pooling = PoolingType.MEAN if case == "mean" else PoolingType.SUM
        ebc = EmbeddingBagCollection(tables=_tables(pooling=pooling), is_weighted=case == "weighted")
        features = _kjt(**{k: v for k, v in WEIGHTED.items() if case == "weighted" or k != "weights"})
    eager, swapped = _swapped(ebc)
    assert isinstance(swapped, FusedEmbeddingBagCollection)
    _assert_same_kt(swapped(features), eager(features))
    if case == "shared_features":
        assert swapped(features).keys() == ["f1@t1", "f1@t2"]


def test_ec_equal_torchrec():
    torch.manual_seed(0)
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10,
                                                     feature_names=["f1", "f2"]),
                                     EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=10,
                                                     feature_names=["f3"])])
    eager, swapped = _swapped(ec)
    features = _kjt(["f1", "f2", "f3"], [1, 2, 4, 5, 4, 3, 2, 9, 1], [0, 2, 4, 6, 7, 8, 9])
    got, want = swapped(features), eager(features)
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key].values(), want[key].values(), **TOL)
        torch.testing.assert_close(got[key].lengths(), want[key].lengths())


def test_meta_device_construction_then_materialise():
    """30/12 and 24: TorchRec's standard path: build on meta (forward on meta gives meta outputs of the
    right shape), swap, to_empty(cpu), then load real weights: equal to TorchRec's module."""
    ebc = EmbeddingBagCollection(tables=_tables(), is_weighted=True, device=torch.device("meta"))
    holder = nn.ModuleDict({"m": ebc})
    gk.swap(holder, optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1))
    meta_out = holder["m"](_kjt(**WEIGHTED, device="meta"))
    assert meta_out.values().device.type == "meta" and meta_out.values().shape == (2, 10)
    holder.to_empty(device="cpu")
    torch.manual_seed(0)
    reference = EmbeddingBagCollection(tables=_tables(), is_weighted=True)
    holder["m"].load_state_dict(reference.state_dict())
    assert not holder["m"].momentum1.any() and int(holder["m"].step) == 0
    _assert_same_kt(holder["m"](_kjt(**WEIGHTED)), reference(_kjt(**WEIGHTED)))
    direct = FusedEmbeddingBagCollection(_tables(), is_weighted=True, device="meta")
    direct.to_empty(device="cpu")
    direct.load_state_dict(reference.state_dict())
    _assert_same_kt(direct(_kjt(**WEIGHTED)), reference(_kjt(**WEIGHTED)))


def test_to_device_moves_everything():
    ebc = EmbeddingBagCollection(tables=_tables())
    eager, swapped = _swapped(ebc)
    moved = swapped.to(torch.device("cpu"))
    assert all(b.device.type == "cpu" for b in moved.buffers())
    features = _kjt(**{k: v for k, v in WEIGHTED.items() if k != "weights"})
    _assert_same_kt(moved(features), eager(features))
    meta = copy.deepcopy(swapped).to("meta")
    assert all(t.device.type == "meta" for t in list(meta.buffers()) + list(meta.parameters()))


def test_duplicate_table_names_refused():
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"]),
              EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f2"])]
    with pytest.raises(ValueError, match="unique"):
        FusedEmbeddingBagCollection(tables)


def test_symbolic_trace_of_the_collections():
    """24: torchrec.fx.symbolic_trace of the swapped EBC / EC (as root) gives a GraphModule that computes
    the same KeyedTensor (main: "input must be a 1-D or 2-D tensor of ids, got Proxy")."""
    torch.manual_seed(0)
    eager, swapped = _swapped(EmbeddingBagCollection(tables=_tables(), is_weighted=True))
    gm = symbolic_trace(swapped)
    out = gm(_kjt(**WEIGHTED))
    assert out.values().shape == (2, 10) and out.offset_per_key() == [0, 3, 6, 10]
    _assert_same_kt(out, eager(_kjt(**WEIGHTED)))
    ec = FusedEmbeddingCollection([EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10,
                                                   feature_names=["f1"])])
    features = _kjt(["f1"], [1, 2, 3], [0, 2, 3])
    gm = symbolic_trace(ec)
    torch.testing.assert_close(gm(features)["f1"].values(), ec(features)["f1"].values())


def test_torchscript_gives_a_clear_error():
    """24: TorchScript is deprecated: the swapped collection (and a GraphModule holding it) refuse
    torch.jit.script with a message naming torch.export."""
    _, swapped = _swapped(EmbeddingBagCollection(tables=_tables()))
    with pytest.raises(TypeError, match="torch.export"):
        torch.jit.script(swapped)
    with pytest.raises(TypeError, match="torch.export"):
        torch.jit.script(symbolic_trace(swapped))


# -- DLRM family --------------------------------------------------------------------------------

def _dlrm(kind: str):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=[f"f{i}"])
        for i, rows in enumerate([20, 7, 13])])
    args = dict(embedding_bag_collection=ebc, dense_in_features=5, dense_arch_layer_sizes=[12, 8],
                over_arch_layer_sizes=[8, 1])
    if kind == "dlrm_dcn":
        return DLRM_DCN(**args, dcn_num_layers=2, dcn_low_rank_dim=4)
    model = DLRM(**args)
    return DLRMTrain(model) if kind == "dlrm_train" else model


def _batch(batch_size: int = 6):
    from torchrec.datasets.random import RandomRecDataset

    return next(iter(RandomRecDataset(keys=["f0", "f1", "f2"], batch_size=batch_size, hash_sizes=[20, 7, 13],
                                      ids_per_feature=3, num_dense=5, manual_seed=3, num_batches=1)))


@pytest.mark.parametrize("kind", ["dlrm", "dlrm_dcn", "dlrm_train"])
def test_dlrm_outputs_equal_and_trace(kind):
    """24: DLRM / DLRM_DCN / DLRMTrain give the same outputs after gk.swap, and a whole swapped DLRM
    traces with torchrec.fx.symbolic_trace."""
    model = _dlrm(kind)
    eager = copy.deepcopy(model)
    report = gk.swap(model)
    assert any("embedding_bag_collection" in p for p, _, _ in report.replaced), str(report)
    batch = _batch()
    if kind == "dlrm_train":
        (loss, (_, logits, _)), (want_loss, (_, want_logits, _)) = model(batch), eager(batch)
        torch.testing.assert_close(loss, want_loss, **TOL)
        torch.testing.assert_close(logits, want_logits, **TOL)
        return
    got, want = model(batch.dense_features, batch.sparse_features), eager(batch.dense_features, batch.sparse_features)
    torch.testing.assert_close(got, want, **TOL)
    gm = symbolic_trace(model)
    torch.testing.assert_close(gm(batch.dense_features, batch.sparse_features), want, **TOL)


# -- an optimizer built before the swap (issue 24 gk.swap 3) ---------------------------------------

def _loss(model, batch):
    logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
    return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())


def _steps(model, optimizer, batches):
    for batch in batches:
        optimizer.zero_grad()
        _loss(model, batch).backward()
        optimizer.step()


def test_optimizer_built_before_swap_is_rewired():
    """24/swap-3: torch.optim.Adagrad(model.parameters()), then gk.swap(model): on main the packed tables
    never trained. gk.swap(model, optimizer=opt) rewires the param groups; with name-based groups (no
    weight decay on the tables) the groups' settings are kept. Training equals the eager model's.
    (Per-table groups, which split a collection into parts: tests/test_swap_param_groups.py.)"""
    batches = [_batch() for _ in range(2)]
    eager, model = _dlrm("dlrm"), _dlrm("dlrm")

    def groups(m):
        tables = [p for n, p in m.named_parameters() if "embedding_bags" in n]
        dense = [p for n, p in m.named_parameters() if "embedding_bags" not in n]
        return [{"params": tables, "weight_decay": 0.0}, {"params": dense, "weight_decay": 0.01}]

    eager_opt = torch.optim.Adagrad(groups(eager), lr=0.1)
    opt = torch.optim.Adagrad(groups(model), lr=0.1)
    report = gk.swap(model, optimizer=opt)
    assert report.fused_parameters == []
    packed = model.sparse_arch.embedding_bag_collection.weights
    assert opt.param_groups[0]["params"] == [packed] and opt.param_groups[0]["weight_decay"] == 0.0
    before = packed.detach().clone()
    _steps(eager, eager_opt, batches)
    _steps(model, opt, batches)
    assert not torch.equal(packed, before)
    want = eager.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, want[name], atol=1e-5, rtol=1e-4, msg=name)


# -- fused optimizer state (issue 24 gk.swap 4; issue 30 items 2, 20) -------------------------------

def _ebc_two_tables(order):
    configs = {"t0": EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
               "t1": EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=6, feature_names=["b"])}
    return [configs[n] for n in order]


@pytest.mark.parametrize("rule", [gk.optim.ExactRowwiseAdagrad(lr=0.1), gk.optim.ExactAdam(lr=0.05)])
def test_optimizer_state_follows_table_names(rule):
    """30/2: the packed state of a collection with tables (t0, t1) loaded into one with (t1, t0) landed
    on other rows (t0[9], t1[0] became t0[3], t0[4]). It follows each table by name now."""
    src = FusedEmbeddingBagCollection(_ebc_two_tables(["t0", "t1"]), optimizer=rule)
    features = _kjt(["a", "b"], [9, 0, 5], [0, 1, 3])
    src(features).values().sum().backward()
    dst = FusedEmbeddingBagCollection(_ebc_two_tables(["t1", "t0"]), optimizer=rule)
    dst.load_optimizer_state_dict(src.optimizer_state_dict())
    for name in ("t0", "t1"):
        i, j = src._table_names.index(name), dst._table_names.index(name)
        if rule.name == "rowwise_adagrad":
            a = src.momentum1[src.layout.rows_offsets[i]:src.layout.rows_offsets[i + 1]]
            b = dst.momentum1[dst.layout.rows_offsets[j]:dst.layout.rows_offsets[j + 1]]
        else:
            a, b = src.layout.table(src.momentum2, i), dst.layout.table(dst.momentum2, j)
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    with pytest.raises(TypeError, match="optimizer_state_dict"):
        dst.load_optimizer_state_dict(None)
    other = FusedEmbeddingBagCollection([EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=11,
                                                            feature_names=["a"])], optimizer=rule)
    with pytest.raises(ValueError, match="tables"):
        other.load_optimizer_state_dict(src.optimizer_state_dict())


def test_collection_resume_equals_uninterrupted_run():
    """24/swap-4: torch.save(model.state_dict()) + optimizer_state_dict(), then resume: equal to the run
    without the break (row-wise Adagrad, whose state a restart would silently reset)."""
    rule = gk.optim.ExactRowwiseAdagrad(lr=0.1)
    g = torch.Generator().manual_seed(0)
    batches = [_kjt(["a", "b"], torch.randint(0, 6, (8,), generator=g).tolist(), [0, 2, 4, 5, 8]) for _ in range(4)]
    torch.manual_seed(0)
    base = FusedEmbeddingBagCollection(_ebc_two_tables(["t0", "t1"]), optimizer=rule)

    def run(module, part):
        for features in part:
            (module(features).values() ** 2).sum().backward()

    straight = copy.deepcopy(base)
    run(straight, batches)
    first = copy.deepcopy(base)
    run(first, batches[:2])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "fused": first.optimizer_state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = FusedEmbeddingBagCollection(_ebc_two_tables(["t0", "t1"]), optimizer=rule)
    resumed.load_state_dict(saved["model"])
    resumed.load_optimizer_state_dict(saved["fused"])
    run(resumed, batches[2:])
    torch.testing.assert_close(resumed.weights, straight.weights, rtol=0, atol=0)


# -- odd input (issue 30 items 1, 6, 13, 14, 17, 18, 19) -------------------------------------------

def test_frozen_ebc_stays_frozen():
    """30/1: a frozen EBC came out of the swap with weights.requires_grad=True and a fused step moved it."""
    ebc = EmbeddingBagCollection(tables=_ebc_two_tables(["t0", "t1"]), is_weighted=True)
    ebc.requires_grad_(False)
    _, swapped = _swapped(ebc, optimizer=gk.optim.ExactSGD(lr=1.0))
    assert not swapped.weights.requires_grad
    before = swapped.weights.detach().clone()
    features = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=torch.tensor([1, 2, 3]),
                                                   lengths=torch.tensor([2, 1]),
                                                   weights=torch.ones(3, requires_grad=True))
    swapped(features).values().sum().backward()  # the KJT's weights need a gradient; the tables do not
    assert features.weights().grad is not None
    torch.testing.assert_close(swapped.weights, before, rtol=0, atol=0)
    mixed = EmbeddingBagCollection(tables=_ebc_two_tables(["t0", "t1"]))
    mixed.embedding_bags["t0"].weight.requires_grad_(False)
    holder = nn.ModuleDict({"m": mixed})
    report = gk.swap(holder)
    # One packed buffer cannot freeze some tables only: the collection is skipped with the reason
    # (its per-table nn.EmbeddingBags are then swapped one by one, keeping their own flags).
    assert type(holder["m"]) is EmbeddingBagCollection and "frozen" in report.skipped[0][2]
    assert not holder["m"].embedding_bags["t0"].weight.requires_grad


def test_bad_backend_refused_at_construction():
    """30/6: FusedEmbeddingBagCollection(..., backend="bogus") succeeded; the error came at the first forward."""
    with pytest.raises(ValueError, match="backend.*bogus"):
        FusedEmbeddingBagCollection(_ebc_two_tables(["t0", "t1"]), backend="bogus")


def test_half_keeps_fp32_optimizer_state():
    """30/13: .half() of a collection with a fused optimizer failed at the next forward."""
    module = FusedEmbeddingBagCollection(_ebc_two_tables(["t0", "t1"]), optimizer=gk.optim.ExactAdam(lr=0.01))
    features = _kjt(["a", "b"], [1, 2, 3], [0, 2, 3])
    module(features).values().sum().backward()
    state = module.momentum1.clone()
    module.half()
    assert module.weights.dtype == torch.float16 and module.momentum1.dtype == torch.float32
    torch.testing.assert_close(module.momentum1, state, rtol=0, atol=0)
    module(features).values().sum().backward()
    assert int(module.step) == 2


@pytest.mark.parametrize("tables", [None, 3, EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10)],
                         ids=["None", "int", "a-bare-config"])
def test_tables_that_are_no_list_are_named(tables):
    """Found by the front-door fuzz: tables=None gave "'NoneType' object is not iterable"."""
    with pytest.raises(TypeError, match="tables must be a list of torchrec EmbeddingBagConfig"):
        FusedEmbeddingBagCollection(tables)
    with pytest.raises(TypeError, match="tables must be a list of torchrec EmbeddingConfig"):
        FusedEmbeddingCollection(tables)


def test_weighted_collection_without_kjt_weights_is_named():
    """Found by the front-door fuzz: is_weighted=True and a KJT without weights gave TorchRec's bare
    "AssertionError: This (Keyed)JaggedTensor doesn't have weights."."""
    module = FusedEmbeddingBagCollection(_ebc_two_tables(["t0", "t1"]), is_weighted=True)
    with pytest.raises(ValueError, match="features has no weights, but the collection is_weighted=True"):
        module(_kjt(["a", "b"], [1, 2, 3], [0, 2, 3]))


def test_kjt_id_dtypes_as_torchrec():
    """Found by the front-door fuzz: uint8 ids, which TorchRec's EBC takes, were refused with the op's
    "indices must have dtype ..."; float ids are refused naming the KJT's values."""
    theirs = EmbeddingBagCollection(tables=_ebc_two_tables(["t0", "t1"]))
    ours = FusedEmbeddingBagCollection(_ebc_two_tables(["t0", "t1"]))
    ours.load_state_dict(theirs.state_dict())
    for dtype in (torch.uint8, torch.int16):
        features = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([9, 2, 5], dtype=dtype),
                                     lengths=torch.tensor([2, 1]))
        torch.testing.assert_close(ours(features).values(), theirs(features).values(), rtol=0, atol=1e-6)
    floats = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([9.0, 2.0, 5.0]), lengths=torch.tensor([2, 1]))
    with pytest.raises(TypeError, match="features' values must be integer ids"):
        ours(floats)


def test_embedding_dim_zero_refused_at_construction():
    """30/19: embedding_dim=0 was accepted at construction and refused at the first forward."""
    bad = EmbeddingBagConfig(name="t_zero", embedding_dim=0, num_embeddings=10, feature_names=["a"])
    with pytest.raises(ValueError, match="t_zero.*embedding_dim"):
        FusedEmbeddingBagCollection([bad])


def test_kjt_errors_name_what_is_wrong():
    """30/14, 17, 18: variable-batch KJTs, lengths that do not sum to the values (keys out of order), and a
    lengths count that is not a multiple of the keys gave "shape '[2, 1]' is invalid"-style errors."""
    ebc = FusedEmbeddingBagCollection(_ebc_two_tables(["t0", "t1"]))
    ec = FusedEmbeddingCollection([EmbeddingConfig(name=n, embedding_dim=4, num_embeddings=6, feature_names=[f])
                                   for n, f in (("t0", "a"), ("t1", "b"))])
    variable = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]),
                                 stride_per_key_per_rank=[[2], [1]])
    for module in (ebc, ec):
        with pytest.raises(ValueError, match="variable-batch KJTs are not supported"):
            module(variable)
    short = KeyedJaggedTensor(keys=["b", "a"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 0, 0]))
    with pytest.raises(ValueError, match="lengths sum to 2, but it has 3 values"):
        ebc(short)
    odd = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="3 lengths for 2 keys"):
        ebc(odd)

"""gk.swap(model, optimizer=torch_optimizer) where the optimizer's param groups split a TorchRec
collection's tables (issue 24, gk.swap item 3: "name-based parameter groups (per-table lr, no weight
decay on embeddings) must keep working").

On main the swap packed a collection's tables into one Parameter and refused such groups with
"param groups [...] with different settings", and refused an optimizer that had already stepped.
Now the collection becomes one fused part per group (Partitioned*Collection), each group holds its
tables' packed Parameter, and the state (momentum_buffer, Adagrad's sum, Adam's moments and step) is
packed along. Each case trains the swapped model and the unswapped one with the same optimizer and
batches and compares losses and tables at every step.

Verification rule (docs/conventions): state is compared only after Lipschitz updates. SGD is
compared from its first step. Adagrad's and Adam's first updates are lr * sign(g) per element, so
those cases take their first two steps on the unswapped model with batches that touch every row
(every element then has nonzero state), copy model and optimizer, swap the copy and compare the
steps after (this is also the case of an optimizer that stepped before the swap). Their fresh
case is checked by what does not depend on the sign: every touched element moves by its group's lr.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gem_kernels as gk

pytest.importorskip("torchrec", reason="torchrec is not installed (see README: optional dependency)")
from torchrec.fx import symbolic_trace  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from gem_kernels.torchrec import PartitionedEmbeddingBagCollection, PartitionedEmbeddingCollection  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
BATCH = 4
# Table -> (rows, dim, features). Feature "a" is read by t0 and t2 (TorchRec names it "a@t0", "a@t2"),
# t0 also reads "b"; mixed poolings run in one fused call.
TABLES = {"t0": (6, 3, ["a", "b"]), "t1": (5, 4, ["c"]), "t2": (6, 2, ["a"]), "t3": (4, 3, ["d"])}
FEATURES = ["a", "b", "c", "d"]


def _limits(tables):
    """The id range of each feature: the fewest rows of the tables that read it."""
    limits = {}
    for rows, _, features in tables.values():
        for f in features:
            limits[f] = min(limits.get(f, rows), rows)
    return limits


def _kjt(tables, seed: int, cover: bool) -> KeyedJaggedTensor:
    """A batch of BATCH samples; ``cover``: every id of every feature appears (every row is touched)."""
    g = torch.Generator().manual_seed(seed)
    limits, values, lengths = _limits(tables), [], []
    for f in sorted(limits):
        ids = torch.randint(0, limits[f], (int(torch.randint(0, 3 * BATCH, (1,), generator=g)),), generator=g)
        if cover:
            ids = torch.cat([torch.randperm(limits[f], generator=g), ids])
        cuts = torch.sort(torch.randint(0, ids.numel() + 1, (BATCH - 1,), generator=g)).values
        lengths.append(torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([ids.numel()])])))
        values.append(ids)
    return KeyedJaggedTensor.from_lengths_sync(keys=sorted(limits), values=torch.cat(values),
                                               lengths=torch.cat(lengths))


def _ebc(tables, name_prefix=""):
    configs = [EmbeddingBagConfig(name=name_prefix + t, embedding_dim=d, num_embeddings=rows, feature_names=fs,
                                  pooling=PoolingType.MEAN if t == "t1" else PoolingType.SUM)
               for t, (rows, d, fs) in tables.items()]
    return EmbeddingBagCollection(tables=configs)


class _Model(nn.Module):
    """Collections -> one linear layer -> squared error against a fixed target."""

    def __init__(self, collections: dict[str, nn.Module], width: int):
        super().__init__()
        self.sparse = nn.ModuleDict(collections)
        self.dense = nn.Linear(width, 1)
        self.register_buffer("target", torch.linspace(-1, 1, BATCH))

    def features(self, kjt):
        out = []
        for module in self.sparse.values():
            result = module(kjt)
            if isinstance(result, dict):  # EmbeddingCollection: the sum of each bag's rows
                out += [torch.segment_reduce(jt.values(), "sum", lengths=jt.lengths(), axis=0) for jt in result.values()]
            else:
                out.append(result.values())
        return torch.cat(out, dim=1)

    def forward(self, kjt):
        return (self.dense(self.features(kjt)).squeeze(-1) - self.target).square().mean()


def _ebc_model():
    torch.manual_seed(0)
    return _Model({"ebc": _ebc(TABLES)}, width=3 + 3 + 4 + 2 + 3)


def _groups(model, spec):
    params = dict(model.named_parameters())
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": [params[n] for n in group["params"]]}
            for group in spec]


def _table(name, prefix="sparse.ebc.embedding_bags."):
    return f"{prefix}{name}.weight"


def _step(model, optimizer, kjt) -> float:
    optimizer.zero_grad()
    loss = model(kjt)
    loss.backward()
    optimizer.step()
    return loss.item()


def _train_both(make_model, spec, optimizer_type, kwargs, pre_steps=0, steps=3, tables=TABLES, check=None):
    """The unswapped model and its optimizer take ``pre_steps`` (on batches touching every row), then a
    copy of both is swapped with gk.swap(copy, optimizer=its optimizer); both train ``steps`` more,
    compared at every step. Returns (swapped model, its optimizer, report)."""
    eager = make_model()
    eager_opt = optimizer_type(_groups(eager, spec), **kwargs)
    for i in range(pre_steps):
        _step(eager, eager_opt, _kjt(tables, 100 + i, cover=True))
    model, opt = copy.deepcopy((eager, eager_opt))  # one memo: the copy's optimizer holds the copy's Parameters
    keys = list(model.state_dict())
    report = gk.swap(model, optimizer=opt)
    assert list(model.state_dict()) == keys
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in eager_opt.param_groups]
    if check is not None:
        check(model, opt)
    for i in range(steps):
        kjt = _kjt(tables, i, cover=False)
        got, want = _step(model, opt, kjt), _step(eager, eager_opt, kjt)
        torch.testing.assert_close(got, want, **TOL, msg=f"loss at step {i}")
        want_state = eager.state_dict()
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, want_state[name], **TOL, msg=f"{name} after step {i}")
    return model, opt, report


PER_TABLE_LR = [
    {"params": [_table("t0"), _table("t2")], "lr": 0.1},
    {"params": [_table("t1"), _table("t3")], "lr": 0.01},
    {"params": ["dense.weight", "dense.bias"], "lr": 0.05},
]


def _check_parts(model, opt):
    """Each table group holds one packed Parameter: its part's."""
    ebc = model.sparse["ebc"]
    assert isinstance(ebc, PartitionedEmbeddingBagCollection)
    assert [p._table_names for p in ebc.parts] == [["t0", "t2"], ["t1", "t3"]]
    assert opt.param_groups[0]["params"] == [ebc.parts[0].weights]
    assert opt.param_groups[1]["params"] == [ebc.parts[1].weights]
    assert len(opt.param_groups[2]["params"]) == 2


@pytest.mark.parametrize("optimizer_type,kwargs,pre_steps", [
    (torch.optim.SGD, {"lr": 0.1}, 0),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 0),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, 2),
    (torch.optim.Adagrad, {"lr": 0.1}, 2),
    (torch.optim.Adam, {"lr": 0.1}, 2),
    (torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1, "amsgrad": True}, 2),
], ids=["sgd", "sgd_momentum", "sgd_nesterov_stepped", "adagrad_stepped", "adam_stepped", "adamw_amsgrad_stepped"])
def test_per_table_lr_trains_as_unswapped(optimizer_type, kwargs, pre_steps):
    """Two tables at lr 0.1, two at 0.01 and the dense layer at 0.05, optimizer built before the swap
    (and, for the stateful optimizers, stepped twice before it): each group keeps its tables, its lr
    and its state, and training equals the unswapped model's."""
    _train_both(_ebc_model, PER_TABLE_LR, optimizer_type, kwargs, pre_steps=pre_steps, check=_check_parts)


@pytest.mark.parametrize("optimizer_type", [torch.optim.Adagrad, torch.optim.Adam])
def test_per_table_lr_first_step_moves_each_table_by_its_lr(optimizer_type):
    """A fresh Adagrad / Adam built before the swap (Adagrad already holds its initial state): the
    first update of every touched element is its group's lr times the sign of its gradient, so each
    table moves by exactly its own lr (the sign itself is not compared: see the module docstring)."""
    model = _ebc_model()
    opt = optimizer_type(_groups(model, PER_TABLE_LR), lr=0.5, eps=1e-12)  # |update| = lr |g| / (|g| + eps)
    gk.swap(model, optimizer=opt)
    _check_parts(model, opt)
    ebc = model.sparse["ebc"]
    before = {t: ebc.weight(t).detach().clone() for t in TABLES}
    _step(model, opt, _kjt(TABLES, 0, cover=True))
    for t in TABLES:
        lr = 0.1 if t in ("t0", "t2") else 0.01
        moved = (ebc.weight(t).detach() - before[t]).abs()
        torch.testing.assert_close(moved, torch.full_like(moved, lr), atol=1e-6, rtol=1e-4, msg=t)


def test_groups_span_two_collections_and_dense_params():
    """One group holds a table of each of two collections and the dense weight (lr 0.1, weight decay
    0.01); another the two collections' other tables (lr 0.01); the dense bias its own group."""
    def make():
        torch.manual_seed(1)
        half = {k: TABLES[k] for k in ("t0", "t1")}
        other = {"u0": (7, 2, ["c"]), "u1": (3, 3, ["d"])}
        return _Model({"ebc": _ebc(half), "other": _ebc(other)}, width=3 + 3 + 4 + 2 + 3)

    spec = [{"params": [_table("t0"), _table("u0", "sparse.other.embedding_bags."), "dense.weight"],
             "lr": 0.1, "weight_decay": 0.01},
            {"params": [_table("t1"), _table("u1", "sparse.other.embedding_bags.")], "lr": 0.01},
            {"params": ["dense.bias"], "lr": 0.05}]
    tables = {**{k: TABLES[k] for k in ("t0", "t1")}, "u0": (7, 2, ["c"]), "u1": (3, 3, ["d"])}
    model, opt, report = _train_both(make, spec, torch.optim.SGD, {"lr": 0.1, "momentum": 0.5}, tables=tables)
    ebc, other = model.sparse["ebc"], model.sparse["other"]
    assert opt.param_groups[0]["params"] == [ebc.parts[0].weights, other.parts[0].weights, model.dense.weight]
    assert opt.param_groups[1]["params"] == [ebc.parts[1].weights, other.parts[1].weights]
    assert {p for p, _, _ in report.replaced} == {"sparse.ebc", "sparse.other"} and report.skipped == []


def test_some_tables_weight_decay_and_a_table_left_out():
    """Weight decay on t0 only, t1 and t2 without, t3 in no group at all (it must not train): the
    groups that hold part of a collection get their part, t3's part stays out of the optimizer."""
    spec = [{"params": [_table("t0")], "weight_decay": 0.1},
            {"params": [_table("t1"), _table("t2")], "weight_decay": 0.0},
            {"params": ["dense.weight", "dense.bias"], "weight_decay": 0.01}]
    eager_t3 = _ebc_model().sparse["ebc"].embedding_bags["t3"].weight.detach().clone()
    model, opt, _ = _train_both(_ebc_model, spec, torch.optim.SGD, {"lr": 0.2, "momentum": 0.9}, pre_steps=2)
    ebc = model.sparse["ebc"]
    assert [p._table_names for p in ebc.parts] == [["t0"], ["t1", "t2"], ["t3"]]
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(ebc.parts[2].weights) not in held
    torch.testing.assert_close(ebc.weight("t3"), eager_t3, rtol=0, atol=0)


def test_embedding_collection_per_table_groups():
    """An EmbeddingCollection (the same dim for every table) with per-table Adam groups, stepped twice
    before the swap: its outputs (dict of JaggedTensor, TorchRec's keys and order) and training equal."""
    tables = {"e0": (6, 3, ["a", "b"]), "e1": (5, 3, ["c"]), "e2": (6, 3, ["a"])}

    def make():
        torch.manual_seed(2)
        configs = [EmbeddingConfig(name=t, embedding_dim=d, num_embeddings=rows, feature_names=fs)
                   for t, (rows, d, fs) in tables.items()]
        return _Model({"ec": EmbeddingCollection(tables=configs)}, width=4 * 3)

    spec = [{"params": [_table("e0", "sparse.ec.embeddings."), _table("e2", "sparse.ec.embeddings.")], "lr": 0.05},
            {"params": [_table("e1", "sparse.ec.embeddings.")], "lr": 0.2},
            {"params": ["dense.weight", "dense.bias"]}]
    model, opt, _ = _train_both(make, spec, torch.optim.Adam, {"lr": 0.1}, pre_steps=2, tables=tables)
    ec = model.sparse["ec"]
    assert isinstance(ec, PartitionedEmbeddingCollection)
    assert [p._table_names for p in ec.parts] == [["e0", "e2"], ["e1"]]
    eager = make()
    eager.load_state_dict(model.state_dict())
    kjt = _kjt(tables, 7, cover=True)
    got, want = ec(kjt), eager.sparse["ec"](kjt)
    assert list(got) == list(want) == ["a@e0", "b", "c", "a@e2"]
    for key in want:
        torch.testing.assert_close(got[key].values(), want[key].values(), **TOL)
        assert torch.equal(got[key].lengths(), want[key].lengths())


def test_partitioned_collection_answers_as_torchrec():
    """The split collection's KeyedTensor (keys, lengths, values), state_dict (TorchRec's keys, in
    order, both ways, a missing table named by its TorchRec key), symbolic_trace, torch.compile and
    the clear TorchScript error."""
    eager = _ebc_model()
    model = copy.deepcopy(eager)
    opt = torch.optim.SGD(_groups(model, PER_TABLE_LR), lr=0.1)
    gk.swap(model, optimizer=opt)
    ebc, want_ebc = model.sparse["ebc"], eager.sparse["ebc"]
    kjt = _kjt(TABLES, 3, cover=True)
    got, want = ebc(kjt), want_ebc(kjt)
    assert got.keys() == want.keys() == ["a@t0", "b", "c", "a@t2", "d"]
    assert got.length_per_key() == want.length_per_key()
    torch.testing.assert_close(got.values(), want.values(), **TOL)
    assert list(ebc.state_dict()) == list(want_ebc.state_dict())
    with torch.no_grad():
        for p in want_ebc.parameters():
            p.mul_(-2)
    ebc.load_state_dict(want_ebc.state_dict())
    torch.testing.assert_close(ebc(kjt).values(), want_ebc(kjt).values(), **TOL)
    roundtrip = _ebc_model().sparse["ebc"]
    roundtrip.load_state_dict(ebc.state_dict())
    torch.testing.assert_close(roundtrip(kjt).values(), want_ebc(kjt).values(), **TOL)
    partial = {k: v for k, v in want_ebc.state_dict().items() if ".t1." not in k}
    result = model.load_state_dict({f"sparse.ebc.{k}": v for k, v in partial.items()}
                                   | {k: v for k, v in model.state_dict().items() if not k.startswith("sparse.ebc.")},
                                   strict=False)
    assert result.missing_keys == ["sparse.ebc.embedding_bags.t1.weight"] and result.unexpected_keys == []
    torch.testing.assert_close(symbolic_trace(ebc)(kjt).values(), ebc(kjt).values(), **TOL)
    with pytest.raises(TypeError, match="torch.export"):
        torch.jit.script(ebc)
    compiled = torch.compile(ebc, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(kjt).values(), ebc(kjt).values(), **TOL)


# -- still refused, clearly ------------------------------------------------------------------------

class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2))

    def forward(self, x):
        return x * torch.cat([self.a, self.b])


class _PackedPair(nn.Module):
    """Packs a _Pair's two Parameters into one and cannot split them; ``views``: its state_dict keeps
    the keys a, b as views into the packed Parameter (what tells the swap where each went)."""

    def __init__(self, pair: _Pair, views: bool):
        super().__init__()
        self.flat = nn.Parameter(torch.cat([pair.a, pair.b]).detach().clone())
        if views:
            self.register_state_dict_post_hook(_pair_views)

    def forward(self, x):
        return x * self.flat


def _pair_views(module, state_dict, prefix, local_metadata):
    flat = state_dict.pop(prefix + "flat")
    state_dict[prefix + "a"], state_dict[prefix + "b"] = flat[:3], flat[3:]


@pytest.mark.parametrize("views,message", [(True, "cannot split"), (False, "different settings")])
def test_a_replacement_that_cannot_split_is_refused(views, message):
    """A registered converter whose replacement packs two Parameters and has no split_by_keys: groups
    with different lr are refused with a ValueError, model and optimizer left as they were; one group
    (also after a step, with momentum state to pack) is rewired."""
    gk.register(_Pair, lambda module, *, optimizer, backend: _PackedPair(module, views))
    model = nn.Sequential(_Pair())
    a, b = model[0].a, model[0].b
    opt = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}], lr=0.1)
    with pytest.raises(ValueError, match=message):
        gk.swap(model, optimizer=opt)
    assert type(model[0]) is _Pair and opt.param_groups[0]["params"] == [a] and opt.param_groups[1]["params"] == [b]
    if views:
        opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
        model(torch.ones(5)).sum().backward()
        opt.step()
        buffers = torch.cat([opt.state[a]["momentum_buffer"], opt.state[b]["momentum_buffer"]])
        gk.swap(model, optimizer=opt)
        assert opt.param_groups[0]["params"] == [model[0].flat]
        torch.testing.assert_close(opt.state[model[0].flat]["momentum_buffer"], buffers, rtol=0, atol=0)


def test_shape_dependent_optimizer_is_refused():
    """Adafactor factors the second moment of a 2-D table: a flat packed table would train otherwise.
    Refused before and after a step, the model left unswapped."""
    model = _ebc_model()
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="Adafactor updates a Parameter by its 2-D shape"):
        gk.swap(model, optimizer=opt)
    assert type(model.sparse["ebc"]) is EmbeddingBagCollection
    _step(model, opt, _kjt(TABLES, 0, cover=True))
    with pytest.raises(ValueError, match="Adafactor"):
        gk.swap(model, optimizer=opt)
    assert type(model.sparse["ebc"]) is EmbeddingBagCollection


class _RowwiseAdagrad(torch.optim.Optimizer):
    """A user's row-wise Adagrad: one accumulator per row, a state shaped [rows] that has no packed form."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    rows = self.state[p].setdefault("row_sum", torch.zeros(p.shape[0]))
                    rows += p.grad.square().mean(1)
                    p -= group["lr"] * p.grad / (rows.sqrt()[:, None] + 1e-10)


def test_state_of_another_shape_is_refused():
    model = _ebc_model()
    tables = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    opt = _RowwiseAdagrad(tables, lr=0.1)
    _step(model, opt, _kjt(TABLES, 0, cover=True))
    with pytest.raises(ValueError, match=r"state 'row_sum' of shape \(6,\)"):
        gk.swap(model, optimizer=opt)
    assert type(model.sparse["ebc"]) is EmbeddingBagCollection and opt.param_groups[0]["params"] == tables


@pytest.mark.parametrize("rule", [gk.optim.ExactRowwiseAdagrad(lr=0.1), gk.optim.ExactAdam(lr=0.05)],
                         ids=["rowwise_adagrad", "adam"])
def test_split_by_keys_keeps_the_fused_optimizer_state(rule):
    """split_by_keys on a collection with a fused optimizer that has stepped: each part takes its
    tables' rows of the state and the step, so training goes on as the whole collection's; the
    report names each part's fused parameter once."""
    from gem_kernels.torchrec import FusedEmbeddingBagCollection

    whole = FusedEmbeddingBagCollection.from_torchrec(_ebc(TABLES), optimizer=rule)
    proj = torch.randn(BATCH, 3 + 3 + 4 + 2 + 3)

    def step(module, seed):
        out = module(_kjt(TABLES, seed, cover=seed < 2)).values()
        (out * proj).sum().backward()
        return out.detach()

    for seed in range(2):
        step(whole, seed)
    keys = [["embedding_bags.t1.weight"], ["embedding_bags.t3.weight", "embedding_bags.t0.weight"],
            ["embedding_bags.t2.weight"]]
    split = whole.split_by_keys(keys)
    assert [p._table_names for p in split.parts] == [["t1"], ["t0", "t3"], ["t2"]]
    for seed in range(2, 5):
        torch.testing.assert_close(step(split, seed), step(whole, seed), **TOL)
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(split.state_dict()[name], value, **TOL)
    holder = nn.ModuleDict({"ebc": split})
    report = gk.swap(holder)
    assert report.replaced == [] and report.fused_parameters == [f"ebc.parts.{i}.weights" for i in range(3)]
    with pytest.raises(ValueError, match="each key in exactly one part"):
        whole.split_by_keys([["embedding_bags.t0.weight"], ["embedding_bags.t0.weight"]])
    with pytest.raises(ValueError, match="parts must be"):
        whole.split_by_keys("embedding_bags.t0.weight")

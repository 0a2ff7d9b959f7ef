"""The TorchRec front door (gem_kernels.torchrec) against TorchRec's own EmbeddingBagCollection and
EmbeddingCollection on the same weights: outputs, every gradient, one fused optimizer step, the
state_dict both ways, torch.compile, bad ids. Skipped as a whole where TorchRec is not installed."""

import subprocess
import sys

import pytest
import torch

import gem_kernels as gk

torchrec = pytest.importorskip("torchrec", reason="TorchRec is not installed (see gem_kernels.torchrec.INSTALL_HINT)")

from torchrec import (  # noqa: E402
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)

from gem_kernels.torchrec import FusedEmbeddingBagCollection, FusedEmbeddingCollection  # noqa: E402

from .utils import randn_nonzero  # noqa: E402

# The C++ kernels where they are built, else the plain PyTorch reference (both are the "cpu" device).
BACKEND = "cpu" if "cpu" in gk.available_backends() else "reference"


def bag_tables(pooling_b=PoolingType.MEAN, pooling_a=PoolingType.SUM):
    """A shared table (t_shared read by features a and b), mixed dims (4, 8, 3) and poolings; the
    feature c is read by two tables, so its embedding names are c@t_c and c@t_c2 (TorchRec's rule)."""
    return [
        EmbeddingBagConfig(name="t_shared", embedding_dim=4, num_embeddings=11, feature_names=["a", "b"],
                           pooling=pooling_a),
        EmbeddingBagConfig(name="t_c", embedding_dim=8, num_embeddings=7, feature_names=["c"], pooling=pooling_b),
        EmbeddingBagConfig(name="t_c2", embedding_dim=3, num_embeddings=5, feature_names=["c"], pooling=PoolingType.SUM),
    ]


def make_kjt(keys, rows, batch, seed=0, weighted=False, max_len=4):
    """Random bags with empty ones; every id below min(rows) so any table can read any feature."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch,), generator=gen)
    lengths[::3] = 0
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    if values.numel() >= 2:
        values[-1] = values[0]
    weights = randn_nonzero(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths, weights=weights)


def table_grad(fused, name):
    return fused.layout.table(fused.weights.grad, fused._table_names.index(name))


def assert_same_keyed(kt, expected):
    assert kt.keys() == expected.keys()
    assert kt.length_per_key() == expected.length_per_key()
    torch.testing.assert_close(kt.values(), expected.values())


# ------------------------------------------------------------------------------------------------
# EmbeddingBagCollection
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [0, 1, 5])
@pytest.mark.parametrize("keys", [["a", "b", "c"], ["c", "a", "b"]], ids=["kjt_in_order", "kjt_permuted"])
def test_ebc_matches_torchrec(batch, keys):
    tables = bag_tables()
    ebc = EmbeddingBagCollection(tables)
    fused = FusedEmbeddingBagCollection.from_torchrec(ebc, backend=BACKEND)
    kjt = make_kjt(keys, 5, batch, seed=batch)
    expected, out = ebc(kjt), fused(kjt)
    assert out.keys() == ["a", "b", "c@t_c", "c@t_c2"]
    assert_same_keyed(out, expected)
    grad = randn_nonzero(*expected.values().shape)
    expected.values().backward(grad)
    out.values().backward(grad)
    for config in tables:
        torch.testing.assert_close(table_grad(fused, config.name), ebc.embedding_bags[config.name].weight.grad)


def test_ebc_weighted_sum_matches_torchrec_with_weight_gradients():
    tables = bag_tables(pooling_b=PoolingType.SUM)
    ebc = EmbeddingBagCollection(tables, is_weighted=True)
    fused = FusedEmbeddingBagCollection.from_torchrec(ebc, backend=BACKEND)
    assert fused.is_weighted() and fused.embedding_bag_configs() == tables
    kjt = make_kjt(["a", "b", "c"], 5, 4, seed=1, weighted=True)
    w_ref = kjt.weights().clone().requires_grad_()
    w = kjt.weights().clone().requires_grad_()
    expected = ebc(KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=w_ref))
    out = fused(KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=w))
    assert_same_keyed(out, expected)
    grad = randn_nonzero(*expected.values().shape)
    expected.values().backward(grad)
    out.values().backward(grad)
    torch.testing.assert_close(w.grad, w_ref.grad)
    for config in tables:
        torch.testing.assert_close(table_grad(fused, config.name), ebc.embedding_bags[config.name].weight.grad)


@pytest.mark.parametrize("all_mean", [True, False], ids=["all_mean", "mixed_pooling"])
def test_ebc_weighted_mean_is_weighted_sum_over_length(all_mean):
    """TorchRec's unsharded module refuses weights with MEAN (nn.EmbeddingBag); FBGEMM's TBE divides
    the weighted sum by the bag length: the oracle is a loop over the bags."""
    tables = bag_tables(pooling_a=PoolingType.MEAN if all_mean else PoolingType.SUM)
    if all_mean:
        tables[2].pooling = PoolingType.MEAN
    fused = FusedEmbeddingBagCollection(tables, is_weighted=True, backend=BACKEND)
    batch = 3
    kjt = make_kjt(["a", "b", "c"], 5, batch, seed=2, weighted=True, max_len=5)
    psw = kjt.weights().clone().requires_grad_()
    out = fused(KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=psw))
    oracle_w = {c.name: fused.weight(c.name).detach().clone().requires_grad_() for c in tables}
    oracle_psw = kjt.weights().clone().requires_grad_()
    jts = kjt.to_dict()
    starts = dict(zip(kjt.keys(), kjt.offset_per_key()))
    columns = []
    for config in tables:
        for feature in config.feature_names:
            jt = jts[feature]
            bags = []
            for b in range(batch):
                lo, hi = int(jt.offsets()[b]), int(jt.offsets()[b + 1])
                rows = oracle_w[config.name][jt.values()[lo:hi]] * oracle_psw[starts[feature] + lo:starts[feature] + hi, None]
                pooled = rows.sum(0)
                if config.pooling == PoolingType.MEAN:
                    pooled = pooled / max(hi - lo, 1)
                bags.append(pooled)
            columns.append(torch.stack(bags))
    expected = torch.cat(columns, dim=1)
    torch.testing.assert_close(out.values(), expected)
    grad = randn_nonzero(*expected.shape)
    out.values().backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(psw.grad, oracle_psw.grad)
    for config in tables:
        torch.testing.assert_close(table_grad(fused, config.name), oracle_w[config.name].grad)


def _rowwise_adagrad(weight, grad, state, touched, lr, eps):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD by hand on the rows the batch touched."""
    weight, state = weight.clone(), state.clone()
    for r in touched:
        state[r] += (grad[r] * grad[r]).mean()
        weight[r] -= lr * grad[r] / (state[r].sqrt() + eps)
    return weight, state


def test_ebc_fused_rowwise_adagrad_updates_shared_rows_once():
    """Two steps of the fused ExactRowwiseAdagrad against the hand-written rule on TorchRec's dense
    gradients (the shared table's rows get the sum over both features, then ONE update)."""
    lr, eps = 0.1, 1e-8
    tables = bag_tables()
    ebc = EmbeddingBagCollection(tables)
    fused = FusedEmbeddingBagCollection.from_torchrec(ebc, optimizer=gk.optim.ExactRowwiseAdagrad(lr=lr, eps=eps),
                                                      backend=BACKEND)
    assert fused.fused_parameter_names() == ["weights"]
    weights = {c.name: ebc.embedding_bags[c.name].weight.detach().clone() for c in tables}
    states = {c.name: torch.zeros(c.num_embeddings) for c in tables}
    for step in range(2):
        kjt = make_kjt(["a", "b", "c"], 5, 4, seed=10 + step)
        # a row read by both features of the shared table in this batch
        assert set(kjt["a"].values().tolist()) & set(kjt["b"].values().tolist())
        for config in tables:
            ebc.embedding_bags[config.name].weight.data.copy_(weights[config.name])
            ebc.embedding_bags[config.name].weight.grad = None
        expected, out = ebc(kjt).values(), fused(kjt).values()
        grad = randn_nonzero(*expected.shape)
        expected.backward(grad)
        out.backward(grad)
        assert fused.weights.grad is None
        jts = kjt.to_dict()
        for config in tables:
            touched = sorted({int(i) for f in config.feature_names for i in jts[f].values()})
            weights[config.name], states[config.name] = _rowwise_adagrad(
                weights[config.name], ebc.embedding_bags[config.name].weight.grad, states[config.name], touched, lr, eps)
            torch.testing.assert_close(fused.weight(config.name).detach(), weights[config.name])
            t = fused._table_names.index(config.name)
            r0 = fused.layout.rows_offsets[t]
            torch.testing.assert_close(fused.momentum1[r0:r0 + config.num_embeddings], states[config.name])
    assert int(fused.optimizer_state_dict()["step"]) == 2


def test_ebc_state_dict_both_ways():
    tables = bag_tables()
    ebc = EmbeddingBagCollection(tables)
    fused = FusedEmbeddingBagCollection(bag_tables(), backend=BACKEND)
    assert list(fused.state_dict()) == list(ebc.state_dict()) == [
        "embedding_bags.t_shared.weight", "embedding_bags.t_c.weight", "embedding_bags.t_c2.weight"]
    fused.load_state_dict(ebc.state_dict())  # a TorchRec checkpoint into the fused module
    kjt = make_kjt(["a", "b", "c"], 5, 3)
    assert_same_keyed(fused(kjt), ebc(kjt))
    with torch.no_grad():
        fused.weights.mul_(-2.0)
    ebc.load_state_dict(fused.state_dict())  # and back
    assert_same_keyed(ebc(kjt), fused(kjt))
    partial = {k: v for k, v in ebc.state_dict().items() if "t_c2" not in k}
    result = fused.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["embedding_bags.t_c2.weight"] and not result.unexpected_keys
    with pytest.raises(RuntimeError, match="size mismatch for embedding_bags.t_c.weight"):
        fused.load_state_dict({**ebc.state_dict(), "embedding_bags.t_c.weight": torch.zeros(3, 8)})


def test_ebc_torch_compile_fullgraph():
    """KJT in, KeyedTensor out, no graph break (shared table, mixed dims and poolings, weighted),
    with a fused optimizer; outputs and updates equal to eager."""
    optimizer = gk.optim.ExactRowwiseAdagrad(lr=0.05)
    eager = FusedEmbeddingBagCollection(bag_tables(), is_weighted=True, optimizer=optimizer, backend=BACKEND)
    compiled_module = FusedEmbeddingBagCollection(bag_tables(), is_weighted=True, optimizer=optimizer, backend=BACKEND)
    compiled_module.load_state_dict(eager.state_dict())
    before = eager.weights.detach().clone()

    compiled = torch.compile(compiled_module, fullgraph=True, backend="aot_eager")
    # One call: a second batch shape recompiles (dynamic shapes), tens of seconds on this CPU.
    kjt = make_kjt(["a", "b", "c"], 5, 4, seed=0, weighted=True)
    out, expected = compiled(kjt), eager(kjt)
    assert out.keys() == expected.keys()
    torch.testing.assert_close(out.values(), expected.values())
    out.values().square().sum().backward()
    expected.values().square().sum().backward()
    assert int(compiled_module.step) == 1 and not torch.equal(eager.weights.detach(), before)
    torch.testing.assert_close(compiled_module.weights, eager.weights)
    torch.testing.assert_close(compiled_module.momentum1, eager.momentum1)


def test_ebc_bad_id_names_feature_and_table():
    fused = FusedEmbeddingBagCollection(bag_tables(), backend=BACKEND)
    kjt = make_kjt(["a", "b", "c"], 5, 3, seed=4)
    values = kjt.values().clone()
    b_start = int(kjt.offset_per_key()[1])
    values[b_start] = 11  # feature b reads t_shared, 11 rows
    bad = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    with pytest.raises(IndexError, match=r"feature 'b': id 11 is out of range for table 't_shared' \(num_embeddings=11\)"):
        fused(bad)
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        fused(values)
    with pytest.raises(ValueError, match=r"missing the keys \['c'\]"):
        fused(KeyedJaggedTensor(keys=["a", "b"], values=torch.zeros(0, dtype=torch.int64),
                                lengths=torch.zeros(2, dtype=torch.int64)))


# ------------------------------------------------------------------------------------------------
# EmbeddingCollection
# ------------------------------------------------------------------------------------------------

def seq_tables():
    return [EmbeddingConfig(name="t_shared", embedding_dim=6, num_embeddings=9, feature_names=["a", "b"]),
            EmbeddingConfig(name="t_c", embedding_dim=6, num_embeddings=5, feature_names=["c"])]


@pytest.mark.parametrize("batch", [0, 4])
def test_ec_matches_torchrec(batch):
    ec = EmbeddingCollection(seq_tables(), need_indices=True)
    fused = FusedEmbeddingCollection.from_torchrec(ec, backend=BACKEND)
    assert list(fused.state_dict()) == list(ec.state_dict()) == ["embeddings.t_shared.weight", "embeddings.t_c.weight"]
    kjt = make_kjt(["b", "a", "c"], 5, batch, seed=5)
    expected, out = ec(kjt), fused(kjt)
    assert list(out) == list(expected) == ["a", "b", "c"]
    for key in expected:
        torch.testing.assert_close(out[key].values(), expected[key].values())
        torch.testing.assert_close(out[key].lengths(), expected[key].lengths())
        torch.testing.assert_close(out[key].weights(), expected[key].weights())
    grads = {key: randn_nonzero(*expected[key].values().shape) for key in expected}
    torch.autograd.backward([expected[k].values() for k in expected], [grads[k] for k in expected])
    torch.autograd.backward([out[k].values() for k in out], [grads[k] for k in out])
    for config in seq_tables():
        torch.testing.assert_close(table_grad(fused, config.name), ec.embeddings[config.name].weight.grad)
    ec.load_state_dict(FusedEmbeddingCollection(seq_tables(), backend=BACKEND).state_dict())


# ------------------------------------------------------------------------------------------------
# Packaging
# ------------------------------------------------------------------------------------------------

def test_torchrec_is_optional_and_lazy():
    """`import gem_kernels` never imports TorchRec; without it gk.torchrec says how to install it."""
    code = (
        "import sys\n"
        "import gem_kernels as gk\n"
        "assert 'torchrec' not in sys.modules, 'import gem_kernels imported torchrec'\n"
        "sys.modules['torchrec'] = None\n"
        "try:\n"
        "    gk.torchrec\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pip install --no-deps torchrec==1.9.2" in result.stdout and "fbgemm-gpu-cpu==1.9.0" in result.stdout
    assert gk.torchrec.FusedEmbeddingBagCollection is FusedEmbeddingBagCollection

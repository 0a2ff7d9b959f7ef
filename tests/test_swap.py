"""gk.swap: every kind of swapped module gives the unswapped module's forward, gradients, optimizer
step and state_dict; the report says what was replaced and why the rest was skipped; TorchRec's own
DLRM and DLRM_DCN train the same after the swap. fp32, small shapes (the file runs in well under a
minute on a 2-core CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gem_kernels as gk
from gem_kernels import SwapSkip, register

TOL = dict(atol=1e-5, rtol=1e-5)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad) for n, p in module.named_parameters()
            if p.grad is not None}


def _assert_same_grads(swapped: nn.Module, eager: nn.Module, **tol) -> None:
    got, want = _grads(swapped), _grads(eager)
    assert got.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], **(tol or TOL), msg=name)


# ---------------------------------------------------------------------------------------------
# nn.EmbeddingBag
# ---------------------------------------------------------------------------------------------

BAG_CASES = {
    "sum-1d": dict(mode="sum"),
    "mean-1d": dict(mode="mean"),
    "sum-psw": dict(mode="sum", psw=True),
    "mean-last-offset": dict(mode="mean", include_last_offset=True),
    "sum-padding-idx": dict(mode="sum", padding_idx=3),
    "mean-padding-idx-neg": dict(mode="mean", padding_idx=-1),
    "mean-2d": dict(mode="mean", two_d=True),
    "sum-2d-psw": dict(mode="sum", two_d=True, psw=True),
}


def _bag_inputs(case: dict, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if case.get("two_d"):
        indices = torch.randint(0, rows, (5, 4), generator=g)
        offsets = None
    else:
        lengths = torch.tensor([3, 0, 1, 5, 2])  # an empty bag included
        indices = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        if not case.get("include_last_offset"):
            offsets = offsets[:-1]
    if "padding_idx" in case:
        indices.view(-1)[::3] = case["padding_idx"] % rows
    psw = torch.rand(indices.shape, generator=g, requires_grad=True) if case.get("psw") else None
    return indices, offsets, psw


def _bag_model(case: dict, rows: int = 11, dim: int = 6, sparse: bool = False) -> nn.Module:
    torch.manual_seed(0)
    kw = {k: case[k] for k in ("mode", "include_last_offset", "padding_idx") if k in case}
    return nn.ModuleDict({"bag": nn.EmbeddingBag(rows, dim, sparse=sparse, **kw)})


@pytest.mark.parametrize("name", list(BAG_CASES))
def test_embedding_bag_forward_and_grads(name):
    case = BAG_CASES[name]
    eager = _bag_model(case)
    swapped = copy.deepcopy(eager)
    report = gk.swap(swapped)
    assert report.replaced == [("bag", "EmbeddingBag", "gem_kernels.nn.EmbeddingBag")]
    assert isinstance(swapped["bag"], gk.nn.EmbeddingBag) and report.skipped == []
    indices, offsets, psw = _bag_inputs(case, 11)
    psw2 = psw.detach().clone().requires_grad_() if psw is not None else None
    want = eager["bag"](indices, offsets, per_sample_weights=psw)
    got = swapped["bag"](indices, offsets, per_sample_weights=psw2)
    torch.testing.assert_close(got, want, **TOL)
    grad_out = torch.randn_like(want)
    (want * grad_out).sum().backward()
    (got * grad_out).sum().backward()
    _assert_same_grads(swapped, eager)
    if psw is not None:
        torch.testing.assert_close(psw2.grad, psw.grad, **TOL)


@pytest.mark.parametrize("name", ["sum-psw", "mean-padding-idx-neg"])
@pytest.mark.parametrize("opt", ["SparseAdam", "Adagrad"])
def test_embedding_bag_sparse_grad_and_step(name, opt):
    """sparse=True and optimizer=None: a sparse gradient, and one torch optimizer step equal."""
    case = BAG_CASES[name]
    eager = _bag_model(case, sparse=True)
    swapped = copy.deepcopy(eager)
    gk.swap(swapped)
    make = {"SparseAdam": lambda p: torch.optim.SparseAdam(p, lr=0.1),
            "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1)}[opt]
    opts = [make(list(m.parameters())) for m in (eager, swapped)]
    for step in range(2):
        indices, offsets, psw = _bag_inputs(case, 11, seed=step)
        psws = [psw if psw is None else psw.detach().clone().requires_grad_() for _ in range(2)]
        for model, o, p in zip((eager, swapped), opts, psws):
            o.zero_grad()
            model["bag"](indices, offsets, per_sample_weights=p).square().sum().backward()
        assert swapped["bag"].weight.grad.is_sparse
        _assert_same_grads(swapped, eager)
        if psw is not None:
            torch.testing.assert_close(psws[1].grad, psws[0].grad, **TOL)
        for o in opts:
            o.step()
        torch.testing.assert_close(swapped["bag"].weight, eager["bag"].weight, **TOL)


@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_embedding_bag_fused_optimizer_step(rule):
    """optimizer=gk.optim rule: the backward updates the rows as the same torch optimizer's step does."""
    case = BAG_CASES["mean-1d"]
    eager = _bag_model(case, sparse=(rule == "adam"))
    swapped = copy.deepcopy(eager)
    fused = {"sgd": gk.optim.ExactSGD(lr=0.1), "adam": gk.optim.ExactAdam(lr=0.1)}[rule]
    torch_opt = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1),
                 "adam": lambda p: torch.optim.SparseAdam(p, lr=0.1)}[rule](list(eager.parameters()))
    report = gk.swap(swapped, optimizer=fused)
    assert report.fused_parameters == ["bag.weight"]
    assert "bag.weight" in str(report)
    for step in range(2):
        indices, offsets, _ = _bag_inputs(case, 11, seed=step)
        torch_opt.zero_grad()
        eager["bag"](indices, offsets).square().sum().backward()
        torch_opt.step()
        swapped["bag"](indices, offsets).square().sum().backward()
        assert swapped["bag"].weight.grad is None
        torch.testing.assert_close(swapped["bag"].weight, eager["bag"].weight, **TOL)


def test_embedding_bag_state_dict_and_idempotence():
    model = nn.Sequential(nn.Linear(3, 3), nn.EmbeddingBag(10, 4, mode="sum"))
    keys = list(model.state_dict())
    weight = model[1].weight
    original = copy.deepcopy(model)
    gk.swap(model)
    assert list(model.state_dict()) == keys
    assert model[1].weight is weight  # the same Parameter: an optimizer built before keeps working
    fused = model[1]
    again = gk.swap(model)
    assert again.replaced == [] and model[1] is fused
    assert again.skipped == [("1", "EmbeddingBag", "already swapped")]
    # a checkpoint of the original loads into the swapped model, and back
    with torch.no_grad():
        original[1].weight.add_(1.0)
    model.load_state_dict(original.state_dict())
    torch.testing.assert_close(model[1].weight, original[1].weight, **TOL)
    original.load_state_dict(model.state_dict())


def test_embedding_bag_out_of_range_id():
    model = nn.Sequential(nn.EmbeddingBag(10, 4, mode="sum"))
    gk.swap(model)
    with pytest.raises(IndexError, match="10"):
        model[0](torch.tensor([1, 10]), torch.tensor([0]))
    with pytest.raises(IndexError):
        model[0](torch.tensor([-1, 2]), torch.tensor([0]))


class _MyBag(nn.EmbeddingBag):
    pass


class _Custom(nn.Module):
    def forward(self, x):
        return x + 1


class _CustomFused(nn.Module):
    def forward(self, x):
        return x + 1


def test_report_skip_reasons_and_filters():
    model = nn.ModuleDict({
        "max": nn.EmbeddingBag(10, 4, mode="max"),
        "max_norm": nn.EmbeddingBag(10, 4, mode="sum", max_norm=1.0),
        "freq": nn.EmbeddingBag(10, 4, mode="sum", scale_grad_by_freq=True),
        "f64": nn.EmbeddingBag(10, 4, mode="sum", dtype=torch.float64),
        "sub": _MyBag(10, 4),
        "ok": nn.EmbeddingBag(10, 4, mode="sum"),
        "tower": nn.ModuleDict({"a": nn.EmbeddingBag(10, 4), "b": nn.EmbeddingBag(10, 4)}),
        "seq_first": nn.MultiheadAttention(8, 2),
        "kdim": nn.MultiheadAttention(8, 2, kdim=4, vdim=4, batch_first=True),
        "bias_kv": nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True),
        "attn": nn.MultiheadAttention(8, 2, batch_first=True),
    })
    report = gk.swap(model, exclude=["tower.b"], include=["EmbeddingBag", "tower", "attn"])
    assert sorted(p for p, _, _ in report.replaced) == ["attn", "ok", "tower.a"]
    reasons = {p: why for p, _, why in report.skipped}
    assert "mode 'max'" in reasons["max"]
    assert "max_norm" in reasons["max_norm"]
    assert "scale_grad_by_freq" in reasons["freq"]
    assert "float64" in reasons["f64"]
    assert "subclass of EmbeddingBag" in reasons["sub"]
    assert reasons["tower.b"] == "excluded"
    assert reasons["seq_first"] == reasons["kdim"] == reasons["bias_kv"] == "not matched by include"
    report = gk.swap(model)  # now without the filter: the attention modules' own reasons
    reasons = {p: why for p, _, why in report.skipped}
    assert reasons["seq_first"] == "batch_first=False"
    assert "kdim" in reasons["kdim"] and "add_bias_kv" in reasons["bias_kv"]
    assert [p for p, _, _ in report.replaced] == ["tower.b"]
    text = str(report)
    for path, type_name, why in report.skipped:
        assert path in text and why in text
    root = gk.swap(nn.EmbeddingBag(10, 4))
    assert root.replaced == [] and "root module" in root.skipped[0][2]
    with pytest.raises(ValueError, match="optimizer"):
        gk.swap(model, optimizer="adagrad")
    with pytest.raises(ValueError, match="include"):
        gk.swap(model, include=3)


def test_register_custom_converter():
    def convert(module, *, optimizer, backend):
        if getattr(module, "frozen", False):
            raise SwapSkip("frozen by the user")
        return _CustomFused()

    register(_Custom, convert)
    model = nn.Sequential(_Custom(), _Custom())
    model[1].frozen = True
    report = gk.swap(model)
    assert report.replaced == [("0", "_Custom", f"{__name__}._CustomFused")]
    assert report.skipped == [("1", "_Custom", "frozen by the user")]
    assert gk.swap(model).replaced == []
    with pytest.raises(TypeError):
        register(int, convert)


# ---------------------------------------------------------------------------------------------
# nn.MultiheadAttention, alone and inside nn.TransformerEncoderLayer
# ---------------------------------------------------------------------------------------------


def _padded_batch(lengths, length=7, dim=8, left=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), length, dim, generator=g)
    pos = torch.arange(length).unsqueeze(0)
    lengths = torch.tensor(lengths).unsqueeze(1)
    pad = pos < length - lengths if left else pos >= lengths
    return x, pad


def _mha_pair(dim=8, heads=2, dropout=0.0, bias=True):
    torch.manual_seed(0)
    eager = nn.Sequential(nn.MultiheadAttention(dim, heads, batch_first=True, dropout=dropout, bias=bias))
    swapped = copy.deepcopy(eager)
    report = gk.swap(swapped)
    assert report.replaced == [("0", "MultiheadAttention", "gem_kernels.nn.MultiheadAttention")]
    return eager[0], swapped[0], report


def _causal(length, kind):
    if kind == "bool":
        return torch.ones(length, length, dtype=torch.bool).triu(1)
    return nn.Transformer.generate_square_subsequent_mask(length)


@pytest.mark.parametrize("masks", ["padding", "padding-float", "causal-bool", "causal-float", "causal-hint",
                                   "padding+causal", "none", "padding+causal-no-bias"])
def test_mha_fused_matches_eager(masks):
    eager, swapped, report = _mha_pair(bias="no-bias" not in masks)
    x, pad = _padded_batch([7, 3, 0, 5] if "padding" in masks else [7, 7, 7, 7])
    kw = dict(need_weights=False)
    if masks.startswith("padding"):
        kw["key_padding_mask"] = pad if masks != "padding-float" else torch.zeros(pad.shape).masked_fill(
            pad, float("-inf"))
    if "causal" in masks:
        kw["attn_mask"] = _causal(7, "bool" if masks.startswith("causal-bool") else "float")
        kw["is_causal"] = masks == "causal-hint"
    valid = (~pad).unsqueeze(-1).float()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = eager(x1, x1, x1, **kw)[0]
    got = swapped(x2, x2, x2, **kw)[0]
    assert report.fallbacks == 0, report.fallback_reasons
    torch.testing.assert_close(got * valid, want * valid, atol=1e-5, rtol=1e-4)
    assert torch.equal(got * (1 - valid), torch.zeros_like(got))  # padded positions: zeros
    grad_out = torch.randn_like(want) * valid  # padded positions do not count
    (want * grad_out).sum().backward()
    (got * grad_out).sum().backward()
    _assert_same_grads(swapped, eager, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("call", ["left-padded", "arbitrary-mask", "need-weights", "cross-attention",
                                  "dropout-training", "3d-mask"])
def test_mha_other_calls_fall_back(call):
    eager, swapped, report = _mha_pair(dropout=0.5 if call == "dropout-training" else 0.0)
    x, pad = _padded_batch([7, 3, 5, 1], left=(call == "left-padded"))
    kw = dict(need_weights=call == "need-weights", key_padding_mask=pad)
    if call == "arbitrary-mask":
        kw["attn_mask"] = torch.rand(7, 7) < 0.3
        kw["attn_mask"].fill_diagonal_(False)
    if call == "3d-mask":
        kw["attn_mask"] = _causal(7, "bool").expand(8, 7, 7)
    key = x.flip(0) if call == "cross-attention" else x
    torch.manual_seed(1)
    want = eager(x, key, key, **kw)
    torch.manual_seed(1)
    got = swapped(x, key, key, **kw)
    assert report.fallbacks == 1 and sum(report.fallback_reasons.values()) == 1
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)  # the original computation itself
    assert (got[1] is None) == (want[1] is None)
    assert "fallbacks so far: 1" in str(report)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_layer_self_attn(norm_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True,
                                       norm_first=norm_first)
    eager = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    swapped = copy.deepcopy(eager)
    keys = list(swapped.state_dict())
    report = gk.swap(swapped)
    assert [p for p, _, _ in report.replaced] == ["layers.0", "layers.0.self_attn", "layers.1", "layers.1.self_attn"]
    assert list(swapped.state_dict()) == keys
    x, pad = _padded_batch([7, 2, 4], seed=3)
    valid = (~pad).unsqueeze(-1).float()
    mask = _causal(7, "float")
    want = eager(x, mask=mask, src_key_padding_mask=pad, is_causal=True)
    got = swapped(x, mask=mask, src_key_padding_mask=pad, is_causal=True)
    assert report.fallbacks == 0, report.fallback_reasons
    assert [layer.layer_fallbacks for layer in swapped.layers] == [0, 0]
    torch.testing.assert_close(got * valid, want * valid, atol=1e-5, rtol=1e-4)
    assert torch.equal(got * (1 - valid), torch.zeros_like(got))
    ((want * valid).square().sum()).backward()
    ((got * valid).square().sum()).backward()
    _assert_same_grads(swapped, eager, atol=1e-4, rtol=1e-4)
    # eval under no_grad: torch's own inference fast path may bypass self_attn; the answer stays right
    eager.eval(), swapped.eval()
    with torch.no_grad():
        torch.testing.assert_close(swapped(x, src_key_padding_mask=pad) * valid,
                                   eager(x, src_key_padding_mask=pad) * valid, atol=1e-5, rtol=1e-4)


def test_transformer_encoder_layer_falls_back():
    """Left padding or dropout in training: torch's layer runs (its swapped self_attn fuses what it can)."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True))
    swapped = copy.deepcopy(eager)
    report = gk.swap(swapped)
    x, pad = _padded_batch([7, 2, 4], left=True)
    torch.testing.assert_close(swapped[0](x, src_key_padding_mask=pad), eager[0](x, src_key_padding_mask=pad),
                               atol=0, rtol=0)
    assert swapped[0].layer_fallback_reasons == {"key_padding_mask does not pad only at the end of each row": 1}
    assert report.fallbacks == 2  # the layer's own fallback, and the self_attn call it handed on fell back too
    dropout = nn.Sequential(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1, batch_first=True))
    gk.swap(dropout)
    dropout[0](x)
    assert dropout[0].layer_fallback_reasons == {"dropout > 0 in training mode": 1}
    seq_first = nn.Sequential(nn.TransformerEncoderLayer(8, 2))
    report = gk.swap(seq_first)
    assert report.skipped == [("0", "TransformerEncoderLayer", "its self_attn: batch_first=False"),
                              ("0.self_attn", "MultiheadAttention", "batch_first=False")]


# ---------------------------------------------------------------------------------------------
# TorchRec
# ---------------------------------------------------------------------------------------------

# Only the TorchRec cases skip without torchrec (an optional dependency, see README); the torch.nn
# cases above run everywhere.
try:
    import torchrec
    from torchrec.models.dlrm import DLRM, DLRM_DCN, InteractionArch
    from torchrec.modules.crossnet import CrossNet, LowRankCrossNet
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
except ImportError:
    torchrec = None
needs_torchrec = pytest.mark.skipif(torchrec is None, reason="torchrec is not installed (see README: optional dependency)")


def _gk_torchrec():
    try:
        return gk.torchrec
    except (AttributeError, ImportError) as exc:
        pytest.skip(f"gem_kernels.torchrec (branch torchrec) is not in this tree: {exc}")


@needs_torchrec
@pytest.mark.parametrize("kind", ["interaction", "crossnet", "low_rank_crossnet"])
def test_torchrec_dense_modules(kind):
    torch.manual_seed(0)
    module = {"interaction": lambda: InteractionArch(num_sparse_features=3),
              "crossnet": lambda: CrossNet(in_features=6, num_layers=2),
              "low_rank_crossnet": lambda: LowRankCrossNet(in_features=6, num_layers=3, low_rank=2)}[kind]()
    if kind != "interaction":
        with torch.no_grad():
            for p in module.bias.parameters():
                p.normal_()
    eager = nn.ModuleDict({"m": module})
    swapped = copy.deepcopy(eager)
    keys = list(swapped.state_dict())
    report = gk.swap(swapped)
    assert len(report.replaced) == 1 and report.replaced[0][0] == "m"
    assert list(swapped.state_dict()) == keys
    if kind == "interaction":
        inputs = (torch.randn(5, 4, requires_grad=True), torch.randn(5, 3, 4, requires_grad=True))
    else:
        inputs = (torch.randn(5, 6, requires_grad=True),)
    inputs2 = tuple(t.detach().clone().requires_grad_() for t in inputs)
    want, got = eager["m"](*inputs), swapped["m"](*inputs2)
    torch.testing.assert_close(got, want, **TOL)
    grad_out = torch.randn_like(want)
    (want * grad_out).sum().backward()
    (got * grad_out).sum().backward()
    for a, b in zip(inputs2, inputs):
        torch.testing.assert_close(a.grad, b.grad, **TOL)
    if kind != "interaction":
        _assert_same_grads(swapped, eager)
    assert gk.swap(swapped).replaced == []


TABLE_ROWS = [40, 17, 60, 9]
DIM = 8


def _ebc(pooling=None):
    pooling = PoolingType.SUM if pooling is None else pooling
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{i}"],
                                 pooling=pooling) for i, rows in enumerate(TABLE_ROWS)]
    return EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))


def _dataset(batch_size=16, seed=0):
    from torchrec.datasets.random import RandomRecDataset

    return RandomRecDataset(keys=[f"f{i}" for i in range(len(TABLE_ROWS))], batch_size=batch_size,
                            hash_sizes=TABLE_ROWS, ids_per_feature=3, num_dense=5, manual_seed=seed,
                            num_generated_batches=4, num_batches=4)


def _dlrm(kind):
    ebc = _ebc()
    torch.manual_seed(1)
    if kind == "dlrm":
        return DLRM(embedding_bag_collection=ebc, dense_in_features=5, dense_arch_layer_sizes=[12, DIM],
                    over_arch_layer_sizes=[8, 1])
    return DLRM_DCN(embedding_bag_collection=ebc, dense_in_features=5, dense_arch_layer_sizes=[12, DIM],
                    over_arch_layer_sizes=[8, 1], dcn_num_layers=2, dcn_low_rank_dim=4)


def _train(model, optimizer, batches, steps):
    losses = []
    for _, batch in zip(range(steps), batches):
        logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
        if optimizer is not None:
            optimizer.zero_grad()
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        losses.append(loss.item())
    return losses


@needs_torchrec
@pytest.mark.parametrize("kind", ["dlrm", "dlrm_dcn"])
def test_torchrec_dlrm_trains_the_same(kind):
    """TorchRec's own DLRM / DLRM_DCN fed by RandomRecDataset: swapped with optimizer=None (Adagrad on
    every parameter) and with the fused row-wise Adagrad for the tables, training equals the eager
    model's; the checkpoint of the eager model loads into the swapped one."""
    _gk_torchrec()
    eager = _dlrm(kind)
    swapped = copy.deepcopy(eager)
    report = gk.swap(swapped)
    replaced = {p for p, _, _ in report.replaced}
    expected = {"sparse_arch.embedding_bag_collection",
                "inter_arch" if kind == "dlrm" else "inter_arch.crossnet"}
    assert replaced == expected, str(report)
    assert report.skipped == [] and report.fused_parameters == []
    assert sorted(swapped.state_dict()) == sorted(eager.state_dict())
    swapped.load_state_dict(eager.state_dict())
    batches = list(iter(_dataset()))
    want = _train(eager, torch.optim.Adagrad(eager.parameters(), lr=0.05), batches, 4)
    got = _train(swapped, torch.optim.Adagrad(swapped.parameters(), lr=0.05), batches, 4)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)
    want_state = eager.state_dict()
    for name, p in swapped.state_dict().items():
        torch.testing.assert_close(p, want_state[name], atol=1e-5, rtol=1e-4, msg=name)


@needs_torchrec
def test_torchrec_fused_rowwise_adagrad_matches_formula():
    """optimizer=ExactRowwiseAdagrad: the tables update in the backward (FBGEMM's EXACT_ROWWISE_ADAGRAD);
    the dense parameters still take the user's optimizer. Checked against the row-wise formula applied
    to the eager model's dense gradient of each table."""
    _gk_torchrec()
    eager = _dlrm("dlrm")
    swapped = copy.deepcopy(eager)
    lr, eps = 0.05, 1e-8
    report = gk.swap(swapped, optimizer=gk.optim.ExactRowwiseAdagrad(lr=lr, eps=eps))
    tables = [f"sparse_arch.embedding_bag_collection.embedding_bags.t{i}.weight" for i in range(len(TABLE_ROWS))]
    fused = set(report.fused_parameters)
    params = dict(swapped.named_parameters())
    assert fused and all(n in params and n.startswith("sparse_arch.embedding_bag_collection.") for n in fused)
    assert sum(params[n].numel() for n in fused) == sum(rows * DIM for rows in TABLE_ROWS)
    dense = [p for n, p in swapped.named_parameters() if n not in fused]
    batch = next(iter(_dataset()))
    _train(swapped, torch.optim.SGD(dense, lr=0.1), [batch], 1)
    eager_opt = torch.optim.SGD([p for n, p in eager.named_parameters() if n not in tables], lr=0.1)
    _train(eager, eager_opt, [batch], 1)
    before, after = dict(eager.named_parameters()), swapped.state_dict()
    for name in tables:
        w, g = before[name].detach(), before[name].grad
        state = g.square().mean(1, keepdim=True)
        expected = w - lr * g / (state.sqrt() + eps)
        torch.testing.assert_close(after[name], expected, atol=1e-5, rtol=1e-4, msg=name)
    for name, p in eager.named_parameters():
        if name not in tables:
            torch.testing.assert_close(after[name], p.detach(), atol=1e-5, rtol=1e-4, msg=name)


@needs_torchrec
def test_torchrec_ebc_compiles_fullgraph():
    _gk_torchrec()
    model = nn.ModuleDict({"ebc": _ebc(PoolingType.MEAN)})
    eager = copy.deepcopy(model)
    gk.swap(model, backend="cpu" if "cpu" in gk.available_backends() else None)
    features = next(iter(_dataset())).sparse_features
    compiled = torch.compile(model["ebc"], fullgraph=True, backend="aot_eager")
    got, want = compiled(features), eager["ebc"](features)
    assert got.keys() == want.keys()
    torch.testing.assert_close(got.values(), want.values(), **TOL)


@needs_torchrec
def test_torchrec_out_of_range_id_names_table_and_feature():
    _gk_torchrec()
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    model = nn.ModuleDict({"ebc": _ebc()})
    gk.swap(model)
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2", "f3"], values=torch.tensor([1, 2, 17, 3]), lengths=torch.tensor([1, 0, 1, 1, 1, 0, 0, 0]))
    with pytest.raises(IndexError, match=r"(?s)(t1.*f1|f1.*t1)"):
        model["ebc"](features)


def test_swap_is_one_function_and_its_engine_a_private_module():
    """Issue 29 item 5: `gem_kernels.swap` was both a module and the function that shadowed it, with
    register/SwapSkip/SwapReport hung on the function. Now the engine is gem_kernels._swap and those
    names are gem_kernels' own."""
    import importlib
    import types

    engine = importlib.import_module("gem_kernels._swap")
    assert isinstance(gk.swap, types.FunctionType) and gk.swap is engine.swap
    assert (gk.register, gk.SwapSkip, gk.SwapReport) == (engine.register, engine.SwapSkip, engine.SwapReport)
    assert not any(hasattr(gk.swap, name) for name in ("register", "SwapSkip", "SwapReport"))

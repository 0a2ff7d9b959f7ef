"""gk.swap and the swapped torch.nn modules, tried as a PyTorch user would (issues 24 and 30).

Each test names the issue item it covers; every one of them failed on main before this branch
(main: include hid children, include=[] swapped everything, bogus backends passed until the first
forward, a converter returning None gave an AttributeError, is_causal without src_mask ran
bidirectional attention, nn.EmbeddingBag had no optimizer_state_dict, the reference fallback was
silent, Proxies were refused, frozen weights moved, [3, 0] input gave [0, 4], meta and .half()
modules failed at the first forward). No TorchRec needed: tests/test_conformance_torchrec.py has
the TorchRec surfaces.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.fx
from torch import nn

import gem_kernels as gk
from gem_kernels import _backend
from gem_kernels.nn import embedding_bag as gk_embedding_bag
from gem_kernels import register

TOL = dict(atol=1e-5, rtol=1e-5)


def _encoder(batch_first: bool = True, layers: int = 2) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)


# -- filters, arguments, converters (issue 24 gk.swap 1; issue 30 items 5, 6, 15) ---------------------

def test_include_selects_and_never_hides_children():
    """24/swap-1: the README's own `include="*.self_attn"` replaced nothing on main (0 replaced, 2 skipped)."""
    encoder = _encoder()
    report = gk.swap(encoder, include="*.self_attn")
    assert sorted(p for p, _, _ in report.replaced) == ["layers.0.self_attn", "layers.1.self_attn"], str(report)
    assert type(encoder.layers[0]) is nn.TransformerEncoderLayer  # the unmatched layer itself stays
    assert type(encoder.layers[0].self_attn) is gk.nn.MultiheadAttention


def test_include_empty_swaps_nothing():
    """30/5: include=[] swapped everything on main."""
    model = nn.ModuleDict({"bag": nn.EmbeddingBag(10, 4), "enc": _encoder()})
    report = gk.swap(model, include=[])
    assert report.replaced == []
    assert type(model["bag"]) is nn.EmbeddingBag


@pytest.mark.parametrize("arg", ["include", "exclude"])
def test_a_dict_filter_is_refused(arg):
    """Found by the front-door fuzz: exclude={"a": 1} was taken as its keys, silently."""
    with pytest.raises(ValueError, match=rf"{arg} must be None, a string or a list of strings"):
        gk.swap(nn.ModuleDict({"bag": nn.EmbeddingBag(10, 4)}), **{arg: {"bag": True}})


def test_key_padding_mask_of_another_shape_is_named():
    """Found by the front-door fuzz: a key_padding_mask of the wrong shape gave torch's bare
    "AssertionError: Expected key_padded_mask.shape[1] to be 3, but got 4" (a batch_first=False
    module is not swapped: torch's own module and message stay)."""
    holder = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2, batch_first=True)})
    gk.swap(holder)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, source length\) = \(2, 3\), "
                                         r"got \(2, 4\)"):
        holder["attn"](x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool), need_weights=False)


def test_bad_backend_refused_at_the_call():
    """30/6: backend="bogus" passed gk.swap and the module constructors; the error came at the first forward."""
    with pytest.raises(ValueError, match="backend.*bogus"):
        gk.swap(nn.ModuleDict({"bag": nn.EmbeddingBag(10, 4)}), backend="bogus")
    with pytest.raises(ValueError, match="backend.*bogus"):
        gk.nn.EmbeddingBag(10, 4, backend="bogus")
    with pytest.raises(ValueError, match="backend.*bogus"):
        gk.nn.FusedEmbeddingBag([gk.nn.TableSpec(10, 4)], backend="bogus")


class _Custom(nn.Linear):
    pass


def test_converter_returning_none_is_named():
    """30/15: a converter that returns None gave "AttributeError: 'NoneType' object has no attribute 'train'"."""
    register(_Custom, lambda module, *, optimizer, backend: None)
    with pytest.raises(TypeError, match=r"(?s)_Custom.*returned NoneType.*'lin'.*SwapSkip"):
        gk.swap(nn.ModuleDict({"lin": _Custom(3, 3)}))


# -- TransformerEncoderLayer (issue 24 gk.swap 2) ----------------------------------------------------

def test_encoder_layer_is_causal_without_mask_follows_torch():
    """24/swap-2: the swapped layer ignored is_causal=True without src_mask (bidirectional attention);
    torch raises there, so must the swap. The layer's own fallback counts in report.fallbacks."""
    layer = _encoder(layers=1).layers[0]
    model = nn.ModuleDict({"layer": layer})
    eager = copy.deepcopy(model)
    report = gk.swap(model)
    x = torch.randn(2, 5, 8)
    with pytest.raises(Exception) as want:
        eager["layer"](x, is_causal=True)
    with pytest.raises(type(want.value), match="attn_mask"):
        model["layer"](x, is_causal=True)
    assert report.fallbacks >= 1
    assert report.fallback_reasons.get("is_causal=True without src_mask") == 1


# -- PyTorch's MultiheadAttention / TransformerEncoderLayer behaviours: equal, or a counted fallback ---

def _pad_mask(batch: int, length: int, valid: list[int]) -> torch.Tensor:
    return torch.arange(length).unsqueeze(0) >= torch.tensor(valid).unsqueeze(1)


MHA_CASES = {
    "key_padding": dict(kpm=True),
    "causal": dict(causal=True),
    "key_padding_causal": dict(kpm=True, causal=True),
    "eval_fast_path": dict(kpm=True, eval=True),
    "need_weights": dict(need_weights=True),
    "batch_first_false": dict(batch_first=False),
    "bias_false": dict(bias=False),
    "kdim_vdim": dict(kdim=4),
    "cross_attention": dict(cross=True),
}


@pytest.mark.parametrize("name", list(MHA_CASES))
def test_mha_behaviours_equal_or_counted(name):
    """24/real clients: each behaviour of nn.MultiheadAttention the swap claims to keep gives torch's
    answer at every valid position, or is counted as a fallback (or the module is skipped, with the
    reason in the report). Never a silently different answer."""
    case = MHA_CASES[name]
    torch.manual_seed(0)
    batch_first = case.get("batch_first", True)
    kdim = case.get("kdim")
    mha = nn.MultiheadAttention(8, 2, bias=case.get("bias", True), batch_first=batch_first, kdim=kdim, vdim=kdim)
    model = nn.ModuleDict({"mha": mha})
    eager = copy.deepcopy(model)
    report = gk.swap(model)
    B, L = 3, 6
    x = torch.randn(B, L, 8) if batch_first else torch.randn(L, B, 8)
    kv = torch.randn(B, L, kdim) if kdim else (torch.randn_like(x) if case.get("cross") else x)
    kwargs = dict(need_weights=case.get("need_weights", False))
    valid = [6, 2, 4]
    if case.get("kpm"):
        kwargs["key_padding_mask"] = _pad_mask(B, L, valid)
    if case.get("causal"):
        kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L)
        kwargs["is_causal"] = True
    if case.get("eval"):  # torch's inference fast path (eval, no_grad) against the swapped module
        model.eval()
        eager.eval()
    with torch.set_grad_enabled(not case.get("eval")):
        want, want_w = eager["mha"](x, kv, kv, **kwargs)
        got, got_w = model["mha"](x, kv, kv, **kwargs)
    if type(model["mha"]) is nn.MultiheadAttention:
        assert report.skipped and report.skipped[0][0] == "mha", str(report)
    fell_back = report.fallbacks > 0
    if case.get("kpm") and not fell_back:
        for b, n in enumerate(valid):  # padded positions hold zeros on the fused path (documented)
            torch.testing.assert_close(got[b, :n], want[b, :n], **TOL)
            assert not got[b, n:].any()
    else:
        torch.testing.assert_close(got, want, **TOL)
    if want_w is not None:
        torch.testing.assert_close(got_w, want_w, **TOL)
    if name in ("need_weights", "cross_attention"):
        assert fell_back, "this call cannot run fused: it must count as a fallback"


@pytest.mark.parametrize("mode", ["train_padding", "eval_fast_path", "batch_first_false", "causal"])
def test_encoder_layer_behaviours_equal_or_counted(mode):
    """24/real clients: TransformerEncoderLayer key padding, causal mask, eval fast path (no_grad),
    batch_first=False: equal to torch at valid positions, or counted."""
    torch.manual_seed(0)
    encoder = _encoder(batch_first=mode != "batch_first_false", layers=1)
    eager = copy.deepcopy(encoder)
    report = gk.swap(encoder)
    B, L = 3, 5
    valid = [5, 3, 1]
    x = torch.randn(B, L, 8) if mode != "batch_first_false" else torch.randn(L, B, 8)
    kwargs = {}
    if mode in ("train_padding", "eval_fast_path"):
        kwargs["src_key_padding_mask"] = _pad_mask(B, L, valid)
    if mode == "causal":
        kwargs["mask"] = nn.Transformer.generate_square_subsequent_mask(L)
        kwargs["is_causal"] = True
    if mode == "eval_fast_path":
        encoder.eval()
        eager.eval()
        with torch.no_grad():
            want, got = eager(x, **kwargs), encoder(x, **kwargs)
    else:
        want, got = eager(x, **kwargs), encoder(x, **kwargs)
    if mode == "batch_first_false":
        assert report.replaced == [] and report.skipped, str(report)
    if "src_key_padding_mask" in kwargs:
        for b, n in enumerate(valid):
            torch.testing.assert_close(got[b, :n], want[b, :n], **TOL)
    else:
        torch.testing.assert_close(got, want, **TOL)


# -- torch.fx and TorchScript (issue 24: modules must trace) ----------------------------------------

def test_swapped_modules_trace_with_torch_fx():
    """24: torch.fx.symbolic_trace reached nn/embedding_bag.py and raised "input must be a 1-D or 2-D
    tensor of ids, got Proxy" on main. A swapped model traces, and the GraphModule computes the same."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(20, 8, mode="sum")
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, ids, offsets, x, pad):
            pooled = self.bag(ids, offsets)
            attn, _ = self.mha(x, x, x, key_padding_mask=pad, need_weights=False)
            return attn[:, 0] + pooled  # position 0 is valid in every row

    model = Model()
    eager = copy.deepcopy(model)
    gk.swap(model)
    gm = torch.fx.symbolic_trace(model)
    ids, offsets = torch.tensor([1, 2, 3, 19, 5]), torch.tensor([0, 2, 2])
    x, pad = torch.randn(3, 4, 8), _pad_mask(3, 4, [4, 2, 1])
    torch.testing.assert_close(gm(ids, offsets, x, pad), eager(ids, offsets, x, pad), **TOL)
    # the root module itself traces too
    bag = gk.nn.EmbeddingBag.from_torch(nn.EmbeddingBag(20, 8, mode="sum"))
    torch.testing.assert_close(torch.fx.symbolic_trace(bag)(ids, offsets), bag(ids, offsets))
    # the checks still run (on real tensors, inside the graph's call)
    with pytest.raises(IndexError):
        gm(torch.tensor([1, 2, 3, 25, 5]), offsets, x, pad)


def test_torchscript_gives_a_clear_error():
    """24: torch.jit.script of a swapped module names torch.export (main: an opaque TorchScript error)."""
    model = nn.ModuleDict({"bag": nn.EmbeddingBag(10, 4), "enc": _encoder(layers=1)})
    gk.swap(model)
    for module in (model, model["bag"], model["enc"]):
        with pytest.raises(TypeError, match="torch.export"):
            torch.jit.script(module)
    # and the way the message names works
    bag = model["bag"]
    ids, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    exported = torch.export.export(bag, (ids, offsets))
    torch.testing.assert_close(exported.module()(ids, offsets), bag(ids, offsets))


# -- nn.EmbeddingBag odd input (issue 30 items 1, 7, 12, 13, 16) --------------------------------------

def test_frozen_embedding_bag_is_never_updated():
    """30/1: a frozen weight moved by 1.0 under a fused optimizer when per_sample_weights needed a gradient."""
    bag = nn.EmbeddingBag(10, 4, mode="sum")
    bag.weight.requires_grad_(False)
    model = nn.ModuleDict({"bag": bag})
    gk.swap(model, optimizer=gk.optim.ExactSGD(lr=1.0))
    before = model["bag"].weight.detach().clone()
    psw = torch.ones(3, requires_grad=True)
    model["bag"](torch.tensor([1, 2, 3]), torch.tensor([0]), per_sample_weights=psw).sum().backward()
    assert not model["bag"].weight.requires_grad
    torch.testing.assert_close(model["bag"].weight, before, rtol=0, atol=0)
    assert psw.grad is not None


def test_two_d_input_of_empty_bags():
    """30/7: [3, 0] ids gave shape [0, 4]: three empty bags are [3, 4] of zeros (torch 2.14's own
    module raises "step must be nonzero" here; a 1-D input with empty bags gives zeros there too)."""
    model = nn.ModuleDict({"sum": nn.EmbeddingBag(10, 4, mode="sum"), "mean": nn.EmbeddingBag(10, 4, mode="mean")})
    gk.swap(model)
    for name in ("sum", "mean"):
        got = model[name](torch.empty(3, 0, dtype=torch.int64))
        assert got.shape == (3, 4) and not got.any()


@pytest.mark.parametrize("optimizer", [None, gk.optim.ExactRowwiseAdagrad(lr=0.1)])
def test_meta_device_then_to_empty(optimizer):
    """30/12: build on meta, swap, to_empty(cpu): main failed at the first forward ("D_offsets[0] and
    rows_offsets[0] must be 0, got <garbage>"). The layout is rebuilt and the optimizer state zeroed."""
    model = nn.ModuleDict({"bag": nn.EmbeddingBag(10, 4, mode="sum", device="meta")})
    gk.swap(model, optimizer=optimizer)
    model.to_empty(device="cpu")
    model["bag"].reset_parameters()
    eager = nn.EmbeddingBag(10, 4, mode="sum", _weight=model["bag"].weight.detach().clone())
    ids, offsets = torch.tensor([1, 9, 3, 3]), torch.tensor([0, 1])
    torch.testing.assert_close(model["bag"](ids, offsets), eager(ids, offsets))
    assert model["bag"].table_meta.rows_offsets.tolist() == [0, 10]
    assert not model["bag"].momentum1.any() and int(model["bag"].step) == 0


def test_half_keeps_fp32_optimizer_state():
    """30/13: .half() of a module with a fused optimizer failed at the next forward ("momentum1 must
    have dtype float32"). The state stays fp32 with its values."""
    model = nn.ModuleDict({"bag": nn.EmbeddingBag(10, 4, mode="sum")})
    gk.swap(model, optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1))
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    model["bag"](ids, offsets).sum().backward()
    state = model["bag"].momentum1.clone()
    model.half()
    assert model["bag"].weight.dtype == torch.float16 and model["bag"].momentum1.dtype == torch.float32
    torch.testing.assert_close(model["bag"].momentum1, state, rtol=0, atol=0)
    model["bag"](ids, offsets).sum().backward()
    assert (model["bag"].momentum1 > state).any()


def test_offsets_past_the_end_named_as_given():
    """30/16 (nn surface): the message cited an offsets[2] the user never passed; torch says offsets[-1]."""
    model = nn.ModuleDict({"bag": nn.EmbeddingBag(10, 4, mode="sum")})
    gk.swap(model)
    with pytest.raises(ValueError, match=r"offsets\[-1\] = 5 is greater than input's length 3"):
        model["bag"](torch.tensor([1, 2, 3]), torch.tensor([0, 5]))


# -- optimizer state of nn.EmbeddingBag (issue 24 gk.swap 4) ----------------------------------------

@pytest.mark.parametrize("rule", [gk.optim.ExactRowwiseAdagrad(lr=0.1), gk.optim.ExactAdam(lr=0.05)])
def test_embedding_bag_optimizer_state_survives_a_checkpoint(rule):
    """24/swap-4: the fused state (momentum, step) lived in non-persistent buffers with no
    optimizer_state_dict(), so a checkpoint silently restarted Adagrad/Adam. Resume through
    torch.save(model.state_dict()) + optimizer_state_dict() equals the uninterrupted run."""
    torch.manual_seed(0)
    base = nn.ModuleDict({"bag": nn.EmbeddingBag(30, 4, mode="sum")})
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 30, (12,), generator=g), torch.tensor([0, 3, 7, 7])) for _ in range(4)]

    def steps(model, part):
        for ids, offsets in part:
            (model["bag"](ids, offsets) ** 2).sum().backward()

    straight = copy.deepcopy(base)
    gk.swap(straight, optimizer=rule)
    steps(straight, batches)

    first = copy.deepcopy(base)
    gk.swap(first, optimizer=rule)
    steps(first, batches[:2])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "fused": first["bag"].optimizer_state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = copy.deepcopy(base)
    gk.swap(resumed, optimizer=rule)
    resumed.load_state_dict(saved["model"])
    resumed["bag"].load_optimizer_state_dict(saved["fused"])
    steps(resumed, batches[2:])
    torch.testing.assert_close(resumed["bag"].weight, straight["bag"].weight, rtol=0, atol=0)
    torch.testing.assert_close(resumed["bag"].momentum1, straight["bag"].momentum1, rtol=0, atol=0)
    with pytest.raises(TypeError, match="optimizer_state_dict"):
        resumed["bag"].load_optimizer_state_dict(None)


# -- the reference backend must not be silent (issue 24 gk.swap 6) ----------------------------------

def test_reference_fallback_is_visible(monkeypatch):
    """24/swap-6: with the extension missing, `auto` ran the reference backend silently. Now:
    SwapReport.notes, a one-time RuntimeWarning, and `python -m gem_kernels info` say so."""
    real = _backend.unavailable_reason
    monkeypatch.setattr(_backend, "unavailable_reason",
                        lambda name: "gem_kernels._C failed to import (test)" if name == "cpu" else real(name))
    monkeypatch.setattr(gk_embedding_bag, "_REFERENCE_WARNED", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = gk.swap(nn.ModuleDict({"bag": nn.EmbeddingBag(10, 4), "bag2": nn.EmbeddingBag(10, 4)}))
        gk.swap(nn.ModuleDict({"bag": nn.EmbeddingBag(10, 4)}))
    ours = [w for w in caught if "reference" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    assert any("'reference'" in n and "_C failed to import" in n for n in report.notes), report.notes
    assert "note:" in str(report)
    from gem_kernels.__main__ import info

    assert "auto on cpu tensors, embedding_bag: reference  (NOT fused" in info()


def test_swap_tests_run_without_torchrec(tmp_path):
    """24/swap-5: tests/test_swap.py skipped the whole file (nn.EmbeddingBag and MultiheadAttention cases
    too) when torchrec was missing (a module-level importorskip). Run it with torchrec unimportable:
    the torch.nn cases pass, only the TorchRec cases skip."""
    import os
    import subprocess
    import sys

    blocker = tmp_path / "torchrec"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('torchrec blocked by the test')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", os.path.join(root, "tests", "test_swap.py"), "-q", "-p", "no:cacheprovider",
         "-k", "embedding_bag_forward_and_grads and sum-1d or torchrec_dense_modules"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert "1 passed, 3 skipped" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]

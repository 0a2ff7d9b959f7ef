"""gem_kernels._autograd.enable_eager_fast_paths: an eager call on plain CPU tensors runs the op's body
directly (inside a torch.autograd.Function when a gradient is needed), skipping the dispatcher's two
Python crossings; every other call keeps the dispatcher path. These tests pin which path runs when, and
that both give the same bits: outputs and every gradient."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch
from torch._library.custom_ops import OPDEFS, CustomOpDef
from torch._subclasses.fake_tensor import FakeTensorMode

import gem_kernels as gk
from gem_kernels import _autograd
from gem_kernels.ops import hstu_layer as hstu_ops
from gem_kernels.ops import jagged as jagged_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Under GK_CUDA_EMU=1 the cpu backend runs the CUDA kernels' code, whose bias-gradient sums use atomics:
# not bit-identical run to run even on one path (measured: pos/time bias gradients 4.8e-7 apart between
# two runs of the same path), so there the two paths are held to a tolerance; the C++ CPU kernels and
# the reference backend are deterministic, so everywhere else to the bit.
CUDA_EMU = os.environ.get("GK_CUDA_EMU") == "1"


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    if CUDA_EMU:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(a, b)


class PassThroughMode(torch.overrides.TorchFunctionMode):
    """Changes nothing, but under it every gem_kernels op takes the dispatcher path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _node_names(t: torch.Tensor) -> set[str]:
    """The class names of every node of t's autograd graph."""
    seen, names, stack = set(), set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_which_ops_have_the_fast_path():
    fast = {n for n, op in OPDEFS.items() if isinstance(op, _autograd._EagerFastOp)}
    ours = {n for n, op in OPDEFS.items() if op._namespace == "gem_kernels"}
    # the model's ops, forward and backward
    for name in ("jagged_attention_fwd", "jagged_attention_bwd", "hstu_uvqk_fwd", "hstu_uvqk_bwd", "hstu_output_fwd",
                 "hstu_output_bwd", "embedding_bag", "fm_compress", "fm_compress_backward", "feature_mix_norm",
                 "feature_mix_norm_backward", "cross_layer", "dot_interaction", "jagged_to_padded"):
        assert f"gem_kernels::{name}" in fast
    # so do the ops that mutate an argument (their natives' schemas declare it: the versions are bumped)
    for name in ("embedding_bag_backward_fused", "zch_remap", "zch_embedding_bag_forward"):
        assert OPDEFS[f"gem_kernels::{name}"]._opoverload._schema.is_mutable
        assert f"gem_kernels::{name}" in fast
    assert fast <= ours
    # still the same op objects: isinstance, opcheck and register_fake see a CustomOpDef
    assert all(isinstance(OPDEFS[n], CustomOpDef) for n in fast)


def _hstu_inputs(requires_grad=True):
    gen = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 5, 5, 12, 20])
    n, dim, heads, ld, ad, max_len = 20, 16, 2, 8, 8, 8
    x = torch.randn(n, dim, generator=gen)
    weights = dict(input_norm_weight=1 + 0.1 * torch.randn(dim, generator=gen),
                   input_norm_bias=0.1 * torch.randn(dim, generator=gen),
                   uvqk_weight=0.2 * torch.randn(dim, heads * (2 * ld + 2 * ad), generator=gen),
                   uvqk_bias=0.1 * torch.randn(heads * (2 * ld + 2 * ad), generator=gen),
                   output_norm_weight=1 + 0.1 * torch.randn(heads * ld, generator=gen),
                   output_norm_bias=0.1 * torch.randn(heads * ld, generator=gen),
                   output_weight=0.2 * torch.randn(3 * heads * ld, dim, generator=gen),
                   output_bias=0.1 * torch.randn(dim, generator=gen),
                   pos_bias=0.1 * torch.randn(heads, 2 * max_len - 1, generator=gen),
                   time_bias=0.1 * torch.randn(heads, 6, generator=gen))
    leaves = [x, *weights.values()]
    for t in leaves:
        t.requires_grad_(requires_grad)
    timestamps = torch.randint(0, 1000, (n,), generator=gen)
    kwargs = dict(weights, num_heads=heads, linear_dim=ld, attention_dim=ad, contextual_len=1,
                  timestamps=timestamps)
    return leaves, (x, offsets, max_len, torch.tensor([2, 0, 3, 1])), kwargs


def _run_hstu_layer(backend):
    leaves, args, kwargs = _hstu_inputs()
    out = hstu_ops.hstu_layer(*args, **kwargs, backend=backend)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    return out, grads, _node_names(out)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_fast_path_equals_the_dispatcher_path_bit_for_bit(backend):
    out, grads, names = _run_hstu_layer(backend)
    with _autograd.dispatcher_path_only():
        out_d, grads_d, names_d = _run_hstu_layer(backend)
    # the eager run took the fast path: the whole layer in one node; the other the dispatcher's three ops
    assert names == {"_HSTULayerNodeBackward", "AccumulateGrad"}
    assert {"LeanFor_gem_kernels_hstu_uvqk_fwdBackward", "LeanFor_gem_kernels_jagged_attention_fwdBackward",
            "LeanFor_gem_kernels_hstu_output_fwdBackward"} <= names_d
    assert not any(n.startswith("EagerFor_") for n in names_d)
    _assert_same(out, out_d)
    for g, g_d in zip(grads, grads_d):
        _assert_same(g, g_d)


def _run_hstu_module(backend, dropout, x_requires_grad):
    torch.manual_seed(0)
    layer = gk.nn.HSTULayer(16, 2, 8, 4, contextual_len=1, max_seq_len=8, num_time_buckets=5, dropout=dropout,
                            silu_qkv=False, concat_u=True, concat_x=True, output_bias=False, backend=backend)
    with torch.no_grad():
        for p in layer.parameters():  # away from the init's zeros and ones, so every gradient is checked
            p.add_(0.1 * torch.randn(p.shape))
    gen = torch.Generator().manual_seed(1)
    offsets = torch.tensor([0, 5, 5, 12, 20])
    x = torch.randn(20, 16, generator=gen).requires_grad_(x_requires_grad)
    timestamps = torch.randint(0, 1000, (20,), generator=gen)
    out = layer(x, offsets, 8, num_targets=torch.tensor([2, 0, 3, 1]), timestamps=timestamps)
    if dropout == 0.0:  # without a gradient (no node): the same output
        with torch.no_grad():
            assert torch.equal(layer(x, offsets, 8, num_targets=torch.tensor([2, 0, 3, 1]), timestamps=timestamps),
                               out)
    leaves = ([x] if x_requires_grad else []) + list(layer.parameters())
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum(), leaves)
    if dropout == 0.0:  # two backwards accumulated into .grad: a gradient aliasing another would change
        for _ in range(2):
            layer(x, offsets, 8, num_targets=torch.tensor([2, 0, 3, 1]), timestamps=timestamps).sum().backward()
        grads = grads + tuple(p.grad for p in layer.parameters())
    return out, grads, _node_names(out)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_hstu_module_fast_path_equals_the_dispatcher_path(backend, dropout, x_requires_grad):
    # gk.nn.HSTULayer hands the op its nn.Linear weights as they are: the fast path's one node reads them
    # transposed and returns their gradients in their layout, the dispatcher path transposes them (two
    # TBackward nodes) and runs the three ops. Same dropout mask (same seed), same bits.
    out, grads, names = _run_hstu_module(backend, dropout, x_requires_grad)
    with _autograd.dispatcher_path_only():
        out_d, grads_d, names_d = _run_hstu_module(backend, dropout, x_requires_grad)
    assert names == {"_HSTULayerNodeBackward", "AccumulateGrad"}
    assert "TBackward0" in names_d and "LeanFor_gem_kernels_hstu_uvqk_fwdBackward" in names_d
    _assert_same(out, out_d)
    assert len(grads) == len(grads_d)
    for g, g_d in zip(grads, grads_d):
        assert g.shape == g_d.shape
        _assert_same(g, g_d)


def test_hstu_fast_path_checks_like_the_dispatcher_path():
    # bad input raises the same ValueError, naming the argument, on both paths (the fast path checks the
    # attention's arguments before it computes q, k and v)
    leaves, args, kwargs = _hstu_inputs()
    x, offsets, max_len, num_targets = args
    bad_calls = [
        (dict(num_targets=torch.tensor([1, 2])), "num_targets must have B = 4 elements"),
        (dict(num_targets=torch.tensor([2, 0, 9, 1])), "num_targets[2] must be in [0, 7]"),
        (dict(offsets=torch.tensor([0, 5, 4, 12, 20])), "seq_offsets must be nondecreasing"),
        (dict(offsets=torch.tensor([0, 5, 5, 12, 20], dtype=torch.float32)), "seq_offsets must have dtype"),
        (dict(max_len=6, pos_bias=None), "max_seq_len must be >= every sequence length, got 6 < 8"),
        (dict(timestamps=torch.zeros(19, dtype=torch.int64)), "timestamps must have N = 20 elements"),
        (dict(pos_bias=torch.zeros(2, 9)), "pos_bias.shape[1] must be 2 * max_seq_len - 1 = 15"),
        (dict(uvqk_weight=torch.zeros(16, 31)), "uvqk_weight must have shape"),
    ]
    for change, message in bad_calls:
        call_args = dict(offsets=offsets, max_len=max_len, num_targets=num_targets)
        call_kwargs = dict(kwargs)
        for key, value in change.items():
            (call_args if key in call_args else call_kwargs)[key] = value
        for dispatcher in (False, True):
            with (_autograd.dispatcher_path_only() if dispatcher else contextlib.nullcontext()):
                with pytest.raises(ValueError, match=re.escape(message)):
                    hstu_ops.hstu_layer(x, call_args["offsets"], call_args["max_len"], call_args["num_targets"],
                                        **call_kwargs, backend="cpu")


def test_interaction_and_embedding_bag_fast_path_equal_the_dispatcher_path():
    gen = torch.Generator().manual_seed(1)

    def run():
        x = torch.randn(6, 5, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
        y = torch.randn(5, 3, generator=torch.Generator().manual_seed(3), requires_grad=True)
        lw, lb = torch.ones(15, requires_grad=True), torch.zeros(15, requires_grad=True)
        fm = gk.fm_compress(x, y, lw, lb, 1e-5, backend="cpu")
        mix = torch.randn(4, 5, generator=torch.Generator().manual_seed(4), requires_grad=True)
        nw, nb = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
        out = gk.feature_mix_norm(x, mix, None, nw, nb, 1e-5, backend="cpu")
        w = torch.randn(10, 4, generator=torch.Generator().manual_seed(5), requires_grad=True)
        tables = gk.TableMeta(torch.tensor([0]), torch.tensor([0, 4]), torch.tensor([0, 10]))
        bag = gk.embedding_bag(w.view(-1), tables, torch.tensor([1, 2, 9, 2]), torch.tensor([0, 1, 4]), None,
                               output_dim=4, backend="cpu")
        loss = fm.square().sum() + out.square().sum() + bag.square().sum()
        leaves = (x, y, lw, lb, mix, nw, nb, w)
        return (fm, out, bag), torch.autograd.grad(loss, leaves), _node_names(loss)

    del gen
    outs, grads, names = run()
    with _autograd.dispatcher_path_only():
        outs_d, grads_d, names_d = run()
    assert {"EagerFor_gem_kernels_fm_compressBackward", "EagerFor_gem_kernels_feature_mix_normBackward",
            "EagerFor_gem_kernels_embedding_bagBackward"} <= names
    assert "LeanFor_gem_kernels_fm_compressBackward" in names_d
    for a, b in zip(outs + grads, outs_d + grads_d):
        _assert_same(a, b)


def _run_wukong_layer(backend, num_in, num_fm_out, num_lcb_out, x_requires_grad):
    torch.manual_seed(3)
    layer = gk.nn.WukongLayer(num_in, num_fm_out, num_lcb_out, 6, fm_rank=3, mlp_hidden=8, backend=backend)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    x = torch.randn(7, num_in, 6, generator=torch.Generator().manual_seed(4)).requires_grad_(x_requires_grad)
    out = layer(x)
    leaves = ([x] if x_requires_grad else []) + list(layer.parameters())
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum(), leaves,
                                allow_unused=True)  # no FM block: its parameters get none on both paths
    # two backwards accumulated into .grad: a gradient aliasing another would be changed by the second
    for _ in range(2):
        (layer(x) * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out, grads + tuple(p.grad for p in layer.parameters()), _node_names(out)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("num_in,num_fm_out,num_lcb_out", [(5, 2, 3), (7, 2, 3), (5, 5, 0), (4, 0, 4), (6, 0, 3)],
                         ids=["identity", "learned_residual", "no_lcb", "no_fm", "no_fm_learned_residual"])
@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_wukong_mix_node_equals_the_dispatcher_path(backend, num_in, num_fm_out, num_lcb_out, x_requires_grad):
    # the fast path builds M = residual + [0; lcb] without autograd inside one node with feature_mix_norm
    # and splits dM in its backward; the dispatcher path records the eye/pad/add and runs the op's node
    out, grads, names = _run_wukong_layer(backend, num_in, num_fm_out, num_lcb_out, x_requires_grad)
    with _autograd.dispatcher_path_only():
        out_d, grads_d, names_d = _run_wukong_layer(backend, num_in, num_fm_out, num_lcb_out, x_requires_grad)
    assert "_WukongMixNormNodeBackward" in names and "LeanFor_gem_kernels_feature_mix_normBackward" not in names
    assert not {"AddBackward0", "ConstantPadNdBackward0"} & names
    assert "LeanFor_gem_kernels_feature_mix_normBackward" in names_d
    if num_lcb_out:
        assert "ConstantPadNdBackward0" in names_d
    # NOTE: the reference backend's matmul folds [B, F, D] differently when its operand requires grad (M does
    # on the dispatcher path, not inside the node): ulps apart there; the C++ kernels to the bit.
    same = _assert_same if backend == "cpu" else torch.testing.assert_close
    same(out, out_d)
    assert len(grads) == len(grads_d)
    for g, g_d in zip(grads, grads_d):
        assert (g is None) == (g_d is None)
        if g is not None:
            assert g.shape == g_d.shape
            same(g, g_d)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_mutating_op_on_the_fast_path_bumps_versions_and_equals_the_dispatcher(backend):
    # the fused embedding-bag backward (row-wise Adagrad in place), called as the autograd backward calls it
    def run():
        gen = torch.Generator().manual_seed(7)
        bag = gk.FusedEmbeddingBag([gk.TableSpec(12, 8), gk.TableSpec(9, 4)], optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1),
                                   backend=backend)
        with torch.no_grad():
            bag.weights.copy_(torch.randn(bag.weights.shape, generator=gen))
        indices = torch.tensor([1, 5, 5, 11, 0, 3, 8, 2])
        offsets = torch.tensor([0, 2, 4, 6, 8])
        version = bag.weights._version
        out = bag(indices, offsets)
        out.square().sum().backward()
        assert bag.weights._version > version
        return out.detach(), bag.weights.detach().clone(), [t.clone() for t in bag.optimizer_state_dict().values()
                                                            if torch.is_tensor(t)]

    out, weights, state = run()
    with _autograd.dispatcher_path_only():
        out_d, weights_d, state_d = run()
    _assert_same(out, out_d)
    _assert_same(weights, weights_d)
    assert len(state) == len(state_d)
    for a, b in zip(state, state_d):
        _assert_same(a, b)


def test_a_torch_function_mode_keeps_the_dispatcher_path():
    values = torch.randn(5, 3, requires_grad=True)
    with PassThroughMode():
        out = gk.jagged_to_padded(values, torch.tensor([0, 2, 5]), 4)
    assert type(out.grad_fn).__name__ == "LeanFor_gem_kernels_jagged_to_paddedBackward"


def test_fake_tensors_autocast_and_no_grad():
    values, offsets = torch.randn(5, 3), torch.tensor([0, 2, 5])
    # FakeTensorMode (torch.compile's and export's tracing): the dispatcher path, fake outputs
    with FakeTensorMode() as mode:
        out = gk.jagged_to_padded(mode.from_tensor(values), mode.from_tensor(offsets), 4)
    assert type(out).__name__ == "FakeTensor" and tuple(out.shape) == (2, 4, 3)
    # autocast: the dispatcher path (its autocast kernel runs the op with autocast off)
    v = values.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gk.jagged_to_padded(v, offsets, 4)
    assert type(out.grad_fn).__name__.startswith("LeanFor_")
    # no gradient needed: the body runs directly, the output needs none
    with torch.no_grad():
        out = gk.jagged_to_padded(v, offsets, 4)
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, jagged_ops.jagged_to_padded_op(values, offsets, 4, 0.0, "cpu"))


def test_compiled_and_eager_agree():
    values, offsets = torch.randn(7, 4), torch.tensor([0, 3, 7])

    def f(v):
        return gk.jagged_to_padded(v, offsets, 5, backend="cpu").square().sum()

    v = values.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(v), v)
    v_c = values.clone().requires_grad_()
    (g_c,) = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(v_c), v_c)
    assert torch.equal(g, g_c)


def test_an_op_without_a_formula_keeps_torchs_refusal():
    # dot_interaction_backward has no backward formula: with a gradient needed, the call stays on the
    # dispatcher path, whose autograd kernel refuses the backward as it always did
    op = OPDEFS["gem_kernels::dot_interaction_backward"]
    assert getattr(op, "_backward_fn", None) is None
    grad_out = torch.randn(3, 6, requires_grad=True)
    out = op(grad_out, torch.randn(3, 4, 5), False, "cpu")
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


def test_bad_input_raises_the_same_on_the_fast_path():
    q = torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match="max_seq_len"):
        gk.jagged_attention(q, q, q, torch.tensor([0, 4]), 2, backend="cpu")


def test_the_environment_switch_turns_it_off():
    code = ("import gem_kernels; from torch._library.custom_ops import OPDEFS; "
            "print(sum(type(o).__name__ == '_EagerFastOp' for o in OPDEFS.values()))")
    env = dict(os.environ, PYTHONPATH=ROOT, GEM_KERNELS_EAGER_FAST="0")
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert off.stdout.strip() == "0"
    env["GEM_KERNELS_EAGER_FAST"] = "1"
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(on.stdout.strip()) >= 20


def _run_wukong_x_grad(backend, dim, fm_rank, dtype, graph):
    """A WukongLayer's x gradient (x a non-leaf) and every parameter's, two backwards accumulated into .grad;
    `graph` "partial" first runs a backward that reaches only the mix node (norm.weight), leaving its x
    gradient in the link, then the full ones. (x is used by the layer only: a third use's gradient would be
    added in another order, ulps apart.)"""
    torch.manual_seed(3)
    layer = gk.nn.WukongLayer(7, 3, 4, dim, fm_rank=fm_rank, mlp_hidden=8, backend=backend).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn(p.shape, dtype=dtype))
    base = torch.randn(9, 7, dim, generator=torch.Generator().manual_seed(4)).to(dtype).requires_grad_()
    x = base * 1.5
    out = layer(x)
    weight = torch.linspace(-1, 1, out.numel(), dtype=dtype).view(out.shape)
    if graph == "partial":
        torch.autograd.grad((out * weight).sum(), [layer.norm.weight], retain_graph=True)
    grads = torch.autograd.grad((out * weight).sum(), [x, base] + list(layer.parameters()), retain_graph=True)
    for _ in range(2):
        (out * weight).sum().backward(retain_graph=True)
    return out, grads + (base.grad,) + tuple(p.grad for p in layer.parameters()), _node_names(out)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dim,fm_rank", [(32, 8), (6, 3)], ids=["rows32", "general"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("graph", ["full", "partial"])
def test_wukong_x_gradient_is_written_once_and_equals_the_dispatcher_path(backend, dim, fm_rank, dtype, graph):
    # the fm_compress node adds its x gradient into the one the mix node left in the layer's WukongXGrad
    # (fm_compress_backward_accumulate); the dispatcher path returns both and the engine adds them
    out, grads, names = _run_wukong_x_grad(backend, dim, fm_rank, dtype, graph)
    with _autograd.dispatcher_path_only():
        out_d, grads_d, names_d = _run_wukong_x_grad(backend, dim, fm_rank, dtype, graph)
    assert "_FmCompressNodeBackward" in names and "_WukongMixNormNodeBackward" in names
    assert "LeanFor_gem_kernels_fm_compressBackward" in names_d
    # NOTE: as test_wukong_mix_node_equals_the_dispatcher_path: the reference's matmuls fold differently
    # when M requires grad (dispatcher path only); the C++ kernels to the bit.
    same = _assert_same if backend == "cpu" else torch.testing.assert_close
    same(out, out_d)
    assert len(grads) == len(grads_d)
    for g, g_d in zip(grads, grads_d):
        assert g is not None and g_d is not None and g.shape == g_d.shape
        same(g, g_d)


@pytest.mark.parametrize("case", ["non_contiguous", "used_again"])
def test_wukong_x_gradient_link_only_where_it_applies(case):
    torch.manual_seed(3)
    layer = gk.nn.WukongLayer(5, 2, 3, 6, fm_rank=3, mlp_hidden=8, backend="cpu")
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(4, 5, 6, generator=gen)
    if case == "non_contiguous":  # both nodes get their own copy of x: not linked, the engine adds
        base = torch.randn(4, 6, 5, generator=gen).transpose(1, 2)

    def run():
        x = base.clone().requires_grad_() if case == "used_again" else base.detach().requires_grad_()
        out = layer(x)
        extra = x.square().sum() if case == "used_again" else 0  # a third gradient for x
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().add(extra).backward()
        return x.grad, _node_names(out)

    grad, names = run()
    with _autograd.dispatcher_path_only():
        grad_d, _ = run()
    assert ("_FmCompressNodeBackward" in names) == (case == "used_again")
    # NOTE: used again, the engine adds x's three gradients in another order than the dispatcher path: ulps
    torch.testing.assert_close(grad, grad_d)
    x = torch.randn(4, 5, 6)  # no gradient for x: nothing to link
    assert "_FmCompressNodeBackward" not in _node_names(layer(x))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("shape", [(9, 7, 32, 8), (5, 4, 6, 3), (0, 3, 32, 8)], ids=["rows32", "general", "empty"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fm_compress_backward_accumulate_adds_like_autograd(backend, shape, dtype):
    from gem_kernels.ops.interaction import (fm_compress_backward_accumulate_op, fm_compress_backward_op,
                                             fm_compress_op)
    B, F, D, k = shape
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(B, F, D, generator=gen).to(dtype), (0.3 * torch.randn(F, k, generator=gen)).to(dtype)
    lw, lb = torch.randn(F * k, generator=gen).to(dtype), torch.randn(F * k, generator=gen).to(dtype)
    g = torch.randn(B, F * k, generator=gen).to(dtype)
    for save in (True, False):
        _out, mean, rstd, products = fm_compress_op(x, y, lw, lb, 1e-5, save, backend)
        dx, dy, dw, db = fm_compress_backward_op(g, x, y, lw, mean, rstd, products, backend)
        prior = torch.randn(B, F, D, generator=gen).to(dtype)
        grad_x = prior.clone()
        rest = fm_compress_backward_accumulate_op(g, x, y, lw, mean, rstd, products, grad_x, backend)
        _assert_same(grad_x, prior + dx)
        for a, b in zip(rest, (dy, dw, db)):
            _assert_same(a, b)
    if backend == "cpu":
        torch.library.opcheck(fm_compress_backward_accumulate_op,
                              (g, x, y, lw, mean, rstd, products, prior.clone(), backend))
        torch.library.opcheck(torch.ops.gem_kernels.fm_compress_backward_accumulate_native.default,
                              (g, x, y, lw, mean, rstd, products, prior.clone()))
        for bad in (prior[:, :-1].clone() if F > 1 else prior.new_empty(B, F + 1, D), prior.double(),
                    prior.transpose(0, 1).contiguous().transpose(0, 1)):
            if bad.shape == x.shape and bad.is_contiguous() and bad.dtype == x.dtype:
                continue
            with pytest.raises(ValueError, match="grad_x must be a contiguous tensor of x's shape"):
                fm_compress_backward_accumulate_op(g, x, y, lw, mean, rstd, products, bad, backend)

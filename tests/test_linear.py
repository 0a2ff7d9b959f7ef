"""gem_kernels.linear (nn.Linear + bias + ReLU, optionally on concat(x, x2) never built) and gk.nn.MLP.

The cpu kernel (fp32) against float64 ground truth by FlashAttention's rule (its error at most twice
eager fp32's), forward and every gradient; the reference twin by gradcheck in fp64; the backward op on
its own against the fp64 reference given the same forward output (so a ReLU mask never differs by a
rounding); empty batches, strided rows, both thread counts, bad input, opcheck; the MLP module."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gem_kernels as gk
from gem_kernels.ops.linear import linear_backward_op, linear_op
from gem_kernels.reference import float64_ground_truth
from gem_kernels.reference import linear as ref
from tests.utils import assert_close, assert_close_vs_eager, poison_allocator, randn_nonzero

CPU = pytest.mark.skipif(gk._backend.unavailable_reason("cpu") is not None, reason="the C++ extension is not built")

# (R, K1, K2, N): odd sizes, one-row and empty batches, a single column, and the GEM model's layers
# (over arch [dense 32 | interactions 512] -> 128, Wukong 80 -> 128 -> 256), and a batch long enough
# that each thread's chunk runs several row blocks (csrc/cpu/linear.cpp block_rows: at most 8192 rows).
SHAPES = [(0, 5, 0, 3), (0, 4, 3, 6), (1, 1, 0, 1), (1, 13, 0, 32), (59, 7, 3, 17), (97, 16, 0, 2),
          (200, 80, 0, 128), (1025, 32, 512, 128), (1025, 128, 0, 256), (2100, 13, 2, 9), (17000, 3, 2, 5)]


def _operands(R, K1, K2, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = randn_nonzero(R, K1, generator=g)
    x2 = randn_nonzero(R, K2, generator=g)
    w = randn_nonzero(N, K1 + K2, generator=g) / (K1 + K2) ** 0.5
    b = randn_nonzero(N, generator=g)
    return x, x2, w, b


def _torch_linear(x, x2, w, b, relu):
    """The plain PyTorch formulation (what nn.Linear + ReLU computes), any dtype, with autograd."""
    out = F.linear(torch.cat([x, x2], dim=1), w, b)
    return torch.relu(out) if relu else out


@CPU
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cpu_forward_and_backward_vs_float64(shape, relu, threads):
    R, K1, K2, N = shape
    x, x2, w, b = _operands(*shape)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        poison_allocator(4 * (R * (N + K1 + K2) + N * (K1 + K2)), "cpu")
        out = linear_op(x, x2, w, b, relu, "cpu")
        grad_out = randn_nonzero(R, N, generator=torch.Generator().manual_seed(1))
        poison_allocator(4 * (R * (N + K1 + K2) + N * (K1 + K2)), "cpu")
        grads = linear_backward_op(grad_out, x, x2, w, out if relu else x.new_empty(0), relu, "cpu")
    finally:
        torch.set_num_threads(previous)
    with float64_ground_truth():
        expected = ref.linear(x.double(), x2.double(), w.double(), b.double(), relu)
        # The backward given the kernel's own forward output, so the ReLU mask is the same on both sides.
        expected_grads = ref.linear_backward(grad_out.double(), x.double(), x2.double(), w.double(), out.double(),
                                             relu)
    eager = _torch_linear(x, x2, w, b, relu)
    assert_close_vs_eager(out, expected, eager, torch.float32, "out")
    g = grad_out.masked_fill(out <= 0, 0) if relu else grad_out
    eager_grads = (g @ w[:, :K1], g @ w[:, K1:], g.t() @ torch.cat([x, x2], 1), g.sum(0))
    for name, got, want, eager_g in zip(("grad_x", "grad_x2", "grad_weight", "grad_bias"), grads, expected_grads,
                                        eager_grads):
        assert got.shape == want.shape, name
        assert_close_vs_eager(got, want, eager_g, torch.float32, name)


@CPU
@pytest.mark.parametrize("relu", [False, True])
def test_autograd_through_the_public_function_equals_torch(relu):
    """gk.linear's gradients (the registered backward) equal torch's Linear + ReLU, for x, x2, weight
    and bias, with x a strided column slice (read in place) and bias None."""
    R, K1, K2, N = 97, 11, 6, 17
    x, x2, w, b = _operands(R, K1, K2, N, seed=3)
    wide_x = randn_nonzero(R, K1 + 5)
    wide_x[:, 2:2 + K1] = x
    x_view = wide_x[:, 2:2 + K1].requires_grad_(False)
    for bias in (b, None):
        leaves = [t.clone().requires_grad_() for t in (x, x2, w)] + ([bias.clone().requires_grad_()] if bias is not None
                                                                     else [])
        xx, xx2, ww = leaves[:3]
        bb = leaves[3] if bias is not None else None
        out = gk.linear(xx, ww, bb, relu=relu, x2=xx2, backend="cpu")
        assert out.shape == (R, N)
        want = _torch_linear(xx, xx2, ww, bb if bb is not None else torch.zeros(N), relu)
        assert_close(out, want)
        grad = randn_nonzero(R, N)
        for got_g, want_g in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(want, leaves, grad)):
            assert_close(got_g, want_g, atol=2e-5, rtol=2e-5)
    assert_close(gk.linear(x_view, w, b, relu=relu, x2=x2, backend="cpu"), _torch_linear(x, x2, w, b, relu))


@pytest.mark.parametrize("relu", [False, True])
def test_reference_gradcheck_float64(relu):
    x, x2, w, b = (t.double().requires_grad_() for t in _operands(7, 4, 3, 5, seed=4))
    with float64_ground_truth():
        assert torch.autograd.gradcheck(lambda *a: gk.linear(a[0], a[2], a[3], relu=relu, x2=a[1],
                                                             backend="reference"), (x, x2, w, b))


@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=CPU), "reference"])
def test_empty_batch(backend):
    """0 rows: an empty output, empty input gradients, zero weight and bias gradients."""
    x, x2, w, b = (t.requires_grad_() for t in _operands(0, 6, 2, 4))
    out = gk.linear(x, w, b, relu=True, x2=x2, backend=backend)
    assert out.shape == (0, 4)
    gx, gx2, gw, gb = torch.autograd.grad(out.sum(), [x, x2, w, b])
    assert gx.shape == (0, 6) and gx2.shape == (0, 2)
    assert torch.equal(gw, torch.zeros(4, 8)) and torch.equal(gb, torch.zeros(4))


@CPU
def test_bad_input_raises_value_errors_naming_the_argument():
    x, x2, w, b = _operands(5, 4, 2, 3)
    with pytest.raises(ValueError, match="x must have 2 dims"):
        gk.linear(x.unsqueeze(0), w, b)
    with pytest.raises(ValueError, match=r"weight must have shape \(N, 6\)"):
        gk.linear(x, w[:, :5].contiguous(), b, x2=x2)
    with pytest.raises(ValueError, match="bias must have shape"):
        gk.linear(x, w, b[:2], x2=x2)
    with pytest.raises(ValueError, match="x2 must have x's 5 rows"):
        gk.linear(x, w, b, x2=x2[:3])
    with pytest.raises(ValueError, match="weight must have x's dtype"):
        gk.linear(x, w.double(), b, x2=x2)
    with pytest.raises(ValueError, match="relu must be a bool"):
        gk.linear(x, w, b, relu=1, x2=x2)
    with pytest.raises(ValueError, match="x must have dtype"):
        gk.linear(x.long(), w, b, x2=x2)
    with pytest.raises(ValueError, match="backend 'cpu' computes float32 only"):
        gk.linear(x.bfloat16(), w.bfloat16(), b.bfloat16(), x2=x2.bfloat16(), backend="cpu")
    with pytest.raises(ValueError, match="float64"):
        gk.linear(x.double(), w.double(), b.double(), x2=x2.double(), backend="cpu")
    # The op itself (what gk.nn.MLP calls): its native kernel checks the operands.
    with pytest.raises(ValueError, match="weight must have 6 columns"):
        linear_op(x, x2, w[:, :5].contiguous(), b, False, "cpu")
    with pytest.raises(ValueError, match="rows must be dense"):
        linear_op(x.t().contiguous().t(), x2, w, b, False, "cpu")
    with pytest.raises(ValueError, match="grad_out must be float32"):
        linear_backward_op(torch.ones(5, 2), x, x2, w, x.new_empty(0), False, "cpu")


def test_other_dtypes_run_the_reference_under_auto():
    x, x2, w, b = (t.bfloat16() for t in _operands(9, 4, 2, 3))
    out = gk.linear(x, w, b, relu=True, x2=x2)
    assert out.dtype == torch.bfloat16
    with float64_ground_truth():
        expected = ref.linear(x.double(), x2.double(), w.double(), b.double(), True)
    assert_close_vs_eager(out, expected, _torch_linear(x, x2, w, b, True), torch.bfloat16, "bf16 out")


@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=CPU), "reference"])
def test_opcheck(backend):
    x, x2, w, b = _operands(6, 5, 3, 4)
    for relu in (False, True):
        args = (x.requires_grad_(), x2.requires_grad_(), w.requires_grad_(), b.requires_grad_())
        torch.library.opcheck(linear_op, (*args, relu, backend))
        out = linear_op(*(a.detach() for a in args), relu, backend)
        torch.library.opcheck(linear_backward_op, (randn_nonzero(6, 4), x.detach(), x2.detach(), w.detach(),
                                                   out if relu else x.new_empty(0), relu, backend))


# ------------------------------------------------------------------------------------------ gk.nn.MLP


def test_mlp_keeps_sequential_children_and_state_dict_keys():
    torch.manual_seed(0)
    mlp = gk.nn.MLP([6, 5, 4], final_activation=True)
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 4), nn.ReLU(inplace=True))
    assert list(mlp.state_dict()) == list(seq.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for k, v in seq.state_dict().items():
        assert torch.equal(mlp.state_dict()[k], v)
    mlp.load_state_dict(seq.state_dict())
    moved = gk.nn.MLP.from_sequential(seq)
    assert all(a is b for a, b in zip(moved.parameters(), seq.parameters()))


@CPU
@pytest.mark.parametrize("final_activation", [False, True])
@pytest.mark.parametrize("with_x2", [False, True])
def test_mlp_fused_equals_its_children(final_activation, with_x2):
    """The fused forward (one gk.linear per Linear and its ReLU) equals the children's run on
    concat(x, x2), output and every gradient, and it does run the op (not the children)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    mlp = gk.nn.MLP([10, 9, 7, 3], final_activation=final_activation)
    x = randn_nonzero(131, 6).requires_grad_()
    x2 = randn_nonzero(131, 4).requires_grad_() if with_x2 else None
    inputs = [x] + ([x2] if with_x2 else []) + list(mlp.parameters())

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    got = mlp((x, x2)) if with_x2 else mlp(torch.cat([x, randn_nonzero(131, 4)], 1))
    grad = randn_nonzero(*got.shape)
    got_grads = torch.autograd.grad(got, inputs, grad, allow_unused=True)
    mlp.backend = "reference"
    want = mlp((x, x2)) if with_x2 else None
    if with_x2:
        plain = nn.Sequential(*mlp)(torch.cat([x, x2], 1))
        assert_close(want, plain)
        assert_close(got, want)
        for g_got, g_want in zip(got_grads, torch.autograd.grad(want, inputs, grad)):
            assert_close(g_got, g_want, atol=2e-5, rtol=2e-5)
    mlp.backend = None
    with Ops() as ops:  # under a dispatch mode the op goes through the dispatcher: its name shows
        mlp((x, x2)) if with_x2 else mlp(torch.cat([x, randn_nonzero(131, 4)], 1))
    assert ops.names.count("gem_kernels::linear") == 3
    assert not any(n in ops.names for n in ("aten::addmm", "aten::relu_"))


@CPU
def test_mlp_runs_its_children_where_it_cannot_fuse():
    """Forward hooks on a child, autocast, a 3-D input, float64 and backend="reference" run the children
    as nn.Sequential does (the hook fires, the dtype is autocast's)."""
    torch.manual_seed(0)
    mlp = gk.nn.MLP([4, 3, 2], final_activation=True)
    x = randn_nonzero(5, 4)
    seen = []
    handle = mlp[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    mlp(x)
    assert seen == [(5, 3)]
    handle.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mlp(x).dtype == torch.bfloat16
    assert mlp(x.unsqueeze(0)).shape == (1, 5, 2)
    with_dropout = gk.nn.MLP.from_sequential(nn.Sequential(mlp[0], nn.Dropout(0.0), nn.ReLU()))
    assert_close(with_dropout(x), torch.relu(mlp[0](x)))
    assert mlp.double()(x.double()).dtype == torch.float64


@CPU
def test_wukong_backend_reaches_its_mlp():
    layer = gk.nn.WukongLayer(3, 2, 1, 4, fm_rank=2, mlp_hidden=[5])
    assert layer.fm_mlp.backend is None
    stack = gk.nn.WukongStack(2, 3, 2, 1, 4, 2, 5, backend="reference")
    assert all(l.fm_mlp.backend == "reference" for l in stack.layers)
    stack.backend = "cpu"
    assert all(l.fm_mlp.backend == "cpu" for l in stack.layers)


def test_flops_counts_the_matmuls():
    from gem_kernels import flops

    fwd, fwd_bytes = flops.linear(10, 6, 4, 4)
    assert fwd == 2 * 10 * 6 * 4 + 10 * 4 and fwd_bytes == (10 * 6 + 4 * 6 + 4 + 10 * 4) * 4
    both, _ = flops.linear(10, 6, 4, 4, relu=True, backward=True)
    assert both == 3 * 2 * 10 * 6 * 4 + 4 * 10 * 4


def test_mlp_traces_with_torch_fx_as_root_and_as_a_child():
    """gk.nn.MLP takes one input (a tensor or a pair (x, x2)), as nn.Sequential does: with a second,
    defaulted argument, symbolic_trace of an MLP as the root traced the pair form and the GraphModule
    failed when called with one tensor. Both forms trace and compute what the module computes."""
    torch.manual_seed(0)
    mlp = gk.nn.MLP([6, 5, 3], final_activation=True)
    x = torch.randn(7, 6)
    gm = torch.fx.symbolic_trace(mlp)
    torch.testing.assert_close(gm(x), mlp(x))

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = mlp

        def forward(self, a, b):
            return self.mlp((a, b))

    parent = Parent()
    a, b = torch.randn(7, 4), torch.randn(7, 2)
    gm = torch.fx.symbolic_trace(parent)
    torch.testing.assert_close(gm(a, b), parent(a, b))
    torch.testing.assert_close(parent(a, b), mlp(torch.cat([a, b], 1)))
    with pytest.raises(ValueError, match="pair"):
        mlp((a, b, b))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_relu_mask_passes_the_gradient_of_a_nan_output_like_torch(backend):
    """ReLU's backward as torch's threshold_backward: no gradient where out <= 0, and a NaN output (a NaN
    in its input row) passes its gradient on; the cpu kernel's first mask zeroed it (out > 0 is false for
    NaN), so that row's grad_x and the bias gradient differed from nn.Linear + ReLU."""
    torch.manual_seed(0)
    x = torch.randn(9, 5)
    x[3, 1] = float("nan")
    w, b = torch.randn(4, 5), torch.randn(4)
    g = torch.randn(9, 4)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    out = gk.linear(*leaves, relu=True, backend=backend)
    got = torch.autograd.grad(out, leaves, g)
    eager = [t.clone().requires_grad_() for t in (x, w, b)]
    want = torch.autograd.grad(F.relu(F.linear(*eager)), eager, g)
    assert out[3].isnan().all()
    for name, a, e in zip(("grad_x", "grad_weight", "grad_bias"), got, want):
        torch.testing.assert_close(a, e, equal_nan=True, rtol=1e-5, atol=1e-5, msg=name)
    assert got[0][3].isfinite().all() and got[0][3].abs().sum() > 0

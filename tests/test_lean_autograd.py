"""gem_kernels._autograd.register_autograd: our ops' Autograd kernel, in place of torch's generated one.

torch's kernel refills the schema's defaults on every forward with grad (quadratic in the argument
count: tens to hundreds of microseconds per call of our ops, see the module). These tests pin that
ours runs instead, and that it keeps torch's behaviour: gradients, no-grad calls, needs_input_grad,
and the check of the formula's gradient count.
"""

from __future__ import annotations

import pytest
import torch
import torch._library.autograd as torch_autograd_impl

import gem_kernels as gk
from gem_kernels import _autograd
from gem_kernels.ops import attention as attention_ops
from gem_kernels.ops import hstu_layer as hstu_ops
from gem_kernels.ops import interaction as interaction_ops
from gem_kernels.ops import jagged as jagged_ops
from gem_kernels.ops import embedding_bag as embedding_bag_ops

LEAN_OPS = [attention_ops.jagged_attention_fwd_op, hstu_ops.hstu_uvqk_fwd_op, hstu_ops.hstu_output_fwd_op,
            interaction_ops.dot_interaction_op, interaction_ops.cross_layer_op, interaction_ops.fm_compress_op,
            interaction_ops.feature_mix_norm_op, embedding_bag_ops.embedding_bag_op, jagged_ops.jagged_to_padded_op,
            jagged_ops.padded_to_jagged_op, jagged_ops.jagged_to_padded_backward_op,
            jagged_ops.padded_to_jagged_backward_op]


@pytest.fixture
def no_torch_refill(monkeypatch):
    """torch's generated Autograd kernel calls utils.fill_defaults on every forward with grad."""
    def refill(*args, **kwargs):
        raise AssertionError("torch's generated Autograd kernel ran (fill_defaults)")
    monkeypatch.setattr(torch_autograd_impl.utils, "fill_defaults", refill)


@pytest.mark.parametrize("op", LEAN_OPS, ids=lambda op: op._name)
def test_every_autograd_op_takes_the_lean_kernel(op):
    assert _autograd._lean_ok(op._opoverload._schema)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_attention_grads_through_the_lean_kernel(no_torch_refill, backend):
    gen = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 3, 3, 8])
    q, k, v = (torch.randn(8, 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    out = gk.jagged_attention(q, k, v, offsets, 5, kind="softmax", causal=True, backend=backend)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    # the same maths, per sequence, in plain torch and fp64
    want = []
    q64, k64, v64 = q.double(), k.double(), v.double()
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        s = torch.einsum("ihd,jhd->hij", q64[a:b], k64[a:b]) / 8 ** 0.5
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        want.append(torch.einsum("hij,jhd->ihd", s.softmax(-1), v64[a:b]))
    want_grads = torch.autograd.grad(torch.cat(want).square().sum(), (q, k, v))
    torch.testing.assert_close(out, torch.cat(want).float(), rtol=1e-4, atol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_needs_input_grad_and_no_grad(no_torch_refill):
    values = torch.randn(5, 3)
    offsets = torch.tensor([0, 2, 5])
    with torch.no_grad():
        padded = gk.jagged_to_padded(values.requires_grad_(), offsets, 4)
    assert not padded.requires_grad
    padded = gk.jagged_to_padded(values, offsets, 4)
    (grad,) = torch.autograd.grad(padded.sum(), values)
    torch.testing.assert_close(grad, torch.ones_like(values))
    # an input that needs no gradient gets None from the formula (embedding bag: weights frozen,
    # per-sample weights trained; its formula reads ctx.needs_input_grad[0] and [9])
    weights = torch.randn(6, 4)
    psw = torch.rand(5, requires_grad=True)
    tables = gk.TableMeta(torch.tensor([0]), torch.tensor([0, 4]), torch.tensor([0, 6]))
    out = gk.embedding_bag(weights.view(-1), tables, torch.tensor([0, 1, 5, 2, 2]), torch.tensor([0, 2, 5]), psw,
                           output_dim=4, backend="reference")
    (grad_psw,) = torch.autograd.grad(out.sum(), psw)
    torch.testing.assert_close(grad_psw, weights.view(6, 4)[[0, 1, 5, 2, 2]].sum(1))


def test_a_formula_with_the_wrong_gradient_count_is_an_error():
    @torch.library.custom_op("gem_kernels_test::lean_twice", mutates_args=())
    def twice(x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    twice.register_fake(lambda x, factor: torch.empty_like(x))

    def setup(ctx, inputs, output):
        ctx.factor = inputs[1]

    def backward(ctx, grad):
        return grad * ctx.factor  # one gradient for two inputs

    _autograd.register_autograd(twice, backward, setup_context=setup)
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="returned 1 gradients, expected 2"):
        twice(x, 2.0).sum().backward()


class PassThroughMode(torch.overrides.TorchFunctionMode):
    """A TorchFunctionMode that changes nothing: under it every gem_kernels op takes the dispatcher path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_graph_node_names_its_op():
    # a profile of the backward tells the ops apart (one shared class name would not): the dispatcher
    # path's node (here under a TorchFunctionMode, which keeps the op on it) and the eager fast path's
    values = torch.randn(5, 3, requires_grad=True)
    with PassThroughMode():
        padded = gk.jagged_to_padded(values, torch.tensor([0, 2, 5]), 4)
    assert type(padded.grad_fn).__name__ == "LeanFor_gem_kernels_jagged_to_paddedBackward"
    padded = gk.jagged_to_padded(values, torch.tensor([0, 2, 5]), 4)
    assert type(padded.grad_fn).__name__ == "EagerFor_gem_kernels_jagged_to_paddedBackward"

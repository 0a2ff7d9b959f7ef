"""gem_kernels.nn.JaggedMultiheadAttention and HSTULayer: shapes, gradients, backend switch."""

import pytest
import torch

import gem_kernels as gk
from gem_kernels.ops.attention import IMPLEMENTED

from .utils import offsets_from_lengths

BACKENDS = tuple(b for b in IMPLEMENTED if b != "reference" and b in gk.available_backends())


def _batch(lengths, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(lengths)
    n = int(offsets[-1])
    x = torch.randn(n, dim, generator=g).requires_grad_(True)
    timestamps = torch.randint(0, 10_000, (n,), generator=g)
    return x, offsets, timestamps


def _modules(backend):
    torch.manual_seed(0)
    mha = gk.nn.JaggedMultiheadAttention(16, 2, kind="softmax", max_seq_len=12, num_time_buckets=6, backend=backend)
    hstu = gk.nn.HSTULayer(16, 2, linear_dim=8, attention_dim=4, max_seq_len=12, num_time_buckets=6,
                           contextual_len=1, max_attn_len=5, backend=backend)
    for module in (mha, hstu):  # nonzero biases, so their gradients and effect are exercised
        with torch.no_grad():
            module.bias.pos_bias.normal_()
            module.bias.time_bias.normal_()
    return mha, hstu


@pytest.mark.parametrize("backend", BACKENDS)
def test_modules_match_reference_backend(backend):
    x, offsets, timestamps = _batch([5, 0, 12, 1], 16)
    targets = torch.tensor([1, 0, 3, 0])
    for module, module_ref in zip(_modules(backend), _modules("reference")):
        y = module(x, offsets, 12, num_targets=targets, timestamps=timestamps)
        y_ref = module_ref(x, offsets, 12, num_targets=targets, timestamps=timestamps)
        assert y.shape == x.shape
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        grads = torch.autograd.grad(y.square().sum(), [x, *module.parameters()])
        grads_ref = torch.autograd.grad(y_ref.square().sum(), [x, *module_ref.parameters()])
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-4)
        assert all(float(g.abs().sum()) > 0 for g in grads)


def test_hstu_layer_is_residual_and_validates():
    x, offsets, _ = _batch([3, 4], 8)
    layer = gk.nn.HSTULayer(8, 2, linear_dim=4, attention_dim=4)
    with torch.no_grad():
        layer.out.weight.zero_()
        layer.out.bias.zero_()
    torch.testing.assert_close(layer(x, offsets, 4), x)
    mha = gk.nn.JaggedMultiheadAttention(8, 2, max_seq_len=4, num_time_buckets=3)
    with pytest.raises(ValueError, match="max_seq_len must be 4"):
        mha(x, offsets, 5)
    with pytest.raises(ValueError, match="timestamps must be given"):
        mha(x, offsets, 4)
    with pytest.raises(ValueError, match="embed_dim must be divisible"):
        gk.nn.JaggedMultiheadAttention(10, 3)


def test_empty_batch():
    x, offsets, _ = _batch([], 8)
    layer = gk.nn.HSTULayer(8, 2, linear_dim=4, attention_dim=4)
    assert layer(x, offsets, 0).shape == (0, 8)

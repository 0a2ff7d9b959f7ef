"""torch.autocast: the product-type ops cast their floating-point operands to the autocast dtype
(gem_kernels/_autocast.py), so a model's fp32 parameters meet its lower-precision activations
without failing the same-dtype checks. Under autocast each op must give exactly what it gives on
explicitly cast operands, and fp32 parameters must get fp32 gradients (the cast's gradient)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import gem_kernels as gk

from .utils import device_backend_params, offsets_from_lengths, reference_params


def _leaf(*shape, device, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g) * scale).to(device).requires_grad_(True)


def _cases(device):
    """name -> (fn(*leaves, backend), fp32 leaves, names of leaves autocast leaves alone)."""
    offsets = offsets_from_lengths([5, 0, 9], device=device)
    timestamps = (torch.arange(14, dtype=torch.int64) ** 2).to(device)

    def attention(q, k, v, pos_bias, time_bias, backend):
        return gk.jagged_attention(q, k, v, offsets, 9, pos_bias=pos_bias, time_bias=time_bias,
                                   timestamps=timestamps, deterministic=True, backend=backend)

    return {
        "dot_interaction": (lambda x, backend: gk.dot_interaction(x, backend=backend),
                            [_leaf(3, 5, 8, device=device)], ()),
        "cross_layer": (lambda x0, xl, w, b, backend: gk.cross_layer(x0, xl, w, b, backend=backend),
                        [_leaf(4, 12, device=device), _leaf(4, 12, device=device, seed=1),
                         _leaf(12, 12, device=device, scale=0.3), _leaf(12, device=device, scale=0.1)], ()),
        "cross_layer low rank": (lambda x0, xl, u, v, b, backend: gk.cross_layer(x0, xl, (u, v), b, backend=backend),
                                 [_leaf(4, 12, device=device), _leaf(4, 12, device=device, seed=1),
                                  _leaf(12, 3, device=device, scale=0.5), _leaf(3, 12, device=device, scale=0.3),
                                  _leaf(12, device=device, scale=0.1)], ()),
        "fm_compress": (lambda x, y, w, b, backend: gk.fm_compress(x, y, w, b, backend=backend),
                        [_leaf(3, 5, 8, device=device), _leaf(5, 2, device=device, scale=0.5),
                         _leaf(10, device=device, scale=0.1, seed=1), _leaf(10, device=device, scale=0.1)], ()),
        "feature_mix_norm": (lambda x, mix, fm, w, b, backend: gk.feature_mix_norm(x, mix, fm, w, b, backend=backend),
                             [_leaf(3, 5, 8, device=device), _leaf(4, 5, device=device, scale=0.5),
                              _leaf(3, 2, 8, device=device, seed=1), _leaf(8, device=device, scale=0.1, seed=1),
                              _leaf(8, device=device, scale=0.1)], ()),
        "jagged_attention": (attention,
                             [_leaf(14, 2, 8, device=device), _leaf(14, 2, 8, device=device, seed=1),
                              _leaf(14, 2, 8, device=device, seed=2), _leaf(2, 17, device=device, scale=0.5),
                              _leaf(1, 9, device=device, scale=0.5)], (3, 4)),  # the biases stay fp32
    }


# Not a comparison with the reference: each backend under autocast against itself on cast operands,
# so the reference backend runs here too.
_PAIRS = reference_params() + device_backend_params()
AMP_PARAMS = [pytest.param(d, b, torch.bfloat16, marks=p.marks, id=f"{p.id}-bf16")
              for p in _PAIRS for d, b in [p.values]]
AMP_PARAMS += [pytest.param(d, b, torch.float16, marks=p.marks, id=f"{p.id}-fp16")
               for p in _PAIRS for d, b in [p.values] if d == "cuda"]


@pytest.mark.parametrize("device,backend,amp_dtype", AMP_PARAMS)
@pytest.mark.parametrize("name", ["dot_interaction", "cross_layer", "cross_layer low rank", "fm_compress",
                                  "feature_mix_norm", "jagged_attention"])
def test_autocast_casts_operands(device, backend, amp_dtype, name):
    fn, leaves, kept = _cases(device)[name]
    with torch.autocast(device, dtype=amp_dtype):
        out = fn(*leaves, backend=backend)
    assert out.dtype == amp_dtype
    cast = [t.detach().clone().requires_grad_(True) if i in kept else
            t.detach().to(amp_dtype).requires_grad_(True) for i, t in enumerate(leaves)]
    expected = fn(*cast, backend=backend)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out)
    out.backward(grad)
    expected.backward(grad)
    for i, (leaf, ref) in enumerate(zip(leaves, cast)):
        assert leaf.grad is not None and leaf.grad.dtype == torch.float32, i
        # Same bits, cast back to fp32 (bias gradients: fixed-order reduction, deterministic=True).
        torch.testing.assert_close(leaf.grad, ref.grad.float(), rtol=0, atol=0, msg=f"operand {i}")


def test_outside_autocast_nothing_is_cast():
    fn, leaves, _ = _cases("cpu")["fm_compress"]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert fn(*leaves, backend="cpu").dtype == torch.float32
    # Autocast on another device type leaves CPU operands alone.
    with torch.autocast("cuda", dtype=torch.float16, enabled=torch.cuda.is_available()):
        assert fn(*leaves, backend="cpu").dtype == torch.float32


def test_compiled_under_autocast_matches_eager():
    fn, leaves, _ = _cases("cpu")["fm_compress"]
    compiled = torch.compile(lambda *t: fn(*t, backend="cpu"), fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(*leaves)
        expected = fn(*leaves, backend="cpu")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("interaction", ["dot", "wukong"])
@pytest.mark.parametrize("kernels", ["fused", "eager"])
def test_model_trains_under_autocast(interaction, kernels):
    """The GEM-like model under bf16 autocast (the usual way to train it on a GPU): one step with
    finite loss, fp32 gradients for every dense parameter, and the loss within bf16 noise of fp32's."""
    from model import GemConfig, GemModel, SyntheticBatches

    cfg = dataclasses.replace(GemConfig.tiny(), interaction=interaction)
    batch = SyntheticBatches(cfg, 32, seed=0)[0]
    model = GemModel(cfg, kernels=kernels, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(batch)
    loss.backward()
    with torch.no_grad():
        full = GemModel(cfg, kernels=kernels, seed=0).loss(batch)
    loss, full = float(loss.detach()), float(full)
    assert math.isfinite(loss) and abs(loss - full) < 0.02 * abs(full)
    grads = [p.grad for p in model.dense_parameters() if "pos_bias" not in str(p.shape)]
    assert grads and all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("interaction", ["dot", "wukong"])
def test_bf16_autocast_training_decreases_loss(interaction):
    """train_step(amp_dtype=bf16) on the fused kernels learns: fresh batches, judged in fp32 on
    held-out batches."""
    from model import GemConfig, GemModel, SyntheticBatches
    from model.train import train_step

    cfg = dataclasses.replace(GemConfig.tiny(), interaction=interaction)
    model = GemModel(cfg, kernels="fused", seed=0)
    optimizers = model.make_optimizers()
    data = SyntheticBatches(cfg, 64, seed=0)
    held_out = [data.held_out(i) for i in range(4)]
    with torch.no_grad():
        before = sum(float(model.loss(b)) for b in held_out) / 4
    for step in range(30):
        train_step(model, data[step], optimizers, amp_dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        after = sum(float(model.loss(b)) for b in held_out) / 4
    assert after < before - 0.01, (before, after)

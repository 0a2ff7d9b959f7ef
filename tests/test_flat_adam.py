"""model.flat_adam.FlatAdam: torch.optim.Adam(fused=True)'s update and state_dict, one fused call per step."""

import copy

import torch

from model import GemConfig, GemModel, SyntheticBatches
from model.flat_adam import FlatAdam

# Odd sizes (slots padded to 16 elements), a 0-size-tail one (1), small and large ones.
SHAPES = [(32, 13), (100, 50), (32,), (16, 32), (16,), (7, 5, 3), (1,), (64, 33), (70, 70)]


def _pair(shapes=SHAPES, dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
    flat = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    return ref, torch.optim.Adam(ref, fused=True, **kwargs), flat, FlatAdam(flat, **kwargs)


def _grads(params_lists, seed, skip=()):
    gen = torch.Generator().manual_seed(seed)
    grads = [None if i in skip else torch.randn(p.shape, generator=gen, dtype=p.dtype)
             for i, p in enumerate(params_lists[0])]
    for params in params_lists:
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()


def _assert_same(ref, flat, ref_opt, flat_opt):
    # Not bit for bit: an element in the vector loop of one call can be in the scalar tail of another
    # (measured: exp_avg_sq 1 ulp apart on tails, the parameters equal).
    for p, q in zip(ref, flat):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    a, b = ref_opt.state_dict(), flat_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for k in a["state"][i]:
            torch.testing.assert_close(b["state"][i][k], a["state"][i][k], rtol=1e-6, atol=1e-9)


def test_flat_adam_equals_fused_adam_and_takes_the_flat_path():
    ref, ref_opt, flat, flat_opt = _pair(lr=3e-3, weight_decay=0.01)
    for step in range(6):
        _grads([ref, flat], step)
        ref_opt.step()
        flat_opt.step()
        assert flat_opt._state_views is not None  # the one-call path ran
        ref_opt.zero_grad()
        flat_opt.zero_grad()
        _assert_same(ref, flat, ref_opt, flat_opt)


def test_flat_adam_state_dict_loads_both_ways():
    ref, ref_opt, flat, flat_opt = _pair(lr=1e-2)
    for step in range(3):
        _grads([ref, flat], step)
        ref_opt.step()
        flat_opt.step()
    # Each optimizer continues from the other's state_dict (model.train's checkpoints either way).
    flat2 = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    flat2_opt = FlatAdam(flat2, lr=1e-2)
    flat2_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    ref2 = [torch.nn.Parameter(p.detach().clone()) for p in flat]
    ref2_opt = torch.optim.Adam(ref2, lr=1e-2, fused=True)
    ref2_opt.load_state_dict(copy.deepcopy(flat_opt.state_dict()))
    for step in range(3, 6):
        _grads([ref, flat2, flat, ref2], step)
        for opt in (ref_opt, flat2_opt, flat_opt, ref2_opt):
            opt.step()
        assert flat2_opt._state_views is not None
    _assert_same(ref, flat2, ref_opt, flat2_opt)
    _assert_same(ref2, flat, ref2_opt, flat_opt)


def test_flat_adam_falls_back_to_torch_where_the_flat_path_does_not_apply():
    """A missing gradient (that parameter keeps its value and its step count, as torch's), then step
    counters that differ, then parameters moved off the flat buffer (Module.to's new tensors): every
    step is still torch's update on the tensors the model holds."""
    ref, ref_opt, flat, flat_opt = _pair(lr=1e-2)
    _grads([ref, flat], 0)
    ref_opt.step()
    flat_opt.step()
    _grads([ref, flat], 1, skip={2})
    ref_opt.step()
    flat_opt.step()
    assert flat_opt._state_views is None
    _assert_same(ref, flat, ref_opt, flat_opt)
    _grads([ref, flat], 2)  # the counters differ now: torch's step again
    ref_opt.step()
    flat_opt.step()
    assert flat_opt._state_views is None
    _assert_same(ref, flat, ref_opt, flat_opt)

    ref, ref_opt, flat, flat_opt = _pair(lr=1e-2)
    _grads([ref, flat], 0)
    ref_opt.step()
    flat_opt.step()
    for p in flat:  # what Module.to / .double() / .cuda() do: new tensors in param.data
        p.data = p.data.clone()
    _grads([ref, flat], 1)
    ref_opt.step()
    flat_opt.step()
    _assert_same(ref, flat, ref_opt, flat_opt)


def test_model_dense_optimizer_is_flat_and_trains_as_torch_adam():
    """GemModel.make_optimizers' FlatAdam against torch's fused Adam on the same model and batches."""
    cfg = GemConfig.tiny()
    data = SyntheticBatches(cfg, 16)
    ref_model, flat_model = GemModel(cfg, "fused", seed=0), GemModel(cfg, "fused", seed=0)
    ref_opt = torch.optim.Adam(ref_model.dense_parameters(), lr=cfg.dense_lr, fused=True)
    flat_opt = flat_model.make_optimizers()[0]
    assert isinstance(flat_opt, FlatAdam)
    for step in range(3):
        for model, opt in ((ref_model, ref_opt), (flat_model, flat_opt)):
            model.loss(data[step]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert flat_opt._state_views is not None
    for (name, p), q in zip(ref_model.named_parameters(), flat_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def test_flat_adam_float64():
    ref, ref_opt, flat, flat_opt = _pair([(5, 3), (5000,)], dtype=torch.float64, lr=1e-2)
    for step in range(3):
        _grads([ref, flat], step)
        ref_opt.step()
        flat_opt.step()
        assert flat_opt._state_views is not None
        assert flat_opt._flat.values.dtype == torch.float64
    for p, q in zip(ref, flat):
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-14)


def test_flat_adam_zero_grad_is_torchs():
    """zero_grad: set_to_none leaves every gradient None (its own loop, no profiler range) and keeps
    torch's profiler range while a profiler runs; set_to_none=False zeros them in place (torch's)."""
    ref, ref_opt, flat, flat_opt = _pair(lr=1e-2)
    _grads([ref, flat], 0)
    kept = [p.grad for p in flat]
    flat_opt.zero_grad(set_to_none=False)
    assert all(p.grad is g and not g.any() for p, g in zip(flat, kept))
    flat_opt.zero_grad()
    assert all(p.grad is None for p in flat)
    _grads([ref, flat], 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flat_opt.zero_grad()
    assert all(p.grad is None for p in flat)
    assert any(e.name == "Optimizer.zero_grad#FlatAdam.zero_grad" for e in prof.events())

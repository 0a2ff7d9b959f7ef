"""The fused remap + lookup (issue 28, "Fused into the lookup"): ``zch_embedding_bag`` remaps and pools
in one pass (cpu: one C++ loop; reference: the two steps). It must equal the two-call path
(``ZchTables.remap`` then ``embedding_bag`` on the slots) in the output, the identity tables, and
every gradient / fused update, over a stream that evicts and resets rows inside the batch."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import gem_kernels as gk
from gem_kernels.nn.embedding_bag import TableSpec
from gem_kernels.ops.embedding_bag import embedding_bag
from gem_kernels.ops.zch import zch_embedding_bag_forward_op

from .test_zch import STATE_BUFFERS, _batch

BACKENDS = [b for b in ("reference", "cpu") if b in gk.available_backends()]


def _module(backend, **kw):
    return gk.HashedEmbeddingBag([TableSpec(4, 8), TableSpec(6, 16)], backend=backend, **kw)


# Under GK_CUDA_EMU the `cpu` embedding-bag op is the CUDA kernel's code (tests/cuda_emu), which sums a
# bag in its own order, while the fused zch pass has no CUDA kernel and stays the C++ one: the two
# paths then agree to fp32 rounding, not bit for bit.
_EMU = os.environ.get("GK_CUDA_EMU") == "1"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-6, atol=1e-6) if _EMU else torch.equal(a, b)


def _two_calls(module, ids, offsets, psw):
    """The unfused path: the module's remap, then the embedding-bag op on its slots."""
    slots = module.remap(ids, offsets)
    return embedding_bag(module.weights, module.table_meta, slots, offsets, psw, output_dim=module.output_dim,
                         pooling=module.pooling, bounds_check="skip", optimizer=module.optimizer,
                         momentum1=module.momentum1, momentum2=module.momentum2, step=module.step,
                         backend=module.backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("unadmitted", ["zeros", "default_row"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("optimizer", [None, "sgd"])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_equals_remap_then_lookup(backend, unadmitted, pooling, optimizer, weighted):
    opt = gk.optim.ExactSGD(lr=0.5) if optimizer == "sgd" else None
    fused = _module(backend, unadmitted=unadmitted, pooling=pooling, optimizer=opt, admission_threshold=2,
                    eviction="lfu")
    fused.train()
    twin = copy.deepcopy(fused)
    for step in range(6):  # the 4-row table evicts every step; reused rows are reset inside the pass
        ids, offsets = _batch(step, batch=4)
        g = torch.Generator().manual_seed(step)
        psw = torch.rand(ids.numel(), generator=g).requires_grad_() if weighted else None
        psw_twin = psw.detach().clone().requires_grad_() if weighted else None
        out = fused(ids, offsets, psw)
        expected = _two_calls(twin, ids, offsets, psw_twin)
        # One summation order (ids in bag order, the same row primitives): bit for bit.
        assert _same(out, expected)
        grad = torch.randn(out.shape, generator=g)
        out.backward(grad)
        expected.backward(grad)
        if weighted:
            assert _same(psw.grad, psw_twin.grad)
        if opt is None:
            assert _same(fused.weights.grad, twin.weights.grad)
            fused.weights.grad = twin.weights.grad = None
        for name in STATE_BUFFERS + ("step",):
            assert torch.equal(getattr(fused.zch, name), getattr(twin.zch, name)), name
        assert _same(fused.weights, twin.weights)  # the fresh rows, and the SGD updates
        assert torch.equal(fused.step, twin.step)
    assert sum(fused.zch.stats()["evictions"]) > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_sgd_updates_only_live_rows(backend):
    module = _module(backend, optimizer=gk.optim.ExactSGD(lr=1.0), admission_threshold=2)
    module.train()
    before = module.weights.detach().clone()
    ids, offsets = torch.tensor([11, 11, 12, 21]), torch.tensor([0, 3, 4])  # 11 admitted; 12 and 21 pending
    module(ids, offsets).sum().backward()
    moved = (module.weights.detach() != before).view(-1)
    table0 = module.layout.table(moved, 0).any(1)
    assert table0.tolist() == [True, False, False, False]  # only 11's row (slot 0)
    assert not module.layout.table(moved, 1).any()


def test_backends_give_the_same_fused_result():
    if len(BACKENDS) < 2:
        pytest.skip("the C++ extension is not built: one backend only")
    modules = {b: _module(b, optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1)) for b in BACKENDS}
    modules["cpu"].load_state_dict(modules["reference"].state_dict())
    for step in range(4):
        ids, offsets = _batch(step)
        outs = {b: m(ids, offsets) for b, m in modules.items()}
        for m, out in zip(modules.values(), outs.values()):
            out.sum().backward()
        torch.testing.assert_close(outs["cpu"], outs["reference"])
    for name in STATE_BUFFERS:
        assert torch.equal(getattr(modules["cpu"].zch, name), getattr(modules["reference"].zch, name))


@pytest.mark.skipif(not _EMU, reason="runs the CUDA kernels' code under GK_CUDA_EMU=1 (tests/cuda_emu)")
def test_cuda_route_of_the_fused_lookup_under_emulation(monkeypatch):
    """On cuda the fused op is zch_remap's kernel, then the embedding-bag kernel on the slots. Both
    emulated (the `cuda` route on CPU tensors): the reference's output, fused updates (fp32 rounding:
    the CUDA bag sums in its own order) and identity tables (bit for bit), over evicting steps."""
    import gem_kernels.ops.zch as zch_ops

    want = _module("reference", optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1), eviction="lfu", seed=2)
    want.train()
    got = copy.deepcopy(want)
    for step in range(6):
        ids, offsets = _batch(step, batch=4)
        expected = want(ids, offsets)
        with monkeypatch.context() as patch:
            patch.setattr(zch_ops, "resolve_backend", lambda *args: "cuda")
            out = got(ids, offsets)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
            out.backward(grad)
        expected.backward(grad)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        for name in STATE_BUFFERS + ("step",):
            assert torch.equal(getattr(got.zch, name), getattr(want.zch, name)), name
        torch.testing.assert_close(got.weights, want.weights, rtol=1e-6, atol=1e-6)
    assert sum(want.zch.stats()["evictions"]) > 0


@pytest.mark.skipif("triton" not in gk.available_backends(), reason="triton is not installed")
def test_triton_route_of_the_fused_lookup():
    """On triton the fused op is zch_remap's Triton kernel, then the Triton embedding bag (interpreted
    on this CPU): the reference's output and fused updates (fp32 rounding) and identity tables (bit
    for bit) over evicting steps."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    want = _module("reference", optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1), eviction="lfu", seed=2)
    want.train()
    got = copy.deepcopy(want).to(device)
    got.backend = "triton"
    for step in range(4):
        ids, offsets = _batch(step, batch=3)
        expected = want(ids, offsets)
        out = got(ids.to(device), offsets.to(device))
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        out.backward(grad.to(device))
        expected.backward(grad)
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=1e-6)
        for name in STATE_BUFFERS + ("step",):
            assert torch.equal(getattr(got.zch, name).cpu(), getattr(want.zch, name)), name
        torch.testing.assert_close(got.weights.detach().cpu(), want.weights.detach(), rtol=1e-6, atol=1e-6)
    assert sum(want.zch.stats()["evictions"]) > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_forward_opcheck(backend):
    module = _module(backend, optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1))
    module.train()
    module(*_batch(0))
    zch = module.zch
    ids, offsets = _batch(1)
    args = (ids, offsets, torch.empty(0), zch.slot_meta, zch.heap, zch.index, zch.pending, zch.table_state, zch.layout,
            0, 0, 5, 1, 32, True, False, module.weights.detach(), *module.table_meta, module.momentum1,
            module.momentum2, module.init_bounds, 0, module.output_dim, 0, backend)
    torch.library.opcheck(zch_embedding_bag_forward_op._opoverload, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_bad_input(backend):
    module = _module(backend)
    module.train()
    with pytest.raises(ValueError, match="offsets must have T\\*B\\+1"):
        module(torch.tensor([1, 2]), torch.tensor([0, 1, 2, 2]))
    with pytest.raises(ValueError, match="per_sample_weights must have indices' length 2"):
        module(torch.tensor([1, 2]), torch.tensor([0, 1, 2]), torch.ones(3))
    with pytest.raises(ValueError, match="offsets"):
        module(torch.tensor([1, 2]), torch.tensor([0, 3, 2]))
    out = module(torch.empty(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert out.shape == (0, 24)


def test_cuda_backend_on_cpu_tensors_says_so():
    module = _module("cuda")
    with pytest.raises(gk.BackendUnavailableError, match="'cuda'"):
        module(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    with pytest.raises(gk.BackendUnavailableError, match="'cuda'"):
        gk.zch_remap(torch.tensor([1]), torch.tensor([0, 1]), gk.ZchTables([3]), backend="cuda")

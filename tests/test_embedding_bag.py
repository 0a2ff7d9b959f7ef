"""Fused multi-table embedding bags (TBE): every backend against the reference, forward, backward and
every fused optimizer; the reference against torch.nn.EmbeddingBag and torch.optim."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gem_kernels as gk
from gem_kernels.reference import embedding_bag as ref_eb
from gem_kernels.ops.embedding_bag import (
    IMPLEMENTED,
    embedding_bag_backward_fused_op,
    embedding_bag_op,
    embedding_bag_per_sample_weights_backward_op,
)

from .utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    assert_close,
    assert_rounded_once,
    cpu_kernel_only,
    device_backend_params,
    interpreter_rounding_factor,
    offsets_from_lengths,
    poison_allocator,
    randn_nonzero,
    reference_params,
)

# Odd dims (4, 36, 260, 5) take the generic paths; 32, 64 and 128 the cpu backend's fixed-D ones.
MIXED = [gk.TableSpec(10, 4), gk.TableSpec(7, 36), gk.TableSpec(50, 260), gk.TableSpec(3, 5), gk.TableSpec(20, 64),
         gk.TableSpec(9, 128), gk.TableSpec(6, 32)]
SAME_DIM = [gk.TableSpec(10, 36), gk.TableSpec(7, 36), gk.TableSpec(50, 36)]
OPTIMIZERS = [
    gk.optim.ExactSGD(lr=0.1),
    gk.optim.ExactSGD(lr=0.05, weight_decay=0.1),
    gk.optim.ExactRowwiseAdagrad(lr=0.1, eps=1e-8),
    gk.optim.ExactRowwiseAdagrad(lr=0.1, eps=1e-3, weight_decay=0.05),
    gk.optim.ExactAdam(lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.02),
]


def _params(**kw):
    """(device, backend) pairs, skipped with the reason where this family has no such backend yet."""
    params = []
    for p in device_backend_params():
        device, backend = p.values
        marks = list(p.marks)
        if backend not in IMPLEMENTED and not any(m.name == "skip" for m in marks):
            marks.append(pytest.mark.skip(reason=f"embedding_bag has no {backend} backend yet"))
        params.append(pytest.param(device, backend, marks=marks, id=p.id))
    return params


def make_batch(specs, batch, index_dtype=torch.int64, device="cpu", seed=0, max_len=6, cover_all=False):
    """Random bags with empty bags and duplicate rows; cover_all makes every row of every table appear."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(specs) * batch,), generator=gen)
    lengths[::4] = 0  # empty bags
    per_table = []
    for t, spec in enumerate(specs):
        table_lengths = lengths[t * batch:(t + 1) * batch]
        if cover_all:
            table_lengths[0] += spec.num_embeddings
        n = int(table_lengths.sum())
        idx = torch.randint(0, spec.num_embeddings, (n,), generator=gen)
        if cover_all:
            idx[:spec.num_embeddings] = torch.arange(spec.num_embeddings)
        if n >= 2:
            idx[-1] = idx[0]  # a duplicate in every table
        per_table.append(idx)
    indices = torch.cat(per_table).to(dtype=index_dtype, device=device)
    return indices, offsets_from_lengths(lengths, index_dtype, device)


def functional(module, indices, offsets, psw=None, backend=None, **kw):
    return gk.embedding_bag(module.weights, module.table_meta, indices, offsets, psw, output_dim=module.output_dim, pooling=module.pooling,
                            backend=backend or module.backend, **kw)


# ------------------------------------------------------------------------------------------------
# The reference against an independent oracle: one torch.nn.EmbeddingBag per table.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pooling,with_psw", [("sum", False), ("sum", True), ("mean", False), ("mean", True)],
                         ids=["sum", "sum-psw", "mean", "mean-psw"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("batch", [1, 5])
def test_reference_matches_nn_embedding_bag(pooling, with_psw, dtype, index_dtype, batch):
    """The reference, forward and gradients, against one fp32 nn.EmbeddingBag per table holding the
    same (dtype-rounded) weights; in fp16/bf16 the reference must be that result rounded once (it sums
    in fp32 and casts back), so the bound is rounding-sized, not the table's."""
    bags = [torch.nn.EmbeddingBag(s.num_embeddings, s.embedding_dim, mode=pooling) for s in MIXED]
    with torch.no_grad():
        for bag in bags:
            bag.weight.copy_(bag.weight.to(dtype))
    module = gk.FusedEmbeddingBag.from_embedding_bags([copy.deepcopy(b).to(dtype) for b in bags], backend="reference")
    indices, offsets = make_batch(MIXED, batch, index_dtype, seed=batch)
    psw = randn_nonzero(indices.numel()).requires_grad_() if with_psw else None
    oracle_psw = psw.detach().clone().requires_grad_() if with_psw else None
    out = module(indices, offsets, psw)
    expected = []
    for t, bag in enumerate(bags):
        lo, hi = int(offsets[t * batch]), int(offsets[(t + 1) * batch])
        local = offsets[t * batch:(t + 1) * batch + 1] - lo
        if with_psw and pooling == "mean":  # nn.EmbeddingBag refuses this: FBGEMM's weighted sum / length
            pooled = F.embedding_bag(indices[lo:hi], bag.weight, local, mode="sum",
                                     per_sample_weights=oracle_psw[lo:hi], include_last_offset=True)
            expected.append(pooled / local.diff().clamp(min=1)[:, None])
        else:
            expected.append(bag(indices[lo:hi], local[:-1], oracle_psw[lo:hi] if with_psw else None))
    expected = torch.cat(expected, dim=1)
    assert out.dtype == dtype
    assert_rounded_once(out, expected, dtype)
    grad = randn_nonzero(*out.shape, dtype=dtype)
    out.backward(grad)
    expected.backward(grad.float())
    for t, bag in enumerate(bags):
        assert_rounded_once(module.layout.table(module.weights.grad, t), bag.weight.grad, dtype)
    if with_psw:  # fp32 per_sample_weights: the dot of a grad row with a dtype weight row, in fp32
        torch.testing.assert_close(psw.grad, oracle_psw.grad)


def test_reference_pooling_none_matches_embedding():
    module = gk.FusedEmbeddingBag(SAME_DIM, pooling="none", backend="reference")
    indices, offsets = make_batch(SAME_DIM, 4)
    psw = randn_nonzero(indices.numel()).requires_grad_()
    oracle_psw = psw.detach().clone().requires_grad_()
    out = module(indices, offsets, psw)
    tables = torch.bucketize(torch.arange(indices.numel()), offsets[1:], right=True) // 4
    expected = torch.stack([module.weight(int(t))[int(i)] * w for t, i, w in zip(tables, indices, oracle_psw)])
    torch.testing.assert_close(out, expected)
    grad = randn_nonzero(*out.shape)
    torch.testing.assert_close(torch.autograd.grad(out, psw, grad)[0], torch.autograd.grad(expected, oracle_psw, grad)[0])


# ------------------------------------------------------------------------------------------------
# Every backend against the reference: forward and dense gradient.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,backend", _params())
@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("with_psw", [False, True])
def test_forward_and_backward(device, backend, pooling, dtype, index_dtype, batch, with_psw):
    if backend == "triton" and device == "cpu" and (index_dtype == torch.int32 or batch == 1) and dtype != torch.float32:
        pytest.skip("interpreter: half dtypes once per pooling (int64, B=5) keeps CI short; fp32 covers the rest")
    specs = SAME_DIM if pooling == "none" else MIXED
    module = gk.FusedEmbeddingBag(specs, pooling=pooling, dtype=dtype, device=device, backend=backend)
    indices, offsets = make_batch(specs, batch, index_dtype, device, seed=batch)
    psw = randn_nonzero(indices.numel(), device=device).requires_grad_() if with_psw else None
    poison_allocator(max(indices.numel(), batch) * module.output_dim * 4, device)
    out = module(indices, offsets, psw)
    # The exact result: the reference on fp32 copies of the (dtype-valued) weights. Pooling sums in
    # fp32 and casts once, so fp16/bf16 results must be that rounded once (stricter than
    # FlashAttention's rule, whose eager in-dtype sum would round at every term).
    weights32 = module.weights.detach().float().requires_grad_(True)
    psw32 = psw.detach().clone().requires_grad_(True) if with_psw else None
    expected = gk.embedding_bag(weights32, module.table_meta, indices, offsets, psw32, output_dim=module.output_dim, pooling=module.pooling,
                                backend="reference")
    assert out.shape == expected.shape and out.dtype == dtype
    factor = interpreter_rounding_factor(backend, device, dtype)
    assert_rounded_once(out, expected, dtype, factor)
    grad = randn_nonzero(*out.shape, dtype=dtype, device=device)
    poison_allocator(module.weights.numel() * 4, device)
    inputs = (module.weights, psw) if with_psw else (module.weights,)
    grads = torch.autograd.grad(out, inputs, grad)
    expected_grads = torch.autograd.grad(expected, (weights32, psw32) if with_psw else (weights32,), grad.float())
    assert grads[0].dtype == dtype
    assert_rounded_once(grads[0], expected_grads[0], dtype, factor)
    if with_psw:  # fp32: a dot over D of dtype-valued rows, summed in fp32
        assert grads[1].dtype == psw.dtype
        torch.testing.assert_close(grads[1], expected_grads[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,backend", _params())
@pytest.mark.parametrize("with_psw", [False, True])
def test_pooling_none_over_many_work_items(device, backend, with_psw):
    """Pooling "none" with thousands of positions in a few long bags (the CPU kernel splits by runs of
    1024 positions: runs start inside bags and cross bag and table boundaries), empty bags between,
    and out-of-range ids (dropped: zero rows) near the boundaries."""
    module = gk.FusedEmbeddingBag(SAME_DIM, pooling="none", bounds_check="skip", device=device, backend=backend)
    gen = torch.Generator().manual_seed(7)
    lengths = torch.tensor([1500, 0, 700, 2100, 0, 1, 0, 900, 1030])  # 3 tables x B = 3
    indices = torch.cat([torch.randint(0, spec.num_embeddings, (int(n),), generator=gen)
                         for spec, n in zip(SAME_DIM, lengths.view(3, 3).sum(1))])
    indices[[0, 1023, 1024, 1499, 1500, 2047, 2048, 4300, indices.numel() - 1]] = -3
    indices, offsets = indices.to(device), offsets_from_lengths(lengths, torch.int64, device)
    psw = randn_nonzero(indices.numel(), device=device) if with_psw else None
    out = functional(module, indices, offsets, psw, bounds_check="skip")
    expected = functional(module, indices, offsets, psw, backend="reference", bounds_check="skip")
    assert out.shape == (indices.numel(), module.output_dim)
    assert_close(out, expected)
    assert torch.count_nonzero(out[indices < 0]) == 0


@pytest.mark.parametrize("device,backend", _params())
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_long_bags_with_dropped_indices(device, backend, pooling):
    """Bags of up to 45 indices, longer than one gather step (Triton's BLOCK_P rows, the CUDA
    forward's kRowsInFlight) and not a multiple of it, with out-of-range indices dropped inside them."""
    module = gk.FusedEmbeddingBag(MIXED, pooling=pooling, bounds_check="skip", device=device, backend=backend)
    indices, offsets = make_batch(MIXED, 3, device=device, max_len=45, seed=3)
    indices[::7] = -1
    indices[3::11] = 10_000
    psw = randn_nonzero(indices.numel(), device=device)
    out = module(indices, offsets, psw)
    expected = functional(module, indices, offsets, psw, backend="reference", bounds_check="skip")
    assert_close(out, expected)


@pytest.mark.parametrize("device,backend", reference_params() + _params())
def test_all_bags_empty_and_zero_batch(device, backend):
    module = gk.FusedEmbeddingBag(MIXED, pooling="mean", device=device, backend=backend)
    offsets = torch.zeros(len(MIXED) * 3 + 1, dtype=torch.int64, device=device)
    indices = torch.zeros(0, dtype=torch.int64, device=device)
    out = module(indices, offsets)
    torch.testing.assert_close(out, torch.zeros(3, module.output_dim, device=device), rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out, module.weights, torch.ones_like(out))
    assert not grad.any()
    empty = module(indices, torch.zeros(1, dtype=torch.int64, device=device))
    assert empty.shape == (0, module.output_dim)


@pytest.mark.parametrize("device,backend", [pytest.param("cpu", "reference", id="cpu-reference")] + _params())
@pytest.mark.parametrize("bounds_check", ["fatal", "skip"])
def test_weighted_mean_matches_oracle(device, backend, bounds_check):
    """Per-sample weights with mean pooling = weighted sum / kept length (FBGEMM TBE), against a
    loop over the bags: output, weight gradient and per-sample-weight gradient; dropped indices
    (skip) count neither in the sum nor in the length."""
    module = gk.FusedEmbeddingBag(MIXED, pooling="mean", bounds_check=bounds_check, device=device, backend=backend)
    batch = 3
    indices, offsets = make_batch(MIXED, batch, device=device, max_len=9, seed=7)
    if bounds_check == "skip":
        indices[2::9] = -3
    psw = randn_nonzero(indices.numel(), device=device).requires_grad_()
    weights = module.weights.detach().clone().requires_grad_()
    oracle_psw = psw.detach().clone().requires_grad_()
    poison_allocator(batch * module.output_dim * 4, device)
    out = module(indices, offsets, psw)
    rows = []
    for b in range(batch):
        pieces = []
        for t, spec in enumerate(MIXED):
            table = module.layout.table(weights, t)
            acc, kept = torch.zeros(spec.embedding_dim, device=device), 0
            for p in range(int(offsets[t * batch + b]), int(offsets[t * batch + b + 1])):
                if 0 <= int(indices[p]) < spec.num_embeddings:
                    acc = acc + oracle_psw[p] * table[int(indices[p])]
                    kept += 1
            pieces.append(acc / max(kept, 1))
        rows.append(torch.cat(pieces))
    expected = torch.stack(rows)
    torch.testing.assert_close(out, expected)
    grad = randn_nonzero(*out.shape, device=device)
    got = torch.autograd.grad(out, (module.weights, psw), grad)
    want = torch.autograd.grad(expected, (weights, oracle_psw), grad)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


# ------------------------------------------------------------------------------------------------
# Fused optimizers: every backend against the reference after three steps (weights and state).
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,backend", _params())
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: repr(o))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_fused_optimizer_matches_reference(device, backend, optimizer, dtype, pooling):
    if dtype != torch.float32 and pooling != "sum":
        pytest.skip("half-precision weights are covered with sum pooling; mean/none differ only in the gradient")
    if backend == "triton" and device == "cpu" and dtype == torch.float16:
        pytest.skip("interpreter: bf16 covers the half-precision path; fp16 runs on the GPU")
    specs = SAME_DIM if pooling == "none" else MIXED
    module = gk.FusedEmbeddingBag(specs, pooling=pooling, dtype=dtype, device=device, optimizer=optimizer,
                                  backend=backend)
    reference = copy.deepcopy(module)
    reference.backend = "reference"
    for step in range(3):
        indices, offsets = make_batch(specs, 4, device=device, seed=10 + step)
        psw = randn_nonzero(indices.numel(), device=device) if pooling != "none" else None
        grad = randn_nonzero(indices.numel() if pooling == "none" else 4, module.output_dim, dtype=dtype,
                             device=device)
        # The per-sample-weight gradient must come from the weights before this step's update: the
        # reference op on a snapshot of them (module and reference weights drift apart by rounding
        # in half precision, so each is checked against its own snapshot).
        for m in (module, reference):
            before = m.weights.detach().clone()
            w = psw.clone().requires_grad_() if psw is not None else None
            m(indices, offsets, w).backward(grad)
            if w is not None:
                expected = ref_eb.embedding_bag_per_sample_weights_backward(
                    grad, before, *m.table_meta, indices, offsets,
                    ref_eb.POOLING_CODES[pooling])
                torch.testing.assert_close(w.grad, expected, atol=1e-4, rtol=1e-4)
        assert module.weights.grad is None
        assert_close(module.weights.detach(), reference.weights.detach())
        torch.testing.assert_close(module.momentum1, reference.momentum1, **_state_tol(dtype))
        torch.testing.assert_close(module.momentum2, reference.momentum2, **_state_tol(dtype))
        assert int(module.step) == int(reference.step) == step + 1


def _state_tol(dtype):
    # NOTE: state is fp32, but it accumulates gradients of half-precision grad_output/weights whose
    # rounding (one ulp of fp16/bf16 weights after the previous step) carries into it.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def _bags_and_module(optimizer, backend, specs=MIXED):
    bags = [torch.nn.EmbeddingBag(s.num_embeddings, s.embedding_dim, mode="sum") for s in specs]
    module = gk.FusedEmbeddingBag.from_embedding_bags(bags, optimizer=optimizer, backend=backend)
    return bags, module


def _loop_step(bags, indices, offsets, grad, batch):
    out = []
    for t, bag in enumerate(bags):
        lo, hi = int(offsets[t * batch]), int(offsets[(t + 1) * batch])
        out.append(bag(indices[lo:hi], (offsets[t * batch:(t + 1) * batch] - lo)))
    torch.cat(out, dim=1).backward(grad)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("optimizer,torch_optimizer", [
    (gk.optim.ExactSGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (gk.optim.ExactSGD(lr=0.05, weight_decay=0.1), lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=0.1)),
    (gk.optim.ExactAdam(lr=0.01, betas=(0.8, 0.95), weight_decay=0.02),
     lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.95), weight_decay=0.02)),
], ids=["sgd", "sgd-weight_decay", "adam"])
def test_fused_optimizer_matches_torch_optim(backend, optimizer, torch_optimizer):
    """With every row touched in every step, the exact sparse update is torch.optim's dense one."""
    if backend not in gk.available_backends():
        pytest.skip(f"{backend} backend unavailable here")
    bags, module = _bags_and_module(optimizer, backend)
    opt = torch_optimizer([b.weight for b in bags])
    for step in range(3):
        indices, offsets = make_batch(MIXED, 3, seed=step, cover_all=True)
        grad = randn_nonzero(3, module.output_dim)
        module(indices, offsets).backward(grad)
        opt.zero_grad()
        _loop_step(bags, indices, offsets, grad, 3)
        opt.step()
    for t, bag in enumerate(bags):
        torch.testing.assert_close(module.weight(t).detach(), bag.weight.detach(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device,backend", reference_params() + _params())
def test_bf16_adam_first_update(device, backend):
    """One ExactAdam step on bf16 weights against torch.optim.Adam in fp32 on the same weights (every
    row touched). Adam's first update is lr * g / |g| per element, so with |w| <= 0.05 one bf16
    rounding of a weight (<= 2e-4) is a fiftieth of lr: a first update 5% wrong fails here, where the
    table's bf16 tolerance (1.6e-2 on weights of magnitude 1) would let any update pass."""
    dtype, lr, batch = torch.bfloat16, 0.01, 3
    bags = [torch.nn.EmbeddingBag(s.num_embeddings, s.embedding_dim, mode="sum") for s in MIXED]
    with torch.no_grad():
        for bag in bags:
            bag.weight.uniform_(-0.05, 0.05)
            bag.weight.copy_(bag.weight.to(dtype))
    optimizer = gk.optim.ExactAdam(lr=lr, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.02)
    module = gk.FusedEmbeddingBag.from_embedding_bags([copy.deepcopy(b).to(device=device, dtype=dtype) for b in bags],
                                                      optimizer=optimizer, backend=backend)
    indices, offsets = make_batch(MIXED, batch, seed=5, cover_all=True)
    grad = randn_nonzero(batch, module.output_dim, dtype=dtype)
    module(indices.to(device), offsets.to(device)).backward(grad.to(device))
    torch_optimizer = torch.optim.Adam([b.weight for b in bags], lr=lr, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.02)
    _loop_step(bags, indices, offsets, grad.float(), batch)
    torch_optimizer.step()
    for t, bag in enumerate(bags):
        expected = bag.weight.detach()
        # NOTE: one ulp of the expected weight: its rounding to bf16, which fp32 reassociation can tip.
        bound = torch.finfo(dtype).eps * expected.abs() + 1e-7
        assert bound.max() < 0.05 * lr
        err = (module.weight(t).detach().float().cpu() - expected).abs()
        assert bool((err <= bound).all()), f"table {t}: weight off by {err.max().item()} after one step"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_rowwise_adagrad_matches_loop(backend, weight_decay):
    """Row-wise Adagrad against a row-by-row loop of FBGEMM's formula, duplicates summed first
    (weight decay added to the row's gradient, L2 as in torch.optim)."""
    if backend not in gk.available_backends():
        pytest.skip(f"{backend} backend unavailable here")
    lr, eps = 0.1, 1e-6
    bags, module = _bags_and_module(gk.optim.ExactRowwiseAdagrad(lr=lr, eps=eps, weight_decay=weight_decay),
                                    backend)
    weights = [b.weight.detach().clone() for b in bags]
    state = [torch.zeros(b.num_embeddings) for b in bags]
    for step in range(3):
        indices, offsets = make_batch(MIXED, 3, seed=20 + step)
        grad = randn_nonzero(3, module.output_dim)
        module(indices, offsets).backward(grad)
        for b in bags:
            b.weight.grad = None
        _loop_step(bags, indices, offsets, grad, 3)
        for t, bag in enumerate(bags):
            lo, hi = int(offsets[t * 3]), int(offsets[(t + 1) * 3])
            for row in sorted(set(indices[lo:hi].tolist())):
                g = bag.weight.grad[row] + weight_decay * weights[t][row]
                state[t][row] += (g * g).mean()
                weights[t][row] -= lr * g / (state[t][row].sqrt() + eps)
            with torch.no_grad():
                bag.weight.copy_(weights[t])
    for t in range(len(bags)):
        torch.testing.assert_close(module.weight(t).detach(), weights[t], atol=2e-5, rtol=2e-5)
        r0 = module.layout.rows_offsets[t]
        torch.testing.assert_close(module.momentum1[r0:r0 + bags[t].num_embeddings], state[t])


# ------------------------------------------------------------------------------------------------
# Bounds checks and bad input.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,backend", reference_params() + _params())
@pytest.mark.parametrize("bad", ["rows", -1, 1 << 40], ids=["rows", "negative", "huge"])
@pytest.mark.parametrize("table", [1, 4], ids=["D36", "D64"])
def test_bounds_check(device, backend, bad, table):
    specs = MIXED
    indices, offsets = make_batch(specs, 3, device=device, seed=3)
    lo = int(offsets[3 * table])  # first index of the table
    bag = int(torch.searchsorted(offsets, lo, right=True)) - 1 - 3 * table
    indices = indices.clone()
    indices[lo] = specs[table].num_embeddings if bad == "rows" else bad
    module = gk.FusedEmbeddingBag(specs, device=device, backend=backend, bounds_check="fatal")
    value = indices[lo].item()
    with pytest.raises(IndexError, match=rf"= {value} is out of range for table {table} .* in bag {bag}"):
        module(indices, offsets)
    # warn / skip drop the bad index: the result is the reference's on the batch without it.
    keep = torch.ones(indices.numel(), dtype=torch.bool, device=device)
    keep[lo] = False
    lengths = offsets.diff()
    lengths[3 * table + bag] -= 1
    clean_out = functional(module, indices[keep], offsets_from_lengths(lengths.cpu(), offsets.dtype, device),
                           backend="reference")
    module.bounds_check = "warn"
    with pytest.warns(UserWarning, match="dropping 1 out-of-range"):
        out = module(indices, offsets)
    torch.testing.assert_close(out, clean_out)
    module.bounds_check = "skip"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = module(indices, offsets)
    torch.testing.assert_close(out, clean_out)
    (grad,) = torch.autograd.grad(out, module.weights, torch.ones_like(out))
    (clean_grad,) = torch.autograd.grad(clean_out, module.weights, torch.ones_like(out))
    torch.testing.assert_close(grad, clean_grad)
    psw = randn_nonzero(indices.numel(), device=device).requires_grad_()
    (psw_grad,) = torch.autograd.grad(module(indices, offsets, psw), psw, torch.ones_like(out))
    assert psw_grad[lo] == 0  # the dropped index
    clean_psw = psw.detach()[keep].requires_grad_()
    clean_out = functional(module, indices[keep], offsets_from_lengths(lengths.cpu(), offsets.dtype, device),
                           clean_psw, backend="reference")
    (clean_psw_grad,) = torch.autograd.grad(clean_out, clean_psw, torch.ones_like(out))
    torch.testing.assert_close(psw_grad[keep], clean_psw_grad)


BAD = [
    (lambda i, o: (i, torch.tensor([0, 2, 1, 3, 3, 3, 3, 3, 3])), ValueError, "nondecreasing"),
    (lambda i, o: (i, o[:-1]), ValueError, r"offsets must have T\*B\+1 elements"),
    (lambda i, o: (i.float(), o), ValueError, "indices must have dtype"),
    (lambda i, o: (i[:-1], o), ValueError, r"offsets\[-1\] must equal the number of rows"),
    (lambda i, o: (i.view(1, -1), o), ValueError, "indices must have 1 dims"),
]


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("make,error,match", BAD)
def test_rejects_bad_input(backend, make, error, match):
    if backend not in gk.available_backends():
        pytest.skip(f"{backend} backend unavailable here")
    module = gk.FusedEmbeddingBag(MIXED[:2], backend=backend)
    indices, offsets = make_batch(MIXED[:2], 4)
    indices, offsets = make(indices, offsets)
    with pytest.raises(error, match=match):
        module(indices, offsets)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("index_dtype,offset_dtype", [(torch.int64, torch.int32), (torch.int32, torch.int64)])
def test_mixed_index_and_offset_dtypes(backend, index_dtype, offset_dtype):
    """TorchRec gives int64 ids with int32 lengths/offsets (RandomRecDataset, most input pipelines);
    FBGEMM's TBE takes the mix, so every backend does: forward and gradient equal the one-dtype call."""
    if backend not in gk.available_backends():
        pytest.skip(f"{backend} backend unavailable here")
    module = gk.FusedEmbeddingBag(MIXED[:2], backend=backend)
    indices, offsets = make_batch(MIXED[:2], 5)
    want = module(indices, offsets)
    (want_grad,) = torch.autograd.grad(want, module.weights, torch.ones_like(want))
    got = module(indices.to(index_dtype), offsets.to(offset_dtype))
    (got_grad,) = torch.autograd.grad(got, module.weights, torch.ones_like(got))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got_grad, want_grad, atol=0, rtol=0)


def _meta(module):
    return dict(weights=module.weights.detach(), **module.table_meta._asdict(), output_dim=module.output_dim,
                pooling=module.pooling)


def _long(values):
    return torch.tensor(values, dtype=torch.int64)


# The table metadata of gk.embedding_bag (MIXED[:2]: 10 x 4 and 7 x 36 at elements 0 and 40) made wrong.
BAD_TABLES = [
    (dict(output_dim=41), r"output_dim must equal D_offsets\[-1\] = 40 for pooled output, got 41"),
    (dict(output_dim=36), r"output_dim must equal D_offsets\[-1\] = 40"),
    (dict(pooling="none", output_dim=4),
     r"pooling 'none' needs every table's D equal to output_dim 4, got D \[4, 36\]"),
    (dict(weights_offsets=_long([0, 20])), r"tables 0 and 1 overlap in weights \(weights_offsets 0 and 20\)"),
    (dict(weights_offsets=_long([0, 41])),
     r"table 1 \(7 x 36 at weights_offsets\[1\] = 41\) does not fit in weights of 292"),
    (dict(weights_offsets=_long([-1, 40])), r"table 0 \(10 x 4 at weights_offsets\[0\] = -1\) does not fit"),
    (dict(D_offsets=_long([0, 4, 4]), output_dim=4), r"table 1 must have D >= 1 and rows >= 1, got D = 0"),
    (dict(rows_offsets=_long([1, 11, 18])), r"rows_offsets\[0\] must be 0, got 0 and 1"),
    (dict(weights=torch.zeros(584)[::2]), r"weights must be contiguous, got stride \(2,\)"),
    (dict(optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1), momentum1=torch.zeros(16),
          step=torch.zeros((), dtype=torch.int64)),
     r"momentum1 must have rows_offsets\[-1\] = 17 elements for rowwise_adagrad, got 16"),
    (dict(optimizer=gk.optim.ExactAdam(lr=0.1), momentum1=torch.zeros(584)[::2], momentum2=torch.zeros(292),
          step=torch.zeros((), dtype=torch.int64)), r"momentum1 must be contiguous"),
]


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("change,match", BAD_TABLES)
def test_rejects_bad_table_metadata(backend, change, match):
    """Metadata the module always gets right, a caller of gk.embedding_bag may not: a ValueError naming
    the table and the values on every backend, never a read or write outside weights."""
    if backend not in gk.available_backends():
        pytest.skip(f"{backend} backend unavailable here")
    module = gk.FusedEmbeddingBag(MIXED[:2])
    indices, offsets = make_batch(MIXED[:2], 4)
    args = dict(_meta(module), **change)
    with pytest.raises(ValueError, match=match):
        tables = gk.TableMeta(*(args.pop(name) for name in gk.TableMeta._fields))
        gk.embedding_bag(args.pop("weights"), tables, indices, offsets, backend=backend, **args)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_table_metadata_checked_again_after_a_change(backend):
    """check_tables reads a module's metadata once, then again whenever it could give another answer:
    the same metadata tensors changed in place, the same tensors with another output_dim or weights,
    new tensors of other values."""
    if backend not in gk.available_backends():
        pytest.skip(f"{backend} backend unavailable here")
    module = gk.FusedEmbeddingBag(MIXED[:2])
    indices, offsets = make_batch(MIXED[:2], 4)
    args = _meta(module)
    weights, meta = args.pop("weights"), gk.TableMeta(*(args.pop(name) for name in gk.TableMeta._fields))
    for _ in range(2):
        gk.embedding_bag(weights, meta, indices, offsets, backend=backend, **args)
    with pytest.raises(ValueError, match=r"output_dim must equal D_offsets\[-1\] = 40"):
        gk.embedding_bag(weights, meta, indices, offsets, backend=backend, **dict(args, output_dim=41))
    with pytest.raises(ValueError, match=r"does not fit in weights of 200"):
        gk.embedding_bag(weights[:200], meta, indices, offsets, backend=backend, **args)
    gk.embedding_bag(weights, meta, indices, offsets, backend=backend, **args)
    meta.weights_offsets[1] = 20  # in place: the version counter moves
    with pytest.raises(ValueError, match=r"tables 0 and 1 overlap in weights"):
        gk.embedding_bag(weights, meta, indices, offsets, backend=backend, **args)
    meta.weights_offsets[1] = 40
    gk.embedding_bag(weights, meta, indices, offsets, backend=backend, **args)
    with torch.no_grad():
        meta.rows_offsets.data = _long([1, 11, 18])  # a new storage under the same tensor, no version bump
    with pytest.raises(ValueError, match=r"rows_offsets\[0\] must be 0"):
        gk.embedding_bag(weights, meta, indices, offsets, backend=backend, **args)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="pooling must be one of"):
        gk.FusedEmbeddingBag(MIXED, pooling="max")
    with pytest.raises(ValueError, match="same embedding_dim"):
        gk.FusedEmbeddingBag(MIXED, pooling="none")
    with pytest.raises(ValueError, match="bounds_check must be one of"):
        gk.FusedEmbeddingBag(MIXED, bounds_check="clamp")
    with pytest.raises(ValueError, match="num_embeddings must be an int >= 1"):
        gk.TableSpec(0, 4)
    with pytest.raises(ValueError, match="lr must be > 0"):
        gk.optim.ExactRowwiseAdagrad(lr=-1.0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        gk.FusedEmbeddingBag(MIXED, dtype=torch.float64)
    indices, offsets = make_batch(MIXED, 2)  # (mean pooling takes per_sample_weights: FBGEMM's weighted mean)
    with pytest.raises(ValueError, match="per_sample_weights must have indices' length"):
        gk.FusedEmbeddingBag(MIXED)(indices, offsets, torch.ones(indices.numel() + 1))


# ------------------------------------------------------------------------------------------------
# Module: from_embedding_bags, weight(t), state_dict round trip.
# ------------------------------------------------------------------------------------------------

def test_weight_views_and_state_dict_round_trip():
    bags = [torch.nn.EmbeddingBag(s.num_embeddings, s.embedding_dim, mode="mean") for s in MIXED]
    optimizer = gk.optim.ExactAdam(lr=0.01)
    module = gk.FusedEmbeddingBag.from_embedding_bags(bags, optimizer=optimizer, backend="cpu"
                                                      if "cpu" in gk.available_backends() else "reference")
    assert module.pooling == "mean"
    for t, bag in enumerate(bags):
        assert module.weight(t).shape == bag.weight.shape
        torch.testing.assert_close(module.weight(t), bag.weight, rtol=0, atol=0)
        assert module.weight(t).data_ptr() == module.weights.data_ptr() + module.layout.weights_offsets[t] * 4
    indices, offsets = make_batch(MIXED, 3)
    module(indices, offsets).sum().backward()
    state = module.state_dict()
    assert set(state) == {"weights", "momentum1", "momentum2", "step"}
    fresh = gk.FusedEmbeddingBag(MIXED, pooling="mean", optimizer=optimizer, backend=module.backend)
    fresh.load_state_dict(state)
    for name in state:
        torch.testing.assert_close(getattr(fresh, name), getattr(module, name), rtol=0, atol=0)
    # Both continue identically: the optimizer state came along.
    for m in (module, fresh):
        m(indices, offsets).sum().backward()
    torch.testing.assert_close(fresh.weights, module.weights, rtol=0, atol=0)
    torch.testing.assert_close(fresh.momentum2, module.momentum2, rtol=0, atol=0)


def test_from_embedding_bags_rejects_mixed_modes():
    with pytest.raises(ValueError, match="share one mode"):
        gk.FusedEmbeddingBag.from_embedding_bags([torch.nn.EmbeddingBag(3, 4, mode="sum"),
                                                  torch.nn.EmbeddingBag(3, 4, mode="max")])


# ------------------------------------------------------------------------------------------------
# torch.library registration: opcheck and torch.compile.
# ------------------------------------------------------------------------------------------------

def _op_args(module, indices, offsets, backend, optimizer_code=0):
    psw = torch.empty(0)
    return (module.weights, module.momentum1, module.momentum2, module.step, *module.table_meta, indices, offsets, psw, module.output_dim, 0, 0, optimizer_code,
            0.1, 1e-8, 0.9, 0.99, 0.0, backend)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_opcheck(backend, index_dtype):
    if backend not in gk.available_backends():
        pytest.skip(f"{backend} backend unavailable here")
    module = gk.FusedEmbeddingBag(MIXED[:3], backend=backend)
    indices, offsets = make_batch(MIXED[:3], 3, index_dtype)
    torch.library.opcheck(embedding_bag_op, _op_args(module, indices, offsets, backend))
    args = list(_op_args(module, indices, offsets, backend))
    args[9] = randn_nonzero(indices.numel()).requires_grad_()  # differentiable per_sample_weights
    torch.library.opcheck(embedding_bag_op, tuple(args))
    grad = randn_nonzero(3, module.output_dim)
    torch.library.opcheck(embedding_bag_per_sample_weights_backward_op,
                          (grad, module.weights.detach(), *module.table_meta, indices, offsets, 0, backend))
    adagrad = gk.FusedEmbeddingBag(MIXED[:3], optimizer=gk.optim.ExactRowwiseAdagrad(), backend=backend)
    grad = randn_nonzero(3, adagrad.output_dim)
    torch.library.opcheck(embedding_bag_backward_fused_op,
                          (grad, adagrad.weights.detach(), adagrad.momentum1, adagrad.momentum2, adagrad.step,
                           *adagrad.table_meta, indices, offsets,
                           torch.empty(0), 0, 2, 0.1, 1e-8, 0.0, 0.0, 0.0, backend))


def test_opcheck_native_ops():
    if "cpu" not in gk.available_backends():
        pytest.skip("cpu backend unavailable here")
    module = gk.FusedEmbeddingBag(MIXED[:3])
    indices, offsets = make_batch(MIXED[:3], 3)
    meta = module.table_meta
    weights = module.weights.detach()
    torch.library.opcheck(torch.ops.gem_kernels.embedding_bag_forward_native.default,
                          (weights, *meta, indices, offsets, torch.empty(0), module.output_dim, 1, 0))
    grad = randn_nonzero(3, module.output_dim)
    torch.library.opcheck(torch.ops.gem_kernels.embedding_bag_backward_native.default,
                          (grad, weights, *meta, indices, offsets, torch.empty(0), 0))
    torch.library.opcheck(torch.ops.gem_kernels.embedding_bag_per_sample_weights_backward_native.default,
                          (grad, weights, *meta, indices, offsets, 0))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_torch_compile_fullgraph(backend):
    if backend not in gk.available_backends():
        pytest.skip(f"{backend} backend unavailable here")
    torch._dynamo.reset()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = gk.FusedEmbeddingBag(MIXED, backend=backend)
            self.proj = torch.nn.Linear(self.ebc.output_dim, 3)

        def forward(self, indices, offsets, psw):
            return self.proj(torch.relu(self.ebc(indices, offsets, psw)))

    model = Model()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    indices, offsets = make_batch(MIXED, 4)
    psw = randn_nonzero(indices.numel()).requires_grad_()
    out = compiled(indices, offsets, psw)
    expected = model(indices, offsets, psw)
    torch.testing.assert_close(out, expected)
    g = torch.autograd.grad(out.sum(), (model.ebc.weights, psw))
    g_ref = torch.autograd.grad(expected.sum(), (model.ebc.weights, psw))
    torch.testing.assert_close(g, g_ref)


# ------------------------------------------------------------------------------------------------
# Fuzz: the cpu backend against the reference over shapes.
# ------------------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dims=st.lists(st.sampled_from([1, 4, 7, 32, 36, 64, 70, 128]), min_size=1, max_size=4), rows=st.integers(1, 30),
       batch=st.integers(0, 6), max_len=st.integers(0, 8), pooling=st.sampled_from(["sum", "mean"]),
       seed=st.integers(0, 1000))
def test_fuzz_cpu_against_reference(dims, rows, batch, max_len, pooling, seed):
    if "cpu" not in gk.available_backends():
        pytest.skip("cpu backend unavailable here")
    specs = [gk.TableSpec(rows + t, d) for t, d in enumerate(dims)]
    module = gk.FusedEmbeddingBag(specs, pooling=pooling, backend="cpu")
    indices, offsets = make_batch(specs, batch, seed=seed, max_len=max_len)
    out = module(indices, offsets)
    expected = functional(module, indices, offsets, backend="reference")
    torch.testing.assert_close(out, expected)
    grad = randn_nonzero(*out.shape)
    (g,) = torch.autograd.grad(out, module.weights, grad)
    (g_ref,) = torch.autograd.grad(expected, module.weights, grad)
    torch.testing.assert_close(g, g_ref)


def test_option_codes_agree_with_the_cpp_header():
    """The codes are defined once per language: gem_kernels/_embedding_bag.py and
    csrc/include/gem_kernels/embedding_bag_codes.h must give every option the same integer."""
    import re
    from pathlib import Path

    from gem_kernels import _embedding_bag as codes

    header = (Path(__file__).resolve().parents[1] / "csrc/include/gem_kernels/embedding_bag_codes.h").read_text()
    cpp = {name: int(value) for name, value in re.findall(r"\b(k[A-Z]\w*) = (\d+)", header)}
    python = {"kSum": codes.SUM, "kMean": codes.MEAN, "kNone": codes.NONE, "kFatal": codes.FATAL,
              "kWarn": codes.WARN, "kSkip": codes.SKIP, "kOptNone": codes.OPT_NONE, "kOptSgd": codes.OPT_SGD,
              "kOptRowwiseAdagrad": codes.OPT_ROWWISE_ADAGRAD, "kOptAdam": codes.OPT_ADAM}
    assert cpp == python


# ------------------------------------------------------------------------------------------------
# The cpu backend's large-output path: the output cache and streaming stores (outputs >= 32 MiB).
# ------------------------------------------------------------------------------------------------

# Output columns 0, 64, 100, 132, 260, 264 (x 4 bytes): the D = 64 tables start 32-byte aligned and
# stream, the fixed-D 32 and 128 tables between them do not (normal stores), 36 and 4 take the
# generic path. ODD_ROW: a 100-float output row, so no slice is aligned from the second bag on.
LARGE_ALIGNED_MIX = [gk.TableSpec(50, 64), gk.TableSpec(30, 36), gk.TableSpec(40, 32), gk.TableSpec(20, 128),
                     gk.TableSpec(9, 4), gk.TableSpec(70, 64)]
LARGE_ODD_ROW = [gk.TableSpec(50, 64), gk.TableSpec(30, 36)]


@pytest.fixture
def large_output_cache():
    """The cpu backend's output cache on (256 MiB of idle blocks) and empty, restored after."""
    if "cpu" not in gk.available_backends():
        pytest.skip("cpu backend unavailable here")
    from gem_kernels import _backend

    C = _backend._C
    previous = C.set_output_cache_limit(0)
    C.set_output_cache_limit(256 << 20)
    yield C
    C.set_output_cache_limit(previous)


@cpu_kernel_only
@pytest.mark.parametrize("store_kind", [0, 1], ids=["normal_stores", "streaming_stores"])
@pytest.mark.parametrize("specs", [LARGE_ALIGNED_MIX, LARGE_ODD_ROW], ids=["aligned_mix", "odd_row"])
@pytest.mark.parametrize("pooling,with_psw,dtype", [("sum", False, torch.float32), ("mean", True, torch.float32),
                                                    ("sum", True, torch.bfloat16)])
def test_cpu_large_output_reuses_cached_memory(large_output_cache, store_kind, specs, pooling, with_psw, dtype):
    """A >= 32 MiB pooled output comes from the output cache: the second call gets the first call's
    memory back (here poisoned with NaN, so an element the kernel does not write fails), in every
    store kind (the store_kind fixture forces both), every slice alignment, and with a resize."""
    from gem_kernels import _backend

    C = large_output_cache
    output_dim = sum(s.embedding_dim for s in specs)
    batch = (32 << 20) // (output_dim * torch.empty((), dtype=dtype).element_size()) + 7
    module = gk.FusedEmbeddingBag(specs, pooling=pooling, dtype=dtype, backend="cpu")
    previous = _backend._C.set_streaming_stores(store_kind)
    try:
        indices, offsets = make_batch(specs, batch, max_len=2, seed=5)
        psw = randn_nonzero(indices.numel()) if with_psw else None
        with torch.no_grad():
            first = functional(module, indices, offsets, psw)
            block, nbytes = first.data_ptr(), first.nbytes
            first.fill_(float("nan"))
            del first
            assert C.output_cache_idle_bytes() >= nbytes
            indices, offsets = make_batch(specs, batch, max_len=2, seed=6)
            psw = randn_nonzero(indices.numel()) if with_psw else None
            out = functional(module, indices, offsets, psw)
            assert out.data_ptr() == block and C.output_cache_idle_bytes() == 0
            expected = gk.embedding_bag(module.weights.float(), module.table_meta, indices, offsets, psw,
                                        output_dim=output_dim, pooling=pooling, backend="reference")
            assert_rounded_once(out, expected, dtype)
            # A resize moves the data to a normal allocation and hands the block back.
            out.resize_(batch + 1, output_dim)
            assert C.output_cache_idle_bytes() >= nbytes
            assert_rounded_once(out[:batch], expected, dtype)
    finally:
        _backend._C.set_streaming_stores(previous)


def _cpu_has_avx512f() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


# The fixed-D fp32 rows' "L2-wide" path (gem_kernels/cpu_gather.h: prefetcht1, 64-byte loads and
# streaming stores; the default on AMD CPUs with AVX-512F) against the 8-float path, switched by
# GEM_KERNELS_EMB_L2_PREFETCH at every call. LARGE_ALIGNED_MIX's 328-float output row puts its bags'
# slices alternately on and off a 64-byte boundary (both streaming stores), LARGE_ODD_ROW's on neither.
@cpu_kernel_only
@pytest.mark.parametrize("store_kind", [0, 1], ids=["normal_stores", "streaming_stores"])
@pytest.mark.parametrize("specs", [LARGE_ALIGNED_MIX, LARGE_ODD_ROW], ids=["aligned_mix", "odd_row"])
@pytest.mark.parametrize("pooling,with_psw", [("sum", False), ("sum", True), ("mean", False), ("mean", True)],
                         ids=["sum", "sum-psw", "mean", "mean-psw"])
def test_cpu_l2_wide_rows_match_the_8_float_path_bit_for_bit(monkeypatch, large_output_cache, store_kind, specs,
                                                              pooling, with_psw):
    """The same bits from both paths (each lane adds the same rows in the same order), both equal to the
    reference rounded once, with out-of-range ids dropped (bounds_check "skip") and a >= 32 MiB output
    (the streaming-store size); the gather roof's reader (gather_rows_read) gives the same checksum in
    both modes."""
    if not _cpu_has_avx512f():
        pytest.skip("the L2-wide path needs AVX-512F, which this CPU does not have")
    monkeypatch.delenv("GEM_KERNELS_NO_AVX512", raising=False)
    from gem_kernels import _backend

    output_dim = sum(s.embedding_dim for s in specs)
    batch = (32 << 20) // (output_dim * 4) + 7
    module = gk.FusedEmbeddingBag(specs, pooling=pooling, dtype=torch.float32, backend="cpu", bounds_check="skip")
    indices, offsets = make_batch(specs, batch, max_len=3, seed=9)
    indices[::97] = 10_000  # beyond every table: dropped
    psw = randn_nonzero(indices.numel()) if with_psw else None
    previous = _backend._C.set_streaming_stores(store_kind)
    try:
        outs = {}
        for mode in ("0", "1"):
            monkeypatch.setenv("GEM_KERNELS_EMB_L2_PREFETCH", mode)
            with torch.no_grad():
                out = functional(module, indices, offsets, psw, bounds_check="skip")
                outs[mode] = out.clone()
                out.fill_(float("nan"))  # the next call may get this block back: poisoned
                del out
    finally:
        _backend._C.set_streaming_stores(previous)
    expected = gk.embedding_bag(module.weights, module.table_meta, indices, offsets, psw, output_dim=output_dim,
                                pooling=pooling, backend="reference", bounds_check="skip")
    assert_rounded_once(outs["1"], expected, torch.float32)
    assert torch.equal(outs["1"], outs["0"])
    tables = [module.weight(t).detach() for t in range(len(specs))]
    ids = [torch.randint(0, s.num_embeddings, (3000,), generator=torch.Generator().manual_seed(t))
           for t, s in enumerate(specs)]
    sums = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("GEM_KERNELS_EMB_L2_PREFETCH", mode)
        sums[mode] = [_backend._C.gather_rows_read(tables, ids, d) for d in (0, 32)]
    assert sums["1"] == sums["0"]


# The cpu backend's fixed-D path runs a work item's bags (128 of one table) in one loop: tables of
# every fixed D, with a generic one between them so that their output columns do not start at 0.
ITEM_SPANNING = [gk.TableSpec(40, 32), gk.TableSpec(30, 36), gk.TableSpec(50, 64), gk.TableSpec(60, 128)]


@cpu_kernel_only
@pytest.mark.parametrize("pooling,with_psw", [("sum", False), ("sum", True), ("mean", False), ("mean", True)],
                         ids=["sum", "sum-psw", "mean", "mean-psw"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cpu_fixed_dim_bags_across_work_items(pooling, with_psw, dtype):
    """B = 300 bags per table (the forward's work items are 128 bags: two whole, one of 44), bags of 0
    to 40 lookups (longer than the row prefetch's distance), and dropped indices (bounds_check "skip"):
    a few per table and one bag all out of range. Every bag lands in its own output slice and a mean
    divides by the bag's kept lookups (0 kept: zeros), each element the fp32 result rounded once."""
    if "cpu" not in gk.available_backends():
        pytest.skip("cpu backend unavailable here")
    batch = 300
    gen = torch.Generator().manual_seed(11)
    module = gk.FusedEmbeddingBag(ITEM_SPANNING, pooling=pooling, dtype=dtype, backend="cpu", bounds_check="skip")
    lengths = torch.randint(0, 41, (len(ITEM_SPANNING) * batch,), generator=gen)
    lengths[::7] = 0
    offsets = offsets_from_lengths(lengths)
    indices = torch.cat([torch.randint(0, s.num_embeddings, (int(lengths[t * batch:(t + 1) * batch].sum()),),
                                       generator=gen) for t, s in enumerate(ITEM_SPANNING)])
    bad = torch.zeros(indices.numel(), dtype=torch.bool)
    bad[torch.randint(0, indices.numel(), (40,), generator=gen)] = True
    for t in range(len(ITEM_SPANNING)):  # one bag of every table in its last work item, all out of range
        bag = t * batch + 290 if lengths[t * batch + 290] > 0 else t * batch + 291
        bad[int(offsets[bag]):int(offsets[bag + 1])] = True
    indices[bad] = torch.where(torch.rand(int(bad.sum()), generator=gen) < 0.5, -1, 10**6)
    psw = randn_nonzero(indices.numel(), generator=gen) if with_psw else None
    poison_allocator(batch * module.output_dim * torch.empty((), dtype=dtype).element_size(), "cpu")
    with torch.no_grad():
        out = functional(module, indices, offsets, psw, bounds_check="skip")
        pieces = []
        for t, spec in enumerate(ITEM_SPANNING):
            lo, hi = int(offsets[t * batch]), int(offsets[(t + 1) * batch])
            keep = ~bad[lo:hi]
            kept = torch.zeros(batch, dtype=torch.long).scatter_add_(
                0, torch.repeat_interleave(torch.arange(batch), lengths[t * batch:(t + 1) * batch]), keep.long())
            sums = F.embedding_bag(indices[lo:hi][keep], module.weight(t).float(), offsets_from_lengths(kept)[:-1],
                                   mode="sum", per_sample_weights=psw[lo:hi][keep] if with_psw else None)
            pieces.append(sums / kept.clamp(min=1)[:, None] if pooling == "mean" else sums)
        expected = torch.cat(pieces, dim=1)
    assert_rounded_once(out, expected, dtype)


@cpu_kernel_only
@pytest.mark.parametrize("value", ["-1", "12abc", "lots"])
def test_cpu_output_cache_env_is_checked(value):
    """A bad GEM_KERNELS_OUTPUT_CACHE_MIB is a ValueError naming the variable and its value (strtoull
    read "-1" as 2^64 - 1 MiB, an unbounded cache); "0" is accepted (the cache off)."""
    import os
    import subprocess
    import sys

    if "cpu" not in gk.available_backends():
        pytest.skip("cpu backend unavailable here")
    code = ("from gem_kernels import _backend\n"
            "try:\n"
            "    print(_backend._C.output_cache_idle_bytes())\n"
            "except ValueError as e:\n"
            "    print('ValueError', e)\n")
    env = dict(os.environ, GEM_KERNELS_OUTPUT_CACHE_MIB=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ValueError" in out.stdout and "GEM_KERNELS_OUTPUT_CACHE_MIB" in out.stdout and value in out.stdout, out.stdout
    env["GEM_KERNELS_OUTPUT_CACHE_MIB"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "0", (out.stdout, out.stderr)


@cpu_kernel_only
@pytest.mark.parametrize("env,limit_mib", [(None, 256), ("", 256), ("0", 0), ("100", 100)])
def test_cpu_output_cache_is_on_by_default(env, limit_mib):
    """Unset (or empty), GEM_KERNELS_OUTPUT_CACHE_MIB keeps 256 MiB of freed large outputs: the next
    forward of the same size gets the block back, already faulted in (the first touch of a fresh one
    was the embedding-bag forward's gap to its gather roof); "0" turns the cache off."""
    import os
    import subprocess
    import sys

    if "cpu" not in gk.available_backends():
        pytest.skip("cpu backend unavailable here")
    code = ("import torch, gem_kernels as gk\n"
            "from gem_kernels import _backend\n"
            "m = gk.FusedEmbeddingBag([gk.TableSpec(50, 64), gk.TableSpec(30, 36)], backend='cpu')\n"
            "batch = (32 << 20) // 400 + 1\n"
            "idx = torch.zeros(2 * batch, dtype=torch.int64)\n"
            "off = torch.arange(2 * batch + 1)\n"
            "with torch.no_grad():\n"
            "    out = m(idx, off)\n"
            "    ptr = out.data_ptr()\n"
            "    del out\n"
            "    idle = _backend._C.output_cache_idle_bytes()\n"
            "    again = m(idx, off)\n"
            "    print(_backend._C.set_output_cache_limit(0) >> 20, idle >> 20, again.data_ptr() == ptr)\n")
    full = {k: v for k, v in os.environ.items() if k != "GEM_KERNELS_OUTPUT_CACHE_MIB"}
    if env is not None:
        full["GEM_KERNELS_OUTPUT_CACHE_MIB"] = env
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    limit, idle, reused = out.stdout.split()
    assert int(limit) == limit_mib
    # On: the freed 34 MiB block (32 MiB + 400 bytes in 2 MiB pages) is kept and handed back.
    assert int(idle) == (34 if limit_mib >= 34 else 0)
    if limit_mib >= 34:
        assert reused == "True"


@cpu_kernel_only
def test_cpu_output_cache_limit(large_output_cache):
    """Freed large outputs are kept up to the limit of idle bytes, and released beyond it."""
    C = large_output_cache
    module = gk.FusedEmbeddingBag(LARGE_ODD_ROW, backend="cpu")
    indices, offsets = make_batch(LARGE_ODD_ROW, (32 << 20) // 400 + 1, max_len=1)
    with torch.no_grad():
        outs = [functional(module, indices, offsets) for _ in range(2)]
        assert outs[0].data_ptr() != outs[1].data_ptr()
        del outs
        assert C.output_cache_idle_bytes() == 2 * (34 << 20)  # 32 MiB + 400 bytes, in 2 MiB pages
        assert C.set_output_cache_limit(40 << 20) == 256 << 20
        assert C.output_cache_idle_bytes() == 34 << 20
        C.set_output_cache_limit(0)
        assert C.output_cache_idle_bytes() == 0
        out = functional(module, indices, offsets)
        del out
        assert C.output_cache_idle_bytes() == 0
    with pytest.raises(ValueError, match="bytes must be >= 0"):
        C.set_output_cache_limit(-1)


# The cpu backend's backward sums a unique row's gradient rows in registers and runs the optimizer
# step there for D = 32, 64 and 128 (for_each_row_gradient's fixed-D row sums / optimizer_row_fixed),
# and in memory for any other D. Tables of 5 (segments of hundreds of lookups), 40 and 700 rows (many unique rows per work
# item): the fixed path must give the generic path's bits.
@cpu_kernel_only
@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("pooling,with_psw", [("sum", False), ("sum", True), ("mean", True), ("none", False)],
                         ids=["sum", "sum-psw", "mean-psw", "none"])
@pytest.mark.parametrize("optimizer", [None, gk.optim.ExactSGD(lr=0.05, weight_decay=0.1),
                                       gk.optim.ExactAdam(lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.02)],
                         ids=["dense-grad", "sgd-weight_decay", "adam-weight_decay"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_fixed_dim_backward_matches_generic_bit_for_bit(dim, pooling, with_psw, optimizer, dtype):
    """The same tables at D (fixed path) and at D + 8 (generic path; the first D columns equal, the
    extra ones random): an element-wise update (dense gradient, SGD, Adam) of the first D columns does
    not see the extra ones, so after two steps they hold the same bits. Row-wise Adagrad's step
    divides by D, so it is checked against the row-by-row loop in test_rowwise_adagrad_matches_loop."""
    if "cpu" not in gk.available_backends():
        pytest.skip("cpu backend unavailable here")
    rows, batch = [5, 40, 700], 300
    gen = torch.Generator().manual_seed(dim)
    fixed = gk.FusedEmbeddingBag([gk.TableSpec(r, dim) for r in rows], pooling=pooling, dtype=dtype,
                                 optimizer=optimizer, backend="cpu")
    generic = gk.FusedEmbeddingBag([gk.TableSpec(r, dim + 8) for r in rows], pooling=pooling, dtype=dtype,
                                   optimizer=copy.deepcopy(optimizer), backend="cpu")
    with torch.no_grad():
        for t in range(len(rows)):
            generic.weight(t).copy_(torch.randn(rows[t], dim + 8, generator=gen).to(dtype))
            fixed.weight(t).copy_(generic.weight(t)[:, :dim])
    for step in range(2):
        lengths = torch.randint(0, 41, (len(rows) * batch,), generator=gen)
        offsets = offsets_from_lengths(lengths)
        indices = torch.cat([torch.randint(0, r, (int(lengths[t * batch:(t + 1) * batch].sum()),), generator=gen)
                             for t, r in enumerate(rows)])
        psw = randn_nonzero(indices.numel(), generator=gen) if with_psw else None
        n_out = indices.numel() if pooling == "none" else batch
        wide = torch.randn(n_out, len(rows), dim + 8, generator=gen).to(dtype)
        grads = (wide[:, :, :dim].reshape(n_out, -1), wide.reshape(n_out, -1))
        if pooling == "none":  # one row per lookup, as wide as a table: each lookup's row of its own table
            table_of = torch.repeat_interleave(torch.arange(len(rows)), torch.stack(
                [lengths[t * batch:(t + 1) * batch].sum() for t in range(len(rows))]))
            grads = tuple(g.view(n_out, len(rows), -1)[torch.arange(n_out), table_of] for g in grads)
        for module, grad in zip((fixed, generic), grads):
            module(indices, offsets, psw).backward(grad)
        if optimizer is None:
            for t in range(len(rows)):
                assert torch.equal(fixed.layout.table(fixed.weights.grad, t),
                                   generic.layout.table(generic.weights.grad, t)[:, :dim]), f"step {step} table {t}"
            fixed.weights.grad = generic.weights.grad = None
    for t in range(len(rows)):
        assert torch.equal(fixed.weight(t), generic.weight(t)[:, :dim]), f"table {t}: weights"
        if isinstance(optimizer, gk.optim.ExactAdam):
            for name in ("momentum1", "momentum2"):
                assert torch.equal(fixed.layout.table(getattr(fixed, name), t),
                                   generic.layout.table(getattr(generic, name), t)[:, :dim]), f"table {t}: {name}"

"""Bench of the embedding_bag family: fused multi-table embedding bags (TBE), forward and
forward + backward + ExactRowwiseAdagrad.

Workload (issue 3): 26 tables with rows geometrically spaced from 1e3 to 5e5 and D alternating 64 /
128 (about 0.9 GB of fp32 weights on the CPU), B = 4096, bag lengths ~ Poisson(20), row ids drawn
from a Zipf law (alpha 1.05) over each table and scattered by a fixed random permutation, so hot rows
repeat as in production but do not sit next to each other. A larger preset runs on a GPU.

Impls: the gem_kernels backends (cpu; reference, which is also the verification reference), and the
baselines: "eager-loop", one nn.EmbeddingBag per table in a Python loop (sparse gradients, the
row-wise Adagrad step written in plain torch ops: what a user writes, torch.optim.Adagrad not being
row-wise); "compile", the same loop under torch.compile; "fbgemm", fbgemm_gpu's
SplitTableBatchedEmbeddingBagsCodegen (EXACT_ROWWISE_ADAGRAD, host weights on the CPU). Every impl of
a case starts from the same weights; the harness holds each one's first output to FlashAttention's
rule against the eager loop run in float64 (at most twice the eager loop's own error) before timing
it. In the fwd+bwd+optimizer case that is the forward of the first step, and after it the updated
rows of every table (the rows the first batch touched, and a sample of rows it did not touch, which
must not move) and their row-wise Adagrad state. Every impl's row-wise state starts at
WARM_MOMENTUM, as after earlier steps: Adagrad's first step from zero state, lr * g / rms(g) per row,
is not Lipschitz in the gradient (a row whose gradient nearly cancels moves by up to lr on a rounding
difference), while from a warm state the update moves by at most about lr / sqrt(WARM_MOMENTUM)
times the gradient's error, which the rule then bounds.

"compile" is primed on every input set before it is timed (its compile_s column: the seconds that
took); the loop's Python-int slice bounds differ per batch, so each set is a graph of its own.

Bytes: ``bytes`` is the floor (gem_kernels.flops.embedding_bag_floor: each distinct row read once,
outputs written once), which "% of peak" divides by; ``formula_bytes`` is FBGEMM's benchmark formula
(every lookup reads its row: B x sum(D) x L), its own GB/s column for comparison with FBGEMM's numbers.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

import gem_kernels as gk
from gem_kernels import flops

from .harness import Case, rotate
from .peaks import gather_roof, gather_roof_call

# The family's time cap (bench/__main__.py): the forward case times six callables round-robin (five
# impls and the gather roof) and 110 s left the impls a call or two each on a busy machine.
FAMILY_BUDGET = {False: 300.0, True: 9.0}
SEED = 0
ZIPF_ALPHA = 1.05
MEAN_BAG = 20
LR, EPS = 0.01, 1e-8
# The row-wise Adagrad state every impl starts from in the fwd+bwd+optimizer case (see the docstring):
# the order of a row's mean squared gradient here (bags of ~20 ids, grad_output ~ N(0, 1)), so the
# first update is still about lr per element and checks the gradient's direction and size.
WARM_MOMENTUM = 1.0


def table_specs(num_tables: int, min_rows: int, max_rows: int, dims=(64, 128)) -> list[gk.TableSpec]:
    ratio = (max_rows / min_rows) ** (1 / max(num_tables - 1, 1))
    return [gk.TableSpec(int(round(min_rows * ratio**t)), dims[t % len(dims)]) for t in range(num_tables)]


def zipf_batch(specs: list[gk.TableSpec], batch: int, seed: int, mean_bag: int = MEAN_BAG,
               alpha: float = ZIPF_ALPHA) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 (indices, offsets [T*B+1]): Poisson(mean_bag) bag lengths, Zipf(alpha) row ids per table."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.poisson(torch.full((len(specs) * batch,), float(mean_bag)), generator=gen).long()
    per_table = []
    for t, spec in enumerate(specs):
        n = int(lengths[t * batch:(t + 1) * batch].sum())
        ranks = torch.arange(1, spec.num_embeddings + 1, dtype=torch.float64)
        cdf = (ranks ** -alpha).cumsum(0)
        rank = torch.searchsorted(cdf, torch.rand(n, generator=gen, dtype=torch.float64) * cdf[-1])
        rank = rank.clamp(max=spec.num_embeddings - 1)
        # A fixed permutation per table (seeded by t, the same for every batch) scatters the hot rows.
        perm = torch.randperm(spec.num_embeddings, generator=torch.Generator().manual_seed(1000 + t))
        per_table.append(perm[rank])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    return torch.cat(per_table), offsets


def _fbgemm_tbe(specs, weights_of, pooling: str, reason_only: bool = False):
    """fbgemm_gpu's CPU TBE with the given tables' weights, or (None, why) when it cannot run."""
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        return None, f"fbgemm omitted: fbgemm_gpu's TBE does not import ({type(exc).__name__}: {exc})"
    if reason_only:
        return None, None
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(s.num_embeddings, s.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for s in specs],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR, eps=EPS,
        pooling_mode=PoolingMode.SUM if pooling == "sum" else PoolingMode.MEAN,
        weights_precision=SparseType.FP32, output_dtype=SparseType.FP32)
    with torch.no_grad():
        for t, w in enumerate(tbe.split_embedding_weights()):
            w.copy_(weights_of(t))
    return tbe, None


def _eager_bags(module: gk.FusedEmbeddingBag, copy: bool, dtype: torch.dtype | None = None
                ) -> list[torch.nn.EmbeddingBag]:
    """One nn.EmbeddingBag per table of ``module``: on its weights (copy=False) or on copies of them
    (in ``dtype``, default the module's)."""
    bags = []
    for t in range(module.num_tables):
        weight = module.weight(t).detach()
        weight = weight.to(dtype or weight.dtype, copy=True) if copy else weight
        bags.append(torch.nn.EmbeddingBag.from_pretrained(weight, freeze=False, mode=module.pooling, sparse=True))
    return bags


def _eager_step_fp64(module: gk.FusedEmbeddingBag, batch: int, args: tuple, reader) -> tuple:
    """The eager loop's step in float64 from ``module``'s weights and the warm state, on the first
    input set: (output, what ``reader`` reads after it). Fresh copies on every call."""
    indices, _, tables, grad = args
    bags = _eager_bags(module, copy=True, dtype=torch.float64)
    states = [torch.full((b.num_embeddings,), WARM_MOMENTUM, dtype=torch.float64, device=grad.device) for b in bags]
    out = _eager_step(_loop_forward(bags, batch), bags, states, indices, tables, grad.double())
    return out, reader(lambda t: bags[t].weight, lambda t: states[t])()


def _loop_forward(bags, batch: int) -> Callable:
    def forward(indices, table_offsets):
        # table_offsets: per table, that table's B start offsets relative to its first index, and
        # its slice bounds; precomputed so the loop itself has no host sync.
        outs = [bag(indices[lo:hi], starts) for bag, (lo, hi, starts) in zip(bags, table_offsets)]
        return torch.cat(outs, dim=1)

    return forward


def _table_offsets(offsets: torch.Tensor, num_tables: int, batch: int) -> list[tuple[int, int, torch.Tensor]]:
    result = []
    for t in range(num_tables):
        lo, hi = int(offsets[t * batch]), int(offsets[(t + 1) * batch])
        result.append((lo, hi, offsets[t * batch:(t + 1) * batch] - lo))
    return result


def rowwise_adagrad_rows_(weight: torch.Tensor, momentum: torch.Tensor, rows: torch.Tensor, grad_rows: torch.Tensor,
                          lr: float = LR, eps: float = EPS) -> None:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD on the given rows of ``weight``, in place: per row
    ``m += mean(g^2); w -= lr * g / (sqrt(m) + eps)``. Rows not given do not move (nor their state)."""
    with torch.no_grad():
        momentum[rows] += grad_rows.pow(2).mean(dim=1)
        weight.index_add_(0, rows, grad_rows * (-lr / (momentum[rows].sqrt() + eps))[:, None])


def rowwise_adagrad_step(bags, states, lr: float = LR, eps: float = EPS) -> None:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD in plain torch ops on the bags' sparse gradients."""
    for bag, state in zip(bags, states):
        grad = bag.weight.grad.coalesce()
        rowwise_adagrad_rows_(bag.weight, state, grad.indices()[0], grad.values(), lr, eps)
        bag.weight.grad = None


def _shape(specs, batch: int, indices: torch.Tensor) -> str:
    rows = sum(s.num_embeddings for s in specs)
    gb = sum(s.num_embeddings * s.embedding_dim for s in specs) * 4 / 1e9
    return (f"T={len(specs)} rows={rows / 1e6:.2f}M ({gb:.2f} GB) D={sorted({s.embedding_dim for s in specs})} "
            f"B={batch} L~{indices.numel() / (len(specs) * batch):.0f} zipf={ZIPF_ALPHA}")


def cases(quick: bool, device: torch.device) -> Iterator[Case]:
    if quick:
        specs, batch, num_sets = table_specs(4, 1000, 20_000), 256, 2
    elif device.type == "cuda":
        specs, batch, num_sets = table_specs(26, 10_000, 5_000_000), 16384, 3
    else:
        specs, batch, num_sets = table_specs(26, 1000, 500_000), 4096, 2
    dtype = torch.float32
    backends = [b for b in (("cuda", "triton", "reference") if device.type == "cuda" else ("cpu", "reference"))
                if b in gk.available_backends() and (b in ("cpu", "reference") or device.type == "cuda")]
    batches = [zipf_batch(specs, batch, SEED + i) for i in range(num_sets)]
    batches = [(i.to(device), o.to(device)) for i, o in batches]
    dims = [s.embedding_dim for s in specs]
    first_indices, first_offsets = (x.cpu() for x in batches[0])
    bounds = [(int(first_offsets[t * batch]), int(first_offsets[(t + 1) * batch])) for t in range(len(specs))]
    lookups = [hi - lo for lo, hi in bounds]
    unique = flops.embedding_bag_distinct_rows(first_indices, first_offsets, len(specs), batch)
    shape = _shape(specs, batch, batches[0][0])
    _, fbgemm_why = _fbgemm_tbe(specs, None, "sum", reason_only=True)
    if device.type != "cpu" and fbgemm_why is None:
        fbgemm_why = "fbgemm omitted: this bench builds fbgemm's CPU TBE only"
    notes = [fbgemm_why] if fbgemm_why else []
    if device.type == "cpu":
        notes.append("FusedEmbeddingBag asks for transparent huge pages for its weights (madvise); the forward's "
                     "eager-loop/compile read those same weights, fbgemm and the fwd+bwd copies use torch's "
                     "default allocation")
    if quick:
        notes.append("compile omitted in --quick: compiling takes longer than the quick budget")

    # ---- forward (inference: no autograd graph) ----
    module = gk.FusedEmbeddingBag(specs, pooling="sum", dtype=dtype, device=device)
    arg_sets = [(i, o, _table_offsets(o, len(specs), batch)) for i, o in batches]
    impls: dict[str, Callable] = {}
    for backend in backends:
        impls[backend] = rotate(arg_sets, lambda i, o, _, b=backend: _no_grad(
            lambda: gk.embedding_bag(module.weights, module.table_meta, i, o, output_dim=module.output_dim,
                                     pooling="sum", backend=b)))
    bags = _eager_bags(module, copy=False)
    loop = _loop_forward(bags, batch)
    impls["eager-loop"] = rotate(arg_sets, lambda i, o, tables: _no_grad(lambda: loop(i, tables)))
    if not quick:  # compiling takes longer than the whole quick budget
        compiled = torch.compile(loop, dynamic=False)
        impls["compile"] = rotate(arg_sets, lambda i, o, tables: _no_grad(lambda: compiled(i, tables)))
    if fbgemm_why is None:
        tbe, _ = _fbgemm_tbe(specs, lambda t: module.weight(t).detach(), "sum")
        impls["fbgemm"] = rotate(arg_sets, lambda i, o, _: _no_grad(lambda: tbe(i, o)))
    case_flops, formula_bytes = flops.embedding_bag(lookups, dims, batch, 4, 8)
    floor_bytes = flops.embedding_bag_floor(first_indices, first_offsets, dims, batch, 4)
    # The roof of a pooled lookup: reading these rows of these tables in this order (bench.peaks).
    # Measured here to find its best reader, then timed again interleaved with the impls (Case.gather_roof),
    # reading the rows of the same rotating input sets, which is what the rows' % of gather divides by.
    weights = [module.weight(t).detach() for t in range(len(specs))]
    roof = gather_roof(weights, [batches[0][0][lo:hi] for lo, hi in bounds], device)
    roof_call = None
    if device.type == "cpu":  # the harness interleaves on the CPU only
        roof_sets = []
        for i, o in batches:
            cut = o[::batch].tolist()  # every table's first offset, and the end
            roof_sets.append((gather_roof_call(weights, [i[lo:hi] for lo, hi in zip(cut, cut[1:])], roof["best"],
                                               device),))
        roof_call = rotate(roof_sets, lambda read: read())
    measured = f"ATen index_select {roof['aten_gbps']:.1f}"
    if roof["prefetched_gbps"]:
        measured += "; prefetching reader " + ", ".join(f"distance {d}: {g:.1f}"
                                                        for d, g in roof["prefetched_gbps"].items())
    gather_note = (f"gather peak {roof['gbps']:.1f} GB/s ({roof['best']}): batch 0's looked-up rows read in its order "
                   f"from these tables, the best of bench.peaks.gather_roof's readers ({measured} GB/s), measured "
                   f"before the impls; that reader is then timed again interleaved with them, on the same input sets "
                   f"(the roof the rows' % of gather divides). What the impls do and the roof does not: write the "
                   f"[B, sum D] output (for cpu: ~5 % of the roof's time at 1 thread, its streaming stores into a "
                   f"reused block; an impl with a fresh block also pays its first touch, see faults/call), "
                   f"keep bags (offsets, sums; cpu ~2 %; bench/results/notes-emb9.md)")
    bags64 = _eager_bags(module, copy=True, dtype=torch.float64)
    yield Case(op="embedding_bag fwd", shape=shape, dtype=dtype, flops=case_flops, bytes=floor_bytes,
               formula_bytes=formula_bytes, impls=impls, baseline="eager-loop", peak="bandwidth",
               notes=[*notes, gather_note], gather_gbps=roof["gbps"], gather_roof=roof_call,
               reference="eager-loop", fp64=lambda: _no_grad(lambda: _loop_forward(bags64, batch)(*arg_sets[0][::2])),
               compiled=[n for n in impls if n == "compile"])
    del bags64
    del impls, loop, bags
    if fbgemm_why is None:
        del tbe

    # ---- forward + backward + ExactRowwiseAdagrad: every impl owns a copy of the same weights ----
    gen = torch.Generator().manual_seed(SEED + 7)
    grad_sets = [torch.randn(batch, module.output_dim, generator=gen).to(device) for _ in batches]
    arg_sets = [(i, o, _table_offsets(o, len(specs), batch), g) for (i, o), g in zip(batches, grad_sets)]
    optimizer = gk.optim.ExactRowwiseAdagrad(lr=LR, eps=EPS)
    # What the first step changes, read after the verification call: the rows batch 0 touched, a
    # sample of rows it did not touch (they must not move), and the row-wise state of both.
    touched = [first_indices[lo:hi].unique().to(device) for lo, hi in bounds]
    untouched = [_untouched_sample(spec.num_embeddings, ids.cpu(), SEED + t).to(device)
                 for t, (spec, ids) in enumerate(zip(specs, touched))]

    def reader(weight_of, momentum_of):
        def read():
            with torch.no_grad():
                return {"rows": [weight_of(t)[touched[t]].clone() for t in range(len(specs))],
                        "momentum": [momentum_of(t)[touched[t]].clone() for t in range(len(specs))],
                        "untouched rows": [weight_of(t)[untouched[t]].clone() for t in range(len(specs))],
                        "untouched momentum": [momentum_of(t)[untouched[t]].clone() for t in range(len(specs))]}
        return read

    impls, state = {}, {}
    for backend in backends:
        fused = gk.FusedEmbeddingBag(specs, pooling="sum", dtype=dtype, device=device, optimizer=optimizer,
                                     backend=backend)
        with torch.no_grad():
            fused.weights.copy_(module.weights)
            fused.momentum1.fill_(WARM_MOMENTUM)
        impls[backend] = rotate(arg_sets, lambda i, o, _, g, m=fused: _fused_step(m, i, o, g))
        state[backend] = reader(fused.weight, lambda t, m=fused: _rows_slice(m.momentum1, specs, t))
    for name in ("eager-loop",) if quick else ("eager-loop", "compile"):
        bags = _eager_bags(module, copy=True)
        states = [torch.full((b.num_embeddings,), WARM_MOMENTUM, device=device) for b in bags]
        loop = _loop_forward(bags, batch)
        fwd = loop if name == "eager-loop" else torch.compile(loop, dynamic=False)
        impls[name] = rotate(arg_sets, lambda i, o, tables, g, fwd=fwd, bags=bags, states=states:
                             _eager_step(fwd, bags, states, i, tables, g))
        state[name] = reader(lambda t, bags=bags: bags[t].weight, lambda t, states=states: states[t])
    if fbgemm_why is None:
        tbe, _ = _fbgemm_tbe(specs, lambda t: module.weight(t).detach(), "sum")
        with torch.no_grad():
            for (momentum,) in tbe.split_optimizer_states():  # views of the TBE's state
                momentum.fill_(WARM_MOMENTUM)
        impls["fbgemm"] = rotate(arg_sets, lambda i, o, _, g: _fbgemm_step(tbe, i, o, g))
        state["fbgemm"] = reader(lambda t: tbe.split_embedding_weights()[t],
                                 lambda t: tbe.split_optimizer_states()[t][0])
    fwd_flops, fwd_bytes = flops.embedding_bag(lookups, dims, batch, 4, 8)
    bwd_flops, bwd_bytes = flops.embedding_bag_backward_rowwise_adagrad(lookups, unique, dims, batch, 4, 8)
    floor_bytes = flops.embedding_bag_floor(first_indices, first_offsets, dims, batch, 4, rowwise_adagrad=True)
    yield Case(op="embedding_bag fwd+bwd+rowwise_adagrad", shape=shape, dtype=dtype, flops=fwd_flops + bwd_flops,
               bytes=floor_bytes, formula_bytes=fwd_bytes + bwd_bytes, impls=impls, baseline="eager-loop",
               peak="bandwidth",
               notes=notes + ["eager-loop/compile: nn.EmbeddingBag(sparse=True) per table + row-wise Adagrad in "
                              "torch ops (compile: the forward loop compiled)"],
               reference="eager-loop", fp64=lambda: _eager_step_fp64(module, batch, arg_sets[0], reader),
               state=state, compiled=[n for n in impls if n == "compile"])


def _rows_slice(per_row: torch.Tensor, specs, t: int) -> torch.Tensor:
    """Table t's part of a packed per-row buffer (FusedEmbeddingBag's row-wise momentum1)."""
    start = sum(s.num_embeddings for s in specs[:t])
    return per_row[start:start + specs[t].num_embeddings]


def _untouched_sample(num_rows: int, touched: torch.Tensor, seed: int, size: int = 64) -> torch.Tensor:
    """Up to ``size`` row ids of a table that ``touched`` does not hold."""
    free = torch.ones(num_rows, dtype=torch.bool)
    free[touched] = False
    ids = free.nonzero().flatten()
    return ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))[:size]]


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def _fused_step(module, indices, offsets, grad):
    out = module(indices, offsets)
    out.backward(grad)
    return out.detach()


def _eager_step(forward, bags, states, indices, tables, grad):
    out = forward(indices, tables)
    out.backward(grad)
    rowwise_adagrad_step(bags, states)
    return out.detach()


def _fbgemm_step(tbe, indices, offsets, grad):
    out = tbe(indices, offsets)
    out.backward(grad)
    return out.detach()

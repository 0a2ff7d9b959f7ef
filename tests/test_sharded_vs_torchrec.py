"""gem_kernels' collections sharded by DMP with gem_kernels' sharders against TorchRec + FBGEMM (the
unswapped EmbeddingBagCollection / EmbeddingCollection under DMP with TorchRec's default sharders),
on the same plan and the same weights, on 2 gloo ranks (issue 24 item 10).

The route is the README's: ``gk.swap(model, optimizer=ExactSGD(lr))``, then DMP with
``FusedEmbeddingBagCollectionSharder()`` / ``FusedEmbeddingCollectionSharder()``. TorchRec's side
trains its tables with FBGEMM's fused EXACT_SGD at the same lr (SGD: the update is Lipschitz in the
gradient, so updated tables can be compared). Every case has a table shared by two features and a
table of its own; plans: every one the sharders offer on the CPU (table-wise, column-wise and, for
the bag collection, table-column-wise); sum and mean pooling, per-sample weights; int32 and int64
lengths.

Verification (FlashAttention's rule): each side's outputs at every step and its tables after the
steps against a float64 run of the same computation on the global batch (``_reference``); ours may
err by at most twice TorchRec + FBGEMM's error plus a small atol. TorchRec + FBGEMM's error is taken
against what it computes: with per-sample weights, FBGEMM's CPU MEAN backward is the weighted sum's
(its forward divides by the length, its backward does not), and the test asserts that divergence.
One spawn of 2 ranks runs every case (a process start costs seconds of imports).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

pytest.importorskip("torchrec")

from gem_kernels.torchrec.sharding import (FusedEmbeddingBagCollectionSharder,  # noqa: E402
                                           FusedEmbeddingCollectionSharder)
from tests.test_distributed import _assemble, _get, _load_full_tables, _local_state, _run_spawned  # noqa: E402

WORLD = 2
GLOBAL_BATCH = 6
STEPS = 2
LR = 0.5
ATOL = 1e-5


def _plans(sharder) -> tuple:
    """The model-parallel plans a gem_kernels sharder offers on the CPU."""
    return tuple(t for t in sharder.sharding_types("cpu") if t != "data_parallel")


# (table, rows, dim, features): t0 is read by two features (a shared table)
TABLES = (("t0", 59, 8, ("f0", "f1")), ("t1", 31, 8, ("f2",)))
FEATURES = [f for *_, fs in TABLES for f in fs]
ROWS = {f: rows for _, rows, _, fs in TABLES for f in fs}
BAG_PLANS = _plans(FusedEmbeddingBagCollectionSharder())
SEQ_PLANS = _plans(FusedEmbeddingCollectionSharder())
# Lengths' dtype alternates rather than doubling every case (CI time): each plan meets int32 and
# int64 lengths, and so does each pooling and each of weighted / unweighted.
BAG_CASES = [dict(kind="bag", plan=p, pooling=q, weighted=w, lengths="int32" if (q == "mean") == w else "int64")
             for p, q, w in itertools.product(BAG_PLANS, ("sum", "mean"), (False, True))]
SEQ_CASES = [dict(kind="seq", plan=p, pooling="none", weighted=False, lengths=("int32", "int64")[i % 2])
             for i, p in enumerate(SEQ_PLANS)]
CASES = BAG_CASES + SEQ_CASES


def _name(case: dict) -> str:
    return "-".join(str(v) for v in case.values())


# ------------------------------------------------------------------------------------------------
# Data and the float64 reference
# ------------------------------------------------------------------------------------------------

def _global_batch(step: int, weighted: bool):
    """Per feature: lengths [B] (0 to 3 ids: empty bags included), ids, per-sample weights."""
    g = torch.Generator().manual_seed(1000 + step)
    batch = {}
    for f in FEATURES:
        lengths = torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
        lengths[step % GLOBAL_BATCH] = 0
        ids = torch.randint(0, ROWS[f], (int(lengths.sum()),), generator=g)
        weights = torch.rand(int(lengths.sum()), generator=g) + 0.5 if weighted else None
        batch[f] = (lengths, ids, weights)
    return batch


def _local_kjt(step: int, case: dict, rank: int):
    from torchrec import KeyedJaggedTensor

    local = GLOBAL_BATCH // WORLD
    lengths, values, weights = [], [], []
    for f, (ln, ids, w) in _global_batch(step, case["weighted"]).items():
        start, count = int(ln[:rank * local].sum()), int(ln[rank * local:(rank + 1) * local].sum())
        lengths.append(ln[rank * local:(rank + 1) * local])
        values.append(ids[start:start + count])
        if w is not None:
            weights.append(w[start:start + count])
    dtype = torch.int32 if case["lengths"] == "int32" else torch.int64
    return KeyedJaggedTensor(keys=FEATURES, values=torch.cat(values), lengths=torch.cat(lengths).to(dtype),
                             weights=torch.cat(weights) if weights else None)


def _targets(step: int, key: str, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + FEATURES.index(key))
    return torch.randn(rows, 8, generator=g)


def _lookup64(tables: dict, case: dict, batch: dict, fbgemm_mean_backward: bool = False) -> dict:
    """Per feature, float64: the pooled [B, dim] bags (sum; mean = weighted sum / length, FBGEMM's), or
    the [ids, dim] rows of a sequence collection. ``fbgemm_mean_backward``: the same values, but the
    gradient of a weighted mean is the weighted sum's (FBGEMM's CPU TBE drops the 1/length there)."""
    out = {}
    for table, _, _, features in TABLES:
        for f in features:
            lengths, ids, weights = batch[f]
            rows = tables[table][ids]
            if case["kind"] == "seq":
                out[f] = rows
                continue
            if weights is not None:
                rows = rows * weights.double()[:, None]
            bag = torch.repeat_interleave(torch.arange(GLOBAL_BATCH), lengths)
            pooled = torch.zeros(GLOBAL_BATCH, rows.shape[1], dtype=torch.float64).index_add(0, bag, rows)
            if case["pooling"] == "mean":
                mean = pooled / lengths.clamp(min=1).double()[:, None]
                pooled = pooled + (mean - pooled).detach() if fbgemm_mean_backward else mean
            out[f] = pooled
    return out


def _loss(outputs: dict, step: int) -> torch.Tensor:
    """Half the squared distance of every output row to a fixed target: gradients depend on the outputs."""
    return sum(0.5 * ((out - _targets(step, key, out.shape[0]).to(out.dtype)) ** 2).sum()
               for key, out in sorted(outputs.items()))


def _reference(initial: dict, case: dict, fbgemm_mean_backward: bool = False) -> dict:
    """The float64 run on the global batch: outputs of every step (split per rank like the sharded
    runs), losses (summed over ranks), and the tables after STEPS fused SGD steps. A row's gradient
    is the sum over every rank's samples divided by the world size: TorchRec's embedding
    all-to-alls divide the gradient they send back (``comm_ops`` gradient division, on by default,
    so that tables see the mean over ranks as DDP's dense parameters do)."""
    from torchrec.distributed.comm_ops import get_gradient_division

    divisor = WORLD if get_gradient_division() else 1
    tables = {name: initial[f"model.coll.{_prefix(case)}.{name}.weight"].double() for name, *_ in TABLES}
    outputs, losses = [], []
    for step in range(STEPS):
        batch = _global_batch(step, case["weighted"])
        leaves = {k: v.clone().requires_grad_(True) for k, v in tables.items()}
        out = _lookup64(leaves, case, batch, fbgemm_mean_backward)
        per_rank = [_split_rank(out, batch, case, rank) for rank in range(WORLD)]
        loss = sum(_loss(p, step) for p in per_rank)
        (loss / divisor).backward()
        outputs.append([{k: v.detach() for k, v in p.items()} for p in per_rank])
        losses.append(float(loss.detach()))
        tables = {k: (leaves[k] - LR * leaves[k].grad).detach() for k in tables}
    return {"outputs": outputs, "losses": losses,
            "tables": {f"model.coll.{_prefix(case)}.{k}.weight": v for k, v in tables.items()}}


def _split_rank(out: dict, batch: dict, case: dict, rank: int) -> dict:
    local = GLOBAL_BATCH // WORLD
    if case["kind"] == "bag":
        return {f: v[rank * local:(rank + 1) * local] for f, v in out.items()}
    parts = {}
    for f, v in out.items():
        lengths = batch[f][0]
        start = int(lengths[:rank * local].sum())
        parts[f] = v[start:start + int(lengths[rank * local:(rank + 1) * local].sum())]
    return parts


def _prefix(case: dict) -> str:
    return "embedding_bags" if case["kind"] == "bag" else "embeddings"


# ------------------------------------------------------------------------------------------------
# What every rank runs
# ------------------------------------------------------------------------------------------------

class _Model(torch.nn.Module):
    """The collection under a parent, as in a model: DMP shards ``coll``; outputs per feature."""

    def __init__(self, coll, pooled: bool):
        super().__init__()
        self.coll, self.pooled = coll, pooled

    def forward(self, features):
        out = self.coll(features)  # sharded: a LazyAwaitable of the KeyedTensor / dict[str, JaggedTensor]
        return out.to_dict() if self.pooled else {k: jt.values() for k, jt in out.items()}


def _collection(case: dict):
    from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig,
                          PoolingType)

    torch.manual_seed(0)
    if case["kind"] == "bag":
        pooling = PoolingType.SUM if case["pooling"] == "sum" else PoolingType.MEAN
        configs = [EmbeddingBagConfig(name=t, num_embeddings=rows, embedding_dim=dim, feature_names=list(fs),
                                      pooling=pooling) for t, rows, dim, fs in TABLES]
        coll = EmbeddingBagCollection(tables=configs, is_weighted=case["weighted"], device=torch.device("cpu"))
        tables = coll.embedding_bags
    else:
        configs = [EmbeddingConfig(name=t, num_embeddings=rows, embedding_dim=dim, feature_names=list(fs))
                   for t, rows, dim, fs in TABLES]
        coll = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
        tables = coll.embeddings
    for table in tables.values():  # N(0, 1): rows far from TorchRec's small uniform init
        torch.nn.init.normal_(table.weight)
    return _Model(coll, pooled=case["kind"] == "bag")


def _per_table_plan(plan: str):
    import dataclasses

    from torchrec.distributed.sharding_plan import column_wise, table_wise
    from torchrec.distributed.types import ShardingType

    fused = "fused"
    if plan == "table_wise":
        return {"t0": table_wise(rank=0, compute_kernel=fused), "t1": table_wise(rank=1, compute_kernel=fused)}
    if plan == "column_wise":
        return {"t0": column_wise(ranks=[0, 1], compute_kernel=fused),
                "t1": column_wise(ranks=[1, 0], compute_kernel=fused)}

    def twcw(ranks):  # TorchRec has no generator for it: column shards on one host's ranks
        cw = column_wise(ranks=ranks, compute_kernel=fused)
        return lambda *args, **kw: dataclasses.replace(cw(*args, **kw),
                                                       sharding_type=ShardingType.TABLE_COLUMN_WISE.value)

    if plan == "table_column_wise":  # t1: both column shards on rank 1
        return {"t0": twcw([0, 1]), "t1": twcw([1, 1])}
    raise ValueError(f"no per-table plan for {plan!r}: add one for every plan a sharder offers")


def _dmp(model, sharder, plan: str):
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    module_plan = construct_module_sharding_plan(model.coll, _per_table_plan(plan), sharder=sharder,
                                                 local_size=WORLD, world_size=WORLD, device_type="cpu")
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                    device=torch.device("cpu"), sharders=[sharder],
                                    plan=ShardingPlan({"coll": module_plan}))


def _run_case(case: dict, ours: bool, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import gem_kernels as gk

    assert world == WORLD
    model = _collection(case)
    full = {f"coll.{k}": v.detach().clone() for k, v in model.coll.state_dict().items()}
    if ours:
        gk.swap(model, optimizer=gk.optim.ExactSGD(lr=LR))
        sharder = FusedEmbeddingBagCollectionSharder() if case["kind"] == "bag" else FusedEmbeddingCollectionSharder()
    else:
        fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
        sharder = (EmbeddingBagCollectionSharder(fused_params=fused) if case["kind"] == "bag"
                   else EmbeddingCollectionSharder(fused_params=fused))
    dmp = _dmp(model, sharder, case["plan"])
    _load_full_tables(dmp, full)  # TorchRec's CPU shards start from their own init: both start from `full`
    initial = _local_state(dmp)
    outputs, losses = [], []
    for step in range(STEPS):
        out = dmp(_local_kjt(step, case, rank))
        loss = _loss(out, step)
        loss.backward()  # the fused optimizers update the tables here
        outputs.append({k: v.detach().clone() for k, v in out.items()})
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(float(reduced))
    kernels = sorted({type(kernel).__name__ for m in dmp.modules() if hasattr(m, "_lookups")
                      for lookup in m._lookups for kernel in lookup._emb_modules})
    return {"outputs": outputs, "losses": losses, "initial": initial, "state": _local_state(dmp), "kernels": kernels}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    jobs = [(f"{_name(case)}/{ours}", _run_case, (case, ours)) for case in CASES for ours in (True, False)]
    return _run_spawned(WORLD, jobs, os.path.join(str(tmp_path_factory.mktemp("sharded")), "w2"))


def _max_err(got, want) -> float:
    return float((got.double() - want.double()).abs().max()) if want.numel() else 0.0


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_sharded_equals_torchrec_fbgemm(runs, case):
    """Outputs of every step on every rank, and every table after the steps: gem_kernels' error
    against float64 is at most twice TorchRec + FBGEMM's, plus ATOL."""
    ours, theirs = _get(runs, f"{_name(case)}/True"), _get(runs, f"{_name(case)}/False")
    assert ours[0]["kernels"] and all(k.startswith("GemBatchedFused") for k in ours[0]["kernels"]), ours[0]["kernels"]
    assert not any(k.startswith("Gem") for k in theirs[0]["kernels"]), theirs[0]["kernels"]
    initial = _assemble([r["initial"] for r in theirs])
    torch.testing.assert_close(_assemble([r["initial"] for r in ours]), initial, atol=0, rtol=0)
    ref = _reference(initial, case)
    # TorchRec + FBGEMM's error is measured against the computation it does: with per-sample weights
    # its MEAN backward is the weighted sum's (FBGEMM's CPU TBE drops 1/length; its forward divides).
    fbgemm_diverges = case["weighted"] and case["pooling"] == "mean"
    base_ref = _reference(initial, case, fbgemm_mean_backward=True) if fbgemm_diverges else ref
    worst = {"output": 0.0, "table": 0.0}
    for step in range(STEPS):
        for rank in range(WORLD):
            want, base_want = ref["outputs"][step][rank], base_ref["outputs"][step][rank]
            got, base = ours[rank]["outputs"][step], theirs[rank]["outputs"][step]
            assert sorted(got) == sorted(base) == sorted(want), (sorted(got), sorted(base))
            for key in want:
                assert got[key].shape == base[key].shape == want[key].shape, key
                err, base_err = _max_err(got[key], want[key]), _max_err(base[key], base_want[key])
                assert err <= 2 * base_err + ATOL, f"step {step} rank {rank} {key}: {err} vs TorchRec {base_err}"
                worst["output"] = max(worst["output"], _max_err(got[key], base[key]))
    state, base_state = _assemble([r["state"] for r in ours]), _assemble([r["state"] for r in theirs])
    for key, want in ref["tables"].items():
        err, base_err = _max_err(state[key], want), _max_err(base_state[key], base_ref["tables"][key])
        assert err <= 2 * base_err + ATOL, f"{key}: {err} vs TorchRec {base_err}"
        worst["table"] = max(worst["table"], _max_err(state[key], base_state[key]))
        # the tables moved (a fused optimizer that did nothing would fail here)
        assert _max_err(want, initial[key]) > 1e-2, key
        # the divergence is real: TorchRec + FBGEMM's tables are far from the float64 gradient step
        assert (_max_err(base_state[key], want) > 1e-2) == fbgemm_diverges, key
    torch.testing.assert_close(ours[0]["losses"], ref["losses"], atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(theirs[0]["losses"], base_ref["losses"], atol=1e-4, rtol=1e-6)
    print(f"\n{_name(case)} losses ours {[round(x, 6) for x in ours[0]['losses']]} "
          f"TorchRec+FBGEMM {[round(x, 6) for x in theirs[0]['losses']]} float64 "
          f"{[round(x, 6) for x in ref['losses']]}; max |ours - TorchRec| outputs {worst['output']:.3g} "
          f"tables {worst['table']:.3g}")

"""Table-wise sharding of gk.torchrec.ZchEmbeddingBagCollection (issue 28, "Sharding"): under
TorchRec's DistributedModelParallel on 2 gloo ranks, ZchEmbeddingBagCollectionSharder gives the
unsharded module's outputs, identity tables and fused updates on the same stream of raw ids; its
state_dict holds the identity tables under the unsharded module's keys (a DCP checkpoint resumes
exactly, and loads into the unsharded module); ttl_unit "seconds" takes the batch's timestamp."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec")

WORLD, GLOBAL_BATCH, STEPS = 2, 8, 5
ROWS, DIMS = (10, 12, 9), (4, 8, 4)


def _module(optimizer, **zch):
    from torchrec import EmbeddingBagConfig

    from gem_kernels.torchrec import ZchEmbeddingBagCollection

    torch.manual_seed(0)  # the initial tables (the default rows keep theirs) are the same in every process
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=r, feature_names=[f"f{i}"])
               for i, (r, d) in enumerate(zip(ROWS, DIMS))]
    return ZchEmbeddingBagCollection(configs, optimizer=optimizer, **({"eviction": "lru"} | zch), seed=7)


def _global_batch(step: int):
    """lengths [3, B] (0 to 3 ids), raw ids of a window that drifts by 3 per step (the tables evict),
    the output gradient [B, sum D]."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (3, GLOBAL_BATCH), generator=g)
    population = torch.randint(-(2**62), 2**62, (3, 40 + 3 * STEPS), generator=torch.Generator().manual_seed(99))
    ids = [population[f, 3 * step + torch.randint(0, 20, (int(lengths[f].sum()),), generator=g)] for f in range(3)]
    grad = torch.randn(GLOBAL_BATCH, sum(DIMS), generator=g)
    return lengths, ids, grad


def _kjt(lengths, ids, samples: slice):
    from torchrec import KeyedJaggedTensor

    values = []
    for f in range(3):
        start = int(lengths[f, :samples.start].sum())
        values.append(ids[f][start:start + int(lengths[f, samples].sum())])
    return KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], values=torch.cat(values),
                                             lengths=lengths[:, samples].reshape(-1))


class _Wrapper(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc

    def forward(self, features, timestamp=None):
        pooled, _ = self.ebc(features, **({} if timestamp is None else {"timestamp": timestamp}))
        return torch.cat([pooled[f"f{i}"] for i in range(3)], dim=1)


def _dmp(module):
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from gem_kernels.torchrec import ZchEmbeddingBagCollectionSharder, sharding_plan

    model = _Wrapper(module)
    sharder = ZchEmbeddingBagCollectionSharder()
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                    device=torch.device("cpu"), sharders=[sharder],
                                    plan=sharding_plan(model, [sharder], "table_wise", compute_device="cpu"))


def _local_zch(dmp) -> dict:
    """This rank's part of the sharded state_dict's ``ebc.zch.*``: key -> (global size, [(row offset,
    shard)]) for ShardedTensors, else the tensor."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for key, value in dmp.state_dict().items():
        if ".zch." in key:
            out[key] = ((tuple(value.size()), [(s.metadata.shard_offsets[0], s.tensor.clone())
                                               for s in value.local_shards()])
                        if isinstance(value, ShardedTensor) else value.clone())
    return out


def _assemble_int(rank_parts: list) -> dict:
    """Whole int64 tensors from the ranks' ``_local_zch`` (every row held by exactly one rank)."""
    full = {}
    for part in rank_parts:
        for key, value in part.items():
            if not isinstance(value, tuple):
                full.setdefault(key, (value, None))
                continue
            size, shards = value
            tensor, held = full.setdefault(key, (torch.zeros(size, dtype=torch.int64),
                                                 torch.zeros(size[0], dtype=torch.int64)))
            for start, shard in shards:
                tensor[start:start + len(shard)] = shard
                held[start:start + len(shard)] += 1
    for key, (tensor, held) in full.items():
        assert held is None or bool((held == 1).all()), f"{key}: rows held by {held.tolist()} ranks"
    return {key: tensor for key, (tensor, _) in full.items()}


def _sharded_run(rank: int, world: int) -> dict:
    import gem_kernels as gk

    dmp = _dmp(_module(gk.optim.ExactSGD(lr=0.5)))
    dmp.train()
    local = GLOBAL_BATCH // world
    samples = slice(rank * local, (rank + 1) * local)
    outputs = []
    for step in range(STEPS):
        lengths, ids, grad = _global_batch(step)
        out = dmp(_kjt(lengths, ids, samples))
        (out * grad[samples]).sum().backward()
        outputs.append(out.detach().clone())
    sharded = dmp.module.ebc
    tables = {name: {k: v.clone() for k, v in zch.state_dict().items()} for name, zch in sharded.zch_tables().items()}
    weights = {name: bag.weight(0).detach().clone() for lookup in sharded._lookups for kernel in lookup._emb_modules
               for name, bag in zip(kernel.emb_module.names, kernel.emb_module.tables)}
    return {"outputs": outputs, "tables": tables, "weights": weights}


RESUME_AT = 3


def _train_steps(dmp, steps, rank: int, world: int, timestamps=None) -> list:
    local = GLOBAL_BATCH // world
    samples = slice(rank * local, (rank + 1) * local)
    outputs = []
    for step in steps:
        lengths, ids, grad = _global_batch(step)
        out = dmp(_kjt(lengths, ids, samples), None if timestamps is None else timestamps[step])
        (out * grad[samples]).sum().backward()
        outputs.append(out.detach().clone())
    return outputs


def _checkpoint_run(directory: str, rank: int, world: int) -> dict:
    """A: RESUME_AT steps, a DCP checkpoint of its state_dict, then the rest of the steps. B, a fresh
    module: loads the checkpoint, then the same rest. Then B in eval mode looks up a batch of new ids."""
    import torch.distributed.checkpoint as dcp

    import gem_kernels as gk

    optimizer = gk.optim.ExactRowwiseAdagrad(lr=0.5)
    a = _dmp(_module(optimizer))
    a.train()
    _train_steps(a, range(RESUME_AT), rank, world)
    saved = _local_zch(a)
    dcp.save({"model": a.state_dict(), "optim": a.fused_optimizer.state_dict()}, checkpoint_id=directory)
    straight = _train_steps(a, range(RESUME_AT, STEPS), rank, world)
    b = _dmp(_module(optimizer))
    state = {"model": b.state_dict(), "optim": b.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    b.load_state_dict(state["model"])
    b.fused_optimizer.load_state_dict(state["optim"])
    loaded = _local_zch(b)
    b.train()
    resumed = _train_steps(b, range(RESUME_AT, STEPS), rank, world)
    trained = _local_zch(b)
    b.eval()
    with torch.no_grad():
        evaluated = b(_kjt(*_global_batch(STEPS + 3)[:2], slice(rank * GLOBAL_BATCH // world,
                                                                         (rank + 1) * GLOBAL_BATCH // world)))
    after_eval = _local_zch(b)
    return {"saved": saved, "loaded": loaded, "straight": straight, "resumed": resumed, "trained": trained,
            "final_a": _local_zch(a), "after_eval": after_eval, "eval_rows": evaluated.shape[0]}


TIMESTAMPS = (100, 101, 103, 106, 107)  # ttl 2 s: ids unseen for 2 s may go (steps 2, 3 evict)


def _seconds_run(rank: int, world: int) -> dict:
    """TTL in seconds: rank r passes the batch's timestamp minus r (the ranks agree on the largest);
    then a training call where rank 1 passes no timestamp."""
    import gem_kernels as gk

    dmp = _dmp(_module(gk.optim.ExactSGD(lr=0.5), eviction="ttl", ttl=2, ttl_unit="seconds"))
    dmp.train()
    outputs = _train_steps(dmp, range(STEPS), rank, world, timestamps=[t - rank for t in TIMESTAMPS])
    tables = _local_zch(dmp)
    try:
        _train_steps(dmp, [0], rank, world, timestamps=[None if rank == 1 else 200])
        missing = None
    except ValueError as error:
        missing = str(error)
    return {"outputs": outputs, "tables": tables, "missing": missing}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's results (tests/test_distributed.py's spawned gloo group, started once)."""
    from .test_distributed import _run_spawned

    directory = tmp_path_factory.mktemp("zch_dist")
    return _run_spawned(WORLD, [("zch", _sharded_run, ()), ("checkpoint", _checkpoint_run, (str(directory / "dcp"),)),
                                ("seconds", _seconds_run, ())], str(directory)), directory / "dcp"


@pytest.fixture(scope="module")
def sharded(runs):
    from .test_distributed import _get

    return _get(runs[0], "zch")


def _unsharded(steps, timestamps=None, **kw):
    """The unsharded module (world-size gradient division, as the sharded run's) after ``steps``, and its outputs."""
    module = _Wrapper(_module(**kw))
    module.train()
    outputs = []
    for step in steps:
        lengths, ids, grad = _global_batch(step)
        out = module(_kjt(lengths, ids, slice(0, GLOBAL_BATCH)), None if timestamps is None else timestamps[step])
        (out * grad).sum().div(WORLD).backward()
        outputs.append(out.detach())
    return module, outputs


def test_sharded_state_dict_holds_the_identity_tables_and_resumes_exactly(runs):
    """The sharded state_dict's ``ebc.zch.*`` (2 ranks, assembled) equal the unsharded module's
    state_dict after the same steps; a DCP checkpoint of it loads into a fresh sharded module
    exactly, and training on from it equals training on without it, bit for bit."""
    import gem_kernels as gk
    from .test_distributed import _get

    result = _get(runs[0], "checkpoint")
    saved = _assemble_int([r["saved"] for r in result])
    module, _ = _unsharded(range(RESUME_AT), optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.5))
    want = {k: v for k, v in module.state_dict().items() if k.startswith("ebc.zch.")}
    assert sorted(saved) == sorted(want)
    for key in want:
        assert torch.equal(saved[key], want[key]), key
    assert int(want["ebc.zch.table_state"][:, 6].sum()) > 0  # evictions happened before the checkpoint
    loaded = _assemble_int([r["loaded"] for r in result])
    for key in want:
        assert torch.equal(loaded[key], saved[key]), key
    for rank in range(WORLD):
        for step, (got, expected) in enumerate(zip(result[rank]["resumed"], result[rank]["straight"])):
            assert torch.equal(got, expected), f"rank {rank} step {RESUME_AT + step}"
    trained, final = _assemble_int([r["trained"] for r in result]), _assemble_int([r["final_a"] for r in result])
    for key in want:
        assert torch.equal(trained[key], final[key]), key
    assert not torch.equal(trained["ebc.zch.slot_meta"], saved["ebc.zch.slot_meta"])  # the resumed steps evicted


def test_sharded_checkpoint_loads_into_the_unsharded_module(runs):
    """The 2-rank DCP checkpoint, loaded into the unsharded module (no process group): its identity
    tables and weights are the unsharded module's after the same steps."""
    import torch.distributed.checkpoint as dcp

    import gem_kernels as gk

    results, directory = runs
    module, _ = _unsharded(range(RESUME_AT), optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.5))
    fresh = _Wrapper(_module(gk.optim.ExactRowwiseAdagrad(lr=0.5)))
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    fresh.load_state_dict(state["model"])
    for key, value in module.state_dict().items():
        if key.startswith("ebc.zch."):
            assert torch.equal(fresh.state_dict()[key], value), key
        elif key.startswith("ebc.embedding_bags."):
            torch.testing.assert_close(fresh.state_dict()[key], value, rtol=1e-6, atol=1e-6)


def test_sharded_eval_only_looks_up(runs):
    """dmp.eval() reaches the ranks' remap: a batch of new ids in eval admits and evicts nothing
    (only the hit counters move), as in the unsharded module."""
    from .test_distributed import _get

    result = _get(runs[0], "checkpoint")
    trained, after = _assemble_int([r["trained"] for r in result]), _assemble_int([r["after_eval"] for r in result])
    for key in ("ebc.zch.slot_meta", "ebc.zch.heap", "ebc.zch.index", "ebc.zch.step"):
        assert torch.equal(after[key], trained[key]), key
    assert (after["ebc.zch.table_state"][:, 9] > trained["ebc.zch.table_state"][:, 9]).all()  # looked up
    assert result[0]["eval_rows"] == GLOBAL_BATCH // WORLD


def test_ttl_seconds_sharded_equals_the_unsharded_module(runs):
    """ttl_unit "seconds" under the sharder: outputs and identity tables of the unsharded module fed
    the same timestamps (the ranks' largest), over a stream that evicts by TTL; a rank passing no
    timestamp fails on every rank."""
    import gem_kernels as gk
    from .test_distributed import _get

    result = _get(runs[0], "seconds")
    module, outputs = _unsharded(range(STEPS), TIMESTAMPS, optimizer=gk.optim.ExactSGD(lr=0.5), eviction="ttl",
                                 ttl=2, ttl_unit="seconds")
    local = GLOBAL_BATCH // WORLD
    for step in range(STEPS):
        for rank in range(WORLD):
            torch.testing.assert_close(result[rank]["outputs"][step], outputs[step][rank * local:(rank + 1) * local],
                                       rtol=1e-6, atol=1e-6, msg=lambda m, s=step, r=rank: f"step {s} rank {r}: {m}")
    tables = _assemble_int([r["tables"] for r in result])
    assert int(module.ebc.zch.table_state[:, 6].sum()) > 0  # TTL evicted
    for key, value in module.state_dict().items():
        if key.startswith("ebc.zch."):
            assert torch.equal(tables[key], value), key
    for rank in range(WORLD):
        assert "timestamp is required in training with ttl_unit 'seconds'" in (result[rank]["missing"] or "")


def test_table_wise_equals_the_unsharded_module(sharded):
    import gem_kernels as gk

    module = _Wrapper(_module(gk.optim.ExactSGD(lr=0.5)))
    module.train()
    local = GLOBAL_BATCH // WORLD
    for step in range(STEPS):
        lengths, ids, grad = _global_batch(step)
        out = module(_kjt(lengths, ids, slice(0, GLOBAL_BATCH)))
        # TorchRec divides the sharded tables' gradients by the world size (comm_ops' gradient
        # division: the ranks' losses are averaged, as DDP averages the dense gradients).
        (out * grad).sum().div(WORLD).backward()
        for rank in range(WORLD):
            torch.testing.assert_close(sharded[rank]["outputs"][step], out.detach()[rank * local:(rank + 1) * local],
                                       rtol=1e-6, atol=1e-6, msg=lambda m, s=step, r=rank: f"step {s} rank {r}: {m}")
    zch = module.ebc.zch
    assert sum(zch.stats()["evictions"]) > 0  # the stream made the tables evict
    slots, cells, _ = zch.layout.tolist()
    held = {}
    for rank in range(WORLD):
        held.update({name: (rank, state) for name, state in sharded[rank]["tables"].items()})
    assert sorted(held) == ["t0", "t1", "t2"] and {r for r, _ in held.values()} == {0, 1}
    for t in range(3):
        rank, state = held[f"t{t}"]
        # The identity table, its eviction metadata and hash index: exactly the unsharded table's.
        assert torch.equal(state["slot_meta"], zch.slot_meta[slots[t]:slots[t + 1]])
        assert torch.equal(state["index"], zch.index[cells[t]:cells[t + 1]])
        assert torch.equal(state["table_state"], zch.table_state[t:t + 1])
        torch.testing.assert_close(sharded[rank]["weights"][f"t{t}"], module.ebc.weight(f"t{t}").detach(),
                                   rtol=1e-6, atol=1e-6)


def test_other_sharding_types_are_refused():
    from torchrec.distributed.types import ShardingType

    from gem_kernels.torchrec import ZchEmbeddingBagCollection, ZchEmbeddingBagCollectionSharder

    sharder = ZchEmbeddingBagCollectionSharder()
    assert sharder.sharding_types("cpu") == [ShardingType.TABLE_WISE.value]
    assert sharder.module_type is ZchEmbeddingBagCollection

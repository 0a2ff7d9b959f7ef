"""Table-wise sharding of gk.torchrec.ZchEmbeddingBagCollection (issue 28, "Sharding"): under
TorchRec's DistributedModelParallel on 2 gloo ranks, ZchEmbeddingBagCollectionSharder gives the
unsharded module's outputs, identity tables and fused updates on the same stream of raw ids."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec")

WORLD, GLOBAL_BATCH, STEPS = 2, 8, 5
ROWS, DIMS = (10, 12, 9), (4, 8, 4)


def _module(optimizer):
    from torchrec import EmbeddingBagConfig

    from gem_kernels.torchrec import ZchEmbeddingBagCollection

    torch.manual_seed(0)  # the initial tables (the default rows keep theirs) are the same in every process
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=r, feature_names=[f"f{i}"])
               for i, (r, d) in enumerate(zip(ROWS, DIMS))]
    return ZchEmbeddingBagCollection(configs, optimizer=optimizer, eviction="lru", seed=7)


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

    def forward(self, features):
        pooled, _ = self.ebc(features)
        return torch.cat([pooled[f"f{i}"] for i in range(3)], dim=1)


def _sharded_run(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import gem_kernels as gk
    from gem_kernels.torchrec import ZchEmbeddingBagCollectionSharder, sharding_plan

    model = _Wrapper(_module(gk.optim.ExactSGD(lr=0.5)))
    sharder = ZchEmbeddingBagCollectionSharder()
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                   device=torch.device("cpu"), sharders=[sharder],
                                   plan=sharding_plan(model, [sharder], "table_wise", compute_device="cpu"))
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


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Every rank's result of ``_sharded_run`` (tests/test_distributed.py's spawned gloo group)."""
    from .test_distributed import _get, _run_spawned

    results = _run_spawned(WORLD, [("zch", _sharded_run, ())],
                           str(tmp_path_factory.mktemp("zch_dist")))
    return _get(results, "zch")


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


def test_other_sharding_types_and_seconds_are_refused():
    from torchrec.distributed.types import ShardingType

    import gem_kernels as gk
    from gem_kernels.torchrec import ZchEmbeddingBagCollection, ZchEmbeddingBagCollectionSharder

    sharder = ZchEmbeddingBagCollectionSharder()
    assert sharder.sharding_types("cpu") == [ShardingType.TABLE_WISE.value]
    assert sharder.module_type is ZchEmbeddingBagCollection
    module = _module(gk.optim.ExactSGD(lr=0.1))
    seconds = ZchEmbeddingBagCollection(module.embedding_bag_configs(), eviction="ttl", ttl=3, ttl_unit="seconds")
    with pytest.raises(ValueError, match="ttl_unit 'seconds' is not supported sharded"):
        sharder._options(seconds)

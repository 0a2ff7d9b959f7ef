"""gk.torchrec.ZchEmbeddingBagCollection: TorchRec's MC-EBC shape on the zero-collision remap, and gk.swap
of TorchRec's ManagedCollisionEmbeddingBagCollection (MCH modules)."""

from __future__ import annotations

import pytest
import torch

torchrec = pytest.importorskip("torchrec")

import gem_kernels as gk  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection  # noqa: E402
from torchrec.modules.mc_modules import (  # noqa: E402
    DistanceLFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from gem_kernels.torchrec import ZchEmbeddingBagCollection  # noqa: E402

BACKENDS = [b for b in ("reference", "cpu") if b in gk.available_backends()]


def configs():
    return [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=6, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=9, feature_names=["f2"],
                               pooling=PoolingType.MEAN)]


def kjt(step: int, batch: int = 3) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (3 * batch,), generator=g)
    values = (torch.randint(0, 8, (int(lengths.sum()),), generator=g) + step) * 1_000_003 - 2**62
    return KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths)


def expected(module: ZchEmbeddingBagCollection, features: KeyedJaggedTensor) -> torch.Tensor:
    """The pooled rows of each feature's ids, looked up by hand in the module's identity tables."""
    outs = []
    for key, jt in features.to_dict().items():
        t = 0 if key in ("f0", "f1") else 1
        ids, used = module.zch.table_ids(t).tolist(), module.zch.table_used(t).tolist()
        slot_of = {x: s for s, (x, u) in enumerate(zip(ids, used)) if u}
        weight = module.weight(f"t{t}").detach()
        rows = []
        for bag in jt.to_dense():
            vecs = [weight[slot_of.get(int(x), weight.shape[0] - 1)] for x in bag]
            pooled = torch.stack(vecs).sum(0) if vecs else weight.new_zeros(weight.shape[1])
            rows.append(pooled / max(len(vecs), 1) if t == 1 else pooled)
        outs.append(torch.stack(rows))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_pools_the_remapped_rows(backend):
    module = ZchEmbeddingBagCollection(configs(), optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1), backend=backend)
    module.train()
    for step in range(5):
        features = kjt(step)
        out, remapped = module(features)
        assert remapped is None and out.keys() == ["f0", "f1", "f2"]
        torch.testing.assert_close(out.values().detach(), expected(module, features))
        out.values().sum().backward()
    assert sum(module.zch.stats()["evictions"]) > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_restores_identity_tables(backend):
    first = ZchEmbeddingBagCollection(configs(), eviction="lfu", backend=backend)
    first.train()
    for step in range(4):
        first(kjt(step))
    state = first.state_dict()
    assert "embedding_bags.t0.weight" in state and "zch.slot_meta" in state
    second = ZchEmbeddingBagCollection(configs(), eviction="lfu", backend=backend)
    second.load_state_dict(state)
    second.train()
    for step in range(4, 7):
        assert torch.equal(first(kjt(step))[0].values(), second(kjt(step))[0].values())
    for key, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[key]), key


def mc_ebc(policy=None):
    tables = configs()
    mcms = {c.name: MCHManagedCollisionModule(zch_size=c.num_embeddings, device=torch.device("cpu"),
                                              eviction_interval=1, eviction_policy=policy or LRU_EvictionPolicy())
            for c in tables}
    mcc = ManagedCollisionCollection(managed_collision_modules=mcms, embedding_configs=tables)
    return ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=tables), mcc)


def test_swap_turns_mc_ebc_into_zch_and_keeps_every_held_id():
    model = torch.nn.Sequential(mc_ebc())
    model.train()
    for step in range(3):  # TorchRec's MCH admits ids as it trains
        model[0](kjt(step))
    model.eval()
    features = kjt(2)
    want = model[0](features)[0].values()
    report = gk.swap(model)
    assert [r[2] for r in report.replaced] == ["gem_kernels.torchrec.ZchEmbeddingBagCollection"]
    assert isinstance(model[0], ZchEmbeddingBagCollection) and model[0].zch.eviction == "lru"
    got = model[0](features)[0].values()
    torch.testing.assert_close(got, want)


def test_swap_skips_a_policy_without_counterpart():
    model = torch.nn.Sequential(mc_ebc(DistanceLFU_EvictionPolicy()))
    report = gk.swap(model, include="ManagedCollisionEmbeddingBagCollection")
    assert any("DistanceLFU_EvictionPolicy" in reason for _, _, reason in report.skipped)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unadmitted must be one of"):
        ZchEmbeddingBagCollection(configs(), unadmitted="drop")
    with pytest.raises(ValueError, match="ttl must be an int >= 1"):
        ZchEmbeddingBagCollection(configs(), eviction="ttl")
    with pytest.raises(ValueError, match="module must be a torchrec ManagedCollisionEmbeddingBagCollection"):
        ZchEmbeddingBagCollection.from_torchrec(EmbeddingBagCollection(tables=configs()))
    module = ZchEmbeddingBagCollection(configs(), eviction="ttl", ttl=3, ttl_unit="seconds")
    with pytest.raises(ValueError, match="timestamp is required"):
        module(kjt(0))
    module(kjt(0), timestamp=10)
    with pytest.raises(ValueError, match="now must not decrease"):
        module(kjt(1), timestamp=9)

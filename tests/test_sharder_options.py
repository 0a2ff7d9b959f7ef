"""The gem_kernels sharders' choices that need no process group: the table optimizer TorchRec's
fused params name (apply_optimizer_in_backward / fused_params) mapped to its exact gk.optim twin or
refused, and sharding_plan's refusal of plans that would shard nothing (issue 24; issue 30 items 8, 21)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec")

import gem_kernels as gk  # noqa: E402
from gem_kernels.torchrec.sharding import (FusedEmbeddingBagCollectionSharder,  # noqa: E402
                                           FusedEmbeddingCollectionSharder, _GemOptions, _resolve_optimizer,
                                           optimizer_from_fused_params, sharding_plan)


def _emb_opt(cls):
    from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

    return optimizer_type_to_emb_opt_type(cls)


def test_torchrec_optimizers_map_to_their_exact_twins():
    """What apply_optimizer_in_backward(cls, params, kwargs) leaves in a table's fused params
    (TorchRec renames lr to learning_rate); FBGEMM's defaults for what it leaves out."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    assert optimizer_from_fused_params({"optimizer": _emb_opt(RowWiseAdagrad), "learning_rate": 0.5}) == \
        gk.optim.ExactRowwiseAdagrad(lr=0.5, eps=1e-8)
    assert optimizer_from_fused_params({"optimizer": _emb_opt(torch.optim.SGD), "learning_rate": 0.3}) == \
        gk.optim.ExactSGD(lr=0.3)
    assert optimizer_from_fused_params({"optimizer": _emb_opt(torch.optim.Adam), "learning_rate": 0.1,
                                        "betas": (0.8, 0.99), "eps": 1e-6}) == \
        gk.optim.ExactAdam(lr=0.1, betas=(0.8, 0.99), eps=1e-6)
    assert optimizer_from_fused_params({"learning_rate": 0.5}) is None  # names no optimizer


@pytest.mark.parametrize("params,match", [
    ({"optimizer": "EXACT_ADAGRAD"}, "EXACT_ADAGRAD"),
    ({"optimizer": "LAMB"}, "LAMB"),
    ({"optimizer": "EXACT_SGD", "max_norm": 1.0}, "max_norm"),
    ({"optimizer": "EXACT_ROWWISE_ADAGRAD", "weight_decay": 0.1}, "weight_decay_mode L2"),
])
def test_optimizer_without_an_exact_twin_is_refused(params, match):
    with pytest.raises(ValueError, match=match):
        optimizer_from_fused_params(params)


def test_weight_decay_with_l2_mode_is_honoured():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    got = optimizer_from_fused_params({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.2,
                                       "weight_decay": 0.01, "weight_decay_mode": WeightDecayMode.L2})
    assert got == gk.optim.ExactRowwiseAdagrad(lr=0.2, weight_decay=0.01)


class _Group:
    def __init__(self, fused_params):
        from types import SimpleNamespace

        self.fused_params = fused_params
        self.embedding_tables = [SimpleNamespace(name="t0")]


def test_conflicting_optimizer_choices_are_refused_and_none_is_fbgemms_default():
    adagrad = {"optimizer": "EXACT_ROWWISE_ADAGRAD", "learning_rate": 0.5}
    with pytest.raises(ValueError, match=r"tables \['t0'\] are given conflicting optimizers"):
        _resolve_optimizer(_GemOptions(gk.optim.ExactSGD(lr=0.1), None, "fatal", None), _Group(adagrad))
    with pytest.raises(ValueError, match="conflicting"):
        _resolve_optimizer(_GemOptions(None, gk.optim.ExactAdam(), "fatal", None), _Group(adagrad))
    assert _resolve_optimizer(_GemOptions(None, None, "fatal", None), _Group(adagrad)) == \
        gk.optim.ExactRowwiseAdagrad(lr=0.5)
    assert _resolve_optimizer(_GemOptions(None, None, "fatal", None), _Group({})) == gk.optim.ExactSGD(lr=0.01)


def _ebc_model():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    model = torch.nn.Module()
    model.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10,
                                                                  feature_names=["a"])])
    return model


@pytest.mark.parametrize("sharders,error,match", [
    ([], ValueError, "non-empty list"),
    ([FusedEmbeddingBagCollectionSharder], TypeError, r"class FusedEmbeddingBagCollectionSharder"),
    ([None], TypeError, r"sharders must hold TorchRec sharder instances.*got None"),  # front-door fuzz: AttributeError
])
def test_sharding_plan_refuses_sharders_that_shard_nothing(sharders, error, match):
    with pytest.raises(error, match=match):
        sharding_plan(_ebc_model(), sharders, "table_wise", world_size=2)


def test_sharding_plan_of_an_unswapped_model_points_to_swap():
    """The default sharder shards gem_kernels' collections: an unswapped TorchRec EBC is named, with
    the two ways out."""
    with pytest.raises(ValueError, match=r"ebc \(EmbeddingBagCollection\).*gk.swap\(model\).*module_type="):
        sharding_plan(_ebc_model(), [FusedEmbeddingBagCollectionSharder()], "table_wise", world_size=2)


@pytest.mark.parametrize("world_size", [-1, 0, 1.5, True])
def test_sharding_plan_refuses_a_bad_world_size(world_size):
    from torchrec import EmbeddingBagCollection

    with pytest.raises(ValueError, match="world_size must be None"):
        sharding_plan(_ebc_model(), [FusedEmbeddingBagCollectionSharder(module_type=EmbeddingBagCollection)],
                      "table_wise", world_size=world_size)


def test_sharder_refuses_a_bad_backend_at_construction():
    """Found by the front-door fuzz (issue 30 item 6's rule): backend="bogus" was accepted by the
    sharder and failed only in the first forward under DMP."""
    with pytest.raises(ValueError, match="backend.*bogus"):
        FusedEmbeddingBagCollectionSharder(backend="bogus")


def test_dmp_input_with_lengths_not_a_multiple_of_the_keys_is_named():
    """Found by the front-door fuzz: under DMP, 3 lengths for 2 keys gave "shape '[2, 1]' is invalid"
    (issue 30 item 18 had fixed the unsharded collection only). The sharded collections' input check,
    which runs before the input all-to-all, says what is wrong (checked here without a process group)."""
    from types import SimpleNamespace

    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from gem_kernels.torchrec.sharding import _BoundsAgreement

    checker = _BoundsAgreement()
    checker._setup_bounds([EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
                           EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=6, feature_names=["b"])],
                          "fatal", SimpleNamespace(process_group=None))
    features = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match=r"features has 3 lengths for 2 keys \['a', 'b'\]"):
        checker._checked_features(features)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_sharders_offer_only_sharding_types_torchrec_shards(device):
    """A sharding type the planner may pick must be one TorchRec's sharded module builds: TorchRec's
    ShardedEmbeddingCollection has no table-column-wise ("Sharding not supported"), so a planner
    that chose it for a FusedEmbeddingCollection made DMP fail."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    for ours, theirs in ((FusedEmbeddingBagCollectionSharder(), EmbeddingBagCollectionSharder()),
                         (FusedEmbeddingCollectionSharder(), EmbeddingCollectionSharder())):
        offered = ours.sharding_types(device)
        assert offered and set(offered) <= set(theirs.sharding_types(device)), (type(ours).__name__, offered)

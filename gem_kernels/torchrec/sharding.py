"""Sharders that make TorchRec's ``DistributedModelParallel`` run gem_kernels on every rank's shards.

Route (see README "Scaling out"): TorchRec's planner, input distribution (KJT all-to-all), output
distribution (pooled all-to-all / reduce-scatter), state_dict and fused-optimizer plumbing are used
as they are. Only the per-rank compute kernel is ours: a ``ShardedEmbeddingBagCollection`` subclass
whose lookups build ``GemBatchedFusedEmbeddingBag`` (a ``BaseBatchedEmbeddingBag``, the same base as
FBGEMM's ``BatchedFusedEmbeddingBag``) around ``gem_kernels.FusedEmbeddingBag``. NVIDIA's dynamicemb
takes the same route. The planner is told ``EmbeddingComputeKernel.FUSED``: our kernel holds what
FBGEMM's FUSED kernel holds (weights + fp32 optimizer state on the compute device) and updates rows
inside the backward, so the planner's memory and cost models apply unchanged.

MEAN pooling: table-wise and column-wise shards see every id of a bag, so the local kernel divides
by the global bag length. Row-wise shards see only their rows' ids; for them TorchRec turns MEAN
into SUM in the kernel (``pooling_type_to_pooling_mode``) and divides by the global lengths after
the reduce-scatter (``_create_mean_pooling_divisor``); we keep that contract.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type

import torch
import torch.distributed as dist
from torch import nn

from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
    EmbeddingFusedOptimizer,
)
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.dp_sharding import BaseDpEmbeddingSharding
from torchrec.distributed.types import ModuleSharder, ShardingType
from torchrec.modules.embedding_configs import data_type_to_dtype
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .._embedding_bag import check_module_options
from ..nn.embedding_bag import FusedEmbeddingBag, TableSpec, check_backend
from ..optim import ExactAdam, ExactRowwiseAdagrad, ExactSGD
from .embedding_modules import pooled_by_feature, slot_bag_lengths

__all__ = [
    "FusedEmbeddingBagCollectionSharder",
    "FusedEmbeddingCollectionSharder",
    "GemBatchedFusedEmbeddingBag",
    "GemBatchedFusedEmbedding",
    "ShardedFusedEmbeddingBagCollection",
    "ShardedFusedEmbeddingCollection",
    "optimizer_from_fused_params",
]

_POOLING = {0: "sum", 1: "mean", 2: "none"}  # fbgemm PoolingMode values
# Sharding types whose lookups we build; data-parallel tables stay on TorchRec's DENSE kernel.
_MODEL_PARALLEL = (ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value,
                   ShardingType.TABLE_COLUMN_WISE.value, ShardingType.ROW_WISE.value,
                   ShardingType.TABLE_ROW_WISE.value)
_ROW_SHARDED = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)


# fused_params that would change FBGEMM's update in ways gem_kernels' fused update does not do.
_UNSUPPORTED_FUSED_PARAMS = ("max_norm", "gradient_clipping", "momentum", "counter_based_regularization",
                             "cowclip_regularization", "global_weight_decay")


def optimizer_from_fused_params(fused_params: Optional[Dict[str, Any]]):
    """The exact ``gem_kernels.optim`` twin of the optimizer named by TorchRec ``fused_params`` (what
    the sharder's ``fused_params`` and ``apply_optimizer_in_backward`` set per table: ``optimizer``,
    an fbgemm ``EmbOptimType``; ``learning_rate``, ``eps``, ``beta1``/``beta2`` or ``betas``,
    ``weight_decay`` with ``weight_decay_mode``), with FBGEMM's defaults for what they leave out;
    None when they name none. An optimizer or a setting with no exact twin is a ValueError."""
    if not fused_params or fused_params.get("optimizer") is None:
        return None
    raw = fused_params["optimizer"]
    name = str(getattr(raw, "name", raw)).upper()
    if name.startswith("EMBOPTIMTYPE."):
        name = name[len("EMBOPTIMTYPE."):]
    for key in _UNSUPPORTED_FUSED_PARAMS:
        if fused_params.get(key):
            raise ValueError(f"fused_params[{key!r}] = {fused_params[key]!r} is not supported by the gem_kernels "
                             f"sharder: its fused update has no equivalent, so the tables would train differently")
    lr = float(fused_params.get("learning_rate", 0.01))  # FBGEMM's defaults for what is left out
    eps = float(fused_params.get("eps", 1e-8))
    decay = float(fused_params.get("weight_decay", 0.0))
    if decay:
        mode = str(getattr(fused_params.get("weight_decay_mode"), "name", fused_params.get("weight_decay_mode")))
        if mode.upper() != "L2":
            # FBGEMM applies no decay under its default mode NONE and a decoupled one under DECOUPLED:
            # gem_kernels' update has L2 decay only, so anything else would train differently.
            raise ValueError(f"fused_params['weight_decay'] = {decay} needs weight_decay_mode L2 for the gem_kernels "
                             f"sharder (its only decay), got weight_decay_mode {fused_params.get('weight_decay_mode')!r}")
    if name in ("EXACT_SGD", "SGD"):
        return ExactSGD(lr=lr, weight_decay=decay)
    if name in ("EXACT_ROWWISE_ADAGRAD", "ROWWISE_ADAGRAD"):
        return ExactRowwiseAdagrad(lr=lr, eps=eps, weight_decay=decay)
    if name in ("ADAM", "EXACT_ADAM"):
        betas = fused_params.get("betas", (fused_params.get("beta1", 0.9), fused_params.get("beta2", 0.999)))
        return ExactAdam(lr=lr, eps=eps, betas=(float(betas[0]), float(betas[1])), weight_decay=decay)
    raise ValueError(f"the gem_kernels sharder trains tables with EXACT_SGD (torch.optim.SGD), EXACT_ROWWISE_ADAGRAD "
                     f"(torchrec.optim.RowWiseAdagrad) or ADAM (torch.optim.Adam); the table's optimizer is {raw!r} "
                     f"(from the sharder's fused_params or apply_optimizer_in_backward)")


def _resolve_optimizer(options: "_GemOptions", config: GroupedEmbeddingConfig):
    """The table group's optimizer: the sharder's ``optimizer=``, the group's fused params (TorchRec
    merges the sharder's ``fused_params`` and ``apply_optimizer_in_backward``'s per-table choice into
    them), the module's own ``optimizer``; two that disagree are an error, none gives FBGEMM's
    default ``EXACT_SGD(lr=0.01)``."""
    sources = {"the sharder's optimizer=": options.optimizer,
               "fused params (sharder fused_params / apply_optimizer_in_backward)":
                   optimizer_from_fused_params(config.fused_params),
               "the module's optimizer": options.module_optimizer}
    given = {k: v for k, v in sources.items() if v is not None}
    if len({repr(v) for v in given.values()}) > 1:
        tables = [t.name for t in config.embedding_tables]
        raise ValueError(f"tables {tables} are given conflicting optimizers: {given}; choose one")
    return next(iter(given.values()), ExactSGD(lr=0.01))


@dataclasses.dataclass
class _GemOptions:
    optimizer: Any
    module_optimizer: Any
    bounds_check: str
    backend: Optional[str]


class _GemTBE(nn.Module):
    """The ``emb_module`` of our kernel: ``gem_kernels.FusedEmbeddingBag`` plus the handful of
    FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen`` methods TorchRec's fused-optimizer and
    state_dict plumbing call (``split_embedding_weights``, ``get_optimizer_state``, learning rate)."""

    def __init__(self, rows: List[int], cols: List[int], pooling: str, dtype: torch.dtype, device, options,
                 optimizer, feature_table_map: List[int]):
        super().__init__()
        self.bags = FusedEmbeddingBag([TableSpec(r, c) for r, c in zip(rows, cols)], pooling=pooling, dtype=dtype,
                                      device=device, optimizer=optimizer,
                                      bounds_check=options.bounds_check, backend=options.backend)
        # FBGEMM's feature_table_map: feature i reads table feature_table_map[i]; a table read by
        # several features (a shared table) gets one bag slot per feature (see slot_bag_lengths).
        seen: Dict[int, int] = {}
        self._feature_slots = []
        for t in feature_table_map:
            self._feature_slots.append((t, seen.get(t, 0)))
            seen[t] = seen.get(t, 0) + 1
        self._shared = any(count > 1 for count in seen.values())

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self._shared:
            return self.bags(indices, offsets, per_sample_weights)
        features = len(self._feature_slots)
        batch = (offsets.numel() - 1) // features
        lengths = (offsets[1:] - offsets[:-1]).view(features, batch)
        bag_lengths = slot_bag_lengths(lengths, self._feature_slots, self.bags.num_tables)
        slot_offsets = torch.cat([bag_lengths.new_zeros(1), bag_lengths.cumsum(0)]).to(offsets.dtype)
        out = self.bags(indices, slot_offsets, per_sample_weights)
        if self.bags.pooling == "none":  # rows follow the ids, already in the op's bag order
            return out
        return pooled_by_feature(out, self._feature_slots, self.bags.layout.D_offsets, batch)

    def split_embedding_weights(self) -> List[torch.Tensor]:
        return [self.bags.weight(t).detach() for t in range(self.bags.num_tables)]

    def weight_offsets(self) -> List[int]:
        return list(self.bags.layout.weights_offsets)

    def get_optimizer_state(self) -> List[Dict[str, torch.Tensor]]:
        """Per table, FBGEMM's names: row-wise Adagrad ``sum`` [rows]; Adam ``exp_avg``,
        ``exp_avg_sq`` [rows, D]; SGD nothing."""
        name = self.bags.optimizer.name if self.bags.optimizer is not None else None
        layout, states = self.bags.layout, []
        for t in range(layout.num_tables):
            if name == "rowwise_adagrad":
                states.append({"sum": self.bags.momentum1[layout.rows_offsets[t]:layout.rows_offsets[t + 1]]})
            elif name == "adam":
                states.append({"exp_avg": layout.table(self.bags.momentum1, t),
                               "exp_avg_sq": layout.table(self.bags.momentum2, t)})
            else:
                states.append({})
        return states

    def get_learning_rate(self) -> float:
        return self.bags.optimizer.lr if self.bags.optimizer is not None else 0.0

    def set_learning_rate(self, lr: float) -> None:
        if self.bags.optimizer is not None and lr != self.bags.optimizer.lr:
            self.bags.optimizer = dataclasses.replace(self.bags.optimizer, lr=float(lr))

    def set_optimizer_step(self, step: int) -> None:
        self.bags.step.fill_(int(step))

    def update_hyper_parameters(self, params_dict: Dict[str, Any]) -> None:
        fields = {f.name for f in dataclasses.fields(self.bags.optimizer)}
        renamed = {"learning_rate": "lr"}
        update = {renamed.get(k, k): v for k, v in params_dict.items() if renamed.get(k, k) in fields}
        self.bags.optimizer = dataclasses.replace(self.bags.optimizer, **update)

    def flush(self) -> None:
        pass

    def reset_cache_states(self) -> None:
        pass


class _GemKernelMixin:
    """What the pooled and the sequence kernel share: the emb_module, parameters as TorchRec's
    FUSED kernels expose them (a slice per table that no outside optimizer touches), the fused
    optimizer with sharded state for checkpoints."""

    def _build(self, config: GroupedEmbeddingConfig, pg, device, pooling: str, options: _GemOptions) -> None:
        feature_table_map = [t for t, table in enumerate(config.embedding_tables) for _ in range(table.num_features())]
        self._emb_module = _GemTBE(self._local_rows, self._local_cols, pooling, data_type_to_dtype(config.data_type),
                                   device, options, _resolve_optimizer(options, config), feature_table_map)
        self._optim = EmbeddingFusedOptimizer(config, self._emb_module, pg)
        self.init_parameters()

    @property
    def emb_module(self) -> _GemTBE:
        return self._emb_module

    @property
    def fused_optimizer(self):
        return self._optim

    @property
    def _param_per_table(self) -> Dict[str, TableBatchedEmbeddingSlice]:
        # Several column-wise shards of one table on this rank are adjacent in the packed buffer
        # (TorchRec lists them together), so one slice covers them, as in FBGEMM's kernel.
        result: Dict[str, TableBatchedEmbeddingSlice] = {}
        counts = dict(self.table_name_to_count)
        layout = self._emb_module.bags.layout
        for t, table in enumerate(self._config.embedding_tables):
            if table.name not in counts:
                continue
            count = counts.pop(table.name)
            start, rows, dim = layout.weights_offsets[t], layout.rows[t], layout.dims[t]
            weight = TableBatchedEmbeddingSlice(data=self._emb_module.bags.weights, start_offset=start,
                                                end_offset=start + count * rows * dim, num_embeddings=-1,
                                                embedding_dim=dim)
            weight._in_backward_optimizers = [self._optim]
            result[table.name] = weight
        return result

    @_param_per_table.setter
    def _param_per_table(self, value) -> None:  # BaseBatchedEmbeddingBag.__init__ assigns {}
        pass

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        yield from ()  # fused parameters are updated in the backward: no buffers to sync (TorchRec convention)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        from torchrec.optim.fused import EmptyFusedOptimizer

        for name, tensor in self.named_split_embedding_weights(prefix, recurse, remove_duplicate):
            param = nn.Parameter(tensor, requires_grad=False)
            param._in_backward_optimizers = [EmptyFusedOptimizer()]
            yield name, param

    def split_embedding_weights(self) -> List[torch.Tensor]:
        return self._emb_module.split_embedding_weights()

    def forward(self, features: KeyedJaggedTensor, *args, **kwargs) -> torch.Tensor:
        if features.variable_stride_per_key():
            raise ValueError("the gem_kernels sharded kernel needs one batch size for every feature "
                             "(variable batch KJTs are not supported)")
        weights = features.weights_or_none()
        if weights is not None and not torch.is_floating_point(weights):
            weights = None
        return self._emb_module(features.values(), features.offsets(), weights)


class GemBatchedFusedEmbeddingBag(_GemKernelMixin, BaseBatchedEmbeddingBag, FusedOptimizerModule):
    """Pooled lookup of one rank's grouped shards with gem_kernels' fused kernel and optimizer."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, sharding_type: Optional[ShardingType] = None,
                 options: Optional[_GemOptions] = None) -> None:
        super().__init__(config, pg, device, sharding_type)
        self._build(config, pg, device, _POOLING[self._pooling.value], options)


class GemBatchedFusedEmbedding(_GemKernelMixin, BaseBatchedEmbedding, FusedOptimizerModule):
    """Sequence (unpooled) lookup of one rank's grouped shards with gem_kernels' fused kernel."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, options: Optional[_GemOptions] = None) -> None:
        super().__init__(config, pg, device)
        self._build(config, pg, device, "none", options)


class _GemPooledLookup(GroupedPooledEmbeddingsLookup):
    def __init__(self, options: _GemOptions, **kwargs) -> None:
        object.__setattr__(self, "_gem_options", options)  # read by _create_embedding_kernel in super().__init__
        super().__init__(**kwargs)

    def _create_embedding_kernel(self, config, device, pg, sharding_type, env):
        if config.compute_kernel != EmbeddingComputeKernel.FUSED:
            return super()._create_embedding_kernel(config, device, pg, sharding_type, env)
        return GemBatchedFusedEmbeddingBag(config, pg, device, sharding_type, self._gem_options)


class _GemSequenceLookup(GroupedEmbeddingsLookup):
    def __init__(self, options: _GemOptions, **kwargs) -> None:
        object.__setattr__(self, "_gem_options", options)
        super().__init__(**kwargs)

    def _create_embedding_kernel(self, config, pg, device, env):
        if config.compute_kernel != EmbeddingComputeKernel.FUSED:
            return super()._create_embedding_kernel(config, pg, device, env)
        return GemBatchedFusedEmbedding(config, pg, device, self._gem_options)


def _grouped_configs(sharding) -> List[GroupedEmbeddingConfig]:
    if hasattr(sharding, "_grouped_embedding_configs"):
        return sharding._grouped_embedding_configs
    return sharding._grouped_embedding_configs_per_rank[sharding._rank]  # table-row-wise


class _BoundsAgreement:
    """The KJT checked BEFORE the input all-to-all, where a bad one is still the user's input: keys
    (none missing, none twice, the first batch's order restored when a later batch lists them in
    another), lengths that sum to the values, and ids within their table's rows, the last outcome
    agreed by every rank: a bad id on one rank raises the same IndexError on all of them (a rank
    that raised alone would leave the others blocked in the next collective)."""

    def _setup_bounds(self, configs, bounds_check: str, env) -> None:
        self._gem_bounds_check = bounds_check
        self._gem_pg = env.process_group
        self._gem_rows = {f: c.num_embeddings for c in configs for f in (c.feature_names or [c.name])}
        self._gem_table = {f: c.name for c in configs for f in (c.feature_names or [c.name])}
        self._gem_key_order: Optional[List[str]] = None

    def _checked_features(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        keys = list(features.keys())
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ValueError(f"features has the keys {duplicates} more than once (keys {keys}); each key must "
                             f"appear once")
        missing = sorted(set(self._gem_rows) - set(keys))
        if missing:
            raise ValueError(f"features is missing the keys {missing} (it has {keys})")
        num_lengths = features.lengths().numel()
        if not features.variable_stride_per_key() and num_lengths % len(keys):
            raise ValueError(f"features has {num_lengths} lengths for {len(keys)} keys {keys}: a KJT needs "
                             f"batch_size lengths per key")
        total, values = int(features.lengths().sum()), features.values().numel()
        if total != values:
            raise ValueError(f"features' lengths sum to {total}, but it has {values} values")
        # TorchRec's input distribution fixes the key order at the first batch and reads later
        # batches by position: put a reordered batch back in that order.
        if self._gem_key_order is None:
            self._gem_key_order = keys
        elif keys != self._gem_key_order:
            if sorted(keys) != sorted(self._gem_key_order):
                raise ValueError(f"features has the keys {keys}, the first batch had {self._gem_key_order}; every "
                                 f"batch must have the same keys")
            features = features.permute([keys.index(k) for k in self._gem_key_order])
        return features

    def _agree_on_ids(self, features: KeyedJaggedTensor) -> None:
        if self._gem_bounds_check != "fatal":
            return
        keys = features.keys()
        lengths = torch.tensor(features.length_per_key(), dtype=torch.int64)
        rows = torch.tensor([self._gem_rows.get(k, 2 ** 62) for k in keys], dtype=torch.int64)
        values = features.values()
        limit = torch.repeat_interleave(rows.to(values.device), lengths.to(values.device),
                                        output_size=values.numel())
        bad = (values < 0) | (values >= limit)
        mine = torch.full((3,), -1, dtype=torch.int64)
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            feature = int(torch.searchsorted(lengths.cumsum(0), torch.tensor(first), right=True))
            mine = torch.tensor([feature, int(values[first]), first], dtype=torch.int64)
        pg = self._gem_pg
        if pg is None or dist.get_world_size(pg) == 1:
            everyone = [mine]
        else:
            device = values.device if dist.get_backend(pg) == "nccl" else torch.device("cpu")
            everyone = [torch.empty(3, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(pg))]
            dist.all_gather(everyone, mine.to(device), group=pg)
        for rank, (feature, value, position) in enumerate(t.tolist() for t in everyone):
            if feature >= 0:
                key = keys[feature]
                raise IndexError(f"id {value} of feature {key!r} (position {position} of the batch of rank {rank}) is "
                                 f"out of range [0, {self._gem_rows[key]}) of table {self._gem_table[key]!r}; every "
                                 f"rank raises this error")


class ShardedFusedEmbeddingBagCollection(_BoundsAgreement, ShardedEmbeddingBagCollection):
    """TorchRec's sharded EBC with gem_kernels lookups; every other part is TorchRec's."""

    def __init__(self, module, table_name_to_parameter_sharding, env, fused_params=None, device=None,
                 qcomm_codecs_registry=None, module_fqn=None, options: Optional[_GemOptions] = None, **kwargs):
        object.__setattr__(self, "_gem_options", options)
        super().__init__(_UnshardedView(module), table_name_to_parameter_sharding, env, fused_params=fused_params,
                         device=device, qcomm_codecs_registry=qcomm_codecs_registry, module_fqn=module_fqn, **kwargs)
        self._setup_bounds(module.embedding_bag_configs(), options.bounds_check, env)
        _copy_unsharded_weights(self, module)

    def _create_lookups(self) -> None:
        for sharding_type, sharding in zip(self._sharding_types, self._embedding_shardings):
            if isinstance(sharding, BaseDpEmbeddingSharding) or sharding_type not in _MODEL_PARALLEL:
                self._lookups.append(sharding.create_lookup())
                continue
            self._lookups.append(_GemPooledLookup(
                self._gem_options, grouped_configs=_grouped_configs(sharding), pg=sharding._pg,
                device=sharding._device, feature_processor=None,
                sharding_type=ShardingType(sharding_type) if sharding_type in _ROW_SHARDED else None,
                env=sharding._env))

    def input_dist(self, ctx, features):
        features = self._checked_features(features)
        self._agree_on_ids(features)
        return super().input_dist(ctx, features)


class ShardedFusedEmbeddingCollection(_BoundsAgreement, ShardedEmbeddingCollection):
    """TorchRec's sharded EmbeddingCollection with gem_kernels lookups."""

    def __init__(self, module, table_name_to_parameter_sharding, env, fused_params=None, device=None,
                 qcomm_codecs_registry=None, module_fqn=None, options: Optional[_GemOptions] = None, **kwargs):
        object.__setattr__(self, "_gem_options", options)
        super().__init__(_UnshardedView(module), table_name_to_parameter_sharding, env, fused_params=fused_params,
                         device=device, qcomm_codecs_registry=qcomm_codecs_registry, module_fqn=module_fqn, **kwargs)
        self._setup_bounds(module.embedding_configs(), options.bounds_check, env)
        _copy_unsharded_weights(self, module)

    def _create_lookups(self) -> None:
        for sharding_type, sharding in self._sharding_type_to_sharding.items():
            if isinstance(sharding, BaseDpEmbeddingSharding) or sharding_type not in _MODEL_PARALLEL:
                self._lookups.append(sharding.create_lookup())
                continue
            self._lookups.append(_GemSequenceLookup(
                self._gem_options, grouped_configs=_grouped_configs(sharding), pg=sharding._pg,
                device=sharding._device, env=sharding._env))

    def input_dist(self, ctx, features):
        features = self._checked_features(features)
        self._agree_on_ids(features)
        return super().input_dist(ctx, features)


class _UnshardedView:
    """The unsharded collection as TorchRec's sharded-module constructors read it: they ask for
    ``module.device``, which gem_kernels' collections (one packed buffer) do not define."""

    def __init__(self, module: nn.Module):
        self._module = module
        tensors = list(module.state_dict().values())
        self.device = tensors[0].device if tensors else torch.device("cpu")

    # TorchRec EmbeddingCollection options gem_kernels' collection does not have: their defaults
    _DEFAULTS = {"use_gather_select": lambda: False, "use_gather_select_per_sharding": lambda: None,
                 "use_sorted_select": lambda: False}

    def __getattr__(self, name: str):
        try:
            return getattr(self._module, name)
        except AttributeError:
            if name in self._DEFAULTS:
                return self._DEFAULTS[name]
            raise


def _copy_unsharded_weights(sharded: nn.Module, module: nn.Module) -> None:
    """Each rank's shards start as the slices of the unsharded module's tables (TorchRec copies
    them only off the CPU; we always do, so a CPU model shards without losing its weights)."""
    if any(t.is_meta for t in module.state_dict().values()):
        return
    with torch.no_grad():
        sharded.load_state_dict(module.state_dict(), strict=False)


class _GemSharderMixin:
    def _init_gem(self, optimizer, bounds_check: str, backend: Optional[str], module_type) -> None:
        check_module_options(optimizer, bounds_check)
        check_backend(backend)
        self._gem_optimizer, self._gem_bounds_check, self._gem_backend = optimizer, bounds_check, backend
        self._gem_module_type = module_type

    def _options(self, module) -> _GemOptions:
        return _GemOptions(self._gem_optimizer, getattr(module, "optimizer", None), self._gem_bounds_check,
                           self._gem_backend)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        types = [ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value]
        if compute_device_type == "cuda":  # TorchRec's own row-wise support ends at the GPU
            types += [ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value]
        return types

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [EmbeddingComputeKernel.FUSED.value]

    @property
    def module_type(self):
        return self._gem_module_type

    def shardable_parameters(self, module) -> Dict[str, nn.Parameter]:
        prefix = self._gem_prefix
        return {name[len(prefix):-len(".weight")]: tensor for name, tensor in module.state_dict().items()
                if name.startswith(prefix) and name.endswith(".weight")}


def _default_module_type(kind: str):
    try:
        from . import FusedEmbeddingBagCollection, FusedEmbeddingCollection  # branch torchrec
    except ImportError:
        return EmbeddingBagCollection if kind == "bag" else EmbeddingCollection
    return FusedEmbeddingBagCollection if kind == "bag" else FusedEmbeddingCollection


class FusedEmbeddingBagCollectionSharder(_GemSharderMixin, EmbeddingBagCollectionSharder):
    """Pass in ``DistributedModelParallel(..., sharders=[FusedEmbeddingBagCollectionSharder(...)])``.

    optimizer: a ``gem_kernels.optim`` config for every table. Else each table trains with what TorchRec
    chose for it (``apply_optimizer_in_backward`` or the sharder's ``fused_params``, mapped to the
    exact ``gem_kernels.optim`` twin; one with no twin is a ValueError), or the module's own
    ``optimizer``; conflicting choices are a ValueError; no choice at all is FBGEMM's default
    ``EXACT_SGD(lr=0.01)``.
    module_type: the class it shards (default ``gem_kernels.torchrec.FusedEmbeddingBagCollection``;
    pass torchrec's ``EmbeddingBagCollection`` to run unswapped TorchRec models on our kernel).
    """

    _gem_prefix = "embedding_bags."

    def __init__(self, optimizer=None, bounds_check: str = "fatal", backend: Optional[str] = None,
                 module_type: Optional[Type[nn.Module]] = None, fused_params: Optional[Dict[str, Any]] = None,
                 qcomm_codecs_registry=None) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self._init_gem(optimizer, bounds_check, backend, module_type or _default_module_type("bag"))

    def shard(self, module, params, env, device=None, module_fqn=None) -> ShardedFusedEmbeddingBagCollection:
        return ShardedFusedEmbeddingBagCollection(module, params, env, fused_params=self.fused_params, device=device,
                                                  qcomm_codecs_registry=self.qcomm_codecs_registry,
                                                  module_fqn=module_fqn, options=self._options(module))

    @property
    def sharded_module_type(self):
        return ShardedFusedEmbeddingBagCollection


class FusedEmbeddingCollectionSharder(_GemSharderMixin, EmbeddingCollectionSharder):
    """The sequence (pooling "none") twin of ``FusedEmbeddingBagCollectionSharder``."""

    _gem_prefix = "embeddings."

    def __init__(self, optimizer=None, bounds_check: str = "fatal", backend: Optional[str] = None,
                 module_type: Optional[Type[nn.Module]] = None, fused_params: Optional[Dict[str, Any]] = None,
                 qcomm_codecs_registry=None) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self._init_gem(optimizer, bounds_check, backend, module_type or _default_module_type("seq"))

    def sharding_types(self, compute_device_type: str) -> List[str]:
        # TorchRec's ShardedEmbeddingCollection has no table-column-wise or table-row-wise sharding
        # ("Sharding not supported"): a planner told it could choose them, and DMP would then fail.
        unsupported = (ShardingType.TABLE_COLUMN_WISE.value, ShardingType.TABLE_ROW_WISE.value)
        return [t for t in super().sharding_types(compute_device_type) if t not in unsupported]

    def shard(self, module, params, env, device=None, module_fqn=None) -> ShardedFusedEmbeddingCollection:
        return ShardedFusedEmbeddingCollection(module, params, env, fused_params=self.fused_params, device=device,
                                               qcomm_codecs_registry=self.qcomm_codecs_registry,
                                               module_fqn=module_fqn, options=self._options(module))

    @property
    def sharded_module_type(self):
        return ShardedFusedEmbeddingCollection


PLANS = ("table_wise", "column_wise", "auto")


def _check_sharders(model: nn.Module, sharders: List[Any]) -> None:
    """A plan that shards nothing leaves every table unsharded under DMP: refuse it, and say why."""
    if not isinstance(sharders, (list, tuple)) or not sharders:
        raise ValueError(f"sharders must be a non-empty list of sharder instances, e.g. "
                         f"[FusedEmbeddingBagCollectionSharder()], got {sharders!r}")
    for sharder in sharders:
        if isinstance(sharder, type):
            raise TypeError(f"sharders must hold sharder instances, got the class {sharder.__name__}; pass "
                            f"{sharder.__name__}()")
        if not isinstance(sharder, ModuleSharder):
            raise TypeError(f"sharders must hold TorchRec sharder instances (e.g. FusedEmbeddingBagCollectionSharder()), "
                            f"got {sharder!r}")
    types = {s.module_type for s in sharders}
    if not any(type(m) in types for m in model.modules()):
        collections = sorted({f"{name or '<model>'} ({type(m).__name__})" for name, m in model.named_modules()
                              if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
                              or "EmbeddingBagCollection" in type(m).__name__
                              or "EmbeddingCollection" in type(m).__name__})
        raise ValueError(f"no module of the model is one the sharders shard ({sorted(t.__name__ for t in types)}); "
                         f"its embedding collections: {collections or 'none'}. Run gk.swap(model) first to put "
                         f"gem_kernels collections in, or pass module_type=torchrec.EmbeddingBagCollection "
                         f"(or EmbeddingCollection) to the sharder")


def sharding_plan(model: nn.Module, sharders: List[Any], plan: str = "auto", world_size: Optional[int] = None,
                  compute_device: str = "cpu", pg: Optional[dist.ProcessGroup] = None):
    """A TorchRec ``ShardingPlan`` for every module of ``model`` that one of ``sharders`` shards.

    plan: ``table_wise`` (table i on rank i mod world_size), ``column_wise`` (every table split
    into world_size column blocks, one per rank) or ``auto`` (TorchRec's ``EmbeddingShardingPlanner``
    over a ``Topology(world_size, compute_device)``, told the FUSED kernel and the sharding types
    our sharders list; it picks among table-, column- and table-column-wise on the CPU, adds
    row-wise ones on GPUs). ``auto`` is collective: every rank of ``pg`` must call it.
    """
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    if plan not in PLANS:
        raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size must be None (the process group's) or an int >= 1, got {world_size!r}")
    _check_sharders(model, sharders)
    world_size = world_size or dist.get_world_size(pg)
    if plan == "auto":
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device=compute_device))
        if pg is None and not dist.is_initialized():
            return planner.plan(model, sharders)
        return planner.collective_plan(model, sharders, pg or dist.GroupMember.WORLD)
    fused = EmbeddingComputeKernel.FUSED.value
    plans, table_index = {}, 0
    for fqn, module in model.named_modules():
        sharder = next((s for s in sharders if type(module) is s.module_type), None)
        if sharder is None:
            continue
        per_table = {}
        for name in sharder.shardable_parameters(module):
            if plan == "table_wise":
                per_table[name] = table_wise(rank=table_index % world_size, compute_kernel=fused)
            else:
                per_table[name] = column_wise(ranks=list(range(world_size)), compute_kernel=fused)
            table_index += 1
        plans[fqn] = construct_module_sharding_plan(module, per_table, sharder=sharder, local_size=world_size,
                                                    world_size=world_size, device_type=compute_device)
    return ShardingPlan(plans)

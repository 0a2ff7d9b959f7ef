"""Table-wise sharding of ``gk.torchrec.ZchEmbeddingBagCollection`` under TorchRec's
``DistributedModelParallel``: ``ZchEmbeddingBagCollectionSharder``, the sibling of
``FusedEmbeddingBagCollectionSharder`` (gem_kernels/torchrec/sharding.py), on the same route: TorchRec's
planner, KJT all-to-all, pooled all-to-all and fused-optimizer plumbing; only the per-rank kernel is
ours, here the fused remap + lookup.

Table-wise, a table and its identity table live on one rank, which after the input all-to-all sees
every id of that table for the global batch (rank 0's samples, then rank 1's, ...), in the order the
unsharded module sees the same global batch. So each rank's remap makes exactly the unsharded
module's decisions, and outputs, identity tables and eviction state equal the unsharded module's on
the same stream. A table's fresh rows are seeded by its index in the unsharded collection (each
local table is its own ``HashedEmbeddingBag``, seeded ``seed + t``), so they are the same too.

Row-wise is not offered. It would need the ids routed by hash, not by row: a raw id has no row
before the remap, so the input distribution must send id x to rank ``hash(x) % world`` (TorchRec's
MPZCH buckets the hash space the same way), each rank holding the identity table, weights and
eviction state of its hash range (its slots are rows ``[rank * slots / world, ...)`` of the table),
remapping and pooling its part of every bag, the partial bags then summed by the reduce-scatter
(MEAN divided by the global lengths afterwards, as TorchRec does). Eviction becomes per-rank (LRU
among a rank's slots, not the whole table's), so the identity tables would equal the unsharded
module's only per hash range.

Limitations: ``ttl_unit="seconds"`` (the batch timestamp does not travel with the KJT) and
row-wise/column-wise plans are refused; the sharded ``state_dict()`` holds the tables' weights
(``embedding_bags.<table>.weight``, as TorchRec's) but not the identity tables: read them from
``ShardedZchEmbeddingBagCollection.zch_tables()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import data_type_to_dtype

from ..nn.embedding_bag import TableSpec
from ..nn.hashed_embedding_bag import HashedEmbeddingBag
from ..ops.zch import ZchTables
from .sharding import (
    FusedEmbeddingBagCollectionSharder,
    GemBatchedFusedEmbeddingBag,
    ShardedFusedEmbeddingBagCollection,
    _GemOptions,
    _GemPooledLookup,
    _GemTBE,
    _resolve_optimizer,
)
from .zch_modules import ZchEmbeddingBagCollection

__all__ = ["ZchEmbeddingBagCollectionSharder", "ShardedZchEmbeddingBagCollection"]


@dataclasses.dataclass
class _ZchOptions(_GemOptions):
    zch: Dict[str, Any] = dataclasses.field(default_factory=dict)  # HashedEmbeddingBag's remap arguments
    seed: int = 0
    table_index: Dict[str, int] = dataclasses.field(default_factory=dict)  # name -> index in the module
    init_bounds: Dict[str, tuple] = dataclasses.field(default_factory=dict)
    admission_capacity: Dict[str, Optional[int]] = dataclasses.field(default_factory=dict)


class _ZchTBE(_GemTBE):
    """The ``emb_module`` of a rank's hashed tables: one single-table ``HashedEmbeddingBag`` per table
    (seeded by the table's index in the unsharded module), with ``_GemTBE``'s FBGEMM-shaped methods."""

    def __init__(self, tables, pooling: str, dtype: torch.dtype, device, options: _ZchOptions, optimizer):
        nn.Module.__init__(self)
        self.names = [t.name for t in tables]
        self.tables = nn.ModuleList(
            HashedEmbeddingBag([TableSpec(t.local_rows, t.local_cols)], pooling=pooling, dtype=dtype, device=device,
                               optimizer=optimizer, init_bounds=[options.init_bounds[t.name]],
                               seed=options.seed + options.table_index[t.name], backend=options.backend,
                               admission_capacity=options.admission_capacity[t.name], **options.zch)
            for t in tables)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch = (offsets.numel() - 1) // len(self.tables)
        bounds = offsets[::batch].tolist() if batch else [0] * (len(self.tables) + 1)
        outs = []
        for t, bag in enumerate(self.tables):
            start, stop = bounds[t], bounds[t + 1]
            psw = per_sample_weights[start:stop] if per_sample_weights is not None else None
            outs.append(bag(indices[start:stop], offsets[t * batch:(t + 1) * batch + 1] - start, psw))
        return torch.cat(outs, dim=1)

    def split_embedding_weights(self) -> List[torch.Tensor]:
        return [bag.weight(0).detach() for bag in self.tables]

    def weight_offsets(self) -> List[int]:
        return [0] * len(self.tables)

    def get_optimizer_state(self) -> List[Dict[str, torch.Tensor]]:
        name = self.optimizer.name if self.optimizer is not None else None
        if name == "rowwise_adagrad":
            return [{"sum": bag.momentum1} for bag in self.tables]
        if name == "adam":
            return [{"exp_avg": bag.layout.table(bag.momentum1, 0), "exp_avg_sq": bag.layout.table(bag.momentum2, 0)}
                    for bag in self.tables]
        return [{} for _ in self.tables]

    @property
    def optimizer(self):
        return self.tables[0].optimizer

    def get_learning_rate(self) -> float:
        return self.optimizer.lr if self.optimizer is not None else 0.0

    def _set_optimizer(self, optimizer) -> None:
        for bag in self.tables:
            bag.optimizer = optimizer

    def set_learning_rate(self, lr: float) -> None:
        if self.optimizer is not None and lr != self.optimizer.lr:
            self._set_optimizer(dataclasses.replace(self.optimizer, lr=float(lr)))

    def set_optimizer_step(self, step: int) -> None:
        for bag in self.tables:
            bag.step.fill_(int(step))

    def update_hyper_parameters(self, params_dict: Dict[str, Any]) -> None:
        fields = {f.name for f in dataclasses.fields(self.optimizer)}
        renamed = {"learning_rate": "lr"}
        update = {renamed.get(k, k): v for k, v in params_dict.items() if renamed.get(k, k) in fields}
        self._set_optimizer(dataclasses.replace(self.optimizer, **update))


def _check_one_feature_per_table(config) -> None:
    # A hashed table's identity table is keyed by one feature's raw ids: two features on one table
    # would share slots and evict each other's ids.
    for table in config.embedding_tables:
        if table.num_features() != 1:
            raise ValueError(f"table {table.name!r} is shared by features {table.feature_names}; a hashed (zch) "
                             f"table takes one feature (give each feature its own table)")


class _ZchBatchedEmbeddingBag(GemBatchedFusedEmbeddingBag):
    """A rank's pooled lookup of its hashed tables (the fused remap + lookup, fused optimizer)."""

    def _build(self, config, pg, device, pooling: str, options: _ZchOptions) -> None:
        from torchrec.distributed.batched_embedding_kernel import EmbeddingFusedOptimizer

        _check_one_feature_per_table(config)
        self._emb_module = _ZchTBE(config.embedding_tables, pooling, data_type_to_dtype(config.data_type), device,
                                   options, _resolve_optimizer(options, config))
        self._optim = EmbeddingFusedOptimizer(config, self._emb_module, pg)
        self.init_parameters()

    @property
    def _param_per_table(self) -> Dict[str, TableBatchedEmbeddingSlice]:
        result = {}
        for name, bag in zip(self._emb_module.names, self._emb_module.tables):
            weight = TableBatchedEmbeddingSlice(data=bag.weights, start_offset=0, end_offset=bag.weights.numel(),
                                                num_embeddings=-1, embedding_dim=bag.layout.dims[0])
            weight._in_backward_optimizers = [self._optim]
            result[name] = weight
        return result

    @_param_per_table.setter
    def _param_per_table(self, value) -> None:  # BaseBatchedEmbeddingBag.__init__ assigns {}
        pass


class _ZchPooledLookup(_GemPooledLookup):
    def _create_embedding_kernel(self, config, device, pg, sharding_type, env):
        return _ZchBatchedEmbeddingBag(config, pg, device, sharding_type, self._gem_options)


class ShardedZchEmbeddingBagCollection(ShardedFusedEmbeddingBagCollection):
    """The table-wise sharded ``ZchEmbeddingBagCollection``: ``(KeyedTensor, None)`` as the unsharded
    module; each rank remaps and pools its tables' ids of the global batch."""

    def __init__(self, module, table_name_to_parameter_sharding, env, fused_params=None, device=None,
                 qcomm_codecs_registry=None, module_fqn=None, options: Optional[_ZchOptions] = None, **kwargs):
        for name, sharding in table_name_to_parameter_sharding.items():
            if sharding.sharding_type != ShardingType.TABLE_WISE.value:
                raise ValueError(f"table {name!r}: sharding type {sharding.sharding_type!r} is not supported for "
                                 f"hashed tables (table_wise is; see gem_kernels/torchrec/zch_sharding.py for "
                                 f"what row_wise would need)")
        super().__init__(module, table_name_to_parameter_sharding, env, fused_params=fused_params, device=device,
                         qcomm_codecs_registry=qcomm_codecs_registry, module_fqn=module_fqn, options=options,
                         **kwargs)
        _copy_identity_tables(self.zch_tables(), module)

    def _create_lookups(self) -> None:
        for sharding in self._embedding_shardings:
            self._lookups.append(_ZchPooledLookup(
                self._gem_options, grouped_configs=sharding._grouped_embedding_configs, pg=sharding._pg,
                device=sharding._device, feature_processor=None, sharding_type=None, env=sharding._env))

    def input_dist(self, ctx, features):
        # Raw ids have no range to check (the unsharded module takes any int64): keys and lengths only.
        return ShardedEmbeddingBagCollection.input_dist(self, ctx, self._checked_features(features))

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs), None

    def zch_tables(self) -> Dict[str, ZchTables]:
        """This rank's identity tables by table name (one single-table ``ZchTables`` each)."""
        out = {}
        for lookup in self._lookups:
            for kernel in lookup._emb_modules:
                for name, bag in zip(kernel.emb_module.names, kernel.emb_module.tables):
                    out[name] = bag.zch
        return out


def _copy_identity_tables(local: Dict[str, ZchTables], module: ZchEmbeddingBagCollection) -> None:
    """Each local table starts with the unsharded module's identity table and eviction state."""
    source = module.zch
    names = [c.name for c in module.embedding_bag_configs()]
    slots, cells, pcells = source.layout.tolist()
    with torch.no_grad():
        for name, zch in local.items():
            t = names.index(name)
            zch.slot_meta.copy_(source.slot_meta[slots[t]:slots[t + 1]])
            zch.heap.copy_(source.heap[slots[t]:slots[t + 1]])
            zch.index.copy_(source.index[cells[t]:cells[t + 1]])
            zch.pending.copy_(source.pending[pcells[t]:pcells[t + 1]])
            zch.table_state.copy_(source.table_state[t:t + 1])
            zch.step.copy_(source.step)


class ZchEmbeddingBagCollectionSharder(FusedEmbeddingBagCollectionSharder):
    """Pass in ``DistributedModelParallel(..., sharders=[ZchEmbeddingBagCollectionSharder(...)])`` to
    shard ``gk.torchrec.ZchEmbeddingBagCollection`` table-wise (the only sharding type it offers).
    Arguments as ``FusedEmbeddingBagCollectionSharder``'s (optimizer, backend, fused_params); the
    remap settings (eviction, ttl, admission, probe bound, unadmitted, seed) are the module's."""

    def __init__(self, optimizer=None, backend: Optional[str] = None, fused_params: Optional[Dict[str, Any]] = None,
                 qcomm_codecs_registry=None) -> None:
        super().__init__(optimizer=optimizer, bounds_check="skip", backend=backend,
                         module_type=ZchEmbeddingBagCollection, fused_params=fused_params,
                         qcomm_codecs_registry=qcomm_codecs_registry)

    def _options(self, module) -> _ZchOptions:
        zch = module.zch
        if zch.ttl_unit == "seconds":
            raise ValueError("ttl_unit 'seconds' is not supported sharded (the batch timestamp does not travel "
                             "with the KJT); use ttl_unit 'steps'")
        pending_cells = torch.diff(zch.layout[2]).tolist()
        configs = module.embedding_bag_configs()
        kwargs = dict(eviction=zch.eviction, ttl=zch.ttl if zch.eviction == "ttl" else None, ttl_unit=zch.ttl_unit,
                      admission_threshold=zch.admission_threshold, max_probe=zch.max_probe,
                      unadmitted=module.unadmitted)
        base = super()._options(module)
        return _ZchOptions(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, zch=kwargs,
                           seed=module.seed, table_index={c.name: t for t, c in enumerate(configs)},
                           init_bounds={c.name: tuple(b) for c, b in zip(configs, module.init_bounds.tolist())},
                           admission_capacity={c.name: cells or None for c, cells in zip(configs, pending_cells)})

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [ShardingType.TABLE_WISE.value]

    def shard(self, module, params, env, device=None, module_fqn=None) -> ShardedZchEmbeddingBagCollection:
        return ShardedZchEmbeddingBagCollection(module, params, env, fused_params=self.fused_params, device=device,
                                                qcomm_codecs_registry=self.qcomm_codecs_registry,
                                                module_fqn=module_fqn, options=self._options(module))

    @property
    def sharded_module_type(self):
        return ShardedZchEmbeddingBagCollection

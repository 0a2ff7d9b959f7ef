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

State: the sharded ``state_dict()`` has the unsharded module's keys. ``embedding_bags.<table>.weight``
are TorchRec's ShardedTensors; ``zch.slot_meta``, ``zch.heap``, ``zch.index``, ``zch.pending`` and
``zch.table_state`` (the identity tables, eviction metadata, hash index, admission counts, stats:
each packed over the tables as in ``ZchTables``) are ShardedTensors of the same global shapes with
one shard per table, on the rank that owns it (TorchRec's MC-EBC shards its MCH buffers the same
way); ``zch.step`` (the clock) is replicated. So torch.distributed.checkpoint saves and reloads them
at any world size, and an unsharded module's state_dict loads too. ``load_state_dict`` restores the
identity tables exactly.

``ttl_unit="seconds"``: pass the batch's ``timestamp`` to the sharded module's forward on every rank,
as to the unsharded one. The owner of a table remaps the global batch's ids, so the ranks agree on
one time for the batch: the largest of their timestamps (one all-reduce of two int64 per training
step; the ranks normally pass the same). A rank passing None in training fails on every rank
(TorchRec's train pipelines, which call ``input_dist`` without it, do not carry a timestamp).

Row-wise/column-wise plans are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import data_type_to_dtype

from ..nn.embedding_bag import TableSpec
from ..nn.hashed_embedding_bag import HashedEmbeddingBag
from ..ops.zch import ZchTables
from ..reference.zch import STATE_FIELDS
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
        self.timestamp: Optional[int] = None  # the batch's time (ttl_unit "seconds"), set around each lookup
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
            outs.append(bag(indices[start:stop], offsets[t * batch:(t + 1) * batch + 1] - start, psw,
                            timestamp=self.timestamp))
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
        self._zch_names = [c.name for c in module.embedding_bag_configs()]
        self._zch_owner = {name: sharding.ranks[0] for name, sharding in table_name_to_parameter_sharding.items()}
        self._zch_offsets = module.zch.layout.tolist() + [list(range(len(self._zch_names) + 1))]
        self._zch_seconds = module.zch.ttl_unit == "seconds"
        # The clock of ttl_unit "steps" (training calls), kept here too so that a rank without tables has it.
        self._zch_step = module.zch.step.detach().clone()
        _copy_identity_tables(self.zch_tables(), module)
        self._register_state_dict_hook(_zch_state_dict_hook)
        self._register_load_state_dict_pre_hook(_zch_load_state_dict_pre_hook, with_module=True)

    def _create_lookups(self) -> None:
        for sharding in self._embedding_shardings:
            self._lookups.append(_ZchPooledLookup(
                self._gem_options, grouped_configs=sharding._grouped_embedding_configs, pg=sharding._pg,
                device=sharding._device, feature_processor=None, sharding_type=None, env=sharding._env))

    def input_dist(self, ctx, features, timestamp: Optional[int] = None):
        # Raw ids have no range to check (the unsharded module takes any int64): keys and lengths only.
        ctx.zch_timestamp = self._batch_time(timestamp)
        return ShardedEmbeddingBagCollection.input_dist(self, ctx, self._checked_features(features))

    def _batch_time(self, timestamp: Optional[int]) -> Optional[int]:
        """The time every owner remaps this global batch at: the ranks' largest timestamp in training
        (ttl_unit "seconds"), this rank's otherwise (eval only reads)."""
        if timestamp is not None and (isinstance(timestamp, bool) or not isinstance(timestamp, int)):
            raise TypeError(f"timestamp must be an int (the batch's time in seconds), got {type(timestamp).__name__}")
        if not self._zch_seconds:
            if timestamp is not None:
                raise ValueError(f"timestamp is only used with ttl_unit 'seconds', got timestamp={timestamp!r}")
            return None
        if not self.training:
            return timestamp
        # [time, missing]: every rank joins the all-reduce, so a rank without a timestamp fails everywhere, not hangs.
        agreed = torch.tensor([0 if timestamp is None else timestamp, int(timestamp is None)], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._env.process_group)
        if agreed[1]:
            raise ValueError("timestamp is required in training with ttl_unit 'seconds' (the batch's time, an int) "
                             "on every rank; a rank passed None")
        return int(agreed[0])

    def compute_and_output_dist(self, ctx, input):
        kernels = self._zch_kernels()
        for kernel in kernels:
            kernel.timestamp = getattr(ctx, "zch_timestamp", None)
        try:
            out = super().compute_and_output_dist(ctx, input)
        finally:
            for kernel in kernels:
                kernel.timestamp = None
        if self.training:
            self._zch_step += 1
        return out

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs), None

    def _zch_kernels(self) -> List[_ZchTBE]:
        return [kernel.emb_module for lookup in self._lookups for kernel in lookup._emb_modules]

    def zch_tables(self) -> Dict[str, ZchTables]:
        """This rank's identity tables by table name (one single-table ``ZchTables`` each)."""
        return {name: bag.zch for kernel in self._zch_kernels() for name, bag in zip(kernel.names, kernel.tables)}


# ZchTables' buffers packed over the tables: (name, the row of ``_zch_offsets`` their rows follow (layout's
# slots, index cells, pending cells; then one per table), their width).
_ZCH_SHARDED = (("slot_meta", 0, 4), ("heap", 0, 3), ("index", 1, 2), ("pending", 2, 2),
                ("table_state", 3, len(STATE_FIELDS)))


def _zch_state_dict_hook(module: ShardedZchEmbeddingBagCollection, destination, prefix: str, local_metadata):
    """``zch.<buffer>``: a ShardedTensor of the unsharded module's global shape, one shard per table
    (rows ``offsets[t]:offsets[t+1]``) on its owner; ``zch.step`` replicated."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    local = module.zch_tables()
    pg = module._env.process_group
    some = next(iter(local.values()), None)
    for field, row, width in _ZCH_SHARDED:
        offsets = module._zch_offsets[row]
        size = torch.Size([offsets[-1], width])
        if offsets[-1] == 0:  # no admission counts anywhere (threshold 1): an empty replicated tensor
            destination[f"{prefix}zch.{field}"] = torch.zeros(size, dtype=torch.int64)
            continue
        device = getattr(some, field).device if some is not None else torch.device("cpu")
        shards_metadata, shards = [], []
        for t, name in enumerate(module._zch_names):
            rows = offsets[t + 1] - offsets[t]
            if rows == 0:
                continue
            meta = ShardMetadata(shard_offsets=[offsets[t], 0], shard_sizes=[rows, width],
                                 placement=f"rank:{module._zch_owner[name]}/{device.type}")
            shards_metadata.append(meta)
            if name in local:
                shards.append(Shard(getattr(local[name], field), meta))
        properties = TensorProperties(dtype=torch.int64, layout=torch.strided, requires_grad=False,
                                      memory_format=torch.contiguous_format, pin_memory=False)
        destination[f"{prefix}zch.{field}"] = ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, ShardedTensorMetadata(shards_metadata=shards_metadata, size=size, tensor_properties=properties),
            process_group=pg)
    destination[f"{prefix}zch.step"] = module._zch_step
    return destination


def _zch_load_state_dict_pre_hook(module: ShardedZchEmbeddingBagCollection, state_dict, prefix: str, local_metadata,
                                  strict: bool, missing_keys, unexpected_keys, error_msgs) -> None:
    """Takes the ``zch.*`` keys out of ``state_dict`` (TorchRec's loader knows only the weights) and
    restores this rank's identity tables from them: a ShardedTensor of this module's sharding (as
    torch.distributed.checkpoint loads into) or the unsharded module's whole tensor."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    local = module.zch_tables()
    values = {}
    for field in [f for f, _, _ in _ZCH_SHARDED] + ["step"]:
        key = f"{prefix}zch.{field}"
        if key in state_dict:
            values[field] = state_dict.pop(key)
        elif strict:
            missing_keys.append(key)
    with torch.no_grad():
        if "step" in values:
            step = values["step"]
            module._zch_step.copy_(step)
            for zch in local.values():
                zch.step.copy_(step)
        for field, row, _ in _ZCH_SHARDED:
            if field not in values:
                continue
            value, offsets = values[field], module._zch_offsets[row]
            for name, zch in local.items():
                t = module._zch_names.index(name)
                start, stop = offsets[t], offsets[t + 1]
                target = getattr(zch, field)
                if isinstance(value, ShardedTensor):
                    shard = next((s.tensor for s in value.local_shards() if s.metadata.shard_offsets[0] == start
                                  and s.metadata.shard_sizes[0] == stop - start), None)
                    if shard is None and stop > start:
                        raise ValueError(f"{prefix}zch.{field}: no local shard holds rows [{start}, {stop}) of table "
                                         f"{name!r} (a ShardedTensor of another sharding: load it through "
                                         f"torch.distributed.checkpoint)")
                    if shard is not None:
                        target.copy_(shard)
                elif tuple(value.shape) != (offsets[-1], target.shape[1]):
                    raise ValueError(f"{prefix}zch.{field} has shape {tuple(value.shape)}, this module's is "
                                     f"{(offsets[-1], target.shape[1])}")
                else:
                    target.copy_(value[start:stop])


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

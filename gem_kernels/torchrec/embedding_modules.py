"""``FusedEmbeddingBagCollection`` / ``FusedEmbeddingCollection``: TorchRec's EmbeddingBagCollection and
EmbeddingCollection on one fused ``gem_kernels.embedding_bag`` call (FBGEMM's TBE design).

Layout. The physical tables live back to back in one flat ``weights`` parameter (one "table" of the
fused op each). The op wants the same number of bags in every table, so a table read by k features
gets k*B bags (its features' bags one after the other) and tables with fewer features are padded
with empty bags up to K*B, K = the most features on one table (K = 1, no padding, when no table is
shared). Consequences:
  - a fused optimizer sees every lookup of a physical table in one sort, so a row read by two
    features is updated ONCE per step with the summed gradient (FBGEMM's TBE does the same);
  - KJT values are passed to the op as they are when the KJT's keys come in the collection's
    feature order (the usual case); otherwise they are gathered into that order first.

Semantics follow TorchRec: output keys are the embedding names (``feature@table`` for a feature
read by several tables), output values fp32; MEAN pooling with weights (``is_weighted``) is the
weighted sum divided by the bag length (FBGEMM TBE). Tables with different poolings run in one
call: the op pools by sum and mean tables carry a 1/length per-sample weight (with bounds_check
"warn"/"skip" a dropped id then still counts in its bag's length, as FBGEMM's bounds check counts it).

state_dict keys are TorchRec's (``embedding_bags.<table>.weight`` / ``embeddings.<table>.weight``,
[rows, dim]), so a TorchRec checkpoint loads into these modules and theirs into TorchRec's. The
fused optimizer's state is not in ``state_dict()`` (TorchRec keeps it in its fused optimizer too):
``optimizer_state_dict()`` / ``load_optimizer_state_dict()`` (it names its tables, so a load into a
collection with the tables in another order follows each table by name).

torch.fx / ``torchrec.fx.symbolic_trace`` trace a collection as one call node (see
``gem_kernels.nn._fx``); ``torch.jit.script`` raises an error that names ``torch.export``.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from ..nn._fx import NotScriptable, is_proxy, trace_call
from ..nn.embedding_bag import PackedTables, check_backend, reference_fallback
from ..ops.embedding_bag import embedding_bag
from .._embedding_bag import advise_huge_pages, check_module_options, pack_tables

_DTYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}
# The op's bounds-check message (reference, cpu and triton backends): renamed to table and feature names.
_BAD_INDEX = re.compile(r"indices\[(\d+)\] = (-?\d+) is out of range for table (\d+) \(num_embeddings=(\d+)\) "
                        r"in bag (\d+)")


class _FusedCollection(PackedTables):
    """What both collections share: the packed tables, the optimizer state, the KJT -> op layout,
    the TorchRec state_dict keys."""

    _PREFIX = ""  # "embedding_bags" / "embeddings": TorchRec's state_dict key of the tables

    def __init__(self, tables, device, optimizer, bounds_check: str, backend: str | None, unpooled: bool):
        super().__init__()
        tables = list(tables)
        if not tables:
            raise ValueError("tables must be a non-empty list of TorchRec embedding configs, got []")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        check_module_options(optimizer, bounds_check)
        check_backend(backend)
        dtypes = set()
        for t in tables:
            for field in ("num_embeddings", "embedding_dim"):
                value = getattr(t, field)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"table {t.name!r}: {field} must be an int >= 1, got {value!r}")
            if t.data_type not in _DTYPES:
                raise ValueError(f"table {t.name!r}: data_type must be one of {[d.name for d in _DTYPES]}, got "
                                 f"{t.data_type}")
            dtypes.add(_DTYPES[t.data_type])
            if not t.feature_names:
                t.feature_names = [t.name]  # as TorchRec's modules do
        if len(dtypes) != 1:
            raise ValueError(f"every table must have the same data_type (one packed buffer), got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        self._configs = tables
        self.optimizer, self.bounds_check, self.backend = optimizer, bounds_check, backend
        self._table_names = names
        self._feature_names = [list(t.feature_names) for t in tables]
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        self._embedding_names = [e for names_t in self._embedding_names_by_table for e in names_t]
        # Lookups in output order: (table, slot of the feature within the table, feature, embedding name).
        self._lookups = [(t, j, f, e) for t, (fs, es) in enumerate(zip(self._feature_names,
                                                                         self._embedding_names_by_table))
                         for j, (f, e) in enumerate(zip(fs, es))]
        self._flat_features = [f for _, _, f, _ in self._lookups]
        self._slots_per_table = max(len(fs) for fs in self._feature_names)  # K
        self._feature_slots = [(t, j) for t, j, _, _ in self._lookups]
        dims = [t.embedding_dim for t in tables]
        if unpooled and len(set(dims)) != 1:
            raise ValueError(f"every table of an EmbeddingCollection must have the same embedding_dim, got {dims}")
        self._set_layout(pack_tables([t.num_embeddings for t in tables], dims), device)
        self.output_dim = self.layout.output_dim(pooled=not unpooled)
        self.weights = nn.Parameter(torch.empty(self.layout.num_elements, dtype=dtype, device=device))
        advise_huge_pages(self.weights)
        self._register_optimizer_state(optimizer, device, persistent=False)
        self.register_state_dict_post_hook(_state_dict_hook)
        self.register_load_state_dict_pre_hook(_load_state_dict_hook)
        reference_fallback(backend, device, "embedding_bag")
        self.reset_parameters()

    # -- tables -----------------------------------------------------------------------------------

    def reset_parameters(self) -> None:
        """Each table by its config's ``init_fn`` (TorchRec's default: U(-sqrt(1/rows), sqrt(1/rows)));
        optimizer state to zero."""
        if self.weights.device.type == "meta":
            return
        with torch.no_grad():
            for t, config in enumerate(self._configs):
                if config.init_fn is not None:
                    config.init_fn(self.weight(config.name))
            self.momentum1.zero_()
            self.momentum2.zero_()
            self.step.zero_()

    def weight(self, table: str) -> torch.Tensor:
        """Table ``table`` as a [rows, dim] view into the packed ``weights`` (writes go to the module)."""
        if table not in self._table_names:
            raise KeyError(f"no table {table!r}; tables: {self._table_names}")
        return self.layout.table(self.weights, self._table_names.index(table))

    def _copy_optimizer_state(self, table: str, other: "_FusedCollection") -> None:
        """Table ``table``'s fused optimizer state (packed like the rows or the weights) into ``other``'s."""
        t, u = self._table_names.index(table), other._table_names.index(table)
        for buffer in ("momentum1", "momentum2"):
            mine, theirs = getattr(self, buffer), getattr(other, buffer)
            if mine.numel() == self.layout.num_elements:
                other.layout.table(theirs, u).copy_(self.layout.table(mine, t))
            elif mine.numel():  # one per row
                rows, to = self.layout.rows_offsets, other.layout.rows_offsets
                theirs[to[u]:to[u + 1]].copy_(mine[rows[t]:rows[t + 1]])

    def fused_parameter_names(self) -> list[str]:
        """Parameters updated inside the backward (their ``.grad`` stays None): empty without an optimizer."""
        return ["weights"] if self.optimizer is not None else []

    def _state_table_names(self) -> list[str]:
        return self._table_names

    def split_by_keys(self, parts: list[list[str]]) -> "_PartitionedCollection":
        """This collection as a ``PartitionedEmbeddingBagCollection`` / ``PartitionedEmbeddingCollection``:
        one fused collection (one packed Parameter) per part, a part being a list of the tables'
        state_dict keys (``embedding_bags.<table>.weight``), every table in exactly one. The values and
        the fused optimizer's state are copied, options and ``requires_grad`` kept.
        ``gk.swap(model, optimizer=torch_optimizer)`` calls it when the optimizer's param groups split
        a collection's tables."""
        partitioned = _PARTITIONED.get(type(self))
        if partitioned is None:  # a subclass (e.g. the ZCH collection) holds more than the tables
            raise ValueError(f"a {type(self).__name__} cannot be split into parts")
        table_of = {f"{self._PREFIX}.{n}.weight": n for n in self._table_names}
        if (not isinstance(parts, (list, tuple)) or not all(isinstance(p, (list, tuple)) and p for p in parts)
                or sorted(k for p in parts for k in p) != sorted(table_of)):
            raise ValueError(f"parts must be non-empty lists of the keys {list(table_of)}, each key in exactly one "
                             f"part, got {parts!r}")
        modules = []
        for part in parts:
            names = {table_of[k] for k in part}
            module = type(self)([c for c in self._configs if c.name in names], device=self.weights.device,
                                optimizer=self.optimizer, bounds_check=self.bounds_check, backend=self.backend,
                                **self._options())
            with torch.no_grad():
                for name in names:
                    module.weight(name).copy_(self.weight(name))
                    self._copy_optimizer_state(name, module)
                module.step.copy_(self.step)
            module.weights.requires_grad_(self.weights.requires_grad)
            modules.append(module.train(self.training))
        return partitioned(self._configs, modules)

    def _copy_tables_from(self, modules: dict, configs) -> None:
        """The weights of TorchRec's per-table modules; ``weights`` is frozen when they all are (one
        packed Parameter cannot freeze some tables only)."""
        frozen = {c.name: not modules[c.name].weight.requires_grad for c in configs}
        if len(set(frozen.values())) > 1:
            raise ValueError(f"some tables are frozen (requires_grad=False) and some are not {frozen}: one packed "
                             f"buffer trains all of them or none")
        with torch.no_grad():
            for config in configs:
                self.weight(config.name).copy_(modules[config.name].weight)
        self.weights.requires_grad_(not all(frozen.values()))

    # -- KJT -> the op's layout ----------------------------------------------------------------------

    def _op_inputs(self, features: KeyedJaggedTensor, with_weights: bool):
        """(indices, offsets, per-sample weights or None, lengths [lookups, B], B) in the op's layout."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a torchrec KeyedJaggedTensor, got {type(features).__name__}")
        keys = features.keys()
        missing = [f for f in self._flat_features if f not in keys]
        if missing:
            raise ValueError(f"features is missing the keys {sorted(set(missing))} (it has {keys})")
        if features.variable_stride_per_key():
            raise ValueError(f"features is a variable-batch KJT (stride per key {features.stride_per_key()}): "
                             f"variable-batch KJTs are not supported; give every key the same batch size")
        values = features.values()
        if values.dtype not in (torch.int32, torch.int64):
            if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
                raise TypeError(f"features' values must be integer ids (int32 or int64), got {values.dtype}")
            values = values.long()  # uint8/int8/int16 ids: TorchRec's modules take them too
        weights = features.weights_or_none() if with_weights else None
        if with_weights and weights is None:
            raise ValueError("features has no weights, but the collection is_weighted=True: build the KJT with "
                             "weights= (one per value)")
        num_lengths = features.lengths().numel()
        if num_lengths % max(len(keys), 1):
            raise ValueError(f"features has {num_lengths} lengths for {len(keys)} keys {keys}: a KJT needs "
                             f"batch_size lengths per key")
        batch = features.stride()
        if num_lengths != len(keys) * batch:
            raise ValueError(f"features has {num_lengths} lengths, expected {len(keys)} keys x stride {batch}")
        lengths = features.lengths().view(len(keys), batch)
        # A value check in the KJT's own terms; CPU only: on a GPU it would be a host sync per batch
        # (there the op's offsets check still refuses the input).
        if not torch.compiler.is_compiling() and values.device.type == "cpu":
            total = int(lengths.sum())
            if total != values.numel():
                raise ValueError(f"features' lengths sum to {total}, but it has {values.numel()} values")
        if list(keys) != self._flat_features:  # gather the values into the collection's feature order
            select = [keys.index(f) for f in self._flat_features]
            values, weights, lengths = _select_features(values, weights, lengths, select)
        bag_lengths = slot_bag_lengths(lengths, self._feature_slots, len(self._configs))
        # Measured and not kept (front12, 2026-12-07): F.pad(cumsum, (1, 0)) here, 6.1 -> 4.7 us in
        # isolation, too little to see in the model's step.
        offsets = torch.cat([bag_lengths.new_zeros(1), bag_lengths.cumsum(0)]).to(values.dtype)
        return values, offsets, weights, bag_lengths, lengths, batch

    def _lookup(self, values, offsets, psw, pooling: str, batch: int) -> torch.Tensor:
        # Frozen tables (requires_grad False) are never updated, whatever else needs a gradient.
        optimizer = self.optimizer if self.weights.requires_grad else None

        def run():
            return embedding_bag(self.weights, self.table_meta, values, offsets, psw, output_dim=self.output_dim,
                                 pooling=pooling, bounds_check=self.bounds_check, optimizer=optimizer,
                                 momentum1=self.momentum1, momentum2=self.momentum2, step=self.step,
                                 backend=self.backend)

        if torch.compiler.is_compiling():  # a compiled graph raises the op's own message (table number, bag)
            return run()
        try:
            return run()
        except IndexError as error:
            raise self._name_bad_index(error, batch) from None

    def _name_bad_index(self, error: IndexError, batch: int) -> IndexError:
        """The op's message names table t and bag (slot) b; TorchRec users want names."""
        match = _BAD_INDEX.search(str(error))
        if match is None:
            return error
        value, t, rows, bag = int(match.group(2)), int(match.group(3)), int(match.group(4)), int(match.group(5))
        j, sample = divmod(bag, max(batch, 1))
        feature = self._feature_names[t][j] if j < len(self._feature_names[t]) else "?"
        return IndexError(f"feature {feature!r}: id {value} is out of range for table {self._table_names[t]!r} "
                          f"(num_embeddings={rows}) in sample {sample}")

    def extra_repr(self) -> str:
        return (f"tables={self._table_names}, rows={self.layout.num_rows}, dims={sorted(set(self.layout.dims))}, "
                f"dtype={self.weights.dtype}, optimizer={self.optimizer}, bounds_check={self.bounds_check!r}")


def _config_list(tables, config_type: type) -> list:
    """``tables`` as a list, or a TypeError naming the argument (a bare config, None, a string)."""
    if isinstance(tables, (str, bytes, config_type)) or not hasattr(tables, "__iter__"):
        raise TypeError(f"tables must be a list of torchrec {config_type.__name__}, got {tables!r}")
    tables = list(tables)
    if not all(isinstance(t, config_type) for t in tables):
        raise ValueError(f"tables must be a list of torchrec {config_type.__name__}, got {tables!r}")
    return tables


def slot_bag_lengths(lengths: torch.Tensor, slots_of_features: list[tuple[int, int]], num_tables: int) -> torch.Tensor:
    """The op's [T*K*B] bag lengths from a KJT's [F, B] lengths, the features in table order.

    The op wants the same number of bags in every table; feature i reads table t as its j-th
    feature (``slots_of_features[i] = (t, j)``): slot (t, j) is bags (t*K + j)*B ... of the op,
    K = the most features on one table, and the slots no feature fills are empty bags. The values
    need no reordering: features in table order are the op's bags in order, padding being empty.
    """
    slots = 1 + max(j for _, j in slots_of_features)
    if slots == 1 and len(slots_of_features) == num_tables:
        return lengths.reshape(-1)
    pad = len(slots_of_features)
    order = [pad] * (num_tables * slots)
    for i, (t, j) in enumerate(slots_of_features):
        order[t * slots + j] = i
    padded = torch.cat([lengths, lengths.new_zeros(1, lengths.shape[1])])
    return padded[torch.tensor(order, device=lengths.device)].reshape(-1)


def pooled_by_feature(out: torch.Tensor, slots_of_features: list[tuple[int, int]], D_offsets: list[int],
                      batch: int) -> torch.Tensor:
    """The op's pooled output in the bag layout of ``slot_bag_lengths`` -> [B, sum of the features'
    dims], one block per feature in order (what TorchRec's and FBGEMM's lookups return)."""
    slots = 1 + max(j for _, j in slots_of_features)
    if slots == 1 and len(slots_of_features) == len(D_offsets) - 1:
        return out
    out3 = out.view(slots, batch, out.shape[-1])
    return torch.cat([out3[j, :, D_offsets[t]:D_offsets[t + 1]] for t, j in slots_of_features], dim=1)


def _select_features(values, weights, lengths, select: list[int]):
    """The features ``select`` (indices into the KJT's keys, repeats allowed) of a KJT's values,
    weights and [F, B] lengths, in that order."""
    device = lengths.device
    totals = lengths.sum(1)
    starts = totals.cumsum(0) - totals
    index = torch.tensor(select, dtype=torch.int64, device=device)
    seg_lengths = totals[index]
    # A permutation keeps the number of values (a static size, so torch.compile needs no data read).
    size = values.numel() if sorted(select) == list(range(lengths.shape[0])) else int(seg_lengths.sum())
    seg_starts = seg_lengths.cumsum(0) - seg_lengths
    shift = torch.repeat_interleave(starts[index] - seg_starts, seg_lengths, output_size=size)
    gather = torch.arange(size, device=device) + shift
    return values[gather], (weights[gather] if weights is not None else None), lengths[index]


def _state_dict_hook(module: _FusedCollection, state_dict: dict, prefix: str, local_metadata) -> None:
    flat = state_dict.pop(prefix + "weights")
    for t, name in enumerate(module._table_names):
        state_dict[f"{prefix}{module._PREFIX}.{name}.weight"] = module.layout.table(flat, t)


def _load_state_dict_hook(module: _FusedCollection, state_dict: dict, prefix: str, local_metadata, strict: bool,
                          missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """TorchRec's per-table keys -> the packed ``weights`` (absent tables keep their values and are
    reported missing)."""
    if prefix + "weights" in state_dict:
        return
    pieces = []
    for t, name in enumerate(module._table_names):
        key = f"{prefix}{module._PREFIX}.{name}.weight"
        current = module.weight(name).detach()
        if key not in state_dict:
            missing_keys.append(key)
            pieces.append(current.reshape(-1))
            continue
        value = state_dict.pop(key)
        if tuple(value.shape) != tuple(current.shape):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, the shape "
                              f"in the current model is {tuple(current.shape)}.")
            pieces.append(current.reshape(-1))
            continue
        pieces.append(value.detach().to(device=current.device, dtype=current.dtype).reshape(-1))
    state_dict[prefix + "weights"] = torch.cat(pieces)


class FusedEmbeddingBagCollection(_FusedCollection):
    """TorchRec's ``EmbeddingBagCollection`` (KJT in, KeyedTensor out) as one fused lookup.

    ``ebc(features) -> KeyedTensor`` with keys, order and values exactly as TorchRec's module:
    per table, per feature in ``feature_names``, the [B, dim] pooled bag (SUM or MEAN; weighted
    with ``is_weighted`` from the KJT's weights; weighted MEAN = weighted sum / length). ``optimizer``:
    None (``weights`` gets a dense gradient for any torch optimizer) or a ``gem_kernels.optim`` rule,
    applied inside the backward once per touched row (rows shared by features summed first).
    ``bounds_check``: "fatal" raises IndexError naming the feature and table of an out-of-range id.
    """

    _PREFIX = "embedding_bags"

    def __init__(self, tables: list[EmbeddingBagConfig], is_weighted: bool = False, device=None, optimizer=None,
                 bounds_check: str = "fatal", backend: str | None = None):
        tables = _config_list(tables, EmbeddingBagConfig)
        for t in tables:
            if t.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"table {t.name!r}: pooling must be SUM or MEAN, got {t.pooling}")
        super().__init__(tables, device, optimizer, bounds_check, backend, unpooled=False)
        self._is_weighted = bool(is_weighted)
        poolings = {t.pooling for t in tables}
        # One pooling: the op's own. Mixed: sum, with 1/length per-sample weights on the mean tables.
        self._pooling = "mean" if poolings == {PoolingType.MEAN} else "sum"
        self._mean_tables = [t.pooling == PoolingType.MEAN for t in tables] if len(poolings) > 1 else None
        self._lengths_per_embedding = [self.layout.dims[t] for t, _, _, _ in self._lookups]

    @classmethod
    def from_torchrec(cls, ebc: EmbeddingBagCollection, optimizer=None, bounds_check: str = "fatal",
                      backend: str | None = None) -> "FusedEmbeddingBagCollection":
        """A fused copy of a TorchRec ``EmbeddingBagCollection`` (same configs, weights, device)."""
        if not isinstance(ebc, EmbeddingBagCollection):
            raise ValueError(f"ebc must be a torchrec EmbeddingBagCollection, got {type(ebc).__name__}")
        configs = ebc.embedding_bag_configs()
        device = next(iter(ebc.embedding_bags.values())).weight.device
        module = cls(configs, is_weighted=ebc.is_weighted(), device=device, optimizer=optimizer,
                     bounds_check=bounds_check, backend=backend)
        module._copy_tables_from(ebc.embedding_bags, configs)
        return module

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def _options(self) -> dict:
        return {"is_weighted": self._is_weighted}

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if is_proxy(features):
            return trace_call(self, features)
        values, offsets, psw, bag_lengths, _, batch = self._op_inputs(features, self._is_weighted)
        slots = self._slots_per_table
        if self._mean_tables is not None:
            slot_is_mean = torch.tensor([m for m in self._mean_tables for _ in range(slots)], device=values.device)
            bag_scale = torch.where(slot_is_mean.repeat_interleave(batch), 1.0 / bag_lengths.clamp(min=1).float(), 1.0)
            scale = torch.repeat_interleave(bag_scale, bag_lengths, output_size=values.numel())
            psw = scale if psw is None else psw * scale
        out = pooled_by_feature(self._lookup(values, offsets, psw, self._pooling, batch),
                                self._feature_slots, self.layout.D_offsets, batch)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=out.float())


class FusedEmbeddingCollection(_FusedCollection):
    """TorchRec's ``EmbeddingCollection`` (KJT in, dict[str, JaggedTensor] out, no pooling) as one
    fused lookup; every table has the same embedding_dim (as TorchRec requires). Keys, order and
    values as TorchRec's module; ``need_indices`` puts the ids in each JaggedTensor's weights."""

    _PREFIX = "embeddings"

    def __init__(self, tables: list[EmbeddingConfig], device=None, optimizer=None, bounds_check: str = "fatal",
                 backend: str | None = None, need_indices: bool = False):
        tables = _config_list(tables, EmbeddingConfig)
        super().__init__(tables, device, optimizer, bounds_check, backend, unpooled=True)
        self._need_indices = bool(need_indices)

    @classmethod
    def from_torchrec(cls, ec: EmbeddingCollection, optimizer=None, bounds_check: str = "fatal",
                      backend: str | None = None) -> "FusedEmbeddingCollection":
        """A fused copy of a TorchRec ``EmbeddingCollection`` (same configs, weights, device)."""
        if not isinstance(ec, EmbeddingCollection):
            raise ValueError(f"ec must be a torchrec EmbeddingCollection, got {type(ec).__name__}")
        configs = ec.embedding_configs()
        device = next(iter(ec.embeddings.values())).weight.device
        module = cls(configs, device=device, optimizer=optimizer, bounds_check=bounds_check, backend=backend,
                     need_indices=ec.need_indices())
        module._copy_tables_from(ec.embeddings, configs)
        return module

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._configs

    def embedding_dim(self) -> int:
        return self.output_dim

    def need_indices(self) -> bool:
        return self._need_indices

    def _options(self) -> dict:
        return {"need_indices": self._need_indices}

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._embedding_names_by_table

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if is_proxy(features):
            return trace_call(self, features)
        values, offsets, _, _, lengths, batch = self._op_inputs(features, False)
        out = self._lookup(values, offsets, None, "none", batch).float()
        # The op's rows follow the values, which are in lookup order: one piece per lookup.
        totals = lengths.sum(1).tolist()
        pieces = torch.split(out, totals)
        ids = torch.split(values, totals) if self._need_indices else [None] * len(totals)
        return {e: JaggedTensor(values=pieces[i], lengths=lengths[i], weights=ids[i])
                for i, (_, _, _, e) in enumerate(self._lookups)}


class _PartitionedCollection(NotScriptable, nn.Module):
    """A collection's tables in several fused collections (``parts``, one packed ``weights`` each),
    answering as the one collection: same outputs (keys, order, values), same TorchRec state_dict
    keys. ``gk.swap(model, optimizer=torch_optimizer)`` builds one where the optimizer's param groups
    (per-table lr, weight decay, ...) split a collection's tables, so that each group holds the packed
    Parameter of its own tables. Each part looks up its own features of the KJT (one fused call per
    part, its features gathered first unless they come first in the KJT's order)."""

    _PREFIX = ""
    _PART: type = nn.Module

    def __init__(self, tables, parts):
        super().__init__()
        tables, parts = list(tables), list(parts)
        if len(parts) < 2 or not all(type(p) is self._PART for p in parts):
            raise ValueError(f"parts must be two or more {self._PART.__name__}, got {[type(p).__name__ for p in parts]}")
        names = [t.name for t in tables]
        part_of = {n: i for i, p in enumerate(parts) for n in p._table_names}
        if len(set(names)) != len(names) or sorted(names) != sorted(n for p in parts for n in p._table_names):
            raise ValueError(f"every table of {names} must be in exactly one part, got parts "
                             f"{[p._table_names for p in parts]}")
        options = {tuple(sorted(p._options().items())) for p in parts}
        if len(options) != 1:
            raise ValueError(f"every part must have the same options, got {sorted(options)}")
        self._configs, self._table_names, self._part_of = tables, names, part_of
        self.parts = nn.ModuleList(parts)
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        self._embedding_names = [e for es in self._embedding_names_by_table for e in es]
        # Each output (table, feature slot) -> (part, the lookup's position in the part's output). A
        # part names its lookups among its own tables (``feature@table`` only where needed there).
        self._sources = []
        for name, embedding_names in zip(names, self._embedding_names_by_table):
            part = parts[part_of[name]]
            for j in range(len(embedding_names)):
                pos = next(k for k, (t, slot, _, _) in enumerate(part._lookups)
                           if part._table_names[t] == name and slot == j)
                self._sources.append((part_of[name], pos))
        self.register_state_dict_post_hook(_partitioned_state_dict_hook)
        self.register_load_state_dict_pre_hook(_partitioned_load_state_dict_hook)
        self.register_load_state_dict_post_hook(_partitioned_load_state_dict_post_hook)

    def _part_key(self, name: str) -> str:
        return f"parts.{self._part_of[name]}.{self._PREFIX}.{name}.weight"

    def weight(self, table: str) -> torch.Tensor:
        """Table ``table`` as a [rows, dim] view into its part's packed ``weights``."""
        if table not in self._part_of:
            raise KeyError(f"no table {table!r}; tables: {self._table_names}")
        return self.parts[self._part_of[table]].weight(table)

    def reset_parameters(self) -> None:
        for part in self.parts:
            part.reset_parameters()

    def fused_parameter_names(self) -> list[str]:
        return [f"parts.{i}.{n}" for i, part in enumerate(self.parts) for n in part.fused_parameter_names()]

    def extra_repr(self) -> str:
        return f"tables={self._table_names}, parts={[p._table_names for p in self.parts]}"


def _partitioned_state_dict_hook(module: _PartitionedCollection, state_dict: dict, prefix: str, local_metadata) -> None:
    """The parts' keys without their ``parts.<i>.``, in the collection's table order (TorchRec's)."""
    tables = {name: state_dict.pop(prefix + module._part_key(name)) for name in module._table_names}
    for name, value in tables.items():
        state_dict[f"{prefix}{module._PREFIX}.{name}.weight"] = value


def _partitioned_load_state_dict_hook(module: _PartitionedCollection, state_dict: dict, prefix: str, local_metadata,
                                      strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    for name in module._table_names:
        key = f"{prefix}{module._PREFIX}.{name}.weight"
        if key in state_dict:
            state_dict[prefix + module._part_key(name)] = state_dict.pop(key)


def _partitioned_load_state_dict_post_hook(module: _PartitionedCollection, incompatible_keys) -> None:
    """A missing table is reported by its TorchRec key, not by its part's."""
    suffixes = {module._part_key(n): f"{module._PREFIX}.{n}.weight" for n in module._table_names}
    for i, key in enumerate(incompatible_keys.missing_keys):
        for inner, outer in suffixes.items():
            if key == inner or key.endswith("." + inner):
                incompatible_keys.missing_keys[i] = key[:len(key) - len(inner)] + outer


class PartitionedEmbeddingBagCollection(_PartitionedCollection):
    """An ``EmbeddingBagCollection`` whose tables are in several ``FusedEmbeddingBagCollection`` parts
    (see ``FusedEmbeddingBagCollection.split_by_keys``): KJT in, the one KeyedTensor out, keys and
    columns in the tables' order, as TorchRec's module returns."""

    _PREFIX = "embedding_bags"
    _PART = FusedEmbeddingBagCollection

    def __init__(self, tables: list[EmbeddingBagConfig], parts: list[FusedEmbeddingBagCollection]):
        super().__init__(tables, parts)
        starts = [[0] for _ in parts]
        for part, s in zip(parts, starts):
            for dim in part._lengths_per_embedding:
                s.append(s[-1] + dim)
        self._lengths_per_embedding = [parts[i]._lengths_per_embedding[pos] for i, pos in self._sources]
        # Columns of the output: runs of (part, first column, end column), neighbours merged.
        self._blocks: list[tuple[int, int, int]] = []
        for i, pos in self._sources:
            a, b = starts[i][pos], starts[i][pos + 1]
            if self._blocks and self._blocks[-1][0] == i and self._blocks[-1][2] == a:
                self._blocks[-1] = (i, self._blocks[-1][1], b)
            else:
                self._blocks.append((i, a, b))

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self.parts[0].is_weighted()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if is_proxy(features):
            return trace_call(self, features)
        outs = [part(features).values() for part in self.parts]
        values = torch.cat([outs[i][:, a:b] for i, a, b in self._blocks], dim=1)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=values)


class PartitionedEmbeddingCollection(_PartitionedCollection):
    """An ``EmbeddingCollection`` whose tables are in several ``FusedEmbeddingCollection`` parts (see
    ``FusedEmbeddingCollection.split_by_keys``): KJT in, the one dict[str, JaggedTensor] out, keys in
    the tables' order, as TorchRec's module returns."""

    _PREFIX = "embeddings"
    _PART = FusedEmbeddingCollection

    def __init__(self, tables: list[EmbeddingConfig], parts: list[FusedEmbeddingCollection]):
        super().__init__(tables, parts)
        self._part_names = [(i, parts[i]._embedding_names[pos]) for i, pos in self._sources]

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._configs

    def embedding_dim(self) -> int:
        return self.parts[0].embedding_dim()

    def need_indices(self) -> bool:
        return self.parts[0].need_indices()

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._embedding_names_by_table

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if is_proxy(features):
            return trace_call(self, features)
        outs = [part(features) for part in self.parts]
        return {e: outs[i][name] for e, (i, name) in zip(self._embedding_names, self._part_names)}


_PARTITIONED = {FusedEmbeddingBagCollection: PartitionedEmbeddingBagCollection,
                FusedEmbeddingCollection: PartitionedEmbeddingCollection}

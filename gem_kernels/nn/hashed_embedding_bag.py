"""``HashedEmbeddingBag``: T embedding bags addressed by raw int64 ids (zero-collision hashing).

Each table has ``num_embeddings`` rows; a ``ZchTables`` (gem_kernels/ops/zch.py) maps each raw id to
a row of its own while rows are free (no two live ids ever share a row), and evicts by LRU, LFU or TTL
once the table is full. A row given to a new id gets that id's fresh weights
(``reference.zch.fresh_row``, uniform in the table's init bounds) and zero optimizer state before the
lookup reads it, so nothing of the old id leaks into the new one.
"""

from __future__ import annotations

import math

import torch

from .._validate import FLOAT_DTYPES
from ..ops.zch import ZchTables, zch_embedding_bag
from .._embedding_bag import advise_huge_pages, check_module_options, pack_tables
from ._fx import is_proxy, trace_call
from .embedding_bag import PackedTables, TableSpec

UNADMITTED = ("zeros", "default_row")


def remap_by_table(zch: ZchTables, ids: torch.Tensor, offsets: torch.Tensor, train: bool, timestamp: int | None,
                   default_row: bool, reset, backend: str | None) -> torch.Tensor:
    """``zch.remap`` of the ids of an embedding-bag call: offsets [T*S+1] hold S bags per table, so
    table t's ids start at offsets[t*S]. Wrapped for torch.fx (below): it reads offsets' size and the
    clock, which a symbolic trace cannot, so traced modules call it as one node."""
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"offsets must be a 1-D tensor of T*B+1 elements, got "
                         f"{tuple(offsets.shape) if isinstance(offsets, torch.Tensor) else type(offsets).__name__}")
    num_tables = zch.num_tables
    if (offsets.numel() - 1) % num_tables:
        raise ValueError(f"offsets must have T*B+1 elements with T = {num_tables}, got {offsets.numel()}")
    stride = (offsets.numel() - 1) // num_tables
    id_offsets = offsets[::stride] if stride else offsets.new_zeros(num_tables + 1)
    return zch.remap(ids, id_offsets, train, timestamp, default_row=default_row, reset=reset, backend=backend)


torch.fx.wrap("remap_by_table")


def hashed_lookup(module, ids: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None,
                  pooling: str, timestamp: int | None) -> torch.Tensor:
    """The fused remap + lookup (``zch_embedding_bag``) of a module holding hashed tables (weights,
    table_meta, optimizer state, zch, init_bounds, seed, unadmitted, backend). Frozen weights
    (requires_grad False) are never updated."""
    optimizer = module.optimizer if module.weights.requires_grad else None
    return zch_embedding_bag(module.weights, module.table_meta, ids, offsets, module.zch, per_sample_weights,
                             output_dim=module.output_dim, pooling=pooling, train=module.training, timestamp=timestamp,
                             default_row=module.unadmitted == "default_row", init_bounds=module.init_bounds,
                             seed=module.seed, optimizer=optimizer, momentum1=module.momentum1,
                             momentum2=module.momentum2, step=module.step, backend=module.backend)



class HashedEmbeddingBag(PackedTables):
    """T embedding bags over raw int64 ids: the remap (``zch_remap``) fused into the embedding-bag
    lookup (``zch_embedding_bag``: one pass over the ids remaps and pools).

    ``out = module(ids, offsets, per_sample_weights=None, timestamp=None)``: ids [N] raw int64 (any
    value), offsets [T*B+1] feature-major as ``FusedEmbeddingBag`` (bag b of table t is
    ``ids[offsets[t*B+b]:offsets[t*B+b+1]]``); output [B, sum_t D_t].

    In training mode each call admits and evicts (one serial pass per table, tables in parallel);
    in eval mode ids are only looked up. An id without a row (not yet admitted, or no row may be
    evicted for it) reads ``unadmitted``: "zeros" (left out of its bag; a mean is over the ids kept)
    or "default_row" (the table's last row, shared and trained; the table then holds
    ``num_embeddings - 1`` ids).

    Args beyond ``FusedEmbeddingBag``'s (tables, pooling "sum"/"mean", dtype, device, optimizer, backend):
        eviction, ttl, ttl_unit, admission_threshold, admission_capacity, max_probe: see ``ZchTables``.
            With ``ttl_unit="steps"`` time is the count of training calls; with "seconds" pass each
            batch's ``timestamp`` (int).
        init_bounds: per table (lo, hi) of the uniform initialiser of fresh rows; default TorchRec's
            (-sqrt(1/rows), sqrt(1/rows)).
        seed: the fresh rows' seed (rows are a function of (seed, table, id), so every backend and
            thread count gives the same weights).

    ``optimizer``: a ``gem_kernels.optim`` config updates the looked-up rows in the backward (only
    live rows: an unadmitted id in "zeros" mode touches none); its state is reset with the row.
    With ``optimizer=None`` the weights get a dense gradient and the external optimizer's state is
    not reset on reuse (use a fused optimizer for that).
    ``state_dict()``: weights, optimizer state, the identity tables and eviction metadata (``zch.*``)
    and the step; loading it restores the identity tables exactly.
    """

    def __init__(self, tables: list[TableSpec], pooling: str = "sum", dtype: torch.dtype = torch.float32,
                 device=None, optimizer=None, eviction: str = "lru", ttl: int | None = None, ttl_unit: str = "steps",
                 admission_threshold: int = 1, admission_capacity: int | None = None, max_probe: int = 32,
                 unadmitted: str = "zeros", init_bounds: list[tuple[float, float]] | None = None, seed: int = 0,
                 backend: str | None = None):
        super().__init__()
        tables = list(tables)
        if not tables or not all(isinstance(t, TableSpec) for t in tables):
            raise ValueError(f"tables must be a non-empty list of TableSpec, got {tables!r}")
        if pooling not in ("sum", "mean"):
            raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
        check_module_options(optimizer)
        if unadmitted not in UNADMITTED:
            raise ValueError(f"unadmitted must be one of {UNADMITTED}, got {unadmitted!r}")
        if unadmitted == "default_row" and any(t.num_embeddings < 2 for t in tables):
            raise ValueError("unadmitted 'default_row' needs num_embeddings >= 2 in every table (one row is the default)")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        rows = [t.num_embeddings for t in tables]
        if init_bounds is None:
            init_bounds = [(-math.sqrt(1 / r), math.sqrt(1 / r)) for r in rows]
        init_bounds = [tuple(b) for b in init_bounds]
        if len(init_bounds) != len(tables) or not all(len(b) == 2 and math.isfinite(b[0]) and math.isfinite(b[1])
                                                      and b[0] <= b[1] for b in init_bounds):
            raise ValueError(f"init_bounds must be one finite (lo, hi) with lo <= hi per table, got {init_bounds!r}")
        self.tables, self.pooling, self.optimizer, self.backend = tables, pooling, optimizer, backend
        self.unadmitted, self.seed = unadmitted, seed
        default_row = unadmitted == "default_row"
        self.zch = ZchTables([r - 1 if default_row else r for r in rows], eviction=eviction, ttl=ttl,
                             ttl_unit=ttl_unit, admission_threshold=admission_threshold,
                             admission_capacity=admission_capacity, max_probe=max_probe, device=device)
        self._set_layout(pack_tables(rows, [t.embedding_dim for t in tables]), device)
        self.output_dim = self.layout.output_dim(pooled=True)
        self.weights = torch.nn.Parameter(torch.empty(self.layout.num_elements, dtype=dtype, device=device))
        advise_huge_pages(self.weights)
        self._register_optimizer_state(optimizer, device, persistent=True)
        self.register_buffer("init_bounds", torch.tensor(init_bounds, dtype=torch.float64, device=device),
                             persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every table uniform in its init bounds, every slot free, optimizer state zero."""
        with torch.no_grad():
            for t, (lo, hi) in enumerate(self.init_bounds.tolist()):
                self.layout.table(self.weights, t).uniform_(lo, hi)
            self.momentum1.zero_()
            self.momentum2.zero_()
            self.step.zero_()
            self.zch.reset()

    def weight(self, t: int) -> torch.Tensor:
        """Table t as a [rows_t, D_t] view of the packed weights (row = slot; the default row last)."""
        return self.layout.table(self.weights, t)

    def fused_parameter_names(self) -> list[str]:
        return ["weights"] if self.optimizer is not None else []

    def remap(self, ids: torch.Tensor, offsets: torch.Tensor, timestamp: int | None = None) -> torch.Tensor:
        """The rows of ``ids`` (the forward's first half): -1 for an id without a row in "zeros" mode."""
        return remap_by_table(self.zch, ids, offsets, self.training, timestamp, self.unadmitted == "default_row",
                              (self.weights, self.table_meta, self.momentum1, self.momentum2, self.init_bounds,
                               self.seed), self.backend)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None,
                timestamp: int | None = None) -> torch.Tensor:
        if is_proxy(ids, offsets, per_sample_weights):  # torch.fx: the whole call is one node
            return trace_call(self, ids, offsets, per_sample_weights, timestamp)
        return hashed_lookup(self, ids, offsets, per_sample_weights, self.pooling, timestamp)

    def extra_repr(self) -> str:
        return (f"rows={list(self.layout.rows)}, dims={list(self.layout.dims)}, pooling={self.pooling!r}, "
                f"unadmitted={self.unadmitted!r}, optimizer={self.optimizer}")

"""Zero-collision hashing (zch): raw int64 ids -> table slots, with eviction and admission.

``ZchTables`` holds the identity tables of T tables (which raw id owns each slot) and their eviction
metadata; ``zch_remap(ids, id_offsets, tables)`` maps a batch of raw ids to slots and, in training,
admits new ids and evicts old ones; ``zch_embedding_bag`` fuses that remap into the embedding-bag
lookup (one pass over the ids remaps and pools; the modules' forward). The algorithm and the state layout are in
gem_kernels/reference/zch.py; csrc/cpu/zch.cpp, csrc/cuda/zch.cu and gem_kernels/triton/zch.py run
the same steps. Backends: ``cpu`` (C++), ``cuda`` (a thread per table), ``triton`` (a program per
table) and ``reference`` (plain Python); all give the same state bit for bit, at any thread count
(tables run in parallel, one table's ids in order). On cuda and triton the fused lookup is the remap,
then the embedding-bag kernel (two passes).
"""

from __future__ import annotations

import torch
from torch import nn

from .._backend import Family, _on_device_of_inputs, kernel, resolve_backend
from .._embedding_bag import OPT_NONE, OPTIMIZER_CODES, POOLING_CODES, SKIP, TableMeta
from .._validate import (check_int64, check_offsets_meta, check_same_device, check_tensor, per_sample_weights_arg)
from ..reference.zch import POLICY_CODES, STATE_FIELDS
from .embedding_bag import _backward as _embedding_bag_backward, _setup as _embedding_bag_setup

def _reference_zch():
    from ..reference import zch
    return zch


def _triton_zch():
    from ..triton import zch
    return zch


FAMILY = Family(_reference_zch, _triton_zch, implemented=("reference", "cpu", "cuda", "triton"))

TTL_UNITS = ("steps", "seconds")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class ZchTables(nn.Module):
    """The identity tables and eviction state of T zero-collision tables (buffers, in ``state_dict()``).

    Args:
        slots: per table, how many ids it holds at once (its rows).
        eviction: "lru" (least recently used), "lfu" (least frequently used; ties: least recent) or
            "ttl" (an id not seen for ``ttl`` steps/seconds may lose its slot; the oldest goes first).
        ttl: for "ttl", the time to live (int >= 1) in ``ttl_unit``.
        ttl_unit: "steps" (``now`` is the count of training batches) or "seconds" (``now`` is the
            batch's timestamp, which must not decrease).
        admission_threshold: sightings an id needs before it gets a slot (1: at once). Counts are kept
            in ``admission_capacity`` cells per table (default 2 x slots); see ``pending_replacements``.
        max_probe: the most index cells one lookup inspects (the probe bound). The index has
            >= 4 x slots cells, so it is at most a quarter full (at half full, a full 8192-slot
            table under churn overflowed 32 probes ~1e-3 of its insertions; bench/hashed.py).

    Stats (``stats()``, cumulative, per table): used slots, hits, lookups, evictions, unadmitted
    lookups, probe overflows (new ids refused because no empty cell was within max_probe), the
    largest probe count seen, pending replacements.
    """

    def __init__(self, slots: list[int], eviction: str = "lru", ttl: int | None = None, ttl_unit: str = "steps",
                 admission_threshold: int = 1, admission_capacity: int | None = None, max_probe: int = 32,
                 device=None):
        super().__init__()
        slots = list(slots)
        if not slots:
            raise ValueError("slots must be a non-empty list of ints >= 1, got []")
        for t, s in enumerate(slots):
            _check_int(f"slots[{t}]", s, 1)
        if eviction not in POLICY_CODES:
            raise ValueError(f"eviction must be one of {tuple(POLICY_CODES)}, got {eviction!r}")
        if eviction == "ttl":
            _check_int("ttl", ttl, 1)
        elif ttl is not None:
            raise ValueError(f"ttl is only used with eviction 'ttl', got ttl={ttl!r} with eviction {eviction!r}")
        if ttl_unit not in TTL_UNITS:
            raise ValueError(f"ttl_unit must be one of {TTL_UNITS}, got {ttl_unit!r}")
        _check_int("admission_threshold", admission_threshold, 1)
        _check_int("max_probe", max_probe, 1)
        if admission_capacity is not None:
            _check_int("admission_capacity", admission_capacity, 1)
        self.slots, self.eviction, self.ttl, self.ttl_unit = slots, eviction, ttl or 0, ttl_unit
        self.admission_threshold, self.max_probe = admission_threshold, max_probe
        index_cells = [_pow2_at_least(4 * s) for s in slots]
        pending_cells = [0 if admission_threshold == 1 else _pow2_at_least(admission_capacity or 2 * s)
                         for s in slots]

        def cumsum(xs):
            out = [0]
            for x in xs:
                out.append(out[-1] + x)
            return out

        self.register_buffer("layout", torch.tensor([cumsum(slots), cumsum(index_cells), cumsum(pending_cells)],
                                                    dtype=torch.int64, device=device), persistent=False)
        total, cells, pcells = sum(slots), sum(index_cells), sum(pending_cells)
        opts = dict(dtype=torch.int64, device=device)
        self.register_buffer("slot_meta", torch.zeros(total, 4, **opts))
        self.register_buffer("heap", torch.zeros(total, 3, **opts))
        self.register_buffer("index", torch.zeros(cells, 2, **opts))
        self.register_buffer("pending", torch.zeros(pcells, 2, **opts))
        self.register_buffer("table_state", torch.zeros(len(slots), len(STATE_FIELDS), **opts))
        # Training calls so far: the clock of ttl_unit "steps".
        self.register_buffer("step", torch.zeros((), **opts))
        self.reset()

    def reset(self) -> None:
        """Every slot free, every counter zero."""
        with torch.no_grad():
            for buffer in (self.slot_meta, self.heap, self.pending, self.table_state, self.step):
                buffer.zero_()
            self.index.zero_()
            self.index[:, 1] = -1

    @property
    def num_tables(self) -> int:
        return len(self.slots)

    def table_ids(self, t: int) -> torch.Tensor:
        """The identity table of table t: [slots_t] raw ids, in slot order (a free slot reads 0; see
        ``table_used``)."""
        start = sum(self.slots[:t])
        return self.slot_meta[start:start + self.slots[t], 0]

    def table_used(self, t: int) -> torch.Tensor:
        """[slots_t] bool: whether each slot of table t holds an id."""
        start = sum(self.slots[:t])
        return self.slot_meta[start:start + self.slots[t], 1] > 0

    def now(self, train: bool, timestamp: int | None) -> int:
        """The time of a call: the count of training calls, this one included (ttl_unit "steps"), or
        ``timestamp`` (ttl_unit "seconds"; required in training)."""
        if self.ttl_unit == "seconds":
            if train and timestamp is None:
                raise ValueError("timestamp is required in training with ttl_unit 'seconds' (the batch's time, an int)")
            return 0 if timestamp is None else timestamp
        if timestamp is not None:
            raise ValueError(f"timestamp is only used with ttl_unit 'seconds', got timestamp={timestamp!r}")
        return int(self.step) + int(bool(train))

    def remap(self, ids: torch.Tensor, id_offsets: torch.Tensor, train: bool, timestamp: int | None = None,
              default_row: bool = False, reset=None, backend: str | None = None) -> torch.Tensor:
        """``zch_remap`` on this clock: ``now`` is the count of training calls (ttl_unit "steps"; this
        one included) or ``timestamp`` (ttl_unit "seconds"; required in training)."""
        now = self.now(train, timestamp)
        with torch.no_grad():
            slots = zch_remap(ids, id_offsets, self, now=now, train=train, default_row=default_row, reset=reset,
                              backend=backend)
            if train:
                self.step += 1
        return slots

    def stats(self) -> dict[str, list[int]]:
        return {name: self.table_state[:, i].tolist() for i, name in enumerate(STATE_FIELDS)}

    def extra_repr(self) -> str:
        extra = f", ttl={self.ttl} {self.ttl_unit}" if self.eviction == "ttl" else ""
        return (f"slots={self.slots}, eviction={self.eviction!r}{extra}, admission_threshold={self.admission_threshold}, "
                f"max_probe={self.max_probe}")


@torch.library.custom_op("gem_kernels::zch_remap",
                         mutates_args=("slot_meta", "heap", "index", "pending", "table_state", "weights", "momentum1",
                                       "momentum2"))
def zch_remap_op(ids: torch.Tensor, id_offsets: torch.Tensor, slot_meta: torch.Tensor, heap: torch.Tensor,
                 index: torch.Tensor, pending: torch.Tensor, table_state: torch.Tensor, layout: torch.Tensor,
                 policy: int, ttl: int, now: int, admit_threshold: int, max_probe: int, train: bool,
                 default_row: bool, weights: torch.Tensor, weights_offsets: torch.Tensor, D_offsets: torch.Tensor,
                 rows_offsets: torch.Tensor, momentum1: torch.Tensor, momentum2: torch.Tensor,
                 init_bounds: torch.Tensor, seed: int, backend: str) -> torch.Tensor:
    args = (ids, id_offsets, slot_meta, heap, index, pending, table_state, layout, policy, ttl, now, admit_threshold,
            max_probe, train, default_row, weights, weights_offsets, D_offsets, rows_offsets, momentum1, momentum2,
            init_bounds, seed)
    if backend in ("cpu", "cuda"):
        return torch.ops.gem_kernels.zch_remap_native(*args)
    if backend == "triton":
        return _on_device_of_inputs(_triton_zch().zch_remap)(*args)
    return _reference_zch().zch_remap(*args)


def _remap_fake(ids, *_):
    return torch.empty_like(ids)


zch_remap_op.register_fake(_remap_fake)
if hasattr(torch.ops.gem_kernels, "zch_remap_native"):  # absent when gem_kernels._C failed to import
    torch.library.register_fake("gem_kernels::zch_remap_native")(_remap_fake)

_EMPTY = {}


def _empty(device, dtype=torch.int64) -> torch.Tensor:
    key = (device, dtype)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return _EMPTY[key]


def zch_remap(ids: torch.Tensor, id_offsets: torch.Tensor, tables: ZchTables, now: int = 0, train: bool = True,
              default_row: bool = False, reset=None, backend: str | None = None) -> torch.Tensor:
    """Map raw ids to slots of their table; in training, admit new ids and evict old ones.

    ``slots = zch_remap(ids, id_offsets, tables, now)``: ids [N] int64 (int32 is widened), any value;
    table t's ids are ``ids[id_offsets[t]:id_offsets[t+1]]`` (id_offsets [T+1], int32/int64) and are
    processed in that order. Returns [N] int64: the id's slot in [0, slots_t), or the miss value for
    an id without one (not yet admitted, no victim allowed, probe overflow, or not training): -1, or
    ``slots_t`` with ``default_row=True`` (a shared default row after the table's slots).

    ``now``: the batch's time for TTL and the metadata (steps or seconds, see ``ZchTables``); it must
    not decrease between training calls. ``train=False`` only looks ids up (no state changes but the
    hit counters). ``reset``: None, or ``(weights, TableMeta, momentum1, momentum2, init_bounds [T, 2]
    float64, seed)``: a slot given to a new id gets the fresh row of reference.zch.fresh_row and zero
    optimizer state (momentum1 row-wise, or both element-wise as Adam's).
    """
    check_tensor("ids", ids, dtypes=(torch.int32, torch.int64), dims=(1,))
    check_tensor("id_offsets", id_offsets, dtypes=(torch.int32, torch.int64), dims=(1,))
    if not isinstance(tables, ZchTables):
        raise TypeError(f"tables must be a gem_kernels ZchTables, got {type(tables).__name__}")
    if id_offsets.numel() != tables.num_tables + 1:
        raise ValueError(f"id_offsets must have T+1 = {tables.num_tables + 1} elements (one segment per table), got "
                         f"{id_offsets.numel()}")
    if isinstance(now, bool) or not isinstance(now, int):
        raise TypeError(f"now must be an int (a step or a timestamp in seconds), got {type(now).__name__}")
    check_int64("now", now)
    check_same_device(ids=ids, id_offsets=id_offsets, tables=tables.slot_meta)
    name = resolve_backend(backend, ids.device, FAMILY)
    device = ids.device
    if reset is None:
        empty = _empty(device)
        weights, meta, m1, m2, bounds, seed = _empty(device, torch.float32), (empty, empty, empty), _empty(
            device, torch.float32), _empty(device, torch.float32), _empty(device, torch.float64), 0
    else:
        weights, meta, m1, m2, bounds, seed = reset
    return zch_remap_op(ids.long().contiguous(), id_offsets.long().contiguous(), tables.slot_meta, tables.heap,
                        tables.index, tables.pending, tables.table_state, tables.layout,
                        POLICY_CODES[tables.eviction], tables.ttl, int(now), tables.admission_threshold,
                        tables.max_probe, bool(train), bool(default_row), weights, *meta, m1, m2, bounds, int(seed),
                        name)


# ---------------------------------------------------------------------------------------------
# The fused remap + lookup: one pass over the ids remaps each one and pools its row.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("gem_kernels::zch_embedding_bag_forward",
                         mutates_args=("slot_meta", "heap", "index", "pending", "table_state", "weights", "momentum1",
                                       "momentum2"))
def zch_embedding_bag_forward_op(ids: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor,
                                 slot_meta: torch.Tensor, heap: torch.Tensor, index: torch.Tensor,
                                 pending: torch.Tensor, table_state: torch.Tensor, layout: torch.Tensor, policy: int,
                                 ttl: int, now: int, admit_threshold: int, max_probe: int, train: bool,
                                 default_row: bool, weights: torch.Tensor, weights_offsets: torch.Tensor,
                                 D_offsets: torch.Tensor, rows_offsets: torch.Tensor, momentum1: torch.Tensor,
                                 momentum2: torch.Tensor, init_bounds: torch.Tensor, seed: int, output_dim: int,
                                 pooling: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(pooled [B, output_dim], slots [N]): the remap of ``ids`` (table t's ids are its bags'
    ``offsets[t*B]:offsets[(t+1)*B]``) and the sum/mean of each bag's rows (an id without a row is
    left out). cpu: one pass (csrc/cpu/zch.cpp); reference, cuda, triton: the remap, then the embedding bag
    (an id without a row, slot -1, is skipped: the one-pass result, as tests/test_zch_fused.py checks)."""
    args = (slot_meta, heap, index, pending, table_state, layout, policy, ttl, now, admit_threshold, max_probe, train,
            default_row, weights, weights_offsets, D_offsets, rows_offsets, momentum1, momentum2, init_bounds, seed)
    if backend == "cpu":
        return torch.ops.gem_kernels.zch_embedding_bag_forward_native(ids, offsets, per_sample_weights, *args,
                                                                      output_dim, pooling)
    if backend == "reference":
        return _reference_zch().zch_embedding_bag_forward(ids, offsets, per_sample_weights, *args, output_dim,
                                                          pooling)
    num_tables = layout.shape[1] - 1
    batch = (offsets.numel() - 1) // num_tables
    id_offsets = offsets[::batch].contiguous() if batch else offsets.new_zeros(num_tables + 1)
    slots = zch_remap_op(ids, id_offsets, *args, backend)
    out = kernel("embedding_bag", "embedding_bag_forward", backend)(
        weights, weights_offsets, D_offsets, rows_offsets, slots, offsets, per_sample_weights, output_dim, pooling,
        SKIP)
    return out, slots


def _zch_embedding_bag_fake(ids, offsets, per_sample_weights, slot_meta, heap, index, pending, table_state, layout,
                            policy, ttl, now, admit_threshold, max_probe, train, default_row, weights, *rest):
    output_dim = rest[-3] if len(rest) == 10 else rest[-2]  # the custom op has `backend` last, the schema not
    batch = (offsets.shape[0] - 1) // (layout.shape[1] - 1)
    return weights.new_empty(batch, output_dim), torch.empty_like(ids)


zch_embedding_bag_forward_op.register_fake(_zch_embedding_bag_fake)
if hasattr(torch.ops.gem_kernels, "zch_embedding_bag_forward_native"):
    torch.library.register_fake("gem_kernels::zch_embedding_bag_forward_native")(_zch_embedding_bag_fake)


class _ZchEmbeddingBag(torch.autograd.Function):
    """The autograd of the fused op. torch.library refuses an autograd formula on an op that mutates
    its inputs (the remap state, the reset rows), so the glue is a Function; its backward is the
    registered embedding-bag backward ops on the forward's slots (dropped ids touch no row: a fused
    optimizer updates live rows only). Inputs 0-9 and 10-19 are ``embedding_bag_op``'s (indices: the
    raw ids), so its setup and backward serve unchanged."""

    @staticmethod
    def forward(ctx, weights, momentum1, momentum2, step, weights_offsets, D_offsets, rows_offsets, ids, offsets,
                per_sample_weights, output_dim, pooling, bounds_check, optimizer, lr, eps, beta1, beta2,
                weight_decay, backend, zch_args):
        out, slots = zch_embedding_bag_forward_op(
            ids, offsets, per_sample_weights, *zch_args[:13], weights, weights_offsets, D_offsets, rows_offsets,
            momentum1, momentum2, *zch_args[13:], output_dim, pooling, backend)
        _embedding_bag_setup(ctx, (weights, momentum1, momentum2, step, weights_offsets, D_offsets, rows_offsets,
                                   slots, offsets, per_sample_weights, output_dim, pooling, bounds_check, optimizer,
                                   lr, eps, beta1, beta2, weight_decay, backend), out)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return _embedding_bag_backward(ctx, grad_output) + (None,)


def zch_embedding_bag(weights: torch.Tensor, tables: TableMeta, ids: torch.Tensor, offsets: torch.Tensor,
                      zch: ZchTables, per_sample_weights: torch.Tensor | None = None, *, output_dim: int,
                      pooling: str = "sum", train: bool = True, timestamp: int | None = None,
                      default_row: bool = False, init_bounds: torch.Tensor, seed: int = 0, optimizer=None,
                      momentum1: torch.Tensor | None = None, momentum2: torch.Tensor | None = None,
                      step: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """Remap raw ids and pool their rows in one pass: ``zch.remap`` then ``embedding_bag`` on the slots,
    fused (the result is the two calls', bit for bit on the cpu backend without per-sample weights).

    ids [N] raw int64 (int32 widened), offsets [T*B+1] int32/int64 feature-major (table t's bags
    ``t*B .. (t+1)*B``, its ids one remap segment), per_sample_weights [N] or None; pooling "sum" or
    "mean" (over the ids that have a row). ``train``/``timestamp``: the remap's (``ZchTables.now``);
    ``default_row``: an id without a row reads row ``slots_t`` of its table, else it is left out.
    ``weights``/``tables``/``optimizer``/``momentum1``/``momentum2``/``step``: as ``embedding_bag``'s
    (the optimizer, if any, updates the looked-up rows in the backward); a row given to a new id gets
    the fresh weights of ``init_bounds`` [T, 2] float64 and ``seed``, and zero optimizer state.
    """
    if not isinstance(zch, ZchTables):
        raise TypeError(f"zch must be a gem_kernels ZchTables, got {type(zch).__name__}")
    check_tensor("ids", ids, dtypes=(torch.int32, torch.int64), dims=(1,))
    check_offsets_meta("offsets", offsets)
    num_tables = zch.num_tables
    if (offsets.numel() - 1) % num_tables:
        raise ValueError(f"offsets must have T*B+1 elements with T = {num_tables}, got {offsets.numel()}")
    if pooling not in ("sum", "mean"):
        raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
    per_sample_weights = per_sample_weights_arg(per_sample_weights, ids, weights.device)
    check_same_device(weights=weights, ids=ids, offsets=offsets, per_sample_weights=per_sample_weights,
                      tables=zch.slot_meta)
    if optimizer is None:
        opt_code, hyper = OPT_NONE, (0.0, 0.0, 0.0, 0.0, 0.0)
        momentum1 = momentum2 = step = weights.new_empty(0, dtype=torch.float32)
    else:
        opt_code, hyper = OPTIMIZER_CODES[optimizer.name], optimizer.hyperparams()
    now = zch.now(train, timestamp)
    name = resolve_backend(backend, ids.device, FAMILY)
    zch_args = (zch.slot_meta, zch.heap, zch.index, zch.pending, zch.table_state, zch.layout,
                POLICY_CODES[zch.eviction], zch.ttl, now, zch.admission_threshold, zch.max_probe, bool(train),
                bool(default_row), init_bounds, int(seed))
    out = _ZchEmbeddingBag.apply(weights, momentum1, momentum2, step, *(m.contiguous() for m in tables),
                                 ids.long().contiguous(), offsets.long().contiguous(),
                                 per_sample_weights.contiguous(), output_dim, POOLING_CODES[pooling], SKIP, opt_code,
                                 *hyper, name, zch_args)
    if train:
        with torch.no_grad():
            zch.step += 1
    return out

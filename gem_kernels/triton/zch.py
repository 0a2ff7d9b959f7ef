"""Triton kernel of the zch family: ``zch_remap`` (raw int64 ids -> slots, with admission, LRU / LFU /
TTL eviction and the reset of a reused slot's row and optimizer state).

Determinism: the same identity tables, eviction metadata and slots as the cpu kernel and
gem_kernels/reference/zch.py, bit for bit. Program t owns table t's whole state and walks its ids in
their order (the cpu's decomposition: tables in parallel, a table's ids serial), since each id's
decision (hit, admission, victim, the cell it lands in) depends on every earlier id of its table. No
two programs touch one table, so there are no concurrent inserts to order. The steps are the
reference's (see its docstring for the layout); Triton has no break or early return, so the loops
carry a flag.

Work decomposition: grid (T,), program = table; a reused row's fresh weights are written BLOCK_D
elements at a time. Roofline: 0 FLOPs; bytes as the cpu kernel's (8 B per id read, 8 B per slot
written, one index probe and one metadata update per id; a reused row writes D weights and its
state). Latency-bound (a serial chain per table): it saves the state's round trip to the host.
"""

import torch
import triton
import triton.language as tl

from ..reference.zch import check_layout, check_values

# Codes of gem_kernels/reference/zch.py (POLICY_CODES, STATE_FIELDS, slot_meta's columns).
_LFU = tl.constexpr(1)
_TTL = tl.constexpr(2)
_USED = tl.constexpr(0)
_SEQ = tl.constexpr(1)
_HEAP_SIZE = tl.constexpr(2)
_LAST_NOW = tl.constexpr(3)
_MAX_PROBE = tl.constexpr(4)
_PROBE_OVERFLOWS = tl.constexpr(5)
_EVICTIONS = tl.constexpr(6)
_PENDING_REPLACEMENTS = tl.constexpr(7)
_HITS = tl.constexpr(8)
_LOOKUPS = tl.constexpr(9)
_UNADMITTED = tl.constexpr(10)
_NUM_FIELDS = tl.constexpr(11)
# The kernel's corruption flags, by kind (the cpu kernel's messages).
_CORRUPT = {1: "zch_remap: index holds slot {slot} outside [0, {slots})",
            2: "zch_remap: heap holds slot {slot} outside [0, {slots})",
            3: "zch_remap: the id of slot {slot} is missing from the index"}
# A reused row's weights are written this many at a time (embedding dims are 4..512).
BLOCK_D = 64


@triton.jit
def _mix64(z):
    """splitmix64's finaliser on uint64."""
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _u64(x):
    return x.to(tl.uint64, bitcast=True)


@triton.jit
def _home(ident, cap):
    return (_mix64(_u64(ident)) & _u64(cap - 1)).to(tl.int64, bitcast=True)


@triton.jit
def _bump(state, field, by):
    tl.store(state + field, tl.load(state + field) + by)


@triton.jit
def _record(error, kind, slot):
    """The first corruption a table meets (kind: see _CORRUPT), raised by the host after the launch."""
    if tl.load(error) == 0:
        tl.store(error, slot * 0 + kind)
        tl.store(error + 1, slot)


@triton.jit
def _heap_less(heap, i, j):
    a_i = tl.load(heap + 3 * i + 1)
    a_j = tl.load(heap + 3 * j + 1)
    return (a_i < a_j) | ((a_i == a_j) & (tl.load(heap + 3 * i + 2) < tl.load(heap + 3 * j + 2)))


@triton.jit
def _heap_swap(heap, i, j):
    for k in tl.static_range(3):
        x = tl.load(heap + 3 * i + k)
        tl.store(heap + 3 * i + k, tl.load(heap + 3 * j + k))
        tl.store(heap + 3 * j + k, x)


@triton.jit
def _sift_down(heap, i, size):
    going = (i >= 0).to(tl.int64)
    while going != 0:
        left = 2 * i + 1
        m = i
        if left < size:
            if _heap_less(heap, left, m):
                m = left
        if left + 1 < size:
            if _heap_less(heap, left + 1, m):
                m = left + 1
        going = (m != i).to(tl.int64)
        if going != 0:
            _heap_swap(heap, i, m)
        i = m


@triton.jit
def _sift_up(heap, i):
    going = (i > 0).to(tl.int64)
    while going != 0:
        parent = (i - 1) // 2
        going = _heap_less(heap, i, parent).to(tl.int64)
        if going != 0:
            _heap_swap(heap, i, parent)
            i = parent
        going = going * (i > 0).to(tl.int64)


@triton.jit
def _key(meta, policy, slot):
    seq = tl.load(meta + 4 * slot + 2)
    first = tl.where(policy == _LFU, tl.load(meta + 4 * slot + 1),
                     tl.where(policy == _TTL, tl.load(meta + 4 * slot + 3), seq))
    return first, seq


@triton.jit
def _index_find(index, cap, ident, max_probe, state):
    """The id's cell (>= 0), or -(first empty cell + 2), or -1 when max_probe cells hold neither."""
    pos = _home(ident, cap)
    d = pos * 0
    result = d - 1
    going = (d < max_probe).to(tl.int64)
    while going != 0:
        empty = tl.load(index + 2 * pos + 1) < 0
        stop = empty | (tl.load(index + 2 * pos) == ident)
        if stop:
            result = tl.where(empty, -(pos + 2), pos)
            tl.store(state + _MAX_PROBE, tl.maximum(tl.load(state + _MAX_PROBE), d + 1))
        d += 1
        pos = (pos + 1) & (cap - 1)
        going = ((d < max_probe) & (stop == 0)).to(tl.int64)
    return result


@triton.jit
def _index_erase(index, cap, pos):
    """Backward-shift deletion of cell ``pos`` (Knuth's algorithm R)."""
    hole = pos
    j = pos
    going = (pos >= 0).to(tl.int64)
    while going != 0:
        j = (j + 1) & (cap - 1)
        cell_id = tl.load(index + 2 * j)
        cell_slot = tl.load(index + 2 * j + 1)
        going = (cell_slot >= 0).to(tl.int64)
        if going != 0:
            k = _home(cell_id, cap)
            stays = tl.where(hole <= j, (hole < k) & (k <= j), (hole < k) | (k <= j))
            if stays == 0:
                tl.store(index + 2 * hole, cell_id)
                tl.store(index + 2 * hole + 1, cell_slot)
                hole = j
    tl.store(index + 2 * hole, hole * 0)
    tl.store(index + 2 * hole + 1, hole * 0 - 1)


@triton.jit
def _admit(pending, pcap, ident, threshold, max_probe, train, state):
    """(admitted 0/1, its count cell or -1) of a sighting of an id not in the index."""
    admitted = (ident * 0 + 1) * (threshold <= 1)
    cell = ident * 0 - 1
    if threshold > 1:
        mask = pcap - 1
        start = (_mix64(_u64(ident) ^ 0x5851F42D4C957F2D) & _u64(mask)).to(tl.int64, bitcast=True)
        window = tl.minimum(max_probe + pcap * 0, pcap)
        empty = cell
        lowest = cell
        found = cell * 0
        d = cell * 0
        while (d < window) & (found == 0):
            pos = (start + d) & mask
            count = tl.load(pending + 2 * pos + 1)
            if count == 0:
                if empty < 0:
                    empty = pos
            elif tl.load(pending + 2 * pos) == ident:
                found = found + 1
                count = count + (train != 0)
                tl.store(pending + 2 * pos + 1, count)
                cell = pos
                admitted = (count >= threshold).to(tl.int64)
            elif lowest < 0:
                lowest = pos
            elif count < tl.load(pending + 2 * lowest + 1):
                lowest = pos
            d += 1
        if found == 0:
            admitted = admitted * 0
            if train != 0:
                cell = empty
                if empty < 0:
                    cell = lowest
                    _bump(state, _PENDING_REPLACEMENTS, 1)
                tl.store(pending + 2 * cell, ident)
                tl.store(pending + 2 * cell + 1, cell * 0 + 1)
    return admitted, cell


@triton.jit
def _victim(meta, heap, state, error, slots, policy, ttl, now, batch_start):
    """The slot whose id the policy evicts now, or -1 (see the reference's victim)."""
    size = tl.load(state + _HEAP_SIZE)
    result = size * 0 - 1
    going = (size > 0).to(tl.int64)
    while going != 0:
        slot = tl.load(heap)
        if (slot < 0) | (slot >= slots):  # a corrupt heap: no victim rather than a wild write
            _record(error, 2, slot)
            going = going * 0
        else:
            first, seq = _key(meta, policy, slot)
            if (first != tl.load(heap + 1)) | (seq != tl.load(heap + 2)):  # stale: refresh, sift down
                tl.store(heap + 1, first)
                tl.store(heap + 2, seq)
                _sift_down(heap, size * 0, size)
            elif seq > batch_start:  # used in this batch: LFU sets it aside, LRU/TTL have no victim
                if policy == _LFU:
                    _heap_swap(heap, size * 0, size - 1)
                    size = size - 1
                    tl.store(state + _HEAP_SIZE, size)
                    _sift_down(heap, size * 0, size)
                else:
                    going = going * 0
            else:
                if (policy != _TTL) | (now - tl.load(meta + 4 * slot + 3) >= ttl):
                    result = slot
                going = going * 0
        going = going * (size > 0).to(tl.int64)
    return result


@triton.jit
def _zch_remap_fwd_kernel(
    ids_ptr, off_ptr, layout_ptr, meta_ptr, heap_ptr, index_ptr, pending_ptr, state_ptr, out_ptr, error_ptr,
    weights_ptr, w_off_ptr, d_off_ptr, r_off_ptr, bounds_ptr, m1_ptr, m2_ptr,
    T, policy, ttl, now, threshold, max_probe, train, default_row, reset, m1_size, m2_size, seed,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    first_slot = tl.load(layout_ptr + t)
    slots = tl.load(layout_ptr + t + 1) - first_slot
    first_cell = tl.load(layout_ptr + T + 1 + t)
    cap = tl.load(layout_ptr + T + 2 + t) - first_cell
    first_pending = tl.load(layout_ptr + 2 * T + 2 + t)
    pcap = tl.load(layout_ptr + 2 * T + 3 + t) - first_pending
    meta = meta_ptr + 4 * first_slot
    heap = heap_ptr + 3 * first_slot
    index = index_ptr + 2 * first_cell
    pending = pending_ptr + 2 * first_pending
    state = state_ptr + _NUM_FIELDS * t
    error = error_ptr + 2 * t
    miss = tl.where(default_row != 0, slots, slots * 0 - 1)
    batch_start = tl.load(state + _SEQ)
    for i in range(tl.load(off_ptr + t), tl.load(off_ptr + t + 1)):
        ident = tl.load(ids_ptr + i)
        out = miss
        _bump(state, _LOOKUPS, 1)
        pos = _index_find(index, cap, ident, max_probe, state)
        if pos >= 0:
            slot = tl.load(index + 2 * pos + 1)
            if slot >= slots:  # a corrupt index: never a write outside the table
                _record(error, 1, slot)
            else:
                _bump(state, _HITS, 1)
                if train != 0:
                    seq = tl.load(state + _SEQ) + 1
                    tl.store(state + _SEQ, seq)
                    tl.store(meta + 4 * slot + 1, tl.load(meta + 4 * slot + 1) + 1)
                    tl.store(meta + 4 * slot + 2, seq)
                    tl.store(meta + 4 * slot + 3, now + slot * 0)
                out = slot
        else:
            admitted, cell = _admit(pending, pcap, ident, threshold, max_probe, train, state)
            if (admitted == 0) | (train == 0):
                _bump(state, _UNADMITTED, 1)
            elif pos == -1:
                _bump(state, _PROBE_OVERFLOWS, 1)
                _bump(state, _UNADMITTED, 1)
            else:
                used = tl.load(state + _USED)
                fresh = used < slots
                slot = used
                placed = used * 0 + 1
                if fresh:
                    tl.store(state + _USED, used + 1)
                else:
                    slot = _victim(meta, heap, state, error, slots, policy, ttl, now, batch_start)
                    old = slot * 0 - 1
                    if slot >= 0:
                        old = _index_find(index, cap, tl.load(meta + 4 * slot), max_probe, state)
                    if old < 0:
                        if slot >= 0:
                            _record(error, 3, slot)
                        _bump(state, _UNADMITTED, 1)
                        placed = placed * 0
                    else:
                        _index_erase(index, cap, old)
                        pos = _index_find(index, cap, ident, max_probe, state)  # the erase may move it closer
                        _bump(state, _EVICTIONS, 1)
                if placed != 0:
                    target = -(pos + 2)
                    tl.store(index + 2 * target, ident)
                    tl.store(index + 2 * target + 1, slot)
                    if cell >= 0:
                        tl.store(pending + 2 * cell + 1, cell * 0)
                    seq = tl.load(state + _SEQ) + 1
                    tl.store(state + _SEQ, seq)
                    tl.store(meta + 4 * slot, ident)
                    tl.store(meta + 4 * slot + 1, seq * 0 + 1)
                    tl.store(meta + 4 * slot + 2, seq)
                    tl.store(meta + 4 * slot + 3, now + seq * 0)
                    first, second = _key(meta, policy, slot)
                    h = slot * 0  # the victim's entry is the top; a fresh slot's is pushed
                    if fresh:
                        h = tl.load(state + _HEAP_SIZE)
                        tl.store(state + _HEAP_SIZE, h + 1)
                    tl.store(heap + 3 * h, slot)
                    tl.store(heap + 3 * h + 1, first)
                    tl.store(heap + 3 * h + 2, second)
                    if fresh:
                        _sift_up(heap, h)
                    else:
                        _sift_down(heap, h, tl.load(state + _HEAP_SIZE))
                    if reset != 0:
                        dim = tl.load(d_off_ptr + t + 1) - tl.load(d_off_ptr + t)
                        row = tl.load(w_off_ptr + t) + slot * dim
                        lo = tl.load(bounds_ptr + 2 * t)
                        hi = tl.load(bounds_ptr + 2 * t + 1)
                        base = _mix64(_u64(ident) ^ _mix64(_u64(seed + t)))
                        for d0 in range(0, dim, BLOCK_D):
                            d = d0 + tl.arange(0, BLOCK_D)
                            u = (_mix64(base + d.to(tl.uint64)) >> 40).to(tl.float64) * (1.0 / 16777216.0)
                            value = (lo + (hi - lo) * u).to(tl.float32)
                            tl.store(weights_ptr + row + d, value.to(weights_ptr.dtype.element_ty), mask=d < dim)
                            if m2_size > 0:  # element-wise state (Adam), packed like the weights
                                zero = tl.zeros((BLOCK_D,), dtype=tl.float32)
                                tl.store(m1_ptr + row + d, zero, mask=d < dim)
                                tl.store(m2_ptr + row + d, zero, mask=d < dim)
                        if (m2_size == 0) & (m1_size > 0):  # row-wise state (Adagrad)
                            tl.store(m1_ptr + tl.load(r_off_ptr + t) + slot, 0.0)
                    out = slot
        tl.store(out_ptr + i, out)
    # End of the batch: LFU's set-aside entries go back into the heap; the clock advances.
    size = tl.load(state + _HEAP_SIZE)
    used = tl.load(state + _USED)
    while size < used:
        _sift_up(heap, size)
        size += 1
    tl.store(state + _HEAP_SIZE, size)
    if train != 0:
        tl.store(state + _LAST_NOW, now + size * 0)


def zch_remap(ids, id_offsets, slot_meta, heap, index, pending, table_state, layout, policy, ttl, now,
              admit_threshold, max_probe, train, default_row, weights, weights_offsets, D_offsets, rows_offsets,
              momentum1, momentum2, init_bounds, seed):
    """The native schema's signature: slots [N], mutating the state (and the rows it resets)."""
    states, layout_list = table_state.tolist(), layout.tolist()
    check_values(id_offsets.tolist(), states, ids.numel(), now, train)
    check_layout(layout_list, states, (slot_meta.numel(), heap.numel(), index.numel(), pending.numel()),
                 admit_threshold)
    num_tables = id_offsets.numel() - 1
    out = torch.empty_like(ids)
    error = torch.zeros(num_tables, 2, dtype=torch.int64, device=ids.device)
    reset = weights.numel() > 0
    # Kernels need a pointer of the right dtype even where the branch that reads it never runs.
    placeholder = torch.zeros(1, dtype=torch.float32, device=ids.device)
    metas = placeholder.long()
    _zch_remap_fwd_kernel[(num_tables,)](
        ids, id_offsets, layout, slot_meta, heap, index, pending, table_state, out, error,
        weights if reset else placeholder, weights_offsets if reset else metas, D_offsets if reset else metas,
        rows_offsets if reset else metas, init_bounds if reset else placeholder.double(),
        momentum1 if momentum1.numel() else placeholder, momentum2 if momentum2.numel() else placeholder,
        num_tables, policy, ttl, now, admit_threshold, max_probe, int(train), int(default_row), int(reset),
        momentum1.numel(), momentum2.numel(), seed, BLOCK_D=BLOCK_D)
    # A state no remap could have made (a direct call): raise as the cpu kernel does.
    slot_off = layout_list[0]
    for t, (kind, slot) in enumerate(error.tolist()):
        if kind:
            raise RuntimeError(_CORRUPT[kind].format(slot=slot, slots=slot_off[t + 1] - slot_off[t]))
    return out

"""Reference of the zch family: the zero-collision remap in plain Python, step for step the algorithm of
csrc/cpu/zch.cpp, so that both backends give the same identity tables bit for bit.

State of T tables, packed back to back (``layout`` [3, T+1] int64: cumulative slots, index cells,
pending cells per table):

- ``slot_meta`` [slots, 4] int64: per slot (id, count, last_seq, last_time). count 0 = free slot.
  ``last_seq`` is the table's access counter at the slot's last use (unique, so it orders every
  access); ``last_time`` the ``now`` of that batch (a step or a timestamp in seconds).
- ``heap`` [slots, 3] int64: a lazy min-heap of (slot, key snapshot). Keys: LRU (last_seq,
  last_seq), LFU (count, last_seq), TTL (last_time, last_seq). Keys only grow, so a snapshot is never
  above the slot's key: a stale top is refreshed and sifted down, a fresh top is the minimum.
- ``index`` [cells, 2] int64: linear-probing hash index (id, slot; slot -1 = empty), capacity a power
  of two >= 4 x slots, home cell ``mix64(id) & (cells - 1)``; at most ``max_probe`` cells inspected.
- ``pending`` [cells, 2] int64: admission counts (id, count; count 0 = empty): an id not in the index
  is counted in the window of ``max_probe`` cells from ``mix64(id ^ PENDING_SALT)``; a full window
  gives the lowest-count cell (first in the window) to the new id (``pending_replacements``).
- ``table_state`` [T, 11] int64: STATE_FIELDS.

Per id, in order (one table's ids are one serial stream; tables are independent):
1. found in the index: its slot (train: count += 1, last_seq = ++seq, last_time = now);
2. else it maps to the miss row (-1, or ``slots`` with ``default_row``) unless train, admitted
   (seen ``admit_threshold`` times) and placed: the next never-used slot, else the policy's victim:
   the minimum key among slots not used earlier in this batch (LFU sets used tops aside until the
   batch ends; for LRU and TTL a used top means every slot was used); TTL only evicts
   ``now - last_time >= ttl``. A probe overflow (no empty cell within max_probe) is never placed.
3. a placed id: count 1, last_seq = ++seq, last_time = now; the victim's id leaves the index
   (backward-shift deletion); the slot's row gets fresh weights ``lo + (hi - lo) * u`` with
   ``u = (mix64(mix64(id ^ mix64(seed + t)) + d) >> 40) / 2**24`` and zero optimizer state.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
PENDING_SALT = 0x5851F42D4C957F2D
POLICY_CODES = {"lru": 0, "lfu": 1, "ttl": 2}
STATE_FIELDS = ("used", "seq", "heap_size", "last_now", "max_probe", "probe_overflows", "evictions",
                "pending_replacements", "hits", "lookups", "unadmitted")
LRU, LFU, TTL = 0, 1, 2
_ID, _COUNT, _SEQ, _TIME = 0, 1, 2, 3


def mix64(z: int) -> int:
    """splitmix64's finalizer on a uint64 (Python int in [0, 2**64))."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class _Table:
    def __init__(self, meta, heap, index, pending, state):
        self.meta, self.heap, self.index, self.pending, self.state = meta, heap, index, pending, state
        self.slots, self.cap, self.pcap = len(meta), len(index), len(pending)

    def key(self, policy, slot):
        m = self.meta[slot]
        if policy == LFU:
            return (m[_COUNT], m[_SEQ])
        if policy == TTL:
            return (m[_TIME], m[_SEQ])
        return (m[_SEQ], m[_SEQ])

    def hkey(self, i):
        return (self.heap[i][1], self.heap[i][2])

    def sift_down(self, i, size):
        while True:
            left, right, m = 2 * i + 1, 2 * i + 2, i
            if left < size and self.hkey(left) < self.hkey(m):
                m = left
            if right < size and self.hkey(right) < self.hkey(m):
                m = right
            if m == i:
                return
            self.heap[i], self.heap[m] = self.heap[m], self.heap[i]
            i = m

    def sift_up(self, i):
        while i > 0:
            p = (i - 1) // 2
            if not self.hkey(i) < self.hkey(p):
                return
            self.heap[i], self.heap[p] = self.heap[p], self.heap[i]
            i = p

    def home(self, ident):
        return mix64(ident & MASK64) & (self.cap - 1)

    def find(self, ident, max_probe):
        pos = self.home(ident)
        for d in range(max_probe):
            cell = self.index[pos]
            if cell[1] < 0 or cell[0] == ident:
                self.state[4] = max(self.state[4], d + 1)
                return pos if cell[1] >= 0 else -(pos + 2)
            pos = (pos + 1) & (self.cap - 1)
        return -1

    def erase(self, pos):
        mask = self.cap - 1
        hole = j = pos
        while True:
            j = (j + 1) & mask
            cell = self.index[j]
            if cell[1] < 0:
                break
            k = self.home(cell[0])
            stays = (hole < k <= j) if hole <= j else (hole < k or k <= j)
            if stays:
                continue
            self.index[hole] = [cell[0], cell[1]]
            hole = j
        self.index[hole] = [0, -1]

    def admit(self, ident, threshold, max_probe, train):
        """(admitted, pending cell or -1)"""
        if threshold <= 1:
            return True, -1
        mask = self.pcap - 1
        start = mix64((ident & MASK64) ^ PENDING_SALT) & mask
        empty = lowest = -1
        for d in range(min(max_probe, self.pcap)):
            pos = (start + d) & mask
            cell = self.pending[pos]
            if cell[1] == 0:
                if empty < 0:
                    empty = pos
                continue
            if cell[0] == ident:
                if train:
                    cell[1] += 1
                return cell[1] >= threshold, pos
            if lowest < 0 or cell[1] < self.pending[lowest][1]:
                lowest = pos
        if not train:
            return False, -1
        pos = empty
        if pos < 0:
            pos = lowest
            self.state[7] += 1
        self.pending[pos] = [ident, 1]
        return 1 >= threshold, pos

    def victim(self, policy, ttl, now, batch_start):
        while self.state[2] > 0:
            size = self.state[2]
            slot = self.heap[0][0]
            current = self.key(policy, slot)
            if current != self.hkey(0):
                self.heap[0] = [slot, current[0], current[1]]
                self.sift_down(0, size)
                continue
            m = self.meta[slot]
            if m[_SEQ] > batch_start:
                if policy != LFU:
                    return -1
                self.heap[0], self.heap[size - 1] = self.heap[size - 1], self.heap[0]
                self.state[2] = size - 1
                self.sift_down(0, size - 1)
                continue
            if policy == TTL and now - m[_TIME] < ttl:
                return -1
            return slot
        return -1


def check_layout(layout: list, states: list, sizes: tuple, admit_threshold: int) -> None:
    """What keeps a direct call inside its buffers (the native kernels' checks): layout [3][T+1] and
    table_state [T][11] as lists, sizes the element counts of (slot_meta, heap, index, pending)."""
    slot_off, index_off, pending_off = layout
    if sizes != (4 * slot_off[-1], 3 * slot_off[-1], 2 * index_off[-1], 2 * pending_off[-1]):
        raise RuntimeError("zch_remap: state tensors do not match layout")
    for t, st in enumerate(states):
        slots, cells = slot_off[t + 1] - slot_off[t], index_off[t + 1] - index_off[t]
        pcells = pending_off[t + 1] - pending_off[t]
        if not (slots >= 1 and cells >= 1 and cells & (cells - 1) == 0 and pcells >= 0 and pcells & (pcells - 1) == 0
                and (admit_threshold <= 1 or pcells >= 1)):
            raise RuntimeError(f"zch_remap: layout of table {t} is invalid (slots {slots}, index cells {cells}, "
                               f"pending cells {pcells})")
        if not (0 <= st[0] <= slots and st[2] == st[0] and st[1] >= 0):
            raise RuntimeError(f"zch_remap: table_state of table {t} is inconsistent (used {st[0]}, heap_size "
                               f"{st[2]}, slots {slots})")


def check_values(off: list, states: list, num_ids: int, now: int, train: bool) -> None:
    """The checks on values the native kernels make (id_offsets [T+1] and table_state [T, 11] as lists)."""
    if off[0] != 0 or off[-1] != num_ids:
        raise ValueError(f"id_offsets must start at 0 and end at ids.numel() = {num_ids}, got {off[0]} and "
                         f"{off[-1]}")
    for t in range(len(off) - 1):
        if off[t] > off[t + 1]:
            raise ValueError(f"id_offsets must be non-decreasing, got id_offsets[{t}] = {off[t]} > "
                             f"id_offsets[{t + 1}] = {off[t + 1]}")
    if train:
        for t, st in enumerate(states):
            if now < st[3]:
                raise ValueError(f"now must not decrease: table {t} last saw now = {st[3]}, got {now}")


def zch_remap(ids, id_offsets, slot_meta, heap, index, pending, table_state, layout, policy, ttl, now,
              admit_threshold, max_probe, train, default_row, weights, weights_offsets, D_offsets, rows_offsets,
              momentum1, momentum2, init_bounds, seed):
    """The native schema's signature; mutates the state tensors (and the weights rows it resets)."""
    off, states = id_offsets.tolist(), table_state.tolist()
    check_values(off, states, ids.numel(), now, train)
    num_tables = len(off) - 1
    slot_off, index_off, pending_off = layout.tolist()
    id_list = ids.tolist()
    meta_all, heap_all = slot_meta.view(-1, 4).tolist(), heap.view(-1, 3).tolist()
    index_all, pending_all = index.view(-1, 2).tolist(), pending.view(-1, 2).tolist()
    out = [0] * len(id_list)
    reset = weights.numel() > 0
    resets = []  # (table, slot, id)
    for t in range(num_tables):
        tab = _Table(meta_all[slot_off[t]:slot_off[t + 1]], heap_all[slot_off[t]:slot_off[t + 1]],
                     index_all[index_off[t]:index_off[t + 1]], pending_all[pending_off[t]:pending_off[t + 1]],
                     states[t])
        st = tab.state
        miss = tab.slots if default_row else -1
        batch_start = st[1]
        for i in range(off[t], off[t + 1]):
            ident = id_list[i]
            st[9] += 1
            pos = tab.find(ident, max_probe)
            if pos >= 0:
                slot = tab.index[pos][1]
                out[i] = slot
                st[8] += 1
                if train:
                    m = tab.meta[slot]
                    m[_COUNT] += 1
                    st[1] += 1
                    m[_SEQ] = st[1]
                    m[_TIME] = now
                continue
            out[i] = miss
            admitted, pending_pos = tab.admit(ident, admit_threshold, max_probe, train)
            if not admitted or not train:
                st[10] += 1
                continue
            if pos == -1:
                st[5] += 1
                st[10] += 1
                continue
            fresh = st[0] < tab.slots
            if fresh:
                slot = st[0]
                st[0] += 1
            else:
                slot = tab.victim(policy, ttl, now, batch_start)
                if slot < 0:
                    st[10] += 1
                    continue
                tab.erase(tab.find(tab.meta[slot][_ID], max_probe))
                pos = tab.find(ident, max_probe)
                st[6] += 1
            tab.index[-(pos + 2)] = [ident, slot]
            if pending_pos >= 0:
                tab.pending[pending_pos][1] = 0
            st[1] += 1
            tab.meta[slot] = [ident, 1, st[1], now]
            key = tab.key(policy, slot)
            if fresh:
                h = st[2]
                st[2] += 1
                tab.heap[h] = [slot, key[0], key[1]]
                tab.sift_up(h)
            else:
                tab.heap[0] = [slot, key[0], key[1]]
                tab.sift_down(0, st[2])
            out[i] = slot
            if reset:
                resets.append((t, slot, ident))
        while st[2] < st[0]:
            st[2] += 1
            tab.sift_up(st[2] - 1)
        if train:
            st[3] = now
        meta_all[slot_off[t]:slot_off[t + 1]] = tab.meta
        heap_all[slot_off[t]:slot_off[t + 1]] = tab.heap
        index_all[index_off[t]:index_off[t + 1]] = tab.index
        pending_all[pending_off[t]:pending_off[t + 1]] = tab.pending
    for name, tensor, values in (("meta", slot_meta, meta_all), ("heap", heap, heap_all), ("index", index, index_all),
                                 ("pending", pending, pending_all), ("state", table_state, states)):
        if values:
            tensor.copy_(torch.tensor(values, dtype=torch.int64).view(tensor.shape))
    if reset:
        _reset_rows(resets, weights, weights_offsets.tolist(), D_offsets.tolist(), rows_offsets.tolist(), momentum1,
                    momentum2, init_bounds.tolist(), seed)
    return torch.tensor(out, dtype=torch.int64, device=ids.device)


def fresh_row(ident: int, table: int, dim: int, seed: int, lo: float, hi: float) -> list[float]:
    """The initial weights of id ``ident`` in table ``table`` (Python floats, cast to the weights' dtype
    on store): a function of the id alone, so every backend and thread count gives the same rows."""
    base = mix64((ident & MASK64) ^ mix64((seed + table) & MASK64))
    return [lo + (hi - lo) * ((mix64((base + d) & MASK64) >> 40) * (1.0 / 16777216.0)) for d in range(dim)]


def _reset_rows(resets, weights, w_off, d_off, r_off, momentum1, momentum2, bounds, seed):
    for t, slot, ident in resets:
        dim = d_off[t + 1] - d_off[t]
        lo, hi = bounds[t]
        start = w_off[t] + slot * dim
        # float32 first, as the C++ kernel rounds: double -> float -> the weights' dtype.
        row = torch.tensor(fresh_row(ident, t, dim, seed, lo, hi), dtype=torch.float64).float()
        weights[start:start + dim] = row.to(weights.dtype)
        if momentum2.numel():
            momentum1[start:start + dim] = 0
            momentum2[start:start + dim] = 0
        elif momentum1.numel():
            momentum1[r_off[t] + slot] = 0


def zch_embedding_bag_forward(ids, offsets, per_sample_weights, slot_meta, heap, index, pending, table_state, layout,
                              policy, ttl, now, admit_threshold, max_probe, train, default_row, weights,
                              weights_offsets, D_offsets, rows_offsets, momentum1, momentum2, init_bounds, seed,
                              output_dim, pooling):
    """The native schema's signature: (pooled [B, output_dim], slots [N]). The remap (``zch_remap``, table
    t's ids being its bags' ``offsets[t*B]:offsets[(t+1)*B]``), then the embedding bag over the slots
    (an id without a row, slot -1, is skipped); the cpu kernel does both in one pass."""
    from .._embedding_bag import SKIP
    from .embedding_bag import embedding_bag_forward

    num_tables = layout.shape[1] - 1
    batch = (offsets.numel() - 1) // num_tables
    id_offsets = offsets[::batch] if batch else offsets.new_zeros(num_tables + 1)
    slots = zch_remap(ids, id_offsets, slot_meta, heap, index, pending, table_state, layout, policy, ttl, now,
                      admit_threshold, max_probe, train, default_row, weights, weights_offsets, D_offsets,
                      rows_offsets, momentum1, momentum2, init_bounds, seed)
    out = embedding_bag_forward(weights, weights_offsets, D_offsets, rows_offsets, slots, offsets, per_sample_weights,
                                output_dim, pooling, SKIP)
    return out, slots

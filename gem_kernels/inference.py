"""Serving helpers: the per-layer K/V cache of HSTU ranking (M-FALCON).

A user's history (and contextual tokens) is encoded once; each HSTU layer's keys and values of those
rows go into a `KVCache`. Candidates are then scored in micro-batches by `HSTULayer.cached_forward`,
which attends each candidate's query over the cached rows and the candidate itself
(`gem_kernels.cached_jagged_attention`), without recomputing the history.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    """Per layer and per user: keys [L, H, attention_dim], values [L, H, linear_dim] and, optionally, the
    rows' timestamps [L] (int64, for the time bias), jagged over users.

    Two layouts:

    - contiguous (``page_size=None``): one buffer per (layer, user) with spare capacity (a vector's:
      `append` writes in place and doubles the buffer when full); `truncate` keeps the capacity,
      `remove` frees it. `scratch` lends the spare rows to a ranking micro-batch (no copy of the user's
      rows: `HSTULayer.cached_forward` of one user attends over a view of the buffer).
    - paged (``page_size=P``): one pool per layer of fixed-size pages, [num_pages, P, H, D] for keys
      and values, and a page table per (layer, user). Users of different lengths share the pool:
      `append` writes the new rows into the user's last page and fresh pages, `truncate` returns
      whole pages to the free list, and no user's rows are ever moved. An exhausted pool doubles
      (one copy of the pool, amortised). The timestamps stay per (layer, user) tensors (8 bytes a row).

    `gather(layer, users)` returns the users' rows as one jagged batch (k, v, timestamps,
    seq_offsets): a copy, which `cached_jagged_attention` reads.

    Memory: `nbytes()` counts the rows held (K, V and timestamps); `reserved_bytes()` what the cache
    allocated for them (paged: the pools, including free pages and the unused tail of last pages).
    """

    def __init__(self, num_layers: int, num_heads: int, attention_dim: int, linear_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 page_size: int | None = None, num_pages: int = 0):
        for name, value in (("num_layers", num_layers), ("num_heads", num_heads), ("attention_dim", attention_dim),
                            ("linear_dim", linear_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1):
            raise ValueError(f"page_size must be an int >= 1 or None, got {page_size!r}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be an int >= 0, got {num_pages!r}")
        if page_size is None and num_pages:
            raise ValueError(f"num_pages needs page_size (the paged layout), got num_pages={num_pages}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        self.num_layers, self.num_heads = num_layers, num_heads
        self.attention_dim, self.linear_dim = attention_dim, linear_dim
        self.dtype, self.device, self.page_size = dtype, torch.device(device), page_size
        self._len: list[dict[int, int]] = [{} for _ in range(num_layers)]
        self._ts: list[dict[int, torch.Tensor | None]] = [{} for _ in range(num_layers)]
        if page_size is None:  # buffers [capacity, H, D]; rows past the user's length are spare
            self._k: list[dict[int, torch.Tensor]] = [{} for _ in range(num_layers)]
            self._v: list[dict[int, torch.Tensor]] = [{} for _ in range(num_layers)]
            self._ts_buf: list[dict[int, torch.Tensor]] = [{} for _ in range(num_layers)]
        else:
            self._k_pool = [self._new_pool(num_pages, attention_dim) for _ in range(num_layers)]
            self._v_pool = [self._new_pool(num_pages, linear_dim) for _ in range(num_layers)]
            self._pages: list[dict[int, list[int]]] = [{} for _ in range(num_layers)]
            self._free: list[list[int]] = [list(range(num_pages - 1, -1, -1)) for _ in range(num_layers)]

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    def _new_pool(self, num_pages: int, dim: int) -> torch.Tensor:
        return torch.zeros(num_pages, self.page_size, self.num_heads, dim, dtype=self.dtype, device=self.device)

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def _check_user(self, layer: int, user: int) -> None:
        if user not in self._len[layer]:
            raise KeyError(f"user {user!r} has no rows in layer {layer} of this cache")

    def users(self, layer: int = 0) -> list[int]:
        self._check_layer(layer)
        return list(self._len[layer])

    def length(self, user: int, layer: int = 0) -> int:
        """Rows held for `user` in `layer` (0 for a user the cache does not hold)."""
        self._check_layer(layer)
        return self._len[layer].get(user, 0)

    def append(self, layer: int, user: int, k: torch.Tensor, v: torch.Tensor,
               timestamps: torch.Tensor | None = None) -> None:
        """Append rows k [n, H, attention_dim], v [n, H, linear_dim] (and their timestamps [n]) to `user`'s
        rows in `layer`. A user's rows either all have timestamps or none do."""
        self._check_layer(layer)
        if isinstance(user, bool) or not isinstance(user, int):
            raise TypeError(f"user must be an int, got {type(user).__name__}")
        for name, t, dim in (("k", k, self.attention_dim), ("v", v, self.linear_dim)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 3 or t.shape[1:] != (self.num_heads, dim):
                raise ValueError(f"{name} must have shape [n, {self.num_heads}, {dim}], got {tuple(t.shape)}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must have the same number of rows, got {k.shape[0]} and {v.shape[0]}")
        n = k.shape[0]
        held = self._len[layer].get(user)
        old_ts = self._ts[layer].get(user)
        if timestamps is not None:
            if not isinstance(timestamps, torch.Tensor) or timestamps.dim() != 1 or timestamps.shape[0] != n \
                    or timestamps.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"timestamps must be an int32/int64 tensor of shape [{n}], got "
                                 f"{getattr(timestamps, 'shape', timestamps)!r}")
            if held and old_ts is None:
                raise ValueError(f"user {user} has rows without timestamps in layer {layer}; got timestamps")
        elif held and old_ts is not None:
            raise ValueError(f"user {user} has rows with timestamps in layer {layer}; got timestamps=None")
        k = k.to(device=self.device, dtype=self.dtype)
        v = v.to(device=self.device, dtype=self.dtype)
        length = held or 0
        if timestamps is not None:
            timestamps = timestamps.to(device=self.device, dtype=torch.int64)
        if not self.paged:
            self._write(layer, user, length, k, v, timestamps)
            self._ts[layer][user] = None if timestamps is None else self._ts_buf[layer][user][:length + n]
            self._len[layer][user] = length + n
            return
        self._ts[layer][user] = None if timestamps is None else (
            timestamps if old_ts is None else torch.cat([old_ts, timestamps]))
        self._len[layer][user] = length + n
        pages = self._pages[layer].setdefault(user, [])
        need = -(-(length + n) // self.page_size) - len(pages)
        if need > len(self._free[layer]):
            self._grow(layer, need - len(self._free[layer]))
        pages.extend(self._free[layer].pop() for _ in range(need))
        rows = self._rows(pages, length, length + n)
        self._k_pool[layer].view(-1, self.num_heads, self.attention_dim).index_copy_(0, rows, k)
        self._v_pool[layer].view(-1, self.num_heads, self.linear_dim).index_copy_(0, rows, v)

    def _write(self, layer: int, user: int, begin: int, k: torch.Tensor, v: torch.Tensor,
               timestamps: torch.Tensor | None) -> None:
        """Contiguous layout: rows [begin, begin + n) of the user's buffers <- k, v, timestamps (the buffers
        grow to max(2 x capacity, begin + n) when short, keeping rows [0, begin))."""
        end = begin + k.shape[0]
        buf = self._k[layer].get(user)
        capacity = 0 if buf is None else buf.shape[0]
        if buf is None or end > capacity:
            new_capacity = max(2 * capacity, end)
            grown = []
            for old, dim, dtype in ((buf, (self.num_heads, self.attention_dim), self.dtype),
                                    (self._v[layer].get(user), (self.num_heads, self.linear_dim), self.dtype),
                                    (self._ts_buf[layer].get(user), (), torch.int64)):
                new = torch.zeros(new_capacity, *dim, dtype=dtype, device=self.device)
                if old is not None:
                    new[:begin] = old[:begin]
                grown.append(new)
            self._k[layer][user], self._v[layer][user], self._ts_buf[layer][user] = grown
        self._k[layer][user][begin:end] = k
        self._v[layer][user][begin:end] = v
        if timestamps is not None:
            self._ts_buf[layer][user][begin:end] = timestamps

    def scratch(self, layer: int, user: int, begin: int, k: torch.Tensor, v: torch.Tensor,
                timestamps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Contiguous layout: write rows k, v (timestamps) at positions [begin, begin + n) past `user`'s
        length, without appending them, and return views (k, v, timestamps or None) of the buffer's rows
        [0, begin + n): the user's rows, whatever spare rows lie between (an earlier micro-batch's), and
        these. The next `append` or `scratch` overwrites them."""
        self._check_layer(layer)
        if self.paged:
            raise ValueError("scratch needs the contiguous layout (page_size=None); gather the paged rows instead")
        length = self._len[layer].get(user, 0)
        if isinstance(begin, bool) or not isinstance(begin, int) or begin < length:
            raise ValueError(f"begin must be an int >= user {user}'s length {length}, got {begin!r}")
        if length and (timestamps is None) != (self._ts[layer][user] is None):
            raise ValueError(f"timestamps must be given exactly when user {user}'s rows have them")
        self._write(layer, user, begin, k.to(self.dtype), v.to(self.dtype),
                    None if timestamps is None else timestamps.to(torch.int64))
        end = begin + k.shape[0]
        ts = None if timestamps is None else self._ts_buf[layer][user][:end]
        return self._k[layer][user][:end], self._v[layer][user][:end], ts

    def _grow(self, layer: int, at_least: int) -> None:
        old = self._k_pool[layer].shape[0]
        added = max(at_least, old)
        self._k_pool[layer] = torch.cat([self._k_pool[layer], self._new_pool(added, self.attention_dim)])
        self._v_pool[layer] = torch.cat([self._v_pool[layer], self._new_pool(added, self.linear_dim)])
        self._free[layer] = list(range(old + added - 1, old - 1, -1)) + self._free[layer]

    def _rows(self, pages: list[int], begin: int, end: int) -> torch.Tensor:
        """Pool rows (page * page_size + offset) of a user's rows [begin, end)."""
        pos = torch.arange(begin, end, device=self.device)
        table = torch.tensor(pages, dtype=torch.long, device=self.device)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    def truncate(self, user: int, length: int, layer: int | None = None) -> None:
        """Keep `user`'s first `length` rows (in `layer`, or in every layer that holds the user)."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"length must be an int >= 0, got {length!r}")
        layers = range(self.num_layers) if layer is None else [layer]
        for lay in layers:
            self._check_layer(lay)
            held = self._len[lay].get(user)
            if held is None:
                if layer is not None:
                    self._check_user(lay, user)
                continue
            keep = min(length, held)
            self._len[lay][user] = keep
            ts = self._ts[lay][user]
            if ts is not None:
                self._ts[lay][user] = ts[:keep] if not self.paged else ts[:keep].clone()
            if self.paged:
                pages = self._pages[lay][user]
                keep_pages = -(-keep // self.page_size)
                self._free[lay].extend(reversed(pages[keep_pages:]))
                del pages[keep_pages:]

    def remove(self, user: int) -> None:
        """Drop every row of `user` (its pages go back to the pools)."""
        for lay in range(self.num_layers):
            if user in self._len[lay]:
                self.truncate(user, 0, lay)
                del self._len[lay][user], self._ts[lay][user]
                if self.paged:
                    del self._pages[lay][user]
                else:
                    del self._k[lay][user], self._v[lay][user], self._ts_buf[lay][user]

    def gather(self, layer: int, users: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                              torch.Tensor]:
        """(k [N, H, attention_dim], v [N, H, linear_dim], timestamps [N] or None, seq_offsets [B+1]) of
        `users`' rows in `layer`, user after user (a user the cache does not hold has 0 rows).
        timestamps is None unless every gathered row has one."""
        self._check_layer(layer)
        lengths = [self._len[layer].get(u, 0) for u in users]
        offsets = torch.tensor([0] + lengths, dtype=torch.long, device=self.device).cumsum(0)
        held = [u for u, n in zip(users, lengths) if n > 0]
        stamps = [self._ts[layer][u] for u in held]
        ts = None
        if stamps and all(t is not None for t in stamps):
            ts = torch.cat(stamps)
        elif not held:
            ts = torch.zeros(0, dtype=torch.long, device=self.device)
        if not self.paged:
            if not held:
                return (torch.zeros(0, self.num_heads, self.attention_dim, dtype=self.dtype, device=self.device),
                        torch.zeros(0, self.num_heads, self.linear_dim, dtype=self.dtype, device=self.device),
                        ts, offsets)
            return (torch.cat([self._k[layer][u][:self._len[layer][u]] for u in held]),
                    torch.cat([self._v[layer][u][:self._len[layer][u]] for u in held]), ts, offsets)
        rows = [self._rows(self._pages[layer][u], 0, self._len[layer][u]) for u in held]
        rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=self.device)
        k = self._k_pool[layer].view(-1, self.num_heads, self.attention_dim).index_select(0, rows)
        v = self._v_pool[layer].view(-1, self.num_heads, self.linear_dim).index_select(0, rows)
        return k, v, ts, offsets

    def _row_bytes(self) -> int:
        return self.num_heads * (self.attention_dim + self.linear_dim) * torch.finfo(self.dtype).bits // 8

    def nbytes(self) -> int:
        """Bytes of the rows held: K and V of every (layer, user) row, plus 8 per timestamp."""
        total = 0
        for lay in range(self.num_layers):
            for user, n in self._len[lay].items():
                total += n * self._row_bytes() + (8 * n if self._ts[lay][user] is not None else 0)
        return total

    def reserved_bytes(self) -> int:
        """Bytes the cache allocated for its rows: the buffers with their spare capacity in the contiguous
        layout; the pools (every page, used or free) plus the timestamps in the paged one."""
        if not self.paged:
            return sum(t.numel() * t.element_size() for bufs in (self._k, self._v) for lay in bufs
                       for t in lay.values()) + sum(8 * t.numel() for lay, held in zip(self._ts_buf, self._ts)
                                                    for u, t in lay.items() if held.get(u) is not None)
        pools = sum(p.numel() * p.element_size() for p in self._k_pool + self._v_pool)
        stamps = sum(8 * t.numel() for lay in self._ts for t in lay.values() if t is not None)
        return pools + stamps

    def memory_stats(self) -> dict[str, int]:
        """{"bytes": nbytes(), "reserved_bytes": reserved_bytes(), "rows": rows held over every layer, and for
        the paged layout "pages", "free_pages" over every layer}."""
        stats = {"bytes": self.nbytes(), "reserved_bytes": self.reserved_bytes(),
                 "rows": sum(sum(lay.values()) for lay in self._len)}
        if self.paged:
            stats["pages"] = sum(p.shape[0] for p in self._k_pool)
            stats["free_pages"] = sum(len(f) for f in self._free)
        return stats

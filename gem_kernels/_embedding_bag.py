"""What every embedding_bag backend shares: the table layout, the option codes and the host-side preparation.

The layout (FBGEMM TBE) has one home: ``pack_tables`` builds a ``TableLayout`` (the Python ints
the modules slice and size their buffers by) and its ``TableMeta`` (the three int64 tensors the ops
take). The modules of gem_kernels.nn and gem_kernels.torchrec and the sharded kernel all build their
layout with it.

The codes are the integers the kernels take for the string options; the C++ and CUDA kernels
read the same values from csrc/include/gem_kernels/embedding_bag_codes.h (a test compares the two),
the Triton kernels as named tl.constexpr. The preparation runs on the host side of a launch
(torch ops on the indices' device): the bounds check and the kept mask (ops/ for the cuda kernels,
triton/, reference/) and the backward's sort into per-row segments (triton/; the cuda kernels
build the same segments in C++, csrc/cuda/embedding_bag.cu).

The modules' construction-time facts live here too: ``check_module_options`` (the fused optimizer
and bounds_check of every embedding module and sharder) and ``advise_huge_pages`` (their packed
CPU buffers).
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .optim import OPTIMIZERS

POOLING_CODES = {"sum": 0, "mean": 1, "none": 2}
BOUNDS_CHECK_CODES = {"fatal": 0, "warn": 1, "skip": 2}
OPTIMIZER_CODES = {"none": 0, "sgd": 1, "rowwise_adagrad": 2, "adam": 3}
SUM, MEAN, NONE = (POOLING_CODES[k] for k in ("sum", "mean", "none"))
FATAL, WARN, SKIP = (BOUNDS_CHECK_CODES[k] for k in ("fatal", "warn", "skip"))
OPT_NONE, OPT_SGD, OPT_ROWWISE_ADAGRAD, OPT_ADAM = (OPTIMIZER_CODES[k] for k in ("none", "sgd", "rowwise_adagrad", "adam"))



def check_module_options(optimizer, bounds_check: str = "fatal") -> None:
    """At a module's construction (not at its first forward): the fused optimizer (None or a
    ``gem_kernels.optim`` config) and the bounds-check option (one of ``BOUNDS_CHECK_CODES``)."""
    if bounds_check not in BOUNDS_CHECK_CODES:
        raise ValueError(f"bounds_check must be one of {tuple(BOUNDS_CHECK_CODES)}, got {bounds_check!r}")
    if optimizer is not None and not isinstance(optimizer, OPTIMIZERS):
        raise ValueError(f"optimizer must be None or one of {[o.__name__ for o in OPTIMIZERS]}, got {optimizer!r}")


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux to back a large CPU buffer (packed tables, their optimizer state) with transparent
    huge pages, before its first touch.

    Lookups hit random rows of a table of up to gigabytes: with 4 KiB pages nearly every one also
    misses the TLB and walks the page tables; 2 MiB pages cut those misses ~500x. Advice only: where
    THP is off, or not Linux, nothing changes.
    """
    if t.device.type != "cpu" or t.nbytes < 4 * _HUGE_PAGE or not sys.platform.startswith("linux"):
        return
    begin = (t.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    end = (t.data_ptr() + t.nbytes) & ~(_HUGE_PAGE - 1)
    if end > begin:
        try:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), _MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass

class TableMeta(NamedTuple):
    """The per-table tensors of the embedding_bag ops: T tables back to back in one flat ``weights``.

    weights_offsets [T]    element offset of table t in ``weights``
    D_offsets       [T+1]  column offset of table t in the pooled output; D_t = D_offsets[t+1] - D_offsets[t]
    rows_offsets    [T+1]  cumulative rows; rows_t = rows_offsets[t+1] - rows_offsets[t] (also the row
                           offset of table t in row-wise optimizer state)
    All int64, on the weights' device. The ops' schemas take the three tensors in this order
    (``*meta``); csrc/include/gem_kernels/table_meta.h is their C++ view.
    """

    weights_offsets: torch.Tensor
    D_offsets: torch.Tensor
    rows_offsets: torch.Tensor


@dataclass(frozen=True)
class TableLayout:
    """Where each table lives, in Python ints: what modules slice the packed buffer and size the
    optimizer state by. ``meta(device)`` gives the same facts as the ops' tensors."""

    rows: tuple[int, ...]
    dims: tuple[int, ...]
    weights_offsets: tuple[int, ...]  # [T]
    D_offsets: tuple[int, ...]  # [T+1]
    rows_offsets: tuple[int, ...]  # [T+1]

    @property
    def num_tables(self) -> int:
        return len(self.rows)

    @property
    def num_rows(self) -> int:
        return self.rows_offsets[-1]

    @property
    def num_elements(self) -> int:
        return self.weights_offsets[-1] + self.rows[-1] * self.dims[-1]

    def output_dim(self, pooled: bool) -> int:
        """Columns of the op's output: every table's D side by side (pooled), or the one shared D."""
        return self.D_offsets[-1] if pooled else self.dims[0]

    def meta(self, device=None) -> TableMeta:
        return TableMeta(*(torch.tensor(v, dtype=torch.int64, device=device)
                           for v in (self.weights_offsets, self.D_offsets, self.rows_offsets)))

    def table(self, flat: torch.Tensor, t: int) -> torch.Tensor:
        """Table t of a buffer packed like the weights (weights, Adam's state) as a [rows_t, D_t] view."""
        start, rows, dim = self.weights_offsets[t], self.rows[t], self.dims[t]
        return flat[start:start + rows * dim].view(rows, dim)

    def state_sizes(self, optimizer_name: str | None) -> tuple[int, int]:
        """Elements of (momentum1, momentum2) for a fused optimizer: row-wise Adagrad one fp32 per
        row, Adam two per weight element, SGD (or none) nothing."""
        m1 = {"rowwise_adagrad": self.num_rows, "adam": self.num_elements}.get(optimizer_name, 0)
        return m1, self.num_elements if optimizer_name == "adam" else 0


def pack_tables(rows: list[int], dims: list[int]) -> TableLayout:
    """The packed layout of tables ``rows[t] x dims[t]``, in order, back to back."""
    rows, dims = tuple(int(r) for r in rows), tuple(int(d) for d in dims)
    if not rows or len(rows) != len(dims):
        raise ValueError(f"rows and dims must describe the same T >= 1 tables, got {len(rows)} and {len(dims)}")

    def cumsum(xs):
        out = [0]
        for x in xs:
            out.append(out[-1] + x)
        return tuple(out)

    return TableLayout(rows, dims, cumsum(r * d for r, d in zip(rows, dims))[:-1], cumsum(dims), cumsum(rows))


def kept_mask(rows_offsets: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
              bounds_check: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept [N] bool, bag id [N] int64 in 0..T*B) of every index; applies the bounds-check mode.

    fatal raises IndexError naming the table, bag and value of the first bad index; warn warns once
    and drops the bad ones; skip drops them silently. Negative indices are out of range.
    """
    num_tables = rows_offsets.numel() - 1
    num_bags = offsets.numel() - 1
    batch = num_bags // max(num_tables, 1)
    offsets = offsets.long()
    bag_ids = torch.repeat_interleave(torch.arange(num_bags, device=indices.device), offsets.diff(),
                                      output_size=indices.numel())
    table_rows = rows_offsets.long().diff().to(indices.device)
    idx = indices.long()
    limit = table_rows[bag_ids // batch] if indices.numel() else idx
    kept = (idx >= 0) & (idx < limit)
    if bounds_check != SKIP and not bool(kept.all()):
        i = int((~kept).nonzero()[0, 0])
        bag = int(bag_ids[i])
        t, b = bag // batch, bag % batch
        message = (f"indices[{i}] = {int(idx[i])} is out of range for table {t} "
                   f"(num_embeddings={int(table_rows[t])}) in bag {b}")
        if bounds_check == FATAL:
            raise IndexError(message)
        warnings.warn(f"embedding_bag: dropping {int((~kept).sum())} out-of-range indices; first: {message}",
                      stacklevel=2)
    return kept, bag_ids


def segments(rows_offsets, indices, offsets, per_sample_weights, pooling, num_tables):
    """The backward's host-side sort of the kept lookups by global row (rows_offsets[t] + row;
    stable, so duplicates keep position order and their sums are deterministic):
    (segment starts [U+1], sorted order of the kept positions, table [U] and global row [U] of each
    segment, the grad_output row and the scale of each index [N])."""
    batch = (offsets.numel() - 1) // num_tables
    kept, bag_ids = kept_mask(rows_offsets, indices, offsets, SKIP)
    tables = bag_ids // max(batch, 1)
    global_rows = rows_offsets[:-1][tables] + indices.long()
    scale = per_sample_weights.float() if per_sample_weights.numel() else torch.ones(indices.numel(), device=indices.device)
    if pooling == MEAN:
        counts = torch.zeros(num_tables * batch, device=indices.device).index_add_(0, bag_ids, kept.float())
        scale = scale / counts.clamp(min=1)[bag_ids]
    src_rows = torch.arange(indices.numel(), device=indices.device) if pooling == NONE else bag_ids % max(batch, 1)
    positions = kept.nonzero().squeeze(1)
    sorted_rows, perm = torch.sort(global_rows[positions], stable=True)
    order = positions[perm]
    unique_rows, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    seg = torch.zeros(unique_rows.numel() + 1, dtype=torch.int64, device=indices.device)
    seg[1:] = counts.cumsum(0)
    seg_tables = torch.searchsorted(rows_offsets, unique_rows, right=True) - 1
    return seg, order, seg_tables, unique_rows, src_rows, scale

"""``FusedEmbeddingBag``: T embedding tables in one packed buffer, looked up in one call (FBGEMM TBE)."""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import torch
from torch import nn

from .._validate import FLOAT_DTYPES, INT64_MAX, check_int64
from ..ops.embedding_bag import embedding_bag
from ..optim import OPTIMIZERS
from ..reference.embedding_bag import BOUNDS_CHECK_CODES, POOLING_CODES


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def _advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux to back a large CPU buffer with transparent huge pages, before its first touch.

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


@dataclass(frozen=True)
class TableSpec:
    """One table: ``num_embeddings`` rows of ``embedding_dim`` features."""

    num_embeddings: int
    embedding_dim: int

    def __post_init__(self):
        for name in ("num_embeddings", "embedding_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
            check_int64(name, value)
        if self.num_embeddings * self.embedding_dim > INT64_MAX:
            raise ValueError(f"num_embeddings * embedding_dim is out of range: {self.num_embeddings} * "
                             f"{self.embedding_dim} elements do not fit in int64")


class FusedEmbeddingBag(nn.Module):
    """T embedding bags in one packed weight buffer, with an optional optimizer fused into the backward.

    ``out = ebc(indices, offsets, per_sample_weights=None)``: indices [N] int32/int64 local to their
    table; offsets [T*B+1] (feature-major: bag b of table t is ``indices[offsets[t*B+b]:offsets[t*B+b+1]]``).
    Output [B, sum_t D_t] (tables concatenated in order) for pooling "sum"/"mean", [N, D] for "none"
    (every table of dim D); ``per_sample_weights`` [N] (sum/none pooling) receive a gradient when they
    require one. See ``gem_kernels.ops.embedding_bag.embedding_bag`` for the exact semantics.

    ``optimizer=None``: ``self.weights`` is an ``nn.Parameter`` that receives a dense gradient, so any
    torch optimizer works. With a ``gem_kernels.optim`` config the backward updates the touched rows
    in place (duplicates summed first, one update per row) and ``self.weights.grad`` stays None.
    The optimizer state (``momentum1``, ``momentum2``, ``step``) is in ``state_dict()``.
    """

    def __init__(self, tables: list[TableSpec], pooling: str = "sum", dtype: torch.dtype = torch.float32,
                 device=None, optimizer=None, bounds_check: str = "fatal", backend: str | None = None):
        super().__init__()
        tables = list(tables)
        if not tables or not all(isinstance(t, TableSpec) for t in tables):
            raise ValueError(f"tables must be a non-empty list of TableSpec, got {tables!r}")
        if pooling not in POOLING_CODES:
            raise ValueError(f"pooling must be one of {tuple(POOLING_CODES)}, got {pooling!r}")
        if bounds_check not in BOUNDS_CHECK_CODES:
            raise ValueError(f"bounds_check must be one of {tuple(BOUNDS_CHECK_CODES)}, got {bounds_check!r}")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
        if optimizer is not None and not isinstance(optimizer, OPTIMIZERS):
            raise ValueError(f"optimizer must be None or one of {[o.__name__ for o in OPTIMIZERS]}, got {optimizer!r}")
        dims = [t.embedding_dim for t in tables]
        if pooling == "none" and len(set(dims)) != 1:
            raise ValueError(f"pooling 'none' needs every table to have the same embedding_dim, got {dims}")
        self.tables = tables
        self.pooling, self.bounds_check, self.optimizer, self.backend = pooling, bounds_check, optimizer, backend
        rows = [t.num_embeddings for t in tables]
        sizes = [r * d for r, d in zip(rows, dims)]
        cumsum = lambda xs: [0] + torch.tensor(xs, dtype=torch.int64).cumsum(0).tolist()  # noqa: E731
        self.output_dim = dims[0] if pooling == "none" else sum(dims)
        self._weight_offsets = cumsum(sizes)[:-1]
        meta = dict(dtype=torch.int64, device=device)
        self.register_buffer("weights_offsets", torch.tensor(self._weight_offsets, **meta), persistent=False)
        self.register_buffer("D_offsets", torch.tensor(cumsum(dims), **meta), persistent=False)
        self.register_buffer("rows_offsets", torch.tensor(cumsum(rows), **meta), persistent=False)
        self.weights = nn.Parameter(torch.empty(sum(sizes), dtype=dtype, device=device))
        name = optimizer.name if optimizer is not None else None
        state = dict(dtype=torch.float32, device=device)
        self.register_buffer("momentum1", torch.empty(
            {"rowwise_adagrad": sum(rows), "adam": sum(sizes)}.get(name, 0), **state))
        self.register_buffer("momentum2", torch.empty(sum(sizes) if name == "adam" else 0, **state))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        for buffer in (self.weights, self.momentum1, self.momentum2):
            _advise_huge_pages(buffer)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 1) like ``nn.EmbeddingBag``; optimizer state to zero."""
        with torch.no_grad():
            nn.init.normal_(self.weights)
            self.momentum1.zero_()
            self.momentum2.zero_()
            self.step.zero_()

    @property
    def num_tables(self) -> int:
        return len(self.tables)

    def weight(self, t: int) -> torch.Tensor:
        """Table t as a [rows_t, D_t] view into the packed buffer (writes go to the module's weights)."""
        spec = self.tables[t]
        start = self._weight_offsets[t]
        return self.weights[start:start + spec.num_embeddings * spec.embedding_dim].view(spec.num_embeddings,
                                                                                         spec.embedding_dim)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return embedding_bag(self.weights, self.weights_offsets, self.D_offsets, self.rows_offsets, indices, offsets,
                             per_sample_weights, output_dim=self.output_dim, pooling=self.pooling,
                             bounds_check=self.bounds_check, optimizer=self.optimizer, momentum1=self.momentum1,
                             momentum2=self.momentum2, step=self.step, backend=self.backend)

    @classmethod
    def from_embedding_bags(cls, bags: list[nn.EmbeddingBag], optimizer=None, bounds_check: str = "fatal",
                            backend: str | None = None) -> "FusedEmbeddingBag":
        """One module holding copies of the weights of ``bags`` (same mode, dtype and device)."""
        bags = list(bags)
        if not bags or not all(isinstance(b, nn.EmbeddingBag) for b in bags):
            raise ValueError("bags must be a non-empty list of torch.nn.EmbeddingBag")
        modes = {b.mode for b in bags}
        if len(modes) != 1 or next(iter(modes)) not in ("sum", "mean"):
            raise ValueError(f"bags must share one mode, 'sum' or 'mean', got {sorted(modes)}")
        dtypes = {b.weight.dtype for b in bags}
        devices = {b.weight.device for b in bags}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"bags must share one dtype and device, got {dtypes} and {devices}")
        if any(b.max_norm is not None or b.padding_idx is not None for b in bags):
            raise ValueError("bags with max_norm or padding_idx are not supported")
        tables = [TableSpec(b.num_embeddings, b.embedding_dim) for b in bags]
        module = cls(tables, pooling=next(iter(modes)), dtype=next(iter(dtypes)), device=next(iter(devices)),
                     optimizer=optimizer, bounds_check=bounds_check, backend=backend)
        with torch.no_grad():
            for t, bag in enumerate(bags):
                module.weight(t).copy_(bag.weight)
        return module

    def extra_repr(self) -> str:
        dims = sorted({t.embedding_dim for t in self.tables})
        return (f"num_tables={self.num_tables}, rows={self.rows_offsets[-1].item()}, dims={dims}, "
                f"pooling={self.pooling!r}, dtype={self.weights.dtype}, optimizer={self.optimizer}, "
                f"bounds_check={self.bounds_check!r}")

"""``QuantizedEmbeddingBag``: T quantized tables (FBGEMM IntNBit rows) in one uint8 buffer, pooled in one call.

Inference only: the tables are buffers, not parameters, and nothing has a gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .._embedding_bag import POOLING_CODES, advise_huge_pages, check_module_options
from ..ops.quant_embedding_bag import (DEFAULT_FP8_EXPONENT_BIAS, DEFAULT_FP8_EXPONENT_BITS, DEFAULT_ROW_ALIGNMENT,
                                       OUTPUT_DTYPES, QuantTableLayout, QuantTableMeta, pack_quant_tables,
                                       quant_embedding_bag, quantize_rows, weight_type_code)
from .._swap import SwapSkip, register
from ._fx import is_proxy, trace_call
from .embedding_bag import PackedTables, TableSpec, torch_bags


class QuantPackedTables(PackedTables):
    """A module holding quantized tables in one flat uint8 ``weights`` buffer: ``layout`` (a
    ``QuantTableLayout``) and ``table_meta`` (a ``QuantTableMeta``, non-persistent buffers)."""

    def _set_quant_layout(self, layout: QuantTableLayout, device, persistent: bool) -> None:
        self._set_layout(layout, device)
        self.register_buffer("weights", torch.zeros(layout.num_bytes, dtype=torch.uint8, device=device),
                             persistent=persistent)
        advise_huge_pages(self.weights)

    @property
    def table_meta(self) -> QuantTableMeta:
        return QuantTableMeta(*(getattr(self, name) for name in QuantTableMeta._fields))

    def table(self, t: int) -> torch.Tensor:
        """Table t's packed rows, a uint8 [rows, row_bytes] view of ``weights`` (writes go to the module)."""
        return self.layout.table(self.weights, t)


class QuantizedEmbeddingBag(QuantPackedTables):
    """T quantized embedding bags in one flat uint8 buffer (FBGEMM's IntNBit TBE, forward only).

    ``out = qebc(indices, offsets, per_sample_weights=None)`` with the conventions of
    ``gem_kernels.FusedEmbeddingBag`` (offsets [T*B+1], feature-major); output [B, sum_t D_t] of
    ``output_dtype`` (pooling "sum"/"mean"), [N, D] for "none". See
    ``gem_kernels.ops.quant_embedding_bag`` for the row format and the exact arithmetic.

    Args:
        tables: list of ``TableSpec``.
        weight_dtype: "int8" | "int4" | "int2" | "fp16" | "fp8" | "fp32", or one per table (mixed).
        pooling, bounds_check: as ``FusedEmbeddingBag``. output_dtype: fp32 | fp16 | bf16.
        row_alignment: row stride multiple in bytes (1, FBGEMM's CPU default; TorchRec's quantized
            collections use 16).

    The tables start zeroed; fill them with ``from_float`` (FBGEMM's row-wise quantization rule),
    ``load_state_dict``, or ``table(t).copy_(rows)`` with already packed rows. ``state_dict()`` holds the
    flat ``weights`` buffer.
    """

    def __init__(self, tables: Sequence[TableSpec], weight_dtype: str | Sequence[str] = "int8", pooling: str = "sum",
                 output_dtype: torch.dtype = torch.float32, bounds_check: str = "fatal",
                 row_alignment: int = DEFAULT_ROW_ALIGNMENT, fp8_exponent_bits: int = DEFAULT_FP8_EXPONENT_BITS,
                 fp8_exponent_bias: int = DEFAULT_FP8_EXPONENT_BIAS, device=None, backend: str | None = None):
        super().__init__()
        tables = list(tables)
        if not tables or not all(isinstance(t, TableSpec) for t in tables):
            raise ValueError(f"tables must be a non-empty list of TableSpec, got {tables!r}")
        dtypes = [weight_dtype] * len(tables) if isinstance(weight_dtype, str) else list(weight_dtype)
        if len(dtypes) != len(tables):
            raise ValueError(f"weight_dtype must be one string or one per table ({len(tables)}), got {weight_dtype!r}")
        codes = [weight_type_code(d) for d in dtypes]
        if pooling not in POOLING_CODES:
            raise ValueError(f"pooling must be one of {tuple(POOLING_CODES)}, got {pooling!r}")
        check_module_options(None, bounds_check)
        if output_dtype not in OUTPUT_DTYPES:
            raise ValueError(f"output_dtype must be one of {OUTPUT_DTYPES}, got {output_dtype!r}")
        dims = [t.embedding_dim for t in tables]
        if pooling == "none" and len(set(dims)) != 1:
            raise ValueError(f"pooling 'none' needs every table to have the same embedding_dim, got {dims}")
        self.tables, self.weight_dtypes = tables, dtypes
        self.pooling, self.output_dtype, self.bounds_check, self.backend = pooling, output_dtype, bounds_check, backend
        self.fp8_exponent_bits, self.fp8_exponent_bias = fp8_exponent_bits, fp8_exponent_bias
        self._set_quant_layout(pack_quant_tables([t.num_embeddings for t in tables], dims, codes, row_alignment),
                               device, persistent=True)
        self.output_dim = sum(dims) if pooling != "none" else dims[0]

    @torch.no_grad()
    def set_table_from_float(self, t: int, weight: torch.Tensor) -> None:
        """Quantize float [rows_t, D_t] ``weight`` into table t by FBGEMM's rule."""
        expected = (self.layout.rows[t], self.layout.dims[t])
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight of table {t} must have shape {expected}, got {tuple(weight.shape)}")
        rows = quantize_rows(weight.to(self.weights.device), self.weight_dtypes[t], self.fp8_exponent_bits,
                             self.fp8_exponent_bias)
        view = self.table(t)
        view.zero_()
        view[:, :rows.shape[1]] = rows

    @classmethod
    def from_float(cls, source, weight_dtype: str | Sequence[str] = "int8", **kwargs) -> "QuantizedEmbeddingBag":
        """Quantize float tables: ``source`` is a ``FusedEmbeddingBag`` (its pooling unless given), an
        ``nn.EmbeddingBag`` (one table), a float tensor [rows, D], or a list / state_dict-like mapping of
        them (in table order)."""
        if isinstance(source, nn.Module) and hasattr(source, "layout") and hasattr(source, "weights"):
            weights = [source.layout.table(source.weights.detach(), t) for t in range(source.layout.num_tables)]
            kwargs.setdefault("pooling", getattr(source, "pooling", "sum"))
        elif isinstance(source, nn.EmbeddingBag):
            weights = [source.weight.detach()]
            kwargs.setdefault("pooling", source.mode)
        elif isinstance(source, torch.Tensor):
            weights = [source.detach()]
        elif isinstance(source, Mapping):
            weights = [w.detach() for w in source.values()]
        elif isinstance(source, Sequence):
            weights = [w.detach() for w in source]
        else:
            raise TypeError(f"source must be a FusedEmbeddingBag, nn.EmbeddingBag, tensor, list or mapping of tensors, "
                            f"got {type(source).__name__}")
        for i, w in enumerate(weights):
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
                raise ValueError(f"table {i} must be a float [rows, dim] tensor, got "
                                 f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
        kwargs.setdefault("device", weights[0].device)
        module = cls([TableSpec(w.shape[0], w.shape[1]) for w in weights], weight_dtype, **kwargs)
        for t, w in enumerate(weights):
            module.set_table_from_float(t, w)
        return module

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if is_proxy(indices, offsets, per_sample_weights):
            return trace_call(self, indices, offsets, per_sample_weights)
        return quant_embedding_bag(self.weights, self.table_meta, indices, offsets, per_sample_weights,
                                   output_dim=self.output_dim, pooling=self.pooling, bounds_check=self.bounds_check,
                                   output_dtype=self.output_dtype, fp8_exponent_bits=self.fp8_exponent_bits,
                                   fp8_exponent_bias=self.fp8_exponent_bias, backend=self.backend)

    def extra_repr(self) -> str:
        tables = ", ".join(f"{t.num_embeddings}x{t.embedding_dim}:{d}" for t, d in zip(self.tables, self.weight_dtypes))
        return f"[{tables}], pooling={self.pooling!r}, output_dtype={self.output_dtype}"


class QuantizedTorchEmbeddingBag(QuantizedEmbeddingBag):
    """One quantized table behind ``torch.nn.EmbeddingBag``'s call: ``forward(input, offsets=None,
    per_sample_weights=None)`` (1-D input with offsets of B bag starts, or B+1 with
    ``include_last_offset``; or 2-D input [B, L]); modes "sum"/"mean". What ``gk.swap(model,
    quantize=...)`` puts in place of an ``nn.EmbeddingBag`` in eval mode."""

    def __init__(self, num_embeddings: int, embedding_dim: int, weight_dtype: str = "int8", mode: str = "mean",
                 include_last_offset: bool = False, **kwargs):
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        super().__init__([TableSpec(num_embeddings, embedding_dim)], weight_dtype, pooling=mode, **kwargs)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.mode, self.include_last_offset = mode, include_last_offset

    @classmethod
    def from_torch(cls, bag: nn.EmbeddingBag, weight_dtype: str = "int8",
                   backend: str | None = None) -> "QuantizedTorchEmbeddingBag":
        if bag.padding_idx is not None or bag.max_norm is not None or bag.mode not in ("sum", "mean"):
            raise ValueError(f"only mode sum/mean without padding_idx or max_norm is quantized, got mode={bag.mode!r}, "
                             f"padding_idx={bag.padding_idx}, max_norm={bag.max_norm}")
        module = cls(bag.num_embeddings, bag.embedding_dim, weight_dtype, mode=bag.mode,
                     include_last_offset=bag.include_last_offset, device=bag.weight.device, backend=backend)
        module.set_table_from_float(0, bag.weight.detach())
        return module

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if is_proxy(input, offsets, per_sample_weights):
            return trace_call(self, input, offsets, per_sample_weights)
        return super().forward(*torch_bags(input, offsets, per_sample_weights, self.include_last_offset))


def _quantize_embedding_bag(module: nn.EmbeddingBag, *, weight_dtype: str, backend: str | None) -> nn.Module:
    try:
        return QuantizedTorchEmbeddingBag.from_torch(module, weight_dtype, backend=backend)
    except ValueError as exc:
        raise SwapSkip(str(exc)) from exc


register(nn.EmbeddingBag, _quantize_embedding_bag, quantize=True)  # gk.swap(model, quantize=...)

"""``QuantEmbeddingBagCollection``: TorchRec's quantized ``EmbeddingBagCollection``
(``torchrec.quant.embedding_modules``) on one fused ``gem_kernels.quant_embedding_bag`` call.

Its rows are FBGEMM's IntNBit rows (the same bytes TorchRec's module hands FBGEMM), so its
``state_dict`` keys and values are TorchRec's: ``embedding_bags.<table>.weight`` uint8 [rows,
row_bytes] (int4/int2 tables as TorchRec's ``UInt4Tensor`` / ``UInt2Tensor`` load too), or with
TorchRec's split scale/bias form, ``weight`` [rows, code bytes] + ``weight_qscale`` / ``weight_qbias``
fp16 [rows, 1]. ``from_torchrec`` copies a TorchRec module's rows byte for byte; ``gk.swap`` does it
for every such module in a model.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.quant.embedding_modules import EmbeddingBagCollection as TorchRecQuantEBC
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ..nn.quant_embedding_bag import QuantPackedTables
from .._swap import SwapSkip, register
from ..ops.quant_embedding_bag import (DEFAULT_FP8_EXPONENT_BIAS, DEFAULT_FP8_EXPONENT_BITS, OUTPUT_DTYPES,
                                       WEIGHT_TYPES, pack_quant_tables, quant_embedding_bag)
from ..nn._fx import is_proxy, trace_call
from .embedding_modules import FusedEmbeddingBagCollection, _FusedCollection, pooled_by_feature

_WEIGHT_DTYPES = {DataType.FP32: "fp32", DataType.FP16: "fp16", DataType.INT8: "int8", DataType.INT4: "int4",
                  DataType.INT2: "int2"}
# TorchRec's quantized collections' default (torchrec.quant.embedding_modules.DEFAULT_ROW_ALIGNMENT).
TORCHREC_ROW_ALIGNMENT = 16


class QuantEmbeddingBagCollection(QuantPackedTables):
    """TorchRec's quantized ``EmbeddingBagCollection`` (KJT in, KeyedTensor out) as one fused lookup.

    Keys, order and values as TorchRec's module: per table, per feature, the [B, dim] pooled bag of
    ``output_dtype``, weighted with ``is_weighted``; mixed dims and mixed data types (INT8 / INT4 /
    INT2 / FP16 / FP32 per table) in one call. Every table must have the same pooling (SUM or MEAN).
    """

    _PREFIX = "embedding_bags"
    # The KJT -> op layout, the bad-index message and TorchRec's accessors are the float collections'
    # (same attributes).
    _op_inputs = _FusedCollection._op_inputs
    _name_bad_index = _FusedCollection._name_bad_index
    embedding_bag_configs = FusedEmbeddingBagCollection.embedding_bag_configs
    is_weighted = FusedEmbeddingBagCollection.is_weighted

    def __init__(self, tables: list[EmbeddingBagConfig], is_weighted: bool = False, device=None,
                 output_dtype: torch.dtype = torch.float32, row_alignment: int = TORCHREC_ROW_ALIGNMENT,
                 bounds_check: str = "fatal", backend: str | None = None):
        super().__init__()
        tables = list(tables)
        if not tables or not all(isinstance(t, EmbeddingBagConfig) for t in tables):
            raise ValueError(f"tables must be a non-empty list of torchrec EmbeddingBagConfig, got {tables!r}")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        poolings = {t.pooling for t in tables}
        if not poolings <= {PoolingType.SUM, PoolingType.MEAN} or len(poolings) != 1:
            raise ValueError(f"every table must have the same pooling, SUM or MEAN, got {sorted(p.name for p in poolings)}")
        for t in tables:
            if t.data_type not in _WEIGHT_DTYPES:
                raise ValueError(f"table {t.name!r}: data_type must be one of {[d.name for d in _WEIGHT_DTYPES]}, "
                                 f"got {t.data_type}")
            if not t.feature_names:
                t.feature_names = [t.name]
        if output_dtype not in OUTPUT_DTYPES:
            raise ValueError(f"output_dtype must be one of {OUTPUT_DTYPES}, got {output_dtype!r}")
        self._configs, self._table_names, self._is_weighted = tables, names, bool(is_weighted)
        self.output_dtype, self.bounds_check, self.backend = output_dtype, bounds_check, backend
        self._pooling = "mean" if poolings == {PoolingType.MEAN} else "sum"
        self._feature_names = [list(t.feature_names) for t in tables]
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        self._embedding_names = [e for names_t in self._embedding_names_by_table for e in names_t]
        self._lookups = [(t, j, f, e) for t, (fs, es) in enumerate(zip(self._feature_names,
                                                                         self._embedding_names_by_table))
                         for j, (f, e) in enumerate(zip(fs, es))]
        self._flat_features = [f for _, _, f, _ in self._lookups]
        self._feature_slots = [(t, j) for t, j, _, _ in self._lookups]  # what _op_inputs' bag layout reads
        self.weight_dtypes = [_WEIGHT_DTYPES[t.data_type] for t in tables]
        layout = pack_quant_tables([t.num_embeddings for t in tables], [t.embedding_dim for t in tables],
                                   [WEIGHT_TYPES[d] for d in self.weight_dtypes], row_alignment)
        # Not persistent: the state_dict hooks below give TorchRec's per-table keys instead.
        self._set_quant_layout(layout, device, persistent=False)
        self.output_dim = sum(self.layout.dims)
        self._lengths_per_embedding = [self.layout.dims[t] for t, _, _, _ in self._lookups]
        self.register_state_dict_post_hook(_state_dict_hook)
        self.register_load_state_dict_pre_hook(_load_state_dict_hook)

    def weight(self, table: str) -> torch.Tensor:
        """Table ``table``'s packed rows, a uint8 [rows, row_bytes] view (writes go to the module)."""
        if table not in self._table_names:
            raise KeyError(f"no table {table!r}; tables: {self._table_names}")
        return self.layout.table(self.weights, self._table_names.index(table))

    @classmethod
    def from_torchrec(cls, module: TorchRecQuantEBC, bounds_check: str = "fatal",
                      backend: str | None = None) -> "QuantEmbeddingBagCollection":
        """A fused copy of TorchRec's quantized collection: same configs, output dtype, row alignment
        and the very same row bytes."""
        if not isinstance(module, TorchRecQuantEBC):
            raise ValueError(f"module must be a torchrec.quant EmbeddingBagCollection, got {type(module).__name__}")
        for emb in module._emb_modules:
            if getattr(emb, "fp8_exponent_bits", -1) not in (-1, DEFAULT_FP8_EXPONENT_BITS) or \
                    getattr(emb, "fp8_exponent_bias", -1) not in (-1, DEFAULT_FP8_EXPONENT_BIAS):
                raise ValueError("fp8 tables with a non-default exponent format are not supported")
            if getattr(emb, "index_remappings_array", torch.empty(0)).numel() or \
                    getattr(emb, "index_remapping_hash_table", torch.empty(0)).numel():
                raise ValueError("pruned tables (index remapping) are not supported")
        device = module._device if module._device.type != "meta" else None
        new = cls(module.embedding_bag_configs(), module.is_weighted(), device=device,
                  output_dtype=module.output_dtype(), row_alignment=module.row_alignment, bounds_check=bounds_check,
                  backend=backend)
        with torch.no_grad():
            by_name = {}
            for emb in module._emb_modules:
                for (name, *_), (rows, _, _) in zip(emb.embedding_specs,
                                                    emb.split_embedding_weights_with_scale_bias(0)):
                    by_name[name] = rows
            for name in new._table_names:
                new.weight(name).copy_(by_name[name])
        return new

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if is_proxy(features):
            return trace_call(self, features)
        values, offsets, psw, _, _, batch = self._op_inputs(features, self._is_weighted)

        def run():
            return quant_embedding_bag(self.weights, self.table_meta, values, offsets, psw, output_dim=self.output_dim,
                                       pooling=self._pooling, bounds_check=self.bounds_check,
                                       output_dtype=self.output_dtype, backend=self.backend)

        if torch.compiler.is_compiling():
            out = run()
        else:
            try:
                out = run()
            except IndexError as error:
                raise self._name_bad_index(error, batch) from None
        out = pooled_by_feature(out, self._feature_slots, self.layout.D_offsets, batch)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=out)

    def extra_repr(self) -> str:
        return (f"tables={self._table_names}, weight_dtypes={self.weight_dtypes}, pooling={self._pooling!r}, "
                f"output_dtype={self.output_dtype}")


def _state_dict_hook(module: QuantEmbeddingBagCollection, state_dict: dict, prefix: str, local_metadata) -> None:
    for t, name in enumerate(module._table_names):
        state_dict[f"{prefix}{module._PREFIX}.{name}.weight"] = module.layout.table(module.weights, t)


def _load_state_dict_hook(module: QuantEmbeddingBagCollection, state_dict: dict, prefix: str, local_metadata,
                          strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """TorchRec's per-table keys -> the packed rows; TorchRec's split form (codes + qscale + qbias)
    reassembled as [scale][bias][codes]."""
    for t, name in enumerate(module._table_names):
        key = f"{prefix}{module._PREFIX}.{name}.weight"
        if key not in state_dict:
            missing_keys.append(key)
            continue
        value = state_dict.pop(key)
        value = getattr(value, "elem", value)  # TorchRec's UInt4Tensor / UInt2Tensor hold uint8 bytes in .elem
        scale, bias = state_dict.pop(key + "_qscale", None), state_dict.pop(key + "_qbias", None)
        if scale is not None and bias is not None:
            value = torch.cat([scale.reshape(-1, 1).view(torch.uint8), bias.reshape(-1, 1).view(torch.uint8), value],
                              1)
        current = module.layout.table(module.weights, t)
        if value.dtype != torch.uint8 or value.shape[0] != current.shape[0] or value.shape[1] > current.shape[1]:
            error_msgs.append(f"size mismatch for {key}: expected uint8 [{current.shape[0]}, <= {current.shape[1]}] "
                              f"packed rows, got {value.dtype} {tuple(value.shape)}")
            continue
        with torch.no_grad():
            current.zero_()
            current[:, :value.shape[1]] = value.to(current.device)


def _convert(module: TorchRecQuantEBC, *, optimizer, backend) -> nn.Module:
    if optimizer is not None:
        raise SwapSkip("a quantized collection is inference only: no optimizer")
    try:
        return QuantEmbeddingBagCollection.from_torchrec(module, backend=backend)
    except ValueError as exc:
        raise SwapSkip(str(exc)) from exc


register(TorchRecQuantEBC, _convert)
__all__ = ["QuantEmbeddingBagCollection", "TORCHREC_ROW_ALIGNMENT"]

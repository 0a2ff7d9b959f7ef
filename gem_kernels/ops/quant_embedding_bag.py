"""Quantized fused embedding bags (inference): the front door, FBGEMM's IntNBit row format, and its quantizer.

Row format (FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen``, ``scale_bias_last=False``): a row
of an int8/int4/int2 table is ``[scale fp16][bias fp16][D * bits / 8 packed codes]``, padded to a
multiple of ``row_alignment`` bytes; element j of an n-bit row sits in byte ``j / (8/n)`` at bit
``(j % (8/n)) * n`` (low bits first), and ``W[j] = scale * q_j + bias``. fp16/fp32 rows are the
values themselves, fp8 rows one byte per element in FBGEMM's HFP8 format (``fp8_exponent_bits`` /
``fp8_exponent_bias``, 4 / 7 by default), both without scale and bias. Table t is
``weights[weights_offsets[t] : + rows_t * row_bytes[t]]`` of one flat uint8 buffer.

The pooled value is dequantize-then-accumulate in fp32 (FBGEMM's order):
``acc = fma(w_i * scale, q, acc + w_i * bias)`` per element, mean multiplies by 1 / kept length,
then the output is cast to ``output_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._backend import Family, kernel, native_kernels, resolve_backend
from .._backend import _on_device_of_inputs as on_device_of_inputs
from .._embedding_bag import BOUNDS_CHECK_CODES, NONE, POOLING_CODES, SKIP, kept_mask
from .embedding_bag import _code
from .._validate import (FLOAT_DTYPES, INDEX_DTYPES, check_nonnegative_int, check_offsets_meta, check_offsets_values,
                         check_same_device, check_tensor, per_sample_weights_arg)



def _reference_module():
    from ..reference import quant_embedding_bag
    return quant_embedding_bag


def _triton_module():
    from ..triton import quant_embedding_bag
    return quant_embedding_bag


# Its own Family for resolve_backend (its ops are not embedding_bag's), with every backend.
QUANT_FAMILY = Family(_reference_module, _triton_module)

# FBGEMM's SparseType codes (fbgemm_gpu.split_embedding_configs.SparseType.as_int()), so that a
# TorchRec module's weights_tys read as they are.
WEIGHT_TYPES = {"fp32": 0, "fp16": 1, "int8": 2, "int4": 3, "int2": 4, "fp8": 6}
FP32, FP16, INT8, INT4, INT2, FP8 = (WEIGHT_TYPES[k] for k in ("fp32", "fp16", "int8", "int4", "int2", "fp8"))
BITS = {FP32: 32, FP16: 16, INT8: 8, INT4: 4, INT2: 2, FP8: 8}
SCALE_BIAS_BYTES = 4  # fp16 scale + fp16 bias in front of every int8/int4/int2 row
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_FP8_EXPONENT_BITS, DEFAULT_FP8_EXPONENT_BIAS = 4, 7  # FBGEMM's SparseType.FP8.default_config()
# FBGEMM's CPU default row alignment (no padding: an int4 row of D = 64 is 36 bytes, 1/7.1 of fp32's);
# TorchRec's quantized collections pass 16 on every device (48 bytes), and their modules keep theirs.
DEFAULT_ROW_ALIGNMENT = 1


def weight_type_code(weight_dtype: str) -> int:
    if weight_dtype not in WEIGHT_TYPES:
        raise ValueError(f"weight_dtype must be one of {tuple(WEIGHT_TYPES)}, got {weight_dtype!r}")
    return WEIGHT_TYPES[weight_dtype]


def unpadded_row_bytes(dim: int, weight_type: int) -> int:
    """Bytes of one row before padding (FBGEMM's ``unpadded_row_size_in_bytes``)."""
    data = dim * BITS[weight_type] // 8
    return data + (SCALE_BIAS_BYTES if weight_type in (INT8, INT4, INT2) else 0)


def row_bytes(dim: int, weight_type: int, row_alignment: int) -> int:
    """Bytes of one padded row (FBGEMM's ``rounded_row_size_in_bytes``)."""
    r = unpadded_row_bytes(dim, weight_type)
    return (r + row_alignment - 1) // row_alignment * row_alignment


class QuantTableMeta(NamedTuple):
    """The per-table int64 tensors of the quantized op: ``weights_offsets`` [T] (byte offset of table
    t), ``D_offsets`` [T+1], ``rows_offsets`` [T+1] (as the training op's ``TableMeta``), ``weights_tys``
    [T] (FBGEMM SparseType codes) and ``row_bytes`` [T] (padded row stride in bytes)."""

    weights_offsets: torch.Tensor
    D_offsets: torch.Tensor
    rows_offsets: torch.Tensor
    weights_tys: torch.Tensor
    row_bytes: torch.Tensor


@dataclass(frozen=True)
class QuantTableLayout:
    """Where each quantized table lives in the flat uint8 buffer, in Python ints. Tables start on
    128-byte boundaries (FBGEMM's ``align_to_cacheline``), rows on ``row_alignment`` bytes."""

    rows: tuple[int, ...]
    dims: tuple[int, ...]
    weight_types: tuple[int, ...]
    row_bytes: tuple[int, ...]
    weights_offsets: tuple[int, ...]
    num_bytes: int

    @property
    def D_offsets(self) -> tuple[int, ...]:
        return _cumsum(self.dims)

    @property
    def rows_offsets(self) -> tuple[int, ...]:
        return _cumsum(self.rows)

    def meta(self, device=None) -> QuantTableMeta:
        return QuantTableMeta(*(torch.tensor(v, dtype=torch.int64, device=device) for v in (
            self.weights_offsets, self.D_offsets, self.rows_offsets, self.weight_types, self.row_bytes)))

    def table(self, flat: torch.Tensor, t: int) -> torch.Tensor:
        """Table t as a uint8 [rows_t, row_bytes_t] view of the flat buffer."""
        start, rows, stride = self.weights_offsets[t], self.rows[t], self.row_bytes[t]
        return flat[start:start + rows * stride].view(rows, stride)


def _cumsum(xs) -> tuple[int, ...]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return tuple(out)


def pack_quant_tables(rows: list[int], dims: list[int], weight_types: list[int],
                      row_alignment: int = DEFAULT_ROW_ALIGNMENT) -> QuantTableLayout:
    """The layout of tables ``rows[t] x dims[t]`` of ``weight_types[t]`` (FBGEMM codes), back to back."""
    if not rows or not len(rows) == len(dims) == len(weight_types):
        raise ValueError(f"rows, dims and weight_types must describe the same T >= 1 tables, got {len(rows)}, "
                         f"{len(dims)} and {len(weight_types)}")
    if isinstance(row_alignment, bool) or not isinstance(row_alignment, int) or row_alignment < 1:
        raise ValueError(f"row_alignment must be an int >= 1, got {row_alignment!r}")
    strides, offsets, pos = [], [], 0
    for t, (r, d, ty) in enumerate(zip(rows, dims, weight_types)):
        if ty not in BITS:
            raise ValueError(f"weight type of table {t} must be one of {WEIGHT_TYPES}, got {ty!r}")
        per_byte = max(1, 8 // BITS[ty])
        if d < 1 or r < 1 or d % per_byte:
            raise ValueError(f"table {t} must have rows >= 1 and D >= 1 divisible by {per_byte} for "
                             f"{_type_name(ty)}, got rows = {r}, D = {d}")
        strides.append(row_bytes(d, ty, row_alignment))
        offsets.append(pos)
        pos += (r * strides[-1] + 127) // 128 * 128
    return QuantTableLayout(tuple(rows), tuple(dims), tuple(weight_types), tuple(strides), tuple(offsets), pos)


def _type_name(code: int) -> str:
    return {v: k for k, v in WEIGHT_TYPES.items()}[code]


# ---------------------------------------------------------------------------------------------
# FBGEMM's quantization rules, in plain PyTorch (the results are byte-equal to
# torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf / FloatToHFP8Quantized; tested).
# ---------------------------------------------------------------------------------------------


def quantize_rows(weight: torch.Tensor, weight_dtype: str, fp8_exponent_bits: int = DEFAULT_FP8_EXPONENT_BITS,
                  fp8_exponent_bias: int = DEFAULT_FP8_EXPONENT_BIAS) -> torch.Tensor:
    """uint8 [R, unpadded row bytes] rows of float ``weight`` [R, D] in FBGEMM's IntNBit format.

    int8/int4/int2 (FBGEMM's row-wise rule): bias = fp16(min(row)); scale = fp16((max - bias) /
    (2^n - 1)) (1 when that is 0 or its inverse overflows); q = clamp(rint((x - bias) / scale), 0,
    2^n - 1) (round half to even, as lrintf), with x - bias and 1/scale in fp32.
    """
    code = weight_type_code(weight_dtype)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, dims=(2,))
    x = weight.detach().float().contiguous()
    R, D = x.shape
    if code == FP32:
        return x.view(torch.uint8).view(R, 4 * D)
    if code == FP16:
        return x.half().view(torch.uint8).view(R, 2 * D)
    if code == FP8:
        return float_to_fp8(x, fp8_exponent_bits, fp8_exponent_bias)
    bits = BITS[code]
    per_byte = 8 // bits
    if D % per_byte:
        raise ValueError(f"embedding_dim must be divisible by {per_byte} for {weight_dtype}, got {D}")
    levels = (1 << bits) - 1
    lo = x.amin(1) if D else x.new_zeros(R)
    hi = x.amax(1) if D else x.new_zeros(R)
    bias_h = lo.half()
    lo = bias_h.float()
    rng = hi - lo
    scale = torch.where(rng == 0, torch.ones_like(rng), rng / levels).half().float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    inv = 1.0 / scale
    bad = torch.isinf(inv)
    scale, inv = torch.where(bad, 1.0, scale), torch.where(bad, 1.0, inv)
    q = torch.round((x - lo[:, None]) * inv[:, None]).clamp(0, levels).to(torch.uint8)
    q = q.view(R, D // per_byte, per_byte)
    packed = torch.zeros(R, D // per_byte, dtype=torch.uint8, device=x.device)
    for k in range(per_byte):
        packed |= q[:, :, k] << (k * bits)
    scale_bias = torch.stack([scale.half(), bias_h], 1).view(torch.uint8)
    return torch.cat([scale_bias, packed], 1)


def float_to_fp8(x: torch.Tensor, exponent_bits: int, exponent_bias: int) -> torch.Tensor:
    """FBGEMM's HFP8 rounding (``FloatToFloat8_ref``): saturate to its max, round to nearest even
    by adding and subtracting a power-of-two "bouncer", in fp32 arithmetic."""
    mantissa_bits = 7 - exponent_bits
    max_pos = (1 << ((1 << exponent_bits) - 2 - exponent_bias)) * (2 - 2.0 ** (exponent_bits - 7))
    bits = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    sign = bits & 0x80000000
    a = torch.minimum((bits & 0x7FFFFFFF).to(torch.int32).view(torch.float32), torch.tensor(max_pos))
    a_bits = a.view(torch.int32).long() & 0xFFFFFFFF
    smallest_normal = 2.0 ** (1 - exponent_bias)
    bouncer = (((a_bits & 0xFF800000) + ((23 - mantissa_bits) << 23)) & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    rounded = ((bouncer + a) - bouncer).view(torch.int32).long() & 0xFFFFFFFF
    normal = ((((rounded - ((127 - exponent_bias) << 23)) << (8 - exponent_bits)) & 0xFFFFFFFF) | sign) >> 24
    sub_bouncer = torch.tensor(((127 + (23 + (1 - exponent_bias - mantissa_bits))) << 23), dtype=torch.int32)
    sub = ((sub_bouncer.view(torch.float32) + a).view(torch.int32).long() | (sign >> 24)) & 0xFF
    return torch.where(a >= smallest_normal, normal, sub).to(torch.uint8)


def fp8_to_float(q: torch.Tensor, exponent_bits: int, exponent_bias: int) -> torch.Tensor:
    """FBGEMM's HFP8 decoding (``Float8ToFloat_ref``): the 7 low bits moved to fp32's exponent and
    mantissa positions, times 2^(127 - bias); exact."""
    q = q.to(torch.int32)
    magnitude = ((q & 0x7F) << (16 + exponent_bits)).view(torch.float32) * 2.0 ** (127 - exponent_bias)
    return torch.where((q & 0x80) != 0, -magnitude, magnitude)


def dequantize_rows(rows: torch.Tensor, dim: int, weight_type: int, fp8_exponent_bits: int = DEFAULT_FP8_EXPONENT_BITS,
                    fp8_exponent_bias: int = DEFAULT_FP8_EXPONENT_BIAS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[R, dim] of `dtype` (fp32 or fp64) of uint8 rows [R, >= unpadded bytes] in the IntNBit format
    (padding ignored). In fp64 the values are exact: q * scale + bias of an integer of at most 8 bits
    and two fp16 numbers needs fewer than 53 bits."""
    R = rows.shape[0]
    if weight_type == FP32:
        return rows[:, :4 * dim].contiguous().view(torch.float32).to(dtype)
    if weight_type == FP16:
        return rows[:, :2 * dim].contiguous().view(torch.float16).to(dtype)
    if weight_type == FP8:
        return fp8_to_float(rows[:, :dim], fp8_exponent_bits, fp8_exponent_bias).to(dtype)
    bits = BITS[weight_type]
    per_byte = 8 // bits
    scale = rows[:, 0:2].contiguous().view(torch.float16).to(dtype)
    bias = rows[:, 2:4].contiguous().view(torch.float16).to(dtype)
    packed = rows[:, SCALE_BIAS_BYTES:SCALE_BIAS_BYTES + dim // per_byte].to(torch.int32)
    shifts = torch.arange(per_byte, device=rows.device, dtype=torch.int32) * bits
    q = ((packed[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(R, dim).to(dtype)
    return q * scale + bias


# ---------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------


def check_quant_tables(weights: torch.Tensor, meta: QuantTableMeta, output_dim: int, pooling: int) -> None:
    """Data checks of the table metadata, one copy of its 5T+2 values: ValueError naming the table."""
    num_tables = meta.weights_offsets.numel()
    v = torch.cat(meta).tolist()
    w_off, d_off = v[:num_tables], v[num_tables:2 * num_tables + 1]
    r_off, tys, strides = v[2 * num_tables + 1:3 * num_tables + 2], v[3 * num_tables + 2:4 * num_tables + 2], \
        v[4 * num_tables + 2:]
    if d_off[0] != 0 or r_off[0] != 0:
        raise ValueError(f"D_offsets[0] and rows_offsets[0] must be 0, got {d_off[0]} and {r_off[0]}")
    for t in range(num_tables):
        dim, rows, ty = d_off[t + 1] - d_off[t], r_off[t + 1] - r_off[t], tys[t]
        if ty not in BITS:
            raise ValueError(f"weights_tys[{t}] must be one of {WEIGHT_TYPES}, got {ty}")
        if dim < 1 or rows < 1 or dim % max(1, 8 // BITS[ty]):
            raise ValueError(f"table {t} must have D >= 1 (divisible by {max(1, 8 // BITS[ty])} for "
                             f"{_type_name(ty)}) and rows >= 1, got D = {dim} and rows = {rows}")
        if strides[t] < unpadded_row_bytes(dim, ty):
            raise ValueError(f"row_bytes[{t}] must be >= {unpadded_row_bytes(dim, ty)} for D = {dim} "
                             f"{_type_name(ty)}, got {strides[t]}")
        if w_off[t] < 0 or w_off[t] + rows * strides[t] > weights.numel():
            raise ValueError(f"table {t} ({rows} rows of {strides[t]} bytes at weights_offsets[{t}] = {w_off[t]}) "
                             f"does not fit in weights of {weights.numel()} bytes")
    if pooling == NONE:
        if {d_off[t + 1] - d_off[t] for t in range(num_tables)} != {output_dim}:
            raise ValueError(f"pooling 'none' needs every table's D equal to output_dim {output_dim}")
    elif d_off[-1] != output_dim:
        raise ValueError(f"output_dim must equal D_offsets[-1] = {d_off[-1]} for pooled output, got {output_dim}")


@torch.library.custom_op("gem_kernels::quant_embedding_bag", mutates_args=())
def quant_embedding_bag_op(weights: torch.Tensor, weights_offsets: torch.Tensor, D_offsets: torch.Tensor,
                           rows_offsets: torch.Tensor, weights_tys: torch.Tensor, row_bytes: torch.Tensor,
                           indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor,
                           output_dim: int, pooling: int, bounds_check: int, output_dtype: torch.dtype,
                           fp8_exponent_bits: int, fp8_exponent_bias: int, backend: str) -> torch.Tensor:
    meta = QuantTableMeta(weights_offsets, D_offsets, rows_offsets, weights_tys, row_bytes)
    check_quant_tables(weights, meta, output_dim, pooling)
    if native_kernels(backend) != "cpu":  # the C++ kernel checks offsets and bounds in its loop
        check_offsets_values("offsets", offsets, indices.shape[0])
        if bounds_check != SKIP:
            kept_mask(rows_offsets, indices, offsets, bounds_check)
    if backend in ("cpu", "cuda"):
        run = kernel("embedding_bag", "quant_embedding_bag_forward", backend)
    elif backend == "triton":
        run = on_device_of_inputs(QUANT_FAMILY.module(backend).quant_embedding_bag_forward)
    else:
        run = QUANT_FAMILY.module(backend).quant_embedding_bag_forward
    return run(
        weights, *meta, indices, offsets, per_sample_weights, output_dim, pooling, bounds_check, output_dtype,
        fp8_exponent_bits, fp8_exponent_bias)


def _forward_fake(weights, weights_offsets, D_offsets, rows_offsets, weights_tys, row_bytes, indices, offsets,
                  per_sample_weights, output_dim, pooling, bounds_check, output_dtype, *_):
    num_tables = weights_offsets.shape[0]
    rows = indices.shape[0] if pooling == NONE else (offsets.shape[0] - 1) // num_tables
    return weights.new_empty((rows, output_dim), dtype=output_dtype)


quant_embedding_bag_op.register_fake(_forward_fake)
if hasattr(torch.ops.gem_kernels, "quant_embedding_bag_forward_native"):
    torch.library.register_fake("gem_kernels::quant_embedding_bag_forward_native")(_forward_fake)


def quant_embedding_bag(weights: torch.Tensor, tables: QuantTableMeta, indices: torch.Tensor, offsets: torch.Tensor,
                        per_sample_weights: torch.Tensor | None = None, *, output_dim: int, pooling: str = "sum",
                        bounds_check: str = "fatal", output_dtype: torch.dtype = torch.float32,
                        fp8_exponent_bits: int = DEFAULT_FP8_EXPONENT_BITS,
                        fp8_exponent_bias: int = DEFAULT_FP8_EXPONENT_BIAS, backend: str | None = None) -> torch.Tensor:
    """Look up and pool T quantized tables' bags in one call (FBGEMM's IntNBit TBE, forward only).

    ``out[b, D_offsets[t]:D_offsets[t+1]] = sum_i w_i * deq(W_t[indices[i]])  for i in offsets[t*B+b] :
    offsets[t*B+b+1]``, ``deq(row)[j] = scale * q_j + bias`` (int8/int4/int2), the value itself
    (fp32/fp16/fp8), accumulated in fp32; ``mean`` divides by the bag's kept length; an empty bag
    gives zeros; ``pooling="none"``: ``out[i] = w_i * deq(W_t[indices[i]])``. Same index, offset,
    per-sample-weight and bounds-check conventions as ``gem_kernels.embedding_bag``.

    Args:
        weights: flat uint8 [bytes], the packed rows (module docstring: the row format).
        tables: a ``QuantTableMeta`` (``module.table_meta``; ``pack_quant_tables(...).meta()`` builds one).
        indices: [N] int32/int64, row ids local to their table.
        offsets: [T*B+1] int32/int64 (mixed with indices' dtype is fine: both are then read as int64).
        per_sample_weights: [N] float or None.
        output_dim: D_offsets[-1] for sum/mean, the shared D for "none".
        pooling: "sum" | "mean" | "none". bounds_check: "fatal" | "warn" | "skip" (as embedding_bag).
        output_dtype: torch.float32 | torch.float16 | torch.bfloat16 (cast after the fp32 pooling).
        fp8_exponent_bits, fp8_exponent_bias: the HFP8 format of fp8 tables.
        backend: "reference" | "cpu" | "cuda" | "triton" | "auto" | None.

    Returns:
        [B, output_dim] (sum/mean) or [N, output_dim] (none), ``output_dtype``.
    """
    check_tensor("weights", weights, dtypes=(torch.uint8,), dims=(1,))
    if not isinstance(tables, tuple) or len(tables) != len(QuantTableMeta._fields):
        raise TypeError(f"tables must be a QuantTableMeta {QuantTableMeta._fields}, got {type(tables).__name__}")
    tables = QuantTableMeta(*tables)
    for name, meta in tables._asdict().items():
        check_tensor(name, meta, dtypes=(torch.int64,), dims=(1,))
    num_tables = tables.weights_offsets.shape[0]
    if num_tables < 1:
        raise ValueError("weights_offsets must describe at least one table, got 0")
    for name in ("weights_tys", "row_bytes"):
        if getattr(tables, name).shape[0] != num_tables:
            raise ValueError(f"{name} must have T = {num_tables} elements, got {getattr(tables, name).shape[0]}")
    if tables.D_offsets.shape[0] != num_tables + 1 or tables.rows_offsets.shape[0] != num_tables + 1:
        raise ValueError(f"D_offsets and rows_offsets must have T+1 = {num_tables + 1} elements, got "
                         f"{tables.D_offsets.shape[0]} and {tables.rows_offsets.shape[0]}")
    check_tensor("indices", indices, dtypes=INDEX_DTYPES, dims=(1,))
    check_offsets_meta("offsets", offsets)
    if offsets.dtype != indices.dtype:  # FBGEMM and TorchRec mix them: read both as int64
        indices, offsets = indices.long(), offsets.long()
    if (offsets.shape[0] - 1) % num_tables != 0:
        raise ValueError(f"offsets must have T*B+1 elements with T = {num_tables} tables, got {offsets.shape[0]}")
    pooling_code = _code("pooling", pooling, POOLING_CODES)
    bounds_code = _code("bounds_check", bounds_check, BOUNDS_CHECK_CODES)
    if output_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {OUTPUT_DTYPES}, got {output_dtype!r}")
    if isinstance(output_dim, bool) or not isinstance(output_dim, int):
        raise ValueError(f"output_dim must be an int >= 0, got {output_dim!r}")
    check_nonnegative_int("output_dim", output_dim)
    for name, value, lo, hi in (("fp8_exponent_bits", fp8_exponent_bits, 1, 7),
                                ("fp8_exponent_bias", fp8_exponent_bias, 1, 127)):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    per_sample_weights = per_sample_weights_arg(per_sample_weights, indices, weights.device)
    check_same_device(weights=weights, indices=indices, offsets=offsets, per_sample_weights=per_sample_weights,
                      **tables._asdict())
    name = resolve_backend(backend, weights.device, QUANT_FAMILY)
    return quant_embedding_bag_op(weights.contiguous(), *(m.contiguous() for m in tables), indices.contiguous(),
                                  offsets.contiguous(), per_sample_weights.contiguous(), output_dim,
                                  pooling_code, bounds_code, output_dtype,
                                  fp8_exponent_bits, fp8_exponent_bias, name)



"""Quantized embedding bags: FBGEMM's IntNBit row format and quantizer, the reference and cpu kernels
against FBGEMM's own IntNBit TBE on the same bytes, the modules, TorchRec's quantized collection and swap."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx
import torch.nn.functional as F

import gem_kernels as gk
from gem_kernels.ops.quant_embedding_bag import (BITS, WEIGHT_TYPES, dequantize_rows, float_to_fp8, fp8_to_float,
                                                 pack_quant_tables, quant_embedding_bag, quant_embedding_bag_op,
                                                 quantize_rows)
from gem_kernels.nn.quant_embedding_bag import QuantizedEmbeddingBag, QuantizedTorchEmbeddingBag

BACKENDS = ("reference", "cpu", "triton")  # triton: the interpreter here (TRITON_INTERPRET=1, tests/conftest.py)
TYPES = ("int8", "int4", "int2", "fp16", "fp8", "fp32")
# Mixed dims and types in one call: D = 64/32/128 take the fixed-D AVX2 loops, 96 the run-time-D
# one, 40/8 the scalar loop.
MIXED = [(100, 64, "int8"), (57, 32, "int4"), (33, 40, "int2"), (80, 96, "fp16"), (20, 8, "fp8"), (11, 128, "fp32"),
         (29, 128, "int4"), (31, 64, "int2")]


def _backend(backend):
    if backend not in gk.available_backends():
        pytest.skip(f"{backend} backend unavailable here: {gk._backend.unavailable_reason(backend)}")
    return backend


def make_tables(specs, row_alignment=16, seed=0):
    """(flat uint8 buffer, layout, float tables) with every table quantized by FBGEMM's rule."""
    g = torch.Generator().manual_seed(seed)
    layout = pack_quant_tables([r for r, _, _ in specs], [d for _, d, _ in specs],
                               [WEIGHT_TYPES[t] for _, _, t in specs], row_alignment)
    flat = torch.zeros(layout.num_bytes, dtype=torch.uint8)
    floats = []
    for t, (r, d, ty) in enumerate(specs):
        w = torch.randn(r, d, generator=g)
        floats.append(w)
        q = quantize_rows(w, ty)
        layout.table(flat, t)[:, :q.shape[1]] = q
    return flat, layout, floats


def make_batch(specs, batch, index_dtype=torch.int64, offsets_dtype=None, max_len=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (len(specs) * batch,), generator=g)
    if lengths.numel():
        lengths[0] = 0  # an empty bag
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    indices = torch.cat([torch.randint(0, specs[t][0], (int(lengths[t * batch:(t + 1) * batch].sum()),), generator=g)
                         for t in range(len(specs))] + [torch.zeros(0, dtype=torch.long)])
    return indices.to(index_dtype), offsets.to(offsets_dtype or index_dtype)


def term_magnitude(flat, layout, indices, offsets, psw, pooling):
    """The op on |w_i| and rows with every sign bit cleared: sum_i |w_i| * (|scale| q + |bias|) per
    output element (|value| for rows without scale and bias), what bounds the rounding error of any
    fp32 evaluation order of the dequantize-and-pool sum."""
    magnitudes = flat.clone()
    for t, ty in enumerate(layout.weight_types):
        rows = layout.table(magnitudes, t)
        width = {WEIGHT_TYPES["fp32"]: 4, WEIGHT_TYPES["fp16"]: 2, WEIGHT_TYPES["fp8"]: 1}.get(ty)
        if width is None:  # scale and bias: fp16, sign in the high byte
            rows[:, 1] &= 0x7F
            rows[:, 3] &= 0x7F
        else:
            rows[:, width - 1:layout.dims[t] * width:width] &= 0x7F
    output_dim = layout.dims[0] if pooling == "none" else sum(layout.dims)
    return quant_embedding_bag(magnitudes, layout.meta(), indices, offsets, None if psw is None else psw.abs(),
                               output_dim=output_dim, pooling=pooling, backend="reference")


# ---------------------------------------------------------------------------------------------
# Row format and quantizer: byte-equal to FBGEMM's
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_dtype", ["int8", "int4", "int2"])
def test_quantize_rows_equals_fbgemm(weight_dtype):
    pytest.importorskip("fbgemm_gpu")
    x = torch.randn(97, 64) * 3
    x[3] = 1.5  # a constant row: range 0, scale 1
    x[4, :] = 0.0
    x[5] = torch.linspace(-1e-6, 1e-6, 64)  # a tiny range: scale underflows fp16
    ours = quantize_rows(x, weight_dtype)
    theirs = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(x, BITS[WEIGHT_TYPES[weight_dtype]])
    # FBGEMM's quantizer writes [codes][scale][bias]; its TBE rows (and ours) are [scale][bias][codes].
    assert torch.equal(ours, torch.cat([theirs[:, -4:], theirs[:, :-4]], 1))


def test_fp8_equals_fbgemm():
    pytest.importorskip("fbgemm_gpu")
    x = torch.randn(300, 16) * 10
    x[0, :6] = torch.tensor([1e-9, -1e-9, 1000.0, -1000.0, 0.0, 2.0 ** -9])
    ours = float_to_fp8(x, 4, 7)
    theirs = torch.ops.fbgemm.FloatToHFP8Quantized(x, 4, 7, 240.0)
    assert torch.equal(ours, theirs)
    assert torch.equal(fp8_to_float(ours, 4, 7), torch.ops.fbgemm.HFP8QuantizedToFloat(theirs, 4, 7))


@pytest.mark.parametrize("weight_dtype", TYPES)
def test_dequantize_error_within_one_step(weight_dtype):
    """An independent check of the reference's dequantization: within half a quantization step (+ fp16 rounding)."""
    x = torch.randn(50, 32)
    back = dequantize_rows(quantize_rows(x, weight_dtype), 32, WEIGHT_TYPES[weight_dtype])
    if weight_dtype in ("int8", "int4", "int2"):
        step = (x.amax(1) - x.amin(1)) / ((1 << BITS[WEIGHT_TYPES[weight_dtype]]) - 1)
        assert ((back - x).abs() <= step[:, None] * 0.51 + 1e-3 * x.abs().amax()).all()
    else:
        # half an ulp of the mantissa (fp8 e4m3: 3 bits), and half the subnormal step below the normals
        tol, floor = {"fp32": (0.0, 0.0), "fp16": (2 ** -11, 2 ** -25), "fp8": (2 ** -4, 2 ** -10)}[weight_dtype]
        assert ((back - x).abs() <= tol * x.abs() + floor).all()


# ---------------------------------------------------------------------------------------------
# The op against FBGEMM's IntNBit TBE on the same bytes
# ---------------------------------------------------------------------------------------------


def _fbgemm_tbe(specs, pooling, output_dtype=torch.float32):
    pytest.importorskip("fbgemm_gpu")
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    types = {"int8": SparseType.INT8, "int4": SparseType.INT4, "int2": SparseType.INT2, "fp16": SparseType.FP16,
             "fp8": SparseType.FP8, "fp32": SparseType.FP32}
    out = {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16, torch.bfloat16: SparseType.BF16}
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        [(f"t{t}", r, d, types[ty], EmbeddingLocation.HOST) for t, (r, d, ty) in enumerate(specs)], device="cpu",
        row_alignment=16, output_dtype=out[output_dtype],
        pooling_mode={"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN}[pooling])
    tbe.initialize_weights()
    return tbe


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("index_dtype,offsets_dtype", [(torch.int64, torch.int64), (torch.int32, torch.int32),
                                                        (torch.int64, torch.int32)])
def test_equals_fbgemm_intnbit_tbe(backend, pooling, weighted, index_dtype, offsets_dtype):
    """Same packed bytes in FBGEMM's TBE and ours. Both dequantize and accumulate in fp32 in FBGEMM's
    order (acc = fma(w*scale, q, acc + w*bias), row after row), so the cpu kernel is bit-equal here;
    the tolerance allows what a different but valid fp32 summation order could change, L * 2^-23 *
    sum|terms| per element (FBGEMM's JIT kernel is generated per ISA, and the reference sums with
    index_add_ and scales by 1/L at the end)."""
    _backend(backend)
    tbe = _fbgemm_tbe(MIXED, pooling)
    flat, layout, _ = make_tables(MIXED)
    assert tbe.weights_host.numel() == flat.numel()
    assert tbe.weights_offsets.tolist() == list(layout.weights_offsets)  # the same layout, byte for byte
    tbe.weights_host.copy_(flat)
    indices, offsets = make_batch(MIXED, 37, index_dtype, offsets_dtype)
    psw = torch.rand(indices.numel()) if weighted else None
    expected = tbe(indices.long(), offsets.long(), psw)
    out = quant_embedding_bag(flat, layout.meta(), indices, offsets, psw, output_dim=sum(layout.dims),
                              pooling=pooling, backend=backend)
    bound = 6 * 2.0 ** -23 * term_magnitude(flat, layout, indices, offsets, psw, pooling) + 1e-30
    assert ((out - expected).abs() <= bound).all(), (out - expected).abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("output_dtype", [torch.float16, torch.bfloat16])
def test_output_dtypes_equal_fbgemm(backend, output_dtype):
    """fp16/bf16 output: the fp32 pooled value rounded once; within one rounding of FBGEMM's."""
    _backend(backend)
    specs = MIXED[:4]
    tbe = _fbgemm_tbe(specs, "sum", output_dtype)
    flat, layout, _ = make_tables(specs)
    tbe.weights_host.copy_(flat)
    indices, offsets = make_batch(specs, 19)
    expected = tbe(indices, offsets)
    out = quant_embedding_bag(flat, layout.meta(), indices, offsets, output_dim=sum(layout.dims),
                              output_dtype=output_dtype, backend=backend)
    assert out.dtype == output_dtype
    eps = torch.finfo(output_dtype).eps
    torch.testing.assert_close(out.float(), expected.float(), rtol=eps, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# cpu against the reference: pooling none, empty batches, every D path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
@pytest.mark.parametrize("weight_dtype", TYPES)
@pytest.mark.parametrize("dim", [8, 32, 64, 96, 128, 288])
def test_cpu_equals_reference(pooling, weight_dtype, dim):
    _check_against_reference("cpu", pooling, weight_dtype, dim)


@pytest.mark.parametrize("pooling", ["mean", "none"])
@pytest.mark.parametrize("weight_dtype", TYPES)
def test_triton_equals_reference(pooling, weight_dtype):
    _check_against_reference("triton", pooling, weight_dtype, 40)  # fewer shapes: the interpreter is slow


def _check_against_reference(backend, pooling, weight_dtype, dim):
    _backend(backend)
    specs = [(59, dim, weight_dtype), (7, dim, weight_dtype)]
    flat, layout, _ = make_tables(specs, row_alignment=1)
    indices, offsets = make_batch(specs, 13)
    psw = torch.rand(indices.numel())
    args = (flat, layout.meta(), indices, offsets, psw)
    kw = dict(output_dim=dim if pooling == "none" else 2 * dim, pooling=pooling)
    ref = quant_embedding_bag(*args, **kw, backend="reference")
    out = quant_embedding_bag(*args, **kw, backend=backend)
    bound = 4 * 2.0 ** -23 * term_magnitude(flat, layout, indices, offsets, psw, pooling) + 1e-30
    assert ((out - ref).abs() <= bound).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_empty_bags(backend):
    _backend(backend)
    flat, layout, _ = make_tables(MIXED[:2])
    for batch in (0, 3):
        offsets = torch.zeros(2 * batch + 1, dtype=torch.long)
        out = quant_embedding_bag(flat, layout.meta(), torch.zeros(0, dtype=torch.long), offsets,
                                  output_dim=96, backend=backend)
        assert out.shape == (batch, 96) and (out == 0).all()


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounds_check(backend):
    _backend(backend)
    specs = MIXED[:2]
    flat, layout, _ = make_tables(specs)
    indices = torch.tensor([1, 2, 100, 3, -1])  # 100 is past table 0's 100 rows; -1 is negative
    offsets = torch.tensor([0, 2, 3, 4, 5])
    kw = dict(output_dim=96, backend=backend)
    with pytest.raises(IndexError, match=r"indices\[2\] = 100 is out of range for table 0"):
        quant_embedding_bag(flat, layout.meta(), indices, offsets, **kw)
    with pytest.warns(UserWarning, match="dropping 2 out-of-range"):
        warned = quant_embedding_bag(flat, layout.meta(), indices, offsets, bounds_check="warn", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        skipped = quant_embedding_bag(flat, layout.meta(), indices, offsets, bounds_check="skip", **kw)
    # the dropped ids contribute nothing: the same as leaving them out
    good = quant_embedding_bag(flat, layout.meta(), torch.tensor([1, 2, 3]), torch.tensor([0, 2, 2, 3, 3]), **kw)
    assert torch.equal(warned, good) and torch.equal(skipped, good)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_offsets(backend):
    _backend(backend)
    flat, layout, _ = make_tables(MIXED[:2])
    indices = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"offsets\[-1\] must equal"):
        quant_embedding_bag(flat, layout.meta(), indices, torch.tensor([0, 1, 2]), output_dim=96, backend=backend)
    with pytest.raises(ValueError, match="nondecreasing"):
        quant_embedding_bag(flat, layout.meta(), indices, torch.tensor([0, 2, 1, 3, 3]), output_dim=96,
                            backend=backend)
    with pytest.raises(ValueError, match=r"offsets\[0\] must be 0"):
        quant_embedding_bag(flat, layout.meta(), indices, torch.tensor([1, 1, 2]), output_dim=96, backend=backend)


def test_bad_arguments_name_themselves():
    flat, layout, _ = make_tables(MIXED[:2])
    indices, offsets = make_batch(MIXED[:2], 3)
    meta = layout.meta()
    with pytest.raises(ValueError, match="weights must have dtype"):
        quant_embedding_bag(flat.float(), meta, indices, offsets, output_dim=96)
    with pytest.raises(ValueError, match="output_dtype"):
        quant_embedding_bag(flat, meta, indices, offsets, output_dim=96, output_dtype=torch.int8)
    with pytest.raises(ValueError, match="output_dim must equal"):
        quant_embedding_bag(flat, meta, indices, offsets, output_dim=95)
    with pytest.raises(ValueError, match="pooling"):
        quant_embedding_bag(flat, meta, indices, offsets, output_dim=96, pooling="max")
    with pytest.raises(ValueError, match="does not fit in weights"):
        quant_embedding_bag(flat[:100], meta, indices, offsets, output_dim=96)
    bad_types = meta._replace(weights_tys=torch.tensor([2, 9]))
    with pytest.raises(ValueError, match=r"weights_tys\[1\]"):
        quant_embedding_bag(flat, bad_types, indices, offsets, output_dim=96)
    with pytest.raises(ValueError, match="weight_dtype"):
        QuantizedEmbeddingBag([gk.TableSpec(4, 8)], "int3")
    with pytest.raises(ValueError, match="divisible by 4"):
        QuantizedEmbeddingBag([gk.TableSpec(4, 6)], "int2")
    with pytest.raises(TypeError, match="QuantTableMeta"):
        quant_embedding_bag(flat, tuple(meta)[:3], indices, offsets, output_dim=96)


def test_opcheck():
    flat, layout, _ = make_tables(MIXED[:3])
    indices, offsets = make_batch(MIXED[:3], 3)
    for backend in BACKENDS:
        if backend in gk.available_backends():
            torch.library.opcheck(quant_embedding_bag_op,
                                  (flat, *layout.meta(), indices, offsets, torch.rand(indices.numel()),
                                   sum(layout.dims), 1, 0, torch.float16, 4, 7, backend))


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_from_float_and_state_dict_round_trip(backend):
    _backend(backend)
    fused = gk.FusedEmbeddingBag([gk.TableSpec(50, 64), gk.TableSpec(30, 32)], pooling="mean")
    q = QuantizedEmbeddingBag.from_float(fused, ["int8", "int4"], backend=backend)
    assert q.pooling == "mean"
    indices, offsets = make_batch([(50, 64, ""), (30, 32, "")], 9)
    out = q(indices, offsets)
    # int8 of N(0,1) rows: within half a step (range/255 ~ 0.02) of the fp32 bag mean, int4 ~ 0.3
    exact = fused(indices, offsets).detach()
    assert (out[:, :64] - exact[:, :64]).abs().max() < 0.02
    assert (out[:, 64:] - exact[:, 64:]).abs().max() < 0.3
    fresh = QuantizedEmbeddingBag([gk.TableSpec(50, 64), gk.TableSpec(30, 32)], ["int8", "int4"], pooling="mean",
                                  backend=backend)
    fresh.load_state_dict(q.state_dict())
    assert torch.equal(fresh(indices, offsets), out)


def test_int4_memory_is_under_a_seventh_of_fp32():
    q = QuantizedEmbeddingBag([gk.TableSpec(1000, 64)] * 2, "int4")
    assert q.weights.numel() <= 2 * 1000 * 64 * 4 / 7


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_torch_embedding_bag_drop_in(backend, mode):
    _backend(backend)
    bag = torch.nn.EmbeddingBag(40, 32, mode=mode)
    q = QuantizedTorchEmbeddingBag.from_torch(bag, "int8", backend=backend)
    table = dequantize_rows(q.table(0), 32, WEIGHT_TYPES["int8"])
    ids = torch.randint(0, 40, (5, 3))
    torch.testing.assert_close(q(ids), F.embedding_bag(ids, table, mode=mode))
    flat, starts = ids.reshape(-1), torch.tensor([0, 4, 4, 9])
    torch.testing.assert_close(q(flat, starts), F.embedding_bag(flat, table, starts, mode=mode))


# ---------------------------------------------------------------------------------------------
# swap and TorchRec's quantized collection
# ---------------------------------------------------------------------------------------------


class _Holder(torch.nn.Module):
    def __init__(self, child):
        super().__init__()
        self.child = child


def test_swap_quantize_embedding_bag_in_eval_mode_only():
    bag = torch.nn.EmbeddingBag(40, 32, mode="sum")
    model = _Holder(bag).eval()
    report = gk.swap(model, quantize="int4")
    assert isinstance(model.child, QuantizedTorchEmbeddingBag), report
    assert model.child.weight_dtypes == ["int4"]
    ids = torch.randint(0, 40, (6, 5))
    table = dequantize_rows(model.child.table(0), 32, WEIGHT_TYPES["int4"])
    torch.testing.assert_close(model.child(ids), F.embedding_bag(ids, table, mode="sum"))
    # state_dict round trip into a fresh swapped model
    other = _Holder(torch.nn.EmbeddingBag(40, 32, mode="sum")).eval()
    gk.swap(other, quantize="int4")
    other.load_state_dict(model.state_dict())
    assert torch.equal(other.child(ids), model.child(ids))
    training = _Holder(torch.nn.EmbeddingBag(40, 32, mode="sum"))  # training mode: the float fused module
    gk.swap(training, quantize="int8")
    assert isinstance(training.child, gk.nn.EmbeddingBag)
    with pytest.raises(ValueError, match="quantize must be None or one of"):
        gk.swap(_Holder(torch.nn.EmbeddingBag(4, 4)).eval(), quantize="int3")


def _torchrec_quant_ebc(weighted=False, pooling="SUM", split_scale_bias=False):
    torchrec = pytest.importorskip("torchrec")
    from torch.ao.quantization import PlaceholderObserver
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.quant.embedding_modules import (EmbeddingBagCollection as QEBC, QuantConfig,
                                                  quant_prep_enable_quant_state_dict_split_scale_bias)

    tables = [EmbeddingBagConfig(name="t0", embedding_dim=64, num_embeddings=100, feature_names=["f0", "f1"],
                                 pooling=PoolingType[pooling]),
              EmbeddingBagConfig(name="t1", embedding_dim=32, num_embeddings=50, feature_names=["f2"],
                                 pooling=PoolingType[pooling]),
              EmbeddingBagConfig(name="t2", embedding_dim=24, num_embeddings=30, feature_names=["f3"],
                                 pooling=PoolingType[pooling])]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, is_weighted=weighted)
    ebc.qconfig = QuantConfig(activation=PlaceholderObserver.with_args(dtype=torch.float),
                              weight=PlaceholderObserver.with_args(dtype=torch.qint8),
                              per_table_weight_dtype={"t1": torch.quint4x2, "t2": torch.float16})
    if split_scale_bias:
        quant_prep_enable_quant_state_dict_split_scale_bias(ebc)
    return QEBC.from_float(ebc)


def _kjt(weighted):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 5, (4 * 7,), generator=g)
    values = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=values, lengths=lengths.int(), weights=weights)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weighted,pooling", [(False, "SUM"), (True, "SUM"), (False, "MEAN")])
def test_torchrec_quant_collection_equals_torchrec(backend, weighted, pooling):
    """From TorchRec's own quantized collection (FBGEMM's IntNBit TBE): same rows, keys and values
    (same arithmetic as test_equals_fbgemm_intnbit_tbe, so the same tolerance)."""
    _backend(backend)
    theirs = _torchrec_quant_ebc(weighted, pooling)
    ours = gk.torchrec.QuantEmbeddingBagCollection.from_torchrec(theirs, backend=backend)
    kjt = _kjt(weighted)
    expected, out = theirs(kjt), ours(kjt)
    assert out.keys() == expected.keys() and out.length_per_key() == expected.length_per_key()
    torch.testing.assert_close(out.values(), expected.values(), rtol=1e-6, atol=1e-6)
    for name, mine in ours.state_dict().items():  # TorchRec's keys and bytes
        assert torch.equal(mine, getattr(theirs.state_dict()[name], "elem", theirs.state_dict()[name]))


@pytest.mark.parametrize("split_scale_bias", [False, True])
def test_torchrec_quant_state_dict_loads(split_scale_bias):
    theirs = _torchrec_quant_ebc(split_scale_bias=split_scale_bias)
    ours = gk.torchrec.QuantEmbeddingBagCollection(theirs.embedding_bag_configs())
    ours.load_state_dict(theirs.state_dict())
    kjt = _kjt(False)
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values(), rtol=1e-6, atol=1e-6)
    again = gk.torchrec.QuantEmbeddingBagCollection(theirs.embedding_bag_configs())
    again.load_state_dict(ours.state_dict())
    assert torch.equal(again.weights, ours.weights)


def test_swap_torchrec_quant_collection():
    theirs = _torchrec_quant_ebc()
    model = _Holder(theirs).eval()
    kjt = _kjt(False)
    expected = theirs(kjt).values()
    report = gk.swap(model)
    assert isinstance(model.child, gk.torchrec.QuantEmbeddingBagCollection), report
    torch.testing.assert_close(model.child(kjt).values(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    _backend(backend)
    torch._dynamo.reset()
    q = QuantizedEmbeddingBag([gk.TableSpec(50, 64), gk.TableSpec(30, 32)], ["int8", "int4"], backend=backend)
    q.set_table_from_float(0, torch.randn(50, 64))
    q.set_table_from_float(1, torch.randn(30, 32))
    indices, offsets = make_batch([(50, 64, ""), (30, 32, "")], 5)
    compiled = torch.compile(q, fullgraph=True)
    assert torch.equal(compiled(indices, offsets), q(indices, offsets))


class _PoolSum(torch.nn.Module):
    """A model around a swapped quantized bag: what torch.fx / TorchRec's inference tooling trace."""

    def __init__(self, child):
        super().__init__()
        self.child = child

    def forward(self, ids, offsets):
        return self.child(ids, offsets).sum(1)


def test_quantized_modules_trace_with_torch_fx():
    """torch.fx.symbolic_trace of a model holding a swapped quantized bag, and torchrec.fx.symbolic_trace
    of the quantized collection, give graphs that compute what the modules do (the modules' Python
    checks used to see a Proxy: "input must be a 1-D or 2-D tensor of ids, got Proxy")."""
    bag = torch.nn.EmbeddingBag(40, 32, mode="sum")
    model = _PoolSum(bag).eval()
    gk.swap(model, quantize="int8")
    assert isinstance(model.child, QuantizedTorchEmbeddingBag)
    ids, starts = torch.randint(0, 40, (9,)), torch.tensor([0, 4, 4])
    gm = torch.fx.symbolic_trace(model)
    assert torch.equal(gm(ids, starts), model(ids, starts))
    with pytest.raises(IndexError):  # the checks still run, on real tensors, when the graph runs
        gm(torch.tensor([40]), torch.tensor([0]))
    pytest.importorskip("torchrec")
    from torchrec.fx import symbolic_trace

    theirs = _torchrec_quant_ebc()
    ours = gk.torchrec.QuantEmbeddingBagCollection.from_torchrec(theirs)
    kjt = _kjt(False)
    traced = symbolic_trace(ours)
    assert torch.equal(traced(kjt).values(), ours(kjt).values())
    assert ours.embedding_bag_configs() is ours._configs and ours.is_weighted() is False

"""Bench of the inference (serving) path. Groups of cases, each a generator in GROUPS; ``cases`` runs them in order:
the quantized embedding bags below, then KV-cached ranking (bench/ranking.py, also a family of its own:
`python -m bench ranking`, which scripts/gpu_check.sh runs so that its rows are reached on a GPU too).

Quantized embedding bags (issue 27 part 1): TorchRec's quantized EmbeddingBagCollection (FBGEMM's
IntNBit TBE, ``int_nbit_split_embedding_codegen_lookup_function``) against ours on the SAME packed
bytes: 8 tables of 100k x 64, B = 2048, bag lengths ~ Poisson(20), Zipf(1.05) ids (the
embedding_bag bench's ``zipf_batch``). One case per weight dtype (int8, int4, fp16); its impls:
  cpu             gk.quant_embedding_bag on the packed rows (the op);
  gk-torchrec     gk.torchrec.QuantEmbeddingBagCollection(kjt) (the module: KJT in, KeyedTensor out);
  torchrec-quant  TorchRec's quantized collection on the same KJT (the baseline);
  fp32-fused      gk.embedding_bag (cpu) on fp32 tables holding the dequantized values (our fp32 forward);
  nn.EmbeddingBag one torch.nn.EmbeddingBag per table in a loop on those fp32 tables (int8 case only);
  reference       the quantized op's plain-PyTorch reference, the verification reference.
Every impl computes the same numbers (the fp32 tables hold the dequantized rows exactly), so all are
checked against the reference before timing, within fp32 summation-order tolerance.

Bytes: the floor counts each distinct row once at the quantized row size (TorchRec's 16-byte row
alignment: int8 D = 64 is 80 bytes, int4 48, fp16 128) plus the fp32 output and the int64 ids; the
FBGEMM-formula column counts every lookup. The fp32 impls read 256-byte rows: their own bytes are in
the notes. % peak is against the copy peak (bench/peaks.py).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

import gem_kernels as gk
from gem_kernels.ops.quant_embedding_bag import WEIGHT_TYPES, dequantize_rows

from .embedding_bag import SEED, zipf_batch
from .harness import Case, SkipFamily, rotate
from .ranking import ranking_cases

QUANT_DTYPES = ("int8", "int4", "fp16")
# Seconds of timing (full, quick): two groups, and the ranking cases time whole model passes of up to 4.6k
# tokens (bench/__main__.py caps each family at this, or at its even share of the run's budget).
FAMILY_BUDGET = {False: 600.0, True: 9.0}


def _torchrec_quant_collection(num_tables: int, rows: int, dim: int, weight_dtype: str):
    """TorchRec's quantized EmbeddingBagCollection (quantized by TorchRec's own from_float)."""
    import torchrec
    from torch.ao.quantization import PlaceholderObserver
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC
    from torchrec.quant.embedding_modules import QuantConfig

    torch.manual_seed(SEED)
    configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{t}"])
               for t in range(num_tables)]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=False)
    weight = {"int8": torch.qint8, "int4": torch.quint4x2, "fp16": torch.float16}[weight_dtype]
    ebc.qconfig = QuantConfig(activation=PlaceholderObserver.with_args(dtype=torch.float),
                              weight=PlaceholderObserver.with_args(dtype=weight))
    return QuantEBC.from_float(ebc)


def _quant_bytes(indices, offsets, num_tables, batch, row_bytes, dim) -> tuple[int, int]:
    """(floor, FBGEMM formula) bytes: distinct rows once / every lookup, + fp32 output + int64 ids."""
    rest = batch * num_tables * dim * 4 + (indices.numel() + offsets.numel()) * 8
    distinct = sum(int(indices[offsets[t * batch]:offsets[(t + 1) * batch]].unique().numel())
                   for t in range(num_tables))
    return distinct * row_bytes + rest, indices.numel() * row_bytes + rest


def _pooled_fp64(tables: list[torch.Tensor], indices: torch.Tensor, offsets: torch.Tensor,
                 batch: int) -> torch.Tensor:
    """The reference's computation in float64 on exact row values (the verification's ground truth):
    [B, sum(D)] sum pooling of table t's bags offsets[t*B : (t+1)*B + 1]."""
    outs = []
    for t, table in enumerate(tables):
        lo, hi = int(offsets[t * batch]), int(offsets[(t + 1) * batch])
        starts = offsets[t * batch:(t + 1) * batch] - lo
        outs.append(torch.nn.functional.embedding_bag(indices[lo:hi], table, starts, mode="sum"))
    return torch.cat(outs, 1)


def quantized_embedding_cases(quick: bool, device: torch.device) -> Iterator[Case]:
    if device.type != "cpu":
        return  # the quantized kernels run on the CPU (reference elsewhere); nothing to compare on a GPU yet
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError as exc:
        raise SkipFamily(f"torchrec is not installed ({exc}): the baseline is TorchRec's quantized collection")
    num_tables, rows, dim, batch = (8, 100_000, 64, 2048) if not quick else (4, 20_000, 64, 256)
    specs = [gk.TableSpec(rows, dim)] * num_tables
    batches = [zipf_batch(specs, batch, SEED + i) for i in range(2)]
    keys = [f"f{t}" for t in range(num_tables)]
    arg_sets = [(i, o, KeyedJaggedTensor(keys=keys, values=i, lengths=o.diff())) for i, o in batches]
    for weight_dtype in QUANT_DTYPES:
        theirs = _torchrec_quant_collection(num_tables, rows, dim, weight_dtype).eval()
        ours = gk.torchrec.QuantEmbeddingBagCollection.from_torchrec(theirs, backend="cpu").eval()
        weights, meta, output_dim = ours.weights, ours.table_meta, ours.output_dim
        code = WEIGHT_TYPES[weight_dtype]
        tables64 = [dequantize_rows(ours.layout.table(weights, t), dim, code, dtype=torch.float64)
                    for t in range(num_tables)]
        fp32 = gk.FusedEmbeddingBag(specs, pooling="sum").requires_grad_(False)
        for t in range(num_tables):
            fp32.layout.table(fp32.weights, t).copy_(dequantize_rows(ours.layout.table(weights, t), dim, code))

        def op(backend):
            return lambda i, o, _: gk.quant_embedding_bag(weights, meta, i, o, output_dim=output_dim, backend=backend)

        impls: dict[str, Callable] = {
            "cpu": rotate(arg_sets, op("cpu")),
            "gk-torchrec": rotate(arg_sets, lambda i, o, kjt, m=ours: m(kjt).values()),
            "torchrec-quant": rotate(arg_sets, lambda i, o, kjt, m=theirs: m(kjt).values()),
            "fp32-fused": rotate(arg_sets, lambda i, o, _, m=fp32: gk.embedding_bag(
                m.weights, m.table_meta, i, o, output_dim=m.output_dim, backend="cpu")),
            "reference": rotate(arg_sets, op("reference")),
        }
        if weight_dtype == "int8":
            bags = [torch.nn.EmbeddingBag.from_pretrained(fp32.layout.table(fp32.weights, t).clone(), mode="sum")
                    for t in range(num_tables)]
            impls["nn.EmbeddingBag"] = rotate(arg_sets, lambda i, o, _, bags=bags: torch.cat(
                [bag(i[o[t * batch]:o[(t + 1) * batch]], o[t * batch:(t + 1) * batch] - o[t * batch])
                 for t, bag in enumerate(bags)], 1))
        row_bytes = ours.layout.row_bytes[0]
        first_i, first_o = batches[0]
        floor, formula = _quant_bytes(first_i, first_o, num_tables, batch, row_bytes, dim)
        fp32_floor, _ = _quant_bytes(first_i, first_o, num_tables, batch, 4 * dim, dim)
        table_bytes = ours.layout.num_bytes
        notes = [f"tables: {weight_dtype} {table_bytes / 2**20:.1f} MiB ({row_bytes} B rows, TorchRec's 16-byte "
                 f"alignment) = 1/{fp32.weights.numel() * 4 / table_bytes:.2f} of fp32's "
                 f"{fp32.weights.numel() * 4 / 2**20:.1f} MiB",
                 f"fp32-fused and nn.EmbeddingBag read fp32 rows: their floor is {fp32_floor / 1e6:.1f} MB, "
                 f"vs {floor / 1e6:.1f} MB for the {weight_dtype} impls (the GB/s column uses the latter)",
                 "% peak is against the copy peak (a gather peak is not measured yet)"]
        if weight_dtype == "int4":
            unaligned = gk.QuantizedEmbeddingBag(specs, "int4").weights.numel()
            notes.append(f"int4 with FBGEMM's CPU row alignment 1 (gk.QuantizedEmbeddingBag's default): "
                         f"{unaligned / 2**20:.1f} MiB = 1/{fp32.weights.numel() * 4 / unaligned:.2f} of fp32")
        yield Case(op=f"quant_embedding_bag fwd {weight_dtype}",
                   shape=f"T={num_tables} rows={rows} D={dim} B={batch} L~20 zipf", dtype=torch.float32,
                   flops=2 * first_i.numel() * dim, bytes=floor, formula_bytes=formula, impls=impls,
                   baseline="torchrec-quant", peak="bandwidth", notes=notes, reference="reference",
                   fp64=lambda tables=tables64: _pooled_fp64(tables, *batches[0], batch))
        del impls, theirs, ours, fp32, tables64


# The groups of inference cases, run in this order.
GROUPS = [quantized_embedding_cases, ranking_cases]


def cases(quick: bool, device: torch.device) -> Iterator[Case]:
    for group in GROUPS:
        yield from group(quick, device)

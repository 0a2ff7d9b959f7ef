"""Compile every Triton kernel of gem_kernels for a GPU, on a machine without one.

The Triton backend runs here only in Triton's CPU interpreter, which accepts code that the GPU
compiler rejects (tl.dot shapes, loop-carried types, shared memory over the chip's limit) and says
nothing about registers or spills. This script closes that gap in two steps:

1. record: in a child process with TRITON_INTERPRET=1, run a workload that launches every kernel at
   the shapes the GPU bench and tests use (head dims 128/64/40, embedding dims 64/128/36/260,
   F = 27/128/256, the HSTU layer at D = 256, fp32/bf16/fp16, every option), and record each
   launch's argument types and constexpr values. The interpreter-only switches (`triton_interpret()`:
   fp32 tl.dot operands) are turned off while recording, so the GPU's specialisations are the ones
   recorded.
2. compile: for every distinct specialisation, `triton.compile` it for the target (default
   sm_90a, the H100/H200) down to a cubin, and read registers, spills and shared memory from the
   bundled ptxas. A compile error, a spill or shared memory over the target's limit fails the run.

Usage:  python scripts/triton_compile_check.py [--arch 90] [--dtypes bfloat16,float32] [--kernels REGEX]
                                              [--jobs N] [--json out.json]
Exit status 0 when every specialisation compiled within the limits. Compiling says nothing about
the results: that still takes a GPU (scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Opt-in shared memory per block (bytes): 227 KiB on sm_90 (H100/H200), 163 KiB on sm_80 (A100).
SHARED_LIMIT = {90: 232448, 80: 166912}

DTYPE_NAMES = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float64": "fp64",
               "torch.int64": "i64", "torch.int32": "i32", "torch.int16": "i16", "torch.int8": "i8",
               "torch.uint8": "u8", "torch.bool": "i1"}


# ---------------------------------------------------------------------------------------------
# Step 1: record launches under the interpreter
# ---------------------------------------------------------------------------------------------

def _workload() -> None:
    """Launch every Triton kernel at GPU-relevant shapes (tiny batches: the interpreter is slow)."""
    import torch

    import gem_kernels as gk
    from gem_kernels import optim

    gk.use_backend("triton")
    names = os.environ.get("GK_CHECK_DTYPES", "float32,bfloat16,float16").split(",")
    dtypes = tuple(getattr(torch, name) for name in names)

    def backward(out, leaves):
        leaves = [t for t in leaves if t is not None and t.requires_grad]
        torch.autograd.grad(out, leaves, torch.randn_like(out))

    for dtype in dtypes:
        # jagged <-> padded
        for D in (64, 128, 36):
            offsets = torch.tensor([0, 3, 3, 7])
            values = torch.randn(7, D, dtype=dtype, requires_grad=True)
            padded = gk.jagged_to_padded(values, offsets, 5)
            backward(padded, [values])
            dense = torch.randn(3, 5, D, dtype=dtype, requires_grad=True)
            backward(gk.padded_to_jagged(dense, offsets), [dense])

        # embedding bags: every pooling, optimizer and per-sample-weights path
        tables = [gk.TableSpec(50, 64), gk.TableSpec(40, 128), gk.TableSpec(30, 36)]
        none_tables = [gk.TableSpec(50, 128), gk.TableSpec(40, 128)]
        B = 3
        for pooling in ("sum", "mean", "none"):
            specs = none_tables if pooling == "none" else tables
            for opt in (None, optim.ExactSGD(lr=0.1), optim.ExactRowwiseAdagrad(lr=0.1),
                        optim.ExactAdam(lr=0.1)):
                for weighted in ((False, True) if pooling != "mean" else (False,)):
                    for index_dtype in (torch.int64, torch.int32):
                        ebc = gk.FusedEmbeddingBag(specs, pooling=pooling, dtype=dtype, optimizer=opt)
                        lengths = torch.randint(0, 4, (len(specs) * B,))
                        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(index_dtype)
                        indices = torch.randint(0, 30, (int(offsets[-1]),), dtype=index_dtype)
                        psw = torch.rand(indices.shape[0], dtype=dtype, requires_grad=True) if weighted else None
                        out = ebc(indices, offsets, per_sample_weights=psw)
                        leaves = [psw] + ([p for p in ebc.parameters()] if opt is None else [])
                        if not any(t is not None and t.requires_grad for t in leaves):
                            out.sum().backward()
                        else:
                            out.backward(torch.randn_like(out))
        gk.FusedEmbeddingBag([gk.TableSpec(20, 260)], dtype=dtype)(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))

        # jagged attention: both kinds, head dims of the bench (128) and the tests, every option
        lengths = [5, 0, 9]
        offsets = torch.tensor([0, 5, 5, 14])
        N, H, max_len = 14, 2, 9
        timestamps = torch.arange(N, dtype=torch.int64) * 1000
        for D in (128, 64, 40):
            for kind in ("softmax", "hstu"):
                for opts in (dict(), dict(causal=False),
                             dict(num_targets=torch.tensor([1, 0, 2]), contextual_len=1, max_attn_len=3),
                             dict(pos_bias=torch.randn(H, 2 * max_len - 1, dtype=dtype, requires_grad=True),
                                  time_bias=torch.randn(1, 11, dtype=dtype, requires_grad=True),
                                  timestamps=timestamps)):
                    for deterministic in (False, True):
                        q, k, v = (torch.randn(N, H, D, dtype=dtype, requires_grad=True) for _ in range(3))
                        out = gk.jagged_attention(q, k, v, offsets, max_len, kind=kind, deterministic=deterministic,
                                                  **opts)
                        backward(out, [q, k, v, opts.get("pos_bias"), opts.get("time_bias")])
        del lengths

        # interaction layers at the bench's feature counts and dims
        for F, D in ((27, 64), (27, 128), (128, 64), (256, 64), (3, 36), (127, 200)):
            x = torch.randn(2, F, D, dtype=dtype, requires_grad=True)
            for self_interaction in (False, True):
                backward(gk.dot_interaction(x, self_interaction=self_interaction), [x])
        for F, D, k in ((27, 64, 16), (128, 64, 16), (256, 64, 16), (27, 36, 4), (3, 8, 1)):
            x = torch.randn(2, F, D, dtype=dtype, requires_grad=True)
            y = torch.randn(F, k, dtype=dtype, requires_grad=True)
            w = torch.randn(F * k, dtype=dtype, requires_grad=True)
            b = torch.randn(F * k, dtype=dtype, requires_grad=True)
            backward(gk.fm_compress(x, y, w, b), [x, y, w, b])
        for F, D, O, Ofm in ((27, 64, 32, 16), (27, 128, 48, 24), (13, 200, 70, 33), (6, 256, 6, 0)):
            x = torch.randn(2, F, D, dtype=dtype, requires_grad=True)
            mix = torch.randn(O, F, dtype=dtype, requires_grad=True)
            fm = torch.randn(2, Ofm, D, dtype=dtype, requires_grad=True)
            w = torch.randn(D, dtype=dtype, requires_grad=True)
            b = torch.randn(D, dtype=dtype, requires_grad=True)
            backward(gk.feature_mix_norm(x, mix, fm, w, b), [x, mix, fm, w, b])
        for N, rank in ((64, None), (96, 16)):
            x0, xl = (torch.randn(4, N, dtype=dtype, requires_grad=True) for _ in range(2))
            bias = torch.randn(N, dtype=dtype, requires_grad=True)
            weight = (torch.randn(N, N, dtype=dtype, requires_grad=True) if rank is None else
                      (torch.randn(N, rank, dtype=dtype, requires_grad=True),
                       torch.randn(rank, N, dtype=dtype, requires_grad=True)))
            params = list(weight) if isinstance(weight, tuple) else [weight]
            backward(gk.cross_layer(x0, xl, weight, bias), [x0, xl, bias, *params])
        # the HSTU layer's projection halves at the bench's dims (D = 256, H = 4, 64 / 64), every option
        offsets = torch.tensor([0, 3, 7])
        for silu_qkv, group_norm, concat, output_bias, dropout in ((False, False, True, False, 0.0),
                                                                   (True, True, False, True, 0.3)):
            layer = gk.nn.HSTULayer(256, 4, 64, 64, silu_qkv=silu_qkv, group_norm=group_norm, concat_u=concat,
                                    concat_x=concat, output_bias=output_bias, dropout=dropout, max_seq_len=4)
            layer = layer.to(dtype)
            x = torch.randn(7, 256, dtype=dtype, requires_grad=True)
            backward(layer(x, offsets, 4), [x, *layer.parameters()])


def _describe(value):
    import torch

    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), value.data_ptr() % 16 == 0]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    if isinstance(value, float):
        return ["float", value]
    if value is None:
        return ["none", None]
    if isinstance(value, str):
        return ["str", value]
    return ["other", repr(value)]


def record(path: str) -> None:
    """Run the workload under the interpreter and write every distinct launch to `path` (JSON)."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, ROOT)
    from triton.runtime import interpreter

    import gem_kernels.triton as gk_triton

    # The interpreter-only paths (fp32 tl.dot operands) off: record what a GPU would compile.
    for name in ("attention", "embedding_bag", "interaction", "jagged"):
        module = importlib.import_module(f"{gk_triton.__name__}.{name}")
        if hasattr(module, "triton_interpret"):
            module.triton_interpret = lambda: False

    launches: dict[str, dict] = {}
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        options = {key: kwargs[key] for key in ("num_warps", "num_stages") if key in kwargs}
        params = {name: _describe(value) for name, value in zip(self.arg_names, args)}
        params.update({name: _describe(value) for name, value in kwargs.items() if name in self.arg_names})
        entry = dict(module=fn.__module__, name=fn.__name__, params=params, options=options)
        launches.setdefault(json.dumps(entry, sort_keys=True), entry)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    _workload()
    with open(path, "w") as f:
        json.dump(list(launches.values()), f)


# ---------------------------------------------------------------------------------------------
# Step 2: compile each specialisation for the GPU target
# ---------------------------------------------------------------------------------------------

def _ptxas_usage(ptxas: str, ptx: str, arch: int) -> dict[str, int]:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        proc = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    text = proc.stderr + proc.stdout
    usage = {"registers": 0, "spill_stores": 0, "spill_loads": 0, "stack": 0}
    if m := re.search(r"Used (\d+) registers", text):
        usage["registers"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text):
        usage["spill_stores"], usage["spill_loads"] = int(m.group(1)), int(m.group(2))
    if m := re.search(r"(\d+) bytes stack frame", text):
        usage["stack"] = int(m.group(1))
    return usage


def compile_one(entry: dict, arch: int) -> dict:
    """Compile one recorded specialisation for sm_<arch>; its registers, spills, shared memory, status."""
    sys.path.insert(0, ROOT)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    jit = getattr(importlib.import_module(entry["module"]), entry["name"])
    # The JIT's own specialisation of a launch: ints equal to 1 become constexprs, and pointers
    # 16-byte aligned and ints divisible by 16 get tt.divisibility = 16 (vectorised loads, less
    # address arithmetic); without them the register counts would be a different kernel's.
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(jit.params):
        kind, value, *extra = entry["params"].get(param.name, ["none", None])
        specialise = not param.do_not_specialize
        if param.is_constexpr or kind in ("none", "str") or (kind == "int" and value == 1 and specialise):
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif kind == "tensor":
            signature[param.name] = "*" + DTYPE_NAMES[value]
            if extra and extra[0]:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif kind == "bool":
            signature[param.name] = "i1"
        elif kind == "int":
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and specialise and not param.do_not_specialize_on_alignment:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif kind == "float":
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{entry['name']}: cannot type argument {param.name}={value!r}")
    dtypes = sorted({v[1:] for v in signature.values() if v.startswith("*")})
    result = dict(kernel=entry["name"], constexprs=constexprs, dtypes=dtypes, options=entry["options"])
    start = time.time()
    try:
        src = ASTSource(fn=jit, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(entry["options"]))
        result["shared"] = int(compiled.metadata.shared)
        result["num_warps"] = int(compiled.metadata.num_warps)
        result.update(_ptxas_usage(ptxas, compiled.asm["ptx"], arch))
        problems = []
        if result["spill_stores"] or result["spill_loads"]:
            problems.append(f"spills {result['spill_stores']} B stores / {result['spill_loads']} B loads")
        if result["shared"] > SHARED_LIMIT.get(arch, SHARED_LIMIT[90]):
            problems.append(f"shared memory {result['shared']} B over the sm_{arch} limit")
        result["status"] = "; ".join(problems) if problems else "ok"
    except Exception as exc:  # a compile error is the finding: report it, go on with the rest
        result["status"] = f"compile error: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
    result["seconds"] = round(time.time() - start, 2)
    return result


def compile_all(launches: list[dict], arch: int, jobs: int) -> list[dict]:
    from concurrent.futures import ProcessPoolExecutor

    results = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for result in pool.map(compile_one, launches, [arch] * len(launches)):
            results.append(result)
            print(f"{result['status'][:48]:<48} {result['kernel']} {result['dtypes']} regs={result.get('registers')} "
                  f"smem={result.get('shared')} {result['constexprs']} {result['options']}", flush=True)
    return results


def summary_markdown(results: list[dict], version: str, arch: int, dtypes: str) -> str:
    """One row per kernel: specialisations, how many fit, the worst registers/spills/shared memory."""
    rows = {}
    for r in results:
        row = rows.setdefault(r["kernel"], dict(n=0, ok=0, regs=0, spill=0, shared=0, errors=0))
        row["n"] += 1
        row["ok"] += r["status"] == "ok"
        row["errors"] += r["status"].startswith("compile error")
        row["regs"] = max(row["regs"], r.get("registers", 0))
        row["spill"] = max(row["spill"], r.get("spill_stores", 0))
        row["shared"] = max(row["shared"], r.get("shared", 0))
    lines = [f"Triton {version}, compiled for sm_{arch} without a GPU (scripts/triton_compile_check.py), "
             f"workload dtypes {dtypes}.", "",
             "| kernel | specialisations | ok | compile errors | most registers | worst spill stores (B/thread) "
             "| most shared memory (B) |", "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['n']} | {row['ok']} | {row['errors']} | {row['regs']} | {row['spill']} "
                     f"| {row['shared']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10: 90 (H100/H200), 80 (A100)")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16", help="I/O dtypes of the workload")
    parser.add_argument("--kernels", default="", help="compile only kernels whose name matches this regex")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compiles")
    parser.add_argument("--json", help="write every specialisation's result here")
    parser.add_argument("--markdown", help="write a per-kernel summary table here")
    parser.add_argument("--launches", help="keep the recorded launches in this JSON file (reused when it exists)")
    parser.add_argument("--num-warps", type=int, default=0, help="compile with this num_warps instead (to try one)")
    parser.add_argument("--record-only", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record_only:
        record(args.record_only)
        return 0

    import triton

    with tempfile.TemporaryDirectory() as tmp:
        path = args.launches or os.path.join(tmp, "launches.json")
        if not os.path.exists(path):
            env = dict(os.environ, TRITON_INTERPRET="1", GK_CHECK_DTYPES=args.dtypes)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--record-only", path], env=env, check=True)
        with open(path) as f:
            launches = [e for e in json.load(f) if re.search(args.kernels, e["name"])]
    if args.num_warps:
        launches = [dict(e, options=dict(e["options"], num_warps=args.num_warps)) for e in launches]
    print(f"triton {triton.__version__}: {len(launches)} specialisations of "
          f"{len({e['name'] for e in launches})} kernels recorded; compiling for sm_{args.arch}", flush=True)
    results = compile_all(launches, args.arch, args.jobs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, arch=args.arch, results=results), f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(summary_markdown(results, triton.__version__, args.arch, args.dtypes))
    bad = [r for r in results if r["status"] != "ok"]
    worst_regs = max((r.get("registers", 0) for r in results), default=0)
    worst_shared = max((r.get("shared", 0) for r in results), default=0)
    print(f"{len(results) - len(bad)} of {len(results)} ok; most registers {worst_regs}, most shared memory "
          f"{worst_shared} B")
    for r in bad:
        print(f"  {r['kernel']} {r['dtypes']} {r['constexprs']}: {r['status']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

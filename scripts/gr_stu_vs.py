"""gem_kernels' fused HSTU layer against generative-recommenders' own STULayer, side by side in one run.

Issue 26's GPU goal: at generative-recommenders' dlrm_v3 default shape (its configs.py: D = 512, 4 heads,
linear and attention dim 128, 5 layers, causal, target-aware; the ragged batch of its issue #530:
B = 32 users, histories of ~1024 items and 2048 candidates each, bf16), gem_kernels' forward must be
faster than GR's Triton path on the same GPU (#530 reports 9.30 ms for the 5-layer forward on an H100).

What runs: 5 (--layers) STULayers built by generative-recommenders (eval mode: no dropout), and for each
gem_kernels backend of the device the same layers through gk.nn.HSTULayer.from_generative_recommenders
(copies of the same weights). Each impl is first verified on a small batch (--verify-batch users) by
FlashAttention's rule (bench.harness.compare): its output's max error against gem_kernels' float64
reference layers must be at most twice GR's own error plus a small atol (without GR: twice the error of
gem_kernels' reference layers run in the same dtype); then the impls' forwards
(under no_grad) are timed interleaved, round-robin, --repeats rounds, on the full batch. Writes a JSON
and a Markdown table (--out) and prints them.

On a GPU GR runs its Triton kernels (HammerKernel.TRITON); on the CPU (by default `--smoke`'s small shape,
for the tests and for trying the script here; `--dlrm-v3` for the full one) its PyTorch path, which needs fbgemm_gpu's CPU ops. GR is imported
from --gr-path (default: $GENERATIVE_RECOMMENDERS_PATH, as for the tests, else .gpu_carry/generative-recommenders, where scripts/gpu_carry.sh puts
it, else an installed package). If GR cannot be imported or raises, the run says why in the JSON
("gr_error") and still verifies and times gem_kernels' layers (exit 0); a gem_kernels impl that fails
verification is not timed and the run exits 1.

    python scripts/gr_stu_vs.py --device cuda --out $OUT/gr-stu       # the goal's run (scripts/gpu_check.sh)
    python scripts/gr_stu_vs.py --smoke --gr-path /tmp/gr               # CPU, small, both sides
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gem_kernels as gk  # noqa: E402
from bench.harness import compare  # noqa: E402
from gem_kernels.reference import float64_ground_truth  # noqa: E402

# generative-recommenders' dlrm_v3 defaults (generative_recommenders/dlrm_v3/configs.py) and #530's batch.
DLRM_V3 = dict(embedding_dim=512, num_heads=4, hidden_dim=128, attention_dim=128, layers=5, batch=32, history=1024,
               candidates=2048)
SMOKE = dict(embedding_dim=32, num_heads=2, hidden_dim=8, attention_dim=8, layers=2, batch=3, history=24, candidates=5)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="a small shape, not dlrm_v3's (the default on the CPU)")
    p.add_argument("--dlrm-v3", action="store_true", help="dlrm_v3's shape on the CPU too")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="default bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="users")
    p.add_argument("--history", type=int, default=None, help="mean history length (uniform in [h/2, 3h/2])")
    p.add_argument("--candidates", type=int, default=None, help="candidates (targets) per user")
    p.add_argument("--verify-batch", type=int, default=2, help="users of the verification batch")
    p.add_argument("--repeats", type=int, default=20, help="timed rounds (each impl once a round)")
    p.add_argument("--gr-path", default=os.environ.get("GENERATIVE_RECOMMENDERS_PATH",
                                                     str(ROOT / ".gpu_carry" / "generative-recommenders")))
    p.add_argument("--out", type=Path, default=None, help="directory for gr-stu.json and gr-stu.md")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    # On the CPU the small shape unless --dlrm-v3: GR's PyTorch path pads dlrm_v3's batch to
    # [32, 4, ~4020, ~4020] scores per layer (~8 GB in fp32) and would run for a very long time.
    args.smoke = args.smoke or (args.device == "cpu" and not args.dlrm_v3)
    shape = SMOKE if args.smoke else DLRM_V3
    for key, value in shape.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key in ("embedding_dim", "num_heads", "hidden_dim", "attention_dim"):
        setattr(args, key, shape[key])
    for name in ("layers", "batch", "history", "candidates", "verify_batch", "repeats"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            p.error(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")
    if args.dtype is None:
        args.dtype = "fp32" if args.device == "cpu" else "bf16"
    return args


def import_gr(path: str):
    """(STULayer, STULayerConfig, HammerKernel) from the checkout at `path` or an installed package."""
    if os.path.isdir(os.path.join(path, "generative_recommenders")) and path not in sys.path:
        sys.path.insert(0, path)
    try:
        import fbgemm_gpu  # noqa: F401  (its CPU ops: GR's PyTorch path calls torch.ops.fbgemm.*)
    except ImportError:
        pass  # the Triton path does not need them
    from generative_recommenders.common import HammerKernel
    from generative_recommenders.modules.stu import STULayer, STULayerConfig

    return STULayer, STULayerConfig, HammerKernel


def batch(num_users: int, history: int, candidates: int, dim: int, dtype, device, gen):
    """x [N, D], seq_offsets, max_seq_len, num_targets: user b has a history of ~U[h/2, 3h/2] items then
    `candidates` targets."""
    lo, hi = max(1, history // 2), max(2, history * 3 // 2)
    hist = torch.randint(lo, hi, (num_users,), generator=gen)
    lengths = hist + candidates
    offsets = torch.zeros(num_users + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    x = torch.randn(int(offsets[-1]), dim, generator=gen).mul_(0.5)
    num_targets = torch.full((num_users,), candidates, dtype=torch.int64)
    return x.to(device=device, dtype=dtype), offsets.to(device), int(lengths.max()), num_targets.to(device)


def build_gr_layers(gr, args, dtype, device):
    STULayer, STULayerConfig, HammerKernel = gr
    layers = []
    for _ in range(args.layers):
        config = STULayerConfig(embedding_dim=args.embedding_dim, num_heads=args.num_heads, hidden_dim=args.hidden_dim,
                                attention_dim=args.attention_dim, output_dropout_ratio=0.1, causal=True,
                                target_aware=True, max_attn_len=None, attn_alpha=None, use_group_norm=False,
                                contextual_seq_len=0)
        layer = STULayer(config)
        with torch.no_grad():  # GR initialises the norms to 1 / 0 and the bias to 0: make every term count
            for p in (layer._input_norm_weight, layer._output_norm_weight):
                p.add_(0.1 * torch.randn_like(p))
            for p in (layer._input_norm_bias, layer._output_norm_bias, layer._uvqk_beta):
                p.normal_(0, 0.1)
        layer.set_hammer_kernel(HammerKernel.PYTORCH if device.type == "cpu" else HammerKernel.TRITON)
        layers.append(layer.to(device=device, dtype=dtype).eval())
    return layers


def run_gr(layers, x, offsets, max_seq_len, num_targets):
    for layer in layers:
        x = layer(x=x, x_lengths=offsets.diff(), x_offsets=offsets, max_seq_len=max_seq_len, num_targets=num_targets)
    return x


def run_gk(layers, x, offsets, max_seq_len, num_targets):
    for layer in layers:
        x = layer(x, offsets, max_seq_len, num_targets)
    return x


def gk_backends(device: torch.device) -> list[str]:
    wanted = ("triton", "cuda") if device.type == "cuda" else ("cpu",)
    return [b for b in wanted if b in gk.available_backends()]


def gk_layers(master: list, backend: str, device: torch.device, dtype) -> list:
    """Copies of the gem_kernels layers on `backend`, in the run's device and dtype."""
    layers = [copy.deepcopy(layer).to(device=device, dtype=dtype) for layer in master]
    for layer in layers:
        layer.backend = backend
    return layers


def timed_rounds(fns: dict, rounds: int, device: torch.device, times: dict[str, list[float]]) -> None:
    """Each fn once a round, round-robin; appends ms per call (CUDA events on a GPU) to times[name], so
    the rounds done so far survive an interrupt."""
    for fn in fns.values():  # warm-up (Triton compiles and autotunes here)
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(args.seed)
    result = {"shape": {k: getattr(args, k) for k in ("embedding_dim", "num_heads", "hidden_dim", "attention_dim",
                                                       "layers", "batch", "history", "candidates")},
              "dtype": args.dtype, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "gr_path": args.gr_path, "gr_error": None, "impls": {}}
    try:
        gr = import_gr(args.gr_path)
        gr_layers = build_gr_layers(gr, args, torch.float32, torch.device("cpu"))
    except Exception as exc:  # noqa: BLE001 (reported, and gem_kernels' layers still run)
        result["gr_error"] = f"import/build: {type(exc).__name__}: {exc}"
        gr, gr_layers = None, None
    if gr_layers is None:
        # Without GR, gem_kernels' layers are built with the same shapes and GR's initialisation scheme.
        gk_master = [gk.nn.HSTULayer(args.embedding_dim, args.num_heads, args.hidden_dim, args.attention_dim,
                                     causal=True, output_bias=False, target_aware=True).eval()
                     for _ in range(args.layers)]
    else:
        gk_master = [gk.nn.HSTULayer.from_generative_recommenders(layer) for layer in gr_layers]
        gr_layers = [layer.to(device=device, dtype=dtype) for layer in gr_layers]

    gen = torch.Generator().manual_seed(args.seed + 1)
    vx, voff, vmax, vnt = batch(args.verify_batch, min(args.history, 256), min(args.candidates, 64),
                                args.embedding_dim, torch.float32, torch.device("cpu"), gen)
    # The truth: gem_kernels' reference layers in float64 on the CPU (the twin of GR's maths).
    ref_layers = gk_layers(gk_master, "reference", torch.device("cpu"), torch.float64)
    with torch.no_grad(), float64_ground_truth():
        truth = run_gk(ref_layers, vx.double(), voff, vmax, vnt)
    args_dev = (vx.to(device=device, dtype=dtype), voff.to(device), vmax, vnt.to(device))
    eager = None
    if gr_layers is not None:
        try:
            with torch.no_grad():
                eager = run_gr(gr_layers, *args_dev).cpu()
            result["gr_error_vs_float64"] = float((eager.double() - truth).abs().max())
        except Exception as exc:  # noqa: BLE001
            result["gr_error"] = f"forward: {type(exc).__name__}: {exc}"
            gr_layers = None
    if eager is None:
        # No GR run: the rule's eager side is gem_kernels' reference layers in the run's dtype.
        with torch.no_grad():
            eager = run_gk(gk_layers(gk_master, "reference", device, dtype), *args_dev).cpu()
    result["rule_eager_side"] = "generative-recommenders" if gr_layers is not None else "gem_kernels reference"
    failed = False
    impls = {}
    for backend in gk_backends(device):
        layers = gk_layers(gk_master, backend, device, dtype)
        with torch.no_grad():
            out = run_gk(layers, *args_dev).cpu()
        entry = {"error_vs_float64": float((out.double() - truth).abs().max())}
        why = compare(out, eager, truth)
        entry["verified"] = why is None
        if why is not None:
            entry["failed"] = why
            failed = True
        result["impls"][f"gem_kernels {backend}"] = entry
        if entry.get("failed") is None:
            impls[f"gem_kernels {backend}"] = layers

    if args.out is not None:  # the verification so far, in case the timing is killed
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gr-stu.json").write_text(json.dumps({**result, "status": "verified; timing"}, indent=1))
    x, offsets, max_seq_len, num_targets = batch(args.batch, args.history, args.candidates, args.embedding_dim, dtype,
                                                 device, gen)
    result["tokens"] = int(offsets[-1])
    result["max_seq_len"] = max_seq_len
    fns = {}
    if gr_layers is not None:
        fns["generative-recommenders"] = lambda: run_gr(gr_layers, x, offsets, max_seq_len, num_targets)
        result["impls"]["generative-recommenders"] = {"kernel": "PYTORCH" if device.type == "cpu" else "TRITON"}
    for name, layers in impls.items():
        fns[name] = lambda layers=layers: run_gk(layers, x, offsets, max_seq_len, num_targets)
    times = {name: [] for name in fns}
    try:
        with torch.no_grad():
            timed_rounds(fns, args.repeats, device, times)
    except KeyboardInterrupt:  # gpu_check's time box (SIGINT): keep and report the rounds done so far
        result["interrupted"] = f"after {min((len(v) for v in times.values()), default=0)} full rounds"
    for name, ms in times.items():
        if not ms:
            continue
        result["impls"][name].update(ms=statistics.median(ms), ms_p10=sorted(ms)[len(ms) // 10],
                                     ms_p90=sorted(ms)[(9 * len(ms)) // 10], rounds=len(ms))
    result["status"] = "timing interrupted" if result.get("interrupted") else "done"
    gr_ms = result["impls"].get("generative-recommenders", {}).get("ms")
    for name, entry in result["impls"].items():
        if gr_ms and entry.get("ms"):
            entry["speedup_vs_gr"] = gr_ms / entry["ms"]

    lines = [f"# gem_kernels fused HSTU layers vs generative-recommenders' STULayer ({result['device']}, {args.dtype})",
             "",
             f"- shape: {result['shape']}, {result['tokens']} tokens, max_seq_len {max_seq_len}; forward, no_grad, "
             f"eval; {args.repeats} interleaved rounds",
             f"- GR: {'not run: ' + result['gr_error'] if result['gr_error'] else 'run'}"
             + (f"; timing interrupted {result['interrupted']}" if result.get("interrupted") else ""),
             "", "| impl | ms (median) | p10-p90 | speedup vs GR | max err vs float64 (verify batch) | verified |",
             "|---|---|---|---|---|---|"]
    for name, e in result["impls"].items():
        err = e.get("error_vs_float64", result.get("gr_error_vs_float64") if name == "generative-recommenders" else None)
        lines.append(f"| {name} | {e.get('ms', float('nan')):.3f} | {e.get('ms_p10', float('nan')):.3f}-"
                     f"{e.get('ms_p90', float('nan')):.3f} | "
                     f"{'%.2fx' % e['speedup_vs_gr'] if e.get('speedup_vs_gr') else '-'} | "
                     f"{'%.3g' % err if err is not None else '-'} | "
                     f"{e.get('failed') or {True: 'yes', False: 'no', None: '-'}[e.get('verified')]} |")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gr-stu.json").write_text(json.dumps(result, indent=1))
        (args.out / "gr-stu.md").write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

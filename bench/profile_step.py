"""Where one training step of the GEM-like model spends its time: torch.profiler's self CPU time of
every op, summed per phase (forward, backward, optimizer) and per category (attention kernels,
matmuls, embedding bags, interaction kernels, optimizer kernels, norms/activations/elementwise,
copies/fills/indexing, allocation, and the rest: Python, autograd and dispatch).

    python -m bench.profile_step [--config small] [--kernels fused] [--steps 10] [--warmup 3]
    python -m bench.profile_step --compare-threads 1,2      (how each op scales from 1 to 2 threads)

Ops are attributed to the phase whose record_function range encloses them; the step is model.train's
(forward, backward, every optimizer's step and zero_grad), on batches of SyntheticBatches. A profile
inflates the cheap ops' share a little (a few us per op recorded): read it for where the time goes,
and model.train for the time.

--compare-threads A,B profiles the same model at A and then B torch threads in one process (the op's
self time per step at each, and their ratio), times the step without the profiler at each, and sums
the B-thread self time of the ops that scale by less than SCALING_SPLIT: what more threads do not
shorten (Python, dispatch, small ops, serial kernels). On a host shared with other jobs a multi-thread
step measures them (OpenMP threads spin at every barrier while a partner is descheduled, see README
"On a shared CPU host"): run it where nothing else runs, or under `chrt -f 10` (SCHED_FIFO, root) so
no other process preempts the timed threads.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PHASES = ("forward", "backward", "optimizer")
# (category, substrings of the op names it takes), first match wins.
CATEGORIES = (
    ("attention kernels", ("jagged_attention",)),
    ("matmuls", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("embedding bags", ("embedding_bag",)),
    ("interaction kernels", ("fm_compress", "feature_mix_norm", "cross_layer", "dot_interaction")),
    ("optimizer kernels", ("_fused_adam", "_foreach")),
    ("norms, activations, elementwise", ("layer_norm", "silu", "threshold", "clamp_min", "relu", "aten::mul",
                                         "aten::add", "aten::sub", "aten::div", "sigmoid", "aten::sum",
                                         "aten::mean", "binary_cross", "aten::neg", "aten::exp")),
    ("copies, fills, indexing", ("copy_", "aten::cat", "clone", "aten::index", "index_put", "index_copy",
                                 "index_select", "fill_", "zero_", "repeat_interleave", "aten::gather",
                                 "aten::scatter", "narrow_copy")),
    ("allocation", ("aten::empty", "aten::zeros", "new_zeros", "new_empty", "empty_strided", "empty_like")),
)
OTHER = "Python, autograd, dispatch"
# --compare-threads: an op whose self time shrinks by less than this from A to B threads (B = 2A) counts
# as not scaling.
SCALING_SPLIT = 1.6


def category(op: str) -> str:
    for name, keys in CATEGORIES:
        if any(key in op for key in keys):
            return name
    return OTHER


def _build(config: str, kernels: str, num_batches: int):
    from model.data import SyntheticBatches
    from model.train import build, parse_args

    args = parse_args(["--config", config, "--kernels", kernels])
    cfg, model, optimizers = build(args)
    data = SyntheticBatches(cfg, cfg.batch_size, seed=args.seed)
    return model, optimizers, [data[i].to(args.device) for i in range(num_batches)]


def profile_steps(config: str = "small", kernels: str = "fused", steps: int = 10, warmup: int = 3,
                  built=None) -> dict:
    """{"step_ms": wall ms per profiled step, "phases": {phase: {"ms": .., "categories": {cat: ms},
    "ops": {op: ms}}}}: self CPU ms per step. built: (model, optimizers, batches) to reuse, from
    _build with at least warmup + steps batches."""
    model, optimizers, batches = built if built is not None else _build(config, kernels, warmup + steps)

    def step(batch) -> None:
        model.train()
        with record_function("## forward"):
            loss = model.loss(batch)
        with record_function("## backward"):
            loss.backward()
        with record_function("## optimizer"):
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        float(loss.detach())

    for batch in batches[:warmup]:
        step(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        began = time.perf_counter()
        for batch in batches[warmup:warmup + steps]:
            step(batch)
        step_ms = (time.perf_counter() - began) / steps * 1e3
    phases = {p: {"ms": 0.0, "categories": defaultdict(float), "ops": defaultdict(float)} for p in PHASES}
    for event in prof.events():
        phase, parent = None, event
        while parent is not None and phase is None:
            if parent.name.startswith("## "):
                phase = parent.name[3:]
            parent = parent.cpu_parent
        if phase is None:
            continue
        op = "(the phase's own Python)" if event.name.startswith("## ") else event.name
        ms = event.self_cpu_time_total / 1e3 / steps
        phases[phase]["ms"] += ms
        phases[phase]["categories"][OTHER if op.startswith("(") else category(op)] += ms
        phases[phase]["ops"][op] += ms
    return {"step_ms": step_ms, "threads": torch.get_num_threads(), "phases": phases}


def _unprofiled_step_ms(built, steps: int) -> float:
    """Median wall ms of `steps` training steps (model.train's train_step), no profiler."""
    from model.train import train_step

    model, optimizers, batches = built
    times = []
    for i in range(steps):
        began = time.perf_counter()
        float(train_step(model, batches[i % len(batches)], optimizers))
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def compare_threads(config: str, kernels: str, steps: int, warmup: int, threads: tuple[int, int]) -> dict:
    """The model profiled at threads[0], then threads[1] torch threads, in one process: {"threads",
    "step_ms": unprofiled median per thread count, "profiled_step_ms", "ops": {op: (ms at A, ms at B)}
    (self CPU ms per step, all phases), "not_scaling_ms": the B-thread ms of the ops whose time shrinks
    by less than SCALING_SPLIT, "scaling_ms": the rest}."""
    built = _build(config, kernels, warmup + steps)
    previous = torch.get_num_threads()
    per_threads, step_ms = [], []
    try:
        for n in threads:
            torch.set_num_threads(n)
            per_threads.append(profile_steps(config, kernels, steps, warmup, built=built))
            step_ms.append(_unprofiled_step_ms(built, max(steps, 5)))
    finally:
        torch.set_num_threads(previous)
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for k, result in enumerate(per_threads):
        for data in result["phases"].values():
            for op, ms in data["ops"].items():
                ops[op][k] += ms
    split = [0.0, 0.0]
    for a, b in ops.values():
        split[0 if b > 0 and a / b >= SCALING_SPLIT * threads[1] / (2 * threads[0]) else 1] += b
    return {"threads": threads, "step_ms": step_ms, "profiled_step_ms": [r["step_ms"] for r in per_threads],
            "ops": {op: tuple(v) for op, v in ops.items()}, "scaling_ms": split[0], "not_scaling_ms": split[1]}


def _parse_threads(text: str) -> tuple[int, int]:
    parts = text.split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 2 or min(values) < 1 or values[1] <= values[0]:
        raise argparse.ArgumentTypeError(f"--compare-threads must be two thread counts A,B with 1 <= A < B, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small")
    parser.add_argument("--kernels", choices=("fused", "eager"), default="fused")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=10, help="ops listed per phase")
    parser.add_argument("--compare-threads", type=_parse_threads, default=None, metavar="A,B",
                        help="profile at A, then B torch threads (e.g. 1,2) and list each op's scaling")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.compare_threads is not None:
        result = compare_threads(args.config, args.kernels, args.steps, args.warmup, args.compare_threads)
        a, b = result["threads"]
        print(f"{args.config} {args.kernels}: step {result['step_ms'][0]:.1f} ms at {a} threads, "
              f"{result['step_ms'][1]:.1f} ms at {b} ({result['step_ms'][0] / result['step_ms'][1]:.2f}x; "
              f"median of unprofiled steps); self CPU ms per profiled step:")
        print(f"  {'op':64s} {a:>4d} thr {b:>4d} thr  ratio")
        for op, (ma, mb) in sorted(result["ops"].items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"  {op[:64]:64s} {ma:8.2f} {mb:8.2f} {ma / mb if mb else float('nan'):6.2f}x")
        print(f"at {b} threads: {result['scaling_ms']:.1f} ms in ops that scale >= {SCALING_SPLIT}x per doubling, "
              f"{result['not_scaling_ms']:.1f} ms in the rest")
        return result
    result = profile_steps(args.config, args.kernels, args.steps, args.warmup)
    print(f"{args.config} {args.kernels}: {result['step_ms']:.1f} ms per profiled step, {result['threads']} threads, "
          f"{args.steps} steps after {args.warmup} warm-up (self CPU ms per step)")
    for phase, data in result["phases"].items():
        print(f"{phase}: {data['ms']:.1f} ms")
        for name, ms in sorted(data["categories"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:34s} {ms:8.2f} ms {100 * ms / max(data['ms'], 1e-9):5.1f}%")
        for op, ms in sorted(data["ops"].items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"      {op[:64]:64s} {ms:8.2f} ms")
    return result


if __name__ == "__main__":
    main()

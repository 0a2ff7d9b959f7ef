"""Where one training step of the GEM-like model spends its time: torch.profiler's self CPU time of
every op, summed per phase (forward, backward, optimizer) and per category (attention kernels,
matmuls, embedding bags, interaction kernels, optimizer kernels, norms/activations/elementwise,
copies/fills/indexing, allocation, and the rest: Python, autograd and dispatch).

    python -m bench.profile_step [--config small] [--kernels fused] [--steps 10] [--warmup 3]

Ops are attributed to the phase whose record_function range encloses them; the step is model.train's
(forward, backward, every optimizer's step and zero_grad), on batches of SyntheticBatches. A profile
inflates the cheap ops' share a little (a few us per op recorded): read it for where the time goes,
and model.train for the time.
"""

from __future__ import annotations

import argparse
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


def category(op: str) -> str:
    for name, keys in CATEGORIES:
        if any(key in op for key in keys):
            return name
    return OTHER


def profile_steps(config: str = "small", kernels: str = "fused", steps: int = 10, warmup: int = 3) -> dict:
    """{"step_ms": wall ms per profiled step, "phases": {phase: {"ms": .., "categories": {cat: ms},
    "ops": {op: ms}}}}: self CPU ms per step."""
    from model.data import SyntheticBatches
    from model.train import build, parse_args

    args = parse_args(["--config", config, "--kernels", kernels])
    cfg, model, optimizers = build(args)
    data = SyntheticBatches(cfg, cfg.batch_size, seed=args.seed)
    batches = [data[i].to(args.device) for i in range(warmup + steps)]

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
        for batch in batches[warmup:]:
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small")
    parser.add_argument("--kernels", choices=("fused", "eager"), default="fused")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=10, help="ops listed per phase")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
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

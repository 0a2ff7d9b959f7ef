"""Train the GEM-like model on synthetic data and report loss and throughput.

    python -m model.train --steps 50 --batch-size 256 --kernels fused --device cpu

Every step draws a fresh batch (seed = step) from the same teacher, so a falling loss is learning,
not memorising. Throughput counts the training steps only (batches are built and moved to the
device before the clock starts); the first step is a warm-up and is not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from .archs import KERNELS
from .config import INTERACTIONS, GemConfig
from .data import make_batch
from .gem import GemModel, train_step

PRESETS = {"small": GemConfig.small, "gpu": GemConfig.gpu}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--kernels", choices=KERNELS, default="fused")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", choices=sorted(PRESETS), default="small")
    parser.add_argument("--interaction", choices=INTERACTIONS, default=None,
                        help="interaction arch (default: the preset's; small: dot, gpu: wukong)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    parser.add_argument("--seed", type=int, default=0, help="parameter initialisation seed")
    parser.add_argument("--amp", choices=("none", "bf16"), default="none",
                        help="bf16: the forward under torch.autocast (fp32 parameters, bf16 products); fp16 would "
                             "also need loss scaling, which this loop does not do")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")

    device = torch.device(args.device)
    cfg = PRESETS[args.config]()
    if args.interaction is not None:
        cfg = dataclasses.replace(cfg, interaction=args.interaction)
    model = GemModel(cfg, kernels=args.kernels, seed=args.seed).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    batches = [make_batch(cfg, args.batch_size, device=device, seed=step) for step in range(args.steps)]
    print(f"config={args.config} interaction={cfg.interaction} kernels={args.kernels} amp={args.amp} device={device} "
          f"batch_size={args.batch_size} steps={args.steps} params={sum(p.numel() for p in model.parameters()):,}")

    flops = sum(model.flops_per_step(batch) for batch in batches[1:])  # outside the clock: it syncs
    losses = []
    start = None
    for step, batch in enumerate(batches):
        if step == 1:  # step 0 is the warm-up
            _synchronize(device)
            start = time.perf_counter()
        losses.append(train_step(model, batch, optimizer, autocast_dtype=torch.bfloat16 if args.amp == "bf16" else None))
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {losses[-1]:.4f}")
    _synchronize(device)

    result = {"first_loss": losses[0], "last_loss": losses[-1], "examples_per_s": None, "tflops": None}
    if start is not None:
        elapsed = time.perf_counter() - start
        timed_steps = args.steps - 1
        result["examples_per_s"] = timed_steps * args.batch_size / elapsed
        result["tflops"] = flops / elapsed / 1e12
        print(f"throughput {result['examples_per_s']:.1f} examples/s  "
              f"({elapsed / timed_steps * 1e3:.2f} ms/step, {result['tflops']:.4f} TFLOP/s model FLOPs, "
              f"{timed_steps} timed steps)")
    else:
        print("throughput: not measured (one step is the warm-up; run --steps >= 2)")
    return result


if __name__ == "__main__":
    main()

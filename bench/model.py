"""Bench of the whole GEM-like model: one training step (forward, backward, optimizer.step),
eager PyTorch arches ("eager", the baseline) against gem_kernels' fused ones ("fused").

Both models start from the same weights (same seed) and see the same rotated batches, so their
first step's losses must agree before either is timed. FLOPs from ``GemModel.flops_per_step``
(0 when the model does not define it); % of the measured matmul peak of the model's dtype (fp32).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from .harness import Case, SkipFamily, rotate

KERNELS = ("eager", "fused")


def cases(quick: bool, device: torch.device) -> Iterator[Case]:
    try:
        from model import GemConfig, GemModel, make_batch, train_step
    except Exception as exc:  # model/ is optional for the bench: skip with the reason
        raise SkipFamily(f"`import model` failed ({type(exc).__name__}: {exc})") from exc

    if device.type == "cuda":
        base, batch_size = GemConfig.gpu(), (256 if quick else 1024)
    else:
        base, batch_size = GemConfig.small(), (64 if quick else 256)
    num_sets = 2 if quick else 3
    for interaction in ("dot", "wukong"):  # DLRM's interaction arch and GEM's (a Wukong stack)
        cfg = dataclasses.replace(base, interaction=interaction)
        batches = [make_batch(cfg, batch_size, device=device, seed=seed) for seed in range(num_sets)]
        impls = {}
        flops = 0
        for kernels in KERNELS:
            model = GemModel(cfg, kernels=kernels, seed=0).to(device)  # the same initial weights for both
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            impls[kernels] = rotate([(b,) for b in batches], lambda b, m=model, o=optimizer: train_step(m, b, o))
            if not flops and hasattr(model, "flops_per_step"):
                flops = int(sum(model.flops_per_step(b) for b in batches) // len(batches))
        notes = [] if flops else ["GemModel has no flops_per_step: TFLOP/s not reported"]
        num_params = sum(p.numel() for p in model.parameters())
        yield Case(op=f"train_step ({interaction} interaction)",
                   shape=f"{'gpu' if device.type == 'cuda' else 'small'} cfg, batch={batch_size}, "
                         f"{num_params / 1e6:.2f}M params",
                   dtype=torch.float32, flops=flops, bytes=0, impls=impls, baseline="eager", peak="matmul",
                   notes=notes, reference="eager", tolerance=dict(atol=1e-4, rtol=1e-4))

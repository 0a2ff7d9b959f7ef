"""Bench of the whole GEM-like model: one training step (forward, backward, every optimizer), for the
config that fits the device (CPU: `small`; GPU: `large` in bf16).

Verification: every impl's first timed-set step is compared with eager's before timing: the loss,
the dense parameters' gradients (captured just before the dense optimizer's first step), and for
every embedding table which rows the step changed and their values (eager's TorchRec row-wise
Adagrad against the fused in-backward update). The dense parameters after the step are not compared:
Adam's first step is lr * g / (|g| + eps), about lr * sign(g), not Lipschitz in g, so a gradient near
zero whose last bit differs between reduction orders (another CPU, another thread count) flips an
element by up to 2 lr; that is how the rule failed on an AMD EPYC (7 of 32768 elements of a Wukong
fm_mlp weight off by up to 9e-4 after the step). The gradients that feed the step are compared instead.

Impls: "eager" (TorchRec's collections + RowwiseAdagrad, gem_kernels' reference backend for HSTU
and Wukong: the baseline), "fused" (gk.torchrec collections with row-wise Adagrad in the backward,
the fused jagged HSTU attention and interaction) and "fused+compile" (the fused model with every
dense arch torch.compile'd). All start from the same weights and see the same rotated batches, so
their first step's losses must agree before any is timed. FLOPs from GemModel.flops_per_step
(forward + backward, real jagged work); % of peak is the MFU against the measured matmul peak of
the training dtype, model.train's MFU formula (model.train.mfu). Per-component times (sparse, sequence, interaction, heads, backward_optimizer;
PhaseTimer, medians of a few steps run before the timed ones, on the same model put back to
its initial state afterwards) go to the notes.
"""

from __future__ import annotations

import statistics
from typing import Iterator

import torch

from .harness import Case, SkipFamily, rotate

IMPLS = ("eager", "fused", "fused+compile")


def config_for(device: torch.device):
    """(preset name, GemConfig, autocast dtype or None) of the device: CPU small fp32, GPU large bf16."""
    from model import GemConfig

    if device.type == "cuda":
        return "large", GemConfig.large(), torch.bfloat16
    return "small", GemConfig.small(), None


def cases(quick: bool, device: torch.device) -> Iterator[Case]:
    try:
        from model import GemModel, PhaseTimer, SyntheticBatches
        from model.train import mfu_by_component, train_step
    except Exception as exc:  # model/ (and torchrec) are optional for the bench: skip with the reason
        raise SkipFamily(f"`import model` failed ({type(exc).__name__}: {exc})") from exc

    name, cfg, amp = config_for(device)
    batch_size = max(cfg.batch_size // 4, 8) if quick else cfg.batch_size
    data = SyntheticBatches(cfg, batch_size, seed=0)
    batches = [data[i].to(device) for i in range(2 if quick else 3)]
    impls, notes, state = {}, [], {}
    names = IMPLS
    if device.type == "cpu":
        # Measured 2026-12-04 on the 2-core dev VM under load: inductor took 533 s to compile the
        # fused small model's arches (first step), far past the family's budget; the compiled step
        # is measured with `python -m model.train --compile` instead.
        names = tuple(n for n in IMPLS if n != "fused+compile")
        notes.append("fused+compile not run on the CPU: inductor's compile of the model (~9 min here) exceeds the "
                     "bench budget; see `python -m model.train --config small --compile`")
    for impl in names:
        kernels = "eager" if impl == "eager" else "fused"
        model = GemModel(cfg, kernels=kernels, seed=0).to(device)
        if impl == "fused+compile":
            model.compile_arches(dynamic=True)
        # The component split first (also the warm-up, and compilation), then the model is put back
        # to its initial state: every impl's timed run starts from the same weights.
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        initial_tables = {k: v for k, v in initial.items() if _is_table(k)}
        initial_fused = model.fused_optimizer_state_dict()
        optimizers, timer, split = model.make_optimizers(), PhaseTimer(device), []
        for i in range(2 if quick else 3):
            float(train_step(model, batches[i % len(batches)], optimizers, amp, timer))
            split.append(timer.read())
        medians = {phase: statistics.median(s[phase] for s in split[1:]) for phase in split[0]}
        notes.append(f"{impl} components (ms, median of {len(split) - 1} steps after one warm-up): "
                     + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
        # Each phase's own FLOPs over its own time (model.train's mfu_by_component is this / the peak).
        by_component = [model.flops_by_component(batches[i % len(batches)]) for i in range(1, len(split))]
        mean = {k: statistics.fmean(f[k] for f in by_component) for k in by_component[0]}
        rates = mfu_by_component(mean, medians, 1.0)
        notes.append(f"{impl} components TFLOP/s (own FLOPs / own time; backward_optimizer: the backward's): "
                     + ", ".join(f"{k} {v:.3g}" for k, v in rates.items() if v is not None))
        model.load_state_dict(initial)
        model.load_fused_optimizer_state_dict(initial_fused)
        del initial, initial_fused
        optimizers = model.make_optimizers()
        step = (lambda b, m=model, o=optimizers: train_step(m, b, o, amp))
        impls[impl] = rotate([(b,) for b in batches], step)
        state[impl] = _step_state(model, optimizers[0], initial_tables)
    flops = int(sum(model.flops_per_step(b) for b in batches) // len(batches))
    rows = sum(b.candidate_ids.numel() for b in batches) / len(batches)
    notes.append(f"examples/s = {batch_size} users (each with K >= 1 candidates, {rows:.0f} rows) / step time")
    yield Case(op=f"GEM train step ({cfg.interaction}, HSTU {cfg.num_hstu_layers} layers)",
               shape=f"{name} cfg, batch={batch_size} users, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params",
               dtype=amp or torch.float32, flops=flops, bytes=0, impls=impls, baseline="eager", peak="matmul",
               notes=notes, reference="eager", state=state,
               tolerance=dict(atol=2e-2 if amp else 1e-4, rtol=2e-2 if amp else 1e-3))


def _is_table(key: str) -> bool:
    return key.endswith(".weight") and (".embedding_bags." in key or ".embeddings." in key)


def _step_state(model, dense_optimizer, initial_tables: dict):
    """A reader of what the first step changed: dense gradients (a one-shot hook snapshots them
    before the dense optimizer's first step; the step zeroes them after; not the parameters after
    Adam's first step, see the module docstring), and per
    table the ids of the rows that moved and their values (state_dict keys are TorchRec's for both
    the eager and the fused collections)."""
    grads: dict = {}
    dense = {id(p) for p in model.dense_parameters()}

    def snapshot(optimizer, args, kwargs):
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if id(p) in dense and p.grad is not None})
        handle.remove()

    handle = dense_optimizer.register_step_pre_hook(snapshot)

    def read():
        current = model.state_dict()
        moved = {}
        for key, before in initial_tables.items():
            after = current[key].detach()
            rows = (after != before).reshape(after.shape[0], -1).any(1).nonzero().flatten()
            moved[key] = (rows, after[rows].clone())
        return {"dense grads": grads, "tables (moved rows, values)": moved}
    return read

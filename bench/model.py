"""Bench of the whole GEM-like model: one training step (forward, backward, every optimizer), for the
config that fits the device (CPU: `small`; GPU: `large` in bf16).

Verification: every impl's first step (on the first input set) is held to FlashAttention's rule
against the eager model's step run in float64 before timing: at most twice the eager fp32 step's
error. Compared: the loss, the dense parameters' gradients (captured just before the dense optimizer's
first step) and, after the step, the embedding tables (their first TABLE_ROWS rows: all of them on
the CPU config, the hottest ones on the GPU config, whose ids are log-uniform). Not compared: the
dense parameters after Adam's first step, lr * g / (|g| + eps) elementwise, which is not Lipschitz in
the gradient: a gradient element near zero whose rounding differs moves by up to 2 lr (measured on
the CPU under ATEN_CPU_CAPABILITY=default: 7 of 32768 elements of a Wukong MLP weight 9e-4 apart,
the failure first seen on an AMD EPYC), and it is torch's own Adam in every impl. The tables' row-wise
Adagrad (TorchRec's collection + the model's RowwiseAdagrad in eager, the fused in-backward update)
starts from WARM_MOMENTUM in every impl, so that its update is Lipschitz in the gradient too.
The ReLUs of the float64 run take the branches each impl's run took (bench/harness.py ReluBranches).

Impls: "eager" (TorchRec's collections + RowwiseAdagrad, gem_kernels' reference backend for HSTU
and Wukong: the baseline), "fused" (gk.torchrec collections with row-wise Adagrad in the backward,
the fused jagged HSTU attention and interaction) and "fused+compile" (the fused model with every
dense arch torch.compile'd). All start from the same weights and see the same rotated batches, so
their first step's losses must agree before any is timed. FLOPs from GemModel.flops_per_step
(forward + backward, real jagged work); % of peak is the MFU against the measured matmul peak of
the training dtype: model.train's MFU, by the one formula both call (gem_kernels.testing.peaks.mfu).
Per-component times (sparse, sequence, interaction, heads, backward_optimizer; PhaseTimer, medians
of a few steps run before the timed ones, on the same model put back to its initial state
afterwards) go to the notes.
"""

from __future__ import annotations

import statistics
from typing import Iterator

import torch

from .harness import Case, SkipFamily, rotate

IMPLS = ("eager", "fused", "fused+compile")
# The tables' row-wise Adagrad state at the verified step (see the docstring): (1e-5)^2, the order of
# a touched row's mean squared gradient at these configs (measured on the small one: row rms 4e-7 to
# 1e-4, median 2e-6 to 2e-5), so that the first update is still about lr per element.
WARM_MOMENTUM = 1e-10
TABLE_ROWS = 65536


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
        model.load_fused_optimizer_state_dict(_warm(initial_fused))
        if impl == "eager":
            initial_eager = initial
        del initial, initial_fused
        optimizers = model.make_optimizers()
        _warm_eager_tables(model, optimizers)
        step = (lambda b, m=model, o=optimizers: train_step(m, b, o, amp))
        impls[impl] = rotate([(b,) for b in batches], step)
        state[impl] = _step_state(model, optimizers[0])
    flops = int(sum(model.flops_per_step(b) for b in batches) // len(batches))
    rows = sum(b.candidate_ids.numel() for b in batches) / len(batches)
    notes.append(f"examples/s = {batch_size} users (each with K >= 1 candidates, {rows:.0f} rows) / step time")
    yield Case(op=f"GEM train step ({cfg.interaction}, HSTU {cfg.num_hstu_layers} layers)",
               shape=f"{name} cfg, batch={batch_size} users, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params",
               dtype=amp or torch.float32, flops=flops, bytes=0, impls=impls, baseline="eager", peak="matmul",
               notes=notes, reference="eager", state=state,
               fp64=lambda: _eager_step_fp64(cfg, initial_eager, batches[0]))


def _is_table(key: str) -> bool:
    return key.endswith(".weight") and (".embedding_bags." in key or ".embeddings." in key)


def _warm(state):
    """A copy of a fused optimizer state (nested dicts) with every row-wise Adagrad sum (a
    "momentum1" entry, whatever the nesting) at WARM_MOMENTUM."""
    if isinstance(state, dict):
        return {key: (value.clone().fill_(WARM_MOMENTUM) if torch.is_tensor(value) and "momentum1" in str(key)
                      else _warm(value)) for key, value in state.items()}
    return state


def _warm_eager_tables(model, optimizers) -> None:
    """The eager model's RowwiseAdagrad (its optimizers after the dense one) starts every table's sum
    at WARM_MOMENTUM, as the fused collections do (model/archs.py keeps it under "sum")."""
    tables = {id(p) for p in model.embedding_parameters()}
    for optimizer in optimizers[1:]:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in tables:
                    optimizer.state[p]["sum"] = torch.full((p.shape[0],), WARM_MOMENTUM, dtype=torch.float32,
                                                           device=p.device)


def _table_rows(state_dict: dict) -> dict:
    return {key: value.detach()[:TABLE_ROWS].clone() for key, value in state_dict.items() if _is_table(key)}


def _step_state(model, dense_optimizer):
    """A reader of what the first step gives: the dense gradients (a one-shot hook snapshots them
    before the dense optimizer's first step; the step zeroes them after) and the tables' first
    TABLE_ROWS rows after the step (state_dict keys are TorchRec's for both the eager and the fused
    collections)."""
    grads: dict = {}
    dense = {id(p) for p in model.dense_parameters()}

    def snapshot(optimizer, args, kwargs):
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if id(p) in dense and p.grad is not None})
        handle.remove()

    handle = dense_optimizer.register_step_pre_hook(snapshot)
    return lambda: {"dense grads": grads, "tables": _table_rows(model.state_dict())}


def _eager_step_fp64(cfg, initial: dict, batch) -> tuple:
    """The eager model's first step in float64 from ``initial`` (its state_dict) on ``batch``: (loss,
    what _step_state reads), the tables' row-wise Adagrad from WARM_MOMENTUM. A fresh model per call."""
    from model import GemModel

    from .embedding_bag import rowwise_adagrad_rows_

    device = batch.labels.device
    model = GemModel(cfg, kernels="eager", seed=0).to(device)
    model.load_state_dict(initial)
    model.double()
    batch = type(batch)(**{k: v.double() if v.is_floating_point() else v for k, v in vars(batch).items()})
    loss = model.loss(batch)
    loss.backward()
    dense = {id(p) for p in model.dense_parameters()}
    grads = {n: p.grad.detach() for n, p in model.named_parameters() if id(p) in dense and p.grad is not None}
    lr, eps = cfg.sparse_lr, model.make_optimizers()[1].defaults["eps"]
    for p in (p for p in model.embedding_parameters() if p.grad is not None):
        grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
        momentum = torch.full((p.shape[0],), WARM_MOMENTUM, dtype=torch.float64, device=device)
        rowwise_adagrad_rows_(p, momentum, torch.arange(p.shape[0], device=device), grad, lr, eps)
    return loss.detach(), {"dense grads": grads, "tables": _table_rows(model.state_dict())}

"""Train the GEM-like model on synthetic data; report loss, held-out AUC, per-component times, TFLOP/s, MFU.

    python -m model.train --config small --steps 200 --kernels fused|eager [--compile] [--amp bf16]
                          [--json PATH] [--checkpoint DIR] [--resume]

Step i trains on SyntheticBatches(config, batch_size, seed)[i] (fresh batches from one planted
teacher: a falling loss is learning); AUC per task is measured on the held-out stream.

MFU = model FLOPs of the timed steps (forward + backward, real jagged work, GemModel.flops_per_step;
      the optimizer update is not model work and is reported apart, optimizer_flops_per_step)
      / (their time x the measured dense matmul peak of the training dtype on this device; on a GPU
      in fp32, measured under the run's TF32 setting, "tf32" in the JSON). The same figure as the %
      of peak of `python -m bench model`'s rows: one formula (gem_kernels.testing.peaks.mfu), the
      same FLOPs (GemModel.flops_per_step), the median step time, and the peak measured as the
      bench's full run measures it.
mfu_vendor: the same against the datasheet's dense peak (GPU only); mfu_by_component: each phase's
FLOPs over its own time (GemModel.flops_by_component).
step_ms is the median step after the warm-up steps; per-component times are medians too.

The loop is factored for wrappers (the distributed driver wraps the model between `build` and
`train`): parse_args -> build -> train -> report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gem_kernels.testing.malloc import DEFAULT_KEEP_MIB, keep_freed_cpu_memory
from gem_kernels.testing.peaks import matmul_peak_tflops, mfu

from .archs import KERNELS
from .config import INTERACTIONS, PRESETS, GemConfig
from .data import Batch, SyntheticBatches
from .gem import PHASES, GemModel, PhaseTimer, model_flops

# Vendor dense peaks (TFLOP/s, no sparsity) of the GPUs this package is benched on, by name fragment,
# most specific first (torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA
# H100 PCIe", "NVIDIA H100 NVL"). "tfloat32": fp32 matmuls on TF32 tensor cores (allow_tf32).
# Datasheets: H100/H200 SXM, H100 PCIe, H100/H200 NVL (their sparsity figures halved), A100.
VENDOR_PEAK_TFLOPS = (
    ("H100 NVL", {"bfloat16": 835.5, "tfloat32": 417.5, "float32": 60.0}),
    ("H100 PCIe", {"bfloat16": 756.0, "tfloat32": 378.0, "float32": 51.2}),
    ("H100", {"bfloat16": 989.4, "tfloat32": 494.7, "float32": 66.9}),
    ("H200 NVL", {"bfloat16": 835.5, "tfloat32": 417.5, "float32": 60.0}),
    ("H200", {"bfloat16": 989.4, "tfloat32": 494.7, "float32": 66.9}),
    ("A100", {"bfloat16": 312.0, "tfloat32": 156.0, "float32": 19.5}),
)
CHECKPOINT_FILE = "checkpoint.pt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m model.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(PRESETS), default="small")
    parser.add_argument("--steps", type=int, default=200, help="total optimizer steps (a resumed run continues to it)")
    parser.add_argument("--kernels", choices=KERNELS, default="fused")
    parser.add_argument("--batch-size", type=int, default=None, help="users per batch (default: the preset's)")
    parser.add_argument("--interaction", choices=INTERACTIONS, default=None, help="default: the preset's (wukong)")
    parser.add_argument("--no-sequence", action="store_true", help="drop the sequence arch (the baseline it must beat)")
    parser.add_argument("--hashed-ids", action="store_true",
                        help="categorical features as raw 64-bit ids with drift, through zero-collision hashed tables")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile every dense arch")
    parser.add_argument("--amp", choices=("none", "bf16"), default="none",
                        help="bf16: the forward under torch.autocast (fp32 parameters and optimizer state)")
    parser.add_argument("--seed", type=int, default=0, help="parameter and data seed")
    parser.add_argument("--warmup", type=int, default=None, help="steps not timed (default: min(5, steps // 4))")
    parser.add_argument("--eval-every", type=int, default=0, help="held-out AUC every N steps (0: at the end only)")
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches per AUC")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--checkpoint", type=Path, default=None, help="directory: save model + optimizers at the end")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="also save every N steps")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    parser.add_argument("--malloc-keep-mib", type=int, default=DEFAULT_KEEP_MIB, metavar="MIB",
                        help="CPU, glibc: keep up to MIB of freed heap mapped for reuse instead of returning it to the "
                             "OS, so a step's activations do not fault their pages in again every step "
                             f"(gem_kernels.testing.malloc); 0 keeps glibc's defaults (default {DEFAULT_KEEP_MIB}, "
                             "as python -m bench)")
    parser.add_argument("--distributed", action="store_true",
                        help="under torchrun: TorchRec DMP, tables sharded by the gem_kernels sharders, the rest "
                             "data-parallel; gloo on CPU, NCCL on GPU (model/distributed.py)")
    parser.add_argument("--plan", choices=("table_wise", "column_wise", "auto"), default="auto",
                        help="--distributed: how the tables are placed (auto: TorchRec's planner)")
    args = parser.parse_args(argv)
    for name in ("steps", "eval_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    for name in ("eval_every", "checkpoint_every", "warmup", "malloc_keep_mib"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not 0 <= args.seed < 2**63:  # torch's generators take 64 bits; the data generator wants >= 0
        parser.error(f"--seed must be an int in [0, 2**63), got {args.seed}")
    if args.resume and args.checkpoint is None:
        parser.error("--resume needs --checkpoint DIR")
    if args.hashed_ids and args.distributed and args.plan == "column_wise":
        parser.error("--hashed-ids with --distributed: the hashed tables shard table-wise only (--plan table_wise or "
                     "auto), got --plan column_wise")
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device {args.device!r} is not a device: {error}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda[:N] (the model trains on real data), got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device!r}: CUDA is not available here")
    # Found out before the run, not after it: an output that cannot be written.
    if args.json is not None:
        problem = _unwritable(args.json, directory=False)
        if problem:
            parser.error(f"--json {args.json}: {problem}")
    if args.checkpoint is not None:
        problem = _unwritable(args.checkpoint, directory=True)
        if problem is None and (args.checkpoint / CHECKPOINT_FILE).is_dir():
            problem = f"{args.checkpoint / CHECKPOINT_FILE} is a directory, not a checkpoint file"
        if problem:
            parser.error(f"--checkpoint {args.checkpoint}: {problem}")
    return args


def _unwritable(path: Path, directory: bool) -> str | None:
    """Why ``path`` (a file, or a directory when ``directory``) cannot be written, or None. Creates
    the missing parent directories (the run would create them anyway). Writes a probe file: root
    passes every os.access check, yet cannot create a file in /proc or on a read-only mount."""
    folder = path if directory else path.parent
    if path.exists() and path.is_dir() != directory:
        return f"is {'a file' if directory else 'a directory'}, not {'a directory' if directory else 'a file'}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot create the directory {folder}: {error.strerror or error}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=folder)
        os.close(fd)
        os.unlink(probe)
        if not directory and path.exists():
            open(path, "a").close()  # appends nothing: the results overwrite it at the end
    except OSError as error:
        return f"is not writable ({error.strerror or error})"
    return None


def config_from_args(args: argparse.Namespace) -> GemConfig:
    cfg = PRESETS[args.config]()
    changes = {}
    if args.interaction is not None:
        changes["interaction"] = args.interaction
    if args.no_sequence:
        changes["use_sequence"] = False
    if args.batch_size is not None:
        changes["batch_size"] = args.batch_size
    if args.hashed_ids:
        changes["hashed_ids"] = True
    return dataclasses.replace(cfg, **changes) if changes else cfg


def build(args: argparse.Namespace) -> tuple[GemConfig, GemModel, list[torch.optim.Optimizer]]:
    """The model on its device and its optimizers (the hook where a distributed driver wraps the model)."""
    cfg = config_from_args(args)
    model = GemModel(cfg, kernels=args.kernels, seed=args.seed).to(args.device)
    optimizers = model.make_optimizers()
    if args.compile:
        model.compile_arches(dynamic=True)
    return cfg, model, optimizers


def train_step(model: GemModel, batch: Batch, optimizers: list[torch.optim.Optimizer],
               amp_dtype: torch.dtype | None = None, timer: PhaseTimer | None = None) -> torch.Tensor:
    """One step: forward (under autocast when amp_dtype), backward, every optimizer's step.
    Returns the loss as a detached device tensor (no host sync here)."""
    if not model.training:
        # Only when it is not in training mode already: Module.train() walks every submodule (~0.1 ms
        # a step here, 52 modules), and it would undo a submodule a user put in eval mode on purpose.
        model.train()
    if timer is not None:
        timer.start()
    device_type = batch.labels.device.type
    with torch.autocast(device_type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
        loss = model.loss(batch, timer)
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if timer is not None:
        timer.mark("backward_optimizer")
    return loss.detach()


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties averaged); nan when one class is absent."""
    scores, labels = scores.double().cpu(), labels.bool().cpu()
    num_pos = int(labels.sum())
    num_neg = labels.numel() - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    order = scores.argsort()
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # Average the ranks of tied scores.
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = (ends - (counts.double() - 1) / 2)[inverse]
    ranks[order] = mean_rank
    return float((ranks[labels].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


@torch.no_grad()
def evaluate(model: GemModel, batches: list[Batch], amp_dtype: torch.dtype | None = None) -> dict[str, float]:
    """Held-out AUC per task (model.cfg.task_names)."""
    model.eval()
    logits, labels = [], []
    for batch in batches:
        with torch.autocast(batch.labels.device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            logits.append(model(batch).float())
        labels.append(batch.labels)
    logits, labels = torch.cat(logits), torch.cat(labels)
    return {task: auc(logits[:, k], labels[:, k]) for k, task in enumerate(model.cfg.task_names)}


def save_checkpoint(directory: Path, model: GemModel, optimizers: list[torch.optim.Optimizer], step: int,
                    losses: list[float]) -> Path:
    """model.state_dict(), the fused collections' in-backward optimizer state, every (dense, eager
    sparse) optimizer's state_dict, the next step and the losses so far."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_FILE
    torch.save({"step": step, "kernels": model.kernels, "config": dataclasses.asdict(model.cfg),
                "model": model.state_dict(), "fused_optimizers": model.fused_optimizer_state_dict(),
                "optimizers": [o.state_dict() for o in optimizers],
                "losses": losses}, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return path


def has_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a published checkpoint (--resume starts fresh when not)."""
    return (directory / CHECKPOINT_FILE).is_file()


def check_checkpoint_config(directory: Path, kernels: str, config: dict, saved_kernels, saved_config) -> None:
    """A ValueError naming every field in which the checkpoint's run differs from this one."""
    if not isinstance(saved_config, dict):
        raise ValueError(f"cannot read checkpoint {directory}: its config is {type(saved_config).__name__}, not a dict")
    differ = [f"{k}: checkpoint {saved_config.get(k)!r}, this run {config.get(k)!r}"
              for k in sorted(set(config) | set(saved_config)) if saved_config.get(k) != config.get(k)]
    if saved_kernels != kernels:
        differ.insert(0, f"kernels: checkpoint {saved_kernels!r}, this run {kernels!r}")
    if differ:
        raise ValueError(f"checkpoint {directory} is of another run; it differs in " + "; ".join(differ))


def load_checkpoint(directory: Path, model: GemModel, optimizers: list[torch.optim.Optimizer]) -> tuple[int, list[float]]:
    """Restores model and optimizers in place; returns (next step, losses so far)."""
    path = directory / CHECKPOINT_FILE
    try:
        state = torch.load(path, map_location=next(model.parameters()).device, weights_only=False)
        if not isinstance(state, dict) or not {"step", "kernels", "config", "model", "optimizers"} <= state.keys():
            raise ValueError(f"not a model.train checkpoint (a {type(state).__name__} "
                             f"{sorted(state) if isinstance(state, dict) else ''})")
    except Exception as error:  # pickle, zip and torch errors alike: say which file could not be read
        raise ValueError(f"cannot read checkpoint {path}: {type(error).__name__}: {error}") from error
    check_checkpoint_config(directory, model.kernels, dataclasses.asdict(model.cfg), state["kernels"], state["config"])
    model.load_state_dict(state["model"])
    model.load_fused_optimizer_state_dict(state["fused_optimizers"])
    if len(state["optimizers"]) != len(optimizers):
        raise ValueError(f"checkpoint has {len(state['optimizers'])} optimizers, this model {len(optimizers)}")
    for optimizer, optimizer_state in zip(optimizers, state["optimizers"]):
        optimizer.load_state_dict(optimizer_state)
    return state["step"], list(state["losses"])


def tf32_enabled(device: torch.device) -> bool | None:
    """Whether this process's fp32 matmuls run on TF32 tensor cores (None off a GPU): the fp32 peak
    is measured, and the vendor peak chosen, under the same setting as the training."""
    return bool(torch.backends.cuda.matmul.allow_tf32) if device.type == "cuda" else None


def measured_peak(device: torch.device, dtype: torch.dtype) -> float:
    """The MFU's roof: the matmul peak as `python -m bench` measures it in a full run (not --quick), so
    that this MFU and the bench's model row (its % of peak) divide by the same measurement."""
    return matmul_peak_tflops(dtype, device, quick=False)


# Reads of the peak model.train makes at most (peak_at_least).
PEAK_READS = 3


def peak_at_least(device: torch.device, dtype: torch.dtype, rate_tflops: float | None) -> tuple[float, list[float]]:
    """(the peak, every read of it): measured_peak, read again (up to PEAK_READS reads, the best kept)
    while the best read is below ``rate_tflops``, the rate the training step itself reached. A
    peak below what the model's own step did is a read taken while something else held the cores
    (seen on a busy 2-core VM: a 2048^3 matmul read 0.001 TFLOP/s, which printed an MFU of 185 %),
    so a quiet moment's read replaces it; an MFU still above 100 % after the last read is printed
    with a warning (main)."""
    reads = [measured_peak(device, dtype)]
    while rate_tflops is not None and max(reads) < rate_tflops and len(reads) < PEAK_READS:
        reads.append(measured_peak(device, dtype))
    return max(reads), reads


def vendor_peak(device: torch.device, dtype: torch.dtype, device_name: str | None = None) -> float | None:
    """The datasheet's dense peak of `dtype` on this GPU (fp32 under TF32 when tf32_enabled); None off
    a GPU or for a GPU not in VENDOR_PEAK_TFLOPS."""
    if device.type != "cuda":
        return None
    name = device_name if device_name is not None else torch.cuda.get_device_name(device)
    key = "bfloat16" if dtype == torch.bfloat16 else "tfloat32" if tf32_enabled(device) else "float32"
    for fragment, peaks in VENDOR_PEAK_TFLOPS:
        if fragment in name:
            return peaks[key]
    return None


class CheckpointStore:
    """model.train's single-process checkpoints (``--checkpoint DIR``: DIR/checkpoint.pt, written to
    a temporary file and renamed into place). The distributed driver passes its own (DCP) store
    with the same three methods."""

    def __init__(self, directory: Path, model: GemModel, optimizers: list[torch.optim.Optimizer]):
        self.directory, self.model, self.optimizers = directory, model, optimizers

    def exists(self) -> bool:
        return has_checkpoint(self.directory)

    def load(self) -> tuple[int, list[float]]:
        return load_checkpoint(self.directory, self.model, self.optimizers)

    def save(self, step: int, losses: list[float]) -> None:
        save_checkpoint(self.directory, self.model, self.optimizers, step, losses)


def mfu_by_component(flops: dict[str, float], components_ms: dict[str, float | None],
                     peak_tflops: float) -> dict[str, float | None]:
    """Each phase's FLOPs (GemModel.flops_by_component: the phase "backward_optimizer" does the
    "backward" FLOPs, its optimizer update is not model work) over the phase's own time."""
    out = {}
    for phase, ms in components_ms.items():
        work = flops.get("backward" if phase == "backward_optimizer" else phase, 0)
        out[phase] = mfu(work, ms, peak_tflops) if ms else None
    return out


def train(args: argparse.Namespace, model: GemModel, optimizers: list[torch.optim.Optimizer],
          data: SyntheticBatches, store: CheckpointStore | None = None) -> dict:
    """The loop: steps [start, args.steps), timed after the warm-up; held-out AUC; checkpoints
    (``store``, default: --checkpoint's CheckpointStore)."""
    device = torch.device(args.device)
    amp_dtype = torch.bfloat16 if args.amp == "bf16" else None
    if store is None and args.checkpoint is not None:
        store = CheckpointStore(args.checkpoint, model, optimizers)
    start, losses = 0, []
    if args.resume and store.exists():  # nothing to resume: start fresh (torchrun restarts pass --resume every time)
        start, losses = store.load()
        if start > args.steps:
            raise ValueError(f"--steps {args.steps} is below the checkpoint's step {start} ({args.checkpoint}); "
                             f"resuming would rewind it: pass --steps >= {start}")
        print(f"resumed from {args.checkpoint} at step {start}", file=sys.stderr, flush=True)
    warmup = min(5, args.steps // 4) if args.warmup is None else args.warmup
    held_out = [data.held_out(i).to(device) for i in range(args.eval_batches)]
    timer = PhaseTimer(device)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    step_ms, components, flops, auc_history = [], {p: [] for p in PHASES}, [], []
    try:
        from tqdm import tqdm
        bar = tqdm(range(start, args.steps), disable=args.no_progress, desc=f"{args.kernels}", unit="step",
                   file=sys.stderr, initial=start, total=args.steps)
    except ImportError:
        bar = range(start, args.steps)
    next_batch = data[start].to(device) if start < args.steps else None
    for step in bar:
        batch = next_batch
        timed = step - start >= warmup
        if timed:
            flops.append(model.flops_by_component(batch))  # before the clock: counts sync on a GPU
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        loss = train_step(model, batch, optimizers, amp_dtype, timer)
        loss_value = float(loss)  # the step's one host sync
        elapsed_ms = (time.perf_counter() - began) * 1e3
        if step + 1 < args.steps:
            next_batch = data[step + 1].to(device)
        losses.append(loss_value)
        if timed:
            step_ms.append(elapsed_ms)
            for phase, ms in timer.read().items():
                components[phase].append(ms)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss_value:.4f}", ex_s=f"{data.batch_size / elapsed_ms * 1e3:.0f}")
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            auc_history.append({"step": step + 1, **evaluate(model, held_out, amp_dtype)})
            print(f"step {step + 1}: held-out AUC " + ", ".join(f"{task} {auc_history[-1][task]:.4f}"
                                                              for task in model.cfg.task_names), file=sys.stderr)
        if store is not None and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            store.save(step + 1, losses)
    if store is not None:
        store.save(args.steps, losses)
    final_auc = evaluate(model, held_out, amp_dtype)
    return dict(losses=losses, step_ms=step_ms, components=components, flops=flops, auc=final_auc,
                auc_history=auc_history,
                loadavg_1min={"start": load_start, "end": os.getloadavg()[0] if load_start is not None else None})


def cpu_contention_warning(threads: int, load: float, cores: int | None, wait_policy: str | None) -> str | None:
    """A warning when other processes' load (the 1-minute average ``load``, taken before this run adds
    its own) leaves fewer idle cores than the ``threads`` torch runs, and OpenMP threads spin-wait
    (``wait_policy``: OMP_WAIT_POLICY, unset or ACTIVE). Torch's parallel regions are OpenMP (libgomp):
    a thread that reaches a region's barrier first spins while the other one waits for a core, and a
    step holds hundreds of regions. None when there is nothing to warn about."""
    if not cores or threads <= 1 or load + threads <= cores + 0.5:
        return None
    if wait_policy is not None and wait_policy.strip().upper() == "PASSIVE":
        return None
    return (f"warning: the 1-minute load average is {load:.1f} on {cores} cores and this run uses {threads} "
            f"threads: with OpenMP's spin-waits at every parallel region's barrier, a busy host makes steps several "
            f"times slower (measured on a 2-core VM at 2 threads beside one busy process: 2-14x, and slower than "
            f"1 thread). Use as many threads as there are idle cores (OMP_NUM_THREADS). OMP_WAIT_POLICY=PASSIVE, "
            f"set before python starts, kept that run at 1.2x one thread's time, but cost 1.35x on the quiet "
            f"host (bench/results/omp-wait-20261207T002709Z)")


def report(args: argparse.Namespace, cfg: GemConfig, model: GemModel, run: dict) -> dict:
    """The result dict (--json): the exact top-level names the issue fixes, plus details."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.amp == "bf16" else torch.float32
    step_ms = statistics.median(run["step_ms"]) if run["step_ms"] else None
    by_component = ({k: statistics.fmean(f[k] for f in run["flops"]) for k in run["flops"][0]}
                    if run["flops"] else {})
    mean_flops = model_flops(by_component) if by_component else None
    tflops = mean_flops / (step_ms / 1e3) / 1e12 if step_ms else None
    peak, peak_reads = peak_at_least(device, dtype, tflops)
    vendor = vendor_peak(device, dtype)
    components_ms = {p: statistics.median(v) if v else None for p, v in run["components"].items()}
    result = {
        "config": args.config,
        "kernels": args.kernels,
        "steps": args.steps,
        "step_ms": step_ms,
        "examples_per_s": cfg.batch_size / (step_ms / 1e3) if step_ms else None,
        "tflops": tflops,
        "peak_tflops": peak,
        # Every read of the peak (PEAK_READS at most): more than one when a read came out below the
        # step's own rate, which a real peak cannot be (peak_at_least).
        "peak_tflops_reads": peak_reads,
        "mfu": mfu(mean_flops, step_ms, peak) if step_ms else None,
        "auc": run["auc"],
        "components_ms": components_ms,
        "mfu_by_component": mfu_by_component(by_component, components_ms, peak) if step_ms else None,
        "loss_first": run["losses"][0] if run["losses"] else None,
        "loss_last": run["losses"][-1] if run["losses"] else None,
        # Details beyond the fixed names.
        "batch_size": cfg.batch_size,
        "timed_steps": len(run["step_ms"]),
        "flops_per_step": mean_flops,
        "flops_by_component": by_component or None,
        "optimizer_flops_per_step": by_component.get("optimizer"),
        "tf32": tf32_enabled(device),
        "dtype": "bfloat16" if args.amp == "bf16" else "float32",
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        # The host's 1-minute load average before and after the loop (another process's load shows here,
        # and OpenMP's spin-waits make a busy host's steps far slower: cpu_contention_warning).
        "loadavg_1min": run.get("loadavg_1min"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "malloc_keep_mib": args.malloc_keep_mib if getattr(args, "malloc_kept", False) else 0,
        "compile": args.compile,
        "use_sequence": cfg.use_sequence,
        "interaction": cfg.interaction,
        "vendor_peak_tflops": vendor,
        "mfu_vendor": mfu(mean_flops, step_ms, vendor) if step_ms and vendor else None,
        "auc_history": run["auc_history"],
        "losses": run["losses"],
        "mfu_formula": "model FLOPs per step (fwd+bwd, jagged; no optimizer update) / (median step time x measured "
                       "matmul peak of dtype, fp32 under TF32 when tf32)",
    }
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.malloc_kept = keep_freed_cpu_memory(args.malloc_keep_mib)
    if args.distributed:
        from .distributed import main as distributed_main

        result = distributed_main(args, config_from_args, train, report)
        if result is None:  # ranks other than 0 report nothing
            return None
    else:
        cfg, model, optimizers = build(args)
        data = SyntheticBatches(cfg, cfg.batch_size, seed=args.seed)
        if torch.device(args.device).type == "cpu" and hasattr(os, "getloadavg"):
            warning = cpu_contention_warning(torch.get_num_threads(), os.getloadavg()[0], os.cpu_count(),
                                             os.environ.get("OMP_WAIT_POLICY"))
            if warning:
                print(warning, file=sys.stderr, flush=True)
        print(f"config={args.config} kernels={args.kernels} interaction={cfg.interaction} amp={args.amp} "
              f"compile={args.compile} device={args.device} batch_size={cfg.batch_size} steps={args.steps} "
              f"params={sum(p.numel() for p in model.parameters()):,}", flush=True)
        run = train(args, model, optimizers, data)
        result = report(args, cfg, model, run)
    comps = ", ".join(f"{k} {v:.2f}" for k, v in result["components_ms"].items() if v is not None)
    print(f"loss {result['loss_first']:.4f} -> {result['loss_last']:.4f}; held-out AUC "
          + ", ".join(f"{k} {v:.4f}" for k, v in result["auc"].items()))
    if result["step_ms"] is not None:
        print(f"step {result['step_ms']:.2f} ms (median of {result['timed_steps']}): {comps}; "
              f"{result['examples_per_s']:.1f} examples/s; {result['tflops']:.4f} TFLOP/s; "
              f"MFU {100 * result['mfu']:.2f}% of {result['peak_tflops']:.3f} TFLOP/s ({result['dtype']} matmul"
              + (", TF32 on" if result["tf32"] else ", TF32 off" if result["tf32"] is False else "") + ")"
              + (f", mfu_vendor {100 * result['mfu_vendor']:.2f}% of {result['vendor_peak_tflops']:.1f} TFLOP/s"
                 if result["mfu_vendor"] is not None else ""))
        if result["mfu"] > 1:
            print(f"warning: MFU above 100 %: every read of the {result['dtype']} matmul peak "
                  f"({', '.join(f'{r:.3f}' for r in result['peak_tflops_reads'])} TFLOP/s) came out below the "
                  f"step's own {result['tflops']:.4f} TFLOP/s, so the host was busy while the peak was measured; "
                  "rerun on a quiet host for a meaningful MFU", file=sys.stderr)
        print("MFU by component: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in result["mfu_by_component"].items()
                                               if v is not None))
    else:
        print("throughput: not measured (every step was a warm-up step)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

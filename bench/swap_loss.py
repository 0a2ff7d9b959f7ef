"""Loss curves of ``gk.swap`` on TorchRec's DLRM (bench/swap.py's model, tables and batches): the
swapped impls trained side by side with the TorchRec baselines.

Loss curves (not part of the timed family: 100 steps take minutes on a CPU):

    python -m bench.swap_loss --loss-steps 100 [--lr 0.01] [--quick] [--out DIR] [--device cpu|cuda]

trains every impl of LOSS_BASELINES from the same weights on the same fresh batches, with no time
cap, and writes ``swap-loss-<device>.json`` and ``.md`` (per-step losses, and per impl its step-1
difference, max per-step |diff| and tail-mean difference vs its baseline, and a verdict). The
batches are RandomRecDataset's ids and dense features with labels from a planted teacher
(``teacher_labels``): a fixed random score per id of the tables TEACHER_TABLES, summed over each
bag, so the labels can be learnt, and only by training those tables (RandomRecDataset's own labels
are coin flips: every curve goes to ln 2, tables trained or not, and the rule below could not fail).
The impls and the baseline each is held to (the same update rule):
  swap_none     gk.swap(model) + torch.optim.Adagrad on every parameter  vs torchrec_adagrad;
  swap_rowwise  gk.swap(model, optimizer=ExactRowwiseAdagrad) + Adagrad on the dense parameters
                vs torchrec_rowwise (TorchRec's RowWiseAdagrad on the tables, Adagrad on the rest);
  frozen_tables the negative control: gk.swap(model), Adagrad on the dense parameters only, the
                tables never move; vs torchrec_adagrad, and it must FAIL the rule.
The rule an impl must pass:
  1. step 1 equal to fp32 rounding: |loss_1 - baseline_1| <= STEP1_RTOL * |baseline_1|. Step 1 runs
     on the initial weights for every impl, so it compares the forward alone; the fused ops sum in
     another order than torch's, nothing else differs;
  2. every loss finite (no divergence);
  3. the curve within noise: over the last TAIL_FRACTION of the steps, |mean(impl) - mean(baseline)|
     <= 2 SE, SE = sqrt(var(impl tail) / n + var(baseline tail) / n): what the batch-to-batch noise of
     n steps alone moves a tail mean by.
The run passes (exit 0) when every impl passes and the control fails. The rule, not per-step
equality: per-step equality to 1e-4 over 100 steps is not a property of two correct fp32
implementations under Adagrad. Adagrad's first step, lr * g / (|g| + eps), does not scale with |g|:
a relative rounding error r of g becomes an absolute error of about lr * r in the parameter. The
fused embedding backward sums each row's contributions in another order than torch's, and where they
nearly cancel (|g| << its terms) r is large. Measured at full size on random labels, lr 0.01, after
step 1 (whose loss and dense gradients are bit-equal): 3.3M of 54M elements differ, those with
|g| >= 1e-7 by at most 1.5e-8 (the weights' rounding), those with |g| < 1e-9 by up to 3.6e-4
(0.04 lr). The trajectories then separate: the first element off by more than lr / 2 appears at
step 4, hundreds by step 12, and the per-step loss difference grows to ~1e-3, within the noise of
the tail means.
"""

from __future__ import annotations

import copy
import time

import torch

import gem_kernels as gk

from .harness import log
from .swap import BATCH, CRITEO_ROWS, DIM, EPS, IDS_PER_FEATURE, LR, ROW_CAP, _dataset, _dlrm, _step, _swapped

# Loss-curve rule (see the module docstring).
STEP1_RTOL = 1e-5  # fp32 forward in another summation order; measured ~1e-7
TAIL_FRACTION = 0.2
# impl -> the baseline with its update rule (see the docstring); frozen_tables is the negative control.
LOSS_BASELINES = {"swap_none": "torchrec_adagrad", "swap_rowwise": "torchrec_rowwise",
                  "frozen_tables": "torchrec_adagrad"}
NEGATIVE_CONTROL = "frozen_tables"
# The planted teacher of the loss curves: the tables of 100 to 1,000 rows (105, 305, 583, 633): more
# rows than D, so that frozen random embeddings cannot represent a per-id score, and few enough that
# B x 20 lookups per step visit each row often (each is learnt in tens of steps at lr 0.01).
TEACHER_TABLES = tuple(t for t, rows in enumerate(CRITEO_ROWS) if 100 <= rows <= 1000)
TEACHER_SCALE = 5.0  # logit = 5 z, z ~ N(0, 1): P(label = 1) mostly far from 1/2
TEACHER_SEED = 1234


def _param_diff(model, base, lr: float) -> dict:
    """How far ``model``'s parameters are from ``base``'s (same state_dict keys): the max |diff|, how
    many elements differ, and how many by more than lr / 2 (an Adagrad step taken with the other sign)."""
    got, want = model.state_dict(), base.state_dict()
    max_diff, differing, flipped, total = 0.0, 0, 0, 0
    for key, w in want.items():
        if not (torch.is_tensor(w) and w.is_floating_point() and key in got):
            continue
        d = (got[key].detach().float() - w.detach().float()).abs()
        max_diff = max(max_diff, float(d.max()) if d.numel() else 0.0)
        differing += int((d > 0).sum())
        flipped += int((d > lr / 2).sum())
        total += d.numel()
    return dict(max_abs_diff=max_diff, elements_differing=differing, elements_off_by_more_than_half_lr=flipped,
                elements=total)


def _curve_stats(curve: list[float], base: list[float]) -> dict:
    c, b = torch.tensor(curve, dtype=torch.float64), torch.tensor(base, dtype=torch.float64)
    diff = (c - b).abs()
    steps = len(curve)
    n = max(2, round(steps * TAIL_FRACTION))
    tail_c, tail_b = c[-n:], b[-n:]
    tail_diff = float(tail_c.mean() - tail_b.mean())
    se = float((tail_c.var() / n + tail_b.var() / n).sqrt()) if steps >= 2 else 0.0
    step1 = float(diff[0])
    checks = {
        "step1_equal_to_fp32_rounding": step1 <= STEP1_RTOL * abs(base[0]),
        "finite": bool(c.isfinite().all()),
        "tail_within_noise": abs(tail_diff) <= 2 * se,
    }
    marks = sorted({s for s in (1, 2, 3, 5, 10, 20, 50, 100, steps) if s <= steps})
    return dict(step1_abs_diff=step1, step1_bound=STEP1_RTOL * abs(base[0]), max_abs_diff=float(diff.max()),
                max_abs_diff_step=int(diff.argmax()) + 1, diff_at_steps={s: float(diff[s - 1]) for s in marks},
                tail_steps=n, tail_mean=float(tail_c.mean()), tail_mean_diff=tail_diff, tail_se=se,
                checks=checks, verdict="pass" if all(checks.values()) else "FAIL")


class Teacher:
    """Labels with a learnable signal for RandomRecDataset's batches: per table of TEACHER_TABLES a
    fixed score u_t[id] ~ N(0, 1) of every id; z = sum over those tables and over the bag of
    u_t[id], scaled to unit variance; label ~ Bernoulli(sigmoid(TEACHER_SCALE * z)). Deterministic:
    the scores and the label draws come from their own seeded generators."""

    def __init__(self, quick: bool):
        g = torch.Generator().manual_seed(TEACHER_SEED)
        self.scores = {t: torch.randn(min(CRITEO_ROWS[t], ROW_CAP[quick]), generator=g) for t in TEACHER_TABLES}
        self.draws = torch.Generator().manual_seed(TEACHER_SEED + 1)

    def __call__(self, batch):
        features = batch.sparse_features.to_dict()
        size = batch.dense_features.shape[0]
        z = torch.zeros(size)
        for t, scores in self.scores.items():
            bags = features[f"f{t}"]
            owner = torch.repeat_interleave(torch.arange(size), bags.lengths().long())
            z.index_add_(0, owner, scores[bags.values().cpu()])
        z /= (IDS_PER_FEATURE * len(self.scores)) ** 0.5
        labels = torch.bernoulli(torch.sigmoid(TEACHER_SCALE * z), generator=self.draws)
        return type(batch)(dense_features=batch.dense_features, sparse_features=batch.sparse_features,
                           labels=labels.to(batch.labels.dtype).to(batch.labels.device))


def _loss_models(quick: bool, device: torch.device, lr: float) -> tuple[dict, dict, dict]:
    """(name -> (model, optimizers), name -> what gk.swap replaced, name -> its optimizers in words):
    the impls of the loss curves, copies of one set of untrained weights."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    base = _dlrm(quick, device)
    rowwise = copy.deepcopy(base)
    tables = [p for n, p in rowwise.named_parameters() if n.startswith("sparse_arch.")]
    dense = [p for n, p in rowwise.named_parameters() if not n.startswith("sparse_arch.")]
    models = {"torchrec_adagrad": (base, [torch.optim.Adagrad(base.parameters(), lr=lr)]),
              "torchrec_rowwise": (rowwise, [torch.optim.Adagrad(dense, lr=lr), RowWiseAdagrad(tables, lr=lr, eps=EPS)])}
    words = {"torchrec_adagrad": f"torch.optim.Adagrad(lr={lr}) on every parameter",
             "torchrec_rowwise": f"TorchRec's RowWiseAdagrad(lr={lr}, eps={EPS}) on the tables, "
                                 f"torch.optim.Adagrad(lr={lr}) on the rest",
             "swap_rowwise": f"gk.optim.ExactRowwiseAdagrad(lr={lr}, eps={EPS}) in the backward (tables), "
                             f"torch.optim.Adagrad(lr={lr}) on the dense parameters",
             "swap_none": f"torch.optim.Adagrad(lr={lr}) on every parameter",
             "frozen_tables": f"torch.optim.Adagrad(lr={lr}) on the dense parameters only (negative control)"}
    reports = {}
    for name, optimizer in (("swap_rowwise", gk.optim.ExactRowwiseAdagrad(lr=lr, eps=EPS)), ("swap_none", None),
                            ("frozen_tables", None)):
        model, opts, report = _swapped(base, optimizer, lr)  # copies of the untrained weights
        if name == NEGATIVE_CONTROL:
            opts = [torch.optim.Adagrad([p for n, p in model.named_parameters() if not n.startswith("sparse_arch.")],
                                        lr=lr)]
        models[name] = (model, opts)
        reports[name] = [f"{p}: {o} -> {n}" for p, o, n in report.replaced]
    return models, reports, words


def loss_curves(steps: int, lr: float = LR, quick: bool = False, device: torch.device | None = None) -> dict:
    """Train the baselines and impls of LOSS_BASELINES ``steps`` steps from the same weights on the
    same fresh batches (one batch drawn per step, shared, labelled by the Teacher), with no time cap;
    the result dict that main() writes."""
    device = device or torch.device("cpu")
    models, reports, words = _loss_models(quick, device, lr)
    teacher = Teacher(quick)
    curves = {name: [] for name in models}
    step1_params = {}
    started = time.perf_counter()
    for step, batch in enumerate(_dataset(quick, steps, -1)):
        batch = teacher(batch).to(device)
        for name, (model, opts) in models.items():
            curves[name].append(float(_step(model, opts, batch)))
        if step == 0:
            step1_params = {name: _param_diff(models[name][0], models[base][0], lr)
                            for name, base in LOSS_BASELINES.items()}
        if (step + 1) % max(1, steps // 10) == 0:
            log(f"[swap loss] step {step + 1}/{steps}: " + ", ".join(f"{n} {c[-1]:.5f}" for n, c in curves.items())
                + f" ({time.perf_counter() - started:.0f} s)")
    from bench import report as bench_report

    stats = {name: _curve_stats(curves[name], curves[base]) | {"baseline": base, "step1_params": step1_params[name]}
             for name, base in LOSS_BASELINES.items()}
    return dict(
        timestamp=bench_report.utc_timestamp(), git_sha=bench_report.git_sha(), device=device.type,
        torch_threads=torch.get_num_threads(), seconds=time.perf_counter() - started,
        config=dict(steps=steps, lr=lr, quick=quick, batch=BATCH[quick], dim=DIM[quick], row_cap=ROW_CAP[quick],
                    tables=len(CRITEO_ROWS), step1_rtol=STEP1_RTOL, tail_fraction=TAIL_FRACTION,
                    teacher=dict(tables=list(TEACHER_TABLES), scale=TEACHER_SCALE, seed=TEACHER_SEED),
                    optimizers=words),
        swapped=reports, curves=curves, stats=stats, negative_control=NEGATIVE_CONTROL,
        verdict=loss_verdict(stats))


def loss_verdict(stats: dict) -> str:
    """"pass" when every impl passes its baseline's rule and the negative control fails it."""
    impls_pass = all(s["verdict"] == "pass" for name, s in stats.items() if name != NEGATIVE_CONTROL)
    control_fails = stats[NEGATIVE_CONTROL]["verdict"] == "FAIL"
    return "pass" if impls_pass and control_fails else "FAIL"


def loss_table_lines(result: dict) -> list[str]:
    cfg, curves = result["config"], result["curves"]
    lines = [f"# gk.swap DLRM loss curves ({result['device']})", "",
             f"{cfg['steps']} steps, lr {cfg['lr']}, B={cfg['batch']}, {cfg['tables']} tables (rows capped at "
             f"{cfg['row_cap']:,}) x D={cfg['dim']}, same initial weights, same fresh batch per step, no time cap; "
             f"git {result['git_sha']}, {result['timestamp']}, {result['torch_threads']} torch threads, "
             f"{result['seconds']:.0f} s.", "",
             "Rule (bench/swap_loss.py docstring): step-1 |diff| <= "
             f"{cfg['step1_rtol']:g} x |loss|, every loss finite, and over the last {cfg['tail_fraction']:.0%} of "
             "the steps |tail-mean diff| <= 2 SE (SE of the difference of the two tail means from their "
             "step-to-step variance).", "",
             f"Labels from a planted teacher (tables {cfg['teacher']['tables']}, scale {cfg['teacher']['scale']}); "
             f"{result['negative_control']} (frozen tables) is the negative control and must FAIL. "
             f"Run verdict: **{result['verdict']}**.", "",
             "| impl | baseline | step-1 abs diff | max per-step abs diff (step) | tail mean | baseline tail mean | "
             "tail-mean diff | 2 SE | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in result["stats"].items():
        base_tail = s["tail_mean"] - s["tail_mean_diff"]
        expected = " (expected: FAIL)" if name == result["negative_control"] else ""
        lines.append(f"| {name} | {s['baseline']} | {s['step1_abs_diff']:.2e} | {s['max_abs_diff']:.2e} "
                     f"({s['max_abs_diff_step']}) | {s['tail_mean']:.5f} | {base_tail:.5f} | "
                     f"{s['tail_mean_diff']:+.2e} | {2 * s['tail_se']:.2e} | {s['verdict']}{expected} |")
    lines += ["", "Per-step |diff| vs the baseline growing over the steps, and the parameters after step 1:", ""]
    for name, s in result["stats"].items():
        growth = ", ".join(f"{k}: {v:.1e}" for k, v in s["diff_at_steps"].items())
        p = s["step1_params"]
        lines.append(f"- {name}: {growth}; after step 1 max |param diff| {p['max_abs_diff']:.2e}, "
                     f"{p['elements_differing']:,} of {p['elements']:,} elements differ, "
                     f"{p['elements_off_by_more_than_half_lr']:,} by > lr/2")
    lines += ["", "| step | " + " | ".join(curves) + " |", "|---|" + "---|" * len(curves)]
    for i in range(len(next(iter(curves.values())))):
        lines.append(f"| {i + 1} | " + " | ".join(f"{c[i]:.6f}" for c in curves.values()) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    from bench import report as bench_report
    from bench import unwritable

    parser = argparse.ArgumentParser(prog="python -m bench.swap_loss", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss-steps", type=int, required=True, help="training steps of the loss curves")
    parser.add_argument("--lr", type=float, default=LR, help=f"Adagrad learning rate of every impl (default {LR})")
    parser.add_argument("--quick", action="store_true", help="the small DLRM of the quick bench")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default: bench/results)")
    args = parser.parse_args(argv)
    if args.loss_steps < 1:
        parser.error(f"--loss-steps must be >= 1, got {args.loss_steps}")
    out = Path(args.out or bench_report.DEFAULT_OUT)
    why = unwritable(out)
    if why:
        parser.error(f"--out {out}: {why}")
    result = loss_curves(args.loss_steps, args.lr, args.quick, torch.device(args.device))
    stem = out / f"swap-loss-{result['device']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = loss_table_lines(result)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:16 + 2 * len(result["stats"])]))
    print(f"results: {stem.with_suffix('.json')}, {stem.with_suffix('.md')}")
    return 0 if result["verdict"] == "pass" else 1


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

"""The GEM small model's training step with one glue change on and off, paired in one process (the two
alternated per round of 8 batches, the order flipped every round), as scripts/linear_step_ab.py does.

  --change residual: the HSTU layer node's residual gradient added into dx by hstu_uvqk_bwd
                     (grad_residual) vs hstu_uvqk_bwd without it followed by dx.add_(grad_out) (the node's
                     previous code, reproduced by wrapping the kernel the node looks up).

Paired = median over (round, batch) of new - old; ratio = median of the rounds' median-new / median-old.
Usage: flock /tmp/gk-measure.lock chrt -f 10 python scripts/step_glue_ab.py --change residual --threads 2
"""
import argparse
import statistics
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--change", choices=("residual",), default="residual")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rounds", type=int, default=20)
p.add_argument("--batch-size", type=int, default=None)
a = p.parse_args()
torch.set_num_threads(a.threads)
from gem_kernels.testing.malloc import keep_freed_cpu_memory  # noqa: E402

keep_freed_cpu_memory(1024)
from gem_kernels.ops import hstu_layer as hstu_ops  # noqa: E402
from model import SyntheticBatches  # noqa: E402
from model.train import build, parse_args, train_step  # noqa: E402

argv = ["--config", "small", "--kernels", "fused", "--device", "cpu"]
if a.batch_size:
    argv += ["--batch-size", str(a.batch_size)]
cfg, model, opts = build(parse_args(argv))

real_kernel = hstu_ops.kernel
state = {"new": True}


def old_uvqk_bwd(fn):
    def run(*args):
        out = fn(*args[:-1])
        out[0].add_(args[-1])  # the node's previous `dx = dx.add_(grad_out)`
        return out
    return run


def switched_kernel(family, op, backend):
    fn = real_kernel(family, op, backend)
    if op == "hstu_uvqk_bwd" and not state["new"]:
        return old_uvqk_bwd(fn)
    return fn


hstu_ops.kernel = switched_kernel


def mode(new):
    state["new"] = new


data = SyntheticBatches(cfg)
batches = [data[i] for i in range(8)]
for new in (True, False):
    mode(new)
    for b in batches[:3]:
        train_step(model, b, opts)
res = {True: [], False: []}
ratios = []
for r in range(a.rounds):
    per = {}
    for new in ((True, False) if r % 2 else (False, True)):
        mode(new)
        times = []
        for b in batches:
            t = time.perf_counter()
            float(train_step(model, b, opts))
            times.append((time.perf_counter() - t) * 1e3)
        res[new].extend(times)
        per[new] = statistics.median(times)
    ratios.append(per[True] / per[False])
old, new = statistics.median(res[False]), statistics.median(res[True])
paired = statistics.median(n - o for n, o in zip(res[True], res[False]))
q = statistics.quantiles(ratios, n=4)
print(f"{a.change} threads {a.threads} rounds {a.rounds}: old {old:.3f} ms new {new:.3f} ms | paired "
      f"{paired * 1e3:+.0f} us | ratio {statistics.median(ratios):.3f} ({q[0]:.3f}-{q[2]:.3f}) | "
      f"rounds new<old {sum(x < 1 for x in ratios)}/{len(ratios)}")

"""The GEM small model's training step with gk.nn.MLP fused (backend None: one gem_kernels.linear per Linear
and ReLU) vs its children (backend "reference": torch's Linear + ReLU), paired in one process, the two
alternated per round of 8 batches. Usage: flock /tmp/gk-measure.lock chrt -f 10 python scripts/linear_step_ab.py --threads 2"""
import sys, time, statistics, argparse
import torch
p = argparse.ArgumentParser(); p.add_argument("--threads", type=int, default=2); p.add_argument("--rounds", type=int, default=10)
a = p.parse_args()
torch.set_num_threads(a.threads)
from gem_kernels.testing.malloc import keep_freed_cpu_memory
keep_freed_cpu_memory(1024)
import gem_kernels as gk
from model.train import parse_args, build, train_step
from model import SyntheticBatches
args = parse_args(["--config", "small", "--kernels", "fused", "--device", "cpu"])
cfg, model, opts = build(args)
mlps = [m for m in model.modules() if isinstance(m, gk.nn.MLP)]
print(len(mlps), "MLPs", [type(m).__name__ for m in mlps])
def mode(fused):
    for m in mlps: m.backend = None if fused else "reference"
data = SyntheticBatches(cfg)
batches = [data[i] for i in range(8)]
for f in (True, False):
    mode(f)
    for b in batches[:3]: train_step(model, b, opts)
res = {True: ([], []), False: ([], [])}
for r in range(a.rounds):
    for f in ((True, False) if r % 2 else (False, True)):
        mode(f)
        for b in batches:
            t, c = time.perf_counter(), time.process_time()
            float(train_step(model, b, opts))
            res[f][0].append((time.perf_counter() - t) * 1e3); res[f][1].append((time.process_time() - c) * 1e3)
ow, oc = statistics.median(res[False][0]), statistics.median(res[False][1])
nw, nc = statistics.median(res[True][0]), statistics.median(res[True][1])
# paired per (round, batch) differences
dw = statistics.median(n - o for n, o in zip(res[True][0], res[False][0]))
print(f"threads {a.threads}: old wall {ow:.2f} cpu {oc:.2f} | new wall {nw:.2f} cpu {nc:.2f} | wall ratio {nw/ow:.3f} cpu ratio {nc/oc:.3f} | paired median diff {dw:+.2f} ms")

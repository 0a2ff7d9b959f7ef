"""Why the GEM small model's GEMMs run slower in the training step than in a hot loop (issue 26, csrc/cpu/linear.cpp).

Usage: flock /tmp/gk-measure.lock chrt -f 10 python scripts/linear_gemm_replay.py THREADS
The model's MLPs run pinned to the reference backend (torch's Linear + ReLU, what the fused op replaced).
capture: 8 train steps under a TorchDispatchMode record every mm/addmm (shapes, strides, time in the step).
replay: the same calls on fresh tensors of the same layouts: (hot) each one 50x in a row; (seq) the step's
sequence in order; (seq_out=) into preallocated outputs; (seq+16MiB) a 16 MiB stream between calls (cold
operands); (seq+200us_serial) 200 us of serial Python between calls (idle worker thread)."""
import sys, time, statistics, collections
import torch
from torch.utils._python_dispatch import TorchDispatchMode
th = int(sys.argv[1]); torch.set_num_threads(th)
from gem_kernels.testing.malloc import keep_freed_cpu_memory
keep_freed_cpu_memory(1024)
from model.train import parse_args, build, train_step
from model import SyntheticBatches
args = parse_args(["--config", "small", "--kernels", "fused", "--device", "cpu"])
cfg, model, opts = build(args)
import gem_kernels as gk
for m in model.modules():
    if isinstance(m, gk.nn.MLP):
        m.backend = "reference"
data = SyntheticBatches(cfg)
batches = [data[i] for i in range(8)]
for b in batches[:4]: train_step(model, b, opts)
aten = torch.ops.aten
GEMMS = {aten.mm.default: "mm", aten.addmm.default: "addmm"}
class Cap(TorchDispatchMode):
    def __init__(s): super().__init__(); s.calls = []
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMMS:
            t = time.perf_counter(); out = func(*args, **kwargs); dt = time.perf_counter() - t
            s.calls.append((GEMMS[func], [(tuple(a.shape), a.stride(), a.storage_offset()) if isinstance(a, torch.Tensor) else a for a in args], kwargs, dt))
            return out
        return func(*args, **kwargs)
caps = []
for b in batches:
    with Cap() as c: float(train_step(model, b, opts))
    caps.append(c.calls)
calls = caps[0]
def flops(c):
    name, a, kw, _ = c
    if name == "mm": (m, k), n = a[0][0], a[1][0][1]
    else: (m, k), n = a[1][0], a[2][0][1]
    return 2 * m * n * k
big = [i for i, c in enumerate(calls) if flops(c) > 5e6]
def mk(spec):
    if not isinstance(spec, tuple): return spec
    shape, stride, off = spec
    n = off + 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else off
    return torch.randn(max(n, 1)).as_strided(shape, stride, off)
fn = {"mm": torch.mm, "addmm": torch.addmm}
def run(c, ts, out=None):
    name, a, kw, _ = c
    if out is not None: return fn[name](*ts, out=out, **kw)
    return fn[name](*ts, **kw)
tensors = [[mk(s) for s in c[1]] for c in calls]
outs = [run(c, t) for c, t in zip(calls, tensors)]
junk = torch.randn(4 << 20)  # 16 MiB
# in-step time: median over the 8 captured steps, same index (shapes vary slightly with R, fine)
instep = {i: statistics.median(cs[i][3] for cs in caps if len(cs) == len(calls)) for i in big}
def timed_seq(mode, reps=20):
    res = collections.defaultdict(list)
    for r in range(reps):
        for i, (c, t) in enumerate(zip(calls, tensors)):
            if mode == "traffic": junk.mul_(1.0)
            if mode == "idle":
                x = time.perf_counter()
                while time.perf_counter() - x < 200e-6: pass
            t0 = time.perf_counter()
            if mode == "out": run(c, t, outs[i])
            else: run(c, t)
            res[i].append(time.perf_counter() - t0)
    return {i: statistics.median(v) for i, v in res.items()}
def timed_hot(reps=50):
    res = {}
    for i in big:
        c, t = calls[i], tensors[i]
        for _ in range(5): run(c, t)
        v = []
        for _ in range(reps):
            t0 = time.perf_counter(); run(c, t); v.append(time.perf_counter() - t0)
        res[i] = statistics.median(v)
    return res
modes = {"hot": timed_hot(), "seq": timed_seq("seq"), "seq_out=": timed_seq("out"), "seq+16MiB": timed_seq("traffic"), "seq+200us_serial": timed_seq("idle")}
print(f"threads {th}; {len(calls)} GEMM calls per step, {len(big)} > 5 MFLOP; times in us")
print(f"{'call':44s} {'MFLOP':>6s} {'in-step':>8s} " + " ".join(f"{m:>16s}" for m in modes))
tot = collections.Counter()
for i in big:
    c = calls[i]; f = flops(c)
    desc = f"{c[0]} " + " ".join("x".join(map(str, s[0])) + ("T" if len(s[1]) == 2 and s[1][0] == 1 and s[0][1] > 1 else "") for s in c[1] if isinstance(s, tuple))
    row = [instep[i]] + [modes[m][i] for m in modes]
    for k, v in zip(["in-step"] + list(modes), row): tot[k] += v
    print(f"{desc:44s} {f/1e6:6.1f} " + " ".join(f"{v*1e6:8.0f}" if j == 0 else f"{v*1e6:16.0f}" for j, v in enumerate(row)))
allf = sum(flops(calls[i]) for i in big)
print("total us:", {k: round(v * 1e6) for k, v in tot.items()})
print("TF/s:", {k: round(allf / v / 1e12, 3) for k, v in tot.items()})
small = [i for i in range(len(calls)) if i not in big]
print("small calls", len(small), "in-step us", round(sum(statistics.median(cs[i][3] for cs in caps if len(cs)==len(calls)) for i in small)*1e6))

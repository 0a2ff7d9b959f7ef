"""hstu_uvqk_bwd at the GEM small model's layer (its arguments captured from a training step, batch 256): with
grad_residual vs without it + dx.add_(grad_out) (the layer node's previous form), alternated call by call in one
process. Usage: flock /tmp/gk-measure.lock chrt -f 10 python scripts/uvqk_residual_ab.py THREADS PAIRS"""
import statistics, sys, time
import torch
threads = int(sys.argv[1]); reps = int(sys.argv[2])
torch.set_num_threads(threads)
from gem_kernels.testing.malloc import keep_freed_cpu_memory
keep_freed_cpu_memory(1024)
from gem_kernels.ops import hstu_layer as hstu_ops
from model import SyntheticBatches
from model.train import build, parse_args, train_step
cfg, model, opts = build(parse_args(["--config", "small", "--kernels", "fused", "--device", "cpu"]))
real = hstu_ops.kernel
captured = []
def capture(family, op, backend):
    fn = real(family, op, backend)
    if op != "hstu_uvqk_bwd":
        return fn
    def run(*a):
        if not captured:
            captured.append(tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in a))
        return fn(*a)
    return run
hstu_ops.kernel = capture
train_step(model, SyntheticBatches(cfg)[0], opts)
hstu_ops.kernel = real
args = captured[0]
fn = real("hstu_layer", "hstu_uvqk_bwd", "cpu")
print("x", tuple(args[4].shape), "heads/dims", args[11:15], "grad_residual", tuple(args[15].shape))
def old():
    out = fn(*args[:15]); out[0].add_(args[15]); return out
def new():
    return fn(*args)
a, b = old(), new()
assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))
for _ in range(20): old(); new()
t_old, t_new = [], []
for i in range(reps):
    for which in ((old, new) if i % 2 else (new, old)):
        t = time.perf_counter(); which(); dt = (time.perf_counter() - t) * 1e6
        (t_old if which is old else t_new).append(dt)
paired = statistics.median(n - o for n, o in zip(t_new, t_old))
print(f"threads {threads}: old {statistics.median(t_old):.0f} us new {statistics.median(t_new):.0f} us "
      f"ratio {statistics.median(t_new)/statistics.median(t_old):.3f} paired {paired:+.0f} us "
      f"(new<old in {sum(n < o for n, o in zip(t_new, t_old))}/{reps})")

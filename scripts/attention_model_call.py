"""CPU time of the HSTU attention at the GEM small model's call (bench/attention.py model_call_inputs:
256 users, H = 2, D = 16, contextual 2 + targets, position and time bias), forward and forward+backward,
on one thread; `--long` adds the bench's history 256 and 1024 HSTU cases (H = 4, D = 128, 50 % dense).

CPU time (time.process_time), not wall time: on a machine shared with other jobs wall time mostly
measures them. To compare two builds of the kernel in one run, point --gk at each repository in turn
and interleave the runs, e.g.

    for r in 1 2 3; do for repo in /work/main $PWD; do
      OMP_NUM_THREADS=1 python scripts/attention_model_call.py --gk $repo; done; done

--gk only chooses where `gem_kernels` is imported from; the inputs always come from this repository's bench.
--native times the kernels alone (jagged_attention_{fwd,bwd}_native), without the Python wrapper and autograd.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gk", default=None, help="repository root to import gem_kernels from (default: this one)")
    parser.add_argument("--long", action="store_true", help="also the history 256 and 1024 bench cases")
    parser.add_argument("--seconds", type=float, default=2.0, help="CPU seconds per timed case")
    parser.add_argument("--native", action="store_true",
                        help="time the kernels alone (the native fwd and bwd ops), not the autograd call")
    args = parser.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.abspath(args.gk or here))
    import gem_kernels as gk  # noqa: F401  (cached: bench below imports this one)
    sys.path[0] = here
    import torch
    from bench import attention as battn
    from gem_kernels.testing.malloc import keep_freed_cpu_memory

    torch.set_num_threads(1)
    keep_freed_cpu_memory(1024)  # else the outputs' page faults are a large part of a call
    cases = [("model", *battn.model_call_inputs(torch.device("cpu"), torch.float32)[1:])]
    if args.long:
        gen = torch.Generator().manual_seed(0)
        for m, b in ((256, 16), (1024, 4)):
            lengths = battn._lengths(b, m, 0.5, gen)
            sets = [battn._inputs(lengths, m, torch.float32, torch.device("cpu"), True, 0)]
            sets[0]["grad_out"] = torch.randn(sets[0]["q"].shape, generator=torch.Generator().manual_seed(100))
            cases.append((f"history{m}", m, sets))
    print(f"gem_kernels from {os.path.dirname(os.path.dirname(gk.__file__))}")
    for name, _, sets in cases:
        a = sets[0]
        leaves = [a[n] for n in ("q", "k", "v", "pos_bias", "time_bias")]
        op_args = {n: t for n, t in a.items() if n != "grad_out"}

        def fwd():
            with torch.no_grad():
                gk.jagged_attention(**op_args, kind="hstu", causal=True, backend="cpu")

        def fwd_bwd():
            out = gk.jagged_attention(**op_args, kind="hstu", causal=True, backend="cpu")
            torch.autograd.grad(out, leaves, a["grad_out"])

        timed = (("fwd", fwd), ("fwd+bwd", fwd_bwd))
        if args.native:
            ops = torch.ops.gem_kernels
            t = {n: (x.detach() if isinstance(x, torch.Tensor) else x) for n, x in a.items()}
            mask = (t["max_seq_len"], "hstu", True, 1.0 / math.sqrt(t["q"].shape[2]), t.get("num_targets"),
                    t.get("contextual_len", 0), 0, t["pos_bias"], t["time_bias"], t["timestamps"], None)
            out, lse = ops.jagged_attention_fwd_native(t["q"], t["k"], t["v"], t["seq_offsets"], *mask)
            timed = (("fwd-op", lambda: ops.jagged_attention_fwd_native(t["q"], t["k"], t["v"], t["seq_offsets"], *mask)),
                     ("bwd-op", lambda: ops.jagged_attention_bwd_native(t["grad_out"], t["q"], t["k"], t["v"], out, lse,
                                                                       t["seq_offsets"], *mask, False)))
        for label, fn in timed:
            fn()
            t0 = time.process_time()
            n = 0
            while time.process_time() - t0 < 0.2:
                fn()
                n += 1
            reps = max(1, int(n * args.seconds / 0.2 / 7))
            samples = []
            for _ in range(7):
                t0 = time.process_time()
                for _ in range(reps):
                    fn()
                samples.append((time.process_time() - t0) / reps * 1e3)
            print(f"{name:10s} {label:8s} {statistics.median(samples):8.3f} ms cpu  "
                  f"(min {min(samples):.3f}, max {max(samples):.3f}, {reps} x 7)")


if __name__ == "__main__":
    main()

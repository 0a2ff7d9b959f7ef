"""Per-call times of the cpu Wukong kernels at the GEM model's `small` shape, for comparing builds.

Prints one JSON line: {"<op> F=<F>": [wall us at 2 threads, CPU us at 1 thread]} for fm_compress and
feature_mix_norm, forward and backward, at B = 1152 rows (the model's interaction arch runs per (user,
candidate): 256 users x 4.5 candidates on average), D = 32, k = 8, O = 16 (8 FM rows) and F = 10 and
16 (the model's two layers). "wall" is what the 2-thread training step sees, with the build's own
thread choice; "CPU" is the thread's CPU time at one thread, which a busy host's time sharing does not
inflate. Run each build in its own process, alternating, and compare medians:

    for i in 1 2 3; do for pkg in /path/to/main_pkg /path/to/new_pkg; do
        PYTHONPATH=$pkg python scripts/wukong_model_ops.py; done; done

(a package dir holds a `gem_kernels/` with that build's `_C*.so`). Like `python -m model.train` and
`python -m bench`, it keeps freed heap mapped (keep_freed_cpu_memory, --malloc-keep-mib), so that a
call's outputs reuse pages instead of faulting fresh ones in. On a host where another process
holds a core, a 2-thread round waits for a descheduled thread (ms per call) and its median says
nothing; `--single-calls` then prints [10th, 50th percentile] wall us of 400 single calls at 2
threads instead: the calls that ran with both cores. The bench rows at the same shape
(`python -m bench interaction`) check the outputs before timing them; this script only times.

`--cold N` rotates every call over N sets of inputs (fresh outputs as always), so that a call finds
its inputs in memory rather than in the caches, as the training step does: the forward wrote x and
fm milliseconds and tens of MB of other work before the backward reads them. At N = 32 (~300 MB)
the 1-thread CPU times come within the host's noise of what a 1-thread step's calls cost (its
profiler's wall times, on a shared host, read more still); N = 1 (the default) measures the kernels
on cache-warm inputs, 0.6-0.8x of that (2026-12-06, 2-vCPU Xeon: mix bwd F = 16 ~690 us warm vs
~920 cold, fm bwd ~410 vs ~700).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import gem_kernels  # noqa: F401  (registers torch.ops.gem_kernels)
from gem_kernels.testing.malloc import DEFAULT_KEEP_MIB, keep_freed_cpu_memory

B, D, K, O, O_FM = 1152, 32, 8, 16, 8


def _per_call_us(fn, clock, calls: int = 100, rounds: int = 5) -> list[float]:
    """us per call of each round, measured with `clock` (perf_counter: wall; thread_time: CPU)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(rounds):
        start = clock()
        for _ in range(calls):
            fn()
        times.append((clock() - start) / calls * 1e6)
    return sorted(times)


def _single_call_us(fn, calls: int = 400) -> list[float]:
    """10th and 50th percentile wall us of `calls` single timed calls."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    times.sort()
    return [round(times[calls // 10], 1), round(times[calls // 2], 1)]


def _rotating(call, sets: list) -> callable:
    """A no-argument fn that runs call on sets[0], sets[1], ... in turn."""
    state = {"next": 0}

    def fn():
        i = state["next"]
        state["next"] = (i + 1) % len(sets)
        return call(sets[i])

    return fn


def main() -> None:
    parser = argparse.ArgumentParser(prog="python scripts/wukong_model_ops.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--single-calls", action="store_true",
                        help="print [10th, 50th percentile] wall us of 400 single calls at 2 threads instead")
    parser.add_argument("--cold", type=int, default=1, metavar="N",
                        help="rotate each call over N input sets, so that inputs come from memory (default 1)")
    parser.add_argument("--malloc-keep-mib", type=int, default=DEFAULT_KEEP_MIB, metavar="MIB",
                        help=f"keep up to MIB of freed heap mapped (default {DEFAULT_KEEP_MIB}; 0: glibc's defaults)")
    args = parser.parse_args()
    if args.cold < 1:
        parser.error(f"--cold must be >= 1, got {args.cold}")
    single_calls = args.single_calls
    keep_freed_cpu_memory(args.malloc_keep_mib)
    ops = torch.ops.gem_kernels
    results = {}
    for F in (10, 16):
        y, mix = torch.randn(F, K) * F ** -0.5, torch.randn(O, F) * F ** -0.5
        lw, lb = 1 + 0.1 * torch.randn(F * K), 0.1 * torch.randn(F * K)
        w, b = 1 + 0.1 * torch.randn(D), 0.1 * torch.randn(D)
        sets = []
        for _ in range(args.cold):
            x, fm = torch.randn(B, F, D), torch.randn(B, O_FM, D)
            out, mean, rstd, products = ops.fm_compress_native(x, y, lw, lb, 1e-5, True)
            out2, mean2, rstd2 = ops.feature_mix_norm_native(x, mix, fm, w, b, 1e-5)
            sets.append(dict(x=x, fm=fm, g=torch.randn_like(out), mean=mean, rstd=rstd, products=products,
                             g2=torch.randn_like(out2), mean2=mean2, rstd2=rstd2))
        fns = {"fm_compress fwd": lambda s: ops.fm_compress_native(s["x"], y, lw, lb, 1e-5, True),
               "fm_compress bwd": lambda s: ops.fm_compress_backward_native(s["g"], s["x"], y, lw, s["mean"],
                                                                            s["rstd"], s["products"]),
               "feature_mix_norm fwd": lambda s: ops.feature_mix_norm_native(s["x"], mix, s["fm"], w, b, 1e-5),
               "feature_mix_norm bwd": lambda s: ops.feature_mix_norm_backward_native(
                   s["g2"], s["x"], mix, s["fm"], w, s["mean2"], s["rstd2"])}
        for name, call in fns.items():
            fn = _rotating(call, sets)
            torch.set_num_threads(2)
            if single_calls:
                results[f"{name} F={F}"] = _single_call_us(fn)
                continue
            wall = _per_call_us(fn, time.perf_counter)
            torch.set_num_threads(1)
            cpu = _per_call_us(fn, time.thread_time)
            # The median wall round (the host's load varies), the least CPU time (what the call costs).
            results[f"{name} F={F}"] = [round(wall[len(wall) // 2], 1), round(cpu[0], 1)]
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""The DCNv2 cross layer against its GEMM roof (issue 26): per thread count, the cpu backend's
forward and forward+backward beside the same GEMMs called alone (torch.mm: x W^T, dz W, dz^T x; low
rank the six products with U and V), interleaved round by round in one process.

    PYTHONPATH=$PWD python scripts/cross_layer_roof.py --threads 1,2 [--cpu-time] [--rounds 9] [--gemm-shapes]

--gemm-shapes first prints what sgemm alone reaches at the op's three B=4096, N=512 shapes (x W^T,
dz W, dz^T x) beside the square n=2048 product of bench/peaks.py: the op's true ceiling.

Run it on two checkouts alternately to compare builds. --cpu-time reports the process's CPU time
instead of wall time: on a busy host (other processes on the cores) it leaves out the time this
process waited for a core, so one-thread figures stay comparable; it counts spinning threads too, so
use wall time for two threads on a quiet host. Minor page faults per call are printed as well: the
[B, N] outputs are fresh allocations and glibc's reuse of them varies from run to run.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

import gem_kernels as gk

SHAPES = [(4096, 512, None), (4096, 1024, 64)]  # bench/interaction.py's CPU cross layer cases


def _fns(B: int, N: int, rank: int | None) -> tuple[dict, int]:
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(B, N, generator=gen).requires_grad_(True)
    xl = torch.randn(B, N, generator=gen).requires_grad_(True)
    g = torch.randn(B, N, generator=gen)
    bias = (torch.randn(N, generator=gen) * 0.1).requires_grad_(True)
    xd = xl.detach()
    if rank is None:
        weight = (torch.randn(N, N, generator=gen) * N ** -0.5).requires_grad_(True)
        params, w = [weight, bias], weight.detach()

        def gemms():
            torch.mm(xd, w.t()), torch.mm(g, w), torch.mm(g.t(), xd)

        gemm_flops = 6 * B * N * N
    else:
        weight = ((torch.randn(N, rank, generator=gen) * rank ** -0.5).requires_grad_(True),
                  (torch.randn(rank, N, generator=gen) * N ** -0.5).requires_grad_(True))
        params, (u, v) = [*weight, bias], (weight[0].detach(), weight[1].detach())

        def gemms():
            p = torch.mm(xd, v.t())
            torch.mm(p, u.t()), torch.mm(g.t(), p)
            gp = torch.mm(g, u)
            torch.mm(gp.t(), xd), torch.mm(gp, v)

        gemm_flops = 12 * B * N * rank

    def forward():
        with torch.no_grad():
            gk.cross_layer(x0, xl, weight, bias, backend="cpu")

    def forward_backward():
        out = gk.cross_layer(x0, xl, weight, bias, backend="cpu")
        torch.autograd.grad(out, [x0, xl, *params], g)

    return {"gemms": gemms, "fwd": forward, "fwd+bwd": forward_backward}, gemm_flops


def _gemm_shapes(threads: int, rounds: int, clock) -> None:
    B, N = SHAPES[0][:2]
    gen = torch.Generator().manual_seed(0)
    x, g, w = torch.randn(B, N, generator=gen), torch.randn(B, N, generator=gen), torch.randn(N, N, generator=gen)
    a, b = torch.randn(2048, 2048, generator=gen), torch.randn(2048, 2048, generator=gen)
    out, out_w, out_sq = torch.empty(B, N), torch.empty(N, N), torch.empty(2048, 2048)
    cases = {"square n=2048": (lambda: torch.mm(a, b, out=out_sq), 2 * 2048 ** 3),
             "NT x W^T": (lambda: torch.mm(x, w.t(), out=out), 2 * B * N * N),
             "NN dz W": (lambda: torch.mm(g, w, out=out), 2 * B * N * N),
             "TN dz^T x": (lambda: torch.mm(g.t(), x, out=out_w), 2 * B * N * N)}
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (fn, _flops) in cases.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    print(f"threads={threads} sgemm TFLOP/s, median (best): " + "  ".join(
        f"{name} {flops / sorted(times[name])[rounds // 2] / 1e12:.3f} ({flops / min(times[name]) / 1e12:.3f})"
        for name, (_fn, flops) in cases.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--gemm-shapes", action="store_true")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        if args.gemm_shapes:
            _gemm_shapes(threads, args.rounds, clock)
        for B, N, rank in SHAPES:
            fns, gemm_flops = _fns(B, N, rank)
            for fn in fns.values():
                fn()
            times = {name: [] for name in fns}
            faults = dict.fromkeys(fns, 0)
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    start = clock()
                    fn()
                    times[name].append((clock() - start) * 1e3)
                    faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
            best = {name: min(t) for name, t in times.items()}
            print(f"threads={threads} B={B} N={N} rank={rank} ({'cpu' if args.cpu_time else 'wall'} ms, median/min): "
                  + "  ".join(f"{name} {med[name]:.2f}/{best[name]:.2f}" for name in fns)
                  + f" | fwd+bwd / gemms {med['fwd+bwd'] / med['gemms']:.3f}/{best['fwd+bwd'] / best['gemms']:.3f}"
                  + f" | gemms {gemm_flops / best['gemms'] / 1e9:.3f} TFLOP/s (min) | faults/call "
                  + " ".join(f"{name} {faults[name] // args.rounds}" for name in fns), flush=True)


if __name__ == "__main__":
    main()

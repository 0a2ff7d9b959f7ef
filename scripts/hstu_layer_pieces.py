"""Per-piece CPU time of the HSTU layer, fused (impl cpu) against attn-only, side by side in one run.

Pieces: uvqk fwd / bwd, attention fwd / bwd, output fwd / bwd, and the whole layer fwd / fwd+bwd, at
bench.hstu_layer's shapes (D = 256, H = 4, dims 64, no silu_qkv, concat u and x) and the small
model's (tokens = 8704, D = 32, H = 2, dims 16, silu_qkv, no concat). Each piece is timed in
thread CPU time (run it with OMP_NUM_THREADS=1: a shared host's other loads then do not count),
the impls interleaved round by round; the median and the minimum over the rounds are printed with fused / attn-only.
glibc keeps freed memory mapped (--malloc-keep-mib, as `python -m model.train` and `python -m bench` do):
without it each op's outputs fault their pages in again, which doubled the small model's uvqk forward.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/hstu_layer_pieces.py [--rounds 7] [--shapes 4096,1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gem_kernels as gk
from gem_kernels._backend import kernel
from gem_kernels.testing.malloc import DEFAULT_KEEP_MIB, keep_freed_cpu_memory
from gem_kernels.ops import hstu_layer as ops
from gem_kernels.reference import hstu_layer as ref
from bench import hstu_layer as bench_layer
from bench.attention import _lengths

EPS = 1e-6


def _shape(name: str):
    gen = torch.Generator().manual_seed(0)
    if name == "model":
        lengths = torch.full((256,), 34, dtype=torch.int64)
        d, h, lin, att, silu, concat, hist = 32, 2, 16, 16, True, False, 34
    else:  # bench.hstu_layer's lengths: its generator's draws replayed up to this history's
        hist = int(name)
        bench_layer._params(torch.float32, "cpu", gen)
        for h in (256, 1024, 4096):
            lengths = _lengths(max(1, 4096 // h), h, 0.5, gen)
            if h == hist:
                break
            for _ in range(4):  # two input sets of x and grad_out
                torch.randn(int(lengths.sum()), bench_layer.DIM, generator=gen)
        d, h, lin, att, silu, concat = 256, 4, 64, 64, False, True
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    width, o = h * lin, h * (2 * lin + 2 * att)
    k = width * (1 + 2 * concat)

    def rnd(*s, scale=1.0, shift=0.0):
        return shift + scale * torch.randn(*s, generator=gen)

    p = dict(input_norm_weight=rnd(d, scale=0.1, shift=1.0), input_norm_bias=rnd(d, scale=0.1),
             uvqk_weight=rnd(d, o, scale=d ** -0.5), uvqk_bias=rnd(o, scale=0.1),
             output_norm_weight=rnd(width, scale=0.1, shift=1.0), output_norm_bias=rnd(width, scale=0.1),
             output_weight=rnd(k, d, scale=k ** -0.5))
    cfg = dict(num_heads=h, linear_dim=lin, attention_dim=att, silu_qkv=silu, concat_u=concat, concat_x=concat)
    return dict(x=rnd(n, d), offsets=offsets, hist=hist, p=p, cfg=cfg, grad=rnd(n, d),
                label=f"tokens={n} D={d} H={h} dims={lin}")


def _pieces(s):
    """{piece: {impl: zero-arg callable}} for one shape."""
    x, off, hist, p, c = s["x"], s["offsets"], s["hist"], s["p"], s["cfg"]
    h, lin, att, silu, cu, cx = (c["num_heads"], c["linear_dim"], c["attention_dim"], c["silu_qkv"], c["concat_u"],
                                 c["concat_x"])
    n, width = x.shape[0], h * lin
    uf, ub = kernel(ops.FAMILY, "hstu_uvqk_fwd", "cpu"), kernel(ops.FAMILY, "hstu_uvqk_bwd", "cpu")
    of, ob = kernel(ops.FAMILY, "hstu_output_fwd", "cpu"), kernel(ops.FAMILY, "hstu_output_bwd", "cpu")
    uv = (p["input_norm_weight"], p["input_norm_bias"], EPS, p["uvqk_weight"], p["uvqk_bias"])
    u_pre, v, q, k, stats = uf(x, *uv, h, lin, att, silu)
    attn = gk.jagged_attention(q, k, v, off, hist, kind="hstu", backend="cpu").reshape(n, width)
    on = (p["output_norm_weight"], p["output_norm_bias"], EPS, p["output_weight"])
    _, ostats = of(attn, u_pre, x, *on, None, None, h, False, cu, cx)
    gen = torch.Generator().manual_seed(5)
    gu, gv, gq, gk_ = (torch.randn(t.shape, generator=gen) for t in (u_pre, v, q, k))
    gattn = torch.randn(attn.shape, generator=gen)

    def eager_uvqk_bwd():
        xx = x.clone().requires_grad_(True)
        ws = [t.clone().requires_grad_(True) for t in (uv[0], uv[1], uv[3], uv[4])]
        outs = ref.uvqk(xx, ws[0], ws[1], EPS, ws[2], ws[3], h, lin, att, silu)
        return lambda: torch.autograd.grad(outs, [xx, *ws], (gu, gv, gq, gk_), retain_graph=True)

    def eager_output_bwd():
        a, u = attn.clone().requires_grad_(True), u_pre.clone().requires_grad_(True)
        ws = [t.clone().requires_grad_(True) for t in (on[0], on[1], on[3])]
        out = ref.output(a, u, x, ws[0], ws[1], EPS, ws[2], None, None, h, False, cu, cx)
        return lambda: torch.autograd.grad(out, [a, u, *ws], s["grad"], retain_graph=True)

    def attn_bwd(strided):
        if strided:  # attn-only's q, k, v: views of one [N, O] GEMM output
            z = torch.cat([u_pre, v.reshape(n, -1), q.reshape(n, -1), k.reshape(n, -1)], 1).requires_grad_(True)
            _, vv, qq, kk = z.split([width, width, h * att, h * att], 1)
            leaves, (qq, kk, vv) = [z], (qq.reshape(n, h, att), kk.reshape(n, h, att), vv.reshape(n, h, lin))
        else:
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            leaves = [qq, kk, vv]
        out = gk.jagged_attention(qq, kk, vv, off, hist, kind="hstu", backend="cpu")
        return lambda: torch.autograd.grad(out, leaves, gattn.view(out.shape), retain_graph=True)

    def attn_fwd(strided):
        if strided:
            z = torch.cat([u_pre, v.reshape(n, -1), q.reshape(n, -1), k.reshape(n, -1)], 1)
            _, vv, qq, kk = z.split([width, width, h * att, h * att], 1)
            qq, kk, vv = qq.reshape(n, h, att), kk.reshape(n, h, att), vv.reshape(n, h, lin)
        else:
            qq, kk, vv = q, k, v
        return lambda: gk.jagged_attention(qq, kk, vv, off, hist, kind="hstu", backend="cpu")

    def layer(fused, backward):
        xx = x.clone().requires_grad_(backward)
        ws = {name: t.clone().requires_grad_(backward) for name, t in p.items()}
        cfg = dict(num_heads=h, linear_dim=lin, attention_dim=att)

        def run():
            with torch.set_grad_enabled(backward):
                if fused:
                    out = ops.hstu_layer(xx, off, hist, **ws, **cfg, silu_qkv=silu, concat_u=cu, concat_x=cx,
                                         backend="cpu")
                else:
                    u_, v_, q_, k_ = ref.uvqk(xx, ws["input_norm_weight"], ws["input_norm_bias"], EPS,
                                              ws["uvqk_weight"], ws["uvqk_bias"], h, lin, att, silu)
                    a_ = gk.jagged_attention(q_, k_, v_, off, hist, kind="hstu", backend="cpu")
                    out = ref.output(a_.reshape(n, -1), u_, xx, ws["output_norm_weight"], ws["output_norm_bias"],
                                     EPS, ws["output_weight"], None, None, h, False, cu, cx)
                if backward:
                    torch.autograd.grad(out, [xx, *ws.values()], s["grad"])
        return run

    with torch.no_grad():
        eager_uvqk_fwd = lambda: ref.uvqk(x, *uv, h, lin, att, silu)  # noqa: E731
        eager_output_fwd = lambda: ref.output(attn, u_pre, x, *on, None, None, h, False, cu, cx)  # noqa: E731
    return {
        "uvqk fwd": {"fused": lambda: uf(x, *uv, h, lin, att, silu), "attn-only": eager_uvqk_fwd},
        "uvqk bwd": {"fused": lambda: ub(gu, gv, gq, gk_, x, *uv, stats, h, lin, att, silu),
                     "attn-only": eager_uvqk_bwd()},
        "attention fwd": {"fused": attn_fwd(False), "attn-only": attn_fwd(True)},
        "attention bwd": {"fused": attn_bwd(False), "attn-only": attn_bwd(True)},
        "output fwd": {"fused": lambda: of(attn, u_pre, x, *on, None, None, h, False, cu, cx),
                       "attn-only": eager_output_fwd},
        "output bwd": {"fused": lambda: ob(s["grad"], attn, u_pre, *on, False, None, ostats, h, False, cu, cx),
                       "attn-only": eager_output_bwd()},
        "layer fwd": {"fused": layer(True, False), "attn-only": layer(False, False)},
        "layer fwd+bwd": {"fused": layer(True, True), "attn-only": layer(False, True)},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shapes", default="4096,1024,256,model")
    ap.add_argument("--pieces", default="")
    ap.add_argument("--wall", action="store_true", help="wall time (for several threads) instead of thread CPU time")
    ap.add_argument("--malloc-keep-mib", type=int, default=DEFAULT_KEEP_MIB,
                    help="freed heap glibc keeps mapped (0: its defaults)")
    args = ap.parse_args()
    keep_freed_cpu_memory(args.malloc_keep_mib)
    clock = time.perf_counter if args.wall else time.thread_time
    print(f"torch threads {torch.get_num_threads()}; ms of {'wall' if args.wall else 'thread CPU'} time, "
          f"median of {args.rounds} rounds")
    for name in args.shapes.split(","):
        s = _shape(name)
        pieces = _pieces(s)
        print(f"\n## history={name} {s['label']}")
        print(f"{'piece':16} {'fused':>9} {'attn-only':>10} {'ratio':>6} {'min fused':>9} {'attn-only':>10} {'ratio':>6}")
        for piece, impls in pieces.items():
            if args.pieces and piece not in args.pieces.split(","):
                continue
            times = {i: [] for i in impls}
            for f in impls.values():
                with torch.no_grad() if "fwd" == piece.split()[-1] and "layer" not in piece else _null():
                    f()
            for _ in range(args.rounds):
                for i, f in impls.items():
                    with torch.no_grad() if "fwd" == piece.split()[-1] and "layer" not in piece else _null():
                        t0 = clock()
                        f()
                        times[i].append(clock() - t0)
            med = {i: statistics.median(t) * 1e3 for i, t in times.items()}
            low = {i: min(t) * 1e3 for i, t in times.items()}
            print(f"{piece:16} {med['fused']:9.2f} {med['attn-only']:10.2f} {med['fused'] / med['attn-only']:6.2f}"
                  f" {low['fused']:9.2f} {low['attn-only']:10.2f} {low['fused'] / low['attn-only']:6.2f}")


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    main()

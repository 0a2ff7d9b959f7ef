"""Time the Triton jagged attention at other tile shapes than the shipped ones, on a GPU.

The shipped tiles (`gem_kernels.triton.attention._launch_config`) were chosen from register counts
without a GPU (scripts/triton_compile_check.py). This script answers the open question in one short
run: at the bench's headline shape (max_seq_len 1024, 50% dense, H = 4, D = 128, bf16), how fast are
the forward (both kinds) and the HSTU backward at a few tile shapes, warps and pipeline stages? Each
config's output is checked against the shipped config's before its time is printed. Lines are printed
(flushed) as they are measured, so a run cut short by its timeout still reports what it did.

Usage:  python scripts/attention_tiles.py [--budget 40]     (GPU; scripts/gpu_check.sh runs it)
        python scripts/attention_tiles.py --smoke           (CPU: Triton interpreter, tiny shape, no timings)
The forward may use BLOCK_M != BLOCK_N; the backward's tiles stay square (the deterministic pos_bias
gradient needs it), so it is timed at square sizes only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (BLOCK_M, BLOCK_N, num_warps, num_stages or None for Triton's default); the shipped one is first.
# Compiled for sm_90a (bf16, D = 128): 128 x 64 at 8 warps fits in 255 registers; 128 x 128 / 8 warps
# and 128 x 32 / 4 warps spill 150-230 B per thread, so they are left out.
FWD_CONFIGS = [(64, 64, 8, None), (128, 64, 8, None), (128, 64, 8, 2), (64, 64, 4, None)]
BWD_CONFIGS = [(64, 8), (64, 4), (32, 4)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=40.0, help="stop starting new configs after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="CPU check of the script itself (interpreter)")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.budget = float("inf")  # a check of every config, however slow the host
    sys.path.insert(0, ROOT)
    import torch
    import triton

    from gem_kernels import flops as gk_flops
    from gem_kernels.triton import attention as tri

    start = time.perf_counter()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    H, D = (2, 16) if args.smoke else (4, 128)
    max_len, num_seqs = (150, 3) if args.smoke else (1024, 128)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(max_len // 4, 3 * max_len // 4 + 1, (num_seqs,), generator=gen)
    lengths[0] = max_len
    offsets = torch.zeros(num_seqs + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    q, k, v, do = (torch.randn(n, H, D, generator=gen).to(device=device, dtype=dtype) for _ in range(4))
    offsets = offsets.to(device)
    scale = D ** -0.5
    print(f"attention tiles: N={n} B={num_seqs} max_seq_len={max_len} H={H} D={D} {dtype}, "
          f"{'interpreter smoke run' if args.smoke else torch.cuda.get_device_name()}", flush=True)

    def timed(fn) -> float:
        if args.smoke:
            fn()
            return float("nan")
        return triton.testing.do_bench(fn, warmup=10, rep=40)

    def fwd(kind, bm, bn, warps, stages):
        out = torch.empty_like(v)
        lse = torch.empty((n, H) if kind == "softmax" else (0,), dtype=torch.float32, device=device)
        launch = tri._common(q, v, offsets, max_len, kind, True, scale, None, 0, 0, None, None, None, None)
        launch.update(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
        if stages is not None:
            launch["num_stages"] = stages
        q_blocks = triton.cdiv(max_len, bm)
        tri._jagged_attention_fwd_kernel[(q_blocks * num_seqs * H,)](q, k, v, out, lse if kind == "softmax" else out,
                                                                   q_blocks=q_blocks, delta=0, **launch)
        return out, lse

    def check(name, got, want) -> bool:
        err = float((got.float() - want.float()).abs().max())
        ok = err <= 2e-2 * float(want.float().abs().max()) + 1e-6  # bf16 outputs, other summation orders
        if not ok:
            print(f"  {name}: WRONG (max abs diff {err:.3g}); not timed", flush=True)
        return ok

    def out_of_time() -> bool:
        if time.perf_counter() - start > args.budget:
            print(f"  budget of {args.budget:.0f} s spent: stopped", flush=True)
            return True
        return False

    def forward_phase(kind) -> bool:
        flop, _ = gk_flops.jagged_attention(offsets.cpu(), H, D, D, 2, causal=True, backward=False)
        want, _ = fwd(kind, *FWD_CONFIGS[0])
        for config in FWD_CONFIGS:
            if out_of_time():
                return False
            name = f"{kind} fwd BLOCK_M={config[0]} BLOCK_N={config[1]} warps={config[2]} stages={config[3] or 'dflt'}"
            try:
                if not check(name, fwd(kind, *config)[0], want):
                    continue
                ms = timed(lambda: fwd(kind, *config))
                print(f"  {name}: {ms:.3f} ms, {flop / ms / 1e9:.0f} TFLOP/s", flush=True)
            except Exception as exc:  # an out-of-resources config is a finding, not the end of the run
                print(f"  {name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
        return True

    # In the order of what the goals ask first: HSTU forward, HSTU backward, softmax forward.
    if not forward_phase("hstu"):
        return 0
    # HSTU backward (the bench's fwd+bwd), square tiles via _launch_config.
    fwd_flop, _ = gk_flops.jagged_attention(offsets.cpu(), H, D, D, 2, causal=True)
    flop = gk_flops.jagged_attention(offsets.cpu(), H, D, D, 2, causal=True, backward=True)[0] - fwd_flop
    out, lse = fwd("hstu", *FWD_CONFIGS[0])
    shipped = tri._launch_config

    def bwd():
        return tri.jagged_attention_bwd(do, q, k, v, out, lse, offsets, max_len, "hstu", True, scale, None, 0, 0,
                                        None, None, None, None, False)

    want = bwd()
    try:
        for block, warps in BWD_CONFIGS:
            if out_of_time():
                return 0
            name = f"hstu bwd BLOCK={block} warps={warps}"
            tri._launch_config = lambda dtype, block_d, block_dv, b=block, w=warps: (b, w)
            try:
                got = bwd()
                if not all(check(f"{name} d{x}", g, w) for x, g, w in zip("qkv", got[:3], want[:3])):
                    continue
                ms = timed(bwd)
                print(f"  {name}: {ms:.3f} ms, {flop / ms / 1e9:.0f} TFLOP/s (bwd FLOPs)", flush=True)
            except Exception as exc:
                print(f"  {name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
    finally:
        tri._launch_config = shipped
    forward_phase("softmax")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bench of the attention family: jagged attention (softmax and HSTU), forward and forward+backward.

B sequences with lengths drawn so the batch is ~50% dense against max_seq_len, and a 95%-sparse
case like generative-recommenders' bench; H = 4, D = 128; fp32 on the CPU, bf16 on a GPU. FLOPs
count the visible work of the real sequences only (gem_kernels.flops.jagged_attention).

Peers: `reference` (gem_kernels' padded eager twin: pad, mask, fp32 maths), `sdpa`
(scaled_dot_product_attention on inputs padded beforehand, with the visibility mask and biases as an
additive float mask; the padding itself is not timed, which flatters it), `nested` (nested-tensor
SDPA; it runs only without a mask, so only on the non-causal case), `flex` (FlexAttention on the
packed input [1, H, N, D] with a document-id mask_mod, causal as the case, the block mask built once
per batch beforehand and not timed, like sdpa's mask; `torch.compile(flex_attention, dynamic=True)`
as jagged users compile it, since N changes every batch: one compile serves every case). Flex runs
on the softmax kind without bias (the visibility of those cases is exactly the document mask, + causal);
on the CPU torch has its forward only (the backward raises), so fwd+bwd cases note it absent. HSTU
has no SDPA form: its baseline is the padded eager reference.

Verification: every impl's output, and in fwd+bwd cases its gradients (q, k, v and the biases, for
one random grad_output per input set), are held to FlashAttention's rule before timing: at most
twice the eager side's error against the eager side run in float64. The eager side is SDPA for
softmax (its float64 run: SDPA on float64 copies of the first input set) and the padded reference
twin for HSTU (its float64 run: the twin in float64). SDPA's output and gradients are unpadded
inside its timed call (a jagged caller needs them jagged); flex is compiled and primed on each input
set before timing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import gem_kernels as gk
from .harness import Case, rotate
from gem_kernels import flops as gk_flops
from gem_kernels.reference import attention as ref

H, D = 4, 128
NUM_BUCKETS = 32
# Compiled lazily on the first flex call (torch.compile itself is cheap; the first call compiles).
_flex_compiled = torch.compile(flex_attention, dynamic=True)


def _lengths(num_seqs: int, max_seq_len: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """Lengths with mean ~density * max_seq_len: uniform in [0.5, 1.5] x the mean (dense: one sequence
    at the max, so the padded peers do no more work than max_seq_len needs)."""
    mean = density * max_seq_len
    lo, hi = max(1, int(mean * 0.5)), min(max_seq_len, int(mean * 1.5) + 1)
    lengths = torch.randint(lo, hi + 1, (num_seqs,), generator=gen).clamp(max=max_seq_len)
    if density >= 0.5:
        lengths[0] = max_seq_len
    return lengths


def _inputs(lengths, max_seq_len, dtype, device, with_bias, seed, h=H, d=D):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device).requires_grad_(True)

    args = dict(q=rnd(n, h, d), k=rnd(n, h, d), v=rnd(n, h, d), seq_offsets=offsets.to(device),
                max_seq_len=max_seq_len)
    if with_bias:
        args["pos_bias"] = (0.1 * torch.randn(h, 2 * max_seq_len - 1, generator=gen)).to(device).requires_grad_(True)
        args["time_bias"] = (0.1 * torch.randn(h, NUM_BUCKETS + 1, generator=gen)).to(device).requires_grad_(True)
        args["timestamps"] = torch.randint(0, 10**7, (n,), generator=gen).sort().values.to(device)
    return args


def _padded_sdpa_inputs(args, causal):
    """q, k, v padded to [B, H, M, D] and the additive float mask [B, H or 1, M, M] (built once, untimed)."""
    m = args["max_seq_len"]
    offsets = args["seq_offsets"]
    with torch.no_grad():
        # aten's padding (independent of the kernels under test, and it takes the float64 run's inputs)
        padded = [torch.ops.aten._jagged_to_padded_dense_forward(args[n].detach().flatten(1), [offsets], [m], 0.0)
                  .view(-1, m, H, D).transpose(1, 2).contiguous().requires_grad_(True) for n in ("q", "k", "v")]
        lengths = offsets.long().diff()
        valid = ref.visibility_mask(lengths, m, causal=causal, num_targets=None, contextual_len=0, max_attn_len=0)
        # Padding rows see themselves so no softmax row is empty (their output is discarded anyway).
        valid = valid | torch.eye(m, dtype=torch.bool, device=valid.device)
        mask = torch.zeros(valid.shape, dtype=args["q"].dtype, device=valid.device).masked_fill(~valid, float("-inf"))
        mask = mask.unsqueeze(1)
        if "pos_bias" in args:
            rel = torch.arange(m, device=mask.device)
            rel = rel.view(1, -1) - rel.view(-1, 1) + m - 1
            tp, _ = ref._pad(args["timestamps"], offsets, m)
            buckets = ref.time_buckets(tp.unsqueeze(2) - tp.unsqueeze(1), NUM_BUCKETS)
            bias = args["pos_bias"][:, rel].unsqueeze(0) + args["time_bias"][:, buckets].transpose(0, 1)
            mask = (mask + bias.to(mask.dtype)).detach()
    return padded, mask


def _flex_missing(device: torch.device, backward: bool, quick: bool) -> str | None:
    """Why the FlexAttention peer cannot run this case here, or None."""
    if quick:
        # Measured on the 2-core CPU with an empty inductor cache: the first call compiles for 13-19 s,
        # and the --quick budget of the whole family is 9 s. A warm cache would hide it; a bench
        # cannot count on one.
        return "FlexAttention: not in --quick (its first call compiles for 13-19 s cold, past the quick budget)"
    if backward:
        # Ask torch itself (eager flex validates the device before any work): the message is the reason.
        x = torch.zeros(1, 1, 16, 16, device=device, requires_grad=True)
        try:
            flex_attention(x, x, x)
        except NotImplementedError as exc:
            return f"FlexAttention fwd+bwd absent: {exc}"
    return None


def _flex_inputs(args, causal, backward):
    """q, k, v as [1, H, N, D] leaves and the block mask of the jagged document mask (+ causal), built
    once per batch, untimed. The leaves require grad only for fwd+bwd: CPU flex refuses any input that
    does, even under no_grad."""
    offsets = args["seq_offsets"]
    n = args["q"].shape[0]
    with torch.no_grad():
        packed = [args[name].detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_(backward)
                  for name in ("q", "k", "v")]
        doc = torch.repeat_interleave(torch.arange(offsets.numel() - 1, device=offsets.device),
                                      offsets.long().diff(), output_size=n)

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    block_mask = create_block_mask(mask_mod, 1, 1, n, n, device=offsets.device)
    return packed, block_mask


def _fwd(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


def _fwd_bwd(fn, grad_leaves, grad_out, unpad=lambda t: t):
    """One forward + backward: (output, gradients of ``grad_leaves``), both through ``unpad`` (the
    padded and packed peers return the jagged layout, so that they compare with the others)."""
    def run():
        out = fn()
        grads = torch.autograd.grad(out, grad_leaves, grad_out)
        return unpad(out.detach()), [unpad(g) for g in grads]
    return run


def cases(quick: bool, device: torch.device) -> Iterator[Case]:
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if quick:
        configs = [(128, 4, 0.5)]
    elif on_gpu:
        # The headline shapes first (50% dense, 1024 then 4096): a budget-limited run keeps them.
        configs = [(m, max(4, 2 * 65536 // m), density) for density in (0.5, 0.05) for m in (1024, 4096, 256)]
    else:
        # (max_seq_len, B, density): sized so the whole family fits a few minutes on a small CPU.
        configs = [(256, 16, 0.5), (256, 16, 0.05), (1024, 4, 0.5), (1024, 4, 0.05)]
    gen = torch.Generator().manual_seed(0)
    for max_seq_len, num_seqs, density in configs:
        lengths = _lengths(num_seqs, max_seq_len, density, gen)
        real_density = float(lengths.float().mean()) / max_seq_len
        variants = [("softmax", False, True), ("hstu", True, True)]
        if max_seq_len == 1024 and density == 0.5 and not quick:
            variants.append(("softmax", False, False))  # non-causal: the one nested-tensor SDPA can run
        for kind, with_bias, causal in variants:
            sets = [_inputs(lengths, max_seq_len, dtype, device, with_bias, seed) for seed in range(2)]
            for seed, args in enumerate(sets):
                g = torch.Generator().manual_seed(100 + seed)
                args["grad_out"] = torch.randn(args["q"].shape, generator=g).to(dtype=dtype, device=device)
            for backward in (False, True) if causal else (False,):
                yield _case(kind, with_bias, causal, backward, sets, lengths, max_seq_len, real_density, device, dtype,
                        quick)
    if not quick and not on_gpu:
        yield from _model_shape_cases(device, dtype)


def model_call_inputs(device, dtype):
    """The GEM small model's HSTU call (model/config.py `small`): 256 users of 2 contextual tokens +
    a lognormal history (median 24, log-std 0.8, at most 64) + 1..8 candidates as targets; H = 2,
    D = 16, causal, position and time bias. Returns (lengths, max_seq_len, two input sets with their
    grad_out) for the bench cases and scripts/attention_model_call.py."""
    gen = torch.Generator().manual_seed(1)
    history = torch.exp(torch.randn(256, generator=gen) * 0.8 + math.log(24.0)).round().clamp(0, 64).long()
    targets = torch.randint(1, 9, (256,), generator=gen)
    lengths = 2 + history + targets
    max_seq_len = 2 + 64 + 8
    sets = []
    for seed in range(2):
        args = _inputs(lengths, max_seq_len, dtype, device, True, seed, h=2, d=16)
        args.update(num_targets=targets.to(device), contextual_len=2)
        args["grad_out"] = torch.randn(args["q"].shape, generator=torch.Generator().manual_seed(100 + seed)).to(
            dtype=dtype, device=device)
        sets.append(args)
    return lengths, max_seq_len, sets


def _model_shape_cases(device, dtype) -> Iterator[Case]:
    """HSTU at the GEM model's own call (model_call_inputs): short sequences, where per-row and
    per-item costs, not the products, decide the time (the cpu kernel's short path)."""
    lengths, max_seq_len, sets = model_call_inputs(device, dtype)
    density = float(lengths.float().mean()) / max_seq_len
    for backward in (False, True):
        yield _case("hstu", True, True, backward, sets, lengths, max_seq_len, density, device, dtype, False, h=2, d=16,
                    label="GEM small model's call, contextual 2 + targets")


def _case(kind, with_bias, causal, backward, sets, lengths, max_seq_len, density, device, dtype, quick, h=H, d=D,
          label="") -> Case:
    args0 = sets[0]
    flops, nbytes = gk_flops.jagged_attention(args0["seq_offsets"].cpu(), h, d, d, torch.finfo(dtype).bits // 8,
                                              causal=causal, backward=backward)

    def wrap(fn, leaves, grad_out=None, unpad=lambda t: t):
        return _fwd_bwd(fn, leaves, grad_out, unpad) if backward else _fwd(fn)

    def make(args, backend, deterministic=False):
        leaves = [t for n, t in args.items() if n in ("q", "k", "v", "pos_bias", "time_bias")]
        op_args = {n: t for n, t in args.items() if n != "grad_out"}  # the model cases' mask options too
        return wrap(lambda: gk.jagged_attention(**op_args, kind=kind, causal=causal, backend=backend,
                                                deterministic=deterministic), leaves, args["grad_out"])

    def ours(backend, deterministic=False):
        return _cycle([make(a, backend, deterministic) for a in sets])

    impls, notes = {}, []
    if device.type == "cpu":
        impls["cpu"] = ours("cpu")
    else:
        impls["triton"] = ours("triton")
        impls["cuda"] = ours("cuda")
        if with_bias and backward:
            # Which bias-gradient path is faster on a GPU is open: one fp32 atomic per visible pair
            # (same-address contention: a 64 x 64 tile adds 4096 values into 127 pos_bias and
            # num_buckets + 1 time_bias entries) against per-tile sums written once and reduced after.
            impls["triton-det"] = ours("triton", deterministic=True)
            notes.append("triton and cuda bias gradients use fp32 atomics (deterministic=False); "
                         "triton-det: deterministic=True (per-tile sums to scratch, fixed-order reduce)")
    # The padded eager twin is the HSTU baseline; for softmax (where SDPA is the baseline) it runs at
    # the short length only: at 1024 it takes seconds per call and says nothing new.
    if kind == "hstu" or max_seq_len <= 256:
        impls["reference"] = ours("reference")
    baseline = "reference"

    def fp64():  # the eager side's float64 run (see the module docstring), on the first input set
        return (sdpa_call if kind == "softmax" else lambda a: make(a, "reference"))(_fp64_args(args0))()

    if kind == "softmax":
        seq_ids, pos = ref._pad(args0["q"].detach(), args0["seq_offsets"], max_seq_len)[1]

        def unpad(t):  # [B, H, M, D] -> jagged [N, H, D]
            return t.transpose(1, 2)[seq_ids, pos]

        def sdpa_call(args):
            (q, k, v), mask = _padded_sdpa_inputs(args, causal)
            # The padded grad_output is zero at padded positions: they add nothing to the gradients.
            grad_out = torch.zeros_like(q)
            grad_out.transpose(1, 2)[seq_ids, pos] = args["grad_out"]
            if backward:
                return wrap(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), [q, k, v], grad_out,
                            unpad)
            # Forward: unpad the output too (a jagged caller needs it; also lets the harness verify it).
            return wrap(lambda: unpad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)), [q, k, v])
        impls["sdpa"] = _cycle([sdpa_call(a) for a in sets])
        baseline = "sdpa"
        if not causal and not with_bias:
            def nested_call(args):
                nts = [torch.nested.nested_tensor_from_jagged(args[n], args["seq_offsets"]).transpose(1, 2)
                       for n in ("q", "k", "v")]

                def fn():
                    return F.scaled_dot_product_attention(*nts).transpose(1, 2).values()
                return wrap(fn, [args["q"], args["k"], args["v"]])
            impls["nested"] = _cycle([nested_call(a) for a in sets])
        else:
            notes.append("nested-tensor SDPA runs only without a mask (no causal, no bias): absent")
        flex_missing = _flex_missing(device, backward, quick)
        if flex_missing is None:
            def unpack(t):  # [1, H, N, D] -> jagged [N, H, D]
                return t[0].transpose(0, 1)

            def flex_call(args):
                (q, k, v), block_mask = _flex_inputs(args, causal, backward)
                if backward:
                    grad_out = args["grad_out"].transpose(0, 1).unsqueeze(0)
                    return wrap(lambda: _flex_compiled(q, k, v, block_mask=block_mask), [q, k, v], grad_out, unpack)
                # Forward: back to the jagged [N, H, D] layout, as the other impls return it.
                return wrap(lambda: unpack(_flex_compiled(q, k, v, block_mask=block_mask)), [q, k, v])
            impls["flex"] = _cycle([flex_call(a) for a in sets])
        else:
            notes.append(flex_missing)
    else:
        notes.append("HSTU (SiLU weights) has no SDPA form: baseline is the padded eager reference")
    bias_txt = " +pos/time bias" if with_bias else ""
    shape = (f"B={lengths.numel()} max_seq_len={max_seq_len} dense={density:.2f} H={h} D={d} "
             f"{'causal' if causal else 'full'}{bias_txt}{', ' + label if label else ''}")
    return Case(op=f"jagged_attention_{kind}_{'fwd_bwd' if backward else 'fwd'}", shape=shape, dtype=dtype,
                flops=flops, bytes=nbytes, impls=impls, baseline=baseline, peak="matmul", notes=notes,
                reference=baseline, fp64=fp64, compiled=[n for n in impls if n == "flex"])


def _fp64_args(args: dict) -> dict:
    """The input set with float64 leaf copies of its float tensors (the float64 run's inputs)."""
    return {n: t.detach().double().requires_grad_(t.requires_grad) if torch.is_tensor(t) and t.is_floating_point()
            else t for n, t in args.items()}


def _cycle(calls):
    """One zero-arg callable that runs the next prepared input set each call (rotate() over callables)."""
    return rotate([(c,) for c in calls], lambda c: c())

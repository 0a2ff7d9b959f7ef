"""Bench of the hstu_layer family: one whole HSTU layer (generative-recommenders' STULayer: input
LayerNorm, UVQK projection, SiLU, HSTU attention, Norm(attn) * u gating, output projection over
concat(u, attn, y), residual), forward and forward+backward, at history lengths 256, 1024 and 4096.

Impls: every gem_kernels backend of the device (``gem_kernels.ops.hstu_layer.hstu_layer``: the fused
projection halves around the fused attention, all on that backend), "attn-only" (torch ops around
gem_kernels' attention on the same backend: what gk.nn.HSTULayer fused before this family existed),
and "eager" (the baseline: the layer built from torch ops, ``gem_kernels.reference.hstu_layer.stu_layer``
with its padded attention, autograd for the backward). Every impl's output and gradients (x and the
seven weights) are held to FlashAttention's rule against the eager layer run in float64 before timing.

The projection halves alone, at the GEM model's `small` shape (model/config.py: 2 heads of linear
and attention dim 16 over D = 32, silu_qkv, no concat; 8704 tokens, ~256 users x 34): each of the four
ops (hstu_uvqk fwd / bwd, hstu_output fwd / bwd) against its reference twin, the backward ops called
alone on saved inputs, FLOPs the GEMMs' (gem_kernels.flops.hstu_uvqk / hstu_output). CPU only (the
small model's shape); first in a full run, so the slow eager layer at 4096 never leaves them out of
the family's budget; last with --quick (256 tokens), after the layer's two cases, which its 9 s
budget covered before.

Layer shape: D = 256, H = 4, linear_dim = attention_dim = 64 (K = 3 * 256), fp32 on the CPU, bf16 on a GPU;
lengths ~50% dense against the history length (bench.attention's draw, one sequence at the full
length), B = 4096 / history sequences on the CPU (16384 / history on a GPU). --quick: history 128,
B = 4.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

import gem_kernels as gk
from gem_kernels import flops as gk_flops
from gem_kernels._backend import FAMILIES, kernel
from gem_kernels.ops import hstu_layer as ops
from gem_kernels.ops.attention import IMPLEMENTED as ATTENTION_BACKENDS
from gem_kernels.reference import attention as ref_attention
from gem_kernels.reference import hstu_layer as ref

from .attention import _lengths
from .harness import Case, rotate

LAYER_BACKENDS = FAMILIES[ops.FAMILY].implemented

# The eager layer at history 4096 takes seconds per fwd+bwd call on a 2-core CPU (its padded
# [B, H, 4096, 4096] scores, also in float64 for the verification): the default share of 110 s
# would stop before that case.
FAMILY_BUDGET = {False: 240.0, True: 9.0}
DIM, HEADS, LINEAR_DIM, ATTENTION_DIM = 256, 4, 64, 64
PARAM_NAMES = ("input_norm_weight", "input_norm_bias", "uvqk_weight", "uvqk_bias", "output_norm_weight",
               "output_norm_bias", "output_weight")
LAYER = dict(num_heads=HEADS, linear_dim=LINEAR_DIM, attention_dim=ATTENTION_DIM)


def _params(dtype, device, gen):
    width = HEADS * LINEAR_DIM
    num_out = HEADS * (2 * LINEAR_DIM + 2 * ATTENTION_DIM)

    def rnd(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=gen)).to(dtype=dtype, device=device)

    values = (rnd(DIM, scale=0.1, shift=1.0), rnd(DIM, scale=0.1), rnd(DIM, num_out, scale=DIM ** -0.5),
              rnd(num_out, scale=0.1), rnd(width, scale=0.1, shift=1.0), rnd(width, scale=0.1),
              rnd(3 * width, DIM, scale=(3 * width) ** -0.5))
    return {name: v.requires_grad_(True) for name, v in zip(PARAM_NAMES, values)}


def _attn_only(backend):
    """The layer as torch ops around gem_kernels' attention (autograd through the projections)."""
    def layer(x, seq_offsets, max_seq_len, **p):
        u_pre, v, q, k = ref.uvqk(x, p["input_norm_weight"], p["input_norm_bias"], 1e-6, p["uvqk_weight"],
                                  p["uvqk_bias"], HEADS, LINEAR_DIM, ATTENTION_DIM, False)
        attn = gk.jagged_attention(q, k, v, seq_offsets, max_seq_len, kind="hstu", backend=backend)
        return ref.output(attn.reshape(x.shape[0], -1), u_pre, x, p["output_norm_weight"], p["output_norm_bias"],
                          1e-6, p["output_weight"], None, None, HEADS, False, True, True)
    return layer


def _call(layer, backward):
    """fn(x, seq_offsets, max_seq_len, grad_out, params) -> output, or (output, gradients of x and params)."""
    def run(x, seq_offsets, max_seq_len, grad_out, params):
        if not backward:
            with torch.no_grad():
                return layer(x, seq_offsets, max_seq_len, **params)
        out = layer(x, seq_offsets, max_seq_len, **params)
        return out.detach(), torch.autograd.grad(out, [x, *params.values()], grad_out)
    return run


def _backends(device: torch.device) -> list[str]:
    # On the CPU only the cpu backend: the Triton interpreter is a correctness tool, far too slow.
    wanted = ("cuda", "triton") if device.type == "cuda" else ("cpu",)
    available = gk.available_backends()
    return [b for b in wanted if b in available and b in ATTENTION_BACKENDS and b in LAYER_BACKENDS]


# The small model's layer (model/config.py GemConfig.small, model/archs.py SequenceArch).
MODEL_DIM, MODEL_HEADS, MODEL_LINEAR_DIM, MODEL_ATTENTION_DIM, MODEL_TOKENS = 32, 2, 16, 16, 8704


def _projection_cases(quick: bool, device: torch.device) -> Iterator[Case]:
    """The four projection ops at the small model's shape, cpu against the reference twin."""
    n = 256 if quick else MODEL_TOKENS
    d, h, lin, att = MODEL_DIM, MODEL_HEADS, MODEL_LINEAR_DIM, MODEL_ATTENTION_DIM
    width, num_out, eps = h * lin, h * (2 * lin + 2 * att), 1e-6
    gen = torch.Generator().manual_seed(1)

    def rnd(*shape, scale=1.0, shift=0.0):
        return shift + scale * torch.randn(*shape, generator=gen)

    def inputs():
        x = rnd(n, d)
        stats = ref._norm_stats(x, 1, eps)
        attn, u_pre = rnd(n, width), rnd(n, width)
        return dict(x=x, nw=rnd(d, scale=0.1, shift=1.0), nb=rnd(d, scale=0.1), w=rnd(d, num_out, scale=d ** -0.5),
                    b=rnd(num_out, scale=0.1), stats=stats, grads=(rnd(n, width), rnd(n, h, lin), rnd(n, h, att),
                                                                  rnd(n, h, att)),
                    attn=attn, u_pre=u_pre, onw=rnd(width, scale=0.1, shift=1.0), onb=rnd(width, scale=0.1),
                    ow=rnd(width, d, scale=width ** -0.5), grad_out=rnd(n, d),
                    out_stats=ref._norm_stats(attn, 1, eps))

    calls = {  # op: a function of (backend function, inputs) -> outputs
        "hstu_uvqk_fwd": lambda f, t: f(t["x"], t["nw"], t["nb"], eps, t["w"], t["b"], h, lin, att, True),
        "hstu_uvqk_bwd": lambda f, t: f(*t["grads"], t["x"], t["nw"], t["nb"], eps, t["w"], t["b"], t["stats"], h,
                                        lin, att, True),
        "hstu_output_fwd": lambda f, t: f(t["attn"], t["u_pre"], t["x"], t["onw"], t["onb"], eps, t["ow"], None,
                                          None, h, False, False, False),
        "hstu_output_bwd": lambda f, t: f(t["grad_out"], t["attn"], t["u_pre"], t["onw"], t["onb"], eps, t["ow"],
                                          False, None, t["out_stats"], h, False, False, False),
    }
    sets = [inputs() for _ in range(2)]
    sets64 = {k: (tuple(t.double() for t in v) if isinstance(v, tuple) else
                  v if k in ("stats", "out_stats") else v.double()) for k, v in sets[0].items()}
    shape = (f"model small: tokens={n} D={d} H={h} linear_dim={lin} attention_dim={att} silu_qkv, no concat")
    for op, call in calls.items():
        backward = op.endswith("bwd")
        if op.startswith("hstu_uvqk"):
            fl, nb = gk_flops.hstu_uvqk(n, d, h, lin, att, 4, backward=backward)
        else:
            fl, nb = gk_flops.hstu_output(n, d, h, lin, 4, concat_u=False, concat_x=False, backward=backward)
        impls = {b: rotate([(t,) for t in sets], lambda t, f=kernel(ops.FAMILY, op, b), call=call: call(f, t))
                 for b in _backends(device)}
        impls["eager"] = rotate([(t,) for t in sets],
                                lambda t, f=kernel(ops.FAMILY, op, "reference"), call=call: call(f, t))
        yield Case(op=op.replace("_fwd", " fwd").replace("_bwd", " bwd"), shape=shape, dtype=torch.float32,
                   flops=fl, bytes=nb, impls=impls, baseline="eager", peak="matmul", reference="eager",
                   fp64=lambda call=call, op=op: call(kernel(ops.FAMILY, op, "reference"), sets64))


def cases(quick: bool, device: torch.device) -> Iterator[Case]:
    if device.type == "cpu" and not quick:
        yield from _projection_cases(quick, device)
    yield from _layer_cases(quick, device)
    if device.type == "cpu" and quick:
        yield from _projection_cases(quick, device)


def _layer_cases(quick: bool, device: torch.device) -> Iterator[Case]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = 16384 if device.type == "cuda" else 4096
    histories = [128] if quick else [256, 1024, 4096]
    gen = torch.Generator().manual_seed(0)
    params = _params(dtype, device, gen)
    params64 = {n: p.detach().double().requires_grad_(True) for n, p in params.items()}
    elem = torch.finfo(dtype).bits // 8
    for history in histories:
        num_seqs = 4 if quick else max(1, tokens // history)
        lengths = _lengths(num_seqs, history, 0.5, gen)
        offsets = torch.zeros(num_seqs + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        n = int(offsets[-1])
        offsets = offsets.to(device)
        sets = [(torch.randn(n, DIM, generator=gen).to(dtype=dtype, device=device).requires_grad_(True), offsets,
                 history, torch.randn(n, DIM, generator=gen).to(dtype=dtype, device=device), params)
                for _ in range(2)]
        x64, _, _, grad64, _ = sets[0]
        x64, grad64 = x64.detach().double().requires_grad_(True), grad64.double()
        shape = (f"B={num_seqs} history={history} tokens={n} D={DIM} H={HEADS} linear_dim={LINEAR_DIM} "
                 f"attention_dim={ATTENTION_DIM}")
        for backward in (False, True):
            layers = {b: lambda *a, b=b, **p: ops.hstu_layer(*a, **p, **LAYER, backend=b) for b in _backends(device)}
            layers.update({"attn-only": _attn_only(_backends(device)[0]), "eager": _eager})
            fl, nb = gk_flops.hstu_layer(offsets.cpu(), DIM, HEADS, LINEAR_DIM, ATTENTION_DIM, elem, backward=backward)
            yield Case(op=f"hstu_layer {'fwd+bwd' if backward else 'fwd'}", shape=shape, dtype=dtype, flops=fl,
                       bytes=nb, impls={name: rotate(sets, _call(fn, backward)) for name, fn in layers.items()},
                       baseline="eager", peak="matmul", reference="eager",
                       fp64=lambda backward=backward: _call(_eager, backward)(x64, offsets, history, grad64,
                                                                             params64),
                       notes=[] if device.type == "cpu" else
                       ["cuda: fp32 CUDA-core GEMM tiles (triton's run on the tensor cores)"])


def _eager(x, seq_offsets, max_seq_len, **p):
    return ref.stu_layer(x, seq_offsets, max_seq_len, None, **p, **LAYER,
                         attn_alpha=ref_attention.default_scale(ATTENTION_DIM))

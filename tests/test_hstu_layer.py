"""The fused HSTU layer (gem_kernels.ops.hstu_layer, gk.nn.HSTULayer).

Three checks, each able to fail on its own:
- the reference twin (gem_kernels.reference.hstu_layer) against the plain-torch layer written out
  below, in float64 (so CI on a clean clone pins the twin's maths without generative-recommenders);
- the fused op on every backend here, output and every gradient, by FlashAttention's rule against
  the twin's float64 run (at most twice the fp32 twin's error, plus a rounding atol);
- gk.nn.HSTULayer.from_generative_recommenders(stu_layer) against generative-recommenders' own
  STULayer on its PyTorch path (imported from $GENERATIVE_RECOMMENDERS_PATH, default /tmp/gr; skipped
  with the reason where it is not there).
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import gem_kernels as gk
from gem_kernels.ops import hstu_layer as ops
from gem_kernels.reference import float64_ground_truth
from gem_kernels.reference import hstu_layer as ref

from .utils import (CUDA_EMULATION, run_on_vector_path, assert_close_vs_eager, cpu_kernel_only, device_backend_params, interpreter_rounding_factor,
                    offsets_from_lengths, poison_allocator, reference_params, rounding_atol)

# The backends of the tests on CPU tensors (triton: the interpreter, where there is no GPU); the
# FlashAttention-rule tests also run triton and cuda on CUDA tensors where there is one. cpu: under
# GK_CUDA_EMU=1 its kernels are csrc/cuda/hstu_layer.cu's (tests/cuda_emu).
KERNEL_PARAMS = device_backend_params()
BACKENDS = [pytest.param("reference", id="reference")] + [
    pytest.param(p.values[1], marks=p.marks, id=p.values[1]) for p in KERNEL_PARAMS if p.values[0] == "cpu"]
PARAM_NAMES = ("input_norm_weight", "input_norm_bias", "uvqk_weight", "uvqk_bias", "output_norm_weight",
               "output_norm_bias", "output_weight", "output_bias")
LENGTHS = (5, 0, 9, 1, 3)


def _layer_inputs(seed, *, dim=24, heads=2, linear_dim=8, attention_dim=4, group_norm=False, concat_u=True,
                  concat_x=True, output_bias=False, lengths=LENGTHS, targets=True):
    """(x, seq_offsets, max_seq_len, num_targets, params, grad_out), fp32, with non-trivial norm weights."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    width = heads * linear_dim
    num_out = heads * (2 * linear_dim + 2 * attention_dim)
    k = width * (1 + concat_u + concat_x)
    norm_size = heads if group_norm else width
    params = dict(input_norm_weight=1 + randn(dim, scale=0.2), input_norm_bias=randn(dim, scale=0.2),
                  uvqk_weight=randn(dim, num_out, scale=dim ** -0.5), uvqk_bias=randn(num_out, scale=0.2),
                  output_norm_weight=1 + randn(norm_size, scale=0.2), output_norm_bias=randn(norm_size, scale=0.2),
                  output_weight=randn(k, dim, scale=k ** -0.5))
    if output_bias:
        params["output_bias"] = randn(dim, scale=0.2)
    offsets = offsets_from_lengths(lengths)
    n = int(offsets[-1])
    num_targets = torch.tensor([min(2, length) for length in lengths]) if targets else None
    return randn(n, dim), offsets, max(lengths), num_targets, params, randn(n, dim)


def _run(fn, x, offsets, max_seq_len, num_targets, params, grad_out, dtype):
    """(out, dx, d<param> for each param), every tensor a fresh leaf in ``dtype``."""
    leaves = [x.to(dtype).requires_grad_(True)] + [p.to(dtype).requires_grad_(True) for p in params.values()]
    out = fn(leaves[0], offsets, max_seq_len, num_targets, **dict(zip(params, leaves[1:])))
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out.to(dtype))]


# ---------------------------------------------------------------------------------------------
# The plain-torch layer: generative-recommenders' STULayer maths, one sequence and one query at a time
# ---------------------------------------------------------------------------------------------


def _visible(n, i, j, num_targets, contextual_len, max_attn_len):
    """Whether query i sees key j in a causal sequence of n (GR's _get_valid_attn_mask rule): positions
    are ids clamped to the last history id (targets see the history and themselves), the contextual
    prefix shares id 0 and sees every history position."""
    def pos(t):
        p = max(t - contextual_len + 1, 0) if contextual_len > 0 else t
        return min(p, last)

    last = (n - contextual_len + 1 if contextual_len > 0 else n) - num_targets
    dist = pos(i) - pos(j)
    seen = i == j or dist > 0
    if max_attn_len > 0:
        seen = seen and dist <= max_attn_len
    if contextual_len > 0 and pos(i) == 0 and pos(j) < last:
        seen = True
    return seen


def _plain_layer(x, offsets, max_seq_len, num_targets, *, input_norm_weight, input_norm_bias, uvqk_weight, uvqk_bias,
                 output_norm_weight, output_norm_bias, output_weight, output_bias=None, num_heads, linear_dim,
                 attention_dim, attn_alpha=None, contextual_len=0, max_attn_len=0, silu_qkv=False, group_norm=False,
                 concat_u=True, concat_x=True, eps=1e-6):
    h, width = num_heads, num_heads * linear_dim
    alpha = attention_dim ** -0.5 if attn_alpha is None else attn_alpha
    xn = F.layer_norm(x, (x.shape[1],), input_norm_weight, input_norm_bias, eps)
    u, v, q, k = (xn @ uvqk_weight + uvqk_bias).split([width, width, h * attention_dim, h * attention_dim], 1)
    u = F.silu(u)
    if silu_qkv:
        v, q, k = F.silu(v), F.silu(q), F.silu(k)
    q, k, v = q.view(-1, h, attention_dim), k.view(-1, h, attention_dim), v.view(-1, h, linear_dim)
    rows = []
    for b in range(len(offsets) - 1):
        s, e = int(offsets[b]), int(offsets[b + 1])
        n = e - s
        targets = 0 if num_targets is None else int(num_targets[b])
        for i in range(n):
            seen = [j for j in range(n) if _visible(n, i, j, targets, contextual_len, max_attn_len)]
            w = F.silu(torch.einsum("hd,jhd->hj", q[s + i], k[s + torch.tensor(seen, dtype=torch.long)]) * alpha)
            rows.append(torch.einsum("hj,jhd->hd", w / max_seq_len, v[s + torch.tensor(seen, dtype=torch.long)]))
    a = torch.stack(rows).reshape(-1, width) if rows else x.new_zeros((0, width))
    if group_norm:
        ah = a.view(-1, h, linear_dim)
        mean, var = ah.mean(2, keepdim=True), ah.var(2, unbiased=False, keepdim=True)
        normed = ((ah - mean) / torch.sqrt(var + eps) * output_norm_weight.view(1, h, 1)
                  + output_norm_bias.view(1, h, 1)).reshape(-1, width)
    else:
        normed = F.layer_norm(a, (width,), output_norm_weight, output_norm_bias, eps)
    c = torch.cat(([u] if concat_u else []) + ([a] if concat_x else []) + [u * normed], 1)
    out = x + c @ output_weight
    return out if output_bias is None else out + output_bias


CONFIGS = {  # name: (layer options, input options)
    "stu": (dict(), dict()),
    "stu_context_window": (dict(contextual_len=2, max_attn_len=3), dict()),
    "group_norm": (dict(group_norm=True, contextual_len=1), dict(group_norm=True)),
    "group_norm_no_concat": (dict(group_norm=True, concat_u=False, concat_x=False, max_attn_len=2),
                             dict(group_norm=True, concat_u=False, concat_x=False)),
    "concat_u_only_alpha": (dict(concat_x=False, attn_alpha=0.7), dict(concat_x=False)),
    "concat_x_only_no_targets": (dict(concat_u=False), dict(concat_u=False, targets=False)),
    "paper_block": (dict(silu_qkv=True, concat_u=False, concat_x=False),
                    dict(concat_u=False, concat_x=False, output_bias=True)),
}
DIMS = dict(num_heads=2, linear_dim=8, attention_dim=4)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_reference_twin_is_the_plain_maths(config):
    """The twin (padded attention, fused-halves split) equals the plain per-query layer, output and every
    gradient, in float64."""
    options, inputs = CONFIGS[config]
    x, offsets, max_seq_len, num_targets, params, grad_out = _layer_inputs(1, **inputs)
    twin = _run(lambda *a, **p: ref.stu_layer(*a, **p, **DIMS, **options), x, offsets, max_seq_len, num_targets,
                params, grad_out, torch.float64)
    plain = _run(lambda *a, **p: _plain_layer(*a, **p, **DIMS, **options), x, offsets, max_seq_len, num_targets,
                 params, grad_out, torch.float64)
    for name, a, b in zip(("out", "x", *params), twin, plain):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


# NOTE: under GK_CUDA_EMU=1 the cpu backend runs csrc/cuda/hstu_layer.cu's kernels in the CPU emulation,
# against the CPU's eager fp32 (MKL) as the rule's baseline (on a GPU, the GPU's own eager). Group norm
# over small groups makes the max error one draw of amplified noise: a query that sees one key gives an
# attention row w * v_j whose group of 8 has rstd ~300 (eps 1e-6), so every fp32 rounding before it comes
# out ~300x larger. The CUDA kernels' summation order draws 3.2x eager's dx error on the group_norm_no_concat
# layer at seed 0 (over seeds 0-9 the layer's dx ratio is 0.14-3.22 for them, 0.15-1.95 for triton, 0.09-1.59
# for the C++ ones; this case was a strict xfail), and on a 2-core AMD EPYC (Zen 4) the emulated output op
# reads 3.3e-6 against eager's 0.95-1.3e-6 (2.6-3.5x; n = 255 / 1100 / 2597, seed 0) and the layer's
# output_norm_weight gradient 3.00e-6 against a 2.96e-6 bound, where an Intel Xeon passes the plain rule.
# The emulation checks the CUDA code's indexing, masking and reductions, whose faults are O(1) errors: its
# bound is 2x the rule's.
EMULATED_CUDA_FACTOR = 2 if CUDA_EMULATION else 1


def _assert_fa_rule(actual, eager, truth, names, what):
    """FlashAttention's rule on the output, dx and every weight gradient.

    # NOTE: a weight gradient sums N tokens' terms, each carrying a few fp32 roundings from the GEMMs
    # and the attention before it; on a tensor of H (2) or H * linear_dim (16) entries, the eager max
    # error is one draw of that noise (0.1 to 4 roundings of the largest entry across seeds here,
    # with both backends' own sums in fp64), so its atol is 8 roundings rather than one. The
    # output and dx, and every tensor of the bench's larger shapes, keep the plain rule.
    """
    for name, a, e, t in zip(names, actual, eager, truth):
        if name in ("out", "x"):
            assert_close_vs_eager(a, t, e, torch.float32, msg=f"{what}: {name}", rounding_factor=EMULATED_CUDA_FACTOR)
            continue
        err = (a.double() - t).abs().max().item() if a.numel() else 0.0
        eager_err = (e.double() - t).abs().max().item() if e.numel() else 0.0
        bound = EMULATED_CUDA_FACTOR * (2 * eager_err + 8 * rounding_atol(t, torch.float32))
        assert err <= bound, f"{what}: {name}: max error {err} > 2 x eager's {eager_err} + 8 roundings"


def _fa_rule_cases():
    """(device, backend, config, seed) params: three seeds, one under the Triton interpreter (each call
    costs seconds there; the seven configs vary the rest)."""
    cases = []
    for param in [pytest.param("cpu", "reference", id="reference")] + KERNEL_PARAMS:
        device, backend = param.values
        for config in CONFIGS:
            for seed in range(1 if (device, backend) == ("cpu", "triton") else 3):
                marks = list(param.marks)
                cases.append(pytest.param(device, backend, config, seed, marks=marks,
                                          id=f"{config}-{param.id}-{seed}"))
    return cases


def _on(device, x, offsets, max_seq_len, num_targets, params, grad_out):
    moved = [t.to(device) if isinstance(t, torch.Tensor) else t
             for t in (x, offsets, max_seq_len, num_targets, grad_out)]
    return (*moved[:4], {n: p.to(device) for n, p in params.items()}, moved[4])


@pytest.mark.parametrize("device, backend, config, seed", _fa_rule_cases())
def test_fused_op_by_the_flash_attention_rule(device, backend, config, seed):
    """hstu_layer on a backend: output and every gradient within twice the fp32 twin's error of the
    twin's float64 run (the twin in float64 is float64 throughout: an fp32 'ground truth' made the
    rule fail on every result computed in another order)."""
    options, inputs = CONFIGS[config]
    x, offsets, max_seq_len, num_targets, params, grad_out = _layer_inputs(seed, **inputs)
    args = (x, offsets, max_seq_len, num_targets, params, grad_out)
    with float64_ground_truth():
        truth = _run(lambda *a, **p: ref.stu_layer(*a, **p, **DIMS, **options), *args, torch.float64)
    eager = _run(lambda *a, **p: ref.stu_layer(*a, **p, **DIMS, **options), *args, torch.float32)
    fused = _run(lambda *a, **p: ops.hstu_layer(*a, **p, **DIMS, **options, backend=backend), *_on(device, *args),
                 torch.float32)
    _assert_fa_rule([t.cpu() for t in fused], eager, truth, ("out", "x", *params), f"{config} seed {seed}")


OP_CASES = {  # name: (output-half options, with output bias, with dropout mask)
    "stu": (dict(group_norm=False, concat_u=True, concat_x=True), False, False),
    "group_norm_mask_bias": (dict(group_norm=True, concat_u=True, concat_x=True), True, True),
    "concat_x_only_mask": (dict(group_norm=False, concat_u=False, concat_x=True), True, True),
    "group_norm_no_concat": (dict(group_norm=True, concat_u=False, concat_x=False), False, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device, backend", KERNEL_PARAMS)
@pytest.mark.parametrize("case", list(OP_CASES))
def test_ops_by_the_flash_attention_rule(device, backend, case, dtype):
    """Each projection op alone (forward and backward, 70 rows: two 64-row tiles of the GEMM kernels),
    on fp32 or bf16 inputs (the GPU bench's), against the twins' float64 run by FlashAttention's rule,
    with the twins in the same dtype as eager: the kernels' own error, free of the attention's
    amplification that the layer test sees."""
    options, has_bias, has_mask = OP_CASES[case]
    g = torch.Generator().manual_seed(3)
    n, dim, heads, linear_dim, attention_dim = 70, 24, 2, 8, 4
    width = heads * linear_dim
    k = width * (1 + options["concat_u"] + options["concat_x"])
    norm_size = heads if options["group_norm"] else width

    def randn(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift

    x = randn(n, dim)
    uvqk = (x, 1 + randn(dim, scale=0.2), randn(dim, scale=0.2), 1e-6,
            randn(dim, heads * (2 * linear_dim + 2 * attention_dim), scale=dim ** -0.5),
            randn(heads * (2 * linear_dim + 2 * attention_dim), scale=0.2))
    attn, u_pre, grad_out = randn(n, width), randn(n, width), randn(n, dim)
    mask = (torch.rand(n, k, generator=g) > 0.3).double() / 0.7 if has_mask else None
    out_w = (1 + randn(norm_size, scale=0.2), randn(norm_size, scale=0.2), 1e-6, randn(k, dim, scale=k ** -0.5),
             randn(dim, scale=0.2) if has_bias else None, mask)
    head = dict(num_heads=heads, group_norm=options["group_norm"], concat_u=options["concat_u"],
                concat_x=options["concat_x"])
    for silu_qkv in ((False, True) if case == "stu" else (False,)):
        dims = (heads, linear_dim, attention_dim, silu_qkv)

        def uvqk_run(fn, dtype, device="cpu"):
            args = tuple(a.to(device, dtype) if isinstance(a, torch.Tensor) else a for a in uvqk)
            outs = fn(*args, *dims)
            grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(4 + i), dtype=torch.float64)
                     .to(device, dtype) for i, o in enumerate(outs[:4])]
            return list(outs[:4]) + list(fn_bwd[fn](*grads, *args, outs[4], *dims))

        def output_run(fn, dtype, device="cpu"):
            cast = [a.to(device, dtype) if isinstance(a, torch.Tensor) else a for a in (attn, u_pre, x, *out_w)]
            out, stats = fn(*cast, *head.values())
            a, u, _, nw, nb, eps, w, ob, m = cast
            return [out] + list(fn_bwd[fn](grad_out.to(device, dtype), a, u, nw, nb, eps, w, ob is not None, m, stats,
                                           *head.values()))

        native = torch.ops.gem_kernels
        mod = gk._backend.FAMILIES["hstu_layer"].module(backend) if backend == "triton" else None
        fused = dict(uvqk=mod.hstu_uvqk_fwd if mod else native.hstu_uvqk_fwd_native,
                     output=mod.hstu_output_fwd if mod else native.hstu_output_fwd_native)
        fn_bwd = {ref.hstu_uvqk_fwd: ref.hstu_uvqk_bwd, ref.hstu_output_fwd: ref.hstu_output_bwd,
                  fused["uvqk"]: mod.hstu_uvqk_bwd if mod else native.hstu_uvqk_bwd_native,
                  fused["output"]: mod.hstu_output_bwd if mod else native.hstu_output_bwd_native}
        for half, run, twin in (("uvqk", uvqk_run, ref.hstu_uvqk_fwd), ("output", output_run, ref.hstu_output_fwd)):
            with float64_ground_truth():
                truth = run(twin, torch.float64)
            eager, got = run(twin, dtype), run(fused[half], dtype, device)
            for i, (a, e, t) in enumerate(zip(got, eager, truth)):
                assert_close_vs_eager(a.cpu(), t, e, dtype, msg=f"{case} {half} silu_qkv={silu_qkv} output {i}",
                                      rounding_factor=interpreter_rounding_factor(backend, device, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device, backend", KERNEL_PARAMS + reference_params())
@pytest.mark.parametrize("n, dim, silu_qkv", [(70, 24, False), (45, 32, True), (0, 32, True)])
def test_uvqk_bwd_adds_grad_residual(device, backend, n, dim, silu_qkv, dtype):
    """hstu_uvqk_bwd's grad_residual (the layer's residual gradient, which the eager fast path's node hands
    it): on every backend dx is the norm backward's dx rounded to x's dtype plus grad_residual, bit for bit
    the same call without it followed by the add; the other outputs unchanged; dx with it by FlashAttention's
    rule against the reference's float64 run (the twin in the same dtype as eager); the memory poisoned
    first. Through the custom op (its checks) and the backend's kernel (what the node calls)."""
    g = torch.Generator().manual_seed(n + dim)
    heads, lin, att = (2, 8, 4) if dim == 24 else (2, 16, 16)
    o = 2 * heads * (lin + att)

    def randn(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift

    x, nw, nb = randn(n, dim), randn(dim, scale=0.2, shift=1.0), randn(dim, scale=0.2)
    w, b = randn(dim, o, scale=dim ** -0.5), randn(o, scale=0.2)
    grads = (randn(n, heads * lin), randn(n, heads, lin), randn(n, heads, att), randn(n, heads, att))
    residual = randn(n, dim)
    stats = ref._norm_stats(x.float(), 1, 1e-6)
    dims = (heads, lin, att, silu_qkv)

    def args(dt, dev="cpu"):
        return [t.to(dev, dt) for t in grads] + [t.to(dev, dt) for t in (x, nw, nb)] + [1e-6] + \
            [t.to(dev, dt) for t in (w, b)] + [stats.to(dev)]

    with float64_ground_truth():
        truth = ref.hstu_uvqk_bwd(*args(torch.float64), *dims, residual)
    eager = ref.hstu_uvqk_bwd(*args(dtype), *dims, residual.to(dtype))
    fn = gk._backend.kernel("hstu_layer", "hstu_uvqk_bwd", backend)
    plain = fn(*args(dtype, device), *dims)
    r = residual.to(device, dtype)
    poison_allocator(max(n, 1) * dim * 8, device)
    via_kernel = fn(*args(dtype, device), *dims, r)
    poison_allocator(max(n, 1) * dim * 8, device)
    via_op = ops.hstu_uvqk_bwd_op(*args(dtype, device), *dims, r, backend)
    for got, how in ((via_kernel, "kernel"), (via_op, "custom op")):
        assert torch.equal(got[0], plain[0] + r), f"{backend} {how}: dx with grad_residual is not dx + grad_residual"
        for i, (a, c) in enumerate(zip(got[1:], plain[1:])):
            assert torch.equal(a, c), f"{backend} {how}: output {i + 1} changed with grad_residual"
    assert_close_vs_eager(via_op[0].cpu(), truth[0], eager[0], dtype, msg=f"{backend} dx with grad_residual",
                          rounding_factor=interpreter_rounding_factor(backend, device, dtype))
    bad = [(r[:, :-1], "shape"), (r.double(), "dtype")] if n else [(r.double(), "dtype")]
    for wrong, what in bad:
        with pytest.raises(ValueError, match="grad_residual"):
            ops.hstu_uvqk_bwd_op(*args(dtype, device), *dims, wrong, backend)
        if backend in ("cpu", "cuda"):  # the native kernels check too (the Python twins trust the custom op)
            with pytest.raises(ValueError, match="grad_residual"):
                fn(*args(dtype, device), *dims, wrong)


@pytest.mark.parametrize("group_norm", [False, True])
def test_cpu_ops_at_widths_off_the_vector_lanes(group_norm):
    """The four cpu projection ops at D = 23, H = 3, linear_dim = 5, attention_dim = 3, where every row
    and norm group of their vectorised passes (8 fp32 / 4 fp64 lanes) ends in a partial vector and the
    uvqk bias column sits at an odd offset: each output against the reference op run in float64, by
    FlashAttention's rule against the reference op in fp32 (weight gradients: 8 roundings of atol, as
    in _assert_fa_rule). Per op rather than through the layer: the attention and the group norm's rstd
    amplify 1-ulp differences in dx at this shape, and the layer's rule then fails on ~5 % of seeds
    for the old kernels and the new alike."""
    _check_cpu_ops(37, 23, 3, 5, 3, group_norm, silu_qkv=False, seeds=range(3))


_SILU_ROWS_CHECK = """
import os
os.environ.setdefault("TRITON_INTERPRET", "1")
from tests.test_hstu_layer import _check_cpu_ops
_check_cpu_ops(70, 24, 1, 27, 27, False, silu_qkv=True, seeds=range(2))
print("silu rows ok")
"""


@pytest.mark.parametrize("avx512", ["as the CPU has it", "off"])
def test_cpu_ops_silu_rows_on_both_paths(avx512):
    """The cpu ops' SiLU rows (silu_block) run 16-lane AVX-512F vectors with a masked last one where
    the CPU has it, else 8-lane AVX2 vectors and a scalar tail: at widths 27 = 16 + 11 (AVX-512) =
    8 + 8 + 8 + 3 (AVX2) (SiLU on u, v, q, k), each op against the reference op in float64 by
    FlashAttention's rule, with the AVX-512 path and with GEM_KERNELS_NO_AVX512=1 (the AVX2 one on
    any CPU). A fresh process: the path is chosen once."""
    if "cpu" not in gk.available_backends():
        pytest.skip("cpu not built")
    run_on_vector_path(_SILU_ROWS_CHECK, avx512, "silu rows ok")


def _check_output_rows(n, dim, heads, lin, group_norm, *, masked, seed):
    """The cpu output ops without concat (the small model's layer: at widths 16 and 32 with norm groups
    of 16 or 32 the fused row pass of csrc/cpu/hstu_layer_rows.inc, and at dim 32 on AVX-512F its
    GEMMs in registers; else output_prologue_row) against the reference op run in float64, by
    FlashAttention's rule against it in fp32, with the output bias and, when `masked`, a dropout mask;
    and the same bits on 1 and 2 threads."""
    cpu = torch.ops.gem_kernels
    width = heads * lin
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return shift + scale * torch.randn(*shape, generator=g)

    attn, u_pre, x, grad_out = rnd(n, width), rnd(n, width, scale=2.0), rnd(n, dim), rnd(n, dim)
    norm_size = heads if group_norm else width
    onw, onb = rnd(norm_size, scale=0.2, shift=1.0), rnd(norm_size, scale=0.2)
    ow, obias = rnd(width, dim, scale=width ** -0.5), rnd(dim, scale=0.2)
    mask = (torch.rand(n, width, generator=g) > 0.3).float() / 0.7 if masked else None
    head = (heads, group_norm, False, False)

    def run(fwd, bwd, dtype):
        t = [v.to(dtype) if v is not None else None for v in (attn, u_pre, x, onw, onb, ow, obias, mask, grad_out)]
        out, stats = fwd(*t[:5], 1e-6, t[5], t[6], t[7], *head)
        grads = bwd(t[8], t[0], t[1], t[3], t[4], 1e-6, t[5], True, t[7], stats, *head)
        return [out, stats.float(), *grads]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        actual = run(cpu.hstu_output_fwd_native, cpu.hstu_output_bwd_native, torch.float32)
        torch.set_num_threads(2)
        two = run(cpu.hstu_output_fwd_native, cpu.hstu_output_bwd_native, torch.float32)
    finally:
        torch.set_num_threads(threads)
    eager = run(ref.hstu_output_fwd, ref.hstu_output_bwd, torch.float32)
    truth = run(ref.hstu_output_fwd, ref.hstu_output_bwd, torch.float64)
    what = f"n={n} dim={dim} heads={heads} lin={lin} group_norm={group_norm} masked={masked}"
    for i, (one, other) in enumerate(zip(actual, two)):
        assert torch.equal(one, other), f"{what}: output {i} differs on 2 threads"
    names = ("out", "stats", "da", "du", "dnw", "dnb", "dw", "dob")
    for name, a, e, t in zip(names, actual, eager, truth):
        if name in ("dnw", "dnb", "dw", "dob"):
            _assert_fa_rule([a], [e], [t], ["weight"], what)
        else:
            assert_close_vs_eager(a, t, e, torch.float32, msg=f"{what}: {name}")


_OUTPUT_ROWS_CHECK = """
import os
os.environ.setdefault("TRITON_INTERPRET", "1")
from tests.test_hstu_layer import _check_output_rows
for seed, (n, dim, heads, lin, group_norm, masked) in enumerate([
        (1100, 32, 2, 16, False, False),  # the small model's layer, 4 chunks of 275
        (1100, 32, 2, 16, False, True),
        (513, 24, 2, 16, True, True),     # group norm over two heads of 16; the residual's masked tail
        (97, 17, 1, 16, False, False),    # width 16
        (45, 32, 1, 16, True, True),      # width 16 at dim 32 (the forward's GEMM in registers, K = 16)
        (70, 24, 2, 8, True, True),       # groups of 8: output_prologue_row on both paths
        (0, 32, 2, 16, False, True)]):
    _check_output_rows(n, dim, heads, lin, group_norm, masked=masked, seed=seed)
print("output rows ok")
"""


@pytest.mark.parametrize("avx512", ["as the CPU has it", "off"])
def test_cpu_output_ops_without_concat_on_both_paths(avx512):
    """The cpu output ops at the small model's layer (no concat, width 32 = two heads of 16: one pass
    per row with the row in registers, 16-lane AVX-512F or 8-lane AVX2 vectors) and beside it (width
    16, the group norm, a dropout mask, dim 24 and 17, 0 rows), on the AVX-512 path and with
    GEM_KERNELS_NO_AVX512=1, each output by FlashAttention's rule (_check_output_rows). A fresh
    process: the path is chosen once."""
    if "cpu" not in gk.available_backends():
        pytest.skip("cpu not built")
    run_on_vector_path(_OUTPUT_ROWS_CHECK, avx512, "output rows ok")


def _check_uvqk_threads(n, dim, heads, lin, att, silu_qkv, seed):
    """The cpu uvqk ops' outputs and gradients: the same bits on 1 and 2 threads."""
    cpu = torch.ops.gem_kernels
    g = torch.Generator().manual_seed(seed)
    o = 2 * heads * (lin + att)
    x, nw, nb = torch.randn(n, dim, generator=g), 1 + 0.2 * torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    w, b = torch.randn(dim, o, generator=g) * dim ** -0.5, torch.randn(o, generator=g)
    grads = (torch.randn(n, heads * lin, generator=g), torch.randn(n, heads, lin, generator=g),
             torch.randn(n, heads, att, generator=g), torch.randn(n, heads, att, generator=g))

    def run():
        outs = cpu.hstu_uvqk_fwd_native(x, nw, nb, 1e-6, w, b, heads, lin, att, silu_qkv)
        return [*outs, *cpu.hstu_uvqk_bwd_native(*grads, x, nw, nb, 1e-6, w, b, outs[4], heads, lin, att, silu_qkv)]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    for i, (a, c) in enumerate(zip(one, two)):
        assert torch.equal(a, c), f"uvqk n={n} output {i} differs on 2 threads"


_UVQK_ROWS_CHECK = """
import os
os.environ.setdefault("TRITON_INTERPRET", "1")
from tests.test_hstu_layer import _check_cpu_ops, _check_uvqk_threads
for seed, (n, heads, lin, att, silu_qkv) in enumerate([
        (1100, 2, 16, 16, True),   # the small model's layer, 4 chunks of 275 (dz rows: 68 tiles of 4, 3 single)
        (7, 2, 16, 16, True),      # dz rows: one tile of 4, 3 single rows
        (8, 2, 16, 16, True),      # dz rows: two tiles of 4, no single row
        (97, 2, 16, 16, False),
        (45, 1, 16, 32, True)]):   # u, v 16 wide, q, k 32
    _check_cpu_ops(n, 32, heads, lin, att, False, silu_qkv=silu_qkv, seeds=[seed])
    _check_uvqk_threads(n, 32, heads, lin, att, silu_qkv, seed)
print("uvqk rows ok")
"""


@pytest.mark.parametrize("avx512", ["as the CPU has it", "off"])
def test_cpu_uvqk_ops_at_dim_32_on_both_paths(avx512):
    """The cpu uvqk ops at D = 32 with u, v, q, k in whole 16-lane vectors (the small model's layer: the
    LayerNorm, split / SiLU and norm backward rows of csrc/cpu/hstu_layer_rows.inc, 16-lane AVX-512F or
    8-lane AVX2 vectors; on AVX-512F the backward's dz rows, 4 rows at a time and single ones), with and
    without silu_qkv, each output by FlashAttention's rule against the
    reference op in float64 (_check_cpu_ops), and the same bits on 1 and 2 threads, on the AVX-512 path
    and with GEM_KERNELS_NO_AVX512=1. A fresh process: the path is chosen once."""
    if "cpu" not in gk.available_backends():
        pytest.skip("cpu not built")
    run_on_vector_path(_UVQK_ROWS_CHECK, avx512, "uvqk rows ok")


# Token counts against the cpu ops' chunking (csrc/cpu/hstu_layer.cpp chunking()) at uvqk width
# O = 576 and output K = 576, where blocks are at most 256 rows: 255 (one chunk, one block), 512 (one
# chunk of two blocks), 513 (two 512-row chunks' worth, rounded up to 4 chunks of 129 rows), 1100
# (4 chunks of 275 in blocks of 138 + 137), 2597 (the bench's history-1024 batch: 8 chunks of 325,
# the last 322).
CHUNKING_TOKENS = [255, 512, 513, 1100, 2597]
CHUNKING_DIMS = dict(dim=24, heads=2, lin=96, att=48)


@pytest.mark.parametrize("n", CHUNKING_TOKENS)
def test_cpu_ops_across_chunks_and_blocks(n):
    """The cpu projection ops run equal chunks (the weight-gradient partials) in blocks of fewer rows
    where a layer is wide: each token count of CHUNKING_TOKENS on 2 threads, with silu_qkv (its
    recomputed pre-activations) and the group norm; each output by FlashAttention's rule as above."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_cpu_ops(n, *CHUNKING_DIMS.values(), True, silu_qkv=True, seeds=range(1))
    finally:
        torch.set_num_threads(threads)


@cpu_kernel_only  # the C++ kernel's claim: the emulated CUDA ops (GK_CUDA_EMU=1) gave other bits on 2 threads
def test_cpu_ops_do_not_depend_on_the_thread_count():
    """The chunking and the order of the weight-gradient partials' sum depend on N alone, never on
    the thread count (csrc/cpu/hstu_layer.cpp): the four cpu projection ops give the same bits on 1
    and 2 threads, at the bench's 2597 tokens (8 chunks, handed to whichever thread is free)."""
    if "cpu" not in gk.available_backends():
        pytest.skip("cpu not built")
    cpu = torch.ops.gem_kernels
    n, dim, heads, lin, att = 2597, *CHUNKING_DIMS.values()
    width, num_out = heads * lin, heads * (2 * lin + 2 * att)
    g = torch.Generator().manual_seed(0)
    x, nw, nb, w, b = (torch.randn(*s, generator=g) for s in ((n, dim), (dim,), (dim,), (dim, num_out), (num_out,)))
    grads = [torch.randn(*s, generator=g) for s in ((n, width), (n, heads, lin), (n, heads, att), (n, heads, att))]
    attn, u_pre, grad_out = (torch.randn(*s, generator=g) for s in ((n, width), (n, width), (n, dim)))
    onw, onb, ow = torch.randn(width, generator=g), torch.randn(width, generator=g), torch.randn(3 * width, dim,
                                                                                              generator=g)

    def run():
        uvqk = cpu.hstu_uvqk_fwd_native(x, nw, nb, 1e-6, w, b, heads, lin, att, True)
        uvqk_grads = cpu.hstu_uvqk_bwd_native(*grads, x, nw, nb, 1e-6, w, b, uvqk[4], heads, lin, att, True)
        out = cpu.hstu_output_fwd_native(attn, u_pre, x, onw, onb, 1e-6, ow, None, None, heads, False, True, True)
        out_grads = cpu.hstu_output_bwd_native(grad_out, attn, u_pre, onw, onb, 1e-6, ow, False, None, out[1], heads,
                                               False, True, True)
        return [*uvqk, *uvqk_grads, *out, *out_grads]

    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(run())
    finally:
        torch.set_num_threads(threads)
    for i, (one, two) in enumerate(zip(*results)):
        assert torch.equal(one, two), f"output {i}"


def _check_cpu_ops(n, dim, heads, lin, att, group_norm, *, silu_qkv, seeds):
    """The four cpu projection ops (concat_u, concat_x, output bias) against the reference op run in
    float64, by FlashAttention's rule against the reference op in fp32."""
    if "cpu" not in gk.available_backends():
        pytest.skip("cpu not built")
    cpu = torch.ops.gem_kernels
    width, groups = heads * lin, heads if group_norm else 1
    num_out, k = 2 * width + 2 * heads * att, 3 * width
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape, scale=1.0, shift=0.0):
            return shift + scale * torch.randn(*shape, generator=g)

        x, nw, nb = rnd(n, dim), rnd(dim, scale=0.2, shift=1.0), rnd(dim, scale=0.2)
        w, b = rnd(dim, num_out, scale=dim ** -0.5), rnd(num_out, scale=0.2)
        grads = (rnd(n, width), rnd(n, heads, lin), rnd(n, heads, att), rnd(n, heads, att))
        attn, u_pre, grad_out = rnd(n, width), rnd(n, width), rnd(n, dim)
        norm_size = heads if group_norm else width
        onw, onb = rnd(norm_size, scale=0.2, shift=1.0), rnd(norm_size, scale=0.2)
        ow, obias = rnd(k, dim, scale=k ** -0.5), rnd(dim, scale=0.2)
        stats = ref._norm_stats(x, 1, 1e-6)
        out_stats = ref._norm_stats(attn, groups, 1e-6)
        calls = {  # name: (cpu op, reference op, its tensor arguments, the others, output names)
            "uvqk_fwd": (cpu.hstu_uvqk_fwd_native, ref.hstu_uvqk_fwd, (x, nw, nb), (1e-6,), (w, b),
                         (heads, lin, att, silu_qkv), ("u", "v", "q", "k")),
            "uvqk_bwd": (cpu.hstu_uvqk_bwd_native, ref.hstu_uvqk_bwd, (*grads, x, nw, nb), (1e-6,), (w, b, stats),
                         (heads, lin, att, silu_qkv), ("x", "dnw", "dnb", "dw", "db")),
            "output_fwd": (cpu.hstu_output_fwd_native, ref.hstu_output_fwd, (attn, u_pre, x, onw, onb), (1e-6,),
                           (ow, obias), (None, heads, group_norm, True, True), ("out",)),
            "output_bwd": (cpu.hstu_output_bwd_native, ref.hstu_output_bwd, (grad_out, attn, u_pre, onw, onb),
                           (1e-6,), (ow,), (True, None, out_stats, heads, group_norm, True, True),
                           ("da", "du", "dnw", "dnb", "dw", "dob")),
        }
        for op, (native, reference, tensors, eps, weights, rest, names) in calls.items():
            def run(fn, dtype):
                cast = [t.to(dtype) if t.dtype.is_floating_point and t is not stats and t is not out_stats
                        else t for t in (*tensors, *weights)]
                return fn(*cast[:len(tensors)], *eps, *cast[len(tensors):], *rest)
            actual, eager, truth = native(*tensors, *eps, *weights, *rest), run(reference, torch.float32), \
                run(reference, torch.float64)
            for name, a, e, t in zip(names, actual, eager, truth):
                what = f"{op} group_norm={group_norm} seed {seed}"
                if name in ("dnw", "dnb", "dw", "db", "dob"):
                    _assert_fa_rule([a], [e], [t], ["weight"], what)
                else:
                    assert_close_vs_eager(a, t, e, torch.float32, msg=f"{what}: {name}",
                                          rounding_factor=EMULATED_CUDA_FACTOR)
            if op == "uvqk_bwd":
                _check_uvqk_residual(native, tensors, eps, weights, rest, actual, rnd(n, dim), f"{op} seed {seed}")


def _check_uvqk_residual(native, tensors, eps, weights, rest, plain, residual, what):
    """hstu_uvqk_bwd given grad_residual: dx is the plain call's dx + grad_residual bit for bit (fp32: added
    in the norm backward's last pass, the bits of at::add_), every other output the plain call's; dx's
    memory poisoned first, so a row the kernel leaves unwritten fails."""
    poison_allocator(residual.numel() * 4, residual.device)
    got = native(*tensors, *eps, *weights, *rest, residual)
    assert torch.equal(got[0], plain[0] + residual), f"{what}: dx with grad_residual is not dx + grad_residual"
    for i, (a, b) in enumerate(zip(got[1:], plain[1:])):
        assert torch.equal(a, b), f"{what}: output {i + 1} changed with grad_residual"


def _check_transposed_weights(n, dim, heads, lin, att, silu_qkv):
    """The cpu ops given uvqk_weight / output_weight as transposed views (nn.Linear's weight .t(), as
    HSTULayer passes them) equal the same ops on contiguous copies bit for bit, and return the weight
    gradients in the weights' layout (the fakes' empty_like), so that nn.Linear's weight gradient comes
    out contiguous (AccumulateGrad keeps it without a copy)."""
    cpu = torch.ops.gem_kernels
    g = torch.Generator().manual_seed(n)
    width, num_out, k = heads * lin, 2 * heads * lin + 2 * heads * att, 3 * heads * lin
    x, nw, nb = torch.randn(n, dim, generator=g), 1 + torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    w, b = torch.randn(dim, num_out, generator=g) * dim ** -0.5, torch.randn(num_out, generator=g)
    ow, obias = torch.randn(k, dim, generator=g) * k ** -0.5, torch.randn(dim, generator=g)
    onw, onb = 1 + torch.randn(width, generator=g), torch.randn(width, generator=g)
    grads = [torch.randn(n, width, generator=g), torch.randn(n, heads, lin, generator=g),
             torch.randn(n, heads, att, generator=g), torch.randn(n, heads, att, generator=g)]
    attn, u_pre, grad_out = torch.randn(n, width, generator=g), torch.randn(n, width, generator=g), \
        torch.randn(n, dim, generator=g)
    wt, owt = w.t().contiguous().t(), ow.t().contiguous().t()
    assert not wt.is_contiguous() and not owt.is_contiguous()
    ua = (heads, lin, att, silu_qkv)
    fwd = [cpu.hstu_uvqk_fwd_native(x, nw, nb, 1e-6, ww, b, *ua) for ww in (w, wt)]
    bwd = [cpu.hstu_uvqk_bwd_native(*grads, x, nw, nb, 1e-6, ww, b, fwd[0][4], *ua) for ww in (w, wt)]
    ofwd = [cpu.hstu_output_fwd_native(attn, u_pre, x, onw, onb, 1e-6, ww, obias, None, heads, False, True, True)
            for ww in (ow, owt)]
    obwd = [cpu.hstu_output_bwd_native(grad_out, attn, u_pre, onw, onb, 1e-6, ww, True, None, ofwd[0][1], heads,
                                       False, True, True) for ww in (ow, owt)]
    for what, (old, new) in (("uvqk fwd", fwd), ("uvqk bwd", bwd), ("output fwd", ofwd), ("output bwd", obwd)):
        for i, (a, c) in enumerate(zip(old, new)):
            assert torch.equal(a, c), f"{what} output {i}: transposed weight differs"
    assert bwd[1][3].stride() == wt.stride() and bwd[0][3].is_contiguous()
    assert obwd[1][4].stride() == owt.stride() and obwd[0][4].is_contiguous()
    layer = gk.nn.HSTULayer(dim, heads, lin, att, concat_u=True, concat_x=True, backend="cpu")
    offsets = torch.tensor([0, n // 3, n])
    layer(x, offsets, n, None).backward(grad_out)
    for name in ("uvqk", "out"):
        weight = getattr(layer, name).weight
        assert weight.grad.stride() == weight.stride(), f"{name}.weight.grad strides {weight.grad.stride()}"


_TRANSPOSED_CHECK = """
import os
os.environ.setdefault("TRITON_INTERPRET", "1")
from tests.test_hstu_layer import _check_transposed_weights
_check_transposed_weights(97, 32, 2, 16, 16, True)
_check_transposed_weights(59, 23, 3, 5, 3, False)
_check_transposed_weights(1025, 32, 2, 16, 16, False)
print("transposed ok")
"""


@pytest.mark.parametrize("avx512", ["as the CPU has it", "off"])
def test_cpu_ops_read_transposed_weights_on_both_paths(avx512):
    """See _check_transposed_weights: at the small model's shape (the AVX-512 rows' register GEMMs) and
    off it (sgemm's NN on the transposed output weight where NT ran on the contiguous one)."""
    if "cpu" not in gk.available_backends():
        pytest.skip("cpu not built")
    run_on_vector_path(_TRANSPOSED_CHECK, avx512, "transposed ok")


def test_float64_twin_is_float64():
    """The twin keeps float64 (it cast to fp32 before: the 'ground truth' then carried fp32 rounding)."""
    x, offsets, max_seq_len, num_targets, params, _ = _layer_inputs(0)
    out = ref.stu_layer(x.double(), offsets, max_seq_len, num_targets, **{k: v.double() for k, v in params.items()},
                        **DIMS)
    plain = _plain_layer(x.double(), offsets, max_seq_len, num_targets, **{k: v.double() for k, v in params.items()},
                         **DIMS)
    assert out.dtype == torch.float64
    assert (out - plain).abs().max().item() < 1e-12


# ---------------------------------------------------------------------------------------------
# gk.nn.HSTULayer
# ---------------------------------------------------------------------------------------------


def _module_params(layer):
    """The module's parameters as the op's (GR's layouts), for the twin."""
    params = dict(input_norm_weight=layer.input_norm.weight, input_norm_bias=layer.input_norm.bias,
                  uvqk_weight=layer.uvqk.weight.t(), uvqk_bias=layer.uvqk.bias,
                  output_norm_weight=layer.attn_norm.weight, output_norm_bias=layer.attn_norm.bias,
                  output_weight=layer.out.weight.t())
    if layer.out.bias is not None:
        params["output_bias"] = layer.out.bias
    return params


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_dropout_draws_one_mask_for_the_concat(backend):
    """Training mode with dropout: the module's output is the twin's with the module's mask (drawn from
    the global generator: F.dropout's distribution on the concat, as STULayer's)."""
    torch.manual_seed(0)
    layer = gk.nn.HSTULayer(16, 2, 8, 4, dropout=0.5, silu_qkv=False, concat_u=True, concat_x=True,
                            output_bias=False, backend=backend)
    x, offsets = torch.randn(9, 16), offsets_from_lengths([4, 5])
    torch.manual_seed(1)
    out = layer(x, offsets, 5)
    torch.manual_seed(1)
    mask = torch.empty(9, 48).bernoulli_(0.5).div_(0.5)
    expected = ref.stu_layer(x, offsets, 5, None, **_module_params(layer), num_heads=2, linear_dim=8,
                             attention_dim=4, dropout_mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, layer.eval()(x, offsets, 5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_empty_sequences(backend):
    layer = gk.nn.HSTULayer(8, 2, 4, 4, concat_u=True, concat_x=True, backend=backend)
    x = torch.zeros(0, 8, requires_grad=True)
    out = layer(x, offsets_from_lengths([0, 0]), 0)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert x.grad.shape == (0, 8) and layer.uvqk.weight.grad.abs().sum() == 0


@pytest.mark.parametrize("grad_mode", [False, True])
def test_cpu_kernels_on_several_threads(grad_mode):
    """A batch large enough for the cpu kernels' worker threads, with weights that require grad, under
    no_grad and with grad: the GEMMs on the workers raised (addmm out= with an operand requiring grad)
    where the small shapes of the other tests ran on the calling thread only."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, offsets, max_seq_len, num_targets, params, grad_out = _layer_inputs(0, dim=64, lengths=(300, 5, 250))
        leaves = {n: p.requires_grad_(True) for n, p in params.items()}
        with torch.set_grad_enabled(grad_mode):
            out = ops.hstu_layer(x, offsets, max_seq_len, num_targets, **leaves, **DIMS, backend="cpu")
            expected = ref.stu_layer(x, offsets, max_seq_len, num_targets, **leaves, **DIMS)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        if grad_mode:
            grads = torch.autograd.grad(out, list(leaves.values()), grad_out)
            grads_expected = torch.autograd.grad(expected, list(leaves.values()), grad_out)
            for name, g, e in zip(leaves, grads, grads_expected):
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-3 * float(e.abs().max()), msg=name)
    finally:
        torch.set_num_threads(threads)


def test_module_options_are_checked():
    with pytest.raises(ValueError, match="concat_u and concat_x must be equal"):
        gk.nn.HSTULayer(8, 2, 4, 4, group_norm=True, concat_u=True)
    with pytest.raises(ValueError, match="dropout must be in"):
        gk.nn.HSTULayer(8, 2, 4, 4, dropout=1.0)
    with pytest.raises(TypeError, match="stu_layer must be a generative_recommenders STULayer"):
        gk.nn.HSTULayer.from_generative_recommenders(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("change, error, match", [
    (dict(uvqk_weight=torch.zeros(24, 7)), ValueError, r"uvqk_weight must have shape \[D, H\*\(2\*linear_dim"),
    (dict(output_weight=torch.zeros(32, 24)), ValueError, r"output_weight must have shape \[K, D\] \(K = .*\) = \[48, 24\]"),
    (dict(output_norm_weight=torch.zeros(2)), ValueError, r"output_norm_weight must have shape \[16\]"),
    (dict(input_norm_bias=torch.zeros(24, dtype=torch.int64)), ValueError, "input_norm_bias must have dtype"),
    (dict(x=torch.zeros(18, 24, dtype=torch.float64)), ValueError, "x must have dtype"),
    (dict(x=torch.zeros(18, 2, 12)), ValueError, "x must have 2 dims"),
    (dict(num_heads=0), ValueError, "num_heads must be an int >= 1, got 0"),
    (dict(concat_x=1), ValueError, "concat_x must be a bool"),
    (dict(group_norm=True, concat_x=False), ValueError, "concat_u and concat_x must be equal"),
    (dict(eps=0.0), ValueError, "eps must be a float > 0"),
    (dict(dropout_mask=torch.ones(18, 3)), ValueError, r"dropout_mask must have shape \[N, K\] = \[18, 48\]"),
    (dict(seq_offsets=torch.tensor([0, 5, 3, 12, 15, 18])), ValueError, "seq_offsets"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_refused(backend, change, error, match):
    x, offsets, max_seq_len, num_targets, params, _ = _layer_inputs(0)
    args = dict(x=x, seq_offsets=offsets, max_seq_len=max_seq_len, num_targets=num_targets, **params, **DIMS)
    args.update(change)
    with pytest.raises(error, match=match):
        ops.hstu_layer(**args, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    """The registered ops' fakes and autograd formulas let dynamo and AOT autograd trace the whole
    layer (forward and backward) as one graph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = gk.nn.HSTULayer(16, 2, 8, 4, silu_qkv=False, concat_u=True, concat_x=True, output_bias=False,
                            contextual_len=1, backend=backend)
    x = torch.randn(12, 16, requires_grad=True)
    offsets, num_targets = offsets_from_lengths([5, 0, 7]), torch.tensor([1, 0, 2])
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = compiled(x, offsets, 7, num_targets)
    expected = layer(x, offsets, 7, num_targets)
    torch.testing.assert_close(got, expected)
    grads = torch.autograd.grad(got.square().sum(), [x, *layer.parameters()])
    grads_expected = torch.autograd.grad(expected.square().sum(), [x, *layer.parameters()])
    for g, e in zip(grads, grads_expected):
        torch.testing.assert_close(g, e)


def test_module_traces_with_torch_fx():
    """torch.fx.symbolic_trace of a model holding the layer: one leaf call, same result."""
    torch.manual_seed(0)
    layer = gk.nn.HSTULayer(16, 2, 8, 4, silu_qkv=False, concat_u=True, concat_x=True, output_bias=False)

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = layer

        def forward(self, x, offsets, num_targets):
            return self.inner(x, offsets, 7, num_targets) * 2.0

    wrapper = Wrapper()
    gm = torch.fx.symbolic_trace(wrapper)
    x, offsets, num_targets = torch.randn(12, 16), offsets_from_lengths([5, 0, 7]), torch.tensor([1, 0, 2])
    torch.testing.assert_close(gm(x, offsets, num_targets), wrapper(x, offsets, num_targets))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    x, offsets, max_seq_len, num_targets, p, _ = _layer_inputs(0)
    uvqk_args = (x, p["input_norm_weight"], p["input_norm_bias"], 1e-6, p["uvqk_weight"], p["uvqk_bias"], 2, 8, 4,
                 False, backend)
    torch.library.opcheck(ops.hstu_uvqk_fwd_op, uvqk_args)
    u_pre = ops.hstu_uvqk_fwd_op(*uvqk_args)[0]
    attn = torch.randn_like(u_pre)
    torch.library.opcheck(ops.hstu_output_fwd_op, (attn, u_pre, x, p["output_norm_weight"], p["output_norm_bias"],
                                                   1e-6, p["output_weight"], None, None, 2, False, True, True,
                                                   backend))
    # nn.Linear's weights as HSTULayer passes them (transposed views): the gradients keep that layout.
    wt, owt = p["uvqk_weight"].t().contiguous().t(), p["output_weight"].t().contiguous().t()
    torch.library.opcheck(ops.hstu_uvqk_fwd_op, (*uvqk_args[:4], wt, *uvqk_args[5:]))
    torch.library.opcheck(ops.hstu_output_fwd_op, (attn, u_pre, x, p["output_norm_weight"], p["output_norm_bias"],
                                                   1e-6, owt, None, None, 2, False, True, True, backend))
    # The uvqk backward with and without grad_residual (the eager fast path's residual), and its native schema.
    u_pre, v, q, k, stats = ops.hstu_uvqk_fwd_op(*uvqk_args)
    grads = [torch.randn_like(t) for t in (u_pre, v, q, k)]
    bwd_args = (*grads, *uvqk_args[:6], stats, 2, 8, 4, False)
    for residual in (None, torch.randn_like(x)):
        torch.library.opcheck(ops.hstu_uvqk_bwd_op, (*bwd_args, residual, backend))
        if backend == "cpu":
            torch.library.opcheck(torch.ops.gem_kernels.hstu_uvqk_bwd_native.default, (*bwd_args, residual))


# ---------------------------------------------------------------------------------------------
# generative-recommenders' own STULayer
# ---------------------------------------------------------------------------------------------

GR_PATH = os.environ.get("GENERATIVE_RECOMMENDERS_PATH", "/tmp/gr")


@pytest.fixture(scope="module")
def gr():
    """generative_recommenders (installed, or a checkout at GR_PATH), with fbgemm_gpu's CPU ops that
    its PyTorch path calls; skips with the reason when either is missing."""
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm.jagged_to_padded_dense on the CPU)
    except ImportError as exc:
        pytest.skip(f"fbgemm_gpu is not installed ({exc}): generative-recommenders' PyTorch path needs it")
    if importlib.util.find_spec("generative_recommenders") is None:
        if not os.path.isdir(os.path.join(GR_PATH, "generative_recommenders")):
            pytest.skip(f"generative-recommenders is neither installed nor checked out at {GR_PATH} "
                        f"(set GENERATIVE_RECOMMENDERS_PATH)")
        sys.path.insert(0, GR_PATH)
    from generative_recommenders.common import HammerKernel
    from generative_recommenders.modules.stu import STULayer, STULayerConfig
    return STULayer, STULayerConfig, HammerKernel


GR_VARIANTS = {
    "targets": dict(),
    "contextual_window": dict(contextual_seq_len=2, max_attn_len=3),
    "group_norm_alpha": dict(use_group_norm=True, attn_alpha=0.3),
    "not_target_aware": dict(target_aware=False),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(GR_VARIANTS))
def test_equals_generative_recommenders_stu_layer(gr, backend, variant):
    """from_generative_recommenders(stu_layer): forward and the gradient of x and of every parameter
    (mapped to GR's) by FlashAttention's rule, with GR's fp32 run as the eager side and the twin's
    float64 run as the truth (GR's PyTorch path runs fbgemm's jagged_to_padded_dense, which has no
    float64 kernel); GR's own distance to that truth is held to fp32 rounding too, so a twin that
    computed another layer would fail here."""
    STULayer, STULayerConfig, HammerKernel = gr
    torch.manual_seed(0)
    config = STULayerConfig(embedding_dim=24, num_heads=2, hidden_dim=8, attention_dim=4, output_dropout_ratio=0.3,
                            **GR_VARIANTS[variant])
    stu = STULayer(config)
    stu.set_hammer_kernel(HammerKernel.PYTORCH)
    with torch.no_grad():  # GR initialises norms to 1 / 0 and the bias to 0: make every term count
        for p in (stu._input_norm_weight, stu._output_norm_weight):
            p.add_(0.2 * torch.randn_like(p))
        for p in (stu._input_norm_bias, stu._output_norm_bias, stu._uvqk_beta):
            p.normal_(0, 0.2)
    stu.eval()  # dropout off: STULayer's F.dropout and ours draw different masks
    ours = gk.nn.HSTULayer.from_generative_recommenders(stu, backend=backend)
    assert not ours.training and ours.dropout.p == 0.3
    x, offsets, max_seq_len, num_targets, _, grad_out = _layer_inputs(2)

    gr_params = [stu._input_norm_weight, stu._input_norm_bias, stu._uvqk_weight, stu._uvqk_beta,
                 stu._output_norm_weight, stu._output_norm_bias, stu._output_weight]
    xg = x.clone().requires_grad_(True)
    out_gr = stu(x=xg, x_lengths=offsets.diff(), x_offsets=offsets, max_seq_len=max_seq_len, num_targets=num_targets)
    eager = [out_gr.detach(), *torch.autograd.grad(out_gr, [xg, *gr_params], grad_out)]

    xo = x.clone().requires_grad_(True)
    out = ours(xo, offsets, max_seq_len, num_targets)
    mine = [ours.input_norm.weight, ours.input_norm.bias, ours.uvqk.weight, ours.uvqk.bias, ours.attn_norm.weight,
            ours.attn_norm.bias, ours.out.weight]
    fused = [out.detach(), *torch.autograd.grad(out, [xo, *mine], grad_out)]
    fused[4], fused[8] = fused[4].t(), fused[8].t()  # nn.Linear's [out, in] to GR's [in, out]

    options = dict(attn_alpha=stu._attn_alpha, contextual_len=stu._contextual_seq_len,
                   max_attn_len=stu._max_attn_len, group_norm=stu._use_group_norm)
    twin_params = dict(zip(PARAM_NAMES, (p.detach().double().requires_grad_(True) for p in gr_params)))
    with float64_ground_truth():
        truth = _run(lambda *a, **p: ref.stu_layer(*a, **p, **DIMS, **options), x, offsets, max_seq_len,
                     num_targets if stu._target_aware else None, twin_params, grad_out, torch.float64)
    names = ("out", "x", *PARAM_NAMES[:-1])
    _assert_fa_rule(fused, eager, truth, names, f"{variant} ours vs GR")
    for name, e, t in zip(names, eager, truth):
        torch.testing.assert_close(e.double(), t, rtol=1e-4, atol=1e-5, msg=f"GR vs the twin: {name}")

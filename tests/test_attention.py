"""jagged_attention (softmax and HSTU): the reference against a per-(b, h, i, j) loop oracle, every
backend against the reference, forward and every gradient, every option alone and combined."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gem_kernels as gk
from gem_kernels.ops import attention as attention_ops
from gem_kernels.ops.attention import IMPLEMENTED, jagged_attention_bwd_op, jagged_attention_fwd_op
from gem_kernels.reference import attention as ref
from gem_kernels.reference import float64_ground_truth

from .utils import (
    run_on_vector_path,
    assert_close,
    assert_close_vs_eager,
    interpreter_rounding_factor,
    cpu_kernel_only,
    cuda_kernel_params,
    device_backend_params,
    offsets_from_lengths,
    poison_allocator,
    reference_params,
)

# Every backend has forward and backward; each is tested against the reference.
BACKENDS = tuple(b for b in IMPLEMENTED if b != "reference")
# Tests against an independent oracle (a formula, the NaN rule) run the reference too, under its own id.
WITH_REFERENCE = device_backend_params(BACKENDS) + reference_params()
NUM_BUCKETS = 8


def interpreted(device, backend):
    """Triton in the CPU interpreter: slow, so it runs the short TRITON_CASES instead of the full sweep."""
    return backend == "triton" and device == "cpu"


def skip_if_interpreted(device, backend):
    if interpreted(device, backend):
        pytest.skip("Triton interpreter: covered by the short test_triton_interpreter_* cases (full sweep on GPU)")


# ------------------------------------------------------------------------------------------------
# Independent oracle: the visibility rule and the scores as the issue states them, one pair at a time.
# ------------------------------------------------------------------------------------------------

def oracle_id(p, L, n, c):
    """Context positions get id 0, p >= c gets p - c + 1 (c = 0: p); targets share the first target's id."""
    def base(x):
        return (0 if x < c else x - c + 1) if c > 0 else x
    return base(L - n) if n > 0 and p >= L - n else base(p)


def oracle_visible(i, j, L, n, c, causal, max_attn_len):
    if i == j:
        return True
    d = oracle_id(i, L, n, c) - oracle_id(j, L, n, c)
    if not causal:
        d = abs(d)
    if d > 0 and (max_attn_len == 0 or d <= max_attn_len):
        return True
    return c > 0 and oracle_id(i, L, n, c) == 0 and j < L - n  # context sees every non-target key


def oracle_attention(q, k, v, offsets, M, kind, causal, scale, num_targets, c, max_attn_len, pos_bias, time_bias,
                     timestamps):
    q, k, v = q.detach(), k.detach(), v.detach()
    pos_bias = None if pos_bias is None else pos_bias.detach()
    time_bias = None if time_bias is None else time_bias.detach()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    for b in range(offsets.numel() - 1):
        start, L = int(offsets[b]), int(offsets[b + 1] - offsets[b])
        n = 0 if num_targets is None else int(num_targets[b])
        for h in range(q.shape[1]):
            for i in range(L):
                scores, keys = [], []
                for j in range(L):
                    if not oracle_visible(i, j, L, n, c, causal, max_attn_len):
                        continue
                    s = scale * float(q[start + i, h].double() @ k[start + j, h].double())
                    if pos_bias is not None:
                        s += float(pos_bias[h % pos_bias.shape[0], j - i + M - 1])
                    if time_bias is not None:
                        dt = abs(int(timestamps[start + i]) - int(timestamps[start + j]))
                        bucket = min(NUM_BUCKETS, math.floor(math.log(max(dt, 1)) / 0.301))
                        s += float(time_bias[h % time_bias.shape[0], bucket])
                    scores.append(s)
                    keys.append(j)
                if kind == "softmax":
                    top = max(scores)
                    weights = [math.exp(s - top) for s in scores]
                    weights = [w / sum(weights) for w in weights]
                else:
                    weights = [s / (1 + math.exp(-s)) / M for s in scores]
                for w, j in zip(weights, keys):
                    out[start + i, h] += w * v[start + j, h].double()
    return out


def make_inputs(lengths, *, H=2, D=8, Dv=None, dtype=torch.float32, device="cpu", pos_heads=None, time_heads=None,
                M=None, targets=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(lengths, device=device)
    N = int(sum(lengths))
    M = max([0, *lengths]) if M is None else M
    Dv = D if Dv is None else Dv

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device).requires_grad_(True)

    inputs = dict(q=rnd(N, H, D), k=rnd(N, H, D), v=rnd(N, H, Dv), seq_offsets=offsets, max_seq_len=M)
    if pos_heads:
        inputs["pos_bias"] = (0.5 * torch.randn(pos_heads, 2 * M - 1, generator=g)).to(device).requires_grad_(True)
    if time_heads:
        time_bias = 0.5 * torch.randn(time_heads, NUM_BUCKETS + 1, generator=g)
        inputs["time_bias"] = time_bias.to(device).requires_grad_(True)
        # Spread over ~e^(0.301*NUM_BUCKETS) so every bucket, the clamped last one included, occurs.
        inputs["timestamps"] = torch.randint(0, 40, (N,), generator=g).to(device) ** 2
    if targets is not None:
        inputs["num_targets"] = torch.tensor(targets, dtype=torch.int64, device=device)
    return inputs


def leaves(inputs):
    return [inputs[name] for name in ("q", "k", "v", "pos_bias", "time_bias") if name in inputs]


def run(inputs, backend, grad_seed=1, **options):
    out = gk.jagged_attention(**inputs, backend=backend, **options)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out)
    grads = torch.autograd.grad(out, leaves(inputs), grad_out)
    return out, grads


# ------------------------------------------------------------------------------------------------
# The reference against the oracle
# ------------------------------------------------------------------------------------------------

MASK_CASES = [
    dict(lengths=[6, 0, 9, 1], causal=True),
    dict(lengths=[6, 0, 9, 1], causal=False),
    dict(lengths=[7, 9, 3], targets=[2, 3, 0]),
    dict(lengths=[7, 9, 3], targets=[2, 3, 0], causal=False),
    dict(lengths=[8, 9, 4], contextual_len=3),
    dict(lengths=[8, 9, 4], contextual_len=3, causal=False),
    dict(lengths=[10, 9, 5], max_attn_len=2),
    dict(lengths=[10, 9, 5], max_attn_len=2, causal=False),
    dict(lengths=[10, 12, 6], targets=[3, 1, 2], contextual_len=2, max_attn_len=3),
    dict(lengths=[10, 12, 6], targets=[3, 1, 2], contextual_len=4, max_attn_len=2, causal=False),
]


@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: str(sorted(c.items())))
def test_reference_mask_matches_oracle(case):
    case = dict(case)
    lengths = case.pop("lengths")
    targets = case.pop("targets", None)
    c, mal, causal = case.get("contextual_len", 0), case.get("max_attn_len", 0), case.get("causal", True)
    M = max(lengths) + 2  # padding past the longest sequence must stay invisible
    lens = torch.tensor(lengths)
    nt = None if targets is None else torch.tensor(targets)
    valid = ref.visibility_mask(lens, M, causal=causal, num_targets=nt, contextual_len=c, max_attn_len=mal)
    for b, L in enumerate(lengths):
        n = 0 if targets is None else targets[b]
        expected = torch.tensor([[i < L and j < L and oracle_visible(i, j, L, n, c, causal, mal) for j in range(M)]
                                 for i in range(M)])
        assert torch.equal(valid[b], expected), f"sequence {b}"


@pytest.mark.parametrize("kind", ["softmax", "hstu"])
@pytest.mark.parametrize("case", MASK_CASES[::3] + [MASK_CASES[-1]], ids=lambda c: str(sorted(c.items())))
def test_reference_output_matches_oracle(kind, case):
    case = dict(case)
    lengths, targets = case.pop("lengths"), case.pop("targets", None)
    inputs = make_inputs(lengths, pos_heads=2, time_heads=1, targets=targets, M=max(lengths) + 3)
    scale = 0.3
    out = gk.jagged_attention(**inputs, kind=kind, scale=scale, backend="reference", **case)
    expected = oracle_attention(inputs["q"], inputs["k"], inputs["v"], inputs["seq_offsets"], inputs["max_seq_len"],
                                kind, case.get("causal", True), scale, inputs.get("num_targets"),
                                case.get("contextual_len", 0), case.get("max_attn_len", 0), inputs["pos_bias"],
                                inputs["time_bias"], inputs["timestamps"])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["softmax", "hstu"])
def test_reference_backward_matches_autograd(kind):
    """The reference backend's closed-form backward against torch autograd through the padded forward."""
    inputs = make_inputs([7, 0, 12, 1], pos_heads=2, time_heads=1, targets=[2, 0, 3, 0])
    options = dict(kind=kind, causal=True, scale=0.4, contextual_len=2, max_attn_len=4)
    _, grads = run(inputs, "reference", **options)
    out, _ = ref.jagged_attention_with_lse(
        inputs["q"], inputs["k"], inputs["v"], inputs["seq_offsets"], inputs["max_seq_len"], kind, True, 0.4,
        inputs["num_targets"], 2, 4, inputs["pos_bias"], inputs["time_bias"], inputs["timestamps"])
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    expected = torch.autograd.grad(out, leaves(inputs), grad_out)
    for got, exp in zip(grads, expected):
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# Every backend against the reference
# ------------------------------------------------------------------------------------------------

# (lengths, inputs options, op options): each option alone, then combined.
CASES = [
    ([5, 0, 70, 1, 130], {}, {}),
    ([5, 0, 70, 1, 130], {}, dict(causal=False)),
    ([9, 33, 2], {}, dict(scale=0.7)),
    ([9, 140, 3, 0], dict(targets=[2, 40, 3, 0]), {}),
    ([9, 140, 3], {}, dict(contextual_len=5)),
    ([2, 140, 3], {}, dict(contextual_len=150)),  # every position is context
    ([9, 140, 3], {}, dict(max_attn_len=17)),
    ([9, 260, 3], {}, dict(max_attn_len=70, causal=False)),  # a band across three 128-key tiles
    ([9, 140, 3], dict(pos_heads=2), {}),
    ([9, 140, 3], dict(pos_heads=1, M=150), {}),
    ([9, 140, 3], dict(time_heads=2), {}),
    ([9, 140, 3], dict(time_heads=1), {}),
    ([9, 140, 3, 0, 1], dict(targets=[3, 20, 1, 0, 0], pos_heads=2, time_heads=1), dict(contextual_len=4,
                                                                                      max_attn_len=30)),
    ([9, 140, 3, 0, 1], dict(targets=[3, 20, 1, 0, 1], pos_heads=1, time_heads=2), dict(contextual_len=2,
                                                                                      max_attn_len=9,
                                                                                      causal=False)),
    # The model's mask (causal, contextual prefix, targets, no window): each row a key prefix plus
    # itself, the targets' span crossing the 128-key tile edge.
    ([9, 140, 3, 0, 1], dict(targets=[3, 20, 1, 0, 1], pos_heads=2, time_heads=2), dict(contextual_len=2)),
    # The cpu kernel runs the products of a mixed tile of these masks in 32-row / 32-key strips, each
    # over the keys / rows it sees: lengths off the strip and tile grids, a window starting mid-strip,
    # and a prefix mask whose targets' holes cross strip edges.
    ([200, 77, 33, 0], {}, {}),
    ([200, 77], {}, dict(max_attn_len=45)),
    ([200, 77], dict(targets=[70, 9], pos_heads=2, time_heads=1), dict(contextual_len=3)),
    ([1], {}, {}),
    ([0, 0], {}, {}),
    ([], {}, {}),
]


def eager_attention(q, k, v, pos_bias, time_bias, *, seq_offsets, max_seq_len, kind="softmax", causal=True,
                    scale=None, num_targets=None, contextual_len=0, max_attn_len=0, timestamps=None):
    """The padded formulation computed eagerly in q's dtype throughout (no fp32 upcast; biases cast to
    it), differentiated by autograd: FlashAttention's "same computation in the same dtype"."""
    dtype, M = q.dtype, max_seq_len
    scale = ref.default_scale(q.shape[2]) if scale is None else scale
    qp, (seq_ids, pos) = ref._pad(q, seq_offsets, M)
    kp, _ = ref._pad(k, seq_offsets, M)
    vp, _ = ref._pad(v, seq_offsets, M)
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp) * scale
    if pos_bias is not None:
        rel = torch.arange(M, device=q.device)
        scores = scores + pos_bias.to(dtype)[:, rel.view(1, -1) - rel.view(-1, 1) + M - 1].unsqueeze(0)
    if time_bias is not None:
        tp, _ = ref._pad(timestamps.long(), seq_offsets, M)
        buckets = ref.time_buckets(tp.unsqueeze(2) - tp.unsqueeze(1), time_bias.shape[1] - 1)
        scores = scores + time_bias.to(dtype)[:, buckets].transpose(0, 1)
    valid = ref.visibility_mask(seq_offsets.long().diff(), M, causal=causal, num_targets=num_targets,
                                contextual_len=contextual_len, max_attn_len=max_attn_len).unsqueeze(1)
    if kind == "softmax":
        weights = torch.softmax(scores.masked_fill(~valid, torch.finfo(dtype).min), dim=-1) * valid
    else:
        weights = torch.nn.functional.silu(scores) / M * valid
    return torch.einsum("bhij,bjhd->bihd", weights, vp)[seq_ids, pos]


def _check_against_reference(inputs, backend, dtype, **options):
    poison_allocator(sum(t.numel() * 4 for t in leaves(inputs)), inputs["q"].device)
    out, grads = run(inputs, backend, **options)
    names = [n for n in ("q", "k", "v", "pos_bias", "time_bias") if n in inputs]
    if dtype != torch.float32:
        _check_half_against_reference(inputs, backend, dtype, out, grads, names, **options)
        return
    expected_out, expected_grads = run(inputs, "reference", **options)
    assert out.shape == expected_out.shape and out.dtype == dtype
    assert_close(out, expected_out, dtype)
    exact_grads = _fp64_reference_grads(inputs, names, **options) if any(n.endswith("bias") for n in names) else {}
    for name, got, exp in zip(names, grads, expected_grads):
        assert got.shape == exp.shape and got.dtype == exp.dtype, name
        if name.endswith("bias"):
            _assert_bias_grad_close(got, exp, exact_grads[name], name)
        else:
            assert_close(got, exp, dtype)


def _assert_matches_reference(inputs, out, grads, **options):
    """out and grads (run()'s grad_out, seed 1) of one float32 call against the reference's, as
    _check_against_reference judges them."""
    names = [n for n in ("q", "k", "v", "pos_bias", "time_bias") if n in inputs]
    expected_out, expected_grads = run(inputs, "reference", **options)
    assert_close(out, expected_out, torch.float32)
    exact_grads = _fp64_reference_grads(inputs, names, **options) if any(n.endswith("bias") for n in names) else {}
    for name, got, exp in zip(names, grads, expected_grads):
        if name.endswith("bias"):
            _assert_bias_grad_close(got, exp, exact_grads[name], name)
        else:
            assert_close(got, exp, torch.float32)


def _fp64_reference_grads(inputs, names, **options):
    """The reference's gradients of `names` on the same inputs in float64 (float64_ground_truth lets the
    reference backend take them), with run()'s grad_out."""
    inputs64 = {n: (t.detach().double().requires_grad_(True) if n in names else t) for n, t in inputs.items()}
    with float64_ground_truth():
        _, grads64 = run(inputs64, "reference", **options)
    return dict(zip(names, grads64))


def _assert_bias_grad_close(got, ref32, exact, name):
    """A bias gradient sums up to H * sum L^2 terms, so the fp32 reference is itself off by an amount
    that grows with the sizes (at H = 8, D = 128, lengths [400, 700] its time-bias gradient is 10x
    further from float64 than the cpu kernel's). FlashAttention's rule against the float64 reference:
    the error is at most twice the fp32 reference's own, plus 4e-5 of the largest entry."""
    scale = max(1.0, float(exact.abs().max()))
    err = (got.double() - exact).abs().max().item() if got.numel() else 0.0
    ref_err = (ref32.double() - exact).abs().max().item() if got.numel() else 0.0
    assert err <= 2 * ref_err + 4e-5 * scale, (f"grad {name}: max error {err} against float64 > 2 x the fp32 "
                                               f"reference's {ref_err} + 4e-5 x {scale}")


def _check_half_against_reference(inputs, backend, dtype, out, grads, names, **options):
    """fp16/bf16 by FlashAttention's rule: out, dq, dk, dv and the bias gradients against the fp32
    reference on the same (dtype-valued) inputs, at most twice the error of eager_attention in the
    dtype, plus a rounding-sized atol."""
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)  # as run() draws it
    fixed = {n: t for n, t in inputs.items() if n not in names}
    exact_leaves = [inputs[n].detach().float().requires_grad_(True) for n in names]
    exact = gk.jagged_attention(**fixed, **dict(zip(names, exact_leaves)), backend="reference", **options)
    exact_grads = torch.autograd.grad(exact, exact_leaves, grad_out.float())
    eager_leaves = [inputs[n].detach().clone().requires_grad_(True) for n in names]
    named = dict(zip(names, eager_leaves))
    eager = eager_attention(named["q"], named["k"], named["v"], named.get("pos_bias"), named.get("time_bias"),
                            **fixed, **options)
    eager_grads = torch.autograd.grad(eager, eager_leaves, grad_out, materialize_grads=True)
    factor = interpreter_rounding_factor(backend, out.device, dtype)
    assert out.shape == exact.shape and out.dtype == dtype
    assert_close_vs_eager(out, exact, eager, dtype, "out", factor)
    for name, got, e, ea in zip(names, grads, exact_grads, eager_grads):
        assert got.shape == e.shape and got.dtype == inputs[name].dtype, name
        assert_close_vs_eager(got, e, ea, dtype, f"grad {name}", factor)


@pytest.mark.parametrize("device,backend", device_backend_params(BACKENDS))
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
@pytest.mark.parametrize("lengths,input_options,options", CASES)
def test_backend_matches_reference(device, backend, kind, lengths, input_options, options):
    skip_if_interpreted(device, backend)
    inputs = make_inputs(lengths, device=device, **input_options)
    _check_against_reference(inputs, backend, torch.float32, kind=kind, **options)


@pytest.mark.parametrize("device,expected", [
    pytest.param("cpu", "cpu", marks=pytest.mark.skipif("cpu" not in gk.available_backends(),
                                                        reason="gem_kernels._C not built")),
    pytest.param("cuda", "triton", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                              reason="no CUDA device on this machine")]),
])
def test_auto_backend_choice(device, expected, monkeypatch):
    """auto: cpu on CPU tensors; triton (tensor cores) before cuda on CUDA tensors, forward and backward."""
    chosen = []
    real_kernel = attention_ops.kernel

    def spy(family, op, backend):
        chosen.append(backend)
        return real_kernel(family, op, backend)

    monkeypatch.setattr(attention_ops, "kernel", spy)
    run(make_inputs([5, 0, 3], device=device, pos_heads=1), "auto")
    assert chosen == [expected, expected]


@pytest.mark.parametrize("device,backend", device_backend_params(BACKENDS))
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(device, backend, kind, dtype):
    lengths = [9, 0, 70, 1]
    if interpreted(device, backend) and (kind, dtype) not in (("softmax", torch.bfloat16), ("hstu", torch.float16)):
        lengths = [9, 0, 12, 1]  # Triton interpreter: the other dtype of each kind on short sequences
    inputs = make_inputs(lengths, dtype=dtype, device=device, targets=[2, 0, 5, 0], pos_heads=2, time_heads=1)
    _check_against_reference(inputs, backend, dtype, kind=kind, contextual_len=2, max_attn_len=20)


@pytest.mark.parametrize("device,backend", device_backend_params(BACKENDS))
@pytest.mark.parametrize("D,Dv", [(24, 24), (40, 40), (24, 40), (40, 7)])
def test_head_dims(device, backend, D, Dv):
    lengths = [13, 0, 29]
    if interpreted(device, backend) and (D, Dv) != (40, 7):
        lengths = [5, 0, 3]  # Triton interpreter: the other head dims on short sequences
    inputs = make_inputs(lengths, D=D, Dv=Dv, H=3, device=device, pos_heads=3)
    for kind in ("softmax", "hstu"):
        _check_against_reference(inputs, backend, torch.float32, kind=kind)


@pytest.mark.parametrize("device,backend", device_backend_params(BACKENDS))
def test_zero_heads(device, backend):
    """q, k, v of [N, 0, D]: valid, an empty output and empty gradients (a zero-size CUDA grid is a
    launch error, so the native kernels must return before launching)."""
    inputs = make_inputs([5, 0, 3], H=0, device=device, pos_heads=1, time_heads=1)
    for kind in ("softmax", "hstu"):
        for deterministic in (False, True):
            out, grads = run(inputs, backend, kind=kind, deterministic=deterministic)
            assert out.shape == (8, 0, 8)
            assert [g.shape for g in grads] == [t.shape for t in leaves(inputs)]
            assert float(grads[3].abs().sum()) == 0 and float(grads[4].abs().sum()) == 0  # no pair, no bias grad


@pytest.mark.parametrize("device,backend", cuda_kernel_params())
def test_cuda_kernels_refuse_head_dims_beyond_shared_memory(device, backend):
    """The CUDA attention keeps its tiles' rows in shared memory: head dims past the GPU's opt-in
    limit raise a ValueError naming them (not a bare launch error) and the backends that take them."""
    inputs = make_inputs([3], D=2048, device=device)
    with pytest.raises(ValueError, match="head dims Dqk = 2048, Dv = 2048 need .* the triton backend takes head "
                                         "dims up to 1024 in fp16/bf16 and 512 in fp32, the reference backend any"):
        gk.jagged_attention(**inputs, backend=backend)
    # D = 400: the forward's 152 KiB fit (with the opt-in past 48 KiB), the backward's 254 KiB do not.
    inputs = make_inputs([3], D=400, device=device)
    out = gk.jagged_attention(**inputs, backend=backend)
    with pytest.raises(ValueError, match="jagged_attention backward: head dims Dqk = 400"):
        out.sum().backward()


@pytest.mark.parametrize("device,backend", device_backend_params(("triton",)))
def test_triton_refuses_head_dims_beyond_shared_memory(device, backend):
    """The triton backend's smallest tiles fit head dims up to 512 (fp32) and 1024 (fp16/bf16) in a GPU
    block's shared memory: above, a ValueError naming them, before anything launches, forward and
    backward alike (empty batches too); at the limit it runs."""
    from gem_kernels.triton.attention import MAX_HEAD_DIM, jagged_attention_bwd

    assert MAX_HEAD_DIM == {torch.float16: 1024, torch.bfloat16: 1024, torch.float32: 512}
    for lengths in ([3], []):
        inputs = make_inputs(lengths, D=513, Dv=8, device=device)
        with pytest.raises(ValueError, match="head dims Dqk = 513, Dv = 8 are above the triton backend's limit of "
                                             "512 for float32"):
            gk.jagged_attention(**inputs, backend=backend)
    q = torch.ones(2, 1, 4, device=device)
    v = torch.ones(2, 1, 1025, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Dqk = 4, Dv = 1025 are above the triton backend's limit of 1024 for bfloat16"):
        jagged_attention_bwd(v, q.bfloat16(), q.bfloat16(), v, v, None, torch.tensor([0, 2], device=device), 2,
                             "hstu", True, 0.5, None, 0, 0, None, None, None, None, False)
    inputs = make_inputs([3, 2], D=512, device=device)
    _check_against_reference(inputs, backend, torch.float32, kind="softmax")


def test_triton_tiles_narrow_as_head_dims_grow(monkeypatch):
    """The GPU tile choice (compiled for sm_90a: see _launch_config): 64 x 64 up to head dim 128 in
    fp16/bf16, then 32 and 16; fp32 on 16 x 16 throughout; the interpreter 64 x 64 for all."""
    pytest.importorskip("triton")
    from gem_kernels.triton import attention as triton_attention

    monkeypatch.setattr(triton_attention, "triton_interpret", lambda: False)
    config = triton_attention._launch_config
    assert [config(torch.bfloat16, d, 16) for d in (16, 64, 128, 256, 512, 1024)] == [
        (64, 4), (64, 8), (64, 8), (32, 8), (16, 8), (16, 8)]
    assert config(torch.float16, 16, 256) == (32, 8)
    assert [config(torch.float32, d, d) for d in (32, 64, 128, 512)] == [(16, 4), (16, 4), (16, 8), (16, 8)]
    monkeypatch.setattr(triton_attention, "triton_interpret", lambda: True)
    assert config(torch.float32, 512, 512) == (64, 8) and config(torch.bfloat16, 256, 16) == (64, 8)


@pytest.mark.parametrize("device,backend", device_backend_params(BACKENDS))
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
@pytest.mark.parametrize("pos_heads,time_heads,extra_len", [(1, 2, None), (2, 1, 80)])
def test_deterministic_backward_is_bit_identical(device, backend, kind, pos_heads, time_heads, extra_len):
    """deterministic=True with both biases: the same bits twice, and the reference's values. max_seq_len =
    longest + 80 leaves relative positions and key blocks that no sequence reaches (gradient exactly 0)."""
    lengths = [40, 3, 70, 17] if interpreted(device, backend) else [40, 3, 200, 17]
    M = None if extra_len is None else max(lengths) + extra_len
    inputs = make_inputs(lengths, H=2, device=device, pos_heads=pos_heads, time_heads=time_heads,
                         targets=[3, 0, 9, 1], M=M)
    options = dict(kind=kind, contextual_len=2, max_attn_len=50, deterministic=True)
    first = run(inputs, backend, **options)
    second = run(inputs, backend, **options)
    for a, b in zip([first[0], *first[1]], [second[0], *second[1]]):
        assert torch.equal(a, b)
    _check_against_reference(inputs, backend, torch.float32, **options)
    if M is not None:
        reach = max(lengths) - 1  # |j - i| <= L - 1
        unreachable = torch.cat([first[1][3][:, :M - 1 - reach], first[1][3][:, M + reach:]], 1)
        assert torch.equal(unreachable, torch.zeros_like(unreachable))


@cpu_kernel_only
@pytest.mark.parametrize("kind", ["softmax", "hstu"])  # hstu: the short path for lengths <= 128 too
def test_cpu_backward_is_independent_of_thread_count(kind):
    """Per-item bias partials reduced in item order: 1 and 2 threads give the same bits."""
    # ~7e7 FLOPs: enough work that the kernel does use a second thread (it stays on one below ~2^24 a thread).
    inputs = make_inputs([150, 3, 200, 17, 90], H=4, D=64, pos_heads=1, time_heads=4, targets=[3, 0, 9, 1, 0])
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, grads = run(inputs, "cpu", kind=kind, contextual_len=2, deterministic=True)
            results.append([out, *grads])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@cpu_kernel_only
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
def test_cpu_long_path_streams_rows_of_large_outputs(kind):
    """The tile loops write out, dq, dk and dv a row at a time from the workspace, with streaming stores
    once a call's outputs reach 4 MiB (kStreamRowsMinBytes): 1100 rows x 8 heads x 128 is 4.5 MB each,
    so both the forward and the backward take the streaming writes (the other cases are smaller). With
    both biases shared by the 8 heads: their gradients sum ~2.6 * 10^6 terms here (the causal pairs of
    8 heads), a size at which the fp32 reference is itself off (softmax's time-bias gradient by 1.1e-3
    against float64, the kernel's by 3e-5; _assert_bias_grad_close judges them against float64)."""
    inputs = make_inputs([400, 700], H=8, D=128, pos_heads=1, time_heads=1)
    assert inputs["v"].numel() * 4 >= 4 << 20
    _check_against_reference(inputs, "cpu", torch.float32, kind=kind)


# The cpu kernel's short-sequence HSTU path (csrc/cpu/attention_short.h) takes items of at most 128
# rows with D and Dv multiples of 8 and a banded or prefix mask; the others take the tile loops.
SHORT_PATH_CASES = [
    # its length bound: 128 and 127 short, 129 not; 1, 8 and 9 around one 8-column block
    ([128, 129, 127, 1, 8, 9, 0], dict(targets=[5, 9, 0, 1, 0, 9, 0], pos_heads=2, time_heads=2),
     dict(contextual_len=2)),
    ([128, 129, 17, 64], dict(pos_heads=1, time_heads=2), dict(max_attn_len=11)),  # banded: rows start past 0
    ([128, 129, 17, 64], dict(pos_heads=2), dict(max_attn_len=11, causal=False)),
    ([128, 129, 17, 64], dict(time_heads=1), dict(causal=False)),  # every pair visible
    ([128, 129, 17, 64], dict(targets=[4, 0, 3, 2], time_heads=2), dict(max_attn_len=5)),  # per-pair mask: tiles
    # contextual rows that see every key, the last one's pos bias at 2L - 2: read in place where round8(L)
    # <= max_seq_len (17, 3), from a padded copy where not (75)
    ([75, 17, 3], dict(pos_heads=2, time_heads=1), dict(contextual_len=2)),
]


@cpu_kernel_only
# (12, 16): D not a multiple of 8, tile loops; where the CPU has AVX-512F, (16, 16) takes the backward's
# 16-key blocks for the scores, dP, dk and dv (dot_key_block16, key_block16), (32, 16) for dk and dv only
@pytest.mark.parametrize("D,Dv", [(8, 16), (16, 8), (12, 16), (16, 16), (32, 16)])
@pytest.mark.parametrize("lengths,input_options,options", SHORT_PATH_CASES)
def test_cpu_short_path_matches_reference(D, Dv, lengths, input_options, options):
    inputs = make_inputs(lengths, D=D, Dv=Dv, **input_options)
    _check_against_reference(inputs, "cpu", torch.float32, kind="hstu", **options)


@cpu_kernel_only
@pytest.mark.parametrize("H", [1, 2, 3])
@pytest.mark.parametrize("time_heads", [1, "H"])
def test_cpu_short_path_time_bias_gradient_of_every_head(H, time_heads):
    """The short backward's time-bias gradient: two heads (the model's) take it in one pass over both
    heads' dS after their rows, bucket pairs side by side; other head counts one pass per head. Each
    head's gradient lands in its own row (time_heads = H) or in the shared one (1), as the reference's."""
    time_heads = H if time_heads == "H" else time_heads
    inputs = make_inputs([74, 36, 9, 1, 20], H=H, D=16, pos_heads=H, time_heads=time_heads, targets=[8, 3, 1, 0, 2])
    g = torch.Generator().manual_seed(H)
    inputs["timestamps"] = torch.randint(0, 10**6, (inputs["q"].shape[0],), generator=g) ** 2
    _check_against_reference(inputs, "cpu", torch.float32, kind="hstu", contextual_len=2)


_ROW_PATHS_CHECK = """
import os
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from tests.test_attention import _check_against_reference, make_inputs
# rows of 32+ keys (the 16-lane rows where the CPU has AVX-512F) and of fewer, long and short items,
# a 16 + 8 + 3 tail (lengths 27, 59), softmax and hstu with both biases
inputs = make_inputs([300, 59, 27, 0, 130], pos_heads=2, time_heads=2, targets=[7, 3, 0, 0, 2])
for kind in ("softmax", "hstu"):
    _check_against_reference(inputs, "cpu", torch.float32, kind=kind, contextual_len=1)
# the short path's forward rows (16 lanes, four rows a group, where the CPU has AVX-512F): lengths around
# 16-column blocks (8: one 8-wide block, 16, 17, 24: 16 + 8, 33, 74: the model's longest, 5: a group of
# 4 + 1), D = Dv = 16 (one register a row) and Dv = 24 (the 8-lane P V), time tables of 9 and 41 entries
# (two and four registers) and 151 (scalar loads), buckets up to the table's last
for D, Dv, buckets in ((16, 16, 8), (8, 24, 40), (16, 16, 150)):
    inputs = make_inputs([8, 16, 17, 24, 33, 74, 5], D=D, Dv=Dv, pos_heads=2, time_heads=2, targets=[1, 0, 3, 8, 2, 8, 1])
    g = torch.Generator().manual_seed(buckets)
    inputs["time_bias"] = (0.5 * torch.randn(2, buckets + 1, generator=g)).requires_grad_(True)
    inputs["timestamps"] = torch.randint(0, 10**6, (inputs["q"].shape[0],), generator=g) ** 2
    _check_against_reference(inputs, "cpu", torch.float32, kind="hstu", contextual_len=2)
print("row paths ok")
"""


@cpu_kernel_only
@pytest.mark.parametrize("avx512", ["as the CPU has it", "off"])
def test_cpu_rows_on_both_paths(avx512):
    """The cpu kernel's exp and SiLU rows (forward and backward) take 16 AVX-512F lanes for rows of
    32+ keys where the CPU has it, 8 AVX2 lanes otherwise, and so do the short path's forward rows:
    both paths against the reference, forward and every gradient, whatever CPU runs the tests
    (GEM_KERNELS_NO_AVX512=1 takes AVX2 on any). A fresh process: the path is chosen once."""
    run_on_vector_path(_ROW_PATHS_CHECK, avx512, "row paths ok")


_LONG_ROW_EDGES_CHECK = """
import math
import torch
from tests.test_attention import _agree_with_reference, _check_against_reference, _forward_backward, _only_nan_rows, make_inputs
# One sequence of 300 (two key tiles; rows of 32+ keys take the 16-lane rows where the CPU has AVX-512F)
# and one of 40, H = 1.
def inputs_of(seed):
    x = make_inputs([300, 40], H=1, D=8, pos_heads=1, seed=seed)
    return {n: (t.detach().clone() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
for kind in ("softmax", "hstu"):
    # A NaN in key 100 of sequence 0 reaches exactly the rows 100..299 (causal): the rows' max and exp
    # keep it (forward) and so do the backward's rows; every other row finite.
    x = inputs_of(0)
    x["k"][100, 0, 3] = math.nan
    out, grads = _agree_with_reference(x, "cpu", kind=kind)
    _only_nan_rows(out, [(i, 0) for i in range(100, 300)])
# softmax: a -inf bias at relative position -1 (each query's previous key) weighs exactly 0 even for a
# value of 1e36 (a weight of exp(-87) ~ 1.6e-38 there would add ~0.02 to that row's out and more to its
# dq and dk): rows 41 of sequence 0 (key 40) and 300 + 21 of sequence 1 (key 20) match the reference.
x = inputs_of(1)
x["pos_bias"][0, x["max_seq_len"] - 2] = -math.inf
x["v"][40, 0] = 1e36
x["v"][320, 0] = 1e36
out, _ = _agree_with_reference(x, "cpu", check_grads=False, kind="softmax")
assert bool(out[41].abs().max() < 10) and bool(out[321].abs().max() < 10), (out[41], out[321])
# The gradients elsewhere are ~1e36 (fp32 rounding beyond any tolerance); those two rows' dq is not.
_, grads = _forward_backward(x, "cpu", kind="softmax")
_, grads_ref = _forward_backward(x, "reference", kind="softmax")
for row in (41, 321):
    torch.testing.assert_close(grads["q"][row], grads_ref["q"][row], atol=1e-5, rtol=1e-5)
# softmax: a NaN among -inf scores only. Every pos_bias entry -inf but relative position -200, and
# key 99 holds a NaN, which a -inf bias does not mask: rows 99..199 of sequence 0 see one NaN score and
# -inf (the row max's NaN flag makes them NaN; without it the max reads -inf and they output 0), rows
# 200..299 a NaN and a finite score, rows 0..98 and sequence 1 -inf only (out 0).
x = inputs_of(2)
x["pos_bias"].fill_(-math.inf)
x["pos_bias"][0, x["max_seq_len"] - 1 - 200] = 0.0
x["k"][99, 0, 5] = math.nan
out, _ = _agree_with_reference(x, "cpu", check_grads=False, kind="softmax")
_only_nan_rows(out, [(i, 0) for i in range(99, 300)])
# hstu with both biases and sorted timestamps (the bench's): most 16-key blocks of a row stay in one time
# bucket (one broadcast bias; the buckets kept for the backward's time-bias gradient), some cross one
# (the walk); forward and every gradient.
x = make_inputs([300, 40], H=2, D=8, pos_heads=2, time_heads=2, seed=3)
g = torch.Generator().manual_seed(3)
x["timestamps"] = torch.randint(0, 10**7, (340,), generator=g).sort().values
_check_against_reference(x, "cpu", torch.float32, kind="hstu")
print("long row edges ok")
"""


@cpu_kernel_only
@pytest.mark.parametrize("avx512", ["as the CPU has it", "off"])
def test_cpu_long_rows_keep_nan_and_zero_weights(avx512):
    """The long path's rows of 32+ keys (16 AVX-512F lanes where the CPU has them, 8 AVX2 lanes
    otherwise): a NaN score reaches its whole row (the row max's NaN flag, the exp's NaN lanes), a -inf
    score (a -inf bias) weighs exactly 0 in the forward and the backward (the exp's blend below -87),
    and the time buckets of sorted timestamps (16-key blocks in one bucket) give the reference's biases
    and time-bias gradient. Against the reference. A fresh process per path."""
    run_on_vector_path(_LONG_ROW_EDGES_CHECK, avx512, "long row edges ok")


_FUSED_HSTU_ROWS_CHECK = """
import torch
from tests.test_attention import _check_against_reference, make_inputs
# The long path's HSTU rows in one pass (hstu_fwd_rows / hstu_bwd_rows where the CPU has AVX-512F: the
# biases, the SiLU, dS and the position gradient of a row at once). Lengths 300 and 517: full tiles,
# causal diagonal tiles (rows of 1..256 keys: 16-key blocks and tails of every length), a last tile of
# 5 rows; sorted timestamps (most blocks in one bucket: the broadcast) and unsorted ones (blocks that
# cross: the walk); each bias alone and both; per-head and shared biases.
for seed, (pos_heads, time_heads, sort) in enumerate([(2, 2, True), (1, 2, False), (2, None, True), (None, 1, True)]):
    x = make_inputs([300, 517], H=2, D=8, pos_heads=pos_heads, time_heads=time_heads, seed=seed)
    if time_heads and sort:
        g = torch.Generator().manual_seed(seed)
        x["timestamps"] = torch.randint(0, 10**7, (817,), generator=g).sort().values
    _check_against_reference(x, "cpu", torch.float32, kind="hstu")
x = make_inputs([300, 517], H=2, D=8, pos_heads=2, time_heads=2, seed=7)
# a window: rows whose keys start past the tile's first column (banded), and not causal (every tile mixed
# or full, rows running past the diagonal)
_check_against_reference(x, "cpu", torch.float32, kind="hstu", max_attn_len=70)
_check_against_reference(x, "cpu", torch.float32, kind="hstu", causal=False, max_attn_len=100)
# targets and a contextual prefix: tiles with a hole (the other targets) take the two-pass form, the
# others the fused one, in the same item
x = make_inputs([300, 517], H=2, D=8, pos_heads=2, time_heads=2, targets=[9, 40], seed=8)
_check_against_reference(x, "cpu", torch.float32, kind="hstu", contextual_len=3)
print("fused hstu rows ok")
"""


@cpu_kernel_only
@pytest.mark.parametrize("avx512", ["as the CPU has it", "off"])
def test_cpu_long_path_fused_hstu_rows(avx512):
    """The long path's HSTU rows take the biases, the SiLU (forward) and SiLU' with the position
    gradient (backward) in one pass a row where the CPU has AVX-512F, scores_tile's passes otherwise:
    both against the reference, forward and every gradient, over the masks and bias layouts that
    decide which tiles take which form. A fresh process per path."""
    run_on_vector_path(_FUSED_HSTU_ROWS_CHECK, avx512, "fused hstu rows ok")


_KEPT_WORKSPACE_CHECK = """
import torch
from tests.test_attention import _check_against_reference, make_inputs
torch.set_num_threads(1)  # one thread: every call below runs on the workspace the first one left
for D in (8, 32):  # then 128 rows of 32: 4x the dk and dv rows of the workspace that D = 8 sized
    inputs = make_inputs([128, 100, 7], D=D, Dv=D, pos_heads=2, time_heads=2, targets=[3, 0, 1])
    _check_against_reference(inputs, "cpu", torch.float32, kind="hstu", contextual_len=2)
print("kept workspace ok")
"""


@cpu_kernel_only
@pytest.mark.parametrize("avx512", ["as the CPU has it", "off"])
def test_cpu_short_path_after_a_call_of_smaller_head_dims(avx512):
    """The cpu kernel keeps its short-path workspace on each thread from one call to the next
    (for_each_item); a call of wider heads must grow what depends on D and Dv (the short backward's dk
    and dv rows) before using it. A fresh process, so that the first call is the one of D = 8."""
    run_on_vector_path(_KEPT_WORKSPACE_CHECK, avx512, "kept workspace ok")


@cpu_kernel_only
@pytest.mark.parametrize("D", [8, 16])  # 16: the backward's 16-key blocks where the CPU has AVX-512F
def test_cpu_short_path_skips_the_targets_hole(D):
    """The model's mask on the short path: target 10 of sequence 0 (targets 9..11, context 2) is seen by
    itself only, so an infinite v, k or q there reaches row 10 alone (and the other targets, which skip
    it as the hole between their prefix and themselves, stay finite), as the reference says."""
    g = torch.Generator().manual_seed(0)
    lengths = [12, 40]
    inputs = dict(q=torch.randn(52, 2, D, generator=g), k=torch.randn(52, 2, D, generator=g),
                  v=torch.randn(52, 2, 16, generator=g), seq_offsets=offsets_from_lengths(lengths), max_seq_len=40,
                  num_targets=torch.tensor([3, 4]))
    inputs["pos_bias"] = 0.5 * torch.randn(2, 79, generator=g)
    for name in ("v", "k", "q"):
        poisoned = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in inputs.items()}
        poisoned[name][10, 0, 0] = math.inf
        out, grads = _agree_with_reference(poisoned, "cpu", kind="hstu", contextual_len=2)
        assert bool(out[[9, 11], 0].isfinite().all()) and bool(out[12:].isfinite().all()), name
        for grad_name, grad in grads.items():
            if grad_name != "pos_bias":
                assert bool(grad[[9, 11]].isfinite().all()), (name, grad_name)


@cpu_kernel_only
@pytest.mark.parametrize("num_buckets", [40, 150])  # 150: the thresholds past int64 (clamped) exist
def test_cpu_short_path_heads_share_buckets_at_the_thresholds(num_buckets):
    """The short path runs a sequence's heads as one item: each pair's time bucket is found once (from a
    table of |dt| cells, not a search) and each head adds its own pos_bias and time_bias rows to it. Key
    timestamps sit at every bucket threshold, one below and one above (and far apart: |dt| up to ~2^62,
    negative dt, unsorted), over lengths around 8-column blocks and at the short path's 128 rows, with
    heads whose tables differ: a bucket off by one at a threshold, or a head reading another's table,
    misses the reference."""
    from gem_kernels._attention import bucket_thresholds

    g = torch.Generator().manual_seed(5)
    thr = bucket_thresholds(num_buckets, "cpu")
    thr = thr[thr < 2**61]
    at_thresholds = torch.cat([thr - 1, thr, thr + 1, -thr, torch.tensor([0, 1, 2, 3, 2**61, -(2**61)])])
    lengths = [128, 7, 8, 9, 16, 17, 1, 33]
    N = sum(lengths)
    inputs = make_inputs(lengths, D=8, Dv=16, pos_heads=2, time_heads=2, targets=[9, 0, 3, 1, 2, 8, 1, 5])
    inputs["time_bias"] = torch.randn(2, num_buckets + 1, generator=g).requires_grad_(True)
    # Key j of each sequence at a random pick of at_thresholds: row 0's dt to it is exactly that value.
    ts = at_thresholds[torch.randint(0, at_thresholds.numel(), (N,), generator=g)]
    ts[inputs["seq_offsets"][:-1]] = 0
    inputs["timestamps"] = ts
    _check_against_reference(inputs, "cpu", torch.float32, kind="hstu", contextual_len=2)


@cpu_kernel_only
def test_cpu_short_path_nonfinite_masked_key_of_one_head():
    """A NaN in one head's k or v row of a target (its other targets skip it, so only its own row sees it)
    reaches that row and head only: the heads of a short sequence run in one item, but never read each
    other's rows."""
    lengths = [12, 8]  # targets 9..11 of sequence 0 (context 2)
    inputs = make_inputs(lengths, D=8, Dv=8, pos_heads=2, time_heads=2, targets=[3, 1])
    for name in ("k", "v"):
        poisoned = {n: (x.detach().clone() if isinstance(x, torch.Tensor) else x) for n, x in inputs.items()}
        poisoned[name][10, 1, 0] = math.nan
        out, grads = _agree_with_reference(poisoned, "cpu", kind="hstu", contextual_len=2)
        expected = torch.zeros(out.shape[:2], dtype=torch.bool)
        expected[10, 1] = True
        assert torch.equal(out.isnan().any(-1), expected), name
        for grad_name in ("q", "k", "v"):
            bad = grads[grad_name].isnan().any(-1)
            assert not bool(bad[:, 0].any()), (name, grad_name)  # head 0 never sees head 1's row
            assert not bool(bad[[9, 11], 1].any()), (name, grad_name)


@cpu_kernel_only
@pytest.mark.parametrize("D", [8, 16])  # 16: dq by runs held in registers where the CPU has AVX-512F
def test_cpu_short_path_silu_at_extreme_scores(D):
    """The short path's 16-lane SiLU rows (forward and backward) take exp(-x) without fast_exp16's edge
    blends that cannot change 1 + exp(-x) (exp16_neg): a position bias that puts the biased scores at
    -1e30, +-1e4, +-100, around the clamps (+-87.5, +-88, +-88.5) and at ordinary values, a different
    one at each relative position, and 1e30 on the diagonal (once a row, so that no row sums several
    such terms), matches the reference, forward and every gradient (a score of 1e30 keeps its SiLU of
    1e30 only with the clamp at 87; -1e30, -100 and -88.5 give a sigmoid of 0)."""
    lengths = [74, 36, 17, 9]
    M = max(lengths)
    inputs = make_inputs(lengths, D=D, Dv=16, pos_heads=2, time_heads=2, targets=[8, 3, 2, 1])
    extremes = torch.tensor([-1e30, -1e4, -100.0, -88.5, -88.0, -87.5, -30.0, -1.0, 0.0, 1.0, 30.0, 87.5, 88.0,
                             88.5, 100.0, 1e4, 0.25, -0.25])
    with torch.no_grad():
        inputs["q"].mul_(1e-3)
        n = inputs["pos_bias"].shape[1]
        inputs["pos_bias"].copy_(extremes[torch.arange(2 * n).reshape(2, n) % extremes.numel()])
        inputs["pos_bias"][:, M - 1] = 1e30
    _check_against_reference(inputs, "cpu", torch.float32, kind="hstu", contextual_len=2)


_KEPT_BUCKETS_CHECK = """
import torch
from tests.test_attention import _assert_matches_reference, make_inputs, leaves
import gem_kernels as gk

def inputs_of(seed):
    # the model's table of 33 entries (two registers and bucket 32's broadcast: time_of_buckets), every
    # bucket 0..32 occurring (|dt| up to 4e4)
    x = make_inputs([74, 36, 17, 9, 3, 1], D=16, pos_heads=2, time_heads=2, targets=[8, 3, 2, 1, 1, 0], seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    x["time_bias"] = (0.5 * torch.randn(2, 33, generator=g)).requires_grad_(True)
    x["timestamps"] = torch.randint(0, 200, (x["q"].shape[0],), generator=g) ** 2
    return x

def forward(x, **o):
    return gk.jagged_attention(**x, backend="cpu", kind="hstu", **o)

def check(x, out, **o):
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    _assert_matches_reference(x, out, torch.autograd.grad(out, leaves(x), grad_out), kind="hstu", **o)

a, b = inputs_of(0), inputs_of(1)
o = dict(contextual_len=2)
# the first forward finds and keeps its buckets; b's replaces them, so a's backward finds its own
out_a = forward(a, **o)
out_b = forward(b, **o)
check(a, out_a, **o)
check(b, out_b, **o)
# a forward that reads a's kept buckets (the model's second layer), its backward too
forward(a, **o)
check(a, forward(a, **o), **o)
# every input the buckets depend on, changed with the rest equal: found again, not read
with torch.no_grad():
    a["timestamps"].copy_(a["timestamps"].flip(0))  # in place: the same tensor, shape and values, reordered
check(a, forward(a, **o), **o)
check(a, forward(a, **o, query_timestamps=a["timestamps"] + 7), **o, query_timestamps=a["timestamps"] + 7)
check(a, forward(a, **o, query_timestamps=a["timestamps"] + 8), **o, query_timestamps=a["timestamps"] + 8)
check(a, forward(a, contextual_len=0), contextual_len=0)
check(a, forward(a, contextual_len=0, max_attn_len=5), contextual_len=0, max_attn_len=5)
a["num_targets"] = torch.tensor([1, 3, 2, 1, 1, 0])
check(a, forward(a, **o), **o)
a["seq_offsets"] = torch.tensor([0, 36, 110, 127, 136, 139, 140])
check(a, forward(a, **o), **o)
# a time table of another size (the same timestamps): other buckets
a["time_bias"] = (0.5 * torch.randn(2, 41)).requires_grad_(True)
check(a, forward(a, **o), **o)
print("kept buckets ok")
"""


@cpu_kernel_only
@pytest.mark.parametrize("avx512", ["as the CPU has it", "off"])
def test_cpu_short_path_keeps_time_buckets_between_calls(avx512):
    """The short path keeps the time buckets of a call's pairs for the next call whose timestamps, query
    timestamps, sequences, targets, mask options and bucket count all equal those they were found from
    (the GEM model's layers, forward and backward). Calls in the orders that find, keep, read and replace
    them (a backward after another batch's forward finds its own), and after each of those inputs changes
    (a timestamp changed in place included), match the reference, forward and every gradient, on both
    vector paths (their bucket finders differ)."""
    run_on_vector_path(_KEPT_BUCKETS_CHECK, avx512, "kept buckets ok")


@cpu_kernel_only
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_cpu_short_path_nonfinite_row_of_a_four_row_group(name):
    """The short backward takes dk and dv four query rows at a time over the keys all four see, and each
    row alone over its others: an Inf in history row 5 (group 4..7, which sees keys 0..5; rows 6 and 7 see
    keys 6 and 7 too) reaches exactly what the reference says, so a key row 5 does not see (6 and later)
    keeps a finite dk and dv (q), and a row that does not see key 6 keeps a finite output and dq (k, v)."""
    lengths = [23, 9]  # context 2, history 2..19, targets 20..22; then 9 rows with 1 target
    inputs = make_inputs(lengths, D=8, Dv=16, pos_heads=2, time_heads=2, targets=[3, 1])
    poisoned = {n: (x.detach().clone() if isinstance(x, torch.Tensor) else x) for n, x in inputs.items()}
    poisoned[name][5 if name == "q" else 6, 0, 0] = math.inf
    out, grads = _agree_with_reference(poisoned, "cpu", kind="hstu", contextual_len=2)
    assert bool(out[:, 1].isfinite().all()) and bool(out[23:].isfinite().all())
    if name == "q":
        assert bool(out[[i for i in range(23) if i != 5], 0].isfinite().all())
        assert bool(grads["k"][6:, 0].isfinite().all()) and bool(grads["v"][6:, 0].isfinite().all())
        assert not bool(grads["k"][:6, 0].isfinite().all())
    else:
        assert bool(out[2:6, 0].isfinite().all()) and bool(grads["q"][2:6, 0].isfinite().all())
        assert not bool(out[6, 0].isfinite().all())


@cpu_kernel_only
@pytest.mark.skipif("cpu" not in gk.available_backends(), reason="the C++ extension is not built")
@pytest.mark.parametrize("path", ["avx2", "scalar", "avx512"], ids=lambda p: f"cpu-{p}")
def test_cpu_fast_exp_matches_exp(path):
    """The cpu kernel's exp (fast_exp8 on 8 AVX2 lanes, fast_exp on the rest; fast_exp16 on 16
    AVX-512 lanes, masked tail, where the CPU has them) against exp in float64 (the exact value, which
    std::exp rounds to within 0.5 ulp) over its whole range, a length that leaves a tail, and the edge
    values the kernel relies on."""
    from gem_kernels._backend import _C
    from gem_kernels._build_info import BUILD_INFO

    if BUILD_INFO.get("cpu_arch_flag") == "-march=x86-64-v3":
        assert _C.attention_avx2()  # the default x86 build must take the vector path
    if path == "avx512" and not _C.attention_avx512():
        pytest.skip("this CPU has no AVX-512: the kernel's rows never take the 16-lane exp")

    def fast_exp(t):
        return _C.attention_fast_exp16(t) if path == "avx512" else _C.attention_fast_exp(t, path == "avx2")

    x = torch.cat([torch.linspace(-87.0, 88.0, 200_003), torch.randn(997) * 4, torch.tensor([0.0, -0.0])])
    got = fast_exp(x).double()
    exact = torch.exp(x.double())
    rel = ((got - exact).abs() / exact).max().item()
    assert rel < 2 * 2.0**-23, rel  # 2 ulp; measured 7.2e-8 on both paths
    edges = torch.tensor([-math.inf, -1e30, -87.5, 88.5, 1e30, math.inf, math.nan, -math.nan, -87.0, 88.0,
                          0.0, 1.0, -1.0, 2.0, 3.0, -3.0])  # 16: each vector path sees every edge in its body
    got = fast_exp(edges)
    assert torch.equal(got[:6], torch.tensor([0.0, 0.0, 0.0, math.inf, math.inf, math.inf]))
    assert bool(got[6:8].isnan().all())
    torch.testing.assert_close(got[8:].double(), torch.exp(edges[8:].double()), rtol=2 * 2.0**-23, atol=0)


@pytest.mark.parametrize("device,backend", device_backend_params(BACKENDS))
def test_int32_offsets_and_targets_and_timestamps(device, backend):
    # Triton interpreter: shorter sequences (the same int32 loads)
    inputs = make_inputs([5, 0, 7] if interpreted(device, backend) else [9, 0, 17], device=device, time_heads=1)
    inputs["seq_offsets"] = inputs["seq_offsets"].int()
    inputs["num_targets"] = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    inputs["timestamps"] = inputs["timestamps"].int()
    _check_against_reference(inputs, backend, torch.float32)


@pytest.mark.parametrize("device,backend", device_backend_params(("cpu", "cuda")))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 40), min_size=0, max_size=5),
    extra_len=st.integers(0, 5),
    kind=st.sampled_from(["softmax", "hstu"]),
    causal=st.booleans(),
    contextual_len=st.integers(0, 6),
    max_attn_len=st.integers(0, 12),
    with_targets=st.booleans(),
    pos_heads=st.sampled_from([None, 1, 2]),
    time_heads=st.sampled_from([None, 1, 2]),
    D=st.integers(1, 20),
    Dv=st.integers(1, 20),
    seed=st.integers(0, 1000),
    deterministic=st.booleans(),
)
def test_fuzz_native_against_reference(device, backend, lengths, extra_len, kind, causal, contextual_len,
                                       max_attn_len, with_targets, pos_heads, time_heads, D, Dv, seed, deterministic):
    targets = [(L * (seed % 7)) // 7 for L in lengths] if with_targets else None
    inputs = make_inputs(lengths, D=D, Dv=Dv, M=max([1, *lengths]) + extra_len, targets=targets,
                         pos_heads=pos_heads, time_heads=time_heads, seed=seed, device=device)
    _check_against_reference(inputs, backend, torch.float32, kind=kind, causal=causal, contextual_len=contextual_len,
                             max_attn_len=max_attn_len, deterministic=deterministic)


@pytest.mark.parametrize("device,backend", device_backend_params(BACKENDS))
def test_time_buckets_over_a_wide_range(device, backend):
    """Many buckets and |dt| up to 1e14: the kernels' bucket search agrees with the fp64 formula."""
    g = torch.Generator().manual_seed(3)
    inputs = make_inputs([20, 31], device=device)
    num_buckets = 100  # e^(0.301 * 100) ~ 1.2e13: the clamp at num_buckets is reached too
    inputs["time_bias"] = torch.randn(2, num_buckets + 1, generator=g).to(device).requires_grad_(True)
    inputs["timestamps"] = (torch.rand(51, generator=g, dtype=torch.float64) ** 4 * 1e14).long().to(device)
    _check_against_reference(inputs, backend, torch.float32)


# ------------------------------------------------------------------------------------------------
# query_timestamps: generative-recommenders' next-item time bias
# ------------------------------------------------------------------------------------------------

def _gr_batch(lengths, max_seq_len, num_buckets, seed=0, H=2, D=4, Dv=3):
    """Jagged q, k, v and GR-style padded timestamps [B, N] (increasing, 0 past each end), N = max_seq_len."""
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(lengths)
    n_rows = int(sum(lengths))
    ts = torch.zeros(len(lengths), max_seq_len, dtype=torch.int64)
    for b, L in enumerate(lengths):
        gaps = torch.randint(1, 3000, (L,), generator=g) ** 2 // 100  # dt from 0 to ~9e4: buckets 0..37
        ts[b, :L] = 10**6 + torch.cumsum(gaps, 0)
    qkv = [torch.randn(n_rows, H, d, generator=g).requires_grad_(True) for d in (D, D, Dv)]
    pos_w = (0.5 * torch.randn(2 * max_seq_len - 1, generator=g)).requires_grad_(True)
    ts_w = (0.5 * torch.randn(num_buckets + 1, generator=g)).requires_grad_(True)
    return qkv, offsets, ts, pos_w, ts_w


@pytest.mark.parametrize("device,backend", WITH_REFERENCE)
@pytest.mark.parametrize("kind", ["hstu", "softmax"])
def test_query_timestamps_reproduce_gr_relative_bucketed_time_bias(device, backend, kind):
    """jagged_attention with query_timestamps = the next item's timestamp (GR's padded "next", see
    reference/gr_relative_bias.py) and GR's bias tables is GR's attention with its
    RelativeBucketedTimeAndPositionBasedBias: output and the gradients of q, k, v and both tables."""
    from gem_kernels.reference import gr_relative_bias as gr

    lengths, max_seq_len, num_buckets = [5, 0, 7, 1], 7, 20  # one full-length sequence: its last row repeats
    (q, k, v), offsets, ts, pos_w, ts_w = _gr_batch(lengths, max_seq_len, num_buckets)
    seq_ids, pos = ref._pad(q.detach(), offsets, max_seq_len)[1]
    next_ts = gr.next_timestamps(ts)
    # The two bucketings (GR's fp32 log, the kernels' fp64 one) agree on every pair of this data.
    dt = next_ts.unsqueeze(2) - ts.unsqueeze(1)
    assert torch.equal(gr.gr_bucketize(dt).clamp(0, num_buckets), ref.time_buckets(dt, num_buckets))

    bias = gr.relative_bucketed_time_and_position_bias(ts, pos_w, ts_w)
    padded = [ref._pad(x, offsets, max_seq_len)[0] for x in (q, k, v)]
    expected = gr.padded_attention_with_bias(*padded, bias, offsets.diff(), kind)[seq_ids, pos]

    def to_dev(x):
        return x.detach().to(device).requires_grad_(x.requires_grad)

    leaves_dev = [to_dev(x) for x in (q, k, v, pos_w, ts_w)]
    qd, kd, vd, pos_d, ts_d = leaves_dev
    common = dict(kind=kind, causal=True, scale=1.0, pos_bias=pos_d.unsqueeze(0), time_bias=ts_d.unsqueeze(0),
                  timestamps=ts[seq_ids, pos].to(device), backend=backend)
    out = gk.jagged_attention(qd, kd, vd, offsets.to(device), max_seq_len,
                              query_timestamps=next_ts[seq_ids, pos].to(device), **common)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    got = torch.autograd.grad(out, leaves_dev, grad_out.to(device))
    exp = torch.autograd.grad(expected, [q, k, v, pos_w, ts_w], grad_out)
    for name, a, b in zip(("q", "k", "v", "pos_w", "ts_w"), got, exp):
        torch.testing.assert_close(a.cpu(), b, atol=2e-5, rtol=2e-5, msg=name)
    # The default (query_timestamps = timestamps, bucket(t_i - t_j)) is another bias: the test can tell.
    plain = gk.jagged_attention(qd, kd, vd, offsets.to(device), max_seq_len, **common)
    assert (plain.detach().cpu() - expected.detach()).abs().max() > 1e-3


@pytest.mark.parametrize("device,backend", WITH_REFERENCE)
def test_query_timestamps_default_and_explicit_equal(device, backend):
    """query_timestamps=timestamps is the default, bit for bit, forward and backward (deterministic:
    the bias gradients' atomics may otherwise sum in another order, as the CUDA emulation shows)."""
    inputs = make_inputs([6, 0, 9], device=device, time_heads=2, pos_heads=1)
    out, grads = run(inputs, backend, deterministic=True)
    out2, grads2 = run(dict(inputs, query_timestamps=inputs["timestamps"].clone()), backend, deterministic=True)
    assert torch.equal(out, out2)
    for a, b in zip(grads, grads2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device,backend", device_backend_params(BACKENDS))
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
def test_query_timestamps_match_reference(device, backend, kind):
    """Arbitrary query_timestamps (not sorted, int32, per-head and shared tables) against the reference."""
    inputs = make_inputs([7, 0, 12, 1], device=device, time_heads=2, pos_heads=1, targets=[2, 0, 3, 0])
    g = torch.Generator().manual_seed(4)
    inputs["query_timestamps"] = (torch.randint(0, 40, (20,), generator=g) ** 2).int().to(device)
    _check_against_reference(inputs, backend, torch.float32, kind=kind, contextual_len=1)


def test_modules_pass_query_timestamps():
    """HSTULayer and JaggedMultiheadAttention forward query_timestamps to the op (other result than the default)."""
    g = torch.Generator().manual_seed(0)
    offsets = offsets_from_lengths([4, 6])
    x = torch.randn(10, 8, generator=g)
    ts = torch.randint(0, 10**5, (10,), generator=g).sort().values
    next_ts = torch.cat([ts[1:], ts[-1:]])
    for module in (gk.nn.HSTULayer(8, 2, 4, 4, max_seq_len=6, num_time_buckets=40),
                   gk.nn.JaggedMultiheadAttention(8, 2, max_seq_len=6, num_time_buckets=40)):
        with torch.no_grad():
            module.bias.time_bias.normal_(generator=g)
        y0 = module(x, offsets, 6, timestamps=ts)
        y1 = module(x, offsets, 6, timestamps=ts, query_timestamps=next_ts)
        assert not torch.allclose(y0, y1)
        torch.testing.assert_close(module(x, offsets, 6, timestamps=ts, query_timestamps=ts), y0)


# ------------------------------------------------------------------------------------------------
# NaN, Inf and extreme values (issue 19): the rule of jagged_attention's docstring, on every backend
# ------------------------------------------------------------------------------------------------

ALL_BACKENDS = WITH_REFERENCE


def _issue19_inputs(device, *, pos_heads=None, D=4, Dv=3, seed=0):
    """The issue's repro shape: seq_offsets [0, 3, 5], max_seq_len 4, H = 2, D = 4, Dv = 3."""
    g = torch.Generator().manual_seed(seed)
    inputs = dict(q=torch.randn(5, 2, D, generator=g), k=torch.randn(5, 2, D, generator=g),
                  v=torch.randn(5, 2, Dv, generator=g), seq_offsets=torch.tensor([0, 3, 5]), max_seq_len=4)
    if pos_heads:
        inputs["pos_bias"] = 0.5 * torch.randn(pos_heads, 7, generator=g)
    return {name: (x.to(device) if isinstance(x, torch.Tensor) else x) for name, x in inputs.items()}


def _forward_backward(inputs, backend, **options):
    """(out, grads of q, k, v[, pos_bias]) on the CPU, for grad_out = ones."""
    inputs = {n: (x.clone().requires_grad_(n in ("q", "k", "v", "pos_bias")) if isinstance(x, torch.Tensor) else x)
              for n, x in inputs.items()}
    out = gk.jagged_attention(**inputs, backend=backend, **options)
    names = [n for n in ("q", "k", "v", "pos_bias") if n in inputs]
    grads = torch.autograd.grad(out, [inputs[n] for n in names], torch.ones_like(out))
    return out.detach().cpu(), dict(zip(names, (g.cpu() for g in grads)))


def _agree_with_reference(inputs, backend, check_grads=True, **options):
    """The backend's output and gradients equal the reference's, NaN and Inf positions included."""
    out, grads = _forward_backward(inputs, backend, **options)
    ref_inputs = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in inputs.items()}
    out_ref, grads_ref = _forward_backward(ref_inputs, "reference", **options)
    torch.testing.assert_close(out, out_ref, equal_nan=True, atol=1e-5, rtol=1e-5)
    for name in grads if check_grads else ():
        torch.testing.assert_close(grads[name], grads_ref[name], equal_nan=True, atol=1e-5, rtol=1e-5, msg=name)
    return out, grads


def _only_nan_rows(out, rows_heads):
    """out[i, h] is all NaN exactly for (i, h) in rows_heads, and finite everywhere else."""
    expected = torch.zeros(out.shape[:2], dtype=torch.bool)
    for i, h in rows_heads:
        expected[i, h] = True
    assert torch.equal(out.isnan().all(-1), expected), out
    assert bool(out[~expected].isfinite().all()), out


NAN_CASES = {
    # name: (where the NaN goes, the (row, head) outputs it must reach: the rows that see it)
    "q[0,0,1]": (lambda x: x["q"].__setitem__((0, 0, 1), math.nan), [(0, 0)]),
    "k[0,0,0]": (lambda x: x["k"].__setitem__((0, 0, 0), math.nan), [(0, 0), (1, 0), (2, 0)]),
    # the last key of sequence 0: only row 2 sees it (the reference leaked it into rows 0 and 1)
    "k[2,0,0]": (lambda x: x["k"].__setitem__((2, 0, 0), math.nan), [(2, 0)]),
    # pos_bias head 0, relative position 0: every row of head 0 uses it
    "pos_bias[0,3]": (lambda x: x["pos_bias"].__setitem__((0, 3), math.nan), [(i, 0) for i in range(5)]),
    # relative position -3: no pair of these sequences (length <= 3) reaches it
    "pos_bias[1,0]": (lambda x: x["pos_bias"].__setitem__((1, 0), math.nan), []),
}


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
@pytest.mark.parametrize("case", list(NAN_CASES))
def test_nan_reaches_exactly_the_rows_that_see_it(device, backend, kind, case):
    """A NaN in q, k or a bias reaches every output whose visible scores contain it (the cpu softmax
    gave 0), and no other (the reference leaked masked keys and unused bias entries): forward, and
    gradients equal to the reference's, NaN positions included."""
    inputs = _issue19_inputs(device, pos_heads=2)
    poison, rows = NAN_CASES[case]
    poison(inputs)
    out, grads = _agree_with_reference(inputs, backend, kind=kind)
    _only_nan_rows(out, rows)
    if not rows:  # an entry no pair reads: every gradient finite, its own exactly 0
        assert all(bool(g.isfinite().all()) for g in grads.values())
        assert float(grads["pos_bias"][1, 0]) == 0.0
    else:
        assert bool(grads["q"].isnan().any()) and bool(grads["k"].isnan().any())


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
def test_nan_scale_reaches_every_output(device, backend, kind):
    out, _ = _agree_with_reference(_issue19_inputs(device), backend, kind=kind, scale=math.nan)
    assert int(out.isnan().sum()) == 30


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
def test_infinite_value_of_an_invisible_key_adds_nothing(device, backend, kind):
    """v[1,0,0] = inf: query 0 cannot see key 1 (causal), so out[0, 0] stays finite (0 * inf leaked
    NaN on every backend); rows 1 and 2 see it. The gradients of row 0 stay finite too."""
    inputs = _issue19_inputs(device)
    inputs["v"][1, 0, 0] = math.inf
    out, grads = _agree_with_reference(inputs, backend, kind=kind)
    assert bool(out[0].isfinite().all()) and bool(out[3:].isfinite().all())
    assert bool(out[1:3, 0, 0].isinf().all()) and bool(out[1:3, 1].isfinite().all())
    assert bool(grads["q"][0].isfinite().all())
    # An infinite q (into dk) and k (into dq) of invisible pairs: query 0 sees key 0 only, so keys 1, 2
    # of head 1 keep finite dk; key 4 is seen by row 4 only, so row 3 keeps a finite dq.
    inputs = _issue19_inputs(device)
    inputs["q"][0, 1, 0] = -math.inf
    inputs["k"][4, 1, 0] = math.inf
    _, grads = _agree_with_reference(inputs, backend, kind=kind)
    assert bool(grads["k"][1:3, 1].isfinite().all()) and bool(grads["q"][3, 1].isfinite().all())


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
def test_infinite_grad_out_of_a_row_reaches_only_the_keys_it_sees(device, backend, kind):
    """grad_out[0, 1, 0] = inf: row 0 of head 1 sees key 0 only (causal), so dv of keys 1 and 2 of head
    1 stays finite (P^T dO over the whole mixed tile would add 0 * inf = NaN there) and key 0's does
    not. The cpu kernel takes the masked product from its Inf/NaN flags of the dO rows (for softmax
    made in the delta's sweep over dO)."""
    inputs = _issue19_inputs(device)
    leaves = [inputs[n].clone().requires_grad_(True) for n in ("q", "k", "v")]
    out = gk.jagged_attention(leaves[0], leaves[1], leaves[2], inputs["seq_offsets"], inputs["max_seq_len"],
                              kind=kind, backend=backend)
    grad_out = torch.ones_like(out)
    grad_out[0, 1, 0] = math.inf
    dv = torch.autograd.grad(out, leaves, grad_out)[2].cpu()
    assert bool(dv[1:, 1].isfinite().all()) and bool(dv[:, 0].isfinite().all()), dv
    assert not bool(dv[0, 1].isfinite().all()), dv


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
def test_huge_scale_beats_masked_entries(device, backend):
    """scale=1e30 with scores of -2e30: every visible key still wins over the invisible ones (the
    reference's -1e30 fill gave [0, 0, 2])."""
    inputs = dict(q=torch.ones(3, 1, 2, device=device), k=-torch.ones(3, 1, 2, device=device),
                  v=torch.tensor([[[1.0]], [[2.0]], [[3.0]]], device=device),
                  seq_offsets=torch.tensor([0, 3], device=device), max_seq_len=3)
    # NOTE: forward only. The kernels' backward recomputes p = exp(s - lse) from the fp32 lse, which at
    # |s| ~ 2e30 has lost log(sum) (FlashAttention's kernels share this); the reference recomputes softmax.
    out, _ = _agree_with_reference(inputs, backend, check_grads=False, kind="softmax", scale=1e30)
    torch.testing.assert_close(out.view(-1), torch.tensor([1.0, 1.5, 2.0]))


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
def test_scale_beyond_fp32_agrees_across_backends(device, backend, kind):
    """scale=1e300 in fp32 rounds to inf: scores of +-inf (NaN where <q, k> = 0, forced on one pair);
    every backend gives the reference's result, NaN and Inf positions included."""
    inputs = _issue19_inputs(device, pos_heads=1)
    inputs["k"][3, 1] = 0.0  # <q_i, k_3> = 0: inf * 0 = NaN for the rows that see key 3
    _agree_with_reference(inputs, backend, kind=kind, scale=1e300)


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
def test_hstu_scores_below_minus_88(device, backend):
    """HSTU silu(s) for s < -88, where exp(-s) overflows fp32: ~0 (the cpu kernel's fast exp wrapped
    around past 88 and gave silu(s) ~ s)."""
    inputs = _issue19_inputs(device)
    out, _ = _agree_with_reference(inputs, backend, kind="hstu", scale=200.0)
    assert bool(out.isfinite().all())


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
def test_all_minus_inf_row_outputs_zero(device, backend):
    """A softmax row whose visible scores are all -inf outputs 0 with lse -inf (the convention every
    backend shares); rows with some finite score are unaffected."""
    inputs = _issue19_inputs(device, pos_heads=1)
    inputs["pos_bias"][0, 3] = -math.inf  # the diagonal: row 0 sees only itself
    out, _ = _agree_with_reference(inputs, backend, kind="softmax")
    assert torch.equal(out[0], torch.zeros(2, 3)) and bool(out.isfinite().all())


@pytest.mark.parametrize("max_seq_len", [10**9, 2**62])
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
def test_reference_pads_to_the_longest_sequence(max_seq_len, kind):
    """A huge max_seq_len costs the reference nothing: it pads to the longest sequence (it tried to
    allocate 64 GB at 10**9 and overflowed a storage size at 2**62). Same result as the cpu kernel."""
    inputs = make_inputs([3, 0, 5], time_heads=1, M=max_seq_len)
    out, grads = run(inputs, "reference", kind=kind)
    small, small_grads = run(dict(inputs, max_seq_len=5), "reference", kind=kind)
    factor = 5 / max_seq_len if kind == "hstu" else 1.0  # HSTU divides by max_seq_len
    torch.testing.assert_close(out, small * factor)
    for got, exp in zip(grads, small_grads):
        torch.testing.assert_close(got, exp * factor)
    if "cpu" in gk.available_backends():
        cpu_out, cpu_grads = run(inputs, "cpu", kind=kind)
        torch.testing.assert_close(cpu_out, out)
        for got, exp in zip(cpu_grads, grads):
            torch.testing.assert_close(got, exp)


# Short cases for the Triton interpreter: every option, multi-tile (L = 70 > BLOCK 64) and edge sizes.
TRITON_CASES = [
    ([5, 0, 70, 1], {}, {}),
    ([5, 0, 70, 1], {}, dict(causal=False, scale=0.7)),
    ([9, 70, 3, 0], dict(targets=[2, 40, 3, 0], pos_heads=2, time_heads=1), dict(contextual_len=4, max_attn_len=30)),
    ([9, 70, 3, 0, 1], dict(targets=[3, 20, 1, 0, 1], pos_heads=1, time_heads=2, M=80),
     dict(contextual_len=2, max_attn_len=9, causal=False)),
    ([1], {}, {}),
    ([0, 0], {}, {}),
    ([], {}, {}),
]


@pytest.mark.triton
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
@pytest.mark.parametrize("lengths,input_options,options", TRITON_CASES)
def test_triton_interpreter_matches_reference(kind, lengths, input_options, options):
    if "triton" not in gk.available_backends() or torch.cuda.is_available():
        pytest.skip("runs the Triton interpreter on machines without a GPU (the GPU runs the full sweep)")
    inputs = make_inputs(lengths, **input_options)
    _check_against_reference(inputs, "triton", torch.float32, kind=kind, **options)


@pytest.mark.triton
@pytest.mark.parametrize("block,kind", [(16, "softmax"), (16, "hstu"), (32, "softmax")])
def test_triton_interpreter_tile_sizes(monkeypatch, block, kind):
    """The interpreter runs 64 x 64 tiles for every dtype; a GPU runs fp32 on 16 x 16 (_launch_config).
    Those tiles here: multi-tile sequences (L = 40), every option, both bias-gradient paths (the
    deterministic scratch is laid out in tiles), max_seq_len past the longest sequence."""
    if "triton" not in gk.available_backends() or torch.cuda.is_available():
        pytest.skip("runs the Triton interpreter on machines without a GPU (the GPU runs fp32 on these tiles)")
    from gem_kernels.triton import attention as triton_attention

    monkeypatch.setattr(triton_attention, "_launch_config", lambda dtype, block_d, block_dv: (block, 4))
    inputs = make_inputs([9, 40, 3, 0, 1], targets=[3, 10, 1, 0, 1], pos_heads=2, time_heads=1, M=50)
    for deterministic in (False, True):
        _check_against_reference(inputs, "triton", torch.float32, kind=kind, contextual_len=2, max_attn_len=20,
                                 deterministic=deterministic)
    first, second = (run(inputs, "triton", kind=kind, contextual_len=2, deterministic=True) for _ in range(2))
    for a, b in zip([first[0], *first[1]], [second[0], *second[1]]):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the argument (validation runs before any backend)
# ------------------------------------------------------------------------------------------------

def _bad(**changes):
    base = dict(q=torch.ones(5, 2, 4), k=torch.ones(5, 2, 4), v=torch.ones(5, 2, 3),
                seq_offsets=torch.tensor([0, 2, 5]), max_seq_len=4)
    base.update(changes)
    return base


BAD = [
    (_bad(q=torch.ones(5, 2)), "q must have 3 dims"),
    (_bad(k=torch.ones(5, 2, 4, dtype=torch.float16)), "k must have q's dtype"),
    (_bad(v=torch.ones(5, 2, 3, dtype=torch.float64)), "v must have dtype"),
    (_bad(k=torch.ones(5, 2, 5)), "k must have q's shape"),
    (_bad(v=torch.ones(5, 3, 3)), "v must have shape"),
    (_bad(seq_offsets=torch.tensor([0, 3, 2, 5])), r"seq_offsets must be nondecreasing, but seq_offsets\[2\] = 2 < "
                                                   r"seq_offsets\[1\] = 3"),
    (_bad(seq_offsets=torch.tensor([1, 2, 5])), r"seq_offsets\[0\] must be 0, got 1"),
    (_bad(seq_offsets=torch.tensor([0, 2, 5], dtype=torch.int32), max_seq_len=2), "got 2 < 3"),
    (_bad(seq_offsets=torch.tensor([0, 2, 4])), r"seq_offsets\[-1\] must equal the number of rows 5"),
    (_bad(seq_offsets=torch.tensor([0.0, 5.0])), "seq_offsets must have dtype"),
    (_bad(max_seq_len=2), "max_seq_len must be >= every sequence length, got 2 < 3"),
    (_bad(max_seq_len=-1), "max_seq_len must be >= 0"),
    (_bad(kind="relu"), "kind must be one of"),
    (_bad(causal=1), "causal must be a bool"),
    (_bad(scale="x"), "scale must be a float"),
    (_bad(num_targets=torch.tensor([1])), "num_targets must have B = 2 elements"),
    (_bad(num_targets=torch.tensor([1, 4])), r"num_targets\[1\] must be in \[0, 3\]"),
    (_bad(num_targets=torch.tensor([-1, 0], dtype=torch.int32)), r"num_targets\[0\] must be in \[0, 2\] \(its sequence "
                                                                 r"length\), got -1"),
    # Several faults at once: every backend names the first in one order (offsets, lengths, targets).
    (_bad(seq_offsets=torch.tensor([0, 4, 5]), max_seq_len=3, num_targets=torch.tensor([0, 9])),
     "max_seq_len must be >= every sequence length, got 3 < 4"),
    (_bad(num_targets=torch.tensor([1.0, 2.0])), "num_targets must have dtype"),
    (_bad(contextual_len=-1), "contextual_len must be >= 0"),
    (_bad(max_attn_len=1.5), "max_attn_len must be an int"),
    (_bad(pos_bias=torch.ones(2, 6)), r"pos_bias.shape\[1\] must be 2 \* max_seq_len - 1 = 7"),
    (_bad(pos_bias=torch.ones(3, 7)), r"pos_bias.shape\[0\] must be 1 or H = 2"),
    (_bad(time_bias=torch.ones(1, 4)), "timestamps must be given with time_bias"),
    (_bad(time_bias=torch.ones(1, 4), timestamps=torch.ones(4, dtype=torch.long)), "timestamps must have N = 5"),
    (_bad(time_bias=torch.ones(1, 4), timestamps=torch.ones(5)), "timestamps must have dtype"),
    (_bad(deterministic="yes"), "deterministic must be a bool"),
    (_bad(query_timestamps=torch.ones(5, dtype=torch.long)), "query_timestamps is only used by the time bias"),
    (_bad(time_bias=torch.ones(1, 4), timestamps=torch.ones(5, dtype=torch.long),
          query_timestamps=torch.ones(4, dtype=torch.long)), "query_timestamps must have N = 5"),
    (_bad(time_bias=torch.ones(1, 4), timestamps=torch.ones(5, dtype=torch.long), query_timestamps=torch.ones(5)),
     "query_timestamps must have dtype"),
    (_bad(time_bias=torch.ones(1, 4), timestamps=torch.ones(5, dtype=torch.long),
          query_timestamps=torch.ones(5, 1, dtype=torch.long)), "query_timestamps must have 1 dim"),
]


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("kwargs,match", BAD)
def test_rejects_bad_input(backend, kwargs, match):
    if backend not in gk.available_backends():
        pytest.skip(f"{backend} backend unavailable here")
    with pytest.raises(ValueError, match=match):
        gk.jagged_attention(**kwargs, backend=backend)


# The data checks' two paths (ops/attention.py _check_values): the native summary of CPU offsets and
# the ATen one (CUDA tensors, or no extension): same verdict and message on every case.
_SUMMARY_CASES = [
    # (seq_offsets, N, max_seq_len, num_targets, delta)
    ([0, 3, 3, 7], 7, 4, [1, 0, 4], 0),       # valid, one empty sequence, a target covering its sequence
    ([0, 3, 3, 7], 7, 4, None, 0),
    ([0], 0, 0, [], 0),                        # no sequence
    ([0], 0, 0, None, 2),                      # no sequence: no delta to hold
    ([1, 3, 7], 7, 4, None, 0),                # offsets[0] != 0
    ([0, 5, 3, 7], 7, 5, None, 0),             # decreasing
    ([0, 3, 6], 7, 4, None, 0),                # offsets[-1] != N
    ([0, 3, 7], 7, 3, None, 0),                # a sequence longer than max_seq_len
    ([0, 3, 3, 7], 7, 4, [1, 0, 5], 0),        # num_targets beyond its sequence's length
    ([0, 3, 3, 7], 7, 4, [1, -1, 0], 0),       # negative num_targets
    ([0, 2, 2, 6], 6, 4, None, 1),             # the cached op's delta: sequence 1 holds none
    ([0, 2, 4, 8], 8, 4, [2, 0, 3], 2),        # valid with delta
]


@pytest.mark.skipif(attention_ops._summary_native is None, reason="the extension has no jagged_offsets_summary")
@pytest.mark.parametrize("offsets_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("case", _SUMMARY_CASES)
def test_value_checks_native_summary_matches_aten(monkeypatch, case, offsets_dtype):
    offsets, n, max_seq_len, targets, delta = case
    seq_offsets = torch.tensor(offsets, dtype=offsets_dtype)
    num_targets = None if targets is None else torch.tensor(targets, dtype=offsets_dtype)
    q = torch.zeros(n, 1, 2)

    def verdict():
        try:
            attention_ops._check_values(q, seq_offsets, max_seq_len, num_targets, delta=delta)
        except ValueError as exc:
            return str(exc)
        return None

    native = verdict()
    monkeypatch.setattr(attention_ops, "_summary_native", None)
    aten = verdict()
    assert native == aten
    # The cases are built to exercise each branch: only the marked valid ones pass.
    assert (native is None) == (case in (_SUMMARY_CASES[0], _SUMMARY_CASES[1], _SUMMARY_CASES[2], _SUMMARY_CASES[3],
                                         _SUMMARY_CASES[-1])), native


def test_device_mismatch_is_value_error():
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        gk.jagged_attention(torch.ones(3, 1, 2), torch.ones(3, 1, 2, device="meta"), torch.ones(3, 1, 2),
                            torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="query_timestamps is on meta but q is on cpu"):
        gk.jagged_attention(torch.ones(3, 1, 2), torch.ones(3, 1, 2), torch.ones(3, 1, 2), torch.tensor([0, 3]), 3,
                            time_bias=torch.ones(1, 3), timestamps=torch.ones(3, dtype=torch.long),
                            query_timestamps=torch.ones(3, dtype=torch.long, device="meta"))


def test_unavailable_backend_is_reported():
    if "cuda" in gk.available_backends():
        pytest.skip("the cuda backend runs here")
    with pytest.raises(gk.BackendUnavailableError):
        gk.jagged_attention(torch.ones(3, 1, 2), torch.ones(3, 1, 2), torch.ones(3, 1, 2), torch.tensor([0, 3]), 3,
                            backend="cuda")


# ------------------------------------------------------------------------------------------------
# torch.library registration: opcheck and torch.compile
# ------------------------------------------------------------------------------------------------

def _op_args(kind, with_bias, device="cpu"):
    inputs = make_inputs([3, 0, 5, 1], H=2, D=4, Dv=3, pos_heads=2 if with_bias else None,
                         time_heads=1 if with_bias else None, targets=[1, 0, 2, 0], device=device)
    # With the time bias, query_timestamps differ from timestamps (the reversed rows).
    query_timestamps = inputs["timestamps"].flip(0) if with_bias else None
    return (inputs["q"], inputs["k"], inputs["v"], inputs["seq_offsets"], 5, kind, True, 0.5,
            inputs["num_targets"], 1, 3, inputs.get("pos_bias"), inputs.get("time_bias"), inputs.get("timestamps"),
            query_timestamps)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("kind", ["softmax", "hstu"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck(backend, kind, with_bias):
    args = _op_args(kind, with_bias)
    torch.library.opcheck(jagged_attention_fwd_op, (*args, False, backend))
    out, lse = jagged_attention_fwd_op(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args), False,
                                       backend)
    plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(jagged_attention_bwd_op, (torch.randn_like(out), *plain[:3], out, lse, *plain[3:], True,
                                                    backend))


@pytest.mark.parametrize("device,backend", device_backend_params(("cpu", "cuda")))
@pytest.mark.parametrize("deterministic", [False, True])
def test_opcheck_native_ops(device, backend, deterministic):
    plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in _op_args("softmax", True, device)]
    torch.library.opcheck(torch.ops.gem_kernels.jagged_attention_fwd_native.default, tuple(plain))
    out, lse = torch.ops.gem_kernels.jagged_attention_fwd_native(*plain)
    torch.library.opcheck(torch.ops.gem_kernels.jagged_attention_bwd_native.default,
                          (torch.randn_like(out), *plain[:3], out, lse, *plain[3:], deterministic))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    inputs = make_inputs([4, 0, 9], pos_heads=2, time_heads=1, targets=[1, 0, 2])

    def fn(q, k, v, pos_bias, time_bias):
        out = gk.jagged_attention(q, k, v, inputs["seq_offsets"], inputs["max_seq_len"], kind="hstu",
                                  num_targets=inputs["num_targets"], contextual_len=1, pos_bias=pos_bias,
                                  time_bias=time_bias, timestamps=inputs["timestamps"], backend=backend)
        return (out * 2.0).sum()

    args = [inputs[n] for n in ("q", "k", "v", "pos_bias", "time_bias")]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = compiled(*args)
    expected = fn(*args)
    torch.testing.assert_close(got, expected)
    for g, e in zip(torch.autograd.grad(got, args), torch.autograd.grad(expected, args)):
        torch.testing.assert_close(g, e)

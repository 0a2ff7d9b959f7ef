"""Bench of the interaction family: DLRM dot interaction, DCNv2 cross layer, Wukong fm_compress,
feature_mix_norm (the Wukong layer's LCB + residual + LayerNorm) and a whole WukongLayer, forward
and forward+backward.

Impls: every gem_kernels backend for the device (cpu on the CPU; cuda and triton on a GPU), the
eager baseline ("eager": TorchRec-style bmm + triu gather, nn.functional.linear cross layer, eager
Wukong FM + LayerNorm, differentiated by autograd; the speedup baseline) and "compile",
torch.compile of that eager function (default inductor mode). Every impl's output and gradients are
held to FlashAttention's rule against the eager function run in float64 (bench/harness.py: at most
twice eager's own error) before it is timed.

Workload (issue 5), scaled to fit the bench budget on a small CPU: B = 4096 (1024 for F = 128),
F = 27 and 128 embeddings, D = 64 and 128, fp32; on a GPU B = 16384 in bf16 and fp32. Cross layer:
N = 512 full rank and N = 1024 at rank 64. WukongLayer: 27 -> 16 FM + 16 LCB embeddings of dim 64
(a residual projection), fm_rank 8, MLP hidden 256. On the CPU also the GEM model's `small` Wukong
layers (issue 26): B = 1152 rows (its interaction arch runs per (user, candidate): 256 users x 4.5
candidates on average), 10 and 16 features of dim 32, fm_rank 8, 8 FM + 8 LCB outputs.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterator

import torch

import gem_kernels as gk
from gem_kernels import flops
from gem_kernels.ops.interaction import IMPLEMENTED
from gem_kernels.reference import interaction as eager_ref

from .harness import Case, rotate

# The family's cap (bench/__main__.py: never more than an even share of what is left of the run): its
# cases, with the cross layer's interleaved GEMM roofs, take ~150 s on the 2-core dev CPU, and the
# default cap of 110 s left the small model's Wukong cases (the last ones) out of a 5-family run.
FAMILY_BUDGET = {False: 170.0, True: 9.0}

SEED = 0


def _backends(device: torch.device) -> list[str]:
    # On the CPU only the cpu backend: the Triton interpreter is a correctness tool, far too slow.
    wanted = ("cuda", "triton") if device.type == "cuda" else ("cpu",)
    available = gk.available_backends()
    return [b for b in wanted if b in available and b in IMPLEMENTED]


def _fwd_bwd(forward: Callable, inputs: tuple, grad_out: torch.Tensor, params: tuple = ()):
    """One forward + backward: (output, grads of every input and parameter)."""
    out = forward(*inputs)
    grads = torch.autograd.grad(out, [*inputs, *params], grad_out)
    return out.detach(), grads


def _impls(device: torch.device, fused: Callable[..., Callable], eager: Callable, quick: bool) -> dict[str, Callable]:
    """name -> fn(*inputs): `fused(backend)` gives the gem_kernels function of a backend. --quick
    leaves out "compile": compiling each case takes longer than the quick budget."""
    impls = {backend: fused(backend) for backend in _backends(device)}
    impls["eager"] = eager
    if not quick:
        impls["compile"] = torch.compile(eager)
    return impls


def _fp64(t: torch.Tensor) -> torch.Tensor:
    """A float64 leaf copy of ``t`` (requiring grad where ``t`` does)."""
    return t.detach().double().requires_grad_(t.requires_grad)


def _cases_of(op: str, shape: str, dtype: torch.dtype, fwd: tuple[int, int], fwd_bwd: tuple[int, int],
              device: torch.device, quick: bool, fused: Callable[..., Callable], eager_of: Callable[..., Callable],
              input_sets: list[tuple], grad_sets: list[torch.Tensor], params: tuple = (),
              gemms: tuple[Callable, Callable] | None = None) -> Iterator[Case]:
    """The forward and the forward+backward case of an op. ``eager_of(*params)`` gives the eager
    function of the inputs with those parameters: the eager impl (the case's parameters) and its
    float64 run (float64 copies of the parameters and of the first input set, which the
    verification call uses). ``gemms``: (forward, forward+backward) functions of (inputs, grad) that
    run the op's matrix products alone (Case.gemm_roof, CPU only), on the same rotating sets."""
    impls = _impls(device, fused, eager_of(*params), quick)
    inputs64 = [_fp64(t) for t in input_sets[0]]
    params64 = [_fp64(p) for p in params]
    eager64 = eager_of(*params64)
    compiled = [n for n in impls if n == "compile"]
    sets = [(inputs, grad) for inputs, grad in zip(input_sets, grad_sets)]
    roofs = [None, None]
    if gemms is not None and device.type == "cpu":
        detached = [(tuple(t.detach() for t in inputs), grad) for inputs, grad in sets]
        roofs = [rotate(detached, lambda inputs, grad, f=f: _no_grad_call(f, inputs, grad)) for f in gemms]
    yield Case(op=op, shape=shape, dtype=dtype, flops=fwd[0], bytes=fwd[1],
               impls={name: rotate(input_sets, fn) for name, fn in impls.items()}, baseline="eager", peak="matmul",
               reference="eager", fp64=lambda: eager64(*inputs64).detach(), compiled=compiled, gemm_roof=roofs[0])
    yield Case(op=f"{op} fwd+bwd", shape=shape, dtype=dtype, flops=fwd_bwd[0], bytes=fwd_bwd[1],
               impls={name: rotate(sets, lambda inputs, grad, fn=fn: _fwd_bwd(fn, inputs, grad, params))
                      for name, fn in impls.items()},
               baseline="eager", peak="matmul", reference="eager",
               fp64=lambda: _fwd_bwd(eager64, inputs64, grad_sets[0].double(), params64), compiled=compiled,
               gemm_roof=roofs[1])


def _no_grad_call(fn: Callable, inputs: tuple, grad: torch.Tensor):
    with torch.no_grad():
        return fn(inputs, grad)


def _eager_wukong(layer: gk.nn.WukongLayer) -> Callable:
    """The same layer (same parameters) with the eager FM: what a user writes without fm_compress."""

    def forward(x):
        fm = eager_ref.eager_fm_compress(x, layer.fm_y, layer.fm_norm.weight, layer.fm_norm.bias, layer.fm_norm.eps)
        fmb = layer.fm_mlp(fm).view(x.shape[0], layer.num_fm_out, layer.dim)
        lcb = torch.matmul(layer.lcb_weight, x)
        residual = x if layer.residual_weight is None else torch.matmul(layer.residual_weight, x)
        return layer.norm(torch.cat([fmb, lcb], 1) + residual)

    return forward


def cases(quick: bool, device: torch.device) -> Iterator[Case]:
    gen = torch.Generator(device=device).manual_seed(SEED)
    num_sets = 2

    def randn(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    if device.type == "cuda":
        dtypes, batch, big_batch = (torch.bfloat16, torch.float32), 16384, 16384
    else:
        dtypes, batch, big_batch = (torch.float32,), 4096, 1024
    if quick:
        batch = big_batch = 128

    def dot(B, F, D, dtype, elem):
        x_sets = [(randn(B, F, D, dtype=dtype).requires_grad_(True),) for _ in range(num_sets)]
        grads = [randn(B, F * (F - 1) // 2, dtype=dtype) for _ in range(num_sets)]
        yield from _cases_of("dot_interaction", f"B={B} F={F} D={D}", dtype,
                             flops.dot_interaction(B, F, D, False, elem),
                             flops.dot_interaction(B, F, D, False, elem, backward=True), device, quick,
                             lambda b: (lambda x: gk.dot_interaction(x, backend=b)),
                             lambda: eager_ref.eager_dot_interaction, x_sets, grads)

    def cross(B, N, rank, dtype, elem):
        bias = randn(N, dtype=dtype, scale=0.1).requires_grad_(True)
        if rank is None:
            weight = randn(N, N, dtype=dtype, scale=N ** -0.5).requires_grad_(True)
            params = (weight, bias)

            def eager_of(w, b):
                return lambda x0, xl: eager_ref.eager_cross_layer(x0, xl, w, b)
        else:
            weight = (randn(N, rank, dtype=dtype, scale=rank ** -0.5).requires_grad_(True),
                      randn(rank, N, dtype=dtype, scale=N ** -0.5).requires_grad_(True))
            params = (*weight, bias)

            def eager_of(u, v, b):
                return lambda x0, xl: eager_ref.eager_cross_layer(x0, xl, (u, v), b)
        sets = [(randn(B, N, dtype=dtype).requires_grad_(True), randn(B, N, dtype=dtype).requires_grad_(True))
                for _ in range(num_sets)]
        grads = [randn(B, N, dtype=dtype) for _ in range(num_sets)]
        shape = f"B={B} N={N}" + (f" rank={rank}" if rank else "")
        # The GEMM roof: the layer's matrix products alone at its shapes (grad standing in for
        # dz = grad * x0). Full rank z = xl W^T; backward dxl += dz W, dW = dz^T xl. Low rank
        # t = xl v^T, z = t u^T; backward dt = dz u, du = dz^T t, dv = dt^T xl, dxl += dt v.
        if rank is None:
            w = weight.detach()

            def gemms_fwd(inputs, grad):
                return torch.mm(inputs[1], w.t())

            def gemms_fwd_bwd(inputs, grad):
                xl = inputs[1]
                return torch.mm(xl, w.t()), torch.mm(grad, w), torch.mm(grad.t(), xl)
        else:
            u, v = (t.detach() for t in weight)

            def gemms_fwd(inputs, grad):
                return torch.mm(torch.mm(inputs[1], v.t()), u.t())

            def gemms_fwd_bwd(inputs, grad):
                xl = inputs[1]
                t = torch.mm(xl, v.t())
                z = torch.mm(t, u.t())
                dt = torch.mm(grad, u)
                return z, torch.mm(grad.t(), t), torch.mm(dt.t(), xl), torch.mm(dt, v)
        yield from _cases_of("cross_layer", shape, dtype, flops.cross_layer(B, N, rank, elem),
                             flops.cross_layer(B, N, rank, elem, backward=True), device, quick,
                             lambda b: (lambda x0, xl: gk.cross_layer(x0, xl, weight, bias, backend=b)),
                             eager_of, sets, grads, params, gemms=(gemms_fwd, gemms_fwd_bwd))

    def fm(B, F, D, k, dtype, elem):
        y = randn(F, k, dtype=dtype, scale=F ** -0.5).requires_grad_(True)
        ln_w = (1 + randn(F * k, dtype=dtype, scale=0.1)).requires_grad_(True)
        ln_b = randn(F * k, dtype=dtype, scale=0.1).requires_grad_(True)
        x_sets = [(randn(B, F, D, dtype=dtype).requires_grad_(True),) for _ in range(num_sets)]
        grads = [randn(B, F * k, dtype=dtype) for _ in range(num_sets)]
        yield from _cases_of("fm_compress", f"B={B} F={F} D={D} k={k}", dtype,
                             flops.fm_compress(B, F, D, k, elem), flops.fm_compress(B, F, D, k, elem, backward=True),
                             device, quick, lambda b: (lambda x: gk.fm_compress(x, y, ln_w, ln_b, backend=b)),
                             lambda *ps: (lambda x: eager_ref.eager_fm_compress(x, *ps)), x_sets, grads,
                             (y, ln_w, ln_b))

    def mix(B, F, D, O, Ofm, dtype, elem):
        """The Wukong layer's output op alone: eager is a broadcast matmul, a pad, an add and a LayerNorm."""
        weight = randn(O, F, dtype=dtype, scale=F ** -0.5).requires_grad_(True)
        ln_w = (1 + randn(D, dtype=dtype, scale=0.1)).requires_grad_(True)
        ln_b = randn(D, dtype=dtype, scale=0.1).requires_grad_(True)
        sets = [(randn(B, F, D, dtype=dtype).requires_grad_(True), randn(B, Ofm, D, dtype=dtype).requires_grad_(True))
                for _ in range(num_sets)]
        grads = [randn(B, O, D, dtype=dtype) for _ in range(num_sets)]
        yield from _cases_of("feature_mix_norm", f"B={B} F={F} D={D} O={O} O_fm={Ofm}", dtype,
                             flops.feature_mix_norm(B, F, O, Ofm, D, elem),
                             flops.feature_mix_norm(B, F, O, Ofm, D, elem, backward=True), device, quick,
                             lambda b: (lambda x, fm: gk.feature_mix_norm(x, weight, fm, ln_w, ln_b, backend=b)),
                             lambda w, lw, lb: (lambda x, fm: eager_ref.eager_feature_mix_norm(x, w, fm, lw, lb)),
                             sets, grads, (weight, ln_w, ln_b))

    def wukong(B, num_in, fm_out, lcb_out, dim, rank, hidden, dtype, elem):
        """A whole Wukong layer, forward + backward (the unit a model trains)."""
        layer = gk.nn.WukongLayer(num_in, fm_out, lcb_out, dim, rank, hidden, device=device, dtype=dtype)
        params = tuple(layer.parameters())
        x_sets = [(randn(B, num_in, dim, dtype=dtype).requires_grad_(True),) for _ in range(num_sets)]
        grads = [randn(B, fm_out + lcb_out, dim, dtype=dtype) for _ in range(num_sets)]

        def fused(backend):
            def forward(x):
                layer.backend = backend
                return layer(x)
            return forward

        impls = _impls(device, fused, _eager_wukong(layer), quick)
        sets = [(inputs, grad) for inputs, grad in zip(x_sets, grads)]
        work = flops.wukong_layer(B, num_in, fm_out, lcb_out, dim, rank, hidden, elem, backward=True)
        layer64 = copy.deepcopy(layer).double()
        inputs64 = [_fp64(t) for t in x_sets[0]]
        yield Case(op="WukongLayer fwd+bwd",
                   shape=f"B={B} in={num_in} fm={fm_out} lcb={lcb_out} D={dim} rank={rank} mlp={hidden}",
                   dtype=dtype, flops=work[0], bytes=work[1],
                   impls={name: rotate(sets, lambda inputs, grad, fn=fn: _fwd_bwd(fn, inputs, grad, params))
                          for name, fn in impls.items()},
                   baseline="eager", peak="matmul", reference="eager",
                   fp64=lambda: _fwd_bwd(_eager_wukong(layer64), inputs64, grads[0].double(),
                                         tuple(layer64.parameters())),
                   compiled=[n for n in impls if n == "compile"])

    # Each op's headline shape first, then the larger ones, so a tight budget still covers every op.
    if quick:
        plan = [(dot, (batch, 27, 64)), (cross, (batch, 64, None)), (fm, (batch, 27, 64, 8)),
                (mix, (batch, 27, 32, 16, 8)), (wukong, (batch, 27, 8, 8, 32, 4, [64])), (cross, (batch, 128, 16))]
    else:
        plan = [(dot, (batch, 27, 64)), (cross, (batch, 512, None)), (fm, (batch, 27, 64, 16)),
                (mix, (batch, 27, 64, 32, 16)), (wukong, (batch, 27, 16, 16, 64, 8, [256])), (cross, (batch, 1024, 64)),
                (dot, (big_batch, 128, 64)), (fm, (big_batch, 128, 64, 16)), (dot, (batch, 27, 128))]
        if device.type == "cpu":
            # The GEM model's `small` config (model/config.py), whose training step these ops limit: one
            # row per (user, candidate), 256 users x 4.5 candidates on average (K uniform in 1..8) = 1152
            # rows; 8 tables + 2 tokens = 10 features of dim 32, then 8 FM + 8 LCB = 16; fm_rank 8.
            rows = 1152
            plan += [(fm, (rows, 10, 32, 8)), (fm, (rows, 16, 32, 8)), (mix, (rows, 10, 32, 16, 8)),
                     (mix, (rows, 16, 32, 16, 8)), (wukong, (rows, 10, 8, 8, 32, 8, [128]))]
    for dtype in dtypes:
        elem = torch.empty((), dtype=dtype).element_size()
        for make, shape in plan:
            yield from make(*shape, dtype, elem)

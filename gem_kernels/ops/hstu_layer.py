"""The fused jagged HSTU layer (generative-recommenders' ``STULayer``): the front door.

Three registered ops run one layer on jagged rows x [N, D], with no padded intermediate:
``hstu_uvqk`` (LayerNorm prologue -> one UVQK GEMM -> bias, SiLU epilogue), the HSTU attention
(``gem_kernels::jagged_attention_fwd``), and ``hstu_output`` (Norm(attn) * silu(u) gating and the
concat as the output GEMM's prologue, the residual as its accumulator). Each has a fake kernel and
an autograd formula whose backward is a registered op too, so ``torch.compile(fullgraph=True)``
sees the whole layer. The maths: ``gem_kernels.reference.hstu_layer``; what the backward
recomputes instead of storing: csrc/cpu/hstu_layer.cpp's header.
"""

from __future__ import annotations

import torch
from torch._C import _any_requires_grad as any_requires_grad

from .._autograd import eager_plain, fast_paths_on, register_autograd
from .._autocast import autocast_operands, run_kernels_without_autocast
from .._backend import kernel, resolve_backend
from .._validate import check_float64_on_reference, check_same_device, check_tensor, float_dtypes
from .attention import _check_values, check_operands, checked_arguments, jagged_attention_fwd_op

FAMILY = "hstu_layer"


# ---------------------------------------------------------------------------------------------
# uvqk half: x -> (u_pre, v, q, k, stats)
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("gem_kernels::hstu_uvqk_fwd", mutates_args=())
def hstu_uvqk_fwd_op(x: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float,
                     uvqk_weight: torch.Tensor, uvqk_bias: torch.Tensor, num_heads: int, linear_dim: int,
                     attention_dim: int, silu_qkv: bool, backend: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u_pre [N, H*Lh], v [N, H, Lh], q [N, H, A], k [N, H, A], fp32 stats [N, 2])."""
    return tuple(kernel(FAMILY, "hstu_uvqk_fwd", backend)(x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias,
                                                          num_heads, linear_dim, attention_dim, silu_qkv))


def _fake_uvqk_fwd(x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, num_heads, linear_dim, attention_dim,
                   silu_qkv, backend=None):
    n = x.shape[0]
    return (x.new_empty((n, num_heads * linear_dim)), x.new_empty((n, num_heads, linear_dim)),
            x.new_empty((n, num_heads, attention_dim)), x.new_empty((n, num_heads, attention_dim)),
            x.new_empty((n, 2), dtype=torch.float32))


hstu_uvqk_fwd_op.register_fake(_fake_uvqk_fwd)


@torch.library.custom_op("gem_kernels::hstu_uvqk_bwd", mutates_args=())
def hstu_uvqk_bwd_op(grad_u: torch.Tensor, grad_v: torch.Tensor, grad_q: torch.Tensor, grad_k: torch.Tensor,
                     x: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float,
                     uvqk_weight: torch.Tensor, uvqk_bias: torch.Tensor, stats: torch.Tensor, num_heads: int,
                     linear_dim: int, attention_dim: int, silu_qkv: bool, grad_residual: torch.Tensor | None,
                     backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dnorm_weight, dnorm_bias, duvqk_weight, duvqk_bias); with grad_residual ([N, D], x's dtype and
    device) dx is the norm backward's plus grad_residual (rounded to x's dtype first, then added: the bits
    of adding the two gradients afterwards), written once: the layer's residual gradient folded in. No
    default (a schema default would cost the op its lean Autograd kernel and eager fast path, see
    gem_kernels/_autograd.py): pass None for dx alone."""
    _check_grad_residual(grad_residual, x)
    return tuple(kernel(FAMILY, "hstu_uvqk_bwd", backend)(
        grad_u, grad_v, grad_q, grad_k, x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, stats, num_heads,
        linear_dim, attention_dim, silu_qkv, grad_residual))


def _check_grad_residual(grad_residual, x) -> None:
    if grad_residual is not None and (grad_residual.shape != x.shape or grad_residual.dtype != x.dtype
                                      or grad_residual.device != x.device):
        raise ValueError(f"grad_residual must have x's shape {tuple(x.shape)}, dtype {x.dtype} and device {x.device}, "
                         f"got {tuple(grad_residual.shape)} {grad_residual.dtype} on {grad_residual.device}")


def _fake_uvqk_bwd(grad_u, grad_v, grad_q, grad_k, x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, stats,
                   num_heads, linear_dim, attention_dim, silu_qkv, grad_residual=None, backend=None):
    _check_grad_residual(grad_residual, x)
    return (torch.empty_like(x), torch.empty_like(norm_weight), torch.empty_like(norm_bias),
            torch.empty_like(uvqk_weight), torch.empty_like(uvqk_bias))


def _fake_uvqk_bwd_native(grad_u, grad_v, grad_q, grad_k, x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias,
                          stats, num_heads, linear_dim, attention_dim, silu_qkv, grad_residual=None):
    return _fake_uvqk_bwd(grad_u, grad_v, grad_q, grad_k, x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias,
                          stats, num_heads, linear_dim, attention_dim, silu_qkv, grad_residual)


hstu_uvqk_bwd_op.register_fake(_fake_uvqk_bwd)
if hasattr(torch.ops.gem_kernels, "hstu_uvqk_bwd_native"):
    torch.library.register_fake("gem_kernels::hstu_uvqk_bwd_native")(_fake_uvqk_bwd_native)


def _uvqk_setup(ctx, inputs, output):
    x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, num_heads, linear_dim, attention_dim, silu_qkv, \
        backend = inputs
    ctx.save_for_backward(x, norm_weight, norm_bias, uvqk_weight, uvqk_bias, output[4])
    ctx.args = (eps, num_heads, linear_dim, attention_dim, silu_qkv, backend)
    ctx.mark_non_differentiable(output[4])


def _uvqk_backward(ctx, grad_u, grad_v, grad_q, grad_k, _grad_stats):
    x, norm_weight, norm_bias, uvqk_weight, uvqk_bias, stats = ctx.saved_tensors
    eps, num_heads, linear_dim, attention_dim, silu_qkv, backend = ctx.args
    dx, dnw, dnb, dw, db = hstu_uvqk_bwd_op(grad_u.contiguous(), grad_v.contiguous(), grad_q.contiguous(),
                                            grad_k.contiguous(), x, norm_weight, norm_bias, eps, uvqk_weight,
                                            uvqk_bias, stats, num_heads, linear_dim, attention_dim, silu_qkv, None,
                                            backend)
    return dx, dnw, dnb, None, dw, db, None, None, None, None, None


register_autograd(hstu_uvqk_fwd_op, _uvqk_backward, setup_context=_uvqk_setup)


# ---------------------------------------------------------------------------------------------
# output half: (attn, u_pre, x) -> out
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("gem_kernels::hstu_output_fwd", mutates_args=())
def hstu_output_fwd_op(attn: torch.Tensor, u_pre: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor,
                       norm_bias: torch.Tensor, eps: float, output_weight: torch.Tensor,
                       output_bias: torch.Tensor | None, dropout_mask: torch.Tensor | None, num_heads: int,
                       group_norm: bool, concat_u: bool, concat_x: bool, backend: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, D], fp32 norm stats [N, 2 * G], G = H with group_norm, else 1)."""
    return tuple(kernel(FAMILY, "hstu_output_fwd", backend)(
        attn, u_pre, x, norm_weight, norm_bias, eps, output_weight, output_bias, dropout_mask, num_heads,
        group_norm, concat_u, concat_x))


def _fake_output_fwd(attn, u_pre, x, norm_weight, norm_bias, eps, output_weight, output_bias, dropout_mask,
                     num_heads, group_norm, concat_u, concat_x, backend=None):
    return torch.empty_like(x), x.new_empty((x.shape[0], 2 * (num_heads if group_norm else 1)), dtype=torch.float32)


hstu_output_fwd_op.register_fake(_fake_output_fwd)


@torch.library.custom_op("gem_kernels::hstu_output_bwd", mutates_args=())
def hstu_output_bwd_op(grad_out: torch.Tensor, attn: torch.Tensor, u_pre: torch.Tensor, norm_weight: torch.Tensor,
                       norm_bias: torch.Tensor, eps: float, output_weight: torch.Tensor, has_output_bias: bool,
                       dropout_mask: torch.Tensor | None, stats: torch.Tensor, num_heads: int, group_norm: bool,
                       concat_u: bool, concat_x: bool, backend: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]:
    """(dattn, du_pre, dnorm_weight, dnorm_bias, doutput_weight, doutput_bias or an empty [0])."""
    return tuple(kernel(FAMILY, "hstu_output_bwd", backend)(
        grad_out, attn, u_pre, norm_weight, norm_bias, eps, output_weight, has_output_bias, dropout_mask, stats,
        num_heads, group_norm, concat_u, concat_x))


def _fake_output_bwd(grad_out, attn, u_pre, norm_weight, norm_bias, eps, output_weight, has_output_bias,
                     dropout_mask, stats, num_heads, group_norm, concat_u, concat_x, backend=None):
    dob = grad_out.new_empty((output_weight.shape[1],), dtype=output_weight.dtype) if has_output_bias \
        else grad_out.new_empty((0,))
    return (torch.empty_like(attn), torch.empty_like(u_pre), torch.empty_like(norm_weight),
            torch.empty_like(norm_bias), torch.empty_like(output_weight), dob)


hstu_output_bwd_op.register_fake(_fake_output_bwd)


def _output_setup(ctx, inputs, output):
    (attn, u_pre, x, norm_weight, norm_bias, eps, output_weight, output_bias, dropout_mask, num_heads, group_norm,
     concat_u, concat_x, backend) = inputs
    ctx.save_for_backward(attn, u_pre, norm_weight, norm_bias, output_weight, dropout_mask, output[1])
    ctx.args = (eps, output_bias is not None, num_heads, group_norm, concat_u, concat_x, backend)
    ctx.mark_non_differentiable(output[1])


def _output_backward(ctx, grad_out, _grad_stats):
    attn, u_pre, norm_weight, norm_bias, output_weight, dropout_mask, stats = ctx.saved_tensors
    eps, has_bias, num_heads, group_norm, concat_u, concat_x, backend = ctx.args
    grad_out = grad_out.contiguous()
    da, du, dnw, dnb, dw, dob = hstu_output_bwd_op(grad_out, attn, u_pre, norm_weight, norm_bias, eps,
                                                   output_weight, has_bias, dropout_mask, stats, num_heads,
                                                   group_norm, concat_u, concat_x, backend)
    # x enters through the residual only: its gradient is grad_out itself.
    return (da, du, grad_out, dnw, dnb, None, dw, dob if has_bias else None, None, None, None, None, None, None)


register_autograd(hstu_output_fwd_op, _output_backward, setup_context=_output_setup)
run_kernels_without_autocast(hstu_uvqk_fwd_op, hstu_uvqk_bwd_op, hstu_output_fwd_op, hstu_output_bwd_op)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def _check_vector(name: str, t, size: int) -> None:
    check_tensor(name, t, dtypes=float_dtypes(), dims=(1,))
    if t.shape[0] != size:
        raise ValueError(f"{name} must have shape [{size}], got {tuple(t.shape)}")


def _check_matrix(name: str, t, shape: tuple[int, int], formula: str) -> None:
    check_tensor(name, t, dtypes=float_dtypes(), dims=(2,))
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {formula} = {list(shape)}, got {tuple(t.shape)}")


def hstu_layer(x: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int, num_targets: torch.Tensor | None = None,
               *, input_norm_weight: torch.Tensor, input_norm_bias: torch.Tensor, uvqk_weight: torch.Tensor,
               uvqk_bias: torch.Tensor, output_norm_weight: torch.Tensor, output_norm_bias: torch.Tensor,
               output_weight: torch.Tensor, output_bias: torch.Tensor | None = None, num_heads: int,
               linear_dim: int, attention_dim: int, attn_alpha: float | None = None, causal: bool = True,
               contextual_len: int = 0, max_attn_len: int = 0, pos_bias: torch.Tensor | None = None,
               time_bias: torch.Tensor | None = None, timestamps: torch.Tensor | None = None,
               query_timestamps: torch.Tensor | None = None, silu_qkv: bool = False, group_norm: bool = False,
               concat_u: bool = True, concat_x: bool = True, dropout_mask: torch.Tensor | None = None,
               eps: float = 1e-6, backend: str | None = None) -> torch.Tensor:
    """One HSTU layer on jagged rows: ``gem_kernels.reference.hstu_layer.stu_layer``'s maths, fused.

    Args:
        x: [N, D] float32/float16/bfloat16 (sequences back to back, ``seq_offsets`` [B+1]).
        seq_offsets, max_seq_len, num_targets, causal, contextual_len, max_attn_len, pos_bias,
            time_bias, timestamps, query_timestamps: as in ``gem_kernels.jagged_attention``
            (kind "hstu"; attn_alpha is its ``scale``, default 1 / sqrt(attention_dim)).
        input_norm_weight, input_norm_bias: [D].
        uvqk_weight: [D, O], O = H * (2 * linear_dim + 2 * attention_dim) (GR's layout: xn @ W);
            uvqk_bias [O]. The columns are u, v, q, k.
        output_norm_weight, output_norm_bias: [H * linear_dim], or [H] with group_norm.
        output_weight: [K, D], K = H * linear_dim * (1 + concat_u + concat_x); output_bias [D] or None.
        silu_qkv: SiLU on v, q, k as well as u (the HSTU paper's form; STULayer: u only).
        group_norm: GroupNorm over the H heads instead of LayerNorm; then concat_u and concat_x
            must be both True or both False (GR ignores a single one there).
        dropout_mask: [N, K] (0 or 1 / (1 - p)) multiplying the concat, or None.
        backend: of the attention and of the two projection halves.

    Returns:
        out [N, D] in x's dtype, differentiable w.r.t. x and every weight.
    """
    return hstu_layer_linear_layout(
        x, seq_offsets, max_seq_len, num_targets, input_norm_weight, input_norm_bias, uvqk_weight, uvqk_bias,
        output_norm_weight, output_norm_bias, output_weight, output_bias, num_heads, linear_dim, attention_dim,
        attn_alpha, causal, contextual_len, max_attn_len, pos_bias, time_bias, timestamps, query_timestamps, silu_qkv,
        group_norm, concat_u, concat_x, dropout_mask, eps, backend, False)


def hstu_layer_linear_layout(x, seq_offsets, max_seq_len, num_targets, input_norm_weight, input_norm_bias,
                             uvqk_weight, uvqk_bias, output_norm_weight, output_norm_bias, output_weight, output_bias,
                             num_heads, linear_dim, attention_dim, attn_alpha, causal, contextual_len, max_attn_len,
                             pos_bias, time_bias, timestamps, query_timestamps, silu_qkv, group_norm, concat_u,
                             concat_x, dropout_mask, eps, backend, linear_layout: bool) -> torch.Tensor:
    """``hstu_layer`` with every argument positional; with linear_layout, uvqk_weight and output_weight
    come in nn.Linear's layout ([O, D] and [D, K]: the transposes of hstu_layer's), as gk.nn.HSTULayer
    holds them. Checks and messages are hstu_layer's, on the transposed views."""
    (x, input_norm_weight, input_norm_bias, uvqk_weight, uvqk_bias, output_norm_weight, output_norm_bias,
     output_weight, output_bias) = autocast_operands(x, input_norm_weight, input_norm_bias, uvqk_weight, uvqk_bias,
                                                     output_norm_weight, output_norm_bias, output_weight, output_bias)
    if linear_layout:
        # Views for the checks (and the dispatcher path below): plain views, no autograd node.
        with torch.no_grad():
            uvqk_weight_t, output_weight_t = _transposed(uvqk_weight), _transposed(output_weight)
    else:
        uvqk_weight_t, output_weight_t = uvqk_weight, output_weight
    check_tensor("x", x, dtypes=float_dtypes(), dims=(2,))
    for name, value in (("num_heads", num_heads), ("linear_dim", linear_dim), ("attention_dim", attention_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    for name, value in (("silu_qkv", silu_qkv), ("group_norm", group_norm), ("concat_u", concat_u),
                        ("concat_x", concat_x)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {type(value).__name__}")
    if group_norm and concat_u != concat_x:
        raise ValueError(f"with group_norm, concat_u and concat_x must be equal (generative-recommenders "
                         f"concatenates only both), got concat_u={concat_u}, concat_x={concat_x}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a float > 0, got {eps!r}")
    n, dim = x.shape
    width = num_heads * linear_dim
    num_out = 2 * width + 2 * num_heads * attention_dim
    k = width * (1 + concat_u + concat_x)
    _check_vector("input_norm_weight", input_norm_weight, dim)
    _check_vector("input_norm_bias", input_norm_bias, dim)
    _check_matrix("uvqk_weight", uvqk_weight_t, (dim, num_out), "[D, H*(2*linear_dim + 2*attention_dim)]")
    _check_vector("uvqk_bias", uvqk_bias, num_out)
    norm_size = num_heads if group_norm else width
    _check_vector("output_norm_weight", output_norm_weight, norm_size)
    _check_vector("output_norm_bias", output_norm_bias, norm_size)
    _check_matrix("output_weight", output_weight_t, (k, dim), "[K, D] (K = H*linear_dim*(1 + concat_u + concat_x))")
    if output_bias is not None:
        _check_vector("output_bias", output_bias, dim)
    if dropout_mask is not None:
        check_tensor("dropout_mask", dropout_mask, dtypes=float_dtypes(), dims=(2,))
        if tuple(dropout_mask.shape) != (n, k):
            raise ValueError(f"dropout_mask must have shape [N, K] = [{n}, {k}], got {tuple(dropout_mask.shape)}")
    weights = dict(input_norm_weight=input_norm_weight, input_norm_bias=input_norm_bias, uvqk_weight=uvqk_weight_t,
                   uvqk_bias=uvqk_bias, output_norm_weight=output_norm_weight, output_norm_bias=output_norm_bias,
                   output_weight=output_weight_t)
    if output_bias is not None:
        weights["output_bias"] = output_bias
    if dropout_mask is not None:
        weights["dropout_mask"] = dropout_mask
    check_same_device(x=x, **weights)
    proj = resolve_backend(backend, x.device, FAMILY)
    check_float64_on_reference(proj, x=x, **weights)
    # The attention's checks (jagged_attention's), before q, k and v exist: on zero-stride views of their shapes.
    stub = x.new_empty(())
    q_like, v_like = stub.expand(n, num_heads, attention_dim), stub.expand(n, num_heads, linear_dim)
    check_operands("q", q_like, q_like, v_like, seq_offsets)
    num_targets, pos_bias, time_bias, timestamps, query_timestamps, scale, attention_backend = checked_arguments(
        q_like, q_like, v_like, seq_offsets, max_seq_len, "hstu", causal, attn_alpha, num_targets, contextual_len,
        max_attn_len, pos_bias, time_bias, timestamps, query_timestamps, False, backend)
    x, seq_offsets = x.contiguous(), seq_offsets.contiguous()
    if dropout_mask is not None:
        dropout_mask = dropout_mask.contiguous()
    config = (float(eps), num_heads, linear_dim, attention_dim, silu_qkv, group_norm, concat_u, concat_x, proj,
              max_seq_len, causal, scale, contextual_len, max_attn_len, attention_backend, linear_layout)
    tensors = (x, seq_offsets, num_targets, timestamps, query_timestamps, input_norm_weight, input_norm_bias,
               uvqk_weight, uvqk_bias, output_norm_weight, output_norm_bias, output_weight, output_bias, pos_bias,
               time_bias, dropout_mask)
    if fast_paths_on() and eager_plain(tensors):
        if torch.is_grad_enabled() and any_requires_grad(*tensors):
            return _HSTULayerNode.apply(config, *tensors)
        return _layer_forward(config, *tensors)[0]
    # Three registered ops (the dispatcher path: compile, export, fake tensors, autocast, ...).
    # The weights' gradients have the weights' layout (the fakes' empty_like). An nn.Linear weight arrives
    # transposed: the CPU kernels read it so (csrc/cpu/hstu_layer.cpp's transposed_layout: no copy here, none
    # back in the backward, none in AccumulateGrad; the small model's batch-8 step -0.09 to -0.12 ms, measured
    # there); the other backends get a contiguous copy, as the CPU ones did.
    if linear_layout:
        uvqk_weight, output_weight = uvqk_weight.t(), output_weight.t()
    if proj != "cpu":
        uvqk_weight, output_weight = uvqk_weight.contiguous(), output_weight.contiguous()
    u_pre, v, q, k_ = hstu_uvqk_fwd_op(x, input_norm_weight, input_norm_bias, float(eps), uvqk_weight, uvqk_bias,
                                       num_heads, linear_dim, attention_dim, silu_qkv, proj)[:4]
    attn, _lse = jagged_attention_fwd_op(q.contiguous(), k_.contiguous(), v.contiguous(), seq_offsets, max_seq_len,
                                         "hstu", causal, scale, num_targets, contextual_len, max_attn_len, pos_bias,
                                         time_bias, timestamps, query_timestamps, False, attention_backend)
    out, _stats = hstu_output_fwd_op(attn.view(n, width), u_pre, x, output_norm_weight, output_norm_bias,
                                     float(eps), output_weight, output_bias, dropout_mask, num_heads, group_norm,
                                     concat_u, concat_x, proj)
    return out


def _transposed(weight):
    return weight.t() if isinstance(weight, torch.Tensor) and weight.dim() == 2 else weight


# ---------------------------------------------------------------------------------------------
# The eager fast path: the whole layer as one autograd node
# ---------------------------------------------------------------------------------------------


def _layer_forward(config, x, seq_offsets, num_targets, timestamps, query_timestamps, input_norm_weight,
                   input_norm_bias, uvqk_weight, uvqk_bias, output_norm_weight, output_norm_bias, output_weight,
                   output_bias, pos_bias, time_bias, dropout_mask):
    """The three ops' bodies back to back: (out, what the backward needs)."""
    (eps, num_heads, linear_dim, attention_dim, silu_qkv, group_norm, concat_u, concat_x, proj, max_seq_len, causal,
     scale, contextual_len, max_attn_len, attention_backend, linear_layout) = config
    if linear_layout:
        uvqk_weight, output_weight = uvqk_weight.t(), output_weight.t()
    if proj != "cpu":
        uvqk_weight, output_weight = uvqk_weight.contiguous(), output_weight.contiguous()
    u_pre, v, q, k, uvqk_stats = kernel(FAMILY, "hstu_uvqk_fwd", proj)(
        x, input_norm_weight, input_norm_bias, eps, uvqk_weight, uvqk_bias, num_heads, linear_dim, attention_dim,
        silu_qkv)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    _check_values(q, seq_offsets, max_seq_len, num_targets)
    attn, lse = kernel("attention", "jagged_attention_fwd", attention_backend)(
        q, k, v, seq_offsets, max_seq_len, "hstu", causal, scale, num_targets, contextual_len, max_attn_len, pos_bias,
        time_bias, timestamps, query_timestamps)
    n = x.shape[0]
    out, output_stats = kernel(FAMILY, "hstu_output_fwd", proj)(
        attn.view(n, num_heads * linear_dim), u_pre, x, output_norm_weight, output_norm_bias, eps, output_weight,
        output_bias, dropout_mask, num_heads, group_norm, concat_u, concat_x)
    return out, (uvqk_weight, output_weight, u_pre, v, q, k, uvqk_stats, attn, lse, output_stats)


class _HSTULayerNode(torch.autograd.Function):
    """hstu_layer's eager fast path (gem_kernels/_autograd.py: plain CPU/CUDA tensors, no tracing, mode or
    autocast): the bodies of hstu_uvqk_fwd, jagged_attention_fwd and hstu_output_fwd in one node, whose
    backward runs their three backward ops' bodies and adds the residual's gradient (grad_out) to dx.
    The dispatcher path's graph has six nodes per layer for the same work: the three ops', a view of the
    attention output, and the two weights' transposes (an nn.Linear layout weight is read transposed here,
    its gradient returned in its own layout). Same kernels, same arguments, same bits (tested against the
    dispatcher path).
    Measured (glue14, 2026-12-07; GEM small model's step, 2 HSTU layers; this node against the three ops'
    nodes, switched per round of 8 batches in one process, SCHED_FIFO, busy 2-core Xeon): batch 8, 1 thread,
    CPU time -332 us a step (paired median, 60 rounds, ratio 0.956); batch 256, 2 threads, wall -375 / -435 us
    (30 / 24 rounds, ratios 0.987 / 0.988); batch 256, 1 thread, CPU -536 us (14 rounds, ratio 0.998).
    The residual's gradient (grad_out) goes into the uvqk backward as grad_residual: the cpu kernel adds it
    in its norm backward's last pass (dx written once; the other backends add it after their dx), in place
    of the node's own dx.add_(grad_out), a pass over [N, D] (step15, 2026-12-07, 2-core AMD EPYC Zen 4,
    SCHED_FIFO under the measuring lock: the small model's uvqk backward at batch 256 (9358 rows), the two
    forms alternated call by call, 2 threads: 1526 -> 1503 and 1535 -> 1509 us, paired -23 / -26 us a layer,
    ratio 0.985 / 0.983; the whole step's paired A/B could not resolve its ~-50 us under the host's noise)."""

    @staticmethod
    def forward(ctx, config, x, seq_offsets, num_targets, timestamps, query_timestamps, input_norm_weight,
                input_norm_bias, uvqk_weight, uvqk_bias, output_norm_weight, output_norm_bias, output_weight,
                output_bias, pos_bias, time_bias, dropout_mask):
        out, saved = _layer_forward(config, x, seq_offsets, num_targets, timestamps, query_timestamps,
                                    input_norm_weight, input_norm_bias, uvqk_weight, uvqk_bias, output_norm_weight,
                                    output_norm_bias, output_weight, output_bias, pos_bias, time_bias, dropout_mask)
        ctx.save_for_backward(x, seq_offsets, num_targets, timestamps, query_timestamps, input_norm_weight,
                              input_norm_bias, uvqk_bias, output_norm_weight, output_norm_bias, pos_bias, time_bias,
                              dropout_mask)
        # Intermediates (nobody else holds them) and the weights as the kernels read them.
        ctx.config, ctx.intermediates, ctx.has_output_bias = config, saved, output_bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x, seq_offsets, num_targets, timestamps, query_timestamps, input_norm_weight, input_norm_bias, uvqk_bias,
         output_norm_weight, output_norm_bias, pos_bias, time_bias, dropout_mask) = ctx.saved_tensors
        (eps, num_heads, linear_dim, attention_dim, silu_qkv, group_norm, concat_u, concat_x, proj, max_seq_len,
         causal, scale, contextual_len, max_attn_len, attention_backend, linear_layout) = ctx.config
        uvqk_weight, output_weight, u_pre, v, q, k, uvqk_stats, attn, lse, output_stats = ctx.intermediates
        n = x.shape[0]
        grad_out = grad_out.contiguous()
        da, du, dnw_out, dnb_out, dw_out, db_out = kernel(FAMILY, "hstu_output_bwd", proj)(
            grad_out, attn.view(n, num_heads * linear_dim), u_pre, output_norm_weight, output_norm_bias, eps,
            output_weight, ctx.has_output_bias, dropout_mask, output_stats, num_heads, group_norm, concat_u, concat_x)
        dq, dk, dv, dpos, dtime = kernel("attention", "jagged_attention_bwd", attention_backend)(
            da.reshape(n, num_heads, linear_dim).contiguous(), q, k, v, attn, lse, seq_offsets, max_seq_len, "hstu",
            causal, scale, num_targets, contextual_len, max_attn_len, pos_bias, time_bias, timestamps,
            query_timestamps, False)
        # The residual (out = x + ...): grad_out added into dx by the uvqk backward (grad_residual).
        dx, dnw_in, dnb_in, dw_uvqk, db_uvqk = kernel(FAMILY, "hstu_uvqk_bwd", proj)(
            du.contiguous(), dv.contiguous(), dq.contiguous(), dk.contiguous(), x, input_norm_weight,
            input_norm_bias, eps, uvqk_weight, uvqk_bias, uvqk_stats, num_heads, linear_dim, attention_dim, silu_qkv,
            grad_out)
        if linear_layout:
            dw_uvqk, dw_out = dw_uvqk.t(), dw_out.t()
        return (None, dx, None, None, None, None, dnw_in, dnb_in, dw_uvqk, db_uvqk, dnw_out, dnb_out, dw_out,
                db_out if ctx.has_output_bias else None, dpos if pos_bias is not None else None,
                dtime if time_bias is not None else None, None)

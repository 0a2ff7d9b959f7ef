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

from .._autograd import register_autograd
from .._autocast import autocast_operands, run_kernels_without_autocast
from .._backend import kernel, resolve_backend
from .._validate import check_float64_on_reference, check_same_device, check_tensor, float_dtypes
from .attention import jagged_attention

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
                     linear_dim: int, attention_dim: int, silu_qkv: bool, backend: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dnorm_weight, dnorm_bias, duvqk_weight, duvqk_bias)."""
    return tuple(kernel(FAMILY, "hstu_uvqk_bwd", backend)(
        grad_u, grad_v, grad_q, grad_k, x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, stats, num_heads,
        linear_dim, attention_dim, silu_qkv))


def _fake_uvqk_bwd(grad_u, grad_v, grad_q, grad_k, x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, stats,
                   num_heads, linear_dim, attention_dim, silu_qkv, backend=None):
    return (torch.empty_like(x), torch.empty_like(norm_weight), torch.empty_like(norm_bias),
            torch.empty_like(uvqk_weight), torch.empty_like(uvqk_bias))


hstu_uvqk_bwd_op.register_fake(_fake_uvqk_bwd)


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
                                            uvqk_bias, stats, num_heads, linear_dim, attention_dim, silu_qkv, backend)
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
    (x, input_norm_weight, input_norm_bias, uvqk_weight, uvqk_bias, output_norm_weight, output_norm_bias,
     output_weight, output_bias) = autocast_operands(x, input_norm_weight, input_norm_bias, uvqk_weight, uvqk_bias,
                                                     output_norm_weight, output_norm_bias, output_weight, output_bias)
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
    _check_matrix("uvqk_weight", uvqk_weight, (dim, num_out), "[D, H*(2*linear_dim + 2*attention_dim)]")
    _check_vector("uvqk_bias", uvqk_bias, num_out)
    norm_size = num_heads if group_norm else width
    _check_vector("output_norm_weight", output_norm_weight, norm_size)
    _check_vector("output_norm_bias", output_norm_bias, norm_size)
    _check_matrix("output_weight", output_weight, (k, dim), "[K, D] (K = H*linear_dim*(1 + concat_u + concat_x))")
    if output_bias is not None:
        _check_vector("output_bias", output_bias, dim)
    if dropout_mask is not None:
        check_tensor("dropout_mask", dropout_mask, dtypes=float_dtypes(), dims=(2,))
        if tuple(dropout_mask.shape) != (n, k):
            raise ValueError(f"dropout_mask must have shape [N, K] = [{n}, {k}], got {tuple(dropout_mask.shape)}")
    weights = dict(input_norm_weight=input_norm_weight, input_norm_bias=input_norm_bias, uvqk_weight=uvqk_weight,
                   uvqk_bias=uvqk_bias, output_norm_weight=output_norm_weight, output_norm_bias=output_norm_bias,
                   output_weight=output_weight)
    if output_bias is not None:
        weights["output_bias"] = output_bias
    if dropout_mask is not None:
        weights["dropout_mask"] = dropout_mask
    check_same_device(x=x, **weights)
    proj = resolve_backend(backend, x.device, FAMILY)
    check_float64_on_reference(proj, x=x, **weights)
    # The weights' gradients have the weights' layout (the fakes' empty_like). An nn.Linear weight arrives
    # transposed: the CPU kernels read it so (csrc/cpu/hstu_layer.cpp's transposed_layout: no copy here, none
    # back in the backward, none in AccumulateGrad; the small model's batch-8 step -0.09 to -0.12 ms, measured
    # there); the other backends get a contiguous copy, as the CPU ones did.
    if proj != "cpu":
        uvqk_weight, output_weight = uvqk_weight.contiguous(), output_weight.contiguous()
    u_pre, v, q, k_ = hstu_uvqk_fwd_op(x.contiguous(), input_norm_weight, input_norm_bias, float(eps),
                                       uvqk_weight, uvqk_bias, num_heads, linear_dim, attention_dim, silu_qkv,
                                       proj)[:4]
    attn = jagged_attention(q, k_, v, seq_offsets, max_seq_len, kind="hstu", causal=causal, scale=attn_alpha,
                            num_targets=num_targets, contextual_len=contextual_len, max_attn_len=max_attn_len,
                            pos_bias=pos_bias, time_bias=time_bias, timestamps=timestamps,
                            query_timestamps=query_timestamps, backend=backend)
    out, _stats = hstu_output_fwd_op(attn.view(n, width), u_pre, x.contiguous(), output_norm_weight,
                                     output_norm_bias, float(eps), output_weight, output_bias,
                                     None if dropout_mask is None else dropout_mask.contiguous(), num_heads,
                                     group_norm, concat_u, concat_x, proj)
    return out

"""Feature-interaction layers: the front door (validation, torch.library ops, fake kernels, autograd).

Four fused ops, each with its backward as a registered op:

- ``dot_interaction``: DLRM / TorchRec ``InteractionArch`` pairwise dot products of F embeddings.
- ``cross_layer``: one DCNv2 cross layer ``x0 * (W xl + b) + xl`` (full or low rank W = U V).
- ``fm_compress``: Wukong's optimised factorization machine ``flatten(X (X^T Y))`` with its LayerNorm.
- ``feature_mix_norm``: the rest of a Wukong layer, ``LayerNorm_D(M X + concat(FMB, 0))``.

Every tensor argument of an op has the dtype of the activations (fp32/fp16/bf16); kernels
accumulate in fp32.
"""

from __future__ import annotations

import math

import torch
from torch._C import _any_requires_grad as any_requires_grad

from .._autograd import eager_plain, fast_paths_on, register_autograd
from .._autocast import autocast_operands, run_kernels_without_autocast
from .._backend import FAMILIES, kernel, native_kernels, resolve_backend
from .._validate import check_float64_on_reference, check_same_device, check_tensor, float_dtypes

FAMILY = "interaction"
IMPLEMENTED = FAMILIES[FAMILY].implemented


def num_pairs(num_features: int, self_interaction: bool) -> int:
    """P: F (F - 1) / 2 pairs i < j, or F (F + 1) / 2 pairs i <= j with self_interaction."""
    return num_features * (num_features + 1) // 2 if self_interaction else num_features * (num_features - 1) // 2


# ---------------------------------------------------------------------------------------------
# torch.library ops. `backend` is a concrete backend name, resolved by the public functions.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("gem_kernels::dot_interaction", mutates_args=())
def dot_interaction_op(x: torch.Tensor, self_interaction: bool, backend: str) -> torch.Tensor:
    return kernel(FAMILY, "dot_interaction", backend)(x, self_interaction)


@dot_interaction_op.register_fake
def _dot_interaction_fake(x, self_interaction, backend):
    return x.new_empty((x.shape[0], num_pairs(x.shape[1], self_interaction)))


@torch.library.custom_op("gem_kernels::dot_interaction_backward", mutates_args=())
def dot_interaction_backward_op(grad_out: torch.Tensor, x: torch.Tensor, self_interaction: bool,
                                backend: str) -> torch.Tensor:
    return kernel(FAMILY, "dot_interaction_backward", backend)(grad_out, x, self_interaction)


@dot_interaction_backward_op.register_fake
def _dot_interaction_backward_fake(grad_out, x, self_interaction, backend):
    return torch.empty_like(x)


def _dot_interaction_setup(ctx, inputs, output):
    x, self_interaction, backend = inputs
    ctx.save_for_backward(x)
    ctx.self_interaction = self_interaction
    ctx.backend = backend


def _dot_interaction_backward(ctx, grad_out):
    (x,) = ctx.saved_tensors
    return dot_interaction_backward_op(grad_out.contiguous(), x, ctx.self_interaction, ctx.backend), None, None


register_autograd(dot_interaction_op, _dot_interaction_backward, setup_context=_dot_interaction_setup)


@torch.library.custom_op("gem_kernels::cross_layer", mutates_args=())
def cross_layer_op(x0: torch.Tensor, xl: torch.Tensor, u: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, z, p): p = xl V^T (empty when v is an empty 1-D tensor: full rank W = u; a low-rank v is
    2-D [r, N], empty itself when N = 0), z = p U^T + b, out = x0 * z + xl.

    z and p are what the backward needs (not differentiable outputs)."""
    return kernel(FAMILY, "cross_layer", backend)(x0, xl, u, v, bias)


@cross_layer_op.register_fake
def _cross_layer_fake(x0, xl, u, v, bias, backend):
    p = xl.new_empty((xl.shape[0], v.shape[0])) if v.dim() == 2 else xl.new_empty(0)
    return torch.empty_like(xl), torch.empty_like(xl), p


@torch.library.custom_op("gem_kernels::cross_layer_backward", mutates_args=())
def cross_layer_backward_op(grad_out: torch.Tensor, x0: torch.Tensor, xl: torch.Tensor, u: torch.Tensor,
                            v: torch.Tensor, z: torch.Tensor, p: torch.Tensor, backend: str
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernel(FAMILY, "cross_layer_backward", backend)(grad_out, x0, xl, u, v, z, p)


@cross_layer_backward_op.register_fake
def _cross_layer_backward_fake(grad_out, x0, xl, u, v, z, p, backend):
    return (torch.empty_like(x0), torch.empty_like(xl), torch.empty_like(u), torch.empty_like(v),
            xl.new_empty((xl.shape[1],)))


def _cross_layer_setup(ctx, inputs, output):
    x0, xl, u, v, _bias, backend = inputs
    _out, z, p = output
    ctx.mark_non_differentiable(z, p)
    ctx.set_materialize_grads(False)  # see _fm_compress_setup
    ctx.save_for_backward(x0, xl, u, v, z, p)
    ctx.backend = backend


def _cross_layer_backward(ctx, grad_out, _grad_z, _grad_p):
    if grad_out is None:
        return (None,) * 6
    x0, xl, u, v, z, p = ctx.saved_tensors
    grads = cross_layer_backward_op(grad_out.contiguous(), x0, xl, u, v, z, p, ctx.backend)
    return (*grads, None)


register_autograd(cross_layer_op, _cross_layer_backward, setup_context=_cross_layer_setup)


def products_shape(x: torch.Tensor, y: torch.Tensor, saved: bool) -> tuple[int, int]:
    """Shape of fm_compress's `products`: fp32 [B, k*D + F*k], each row a sample's (X^T Y)^T [k, D]
    then S = X X^T Y [F, k]; 0 rows when the backend does not keep them (the backward recomputes)."""
    B, F, D = x.shape
    k = y.shape[1]
    return (B if saved else 0, k * D + F * k)


# Backends whose fm_compress keeps X^T Y and S for the backward, trading 4*F*D*k of its 12*F*D*k
# FLOPs for 4*(D + F)*k bytes per sample written and read back. On the CPU kernels (compute bound)
# that pays where F is large against k (F = 128, D = 64, k = 16: the products are a third of X's
# bytes) and is about even at F = 27, where X^T Y alone is as large as X. The GPU kernels are memory
# bound (the traffic would cost more than the FLOPs) and the reference stays the plain
# formulation: they recompute.
SAVES_PRODUCTS = ("cpu",)


@torch.library.custom_op("gem_kernels::fm_compress", mutates_args=())
def fm_compress_op(x: torch.Tensor, y: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                   save_products: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [B, F*k], mean [B] fp32, rstd [B] fp32, products): the LayerNorm statistics and (when
    save_products and the backend is in SAVES_PRODUCTS) the products the backward reuses."""
    return kernel(FAMILY, "fm_compress", backend)(x, y, ln_weight, ln_bias, eps, save_products)


@fm_compress_op.register_fake
def _fm_compress_fake(x, y, ln_weight, ln_bias, eps, save_products, backend):
    B = x.shape[0]
    saved = save_products and native_kernels(backend) in SAVES_PRODUCTS
    return (x.new_empty((B, x.shape[1] * y.shape[1])), x.new_empty((B,), dtype=torch.float32),
            x.new_empty((B,), dtype=torch.float32), x.new_empty(products_shape(x, y, saved), dtype=torch.float32))


@torch.library.custom_op("gem_kernels::fm_compress_backward", mutates_args=())
def fm_compress_backward_op(grad_out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, ln_weight: torch.Tensor,
                            mean: torch.Tensor, rstd: torch.Tensor, products: torch.Tensor, backend: str
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernel(FAMILY, "fm_compress_backward", backend)(grad_out, x, y, ln_weight, mean, rstd, products)


@fm_compress_backward_op.register_fake
def _fm_compress_backward_fake(grad_out, x, y, ln_weight, mean, rstd, products, backend):
    return torch.empty_like(x), torch.empty_like(y), torch.empty_like(ln_weight), torch.empty_like(ln_weight)


def _fm_compress_setup(ctx, inputs, output):
    x, y, ln_weight, _ln_bias, _eps, _save_products, backend = inputs
    _out, mean, rstd, products = output
    ctx.mark_non_differentiable(mean, rstd, products)
    # The statistics and products get no gradient: without this, autograd hands the backward a zero
    # tensor of each (a fill of [B, products] per layer and step, measured 3 MB per small-model step).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, y, ln_weight, mean, rstd, products)
    ctx.backend = backend


def _fm_compress_backward(ctx, grad_out, _grad_mean, _grad_rstd, _grad_products):
    if grad_out is None:  # not materialized: the output got no gradient either
        return (None,) * 7
    x, y, ln_weight, mean, rstd, products = ctx.saved_tensors
    grads = fm_compress_backward_op(grad_out.contiguous(), x, y, ln_weight, mean, rstd, products, ctx.backend)
    return (*grads, None, None, None)


register_autograd(fm_compress_op, _fm_compress_backward, setup_context=_fm_compress_setup)


# Backends with a native fm_compress_backward_accumulate; the op adds the separate grad_x elsewhere.
ACCUMULATES_GRAD_X = ("cpu", "reference")


@torch.library.custom_op("gem_kernels::fm_compress_backward_accumulate", mutates_args=("grad_x",))
def fm_compress_backward_accumulate_op(grad_out: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                                       ln_weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                                       products: torch.Tensor, grad_x: torch.Tensor, backend: str
                                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fm_compress_backward with its x gradient added into grad_x (x's shape, dtype and device, contiguous)
    -> (grad_y, grad_ln_weight, grad_ln_bias): a Wukong layer's x gradient written once, where the engine
    would add fm_compress's and feature_mix_norm's (wukong_fm_compress)."""
    if backend in ACCUMULATES_GRAD_X:
        return kernel(FAMILY, "fm_compress_backward_accumulate", backend)(grad_out, x, y, ln_weight, mean, rstd,
                                                                         products, grad_x)
    dx, dy, dw, db = kernel(FAMILY, "fm_compress_backward", backend)(grad_out, x, y, ln_weight, mean, rstd, products)
    grad_x.add_(dx)
    return dy, dw, db


@fm_compress_backward_accumulate_op.register_fake
def _fm_compress_backward_accumulate_fake(grad_out, x, y, ln_weight, mean, rstd, products, grad_x, backend):
    return torch.empty_like(y), torch.empty_like(ln_weight), torch.empty_like(ln_weight)


@torch.library.custom_op("gem_kernels::feature_mix_norm", mutates_args=())
def feature_mix_norm_op(x: torch.Tensor, mix: torch.Tensor, fm: torch.Tensor, ln_weight: torch.Tensor,
                        ln_bias: torch.Tensor, eps: float, backend: str
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [B, O, D], mean [B, O] fp32, rstd [B, O] fp32)."""
    return kernel(FAMILY, "feature_mix_norm", backend)(x, mix, fm, ln_weight, ln_bias, eps)


def _feature_mix_norm_fake(x, mix, fm, ln_weight, ln_bias, eps, backend=None):
    B, O = x.shape[0], mix.shape[0]
    return (x.new_empty((B, O, x.shape[2])), x.new_empty((B, O), dtype=torch.float32),
            x.new_empty((B, O), dtype=torch.float32))


feature_mix_norm_op.register_fake(_feature_mix_norm_fake)


@torch.library.custom_op("gem_kernels::feature_mix_norm_backward", mutates_args=())
def feature_mix_norm_backward_op(grad_out: torch.Tensor, x: torch.Tensor, mix: torch.Tensor, fm: torch.Tensor,
                                 ln_weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, backend: str
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernel(FAMILY, "feature_mix_norm_backward", backend)(grad_out, x, mix, fm, ln_weight, mean, rstd)


def _feature_mix_norm_backward_fake(grad_out, x, mix, fm, ln_weight, mean, rstd, backend=None):
    return (torch.empty_like(x), torch.empty_like(mix), torch.empty_like(fm), torch.empty_like(ln_weight),
            torch.empty_like(ln_weight))


feature_mix_norm_backward_op.register_fake(_feature_mix_norm_backward_fake)


def _feature_mix_norm_setup(ctx, inputs, output):
    x, mix, fm, ln_weight, _ln_bias, _eps, backend = inputs
    _out, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)  # see _fm_compress_setup
    ctx.save_for_backward(x, mix, fm, ln_weight, mean, rstd)
    ctx.backend = backend


def _feature_mix_norm_backward(ctx, grad_out, _grad_mean, _grad_rstd):
    if grad_out is None:
        return (None,) * 7
    x, mix, fm, ln_weight, mean, rstd = ctx.saved_tensors
    grads = feature_mix_norm_backward_op(grad_out.contiguous(), x, mix, fm, ln_weight, mean, rstd, ctx.backend)
    return (*grads, None, None)


register_autograd(feature_mix_norm_op, _feature_mix_norm_backward, setup_context=_feature_mix_norm_setup)
run_kernels_without_autocast(dot_interaction_op, dot_interaction_backward_op, cross_layer_op, cross_layer_backward_op,
                             fm_compress_op, fm_compress_backward_op, fm_compress_backward_accumulate_op,
                             feature_mix_norm_op,
                             feature_mix_norm_backward_op)


# Fake kernels for the native schemas (csrc/ops.cpp), so opcheck and tracing see them too.
if hasattr(torch.ops.gem_kernels, "dot_interaction_native"):

    @torch.library.register_fake("gem_kernels::dot_interaction_native")
    def _dot_interaction_native_fake(x, self_interaction):
        return x.new_empty((x.shape[0], num_pairs(x.shape[1], self_interaction)))

    @torch.library.register_fake("gem_kernels::dot_interaction_backward_native")
    def _dot_interaction_backward_native_fake(grad_out, x, self_interaction):
        return torch.empty_like(x)

    @torch.library.register_fake("gem_kernels::cross_layer_native")
    def _cross_layer_native_fake(x0, xl, u, v, bias):
        p = xl.new_empty((xl.shape[0], v.shape[0])) if v.dim() == 2 else xl.new_empty(0)
        return torch.empty_like(xl), torch.empty_like(xl), p

    @torch.library.register_fake("gem_kernels::cross_layer_backward_native")
    def _cross_layer_backward_native_fake(grad_out, x0, xl, u, v, z, p):
        return (torch.empty_like(x0), torch.empty_like(xl), torch.empty_like(u), torch.empty_like(v),
                xl.new_empty((xl.shape[1],)))

    @torch.library.register_fake("gem_kernels::fm_compress_native")
    def _fm_compress_native_fake(x, y, ln_weight, ln_bias, eps, save_products):
        B = x.shape[0]
        # The CPU kernel keeps them, the CUDA one does not.
        saved = save_products and native_kernels(x.device.type) in SAVES_PRODUCTS
        return (x.new_empty((B, x.shape[1] * y.shape[1])), x.new_empty((B,), dtype=torch.float32),
                x.new_empty((B,), dtype=torch.float32), x.new_empty(products_shape(x, y, saved), dtype=torch.float32))

    @torch.library.register_fake("gem_kernels::fm_compress_backward_native")
    def _fm_compress_backward_native_fake(grad_out, x, y, ln_weight, mean, rstd, products):
        return torch.empty_like(x), torch.empty_like(y), torch.empty_like(ln_weight), torch.empty_like(ln_weight)

    @torch.library.register_fake("gem_kernels::fm_compress_backward_accumulate_native")
    def _fm_compress_backward_accumulate_native_fake(grad_out, x, y, ln_weight, mean, rstd, products, grad_x):
        return torch.empty_like(y), torch.empty_like(ln_weight), torch.empty_like(ln_weight)

    torch.library.register_fake("gem_kernels::feature_mix_norm_native")(_feature_mix_norm_fake)
    torch.library.register_fake("gem_kernels::feature_mix_norm_backward_native")(_feature_mix_norm_backward_fake)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def _check_like(name: str, t, ref_name: str, ref: torch.Tensor, shape: tuple) -> None:
    """t is a tensor of ref's dtype and device with exactly `shape`."""
    check_tensor(name, t, dtypes=float_dtypes(), dims=(len(shape),))
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")
    check_same_device(**{ref_name: ref, name: t})
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _layer_norm_params(x: torch.Tensor, width: int, ln_weight, ln_bias, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """The LayerNorm's (weight, bias) over `width` features, checked against x (None: 1 and 0), and
    eps checked > 0."""
    if ln_weight is None:
        ln_weight = x.new_ones(width)
    else:
        _check_like("ln_weight", ln_weight, "x", x, (width,))
    if ln_bias is None:
        ln_bias = x.new_zeros(width)
    else:
        _check_like("ln_bias", ln_bias, "x", x, (width,))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ValueError(f"eps must be a float > 0 and finite, got {eps!r}")
    return ln_weight, ln_bias


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__}")


def dot_interaction(x: torch.Tensor, self_interaction: bool = False, *, backend: str | None = None) -> torch.Tensor:
    """DLRM pairwise dot interaction of F embeddings, upper triangle only.

    ``out[b, p] = sum_d x[b, i_p, d] * x[b, j_p, d]`` for the pairs ``(i_p, j_p)`` of
    ``torch.triu_indices(F, F, 1)`` (i < j), or ``torch.triu_indices(F, F, 0)`` (i <= j) with
    ``self_interaction``: TorchRec's ``InteractionArch`` (bmm + triu gather), whose [B, F, F] gram
    the fused backends never materialise. Accumulates in fp32.

    Args:
        x: [B, F, D] float32/float16/bfloat16. B = 0 is valid; F = 1 gives P = 0 (or 1 with
            self_interaction).
        self_interaction: include the squared norms <x_i, x_i>.
        backend: "reference" | "cpu" | "cuda" | "triton" | "auto"; None uses ``use_backend``'s default.

    Returns:
        [B, P] in x's dtype, P = F (F - 1) / 2 (F (F + 1) / 2 with self_interaction). Differentiable
        w.r.t. x: ``grad_x = (G + G^T) x`` with G the upper triangle scattered from grad_out.

    Under ``torch.autocast`` x is cast to the autocast dtype first (gem_kernels/_autocast.py).
    """
    (x,) = autocast_operands(x)
    check_tensor("x", x, dtypes=float_dtypes(), dims=(3,))
    _check_bool("self_interaction", self_interaction)
    name = resolve_backend(backend, x.device, FAMILY)
    check_float64_on_reference(name, x=x)
    return dot_interaction_op(x.contiguous(), self_interaction, name)


def cross_layer(x0: torch.Tensor, xl: torch.Tensor,
                weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor, *,
                backend: str | None = None) -> torch.Tensor:
    """One DCNv2 cross layer: ``x_{l+1} = x0 * (W xl + b) + xl``, bias, product and residual fused.

    Follows TorchRec's ``CrossNet`` (full rank, ``W`` [N, N] applied as ``xl @ W^T``, nn.Linear's
    convention) and ``LowRankCrossNet`` (``W = U V``: pass ``weight=(u, v)`` with u [N, r] and
    v [r, N], so ``W xl = U (V xl)``). Accumulates in fp32.

    Args:
        x0: [B, N] the layer-0 input, float32/float16/bfloat16. B = 0 is valid.
        xl: [B, N] the current layer's input, x0's dtype and device.
        weight: [N, N], or a tuple (u [N, r], v [r, N]) with r >= 1; x0's dtype and device. N = 0
            is valid for both forms (the output is [B, 0]).
        bias: [N], x0's dtype and device.
        backend: "reference" | "cpu" | "cuda" | "triton" | "auto"; None uses ``use_backend``'s default.

    Returns:
        [B, N] in x0's dtype; differentiable w.r.t. x0, xl, weight (u, v) and bias.

    Under ``torch.autocast`` every operand is cast to the autocast dtype first (like nn.Linear).
    """
    x0, xl, weight, bias = autocast_operands(x0, xl, weight, bias)
    check_tensor("x0", x0, dtypes=float_dtypes(), dims=(2,))
    _check_like("xl", xl, "x0", x0, tuple(x0.shape))
    N = x0.shape[1]
    if isinstance(weight, (tuple, list)):
        if len(weight) != 2:
            raise ValueError(f"weight must be a tensor [N, N] or a tuple (u, v), got a sequence of {len(weight)}")
        u, v = weight
        check_tensor("u", u, dims=(2,))
        rank = u.shape[1]
        if rank < 1:
            raise ValueError(f"u must have shape ({N}, r) with r >= 1, got {tuple(u.shape)}")
        _check_like("u", u, "x0", x0, (N, rank))
        _check_like("v", v, "x0", x0, (rank, N))
    else:
        u = weight
        _check_like("weight", u, "x0", x0, (N, N))
        v = x0.new_empty(0)
    _check_like("bias", bias, "x0", x0, (N,))
    name = resolve_backend(backend, x0.device, FAMILY)
    check_float64_on_reference(name, x0=x0)
    out, _z, _p = cross_layer_op(x0.contiguous(), xl.contiguous(), u.contiguous(), v.contiguous(),
                                 bias.contiguous(), name)
    return out


def fm_compress(x: torch.Tensor, y: torch.Tensor, ln_weight: torch.Tensor | None = None,
                ln_bias: torch.Tensor | None = None, eps: float = 1e-5, *,
                backend: str | None = None) -> torch.Tensor:
    """Wukong's optimised factorization machine with its LayerNorm: ``LayerNorm(flatten(X (X^T Y)))``.

    Per sample, ``s = flatten(x[b] @ (x[b]^T @ y))`` [F*k] (the rank-k compression of the F x F
    interaction matrix ``x x^T``, Wukong's "optimised FM"), then LayerNorm over those F*k features:
    ``out = (s - mean(s)) / sqrt(var(s) + eps) * ln_weight + ln_bias`` (biased variance, like
    torch.nn.LayerNorm). The output is what the FMB's MLP consumes. Statistics and matmuls in fp32.

    Args:
        x: [B, F, D] float32/float16/bfloat16. B = 0 and F = 1 are valid.
        y: [F, k] the learned compression, x's dtype and device, k >= 1.
        ln_weight: [F*k] LayerNorm scale, x's dtype and device; None means 1 (no affine scale).
        ln_bias: [F*k] LayerNorm shift; None means 0.
        eps: LayerNorm epsilon, > 0 (torch.nn.LayerNorm's default 1e-5).
        backend: "reference" | "cpu" | "cuda" | "triton" | "auto"; None uses ``use_backend``'s default.

    Returns:
        [B, F*k] in x's dtype; differentiable w.r.t. x, y, ln_weight and ln_bias.

    Under ``torch.autocast`` every operand is cast to the autocast dtype first (the LayerNorm
    statistics stay fp32 inside).
    """
    x, y, ln_weight, ln_bias = autocast_operands(x, y, ln_weight, ln_bias)
    ln_weight, ln_bias, name = _fm_compress_arguments(x, y, ln_weight, ln_bias, eps, backend)
    # Keep the products only when a backward will run (inference skips their writes).
    save_products = torch.is_grad_enabled() and any(t.requires_grad for t in (x, y, ln_weight, ln_bias))
    out, _mean, _rstd, _products = fm_compress_op(x.contiguous(), y.contiguous(), ln_weight.contiguous(),
                                                  ln_bias.contiguous(), float(eps), save_products, name)
    return out


def _fm_compress_arguments(x, y, ln_weight, ln_bias, eps, backend):
    """fm_compress's checks: (ln_weight, ln_bias) with None as the LayerNorm's ones and zeros, and the
    concrete backend."""
    check_tensor("x", x, dtypes=float_dtypes(), dims=(3,))
    F = x.shape[1]
    check_tensor("y", y, dims=(2,))
    if y.shape[1] < 1:
        raise ValueError(f"y must have shape ({F}, k) with k >= 1, got {tuple(y.shape)}")
    _check_like("y", y, "x", x, (F, y.shape[1]))
    ln_weight, ln_bias = _layer_norm_params(x, F * y.shape[1], ln_weight, ln_bias, eps)
    name = resolve_backend(backend, x.device, FAMILY)
    check_float64_on_reference(name, x=x)
    return ln_weight, ln_bias, name


class WukongXGrad:
    """One Wukong layer's link between its fm_compress node and its feature_mix_norm node
    (wukong_fm_compress, then wukong_feature_mix_norm with the same link, on the same x).

    Backward, the feature_mix_norm node runs first (fm_compress's output reaches the layer's output only
    through it): it leaves its x gradient here instead of returning it, and the fm_compress node's
    backward adds its own into that tensor (fm_compress_backward_accumulate) and returns the sum. x's
    gradient is written once, where the engine would hold both and add them. Each backward pass
    overwrites grad_x before the fm_compress node reads it.
    Measured (resid14, 2026-12-07; GEM small model's step, batch 256, 2 Wukong layers; link on/off switched
    per round of 8 batches in one process, SCHED_FIFO under the measuring lock, busy 2-core Xeon): profiler
    on, 2 threads: aten::add_ 6 -> 4 a step, 350 -> 132 us, and the fm_compress backward 647 us (fresh
    grad_x) -> 618 us (accumulating); profiler off, paired median of per-step differences: 2 threads wall
    -435 / -265 / -404 us (30 / 30 / 40 rounds; ratios 1.002 / 0.990 / 0.984 on a 29-31 ms step),
    1 thread CPU -254 / -876 / -717 us (14 / 14 / 16 rounds; 0.995 / 0.993 / 0.970 on 43-45 ms)."""

    __slots__ = ("x", "grad_x")

    def __init__(self):
        self.x = None  # the x the fm_compress node took; the mix node links only to the same tensor
        self.grad_x = None


def wukong_fm_compress(x: torch.Tensor, y: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                       eps: float, x_grad: WukongXGrad, *, backend: str | None = None) -> torch.Tensor:
    """``fm_compress(x, y, ln_weight, ln_bias, eps)`` for gk.nn.WukongLayer, whose output reaches the
    layer's output only through wukong_feature_mix_norm(..., x_grad=x_grad) on the same x.

    On the eager fast path (gem_kernels/_autograd.py) with a backend in ACCUMULATES_GRAD_X, x contiguous
    and requiring grad: one node whose backward adds its x gradient into feature_mix_norm's (see
    WukongXGrad). Elsewhere fm_compress, and the engine adds the two gradients."""
    tensors = (x, y, ln_weight, ln_bias)
    if (fast_paths_on() and eager_plain(tensors) and torch.is_grad_enabled() and x.requires_grad
            and x.is_contiguous()):
        ln_weight_, ln_bias_, name = _fm_compress_arguments(x, y, ln_weight, ln_bias, eps, backend)
        if name in ACCUMULATES_GRAD_X:
            x_grad.x = x
            return _FmCompressNode.apply(x, y.contiguous(), ln_weight_.contiguous(), ln_bias_.contiguous(),
                                         float(eps), name, x_grad)
    return fm_compress(x, y, ln_weight, ln_bias, eps, backend=backend)


class _FmCompressNode(torch.autograd.Function):
    """wukong_fm_compress's node: fm_compress's body forward; backward its x gradient added into the one
    the layer's feature_mix_norm node left in the link (or written fresh when that node did not link)."""

    @staticmethod
    def forward(ctx, x, y, ln_weight, ln_bias, eps, backend, x_grad):
        out, mean, rstd, products = kernel(FAMILY, "fm_compress", backend)(x, y, ln_weight, ln_bias, eps, True)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, y, ln_weight, mean, rstd, products)
        ctx.backend, ctx.x_grad = backend, x_grad
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, ctx.x_grad.grad_x = ctx.x_grad.grad_x, None
        if grad_out is None:
            return (grad_x,) + (None,) * 6
        x, y, ln_weight, mean, rstd, products = ctx.saved_tensors
        if grad_x is None:
            grad_x, dy, dw, db = kernel(FAMILY, "fm_compress_backward", ctx.backend)(
                grad_out.contiguous(), x, y, ln_weight, mean, rstd, products)
        else:
            dy, dw, db = kernel(FAMILY, "fm_compress_backward_accumulate", ctx.backend)(
                grad_out.contiguous(), x, y, ln_weight, mean, rstd, products, grad_x)
        return grad_x, dy, dw, db, None, None, None


def feature_mix_norm(x: torch.Tensor, mix: torch.Tensor, fm: torch.Tensor | None = None,
                     ln_weight: torch.Tensor | None = None, ln_bias: torch.Tensor | None = None, eps: float = 1e-5,
                     *, backend: str | None = None) -> torch.Tensor:
    """The output of a Wukong layer: ``LayerNorm_D(mix @ X + concat(fm, 0))``, in one pass.

    Per sample, ``s = mix @ x[b]`` [O, D] mixes the F input embeddings (Wukong's linear compress
    block and the residual projection, stacked as one [O, F] matrix: see WukongLayer.feature_mix);
    ``fm[b]`` (the factorization-machine block's O_fm output embeddings) is added to its first O_fm
    rows (the concat); then each of the O rows is layer-normed over the embedding dim D:
    ``out = (s - mean(s)) / sqrt(var(s) + eps) * ln_weight + ln_bias`` (biased variance, like
    torch.nn.LayerNorm(D)). Eager PyTorch runs this as a broadcast bmm, a pad, an add and a
    LayerNorm, each a pass over [B, O, D]; the fused backends read X and fm once and write the
    output once (and the backward recomputes s rather than keeping it). Matmuls and statistics in fp32.

    Args:
        x: [B, F, D] float32/float16/bfloat16. B = 0 and F = 1 are valid.
        mix: [O, F], x's dtype and device, O >= 1.
        fm: [B, O_fm, D] with 0 <= O_fm <= O, x's dtype and device; None means O_fm = 0.
        ln_weight: [D] LayerNorm scale, x's dtype and device; None means 1.
        ln_bias: [D] LayerNorm shift; None means 0.
        eps: LayerNorm epsilon, > 0.
        backend: "reference" | "cpu" | "cuda" | "triton" | "auto"; None uses ``use_backend``'s default.

    Returns:
        [B, O, D] in x's dtype; differentiable w.r.t. x, mix, fm, ln_weight and ln_bias.

    Under ``torch.autocast`` every operand is cast to the autocast dtype first.
    """
    x, mix, fm, ln_weight, ln_bias = autocast_operands(x, mix, fm, ln_weight, ln_bias)
    x, mix, fm, ln_weight, ln_bias, name = _feature_mix_norm_arguments(x, mix, fm, ln_weight, ln_bias, eps, backend)
    out, _mean, _rstd = feature_mix_norm_op(x, mix, fm, ln_weight, ln_bias, float(eps), name)
    return out


def _feature_mix_norm_arguments(x, mix, fm, ln_weight, ln_bias, eps, backend):
    """feature_mix_norm's checks: its operands as the op takes them (contiguous; fm [B, 0, D] for None, the
    LayerNorm's ones and zeros for None) and the concrete backend."""
    check_tensor("x", x, dtypes=float_dtypes(), dims=(3,))
    B, F, D = x.shape
    if F < 1 or D < 1:
        raise ValueError(f"x must have shape (B, F, D) with F >= 1 and D >= 1, got {tuple(x.shape)}")
    check_tensor("mix", mix, dims=(2,))
    if mix.shape[0] < 1:
        raise ValueError(f"mix must have shape (O, {F}) with O >= 1, got {tuple(mix.shape)}")
    _check_like("mix", mix, "x", x, (mix.shape[0], F))
    O = mix.shape[0]
    if fm is None:
        fm = x.new_empty((B, 0, D))
    else:
        check_tensor("fm", fm, dims=(3,))
        if not 0 <= fm.shape[1] <= O:
            raise ValueError(f"fm must have shape ({B}, O_fm, {D}) with O_fm <= {O} (mix's rows), "
                             f"got {tuple(fm.shape)}")
        _check_like("fm", fm, "x", x, (B, fm.shape[1], D))
    ln_weight, ln_bias = _layer_norm_params(x, D, ln_weight, ln_bias, eps)
    name = resolve_backend(backend, x.device, FAMILY)
    check_float64_on_reference(name, x=x)
    return x.contiguous(), mix.contiguous(), fm.contiguous(), ln_weight.contiguous(), ln_bias.contiguous(), name


def wukong_mix(residual_weight: torch.Tensor | None, lcb_weight: torch.Tensor, num_in: int,
               num_fm_out: int) -> torch.Tensor:
    """A Wukong layer's M [num_out, num_in] (gk.nn.WukongLayer.feature_mix): the residual projection (the
    identity for None) with lcb_weight [num_lcb_out, num_in] added to its last num_lcb_out rows. One add
    of the zero-padded LCB rows: two ops and a slice backward, where slicing, adding and concatenating
    the blocks is five ops forward and as many backward."""
    if residual_weight is None:
        residual_weight = torch.eye(num_in, dtype=lcb_weight.dtype, device=lcb_weight.device)
    if lcb_weight.shape[0] == 0:
        return residual_weight
    return residual_weight + torch.nn.functional.pad(lcb_weight, (0, 0, num_fm_out, 0))


def wukong_feature_mix_norm(x: torch.Tensor, residual_weight: torch.Tensor | None, lcb_weight: torch.Tensor,
                            fm: torch.Tensor | None, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float, *,
                            backend: str | None = None, x_grad: WukongXGrad | None = None) -> torch.Tensor:
    """``feature_mix_norm(x, wukong_mix(residual_weight, lcb_weight, F, O_fm), fm, ln_weight, ln_bias, eps)``
    (O_fm = fm.shape[1], 0 for None), differentiable w.r.t. residual_weight and lcb_weight themselves.

    On the eager fast path (gem_kernels/_autograd.py) it is one autograd node: M is built without autograd
    and its gradient split in the node's backward (d residual = dM, d lcb = its last rows), where the
    composition records an eye or nothing, a pad and an add forward and their two nodes backward. Elsewhere
    (compile, tracing, autocast, ...) it is that composition and feature_mix_norm.
    Measured (glue14, 2026-12-07; GEM small model's step, 2 Wukong layers, switched per round in one
    process, SCHED_FIFO, busy 2-core Xeon): batch 8, 1 thread, CPU -50 / -76 us a step (60 / 80 rounds,
    ratios 0.995 / 0.988); batch 256: +74 us at 2 threads (30 rounds, ratio 1.003), +25 us at 1 thread:
    within the noise there.
    x_grad: the link of wukong_fm_compress(x, ...) when fm came from it; on the fast path, with that node
    made on this same x, this node hands its x gradient to that node's backward (WukongXGrad)."""
    num_fm_out = 0 if fm is None else fm.shape[1]
    tensors = (x, residual_weight, lcb_weight, fm, ln_weight, ln_bias)
    if not (fast_paths_on() and eager_plain(tensors) and torch.is_grad_enabled() and any_requires_grad(*tensors)):
        return feature_mix_norm(x, wukong_mix(residual_weight, lcb_weight, x.shape[1], num_fm_out), fm, ln_weight,
                                ln_bias, eps, backend=backend)
    with torch.no_grad():
        mix = wukong_mix(residual_weight, lcb_weight, x.shape[1], num_fm_out)
    x_, mix, fm_, ln_weight_, ln_bias_, name = _feature_mix_norm_arguments(x, mix, fm, ln_weight, ln_bias, eps,
                                                                           backend)
    linked = x_grad if x_grad is not None and x_grad.x is x else None
    if x_grad is not None:
        x_grad.x = None  # the link keeps no tensor alive beyond the forward
    return _WukongMixNormNode.apply(x_, mix, fm_, ln_weight_, ln_bias_, float(eps), name, residual_weight,
                                    lcb_weight, num_fm_out, linked)


class _WukongMixNormNode(torch.autograd.Function):
    """wukong_feature_mix_norm's one node: feature_mix_norm's body forward, its backward op's body and the
    split of dM backward (no gradient for mix itself: it is built from residual_weight and lcb_weight)."""

    @staticmethod
    def forward(ctx, x, mix, fm, ln_weight, ln_bias, eps, backend, residual_weight, lcb_weight, num_fm_out, x_grad):
        out, mean, rstd = kernel(FAMILY, "feature_mix_norm", backend)(x, mix, fm, ln_weight, ln_bias, eps)
        ctx.save_for_backward(x, mix, fm, ln_weight, mean, rstd)
        ctx.backend, ctx.num_fm_out, ctx.has_residual = backend, num_fm_out, residual_weight is not None
        ctx.fm_given, ctx.has_lcb = fm.shape[1] > 0, lcb_weight.shape[0] > 0  # as wukong_mix: no rows, not used
        ctx.x_grad = x_grad
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, mix, fm, ln_weight, mean, rstd = ctx.saved_tensors
        dx, dmix, dfm, dln_weight, dln_bias = kernel(FAMILY, "feature_mix_norm_backward", ctx.backend)(
            grad_out.contiguous(), x, mix, fm, ln_weight, mean, rstd)
        dlcb = None
        if ctx.has_lcb:
            # Not a view of the residual's gradient: AccumulateGrad may keep both as the .grad tensors and
            # add the next step's in place (the dispatcher path's pad backward copies the rows as well).
            dlcb = dmix[ctx.num_fm_out:].clone() if ctx.has_residual else dmix[ctx.num_fm_out:]
        if ctx.x_grad is not None:
            ctx.x_grad.grad_x, dx = dx, None  # the fm_compress node adds its own and returns the sum
        return (dx, None, dfm if ctx.fm_given else None, dln_weight, dln_bias, None, None,
                dmix if ctx.has_residual else None, dlcb, None, None)

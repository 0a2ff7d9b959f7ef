"""Jagged <-> padded conversions: the front door (validation, torch.library ops, fake kernels, autograd).

A jagged batch packs B variable-length sequences back to back: values [N, *feat] with offsets
[B+1] (int32/int64, offsets[0] == 0, nondecreasing, offsets[-1] == N); sequence b is
values[offsets[b] : offsets[b+1]]. This is FBGEMM's jagged layout and TorchRec's KJT values/offsets.
"""

from __future__ import annotations

import torch

from .._autograd import register_autograd
from .._backend import kernel, resolve_backend
from .._validate import (
    FLOAT_DTYPES,
    check_nonnegative_int,
    check_offsets_meta,
    check_offsets_values,
    check_pad_value,
    check_same_device,
    check_tensor,
    float_dtypes,
    offsets_summary,
)

FAMILY = "jagged"


# ---------------------------------------------------------------------------------------------
# torch.library ops. Feature dims are flattened to one: values [N, D], padded [B, max_len, D].
# `backend` is a concrete backend name, resolved by the public functions below. The forward ops
# read the offsets once (one sync on a GPU); the backward ops run on the offsets the forward checked
# and read nothing. The two conversions are each other's adjoint, so each backward op is the other
# conversion's kernel, and the backward ops are each other's gradient (double backward).
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("gem_kernels::jagged_to_padded", mutates_args=())
def jagged_to_padded_op(values: torch.Tensor, offsets: torch.Tensor, max_len: int, pad_value: float,
                        backend: str) -> torch.Tensor:
    check_offsets_values("offsets", offsets, values.shape[0])
    return kernel(FAMILY, "jagged_to_padded", backend)(values, offsets, max_len, pad_value)


@jagged_to_padded_op.register_fake
def _jagged_to_padded_fake(values, offsets, max_len, pad_value, backend):
    return values.new_empty((offsets.shape[0] - 1, max_len, values.shape[1]))


@torch.library.custom_op("gem_kernels::padded_to_jagged", mutates_args=())
def padded_to_jagged_op(padded: torch.Tensor, offsets: torch.Tensor, total_len: int, backend: str) -> torch.Tensor:
    """total_len = -1 reads it from offsets[-1] (a data-dependent size under torch.compile), in the
    same copy as the checks."""
    summary = offsets_summary(offsets).tolist()
    check_offsets_values("offsets", offsets, total_len if total_len >= 0 else None, summary)
    if total_len < 0:
        total_len = summary[2]
    return kernel(FAMILY, "padded_to_jagged", backend)(padded, offsets, total_len)


@padded_to_jagged_op.register_fake
def _padded_to_jagged_fake(padded, offsets, total_len, backend):
    if total_len < 0:
        total_len = torch.library.get_ctx().new_dynamic_size()
    return padded.new_empty((total_len, padded.shape[2]))


@torch.library.custom_op("gem_kernels::jagged_to_padded_backward", mutates_args=())
def jagged_to_padded_backward_op(grad_padded: torch.Tensor, offsets: torch.Tensor, total_len: int,
                                 backend: str) -> torch.Tensor:
    """grad values [total_len, D]: padded_to_jagged of grad_padded, on the forward's checked offsets."""
    return kernel(FAMILY, "padded_to_jagged", backend)(grad_padded, offsets, total_len)


@jagged_to_padded_backward_op.register_fake
def _jagged_to_padded_backward_fake(grad_padded, offsets, total_len, backend):
    return grad_padded.new_empty((total_len, grad_padded.shape[2]))


@torch.library.custom_op("gem_kernels::padded_to_jagged_backward", mutates_args=())
def padded_to_jagged_backward_op(grad_values: torch.Tensor, offsets: torch.Tensor, max_len: int,
                                 backend: str) -> torch.Tensor:
    """grad padded [B, max_len, D]: jagged_to_padded of grad_values (pad 0), on the forward's checked offsets."""
    return kernel(FAMILY, "jagged_to_padded", backend)(grad_values, offsets, max_len, 0.0)


@padded_to_jagged_backward_op.register_fake
def _padded_to_jagged_backward_fake(grad_values, offsets, max_len, backend):
    return grad_values.new_empty((offsets.shape[0] - 1, max_len, grad_values.shape[1]))


def _setup_values_input(ctx, inputs, output):
    """setup_context of the ops whose input is values [N, D] (jagged_to_padded, padded_to_jagged_backward)."""
    ctx.save_for_backward(inputs[1])
    ctx.total_len, ctx.backend, ctx.num_inputs = inputs[0].shape[0], inputs[-1], len(inputs)


def _setup_padded_input(ctx, inputs, output):
    """setup_context of the ops whose input is padded [B, max_len, D] (padded_to_jagged, jagged_to_padded_backward)."""
    ctx.save_for_backward(inputs[1])
    ctx.max_len, ctx.backend, ctx.num_inputs = inputs[0].shape[1], inputs[-1], len(inputs)


def _grad_values(ctx, grad_padded):
    (offsets,) = ctx.saved_tensors
    grad = jagged_to_padded_backward_op(grad_padded.contiguous(), offsets, ctx.total_len, ctx.backend)
    return (grad,) + (None,) * (ctx.num_inputs - 1)


def _grad_padded(ctx, grad_values):
    (offsets,) = ctx.saved_tensors
    grad = padded_to_jagged_backward_op(grad_values.contiguous(), offsets, ctx.max_len, ctx.backend)
    return (grad,) + (None,) * (ctx.num_inputs - 1)


register_autograd(jagged_to_padded_op, _grad_values, setup_context=_setup_values_input)
register_autograd(padded_to_jagged_op, _grad_padded, setup_context=_setup_padded_input)
register_autograd(jagged_to_padded_backward_op, _grad_padded, setup_context=_setup_padded_input)
register_autograd(padded_to_jagged_backward_op, _grad_values, setup_context=_setup_values_input)


# jagged_broadcast_cat and its backward: each other's adjoint (the backward's gradient is the forward
# again), like the two conversions above. A CPU native pass (csrc/cpu/jagged.cpp) where the extension
# has it, the reference twin on every other device (a copy and a segment sum: index work, no kernel worth
# a GPU launch per op of its own).
_BROADCAST_CAT_NATIVE = hasattr(torch.ops.gem_kernels, "jagged_broadcast_cat_native")


@torch.library.custom_op("gem_kernels::jagged_broadcast_cat", mutates_args=())
def jagged_broadcast_cat_op(dense: torch.Tensor, offsets: torch.Tensor, jagged: torch.Tensor) -> torch.Tensor:
    if _BROADCAST_CAT_NATIVE and dense.is_cpu and offsets.is_cpu and jagged.is_cpu:
        return torch.ops.gem_kernels.jagged_broadcast_cat_native(dense, offsets, jagged)
    from ..reference.jagged import jagged_broadcast_cat as reference

    check_offsets_values("offsets", offsets, jagged.shape[0])
    return reference(dense, offsets, jagged)


@jagged_broadcast_cat_op.register_fake
def _jagged_broadcast_cat_fake(dense, offsets, jagged):
    return dense.new_empty((jagged.shape[0], dense.shape[1] + jagged.shape[1]))


@torch.library.custom_op("gem_kernels::jagged_broadcast_cat_backward", mutates_args=())
def jagged_broadcast_cat_backward_op(grad: torch.Tensor, offsets: torch.Tensor,
                                     dense_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    if _BROADCAST_CAT_NATIVE and grad.is_cpu and offsets.is_cpu:
        return torch.ops.gem_kernels.jagged_broadcast_cat_backward_native(grad, offsets, dense_width)
    from ..reference.jagged import jagged_broadcast_cat_backward as reference

    return reference(grad, offsets, dense_width)


@jagged_broadcast_cat_backward_op.register_fake
def _jagged_broadcast_cat_backward_fake(grad, offsets, dense_width):
    return (grad.new_empty((offsets.shape[0] - 1, dense_width)),
            grad.new_empty((grad.shape[0], grad.shape[1] - dense_width)))


def _setup_broadcast_cat(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.dense_width = inputs[0].shape[1]


def _grad_broadcast_cat(ctx, grad):
    (offsets,) = ctx.saved_tensors
    grad_dense, grad_jagged = jagged_broadcast_cat_backward_op(grad.contiguous(), offsets, ctx.dense_width)
    return grad_dense, None, grad_jagged


def _setup_broadcast_cat_backward(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _grad_broadcast_cat_backward(ctx, grad_dense, grad_jagged):
    (offsets,) = ctx.saved_tensors
    return jagged_broadcast_cat_op(grad_dense.contiguous(), offsets, grad_jagged.contiguous()), None, None


register_autograd(jagged_broadcast_cat_op, _grad_broadcast_cat, setup_context=_setup_broadcast_cat)
register_autograd(jagged_broadcast_cat_backward_op, _grad_broadcast_cat_backward,
                  setup_context=_setup_broadcast_cat_backward)


# Fake kernels for the native schemas (csrc/ops.cpp), so opcheck and tracing see them too.
if hasattr(torch.ops.gem_kernels, "jagged_to_padded_native"):

    @torch.library.register_fake("gem_kernels::jagged_to_padded_native")
    def _jagged_to_padded_native_fake(values, offsets, max_len, pad_value):
        return values.new_empty((offsets.shape[0] - 1, max_len, values.shape[1]))

    @torch.library.register_fake("gem_kernels::padded_to_jagged_native")
    def _padded_to_jagged_native_fake(padded, offsets, total_len):
        return padded.new_empty((total_len, padded.shape[2]))

if hasattr(torch.ops.gem_kernels, "jagged_broadcast_cat_native"):

    @torch.library.register_fake("gem_kernels::jagged_broadcast_cat_native")
    def _jagged_broadcast_cat_native_fake(dense, offsets, jagged):
        return _jagged_broadcast_cat_fake(dense, offsets, jagged)

    @torch.library.register_fake("gem_kernels::jagged_broadcast_cat_backward_native")
    def _jagged_broadcast_cat_backward_native_fake(grad, offsets, dense_width):
        return _jagged_broadcast_cat_backward_fake(grad, offsets, dense_width)

if hasattr(torch.ops.gem_kernels, "hstu_sequence_layout_native"):

    @torch.library.register_fake("gem_kernels::hstu_sequence_layout_native")
    def _hstu_sequence_layout_native_fake(history_offsets, num_candidates, request_timestamps, history_timestamps,
                                          contextual_len, num_rows):
        num_users = num_candidates.shape[0]
        total = num_users * contextual_len + history_timestamps.shape[0] + num_rows
        new = history_offsets.new_empty
        return new((num_users + 1,)), new((total,)), new((num_rows,)), new((total,)), new((total,))


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int, pad_value: float = 0.0, *,
                     backend: str | None = None) -> torch.Tensor:
    """Pad a jagged batch into a dense [B, max_len, *feat] tensor.

    ``padded[b, p] = values[offsets[b] + p]`` for ``p < min(L_b, max_len)`` and ``pad_value`` after,
    with ``L_b = offsets[b+1] - offsets[b]``; sequences longer than ``max_len`` are truncated.
    Follows FBGEMM's ``jagged_to_padded_dense`` (one jagged dim).

    Args:
        values: [N] or [N, D], float32/float16/bfloat16.
        offsets: [B+1] int32/int64 on values' device; offsets[0] == 0, nondecreasing, offsets[-1] == N.
            B = 0 (offsets == [0]) and zero-length sequences are valid.
        max_len: padded length, >= 0.
        pad_value: value of the positions past each sequence's end; a finite value must lie within
            values' dtype's range (ValueError otherwise, on every backend); +-inf and NaN are allowed.
        backend: "reference" | "cpu" | "cuda" | "triton" | "auto"; None uses ``use_backend``'s default.

    Returns:
        [B, max_len] or [B, max_len, D], values' dtype. Differentiable w.r.t. values (the backward is
        ``padded_to_jagged``).
    """
    check_tensor("values", values, dtypes=FLOAT_DTYPES, dims=(1, 2))
    check_offsets_meta("offsets", offsets)
    check_same_device(values=values, offsets=offsets)
    check_nonnegative_int("max_len", max_len)
    check_pad_value("pad_value", pad_value, values.dtype)
    name = resolve_backend(backend, values.device, FAMILY)
    flat = (values.unsqueeze(1) if values.dim() == 1 else values).contiguous()
    padded = jagged_to_padded_op(flat, offsets.contiguous(), max_len, float(pad_value), name)
    return padded.squeeze(-1) if values.dim() == 1 else padded


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total_len: int | None = None, *,
                     backend: str | None = None) -> torch.Tensor:
    """Pack a dense [B, max_len, *feat] tensor into a jagged batch: the inverse of ``jagged_to_padded``.

    ``values[offsets[b] + p] = padded[b, p]`` for ``p < min(L_b, max_len)``; rows of sequences longer
    than max_len, which ``jagged_to_padded`` truncated away, are zero. Follows FBGEMM's
    ``dense_to_jagged``.

    Args:
        padded: [B, max_len] or [B, max_len, D], float32/float16/bfloat16.
        offsets: [B+1] int32/int64 on padded's device, as in ``jagged_to_padded``.
        total_len: N = offsets[-1] when the caller knows it (saves a device sync; checked).
        backend: as in ``jagged_to_padded``.

    Returns:
        values [N] or [N, D]. Differentiable w.r.t. padded (the backward is ``jagged_to_padded``).
    """
    check_tensor("padded", padded, dtypes=FLOAT_DTYPES, dims=(2, 3))
    check_offsets_meta("offsets", offsets)
    check_same_device(padded=padded, offsets=offsets)
    if padded.shape[0] != offsets.shape[0] - 1:
        raise ValueError(
            f"offsets must have padded.shape[0] + 1 = {padded.shape[0] + 1} elements, got {offsets.shape[0]}"
        )
    if total_len is not None:
        check_nonnegative_int("total_len", total_len)
    name = resolve_backend(backend, padded.device, FAMILY)
    flat = (padded.unsqueeze(2) if padded.dim() == 2 else padded).contiguous()
    values = padded_to_jagged_op(flat, offsets.contiguous(), -1 if total_len is None else total_len, name)
    return values.squeeze(-1) if padded.dim() == 2 else values


def hstu_sequence_layout(history_offsets: torch.Tensor, num_candidates: torch.Tensor,
                         request_timestamps: torch.Tensor, history_timestamps: torch.Tensor, contextual_len: int,
                         num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each row of the jagged HSTU input comes from, for B users whose sequence b is
    [contextual_len context rows, its L_b history items, its K_b candidates] (generative-recommenders'
    layout with contextual tokens and candidates as targets).

    The source rows are [every user's context rows (user-major); the history, back to back; the
    candidates, back to back]: ``x = empty(N, D).index_copy_(0, rows, cat([context, history, candidates]))``
    builds the sequences (N = B*c + S + R).

    Args:
        history_offsets: [B+1] integer, history_offsets[0] == 0, nondecreasing, history_offsets[-1] == S.
        num_candidates: [B] integer >= 0 (K_b), summing to num_rows.
        request_timestamps: [B] integer, the time of user b's context and candidate rows.
        history_timestamps: [S] integer, the history items' times.
        contextual_len: c >= 0.
        num_rows: R, the number of candidates (a Python int: every output size is static).

    Returns:
        (seq_offsets [B+1], rows [N] (the destination row of each source row), candidate_owner [R] (the
        user of each candidate), timestamps [N], query_timestamps [N]), on the inputs' device. Timestamps
        in sequence order: a history row's own, the request's for context and candidate rows; query
        timestamps equal them except on history rows, which take the next history item's (the request's
        for the user's last one), as generative-recommenders' RelativeBucketedTimeAndPositionBasedBias
        buckets ts(next item) - ts(key).

    CPU int64 tensors run one native pass (csrc/cpu/jagged.cpp; it checks the offsets and sums and raises
    ValueError); other devices and dtypes run ``gem_kernels.reference.jagged.hstu_sequence_layout``
    (plain PyTorch, no value checks: on a GPU they would be host syncs).
    """
    tensors = dict(history_offsets=history_offsets, num_candidates=num_candidates,
                   request_timestamps=request_timestamps, history_timestamps=history_timestamps)
    for name, t in tensors.items():
        check_tensor(name, t, dtypes=(torch.int32, torch.int64), dims=(1,))
    check_same_device(**tensors)
    check_nonnegative_int("contextual_len", contextual_len)
    check_nonnegative_int("num_rows", num_rows)
    num_users = num_candidates.shape[0]
    if history_offsets.shape[0] != num_users + 1 or request_timestamps.shape[0] != num_users:
        raise ValueError(f"history_offsets must have B+1 = {num_users + 1} and request_timestamps B = {num_users} "
                         f"elements (B = num_candidates.shape[0]), got {history_offsets.shape[0]} and "
                         f"{request_timestamps.shape[0]}")
    if history_offsets.is_cpu and all(t.dtype == torch.int64 for t in tensors.values()) \
            and hasattr(torch.ops.gem_kernels, "hstu_sequence_layout_native"):
        return torch.ops.gem_kernels.hstu_sequence_layout_native(history_offsets, num_candidates, request_timestamps,
                                                                 history_timestamps, contextual_len, num_rows)
    from ..reference.jagged import hstu_sequence_layout as reference

    return reference(history_offsets, num_candidates, request_timestamps, history_timestamps, contextual_len,
                     num_rows)


def jagged_broadcast_cat(dense: torch.Tensor, offsets: torch.Tensor, jagged: torch.Tensor) -> torch.Tensor:
    """Each jagged row prefixed with its sequence's dense row:
    ``out[n] = cat(dense[b], jagged[n])`` for ``n in offsets[b] : offsets[b+1]``.

    The backward sums each sequence's gradient rows into dense's gradient (a segment sum, in row order,
    fp32 accumulation for half and bfloat16: generative-recommenders' jagged_reduce_sum of a dense
    broadcast) and hands jagged its own columns. ``jagged`` of width 0 is a plain broadcast of dense's
    rows to their sequences' rows (``dense.repeat_interleave(lengths, 0)``, whose ATen backward is an
    index_add). A zero-length sequence takes no row and gets a zero gradient.

    Args:
        dense: [B, K] float32/float16/bfloat16 (and float64 inside float64_ground_truth()).
        offsets: [B+1] int32/int64 on dense's device; offsets[0] == 0, nondecreasing, offsets[-1] == N
            (ValueError otherwise).
        jagged: [N, S] float on dense's device (S may be 0).

    Returns:
        [N, K + S] of dense's and jagged's promoted dtype (as torch.cat promotes: under autocast the fp32
        dense rows and bf16 jagged rows give fp32), differentiable w.r.t. dense and jagged.

    CPU tensors run one native pass each way (csrc/cpu/jagged.cpp; it checks the offsets' values); other
    devices run ``gem_kernels.reference.jagged.jagged_broadcast_cat`` (plain PyTorch).
    """
    check_tensor("dense", dense, dtypes=float_dtypes(), dims=(2,))
    check_tensor("jagged", jagged, dtypes=float_dtypes(), dims=(2,))
    check_offsets_meta("offsets", offsets)
    check_same_device(dense=dense, offsets=offsets, jagged=jagged)
    if offsets.shape[0] != dense.shape[0] + 1:
        raise ValueError(f"offsets must have dense.shape[0] + 1 = {dense.shape[0] + 1} elements, "
                         f"got {offsets.shape[0]}")
    dtype = torch.promote_types(dense.dtype, jagged.dtype)
    return jagged_broadcast_cat_op(dense.to(dtype).contiguous(), offsets.contiguous(), jagged.to(dtype).contiguous())

"""Cached (delta) jagged attention for inference: new query rows against a sequence's whole K/V.

generative-recommenders' `delta_hstu_mha` layout: delta_q [B * delta, H, D] holds the queries of the
last `delta` rows of every sequence (delta the same for every sequence), k [N, H, D] and v [N, H, Dv]
the whole sequences (the cached rows followed by the delta rows' own k/v). The result is those rows of
the full causal `jagged_attention`, at delta * L work per sequence instead of L^2.

Forward only (serving): the op has no backward, and asking for one raises.
"""

from __future__ import annotations

import torch

from .._autocast import run_kernels_without_autocast
from .._backend import Family, _on_device_of_inputs, resolve_backend
from .._validate import check_float64_on_reference, check_nonnegative_int
from .attention import KINDS, _check_values, _round_to_fp32, check_operands, check_options


def _reference_cached_attention():
    from ..reference import cached_attention
    return cached_attention


def _triton_cached_attention():
    from ..triton import attention
    return attention


# Its own Family (the attention family's backward ops have no cached twin): every backend, `auto` on CUDA
# tensors in the attention family's order (triton's tiles run on the tensor cores, see _backend.FAMILIES).
FAMILY = Family(_reference_cached_attention, _triton_cached_attention, auto_cuda=("triton", "cuda"))


@torch.library.custom_op("gem_kernels::cached_jagged_attention_fwd", mutates_args=())
def cached_jagged_attention_fwd_op(delta_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   seq_offsets: torch.Tensor, max_seq_len: int, kind: str, scale: float,
                                   num_targets: torch.Tensor | None, contextual_len: int, max_attn_len: int,
                                   pos_bias: torch.Tensor | None, time_bias: torch.Tensor | None,
                                   timestamps: torch.Tensor | None, query_timestamps: torch.Tensor | None,
                                   backend: str) -> torch.Tensor:
    """out [B * delta, H, Dv] in delta_q's dtype."""
    num_seqs = seq_offsets.shape[0] - 1
    _check_values(k, seq_offsets, max_seq_len, num_targets, delta=delta_q.shape[0] // num_seqs if num_seqs else 0)
    if backend in ("cpu", "cuda"):
        run = torch.ops.gem_kernels.cached_jagged_attention_fwd_native
    elif backend == "triton":
        run = _on_device_of_inputs(FAMILY.module(backend).cached_jagged_attention_fwd)
    else:
        run = FAMILY.module(backend).cached_jagged_attention_fwd
    return run(delta_q, k, v, seq_offsets, max_seq_len, kind, scale, num_targets, contextual_len, max_attn_len,
               pos_bias, time_bias, timestamps, query_timestamps)


def _cached_fwd_fake(delta_q, k, v, seq_offsets, max_seq_len, kind, scale, num_targets, contextual_len, max_attn_len,
                     pos_bias, time_bias, timestamps, query_timestamps, backend=None):
    return delta_q.new_empty((delta_q.shape[0], delta_q.shape[1], v.shape[2]))


cached_jagged_attention_fwd_op.register_fake(_cached_fwd_fake)


def _no_backward(ctx, grad_out):
    raise RuntimeError("cached_jagged_attention is forward-only (serving): it has no backward. Train with "
                       "gem_kernels.jagged_attention, and run the cached op under torch.no_grad() or "
                       "torch.inference_mode()")


cached_jagged_attention_fwd_op.register_autograd(_no_backward)
run_kernels_without_autocast(cached_jagged_attention_fwd_op)

if hasattr(torch.ops.gem_kernels, "cached_jagged_attention_fwd_native"):
    torch.library.register_fake("gem_kernels::cached_jagged_attention_fwd_native")(_cached_fwd_fake)


def cached_jagged_attention(delta_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                            max_seq_len: int, kind: str = "hstu", num_targets: torch.Tensor | None = None,
                            contextual_len: int = 0, max_attn_len: int = 0, pos_bias: torch.Tensor | None = None,
                            time_bias: torch.Tensor | None = None, timestamps: torch.Tensor | None = None,
                            query_timestamps: torch.Tensor | None = None, *, scale: float | None = None,
                            backend: str | None = None) -> torch.Tensor:
    """The last `delta` rows of causal `jagged_attention`, from their queries and the whole sequences' K/V.

    With L = the length of sequence b and delta = delta_q.shape[0] // B, query row t of sequence b is
    position i = L - delta + t of that sequence, and::

        out[b * delta + t] = jagged_attention(q, k, v, seq_offsets, max_seq_len, causal=True, ...)[start_b + i]

    for any q whose rows start_b + L - delta + t are delta_q's (the other rows of q do not enter them):
    the same scores, biases (pos_bias[h, j - i + max_seq_len - 1], time_bias[h, bucket(tq_i - t_j)]),
    visibility rule (num_targets, contextual_len, max_attn_len count over the whole sequence), NaN/Inf
    rule and HSTU normaliser max_seq_len as `jagged_attention` (see there). This is
    generative-recommenders' `delta_hstu_mha` (`pytorch_cached_hstu_mha`), with softmax as well.
    M-FALCON ranking appends m candidates as the delta rows with num_targets = m: each sees the history
    and itself, never another candidate.

    Args:
        delta_q: [B * delta, H, Dqk] float32/float16/bfloat16, the queries of the last delta rows of every
            sequence, sequence-major.
        k: [N, H, Dqk]; v: [N, H, Dv]: the whole sequences (cached rows and the delta rows), delta_q's dtype.
        seq_offsets: [B+1] int32/int64 over k's rows; every sequence has length >= delta. B = 0 is valid
            (delta_q must then have 0 rows).
        max_seq_len: >= every sequence length; the HSTU normaliser and the pos_bias width.
        kind: "hstu" | "softmax".
        num_targets, contextual_len, max_attn_len, pos_bias, time_bias, timestamps: as in
            `jagged_attention`, over the whole sequences (timestamps [N], one per key row).
        query_timestamps: [B * delta] int32/int64, tq of the delta rows, or None (= their timestamps).
        scale: multiplies <q, k>; default 1 / sqrt(Dqk) (generative-recommenders' alpha).
        backend: "reference" | "cpu" | "cuda" | "triton" | "auto" (None: ``use_backend``'s default); "auto"
            takes triton (then cuda) on CUDA tensors, cpu on CPU tensors.

    Returns:
        out [B * delta, H, Dv] in delta_q's dtype, accumulated in fp32. Forward only: a backward through
        it raises RuntimeError.
    """
    delta_q, k, v = check_operands("delta_q", delta_q, k, v, seq_offsets)
    if k.shape[1:] != delta_q.shape[1:]:
        raise ValueError(f"k must have shape [N, H, Dqk] = [N, {delta_q.shape[1]}, {delta_q.shape[2]}] like "
                         f"delta_q, got {tuple(k.shape)}")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v must have shape [N, H, Dv] = [{k.shape[0]}, {k.shape[1]}, Dv], got {tuple(v.shape)}")
    if delta_q.shape[2] < 1 or v.shape[2] < 1:
        raise ValueError(f"head dims must be >= 1, got delta_q {tuple(delta_q.shape)} and v {tuple(v.shape)}")
    num_seqs = seq_offsets.shape[0] - 1
    if num_seqs == 0 and delta_q.shape[0] != 0:
        raise ValueError(f"delta_q must have 0 rows when B = 0, got shape {tuple(delta_q.shape)}")
    if num_seqs > 0 and delta_q.shape[0] % num_seqs != 0:
        raise ValueError(f"delta_q must have B * delta rows (B = {num_seqs}, delta the same for every sequence), "
                         f"got {delta_q.shape[0]} rows")
    check_nonnegative_int("max_seq_len", max_seq_len)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if scale is None:
        scale = delta_q.shape[2] ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float or None, got {type(scale).__name__}")
    num_targets, pos_bias, time_bias, timestamps, query_timestamps = check_options(
        delta_q, k.shape[0], num_seqs, max_seq_len, contextual_len, max_attn_len, num_targets, pos_bias, time_bias,
        timestamps, query_timestamps, query_rows_name="B * delta")
    name = resolve_backend(backend, delta_q.device, FAMILY)
    check_float64_on_reference(name, delta_q=delta_q, pos_bias=pos_bias, time_bias=time_bias)
    return cached_jagged_attention_fwd_op(delta_q.contiguous(), k.contiguous(), v.contiguous(),
                                          seq_offsets.contiguous(), max_seq_len, kind,
                                          float(_round_to_fp32(float(scale))), num_targets, contextual_len,
                                          max_attn_len, pos_bias, time_bias, timestamps, query_timestamps, name)

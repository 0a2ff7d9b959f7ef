"""Jagged attention (softmax and HSTU): the front door (validation, torch.library ops, fake kernels, autograd).

q, k [N, H, Dqk] and v [N, H, Dv] pack B sequences back to back (FBGEMM's jagged layout):
sequence b is rows seq_offsets[b] : seq_offsets[b+1]. Attention runs within each sequence only.
"""

from __future__ import annotations

import math
import struct

import torch

from .._autograd import register_autograd
from .._autocast import autocast_operands, run_kernels_without_autocast
from .._backend import FAMILIES, kernel, resolve_backend
from .._validate import (
    INDEX_DTYPES,
    check_float64_on_reference,
    check_nonnegative_int,
    check_offsets_meta,
    check_offsets_values,
    offsets_summary,
    check_same_device,
    check_tensor,
    float_dtypes,
)

FAMILY = "attention"
KINDS = ("softmax", "hstu")
# Backends and `auto`'s preference (triton before cuda on CUDA tensors, and why): _backend.FAMILIES.
IMPLEMENTED = FAMILIES[FAMILY].implemented


try:
    from .._C import jagged_offsets_summary as _summary_native
except ImportError:  # no extension (the reference and triton backends still run), or an older build
    _summary_native = None


def _check_values(q, seq_offsets, max_seq_len, num_targets, delta: int = 0) -> None:
    """Data-dependent checks (read the tensors): run in the forward op's real kernel only, never while
    tracing, and not again in the backward, which runs on the tensors the forward saw
    (docs/op-flow.md, "checks once per step"). Everything is read in one device-to-host copy; an
    error reads more to word its message. q: the rows tensor ([N, ...]); delta > 0 (the cached op):
    every sequence must also hold its delta query rows."""
    lengths = None  # [B] int64: built here on the ATen path, only to word an error on the native one
    has_targets = num_targets is not None and num_targets.numel() > 0
    if _summary_native is not None and seq_offsets.is_cpu and (not has_targets or num_targets.is_cpu):
        # The same six numbers in one C++ pass (~40 us of small ATen ops a call otherwise: the GEM
        # model's layers call this twice a step; serving once a request and layer).
        first, decreasing, last, longest, shortest, num_bad = _summary_native(
            seq_offsets, num_targets if has_targets else None)
    else:
        lengths = seq_offsets.long().diff()
        zero = lengths.new_zeros(())
        longest = lengths.max() if lengths.numel() > 0 else zero
        shortest = lengths.min() if lengths.numel() > 0 else zero
        bad = ((num_targets.long() < 0) | (num_targets.long() > lengths)) if has_targets else None
        summary = torch.cat([offsets_summary(seq_offsets),
                             torch.stack([longest, shortest, bad.sum() if has_targets else zero])])
        first, decreasing, last, longest, shortest, num_bad = summary.tolist()
    check_offsets_values("seq_offsets", seq_offsets, q.shape[0], summary=[first, decreasing, last])
    num_seqs = seq_offsets.shape[0] - 1
    if lengths is None and ((num_seqs > 0 and shortest < delta) or longest > max_seq_len or num_bad):
        lengths = seq_offsets.long().diff()  # an error follows: read the lengths to word it
    if num_seqs > 0 and shortest < delta:
        b = int((lengths < delta).nonzero()[0, 0])
        raise ValueError(f"every sequence must hold its delta = {delta} query rows (delta_q has B * delta rows), "
                         f"but sequence {b} has length {int(lengths[b])}")
    if longest > max_seq_len:
        raise ValueError(f"max_seq_len must be >= every sequence length, got {max_seq_len} < {longest}")
    if num_bad:
        b = int(((num_targets.long() < 0) | (num_targets.long() > lengths)).nonzero()[0, 0])
        raise ValueError(f"num_targets[{b}] must be in [0, {int(lengths[b])}] (its sequence length), "
                         f"got {int(num_targets[b])}")


# ---------------------------------------------------------------------------------------------
# torch.library ops. `backend` is a concrete backend name, resolved by the public function.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("gem_kernels::jagged_attention_fwd", mutates_args=())
def jagged_attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                            max_seq_len: int, kind: str, causal: bool, scale: float,
                            num_targets: torch.Tensor | None, contextual_len: int, max_attn_len: int,
                            pos_bias: torch.Tensor | None, time_bias: torch.Tensor | None,
                            timestamps: torch.Tensor | None, query_timestamps: torch.Tensor | None,
                            deterministic: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, H, Dv] in q's dtype, lse [N, H] fp32 softmax log-sum-exp; empty [0] for hstu).

    `deterministic` is only carried to the backward.
    """
    _check_values(q, seq_offsets, max_seq_len, num_targets)
    out, lse = kernel(FAMILY, "jagged_attention_fwd", backend)(
        q, k, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len, max_attn_len,
        pos_bias, time_bias, timestamps, query_timestamps)
    return out, lse


def _jagged_attention_fwd_fake(q, k, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len, max_attn_len,
              pos_bias, time_bias, timestamps, query_timestamps, deterministic=False, backend=None):
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    lse = q.new_empty((q.shape[0], q.shape[1]) if kind == "softmax" else (0,), dtype=torch.float32)
    return out, lse


jagged_attention_fwd_op.register_fake(_jagged_attention_fwd_fake)


@torch.library.custom_op("gem_kernels::jagged_attention_bwd", mutates_args=())
def jagged_attention_bwd_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int,
                            kind: str, causal: bool, scale: float, num_targets: torch.Tensor | None,
                            contextual_len: int, max_attn_len: int, pos_bias: torch.Tensor | None,
                            time_bias: torch.Tensor | None, timestamps: torch.Tensor | None,
                            query_timestamps: torch.Tensor | None, deterministic: bool,
                            backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor]:
    """(dq, dk, dv, dpos_bias, dtime_bias); an absent bias gets an empty [0] gradient.

    No value checks: the forward op checked these very tensors (autograd saved them)."""
    return tuple(kernel(FAMILY, "jagged_attention_bwd", backend)(
        grad_out, q, k, v, out, lse, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len,
        max_attn_len, pos_bias, time_bias, timestamps, query_timestamps, deterministic))


def _jagged_attention_bwd_fake(grad_out, q, k, v, out, lse, seq_offsets, max_seq_len, kind, causal, scale, num_targets,
              contextual_len, max_attn_len, pos_bias, time_bias, timestamps, query_timestamps, deterministic,
              backend=None):
    dpos = torch.empty_like(pos_bias) if pos_bias is not None else q.new_empty((0,))
    dtime = torch.empty_like(time_bias) if time_bias is not None else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dpos, dtime


jagged_attention_bwd_op.register_fake(_jagged_attention_bwd_fake)


def _setup(ctx, inputs, output):
    (q, k, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len, max_attn_len, pos_bias,
     time_bias, timestamps, query_timestamps, deterministic, backend) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seq_offsets, num_targets, pos_bias, time_bias, timestamps,
                          query_timestamps)
    ctx.args = (max_seq_len, kind, causal, scale, contextual_len, max_attn_len, backend)
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, seq_offsets, num_targets, pos_bias, time_bias, timestamps, query_timestamps = ctx.saved_tensors
    max_seq_len, kind, causal, scale, contextual_len, max_attn_len, backend = ctx.args
    dq, dk, dv, dpos, dtime = jagged_attention_bwd_op(
        grad_out.contiguous(), q, k, v, out, lse, seq_offsets, max_seq_len, kind, causal, scale, num_targets,
        contextual_len, max_attn_len, pos_bias, time_bias, timestamps, query_timestamps, ctx.deterministic, backend)
    return (dq, dk, dv, None, None, None, None, None, None, None, None,
            dpos if pos_bias is not None else None, dtime if time_bias is not None else None, None, None, None, None)


register_autograd(jagged_attention_fwd_op, _backward, setup_context=_setup)
run_kernels_without_autocast(jagged_attention_fwd_op, jagged_attention_bwd_op)

# Fake kernels for the native schemas (csrc/ops.cpp), so opcheck and tracing see them too.
if hasattr(torch.ops.gem_kernels, "jagged_attention_fwd_native"):
    torch.library.register_fake("gem_kernels::jagged_attention_fwd_native")(_jagged_attention_fwd_fake)
    torch.library.register_fake("gem_kernels::jagged_attention_bwd_native")(_jagged_attention_bwd_fake)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def _round_to_fp32(x: float) -> float:
    """x rounded to the nearest fp32 (what every backend multiplies by), +-inf past fp32's range: the
    backends then agree on a scale such as 1e300, which a C++ cast to float would leave undefined."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _check_bias(name: str, bias, num_heads: int, width: int | None, device) -> None:
    check_tensor(name, bias, dtypes=float_dtypes(), dims=(2,))
    if bias.shape[0] not in (1, num_heads):
        raise ValueError(f"{name}.shape[0] must be 1 or H = {num_heads}, got shape {tuple(bias.shape)}")
    if width is not None and bias.shape[1] != width:
        raise ValueError(f"{name}.shape[1] must be 2 * max_seq_len - 1 = {width}, got shape {tuple(bias.shape)}")
    if bias.shape[1] < 1:
        raise ValueError(f"{name}.shape[1] must be >= 1, got shape {tuple(bias.shape)}")
    if bias.device != device:
        raise ValueError(f"{name} is on {bias.device} but q is on {device}; they must match")


def check_options(q: torch.Tensor, num_rows: int, num_seqs: int, max_seq_len: int, contextual_len, max_attn_len,
                  num_targets, pos_bias, time_bias, timestamps, query_timestamps, query_rows_name: str = "N"):
    """Checks the mask and bias arguments shared by jagged_attention and cached_jagged_attention, and
    returns (num_targets, pos_bias, time_bias, timestamps, query_timestamps) contiguous (timestamps None
    without time_bias). q: the queries ([rows, H, D]: N rows, or B * delta in the cached op), whose rows
    query_timestamps follows (named query_rows_name in messages); num_rows: N, the key rows that timestamps
    follows."""
    check_nonnegative_int("contextual_len", contextual_len)
    check_nonnegative_int("max_attn_len", max_attn_len)
    if num_targets is not None:
        check_tensor("num_targets", num_targets, dtypes=INDEX_DTYPES, dims=(1,))
        check_same_device(q=q, num_targets=num_targets)
        if num_targets.shape[0] != num_seqs:
            raise ValueError(f"num_targets must have B = {num_seqs} elements, got shape {tuple(num_targets.shape)}")
        num_targets = num_targets.contiguous()
    num_heads = q.shape[1]
    if pos_bias is not None:
        _check_bias("pos_bias", pos_bias, num_heads, 2 * max_seq_len - 1, q.device)
        pos_bias = pos_bias.contiguous()
    if time_bias is not None:
        _check_bias("time_bias", time_bias, num_heads, None, q.device)
        if timestamps is None:
            raise ValueError("timestamps must be given with time_bias, got None")
        time_bias = time_bias.contiguous()
    if timestamps is not None:
        check_tensor("timestamps", timestamps, dtypes=INDEX_DTYPES, dims=(1,))
        check_same_device(q=q, timestamps=timestamps)
        if timestamps.shape[0] != num_rows:
            raise ValueError(f"timestamps must have N = {num_rows} elements, got shape {tuple(timestamps.shape)}")
        timestamps = timestamps.contiguous() if time_bias is not None else None
    if query_timestamps is not None:
        if time_bias is None:
            raise ValueError("query_timestamps is only used by the time bias: pass time_bias (and timestamps) "
                             "with it, got time_bias=None")
        check_tensor("query_timestamps", query_timestamps, dtypes=INDEX_DTYPES, dims=(1,))
        check_same_device(q=q, query_timestamps=query_timestamps)
        if query_timestamps.shape[0] != q.shape[0]:
            raise ValueError(f"query_timestamps must have {query_rows_name} = {q.shape[0]} elements, got shape "
                             f"{tuple(query_timestamps.shape)}")
        query_timestamps = query_timestamps.contiguous()
    return num_targets, pos_bias, time_bias, timestamps, query_timestamps


def check_operands(q_name: str, q, k, v, seq_offsets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) after autocast (gem_kernels/_autocast.py), checked: 3-D float tensors of q's dtype on
    seq_offsets' device, seq_offsets 1-D int32/int64. q_name: the queries' name in messages."""
    q, k, v = autocast_operands(q, k, v)
    check_tensor(q_name, q, dtypes=float_dtypes(), dims=(3,))
    check_tensor("k", k, dtypes=float_dtypes(), dims=(3,))
    check_tensor("v", v, dtypes=float_dtypes(), dims=(3,))
    check_offsets_meta("seq_offsets", seq_offsets)
    check_same_device(**{q_name: q}, k=k, v=v, seq_offsets=seq_offsets)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have {q_name}'s dtype {q.dtype}, got {t.dtype}")
    return q, k, v


def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                     max_seq_len: int, *, kind: str = "softmax", causal: bool = True, scale: float | None = None,
                     num_targets: torch.Tensor | None = None, contextual_len: int = 0, max_attn_len: int = 0,
                     pos_bias: torch.Tensor | None = None, time_bias: torch.Tensor | None = None,
                     timestamps: torch.Tensor | None = None, query_timestamps: torch.Tensor | None = None,
                     deterministic: bool = False, backend: str | None = None) -> torch.Tensor:
    """Attention within each sequence of a jagged batch: softmax or HSTU (pointwise SiLU) weights.

    Within sequence b (length L, positions i = query and j = key counted from its start, n =
    num_targets[b] or 0, c = contextual_len)::

        s_ij = scale * <q_i, k_j> + pos_bias[h, j - i + max_seq_len - 1] + time_bias[h, bucket(tq_i - t_j)]
        bucket(dt) = min(num_buckets, floor(ln(max(|dt|, 1)) / 0.301)),  num_buckets = time_bias.shape[1] - 1
        t = timestamps, tq = query_timestamps (default: timestamps, i.e. bucket(t_i - t_j))
        softmax: out_i = sum_j softmax_j(s_ij over visible j) v_j
        hstu:    out_i = sum_{visible j} silu(s_ij) / max_seq_len * v_j

    Visibility is generative-recommenders' ``_get_valid_attn_mask``: the c context positions get id
    0, position p >= c gets id p - c + 1 (c = 0: id = p), and the n targets share the id of the
    first target. With d = id_i - id_j (|d| when not causal), j is visible from i when i == j, or
    d > 0 and (max_attn_len == 0 or d <= max_attn_len); a context query (id 0, c > 0) also sees
    every non-target key. Targets see the history and themselves, never each other; context never
    sees targets. Every row sees at least itself, so no softmax row is empty.

    NaN and Inf (in q, k, v, a bias, or the scale, which is rounded to fp32 first: 1e300 becomes
    inf) follow one rule on every backend:

    - Only visible pairs enter the maths. An invisible or padded key adds nothing to any output or
      gradient, even when its k, v or bias entry is NaN or Inf (never 0 * inf), and a bias entry that
      no visible pair uses is never read into a result.
    - Visible pairs follow the IEEE arithmetic of the formulas above. A NaN in any score row i sees
      (from q_i, a visible k_j, a used bias entry or the scale) makes output row i NaN, in both kinds
      (softmax: its lse too). A NaN or Inf in v_j reaches exactly the rows that see j (w * inf is
      +-inf, NaN where w = 0 or infinities of both signs meet).
    - Infinite scores. Softmax: a visible +inf makes the row NaN (inf - inf); a visible -inf gets weight
      0, and a row whose visible scores are all -inf outputs sum_j 0 * v_j (0; NaN if such a v_j is
      infinite) with lse = -inf (FlashAttention's convention). HSTU: silu(+inf) = inf and
      silu(-inf) = -inf * sigmoid(-inf) = NaN.
    - Backward: the gradients follow the same selection: a NaN reaches dq_i, dk_j, dv_j and the bias
      entries of the visible pairs whose terms contain it, and nothing else.

    Args:
        q, k: [N, H, Dqk]; v: [N, H, Dv]; one dtype among float32/float16/bfloat16, one device.
        seq_offsets: [B+1] int32/int64; offsets[0] == 0, nondecreasing, offsets[-1] == N. B = 0 and
            zero-length sequences are valid.
        max_seq_len: int >= every sequence length; also the HSTU normaliser and the pos_bias width.
        kind: "softmax" | "hstu".
        causal: see the visibility rule above.
        scale: multiplies <q, k>; default 1 / sqrt(Dqk).
        num_targets: [B] int32/int64 with 0 <= num_targets[b] <= L_b, or None (no targets).
        contextual_len: c >= 0.
        max_attn_len: window on the id distance, 0 = unlimited.
        pos_bias: [H or 1, 2 * max_seq_len - 1] float, or None.
        time_bias: [H or 1, num_buckets + 1] float, or None; needs timestamps.
        timestamps: [N] int32/int64 (one per row), required with time_bias.
        query_timestamps: [N] int32/int64 like timestamps, or None (= timestamps); only with time_bias.
            The time of query row i in bucket(tq_i - t_j). generative-recommenders' research HSTU
            (``RelativeBucketedTimeAndPositionBasedBias``) buckets ts(next item) - ts(key): pass the
            next row's timestamp here (``gem_kernels.reference.gr_relative_bias`` is that formula).
        deterministic: make the backward bit-identical run to run. The cpu and reference backends
            always are. triton never uses atomics for dq/dk/dv; its bias gradients use fp32 atomics
            when False, and per-program partial sums in scratch reduced in a fixed order when True
            (slower: a reduction kernel, scratch of ~H * sum L^2 / 16 bytes for pos_bias; / 4 with fp32
            inputs on a GPU, whose tiles are 16 wide). cuda: dq, dk,
            dv never use atomics; bias gradients likewise atomics when False, scratch + fixed-order
            reduction when True (~H * sum L^2 / 8 bytes for pos_bias).
        backend: "reference" | "cpu" | "cuda" | "triton" | "auto"; None uses ``use_backend``'s default.
            "auto" takes triton (then cuda) on CUDA tensors, cpu on CPU tensors.

    Returns:
        out [N, H, Dv] in q's dtype, differentiable w.r.t. q, k, v, pos_bias and time_bias. Softmax
        statistics and all accumulations are fp32. Under ``torch.autocast`` q, k and v are cast to the
        autocast dtype first, like SDPA's (gem_kernels/_autocast.py); the biases keep theirs (they
        are added in fp32).
    """
    q, k, v = check_operands("q", q, k, v, seq_offsets)
    num_targets, pos_bias, time_bias, timestamps, query_timestamps, scale, name = checked_arguments(
        q, k, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len, max_attn_len, pos_bias,
        time_bias, timestamps, query_timestamps, deterministic, backend)
    out, _lse = jagged_attention_fwd_op(q.contiguous(), k.contiguous(), v.contiguous(), seq_offsets.contiguous(),
                                        max_seq_len, kind, causal, scale, num_targets, contextual_len,
                                        max_attn_len, pos_bias, time_bias, timestamps, query_timestamps,
                                        deterministic, name)
    return out


def checked_arguments(q, k, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len,
                      max_attn_len, pos_bias, time_bias, timestamps, query_timestamps, deterministic, backend):
    """jagged_attention's checks after check_operands (the shapes of q, k, v against each other, every
    option), reading shapes, dtypes and devices only: (num_targets, pos_bias, time_bias, timestamps,
    query_timestamps) as check_options returns them, the scale rounded to fp32, and the concrete backend.
    gem_kernels.ops.hstu_layer runs them before the layer computes q, k and v, on views of their shapes."""
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must have shape [N, H, Dv] = [{q.shape[0]}, {q.shape[1]}, Dv], got {tuple(v.shape)}")
    if q.shape[2] < 1 or v.shape[2] < 1:
        raise ValueError(f"head dims must be >= 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    check_nonnegative_int("max_seq_len", max_seq_len)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if scale is None:
        scale = q.shape[2] ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = _round_to_fp32(float(scale))
    num_targets, pos_bias, time_bias, timestamps, query_timestamps = check_options(
        q, k.shape[0], seq_offsets.shape[0] - 1, max_seq_len, contextual_len, max_attn_len, num_targets, pos_bias,
        time_bias, timestamps, query_timestamps)
    name = resolve_backend(backend, q.device, FAMILY)
    check_float64_on_reference(name, q=q, pos_bias=pos_bias, time_bias=time_bias)
    return num_targets, pos_bias, time_bias, timestamps, query_timestamps, float(scale), name

"""Reference jagged attention: pad every sequence to the longest one, build the visibility mask, eager maths.

The ground truth of `gem_kernels.jagged_attention` (softmax and HSTU kinds). Everything is computed
in fp32 on [B, H, W, W] tensors (W = the longest sequence, never more than max_seq_len, which can be
far larger: only the pos_bias index and the HSTU normaliser use it) and cast back to the input dtype.
The mask follows generative-recommenders' `_get_valid_attn_mask` (the reference of `hstu_mha`); see
`visibility_mask` for the rule in words.

Masking is by selection only (torch.where / indexing), never by adding a large negative constant or
multiplying by 0: an invisible or padded pair contributes nothing at all, not even a NaN or the NaN of
0 * inf, and any visible score, however large, beats "invisible" (see `_masked_sum`). The NaN/Inf rule
this implements is written in `gem_kernels.jagged_attention`'s docstring.
"""

from __future__ import annotations

import math

import torch

from .._attention import time_buckets  # noqa: F401  (re-exported: tests and bench use ref.time_buckets)
from . import wide



def position_ids(lengths: torch.Tensor, max_seq_len: int, num_targets: torch.Tensor | None,
                 contextual_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, max_seq_len] of every position, and max_ids [B] (the id of the first target).

    The c = contextual_len context positions all get id 0 and position p >= c gets p - c + 1
    (c = 0: id = p); with targets, ids are clamped at max_id = L - n (+ 1 - c when c > 0), so the n
    targets share the id of the first one.
    """
    lengths = lengths.long()
    ids = torch.arange(max_seq_len, device=lengths.device).view(1, -1).expand(lengths.numel(), -1)
    max_ids = lengths.clone()
    if contextual_len > 0:
        ids = (ids - contextual_len + 1).clamp(min=0)
        max_ids = max_ids - contextual_len + 1
    if num_targets is not None:
        max_ids = max_ids - num_targets.long()
        ids = torch.minimum(ids, max_ids.view(-1, 1))
    return ids, max_ids


def visibility_mask(lengths: torch.Tensor, max_seq_len: int, *, causal: bool, num_targets: torch.Tensor | None,
                    contextual_len: int, max_attn_len: int) -> torch.Tensor:
    """valid [B, M, M]: valid[b, i, j] says whether query i of sequence b sees key j.

    With d = id_i - id_j (|d| when not causal): j is visible from i when i == j, or d > 0 and
    (max_attn_len == 0 or d <= max_attn_len); in addition a context query (id 0, c > 0) sees every
    key whose id is below max_id (every non-target key). Positions past the sequence's end see and
    are seen by nothing.
    """
    ids, max_ids = position_ids(lengths, max_seq_len, num_targets, contextual_len)
    row, col = ids.unsqueeze(2), ids.unsqueeze(1)
    dist = row - col
    if not causal:
        dist = dist.abs()
    eye = torch.eye(max_seq_len, dtype=torch.bool, device=lengths.device).unsqueeze(0)
    valid = eye | (dist > 0)
    if max_attn_len > 0:
        valid = valid & (dist <= max_attn_len)
    if contextual_len > 0:
        valid = valid | ((row == 0) & (col < max_ids.view(-1, 1, 1)))
    in_seq = torch.arange(max_seq_len, device=lengths.device).view(1, -1) < lengths.long().view(-1, 1)
    return valid & in_seq.unsqueeze(2) & in_seq.unsqueeze(1)


def _pad(x: torch.Tensor, seq_offsets: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, *feat] -> padded [B, width, *feat] (zeros past each end), and the (seq, pos) of every row."""
    offsets = seq_offsets.long()
    lengths = offsets.diff()
    seq_ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths, output_size=x.shape[0])
    pos = torch.arange(x.shape[0], device=x.device) - offsets[seq_ids]
    padded = x.new_zeros((lengths.numel(), width, *x.shape[1:]))
    padded = padded.index_put((seq_ids, pos), x)
    return padded, torch.stack([seq_ids, pos])


def padded_width(seq_offsets: torch.Tensor) -> int:
    """The longest sequence: the reference pads to it, not to max_seq_len (which may be 10**9)."""
    lengths = seq_offsets.long().diff()
    return int(lengths.max()) if lengths.numel() > 0 else 0


def _masked_sum(w: torch.Tensor, valid: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """out[b, i, h, d] = sum over j with valid[b, i, j] of w[b, h, i, j] * x[b, j, h, d], by selection.

    w [B, H, W, W] (any values where invalid), valid [B, 1, W, W] bool, x [B, W, H, D] -> [B, W, H, D].
    A plain matmul of the zeroed weights would turn an invisible infinite x into 0 * inf = NaN: the
    finite part of x goes through one einsum, and each non-finite entry of x (rare) is added pair by
    pair where valid, so it reaches exactly the rows that see it (IEEE maths there: 0 * inf = NaN)."""
    w = torch.where(valid, w, 0.0)
    finite = torch.isfinite(x)
    out = torch.einsum("bhij,bjhd->bihd", w, torch.where(finite, x, 0.0))
    if not bool(finite.all()):
        b, j, h, d = (~finite).nonzero(as_tuple=True)  # E entries
        rows = torch.arange(w.shape[2], device=w.device)
        contrib = torch.where(valid[b, 0, :, j], w[b, h, :, j] * x[b, j, h, d].unsqueeze(1), 0.0)  # [E, W]
        out = out.index_put((b[:, None], rows[None, :], h[:, None], d[:, None]), contrib, accumulate=True)
    return out


def attention_scores(q, k, seq_offsets, max_seq_len, *, scale, pos_bias, time_bias, timestamps, query_timestamps=None,
                     width=None):
    """Padded fp32 scores s [B, H, W, W] = scale * <q_i, k_j> + pos_bias + time_bias, and the row index.

    W = width (default: the longest sequence). Entries of invisible or padded pairs are whatever the
    arithmetic gives (NaN included): callers select the visible ones."""
    width = padded_width(seq_offsets) if width is None else width
    qp, index = _pad(wide(q), seq_offsets, width)  # [B, W, H, D]
    kp, _ = _pad(wide(k), seq_offsets, width)
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp) * scale
    if pos_bias is not None:
        rel = torch.arange(width, device=q.device)
        rel = rel.view(1, -1) - rel.view(-1, 1) + max_seq_len - 1  # j - i + M - 1
        scores = scores + wide(pos_bias)[:, rel].unsqueeze(0)  # [1, H or 1, W, W]
    if time_bias is not None:
        scores = scores + wide(time_bias)[:, _pair_buckets(seq_offsets, width, time_bias, timestamps,
                                                              query_timestamps)].transpose(0, 1)
    return scores, index


def _pair_buckets(seq_offsets, width, time_bias, timestamps, query_timestamps):
    """bucket(tq_i - t_j) of every padded pair [B, W, W]; tq = query_timestamps, default timestamps."""
    tp, _ = _pad(timestamps.long(), seq_offsets, width)  # [B, W]
    tq = tp if query_timestamps is None else _pad(query_timestamps.long(), seq_offsets, width)[0]
    return time_buckets(tq.unsqueeze(2) - tp.unsqueeze(1), time_bias.shape[1] - 1)


def _softmax_weights(scores, valid):
    """(p [B, H, W, W], lse [B, H, W]) over the visible keys of each row, by selection.

    m = max of the visible scores (NaN if one is NaN); p = exp(s - m) / sum exp(s - m). A row whose
    visible scores are all -inf gets p = 0 and lse = -inf (FlashAttention's convention, which the
    kernels share: exp(-inf) = 0, the sum 0 is not divided by). m is a constant shift (detached)."""
    neg_inf = float("-inf")
    if scores.shape[-1] == 0:  # every sequence empty: nothing to reduce (amax refuses an empty dim)
        return scores, scores.new_full(scores.shape[:-1], neg_inf)
    row_max = torch.where(valid, scores, neg_inf).amax(-1, keepdim=True)
    shift = torch.where(row_max == neg_inf, 0.0, row_max).detach()
    # Invisible pairs: exp(-inf) = 0, whose gradient is 0 * 0 (selecting after exp would give 0 * inf).
    e = torch.exp(torch.where(valid, scores - shift, neg_inf))
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total == 0, 1.0, total)
    return p, (shift + torch.log(total)).squeeze(-1)


def _hstu_parts(scores, valid, max_seq_len):
    """(silu(s) / max_seq_len, sigmoid(s)) on visible pairs, 0 elsewhere (selected before the maths too,
    so that autograd does not multiply a zero gradient by an invisible NaN)."""
    s = torch.where(valid, scores, 0.0)
    sig = torch.sigmoid(s)
    return torch.where(valid, s * sig / max_seq_len, 0.0), sig, s


def jagged_attention_with_lse(q, k, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len,
                              max_attn_len, pos_bias, time_bias, timestamps, query_timestamps=None):
    """out [N, H, Dv] in q's dtype and lse [N, H] fp32 (softmax; empty for hstu). Differentiable."""
    num_rows, num_heads, _ = q.shape
    lengths = seq_offsets.long().diff()
    width = padded_width(seq_offsets)
    scores, index = attention_scores(q, k, seq_offsets, max_seq_len, scale=scale, pos_bias=pos_bias,
                                     time_bias=time_bias, timestamps=timestamps, query_timestamps=query_timestamps,
                                     width=width)
    valid = visibility_mask(lengths, width, causal=causal, num_targets=num_targets,
                            contextual_len=contextual_len, max_attn_len=max_attn_len).unsqueeze(1)
    if kind == "softmax":
        weights, lse_padded = _softmax_weights(scores, valid)
    else:
        weights, _, _ = _hstu_parts(scores, valid, max_seq_len)
        lse_padded = None
    vp, _ = _pad(wide(v), seq_offsets, width)  # [B, W, H, Dv]
    out_padded = _masked_sum(weights, valid, vp)
    seq_ids, pos = index
    out = out_padded[seq_ids, pos].to(q.dtype)
    if lse_padded is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    else:
        lse = lse_padded.transpose(1, 2)[seq_ids, pos].detach().contiguous()
    assert out.shape == (num_rows, num_heads, v.shape[2])
    return out, lse


def jagged_attention_fwd(q, k, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len,
                         max_attn_len, pos_bias, time_bias, timestamps, query_timestamps=None):
    with torch.no_grad():
        return jagged_attention_with_lse(q, k, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets,
                                         contextual_len, max_attn_len, pos_bias, time_bias, timestamps,
                                         query_timestamps)


def jagged_attention_bwd(grad_out, q, k, v, out, lse, seq_offsets, max_seq_len, kind, causal, scale, num_targets,
                         contextual_len, max_attn_len, pos_bias, time_bias, timestamps, query_timestamps,
                         deterministic):
    """(dq, dk, dv, dpos_bias, dtime_bias) in closed form on the padded fp32 tensors (the tests check
    it against autograd through `jagged_attention_with_lse`); absent biases give empty tensors.
    `out`/`lse` are recomputed rather than read; `deterministic` holds trivially. Every product is
    masked by selection (`_masked_sum`), like the forward's."""
    del out, lse, deterministic
    lengths = seq_offsets.long().diff()
    width = padded_width(seq_offsets)
    scores, (seq_ids, pos) = attention_scores(q, k, seq_offsets, max_seq_len, scale=scale, pos_bias=pos_bias,
                                              time_bias=time_bias, timestamps=timestamps,
                                              query_timestamps=query_timestamps, width=width)
    valid = visibility_mask(lengths, width, causal=causal, num_targets=num_targets,
                            contextual_len=contextual_len, max_attn_len=max_attn_len).unsqueeze(1)
    valid_t = valid.transpose(-1, -2)
    qp, _ = _pad(wide(q), seq_offsets, width)
    kp, _ = _pad(wide(k), seq_offsets, width)
    vp, _ = _pad(wide(v), seq_offsets, width)
    dop, _ = _pad(wide(grad_out), seq_offsets, width)
    # dP_ij = <dO_i, v_j> involves only i's and j's own rows: selecting afterwards is exact.
    dweights = torch.where(valid, torch.einsum("bihd,bjhd->bhij", dop, vp), 0.0)
    if kind == "softmax":
        weights, _ = _softmax_weights(scores, valid)
        delta = torch.where(valid, weights * dweights, 0.0).sum(-1, keepdim=True)
        dscores = torch.where(valid, weights * (dweights - delta), 0.0)
    else:
        weights, sig, s = _hstu_parts(scores, valid, max_seq_len)
        dscores = torch.where(valid, dweights * (sig * (1 + s * (1 - sig))) / max_seq_len, 0.0)
    dq = (_masked_sum(dscores, valid, kp) * scale)[seq_ids, pos].to(q.dtype)
    dk = (_masked_sum(dscores.transpose(-1, -2), valid_t, qp) * scale)[seq_ids, pos].to(k.dtype)
    dv = _masked_sum(weights.transpose(-1, -2), valid_t, dop)[seq_ids, pos].to(v.dtype)
    num_heads = q.shape[1]
    dpos = q.new_empty((0,))
    if pos_bias is not None:
        rel = torch.arange(width, device=q.device)
        rel = (rel.view(1, -1) - rel.view(-1, 1) + max_seq_len - 1).reshape(-1)
        per_head = dscores.sum(0).reshape(num_heads, -1)
        dpos = per_head.new_zeros((num_heads, pos_bias.shape[1])).index_add_(1, rel, per_head)
        dpos = dpos.sum(0, keepdim=True) if pos_bias.shape[0] == 1 else dpos
        dpos = dpos.to(pos_bias.dtype)
    dtime = q.new_empty((0,))
    if time_bias is not None:
        buckets = _pair_buckets(seq_offsets, width, time_bias, timestamps, query_timestamps).reshape(-1)
        per_head = dscores.transpose(0, 1).reshape(num_heads, -1)
        dtime = per_head.new_zeros((num_heads, time_bias.shape[1])).index_add_(1, buckets, per_head)
        dtime = dtime.sum(0, keepdim=True) if time_bias.shape[0] == 1 else dtime
        dtime = dtime.to(time_bias.dtype)
    return dq, dk, dv, dpos, dtime


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0

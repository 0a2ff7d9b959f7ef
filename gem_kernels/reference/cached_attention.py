"""Reference cached (delta) jagged attention: the last `delta` query rows of every sequence against the
sequence's whole K/V, on padded fp32 tensors.

The ground truth of `gem_kernels.cached_jagged_attention`. It is `reference.attention`'s maths with
the query axis cut to the delta rows: scores [B, H, delta, W] instead of [B, H, W, W], the visibility
rows of positions L - delta .. L - 1 of generative-recommenders' `_get_valid_attn_mask` (causal),
and the same masking by selection (`_masked_sum`, `_softmax_weights`, `_hstu_parts`), so the NaN/Inf
rule of `jagged_attention` holds here too.
"""

from __future__ import annotations

import torch

from .._attention import time_buckets
from . import wide
from .attention import _hstu_parts, _masked_sum, _pad, _softmax_weights, padded_width, visibility_mask


def query_positions(seq_offsets: torch.Tensor, delta: int) -> torch.Tensor:
    """positions [B, delta] of the delta query rows within their sequences: L_b - delta + t."""
    lengths = seq_offsets.long().diff()
    return lengths.view(-1, 1) - delta + torch.arange(delta, device=seq_offsets.device).view(1, -1)


def cached_jagged_attention_fwd(delta_q, k, v, seq_offsets, max_seq_len, kind, scale, num_targets, contextual_len,
                                max_attn_len, pos_bias, time_bias, timestamps, query_timestamps):
    """out [B * delta, H, Dv] in delta_q's dtype (see gem_kernels.cached_jagged_attention)."""
    num_seqs = seq_offsets.numel() - 1
    _, num_heads, head_dim = delta_q.shape
    out_dim = v.shape[2]
    if num_seqs == 0 or delta_q.shape[0] == 0:
        return delta_q.new_empty((delta_q.shape[0], num_heads, out_dim))
    delta = delta_q.shape[0] // num_seqs
    with torch.no_grad():
        width = padded_width(seq_offsets)
        lengths = seq_offsets.long().diff()
        rows = query_positions(seq_offsets, delta)  # [B, delta]
        kp, _ = _pad(wide(k), seq_offsets, width)  # [B, W, H, D]
        vp, _ = _pad(wide(v), seq_offsets, width)
        qd = wide(delta_q).view(num_seqs, delta, num_heads, head_dim)
        scores = torch.einsum("bihd,bjhd->bhij", qd, kp) * scale  # [B, H, delta, W]
        cols = torch.arange(width, device=k.device).view(1, 1, -1)
        if pos_bias is not None:
            rel = cols - rows.unsqueeze(-1) + max_seq_len - 1  # j - i + M - 1, [B, delta, W]
            scores = scores + wide(pos_bias)[:, rel].transpose(0, 1)
        if time_bias is not None:
            tp, _ = _pad(timestamps.long(), seq_offsets, width)  # [B, W]
            if query_timestamps is None:
                tq = tp.gather(1, rows)
            else:
                tq = query_timestamps.long().view(num_seqs, delta)
            buckets = time_buckets(tq.unsqueeze(2) - tp.unsqueeze(1), time_bias.shape[1] - 1)
            scores = scores + wide(time_bias)[:, buckets].transpose(0, 1)
        full = visibility_mask(lengths, width, causal=True, num_targets=num_targets, contextual_len=contextual_len,
                               max_attn_len=max_attn_len)  # [B, W, W]
        valid = full.gather(1, rows.unsqueeze(-1).expand(-1, -1, width)).unsqueeze(1)  # [B, 1, delta, W]
        if kind == "softmax":
            weights, _ = _softmax_weights(scores, valid)
        else:
            weights, _, _ = _hstu_parts(scores, valid, max_seq_len)
        out = _masked_sum(weights, valid, vp)  # [B, delta, H, Dv]
    return out.reshape(num_seqs * delta, num_heads, out_dim).to(delta_q.dtype)

"""Reference jagged attention: pad every sequence to max_seq_len, build the visibility mask, eager maths.

The ground truth of `gem_kernels.jagged_attention` (softmax and HSTU kinds). Everything is computed
in fp32 on [B, H, max_seq_len, max_seq_len] tensors and cast back to the input dtype; the
gradients are what plain torch autograd gives through this forward. The mask follows
generative-recommenders' `_get_valid_attn_mask` (the reference of `hstu_mha`); see
`visibility_mask` for the rule in words.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# generative-recommenders' log-time bucketing divisor: bucket(dt) = floor(ln(max(|dt|, 1)) / 0.301).
TIME_BUCKET_DIVISOR = 0.301


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


def time_buckets(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """bucket(dt) = min(num_buckets, floor(ln(max(|dt|, 1)) / 0.301)), computed in fp64."""
    x = dt.abs().clamp(min=1).double()
    return (torch.log(x) / TIME_BUCKET_DIVISOR).floor().clamp(max=num_buckets).long()


def _pad(x: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, *feat] -> padded [B, M, *feat] (zeros past each end), and the (seq, pos) of every row."""
    offsets = seq_offsets.long()
    lengths = offsets.diff()
    seq_ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths, output_size=x.shape[0])
    pos = torch.arange(x.shape[0], device=x.device) - offsets[seq_ids]
    padded = x.new_zeros((lengths.numel(), max_seq_len, *x.shape[1:]))
    padded = padded.index_put((seq_ids, pos), x)
    return padded, torch.stack([seq_ids, pos])


def attention_scores(q, k, seq_offsets, max_seq_len, *, scale, pos_bias, time_bias, timestamps):
    """Padded fp32 scores s [B, H, M, M] = scale * <q_i, k_j> + pos_bias + time_bias, and the row index."""
    qp, index = _pad(q.float(), seq_offsets, max_seq_len)  # [B, M, H, D]
    kp, _ = _pad(k.float(), seq_offsets, max_seq_len)
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp) * scale
    if pos_bias is not None:
        rel = torch.arange(max_seq_len, device=q.device)
        rel = rel.view(1, -1) - rel.view(-1, 1) + max_seq_len - 1  # j - i + M - 1
        scores = scores + pos_bias.float()[:, rel].unsqueeze(0)  # [1, H or 1, M, M]
    if time_bias is not None:
        tp, _ = _pad(timestamps.long(), seq_offsets, max_seq_len)  # [B, M]
        buckets = time_buckets(tp.unsqueeze(2) - tp.unsqueeze(1), time_bias.shape[1] - 1)  # [B, M, M]
        scores = scores + time_bias.float()[:, buckets].transpose(0, 1)  # [B, H or 1, M, M]
    return scores, index


def jagged_attention_with_lse(q, k, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len,
                              max_attn_len, pos_bias, time_bias, timestamps):
    """out [N, H, Dv] in q's dtype and lse [N, H] fp32 (softmax; empty for hstu). Differentiable."""
    num_rows, num_heads, _ = q.shape
    lengths = seq_offsets.long().diff()
    scores, index = attention_scores(q, k, seq_offsets, max_seq_len, scale=scale, pos_bias=pos_bias,
                                     time_bias=time_bias, timestamps=timestamps)
    valid = visibility_mask(lengths, max_seq_len, causal=causal, num_targets=num_targets,
                            contextual_len=contextual_len, max_attn_len=max_attn_len).unsqueeze(1)
    if kind == "softmax":
        # A finite fill keeps padded rows (no visible key) finite in the backward; they are zeroed below.
        masked = scores.masked_fill(~valid, -1e30)
        lse_padded = torch.logsumexp(masked, dim=-1)  # [B, H, M]
        weights = torch.softmax(masked, dim=-1) * valid
    else:
        weights = F.silu(scores) / max_seq_len * valid
        lse_padded = None
    vp, _ = _pad(v.float(), seq_offsets, max_seq_len)  # [B, M, H, Dv]
    out_padded = torch.einsum("bhij,bjhd->bihd", weights, vp)
    seq_ids, pos = index
    out = out_padded[seq_ids, pos].to(q.dtype)
    if lse_padded is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    else:
        lse = lse_padded.transpose(1, 2)[seq_ids, pos].detach().contiguous()
    assert out.shape == (num_rows, num_heads, v.shape[2])
    return out, lse


def jagged_attention_fwd(q, k, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len,
                         max_attn_len, pos_bias, time_bias, timestamps):
    with torch.no_grad():
        return jagged_attention_with_lse(q, k, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets,
                                         contextual_len, max_attn_len, pos_bias, time_bias, timestamps)


def jagged_attention_bwd(grad_out, q, k, v, out, lse, seq_offsets, max_seq_len, kind, causal, scale, num_targets,
                         contextual_len, max_attn_len, pos_bias, time_bias, timestamps, deterministic):
    """(dq, dk, dv, dpos_bias, dtime_bias) in closed form on the padded fp32 tensors (the tests check
    it against autograd through `jagged_attention_with_lse`); absent biases give empty tensors.
    `out`/`lse` are recomputed rather than read; `deterministic` holds trivially."""
    del out, lse, deterministic
    lengths = seq_offsets.long().diff()
    scores, (seq_ids, pos) = attention_scores(q, k, seq_offsets, max_seq_len, scale=scale, pos_bias=pos_bias,
                                              time_bias=time_bias, timestamps=timestamps)
    valid = visibility_mask(lengths, max_seq_len, causal=causal, num_targets=num_targets,
                            contextual_len=contextual_len, max_attn_len=max_attn_len).unsqueeze(1)
    qp, _ = _pad(q.float(), seq_offsets, max_seq_len)
    kp, _ = _pad(k.float(), seq_offsets, max_seq_len)
    vp, _ = _pad(v.float(), seq_offsets, max_seq_len)
    dop, _ = _pad(grad_out.float(), seq_offsets, max_seq_len)
    dweights = torch.einsum("bihd,bjhd->bhij", dop, vp)
    if kind == "softmax":
        weights = torch.softmax(scores.masked_fill(~valid, -1e30), dim=-1) * valid
        dscores = weights * (dweights - (weights * dweights).sum(-1, keepdim=True))
    else:
        sig = torch.sigmoid(scores)
        weights = scores * sig / max_seq_len * valid
        dscores = dweights * (sig * (1 + scores * (1 - sig))) / max_seq_len * valid
    dq = (torch.einsum("bhij,bjhd->bihd", dscores, kp) * scale)[seq_ids, pos].to(q.dtype)
    dk = (torch.einsum("bhij,bihd->bjhd", dscores, qp) * scale)[seq_ids, pos].to(k.dtype)
    dv = torch.einsum("bhij,bihd->bjhd", weights, dop)[seq_ids, pos].to(v.dtype)
    num_heads = q.shape[1]
    dpos = q.new_empty((0,))
    if pos_bias is not None:
        rel = torch.arange(max_seq_len, device=q.device)
        rel = (rel.view(1, -1) - rel.view(-1, 1) + max_seq_len - 1).reshape(-1)
        per_head = dscores.sum(0).reshape(num_heads, -1)
        dpos = per_head.new_zeros((num_heads, pos_bias.shape[1])).index_add_(1, rel, per_head)
        dpos = dpos.sum(0, keepdim=True) if pos_bias.shape[0] == 1 else dpos
        dpos = dpos.to(pos_bias.dtype)
    dtime = q.new_empty((0,))
    if time_bias is not None:
        tp, _ = _pad(timestamps.long(), seq_offsets, max_seq_len)
        buckets = time_buckets(tp.unsqueeze(2) - tp.unsqueeze(1), time_bias.shape[1] - 1).reshape(-1)
        per_head = dscores.transpose(0, 1).reshape(num_heads, -1)
        dtime = per_head.new_zeros((num_heads, time_bias.shape[1])).index_add_(1, buckets, per_head)
        dtime = dtime.sum(0, keepdim=True) if time_bias.shape[0] == 1 else dtime
        dtime = dtime.to(time_bias.dtype)
    return dq, dk, dv, dpos, dtime


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0

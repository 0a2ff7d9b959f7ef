"""The plain-PyTorch oracles of the fuzz's value cases: differentiable, run in float64 unless a case says fp32."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# Oracles (plain PyTorch, differentiable, run in float64 unless a case says fp32)
# ---------------------------------------------------------------------------------------------


def oracle_jagged_to_padded(values, offsets, max_len, pad_value):
    flat = values.unsqueeze(1) if values.dim() == 1 else values
    rows = []
    off = offsets.tolist()
    for b in range(len(off) - 1):
        seq = flat[off[b]:off[b + 1]][:max_len]
        pad = flat.new_full((max_len - seq.shape[0], flat.shape[1]), pad_value)
        rows.append(torch.cat([seq, pad]))
    out = torch.stack(rows) if rows else flat.new_zeros((0, max_len, flat.shape[1]))
    return out.squeeze(-1) if values.dim() == 1 else out


def oracle_padded_to_jagged(padded, offsets):
    flat = padded.unsqueeze(2) if padded.dim() == 2 else padded
    off = offsets.tolist()
    parts = []
    for b in range(len(off) - 1):
        length = off[b + 1] - off[b]
        keep = flat[b, :min(length, flat.shape[1])]
        parts.append(torch.cat([keep, flat.new_zeros((length - keep.shape[0], flat.shape[2]))]))
    out = torch.cat(parts) if parts else flat.new_zeros((0, flat.shape[2]))
    return out.squeeze(-1) if padded.dim() == 2 else out


def oracle_dot_interaction(x, self_interaction):
    F_ = x.shape[1]
    i, j = torch.triu_indices(F_, F_, 0 if self_interaction else 1)
    return (x[:, i, :] * x[:, j, :]).sum(-1)


def oracle_cross_layer(x0, xl, weight, bias):
    # U (V xl), in TorchRec's LowRankCrossNet's order: with an Inf in xl, (U V) xl would put NaN in
    # other places than the two-step product every backend computes.
    wx = xl @ weight[1].t() @ weight[0].t() if isinstance(weight, tuple) else xl @ weight.t()
    return x0 * (wx + bias) + xl


def _layer_norm(s, weight, bias, eps):
    mean = s.mean(-1, keepdim=True)
    var = (s - mean).square().mean(-1, keepdim=True)
    return (s - mean) / torch.sqrt(var + eps) * weight + bias


def oracle_fm_compress(x, y, ln_weight, ln_bias, eps):
    s = torch.bmm(x, torch.matmul(x.transpose(1, 2), y)).flatten(1)
    return _layer_norm(s, ln_weight, ln_bias, eps)


def oracle_feature_mix_norm(x, mix, fm, ln_weight, ln_bias, eps):
    s = torch.einsum("of,bfd->bod", mix, x)
    if fm is not None and fm.shape[1]:
        s = torch.cat([s[:, :fm.shape[1]] + fm, s[:, fm.shape[1]:]], 1)
    return _layer_norm(s, ln_weight, ln_bias, eps)


def oracle_embedding_bag(tables, indices, offsets, psw, pooling):
    """tables: list of [rows_t, D_t]; out-of-range indices are dropped (bounds_check warn/skip)."""
    T = len(tables)
    off = offsets.tolist()
    idx = indices.tolist()
    B = (len(off) - 1) // T
    if pooling == "none":
        rows = []
        for t in range(T):
            for b in range(B):
                for p in range(off[t * B + b], off[t * B + b + 1]):
                    r = idx[p]
                    ok = 0 <= r < tables[t].shape[0]
                    row = tables[t][r] if ok else tables[t].new_zeros(tables[t].shape[1])
                    rows.append(row * (psw[p] if psw is not None else 1))
        D = tables[0].shape[1]
        return torch.stack(rows) if rows else tables[0].new_zeros((0, D))
    cols = []
    for t in range(T):
        bags = []
        for b in range(B):
            acc = tables[t].new_zeros(tables[t].shape[1])
            kept = 0
            for p in range(off[t * B + b], off[t * B + b + 1]):
                r = idx[p]
                if 0 <= r < tables[t].shape[0]:
                    acc = acc + tables[t][r] * (psw[p] if psw is not None else 1)
                    kept += 1
            if pooling == "mean" and kept:
                acc = acc / kept
            bags.append(acc)
        cols.append(torch.stack(bags) if bags else tables[t].new_zeros((0, tables[t].shape[1])))
    return torch.cat(cols, 1)


def oracle_attention(q, k, v, seq_offsets, max_seq_len, kind, causal, scale):
    """Softmax / HSTU attention without targets, context, window or biases: masks by selection, so
    an invisible key contributes nothing."""
    off = seq_offsets.tolist()
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    parts = []
    for b in range(len(off) - 1):
        s0, s1 = off[b], off[b + 1]
        L = s1 - s0
        if L == 0:
            continue
        qb, kb, vb = q[s0:s1].transpose(0, 1), k[s0:s1].transpose(0, 1), v[s0:s1].transpose(0, 1)  # [H, L, D]
        s = scale * qb @ kb.transpose(1, 2)
        i = torch.arange(L)
        visible = (i[:, None] >= i[None, :]) if causal else torch.ones(L, L, dtype=torch.bool)
        if kind == "softmax":
            w = torch.softmax(s.masked_fill(~visible, -math.inf), -1)
        else:
            w = torch.where(visible, F.silu(s) / max_seq_len, torch.zeros_like(s))
        parts.append((s0, (w @ vb).transpose(0, 1)))
    if not parts:
        return out
    pieces = []
    cursor = 0
    for s0, o in parts:
        if s0 > cursor:
            pieces.append(out[cursor:s0])
        pieces.append(o)
        cursor = s0 + o.shape[0]
    if cursor < out.shape[0]:
        pieces.append(out[cursor:])
    return torch.cat(pieces)

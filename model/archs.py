"""The arches of the GEM-like model, each with its kernel switch.

Every arch picks its compute kernel in ONE place: a module-level table `{kernels: function}` right
above the arch (POOLED_EMBEDDINGS, JAGGED_ATTENTION, DOT_INTERACTION, WUKONG_BACKEND). "eager" is plain PyTorch;
"fused" is gem_kernels. A fused op that lands replaces one entry of one table, with the same
signature; nothing else in the model changes.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import gem_kernels

from .config import GemConfig

KERNELS = ("eager", "fused")


def check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")


def mlp(sizes: tuple[int, ...] | list[int], final_activation: bool) -> nn.Sequential:
    """Linear layers of widths sizes[0] -> ... -> sizes[-1] with ReLU between (and after the last
    one when final_activation)."""
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(fan_in, fan_out))
        if final_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def mlp_flops(sizes: tuple[int, ...] | list[int], rows: int) -> int:
    """Forward matmul FLOPs of mlp(sizes) on `rows` rows: 2 * rows * fan_in * fan_out per layer."""
    return sum(2 * rows * fan_in * fan_out for fan_in, fan_out in zip(sizes[:-1], sizes[1:]))


# ---------------------------------------------------------------------------------------------
# Sparse arch: one sum-pooled embedding bag per table, all tables in one flat weight (FBGEMM TBE
# layout: table t owns rows table_row_offsets[t] : table_row_offsets[t+1]).
# ---------------------------------------------------------------------------------------------


def pooled_embeddings_eager(weight: torch.Tensor, table_row_offsets: torch.Tensor, indices: torch.Tensor,
                            offsets: torch.Tensor, num_tables: int, batch_size: int) -> torch.Tensor:
    """Sum pooling of every bag of every table: [B, T, D].

    out[b, t] = sum_{i in offsets[t*B+b] : offsets[t*B+b+1]} weight[table_row_offsets[t] + indices[i]]
    (0 for an empty bag); indices/offsets in TorchRec's feature-major KJT layout.
    """
    bag_table = torch.arange(num_tables, device=indices.device).repeat_interleave(batch_size)
    index_table = torch.repeat_interleave(bag_table, offsets.diff(), output_size=indices.numel())
    rows = indices + table_row_offsets[index_table]
    pooled = F.embedding_bag(rows, weight, offsets, mode="sum", include_last_offset=True)  # [T*B, D]
    return pooled.view(num_tables, batch_size, weight.shape[1]).transpose(0, 1)


def pooled_embeddings_fused(weight: torch.Tensor, table_row_offsets: torch.Tensor, indices: torch.Tensor,
                            offsets: torch.Tensor, num_tables: int, batch_size: int) -> torch.Tensor:
    """pooled_embeddings_eager in one gem_kernels.embedding_bag call (FBGEMM TBE layout: the flat
    weight is the packed tables, every table of dim D)."""
    dim = weight.shape[1]
    rows_offsets = torch.cat([table_row_offsets, table_row_offsets.new_full((1,), weight.shape[0])])
    d_offsets = torch.arange(num_tables + 1, device=weight.device, dtype=torch.int64) * dim
    pooled = gem_kernels.embedding_bag(weight.view(-1), table_row_offsets * dim, d_offsets, rows_offsets,
                                       indices, offsets, output_dim=num_tables * dim, pooling="sum")
    return pooled.view(batch_size, num_tables, dim)


POOLED_EMBEDDINGS: dict[str, Callable[..., torch.Tensor]] = {
    "eager": pooled_embeddings_eager,
    "fused": pooled_embeddings_fused,
}


class SparseArch(nn.Module):
    def __init__(self, cfg: GemConfig, kernels: str):
        super().__init__()
        check_kernels(kernels)
        rows = torch.tensor((0,) + cfg.num_embeddings_per_table, dtype=torch.int64).cumsum(0)
        self.num_tables = cfg.num_tables
        self.weight = nn.Parameter(torch.randn(int(rows[-1]), cfg.embedding_dim) / math.sqrt(cfg.embedding_dim))
        self.register_buffer("table_row_offsets", rows[:-1].clone(), persistent=False)
        self.pooled_embeddings = POOLED_EMBEDDINGS[kernels]

    def forward(self, sparse_indices: torch.Tensor, sparse_offsets: torch.Tensor, batch_size: int) -> torch.Tensor:
        return self.pooled_embeddings(self.weight, self.table_row_offsets, sparse_indices, sparse_offsets,
                                      self.num_tables, batch_size)


# ---------------------------------------------------------------------------------------------
# Sequence arch: item + time-bucket embedding -> jagged [S, D] -> pre-norm attention layers ->
# mean over each sequence. Position-wise work (norms, projections, FFN) runs on the jagged rows;
# only the attention core sees the sequence structure.
# ---------------------------------------------------------------------------------------------


def attention_mask(lengths: torch.Tensor, num_targets: torch.Tensor, max_len: int) -> torch.Tensor:
    """Boolean [B, 1, max_len, max_len], True where query i may attend to key j.

    Causal, and target-aware as in HSTU (generative-recommenders): a target item attends to the
    history and to itself, never to another target. Padded query rows attend to themselves, so no
    softmax row is empty (their outputs are dropped by the unpad).
    """
    positions = torch.arange(max_len, device=lengths.device)
    valid = positions < lengths.unsqueeze(1)                                        # [B, L]
    history = positions < (lengths - num_targets).unsqueeze(1)                      # [B, L]
    causal = positions.unsqueeze(1) >= positions.unsqueeze(0)                       # [L, L] (i, j)
    diagonal = positions.unsqueeze(1) == positions.unsqueeze(0)
    keys_ok = (valid & history).unsqueeze(1) & causal                               # [B, L, L]
    return (keys_ok | diagonal).unsqueeze(1)


def _padded_attention(qkv: torch.Tensor, lengths: torch.Tensor, num_targets: torch.Tensor,
                      num_heads: int) -> torch.Tensor:
    """Masked softmax attention on padded qkv [B, L, 3 * H * Dh] -> [B, L, H * Dh]."""
    batch_size, max_len, width = qkv.shape
    head_dim = width // (3 * num_heads)
    q, k, v = qkv.view(batch_size, max_len, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(lengths, num_targets, max_len))
    return out.transpose(1, 2).reshape(batch_size, max_len, num_heads * head_dim)


def _jagged_positions(seq_offsets: torch.Tensor, total_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every jagged row: its sequence and its position within that sequence."""
    lengths = seq_offsets.diff()
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=seq_offsets.device), lengths,
                                  output_size=total_len)
    return seq, torch.arange(total_len, device=seq_offsets.device) - seq_offsets[seq]


def jagged_attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                           num_targets: torch.Tensor, max_len: int) -> torch.Tensor:
    """Causal target-aware softmax attention over jagged q, k, v [S, H, Dh] -> [S, H, Dh].

    Plain PyTorch: pad with index ops, masked scaled_dot_product_attention, unpad. max_len must be
    at least the longest sequence.
    """
    total_len, num_heads, head_dim = q.shape
    qkv = torch.stack([q, k, v], dim=1).reshape(total_len, 3 * num_heads * head_dim)
    seq, pos = _jagged_positions(seq_offsets, total_len)
    padded = qkv.new_zeros(seq_offsets.numel() - 1, max_len, qkv.shape[1]).index_put((seq, pos), qkv)
    out = _padded_attention(padded, seq_offsets.diff(), num_targets, num_heads)
    return out[seq, pos].view(total_len, num_heads, head_dim)


def jagged_attention_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                           num_targets: torch.Tensor, max_len: int) -> torch.Tensor:
    """The same attention as jagged_attention_eager on the jagged rows directly, no padding:
    gem_kernels.jagged_attention's causal visibility with num_targets is exactly attention_mask's."""
    return gem_kernels.jagged_attention(q, k, v, seq_offsets, max_len, kind="softmax", causal=True,
                                        num_targets=num_targets)


JAGGED_ATTENTION: dict[str, Callable[..., torch.Tensor]] = {
    "eager": jagged_attention_eager,
    "fused": jagged_attention_fused,
}


class AttentionLayer(nn.Module):
    """Pre-norm transformer layer on jagged rows: x += W_o attn(LN(x)); x += FFN(LN(x))."""

    def __init__(self, cfg: GemConfig, attention: Callable[..., torch.Tensor]):
        super().__init__()
        dim = cfg.embedding_dim
        self.num_heads = cfg.num_heads
        self.attention = attention
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, cfg.ffn_multiplier * dim), nn.GELU(),
                                 nn.Linear(cfg.ffn_multiplier * dim, dim))

    def forward(self, x: torch.Tensor, seq_offsets: torch.Tensor, num_targets: torch.Tensor,
                max_len: int) -> torch.Tensor:
        total_len, dim = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(total_len, 3, self.num_heads, dim // self.num_heads).unbind(1)
        x = x + self.out(self.attention(q, k, v, seq_offsets, num_targets, max_len).reshape(total_len, dim))
        return x + self.ffn(self.ffn_norm(x))


def time_buckets(seq_timestamps: torch.Tensor, seq_offsets: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Log2-bucketed age of each event relative to its sequence's last event: [S] int64 in [0, num_buckets)."""
    lengths = seq_offsets.diff()
    # Gather each sequence's last timestamp; the appended 0 keeps the gather in bounds when S == 0
    # (an empty sequence's entry is repeated zero times, so its value never matters).
    last = torch.cat([seq_timestamps, seq_timestamps.new_zeros(1)])[(seq_offsets[1:] - 1).clamp(min=0)]
    age = torch.repeat_interleave(last, lengths, output_size=seq_timestamps.numel()) - seq_timestamps
    return torch.log2(age.double() + 1.0).long().clamp_(0, num_buckets - 1)


def jagged_mean(x: torch.Tensor, seq_offsets: torch.Tensor) -> torch.Tensor:
    """Mean of each sequence's rows: x [S, D] -> [B, D], 0 for an empty sequence."""
    lengths = seq_offsets.diff()
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths, output_size=x.shape[0])
    sums = x.new_zeros(lengths.numel(), x.shape[1]).index_add(0, seq, x)
    return sums / lengths.clamp(min=1).unsqueeze(1).to(x.dtype)


class SequenceArch(nn.Module):
    def __init__(self, cfg: GemConfig, kernels: str):
        super().__init__()
        check_kernels(kernels)
        dim = cfg.embedding_dim
        self.num_time_buckets = cfg.num_time_buckets
        self.item_embedding = nn.Parameter(torch.randn(cfg.num_items, dim) / math.sqrt(dim))
        self.time_embedding = nn.Parameter(torch.randn(cfg.num_time_buckets, dim) / math.sqrt(dim))
        attention = JAGGED_ATTENTION[kernels]
        self.layers = nn.ModuleList(AttentionLayer(cfg, attention) for _ in range(cfg.num_attention_layers))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, seq_ids: torch.Tensor, seq_timestamps: torch.Tensor, seq_offsets: torch.Tensor,
                num_targets: torch.Tensor) -> torch.Tensor:
        """-> the user representation [B, D]: mean over each sequence's final rows (0 when empty)."""
        x = (F.embedding(seq_ids, self.item_embedding)
             + F.embedding(time_buckets(seq_timestamps, seq_offsets, self.num_time_buckets), self.time_embedding))
        # Padded length of the attention: the longest sequence (at least 1, so an all-empty batch
        # still has a well-formed, fully dropped, padded tensor). One host sync per forward.
        max_len = max(int(seq_offsets.diff().max()), 1) if seq_offsets.numel() > 1 else 1
        for layer in self.layers:
            x = layer(x, seq_offsets, num_targets, max_len)
        return jagged_mean(self.final_norm(x), seq_offsets)


# ---------------------------------------------------------------------------------------------
# Interaction arch: DLRM dot interaction of the [B, F, D] feature stack, upper triangle i < j.
# ---------------------------------------------------------------------------------------------


def dot_interaction_eager(features: torch.Tensor) -> torch.Tensor:
    """features [B, F, D] -> [B, F*(F-1)/2]: <features[:, i], features[:, j]> for i < j, row-major."""
    num_features = features.shape[1]
    gram = torch.bmm(features, features.transpose(1, 2))
    i, j = torch.triu_indices(num_features, num_features, offset=1, device=features.device)
    return gram[:, i, j]


DOT_INTERACTION: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "eager": dot_interaction_eager,
    "fused": gem_kernels.dot_interaction,
}


# Wukong interaction: the stack's fused ops (fm_compress) run on gem_kernels' reference backend
# (plain PyTorch, the paper's formulation) for "eager" and on the auto-selected backend for "fused".
WUKONG_BACKEND: dict[str, str | None] = {
    "eager": "reference",
    "fused": None,
}


class InteractionArch(nn.Module):
    """[dense_out, interaction(features)] -> over arch MLP -> num_tasks logits (the task heads).

    interaction "dot": the F*(F-1)/2 pairwise dot products; "wukong": a WukongStack over the F
    features, its [B, fm_out + lcb_out, D] output flattened.
    """

    def __init__(self, cfg: GemConfig, kernels: str):
        super().__init__()
        check_kernels(kernels)
        self.interaction = cfg.interaction
        if cfg.interaction == "dot":
            self.dot_interaction = DOT_INTERACTION[kernels]
        else:
            self.wukong = gem_kernels.nn.WukongStack(cfg.wukong_layers, cfg.num_features, cfg.wukong_fm_out,
                                                     cfg.wukong_lcb_out, cfg.embedding_dim, cfg.wukong_fm_rank,
                                                     list(cfg.wukong_mlp), backend=WUKONG_BACKEND[kernels])
        over_sizes = (cfg.embedding_dim + cfg.interaction_width,) + cfg.over_arch_layers
        self.over_arch = mlp(over_sizes, final_activation=True)
        self.task_heads = nn.Linear(over_sizes[-1], cfg.num_tasks)

    def forward(self, dense_out: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        if self.interaction == "dot":
            interactions = self.dot_interaction(features)
        else:
            interactions = self.wukong(features).flatten(1)
        return self.task_heads(self.over_arch(torch.cat([dense_out, interactions], dim=1)))

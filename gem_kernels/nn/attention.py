"""nn.Modules on jagged attention: multi-head attention and the HSTU block, on jagged [N, embed_dim] inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.attention import jagged_attention


class _RelativeBias(nn.Module):
    """Optional learned relative position bias [H, 2*max_seq_len-1] and log-time bias [H, num_buckets+1]."""

    def __init__(self, num_heads: int, max_seq_len: int, num_time_buckets: int):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.pos_bias = nn.Parameter(torch.zeros(num_heads, 2 * max_seq_len - 1)) if max_seq_len > 0 else None
        self.time_bias = nn.Parameter(torch.zeros(num_heads, num_time_buckets + 1)) if num_time_buckets > 0 else None

    def check(self, max_seq_len: int, timestamps) -> None:
        if self.pos_bias is not None and max_seq_len != self.max_seq_len:
            raise ValueError(f"max_seq_len must be {self.max_seq_len} (the pos_bias size of this module), "
                             f"got {max_seq_len}")
        if self.time_bias is not None and timestamps is None:
            raise ValueError("timestamps must be given to a module built with num_time_buckets > 0, got None")


class JaggedMultiheadAttention(nn.Module):
    """Multi-head attention within each sequence of a jagged batch.

    ``x`` [N, embed_dim] (sequences back to back, ``seq_offsets`` [B+1]) -> one fused projection to
    Q, K, V ([N, H, head_dim] each) -> ``jagged_attention`` -> output projection -> [N, embed_dim].

    Args:
        embed_dim, num_heads: embed_dim must be divisible by num_heads unless head_dim is given.
        kind: "softmax" | "hstu" (see ``gem_kernels.jagged_attention``).
        head_dim: per-head dim of q, k, v (default embed_dim // num_heads).
        causal, contextual_len, max_attn_len: the visibility options of ``jagged_attention``.
        max_seq_len: > 0 adds a learned relative position bias (then every call must pass this max_seq_len).
        num_time_buckets: > 0 adds a learned log-time bias (calls must pass timestamps).
        backend: the backend of the attention op (None: ``use_backend``'s default).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, kind: str = "softmax", head_dim: int | None = None,
                 causal: bool = True, contextual_len: int = 0, max_attn_len: int = 0, max_seq_len: int = 0,
                 num_time_buckets: int = 0, bias: bool = True, backend: str | None = None):
        super().__init__()
        if head_dim is None:
            if embed_dim % num_heads != 0:
                raise ValueError(f"embed_dim must be divisible by num_heads = {num_heads}, got {embed_dim}")
            head_dim = embed_dim // num_heads
        self.num_heads, self.head_dim, self.kind = num_heads, head_dim, kind
        self.causal, self.contextual_len, self.max_attn_len = causal, contextual_len, max_attn_len
        self.backend = backend
        self.qkv = nn.Linear(embed_dim, 3 * num_heads * head_dim, bias=bias)
        self.out = nn.Linear(num_heads * head_dim, embed_dim, bias=bias)
        self.bias = _RelativeBias(num_heads, max_seq_len, num_time_buckets)

    def forward(self, x: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int,
                num_targets: torch.Tensor | None = None, timestamps: torch.Tensor | None = None) -> torch.Tensor:
        self.bias.check(max_seq_len, timestamps)
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        attn = jagged_attention(q, k, v, seq_offsets, max_seq_len, kind=self.kind, causal=self.causal,
                                num_targets=num_targets, contextual_len=self.contextual_len,
                                max_attn_len=self.max_attn_len, pos_bias=self.bias.pos_bias,
                                time_bias=self.bias.time_bias,
                                timestamps=timestamps if self.bias.time_bias is not None else None,
                                backend=self.backend)
        return self.out(attn.reshape(x.shape[0], self.num_heads * self.head_dim))  # not -1: N may be 0


class HSTULayer(nn.Module):
    """The HSTU block of generative-recommenders (Zhai et al. 2024), on a jagged batch::

        u, v, q, k = split(silu(Linear(LayerNorm(x))))         # one fused projection
        a = jagged_attention(q, k, v, kind="hstu")             # [N, H, linear_dim]
        y = x + Linear(dropout(u * LayerNorm(a)))              # gating by u, residual

    Args:
        embed_dim: model dim of x [N, embed_dim].
        num_heads: H.
        linear_dim: per-head dim of u and v.
        attention_dim: per-head dim of q and k.
        causal, contextual_len, max_attn_len, max_seq_len, num_time_buckets, backend: as in
            ``JaggedMultiheadAttention``.
        dropout: on the gated attention output.
        eps: of both layer norms.
    """

    def __init__(self, embed_dim: int, num_heads: int, linear_dim: int, attention_dim: int, *, causal: bool = True,
                 contextual_len: int = 0, max_attn_len: int = 0, max_seq_len: int = 0, num_time_buckets: int = 0,
                 dropout: float = 0.0, eps: float = 1e-6, backend: str | None = None):
        super().__init__()
        self.num_heads, self.linear_dim, self.attention_dim = num_heads, linear_dim, attention_dim
        self.causal, self.contextual_len, self.max_attn_len = causal, contextual_len, max_attn_len
        self.backend = backend
        self.input_norm = nn.LayerNorm(embed_dim, eps=eps)
        self.uvqk = nn.Linear(embed_dim, num_heads * (2 * linear_dim + 2 * attention_dim))
        self.attn_norm = nn.LayerNorm(num_heads * linear_dim, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(num_heads * linear_dim, embed_dim)
        self.bias = _RelativeBias(num_heads, max_seq_len, num_time_buckets)

    def forward(self, x: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int,
                num_targets: torch.Tensor | None = None, timestamps: torch.Tensor | None = None) -> torch.Tensor:
        self.bias.check(max_seq_len, timestamps)
        n, h = x.shape[0], self.num_heads
        uvqk = F.silu(self.uvqk(self.input_norm(x)))
        u, v, q, k = uvqk.split([h * self.linear_dim, h * self.linear_dim, h * self.attention_dim,
                                 h * self.attention_dim], dim=-1)
        attn = jagged_attention(q.reshape(n, h, self.attention_dim), k.reshape(n, h, self.attention_dim),
                                v.reshape(n, h, self.linear_dim), seq_offsets, max_seq_len, kind="hstu",
                                causal=self.causal, num_targets=num_targets, contextual_len=self.contextual_len,
                                max_attn_len=self.max_attn_len, pos_bias=self.bias.pos_bias,
                                time_bias=self.bias.time_bias,
                                timestamps=timestamps if self.bias.time_bias is not None else None,
                                backend=self.backend)
        gated = u * self.attn_norm(attn.reshape(n, h * self.linear_dim))
        return x + self.out(self.dropout(gated))

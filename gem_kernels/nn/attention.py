"""nn.Modules on jagged attention: multi-head attention and the HSTU block, on jagged [N, embed_dim] inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._validate import FLOAT_DTYPES
from ..ops.attention import jagged_attention
from ..ops.hstu_layer import hstu_layer_linear_layout
from ..ops.jagged import jagged_to_padded, padded_to_jagged
from ._fx import NotScriptable, is_proxy, trace_call


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
        num_time_buckets: > 0 adds a learned log-time bias (calls must pass timestamps; query_timestamps,
            default timestamps, is the query side of bucket(tq_i - t_j), see ``jagged_attention``).
            Without a time bias both are ignored.
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
                num_targets: torch.Tensor | None = None, timestamps: torch.Tensor | None = None,
                query_timestamps: torch.Tensor | None = None) -> torch.Tensor:
        self.bias.check(max_seq_len, timestamps)
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        attn = jagged_attention(q, k, v, seq_offsets, max_seq_len, kind=self.kind, causal=self.causal,
                                num_targets=num_targets, contextual_len=self.contextual_len,
                                max_attn_len=self.max_attn_len, pos_bias=self.bias.pos_bias,
                                time_bias=self.bias.time_bias,
                                timestamps=timestamps if self.bias.time_bias is not None else None,
                                query_timestamps=query_timestamps if self.bias.time_bias is not None else None,
                                backend=self.backend)
        return self.out(attn.reshape(x.shape[0], self.num_heads * self.head_dim))  # not -1: N may be 0


class HSTULayer(nn.Module):
    """The HSTU layer of generative-recommenders (Zhai et al. 2024) on a jagged batch, one call of the
    fused ``gem_kernels.ops.hstu_layer.hstu_layer`` (maths: ``gem_kernels.reference.hstu_layer``)::

        u, v, q, k = split(LayerNorm(x) @ W_uvqk + b_uvqk)     # one projection
        u = silu(u); v, q, k = silu(v, q, k) if silu_qkv
        a = jagged_attention(q, k, v, kind="hstu", scale=attn_alpha)   # [N, H * linear_dim]
        y = u * Norm(a)                                        # LayerNorm, or GroupNorm per head
        out = x + dropout([u] + [a] + [y]) @ W_out (+ b_out)   # [u] if concat_u, [a] if concat_x

    The defaults are the HSTU paper's block (SiLU on all four, y alone, an output bias);
    ``from_generative_recommenders(stu_layer)`` builds generative-recommenders' ``STULayer`` (SiLU on
    u only, concat_u and concat_x, no output bias) with a copy of its weights.

    Args:
        embed_dim: model dim of x [N, embed_dim].
        num_heads: H.
        linear_dim: per-head dim of u and v.
        attention_dim: per-head dim of q and k.
        causal, contextual_len, max_attn_len, max_seq_len, num_time_buckets, backend: as in
            ``JaggedMultiheadAttention`` (backend: of the attention and of the two projection halves).
        dropout: on the concatenated input of the output projection (training mode only).
        eps: of both norms.
        silu_qkv: SiLU on v, q, k too (STULayer: False).
        concat_u, concat_x: concatenate u and a before y (STULayer: both).
        group_norm: GroupNorm of a over the H heads (weight and bias [H]) instead of LayerNorm over
            H * linear_dim; then concat_u and concat_x must be equal.
        attn_alpha: the attention's scale (default 1 / sqrt(attention_dim)).
        output_bias: whether the output projection has a bias (STULayer: no).
        target_aware: pass num_targets to the attention (STULayer's ``target_aware``); False ignores it.
    """

    def __init__(self, embed_dim: int, num_heads: int, linear_dim: int, attention_dim: int, *, causal: bool = True,
                 contextual_len: int = 0, max_attn_len: int = 0, max_seq_len: int = 0, num_time_buckets: int = 0,
                 dropout: float = 0.0, eps: float = 1e-6, silu_qkv: bool = True, concat_u: bool = False,
                 concat_x: bool = False, group_norm: bool = False, attn_alpha: float | None = None,
                 output_bias: bool = True, target_aware: bool = True, backend: str | None = None):
        super().__init__()
        if group_norm and concat_u != concat_x:
            raise ValueError(f"with group_norm, concat_u and concat_x must be equal (generative-recommenders "
                             f"concatenates only both), got concat_u={concat_u}, concat_x={concat_x}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.num_heads, self.linear_dim, self.attention_dim = num_heads, linear_dim, attention_dim
        self.causal, self.contextual_len, self.max_attn_len = causal, contextual_len, max_attn_len
        self.silu_qkv, self.concat_u, self.concat_x, self.group_norm = silu_qkv, concat_u, concat_x, group_norm
        self.attn_alpha, self.target_aware, self.eps, self.backend = attn_alpha, target_aware, eps, backend
        width = num_heads * linear_dim
        self.input_norm = nn.LayerNorm(embed_dim, eps=eps)
        self.uvqk = nn.Linear(embed_dim, num_heads * (2 * linear_dim + 2 * attention_dim))
        # GroupNorm(H, H) on [N, H, linear_dim]: one group per head, weight and bias per head (STULayer's).
        self.attn_norm = nn.GroupNorm(num_heads, num_heads, eps=eps) if group_norm else nn.LayerNorm(width, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(width * (1 + concat_u + concat_x), embed_dim, bias=output_bias)
        self.bias = _RelativeBias(num_heads, max_seq_len, num_time_buckets)

    @classmethod
    def from_generative_recommenders(cls, stu_layer: nn.Module, *, backend: str | None = None) -> "HSTULayer":
        """An ``HSTULayer`` computing generative-recommenders' ``STULayer`` (modules/stu.py), with a copy
        of its weights (same dtype and device) and its training mode. ``forward(x, seq_offsets,
        max_seq_len, num_targets)`` then equals ``stu_layer(x=x, x_lengths=seq_offsets.diff(),
        x_offsets=seq_offsets, max_seq_len=max_seq_len, num_targets=num_targets)``; dropout (its
        ``output_dropout_ratio``) draws its own mask."""
        missing = [a for a in ("_uvqk_weight", "_uvqk_beta", "_output_weight", "_num_heads", "_hidden_dim",
                               "_attention_dim", "_use_group_norm") if not hasattr(stu_layer, a)]
        if missing:
            raise TypeError(f"stu_layer must be a generative_recommenders STULayer, got {type(stu_layer).__name__} "
                            f"(missing {missing})")
        uvqk_weight = stu_layer._uvqk_weight
        layer = cls(uvqk_weight.shape[0], stu_layer._num_heads, stu_layer._hidden_dim, stu_layer._attention_dim,
                    causal=stu_layer._causal, contextual_len=stu_layer._contextual_seq_len,
                    max_attn_len=stu_layer._max_attn_len, dropout=stu_layer._output_dropout_ratio,
                    silu_qkv=False, concat_u=True, concat_x=True, group_norm=stu_layer._use_group_norm,
                    attn_alpha=stu_layer._attn_alpha, output_bias=False, target_aware=stu_layer._target_aware,
                    backend=backend).to(device=uvqk_weight.device, dtype=uvqk_weight.dtype)
        with torch.no_grad():
            layer.input_norm.weight.copy_(stu_layer._input_norm_weight)
            layer.input_norm.bias.copy_(stu_layer._input_norm_bias)
            layer.uvqk.weight.copy_(uvqk_weight.t())  # GR stores [in, out], nn.Linear [out, in]
            layer.uvqk.bias.copy_(stu_layer._uvqk_beta)
            layer.attn_norm.weight.copy_(stu_layer._output_norm_weight)
            layer.attn_norm.bias.copy_(stu_layer._output_norm_bias)
            layer.out.weight.copy_(stu_layer._output_weight.t())
        return layer.train(stu_layer.training)

    def forward(self, x: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int,
                num_targets: torch.Tensor | None = None, timestamps: torch.Tensor | None = None,
                query_timestamps: torch.Tensor | None = None) -> torch.Tensor:
        if is_proxy(x, seq_offsets, max_seq_len, num_targets, timestamps, query_timestamps):
            return trace_call(self, x, seq_offsets, max_seq_len, num_targets, timestamps, query_timestamps)
        self.bias.check(max_seq_len, timestamps)
        mask = None
        if self.training and self.dropout.p > 0:
            # F.dropout's distribution (GR applies it to the concat); the mask is one operand of the
            # output GEMM's prologue, so no dropped copy of the concat is ever stored.
            keep = 1.0 - self.dropout.p
            mask = torch.empty(x.shape[0], self.out.in_features, device=x.device, dtype=x.dtype).bernoulli_(keep)
            mask.div_(keep)
        time_bias = self.bias.time_bias
        # The weights in nn.Linear's layout: the eager fast path reads them transposed inside its one node.
        return hstu_layer_linear_layout(
            x, seq_offsets, max_seq_len, num_targets if self.target_aware else None, self.input_norm.weight,
            self.input_norm.bias, self.uvqk.weight, self.uvqk.bias, self.attn_norm.weight, self.attn_norm.bias,
            self.out.weight, self.out.bias, self.num_heads, self.linear_dim, self.attention_dim, self.attn_alpha,
            self.causal, self.contextual_len, self.max_attn_len, self.bias.pos_bias, time_bias,
            timestamps if time_bias is not None else None, query_timestamps if time_bias is not None else None,
            self.silu_qkv, self.group_norm, self.concat_u, self.concat_x, mask, self.eps, self.backend, True)

    def cached_forward(self, delta_x: torch.Tensor, cache, layer: int, users: list[int], max_seq_len: int, *,
                       num_targets: torch.Tensor | None = None, timestamps: torch.Tensor | None = None,
                       query_timestamps: torch.Tensor | None = None, delta_start: list[int] | None = None,
                       append: bool = False) -> torch.Tensor:
        """This layer on the next delta rows of every user, over the users' rows held in `cache` (M-FALCON).

        The rows of user b are: its cached rows (keys and values of this layer, from
        ``cache.gather(layer, users)``), then, at positions delta_start[b] .. delta_start[b] + delta - 1,
        the delta new rows delta_x[b * delta : (b + 1) * delta]. The output equals `forward`'s on those
        rows of the whole sequences (causal; same biases, mask and normaliser), computed at delta * L
        attention work (`gem_kernels.cached_jagged_attention`). Positions between the cached rows and
        delta_start[b] (e.g. the candidates of earlier micro-batches) hold no rows: they must be targets
        (num_targets[b] >= delta_start[b] + delta - cached length), so that no delta row may see them.

        Args:
            delta_x: [B * delta, embed_dim], B = len(users), delta the same for every user.
            cache: a gem_kernels.inference.KVCache with this layer's H, attention_dim, linear_dim.
            layer: this layer's index in `cache`.
            users: the users' keys in `cache` (a user it does not hold has no cached rows).
            max_seq_len, num_targets: as in `forward`, over the whole sequences (num_targets [B]).
            timestamps: [B * delta] int, the new rows' timestamps (the cached rows' are in the cache);
                required with the time bias.
            query_timestamps: [B * delta] int or None (= timestamps), as in `forward`.
            delta_start: B ints, the positions of the first new rows, >= the cached lengths; None = the
                cached lengths. Python ints, like every size here: the layer reads no tensor's values,
                so it traces (torch.export) with the cache's contents as constants.
            append: also append the new rows' keys, values and timestamps to `cache` (encoding a history
                incrementally); candidates are scored with append=False.

        Returns:
            [B * delta, embed_dim]. Forward only (inference): run it under torch.no_grad().
        """
        from ..ops.cached_attention import cached_jagged_attention

        if not self.causal:
            raise ValueError("cached_forward needs a causal layer (later rows must not change earlier ones), "
                             "got causal=False")
        self.bias.check(max_seq_len, timestamps)
        n, h, num_users = delta_x.shape[0], self.num_heads, len(users)
        if (num_users == 0 and n != 0) or (num_users > 0 and n % num_users != 0):
            raise ValueError(f"delta_x must have len(users) * delta rows (len(users) = {num_users}), got {n} rows")
        delta = n // num_users if num_users else 0
        uvqk = F.silu(self.uvqk(self.input_norm(delta_x)))
        u, v, q, k = uvqk.split([h * self.linear_dim, h * self.linear_dim, h * self.attention_dim,
                                 h * self.attention_dim], dim=-1)
        q, k = q.reshape(n, h, self.attention_dim), k.reshape(n, h, self.attention_dim)
        v = v.reshape(n, h, self.linear_dim)
        cached_lengths = [cache.length(user, layer) for user in users]
        starts = cached_lengths if delta_start is None else [int(s) for s in delta_start]
        if len(starts) != num_users or any(s < c for s, c in zip(starts, cached_lengths)):
            raise ValueError(f"delta_start must be len(users) = {num_users} positions >= the cached lengths "
                             f"{cached_lengths}, got {delta_start}")
        time_bias = self.bias.time_bias
        if time_bias is not None and timestamps is None:
            raise ValueError("this layer has a time bias: timestamps of the new rows are required, got None")
        bounds = [0]
        for s in starts:
            bounds.append(bounds[-1] + s + delta)
        device = delta_x.device
        offsets = torch.tensor(bounds, device=device)
        if num_users == 1 and not cache.paged:
            # One user, contiguous buffer: the new rows go to its spare rows, the attention reads a view of
            # the buffer (no copy of the cached rows).
            whole_k, whole_v, whole_ts = cache.scratch(layer, users[0], starts[0], k, v, timestamps)
        else:
            whole_k, whole_v, whole_ts = self._gathered(cache, layer, users, k, v, timestamps, cached_lengths,
                                                        starts, bounds, delta)
        if time_bias is not None and whole_ts is None:
            raise ValueError("this layer has a time bias: the cached rows need timestamps (append them with "
                             "timestamps), got rows without")
        attn = cached_jagged_attention(q, whole_k, whole_v, offsets, max_seq_len, kind="hstu",
                                       num_targets=num_targets, contextual_len=self.contextual_len,
                                       max_attn_len=self.max_attn_len, pos_bias=self.bias.pos_bias,
                                       time_bias=time_bias, timestamps=whole_ts if time_bias is not None else None,
                                       query_timestamps=query_timestamps if time_bias is not None else None,
                                       backend=self.backend)
        if append:
            for b, user in enumerate(users):
                rows = slice(b * delta, (b + 1) * delta)
                cache.append(layer, user, k[rows], v[rows], None if timestamps is None else timestamps[rows])
        gated = u * self.attn_norm(attn.reshape(n, h * self.linear_dim))
        return delta_x + self.out(self.dropout(gated))


    @staticmethod
    def _gathered(cache, layer, users, k, v, timestamps, cached_lengths, starts, bounds, delta):
        """(k, v, timestamps or None) of the users' whole sequences: the cached rows (a copy gathered from
        the cache), zeros up to starts[b], then the new rows."""
        cached_k, cached_v, cached_ts, _ = cache.gather(layer, users)
        device, n, num_users = k.device, k.shape[0], len(users)
        cached_rows = torch.arange(cached_k.shape[0], device=device) + torch.tensor(
            [b - sum(cached_lengths[:i]) for i, b in enumerate(bounds[:-1])], device=device).repeat_interleave(
            torch.tensor(cached_lengths, device=device), output_size=cached_k.shape[0])
        new_rows = (torch.tensor([b + s for b, s in zip(bounds, starts)], device=device).repeat_interleave(
            delta, output_size=n) + torch.arange(delta, device=device).repeat(num_users))

        def whole(cached_part, new_part):
            full = new_part.new_zeros((bounds[-1], *new_part.shape[1:]))
            return full.index_copy(0, cached_rows, cached_part.to(new_part.dtype)).index_copy(0, new_rows, new_part)

        whole_ts = None
        if timestamps is not None and cached_ts is not None:
            whole_ts = whole(cached_ts, timestamps.long())
        return whole(cached_k, k), whole(cached_v, v), whole_ts


def _end_padding_lengths(key_padding_mask: torch.Tensor, batch: int, length: int) -> torch.Tensor | None:
    """Sequence lengths [B] when ``key_padding_mask`` (bool, True = pad; or float, -inf = pad and 0
    elsewhere) pads only at the end of each row, else None."""
    if key_padding_mask.shape != (batch, length):
        return None
    if key_padding_mask.dtype == torch.bool:
        pad = key_padding_mask
    elif key_padding_mask.is_floating_point():
        pad = torch.isneginf(key_padding_mask)
        if bool((key_padding_mask.masked_fill(pad, 0) != 0).any()):
            return None
    else:
        return None
    lengths = length - pad.sum(1)
    expected = torch.arange(length, device=pad.device).unsqueeze(0) >= lengths.unsqueeze(1)
    return lengths if torch.equal(pad, expected) else None


def _is_causal_mask(attn_mask: torch.Tensor, length: int) -> bool:
    """Whether ``attn_mask`` is the [L, L] causal mask: bool True above the diagonal (masked), or float
    -inf above and 0 on and below it (``nn.Transformer.generate_square_subsequent_mask``)."""
    if attn_mask.shape != (length, length):
        return False
    upper = torch.ones(length, length, dtype=torch.bool, device=attn_mask.device).triu(1)
    if attn_mask.dtype == torch.bool:
        return torch.equal(attn_mask, upper)
    if not attn_mask.is_floating_point():
        return False
    return torch.equal(torch.isneginf(attn_mask), upper) and not bool(attn_mask.masked_fill(upper, 0).any())


class MultiheadAttention(NotScriptable, nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` whose self-attention calls over end-padded rows run on the jagged rows.

    A call ``mha(x, x, x, key_padding_mask=..., need_weights=False, attn_mask=..., is_causal=...)``
    (batch_first, 3-D x, dropout 0 or eval mode) whose ``key_padding_mask`` pads only at the end of
    each row (or is None) and whose ``attn_mask`` is None or the causal mask packs the valid rows
    (``padded_to_jagged``), projects them with the module's own ``in_proj`` weights, runs
    ``gem_kernels.jagged_attention(kind="softmax")``, projects with ``out_proj`` and pads back: padded
    positions are never computed and come out as zeros (torch computes a value there that no valid
    position ever reads). Every other call runs ``nn.MultiheadAttention.forward`` unchanged and is
    counted in ``fallbacks`` (``fallback_reasons`` says why), so an answer is never wrong at a valid
    position. Padded positions (``key_padding_mask`` True) hold zeros on the fused path and torch's
    values on a fallback: read only valid positions (no valid position reads a padded one).

    Same parameters, buffers and ``state_dict()`` keys as torch's module (it is one); build it with
    ``MultiheadAttention.from_torch(mha)``, which shares ``mha``'s Parameters. torch's inference fast
    path of ``nn.TransformerEncoderLayer`` (eval mode under no_grad) bypasses ``self_attn`` and keeps
    torch's own fused kernel.
    """

    backend: str | None = None

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, backend: str | None = None) -> "MultiheadAttention":
        new = cls.__new__(cls)
        new.__dict__.update(mha.__dict__)
        for name, value in mha.__dict__.items():  # own containers (parameters, hooks), the same tensors
            if isinstance(value, (dict, set)):
                new.__dict__[name] = type(value)(value)
        new.backend = backend
        new.fallbacks = 0
        new.fallback_reasons = {}
        return new

    def _why_not_fused(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal) -> str | None:
        if need_weights:
            return "need_weights=True"
        if not (query is key and key is value):
            return "not self-attention (query, key, value are not one tensor)"
        if not self.batch_first:
            return "batch_first=False"
        if query.dim() != 3 or query.is_nested:
            return "input is not a batched 3-D dense tensor"
        if self.training and self.dropout > 0:
            return "dropout > 0 in training mode"
        if self.in_proj_weight is None or self.bias_k is not None or self.add_zero_attn:
            return "separate q/k/v projections, add_bias_kv or add_zero_attn"
        if query.dtype not in FLOAT_DTYPES:
            return f"dtype {query.dtype}"
        if is_causal and attn_mask is None:
            return "is_causal=True without attn_mask"  # torch raises; the original call says so
        return None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        if is_proxy(query, key, value, key_padding_mask, attn_mask):
            return trace_call(self, query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                              attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)
        if key_padding_mask is not None and key.dim() == 3 and not key.is_nested:
            # torch's own check on this path is a bare AssertionError (about a "key_padded_mask")
            shape = tuple(key.shape[:2]) if self.batch_first else (key.shape[1], key.shape[0])
            if tuple(key_padding_mask.shape) != shape:
                raise ValueError(f"key_padding_mask must have shape (batch, source length) = {shape}, got "
                                 f"{tuple(key_padding_mask.shape)}")
        why = self._why_not_fused(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        if why is None:
            why, lengths, causal = _jagged_masks(query, key_padding_mask, attn_mask)
        if why is not None:
            self.fallbacks += 1
            self.fallback_reasons[why] = self.fallback_reasons.get(why, 0) + 1
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                                   is_causal=is_causal)
        return self._jagged_forward(query, lengths, causal), None

    def _jagged_forward(self, x: torch.Tensor, lengths: torch.Tensor | None, causal: bool) -> torch.Tensor:
        rows, seq_offsets = _pack(x, lengths, self.backend)
        out = _attention_rows(self, rows, seq_offsets, x.shape[1], causal, self.backend)
        return _unpack(out, x, lengths, seq_offsets, self.backend)


def _pack(x: torch.Tensor, lengths: torch.Tensor | None, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid rows [N, E] of x [B, L, E] (end padding; lengths None = no padding) and seq_offsets [B+1]."""
    batch, length, embed_dim = x.shape
    if lengths is None:
        seq_offsets = torch.arange(0, (batch + 1) * length, max(length, 1), device=x.device)[:batch + 1]
        return x.reshape(batch * length, embed_dim), seq_offsets
    seq_offsets = F.pad(lengths.cumsum(0), (1, 0))
    return padded_to_jagged(x, seq_offsets, int(seq_offsets[-1]), backend=backend), seq_offsets


def _unpack(rows: torch.Tensor, like: torch.Tensor, lengths: torch.Tensor | None, seq_offsets: torch.Tensor,
            backend) -> torch.Tensor:
    batch, length, _ = like.shape
    if lengths is None:
        return rows.view(batch, length, rows.shape[-1])
    return jagged_to_padded(rows, seq_offsets, length, backend=backend)


def _attention_rows(mha: nn.MultiheadAttention, rows: torch.Tensor, seq_offsets: torch.Tensor, max_len: int,
                    causal: bool, backend) -> torch.Tensor:
    """``mha``'s self-attention (in_proj, softmax attention per sequence, out_proj) on jagged rows [N, E]."""
    total, embed_dim = rows.shape
    # Three projections, not one [N, 3E] one: q, k, v come out contiguous, where the views of one
    # would be copied by the attention op and their gradients stacked back in the backward (1 ms
    # less per layer fwd+bwd at B=64, L=256, E=64 on one CPU thread; the same values).
    biases = mha.in_proj_bias.chunk(3) if mha.in_proj_bias is not None else (None, None, None)
    q, k, v = (F.linear(rows, w, b).view(total, mha.num_heads, mha.head_dim)
               for w, b in zip(mha.in_proj_weight.chunk(3), biases))
    attn = jagged_attention(q, k, v, seq_offsets, max_len, kind="softmax", causal=causal, backend=backend)
    return F.linear(attn.reshape(total, embed_dim), mha.out_proj.weight, mha.out_proj.bias)


def _jagged_masks(x: torch.Tensor, key_padding_mask, attn_mask) -> tuple[str | None, torch.Tensor | None, bool]:
    """(why not, lengths or None, causal) for self-attention over x [B, L, E] with these masks."""
    causal = False
    if attn_mask is not None:
        causal = _is_causal_mask(attn_mask, x.shape[1])
        if not causal:
            return "attn_mask is not the causal mask", None, False
    lengths = None
    if key_padding_mask is not None:
        lengths = _end_padding_lengths(key_padding_mask, x.shape[0], x.shape[1])
        if lengths is None:
            return "key_padding_mask does not pad only at the end of each row", None, False
    return None, lengths, causal


class TransformerEncoderLayer(NotScriptable, nn.TransformerEncoderLayer):
    """``torch.nn.TransformerEncoderLayer`` that runs the whole layer on the valid rows of end-padded input.

    When the call's ``src_key_padding_mask`` pads only at the end of each row (or is None), ``src_mask``
    is None or the causal mask, the input is batch_first 3-D and no dropout is active (p = 0 or eval
    mode), the valid rows are packed once and the self-attention (``gem_kernels.jagged_attention``
    between the same in/out projections), both LayerNorms and the feed-forward block run on them
    only; padded positions come out as zeros (torch computes values there that no valid position
    reads; read only valid positions). Any other call runs ``nn.TransformerEncoderLayer.forward``
    (whose ``self_attn``, when swapped, still fuses what it can) and counts in ``fallbacks``
    (``fallback_reasons``), which ``SwapReport.fallbacks`` adds up. ``is_causal=True`` without
    ``src_mask`` is such a call: torch's own forward raises there, and so does this one. Same parameters and ``state_dict()`` keys (it is one); build it
    with ``TransformerEncoderLayer.from_torch(layer)``, which shares ``layer``'s submodules.
    """

    backend: str | None = None

    @classmethod
    def from_torch(cls, layer: nn.TransformerEncoderLayer, backend: str | None = None) -> "TransformerEncoderLayer":
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)
        for name, value in layer.__dict__.items():
            if isinstance(value, (dict, set)):
                new.__dict__[name] = type(value)(value)
        new.backend = backend
        new.layer_fallbacks = 0
        new.layer_fallback_reasons = {}
        return new

    @property
    def fallbacks(self) -> int:
        """Calls of this layer that ran torch's forward (its ``self_attn`` counts its own)."""
        return self.layer_fallbacks

    @property
    def fallback_reasons(self) -> dict[str, int]:
        return self.layer_fallback_reasons

    def _why_not_jagged(self, src: torch.Tensor) -> str | None:
        attn = self.self_attn
        if src.dim() != 3 or src.is_nested:
            return "input is not a batched 3-D dense tensor"
        if not attn.batch_first:
            return "batch_first=False"
        if attn.in_proj_weight is None or attn.bias_k is not None or attn.add_zero_attn:
            return "separate q/k/v projections, add_bias_kv or add_zero_attn"
        if self.training and any(p > 0 for p in (self.dropout.p, self.dropout1.p, self.dropout2.p, attn.dropout)):
            return "dropout > 0 in training mode"
        if src.dtype not in FLOAT_DTYPES:
            return f"dtype {src.dtype}"
        return None

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor | None = None,
                src_key_padding_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if is_proxy(src, src_mask, src_key_padding_mask):
            return trace_call(self, src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                              is_causal=is_causal)
        why = self._why_not_jagged(src)
        if why is None and is_causal and src_mask is None:
            why = "is_causal=True without src_mask"  # torch raises; the original call says so
        if why is None:
            why, lengths, causal = _jagged_masks(src, src_key_padding_mask, src_mask)
        if why is not None:
            self.layer_fallbacks += 1
            self.layer_fallback_reasons[why] = self.layer_fallback_reasons.get(why, 0) + 1
            return super().forward(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                                   is_causal=is_causal)
        x, seq_offsets = _pack(src, lengths, self.backend)
        max_len = src.shape[1]

        def sa(rows):
            return self.dropout1(_attention_rows(self.self_attn, rows, seq_offsets, max_len, causal, self.backend))

        if self.norm_first:
            x = x + sa(self.norm1(x))
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + sa(x))
            x = self.norm2(x + self._ff_block(x))
        return _unpack(x, src, lengths, seq_offsets, self.backend)

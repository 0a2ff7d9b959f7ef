"""The arches of the GEM-like model, each built "eager" or "fused" with the same parameters on the
same seed. They differ only in their leaves:

| leaf                 | eager                                     | fused                                  |
|----------------------|-------------------------------------------|----------------------------------------|
| sparse tables        | torchrec EmbeddingBagCollection + RowwiseAdagrad | gk.torchrec.FusedEmbeddingBagCollection, ExactRowwiseAdagrad in the backward |
| sequence embeddings  | torchrec EmbeddingCollection + RowwiseAdagrad | gk.torchrec.FusedEmbeddingCollection, likewise |
| HSTU layers          | ReferenceHSTULayer (padded plain PyTorch) | gk.nn.HSTULayer (jagged fused attention) |
| Wukong / dot         | ReferenceWukongStack / EagerDotInteraction | gk.nn.WukongStack / gk.nn.DotInteraction |
| MLPs (dense, over)   | ReferenceMLP (the nn.Sequential run)      | gk.nn.MLP (one gk.linear per Linear + ReLU) |

gk.swap converts each eager leaf into its fused twin (converters registered below), so
`gk.swap(GemModel(cfg, "eager"), optimizer=gk.optim.ExactRowwiseAdagrad(lr))` is the fused model."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import gem_kernels
from gem_kernels.nn import HSTULayer, WukongStack
from gem_kernels.ops.jagged import hstu_sequence_layout

from .config import GemConfig
from .data import Batch, _offsets, sparse_feature_names

KERNELS = ("eager", "fused")


def check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")


def mlp(sizes: tuple[int, ...] | list[int], final_activation: bool, kernels: str = "fused") -> gem_kernels.nn.MLP:
    """Linear layers of widths sizes[0] -> ... -> sizes[-1] with ReLU between (and after the last
    one when final_activation): gem_kernels.nn.MLP, whose forward runs each Linear with the ReLU after it
    as one gem_kernels.linear op; for kernels="eager" a ReferenceMLP (the plain nn.Sequential run, its
    ReLUs in place on their Linear's output, which nothing else reads). Same children and state_dict
    keys either way."""
    check_kernels(kernels)
    return (ReferenceMLP if kernels == "eager" else gem_kernels.nn.MLP)(sizes, final_activation)


def mlp_flops(sizes: tuple[int, ...] | list[int], rows: int) -> int:
    """Forward matmul FLOPs of mlp(sizes) on `rows` rows: 2 * rows * fan_in * fan_out per layer."""
    return sum(2 * rows * fan_in * fan_out for fan_in, fan_out in zip(sizes[:-1], sizes[1:]))


class RowwiseAdagrad(torch.optim.Optimizer):
    """FBGEMM's row-wise Adagrad in plain PyTorch, the eager twin of gk.optim.ExactRowwiseAdagrad:
    per row of a 2-D parameter, ``m += mean(g^2); w -= lr * g / (sqrt(m) + eps)``.

    On a dense gradient an untouched row has g = 0 and stays as it is, state included, so this is
    the exact (touched rows only) rule. torch.optim.Adagrad keeps one state per element instead,
    a different rule from the row-wise one TorchRec and FBGEMM train embeddings with."""

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() != 2:
                    raise ValueError(f"RowwiseAdagrad needs 2-D parameters, got shape {tuple(p.shape)}")
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
                grad = p.grad.float()
                state["sum"].add_(grad.square().mean(1))
                # A row with sum 0 has had only zero gradients: it stays (no 0/0 when eps = 0).
                denom = (state["sum"].sqrt() + group["eps"]).masked_fill_(state["sum"] == 0, 1.0)
                p.addcdiv_(grad, denom.unsqueeze(1).to(p.dtype), value=-group["lr"])


def _own_rng():
    """The collections draw their own (discarded) initial values: in a forked RNG, so that eager and
    fused consume the model's RNG stream alike and every later module gets the same parameters."""
    return torch.random.fork_rng(devices=[])


def init_table(num_rows: int, dim: int) -> torch.Tensor:
    """Initial table values from the (forked, seeded) global RNG: N(0, 1/dim)."""
    return torch.randn(num_rows, dim) / math.sqrt(dim)


# ---------------------------------------------------------------------------------------------
# The eager leaves and their swap converters. Eager and fused differ only in these leaves (and in
# TorchRec's collections vs gk.torchrec's, which gk.swap converts itself), so gk.swap turns an eager
# GemModel into the fused one, module by module, with the same state_dict keys.
# ---------------------------------------------------------------------------------------------


class ReferenceMLP(gem_kernels.nn.MLP):
    """gk.nn.MLP pinned to the reference backend: its children run as nn.Sequential runs them."""

    def __init__(self, sizes, final_activation: bool = False):
        super().__init__(sizes, final_activation, backend="reference")


class ReferenceHSTULayer(HSTULayer):
    """gk.nn.HSTULayer pinned to the reference backend (padded plain PyTorch): the eager baseline."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, backend="reference", **kwargs)
        self.init_args, self.init_kwargs = args, kwargs


class ReferenceWukongStack(WukongStack):
    """gk.nn.WukongStack pinned to the reference backend (the paper's formulation in plain PyTorch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, backend="reference", **kwargs)
        self.init_args, self.init_kwargs = args, kwargs


class EagerDotInteraction(nn.Module):
    """DLRM's dot interaction in plain PyTorch: x [R, F, D] -> [R, F*(F-1)/2], <x_i, x_j> for i < j, row-major."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        num_features = features.shape[1]
        gram = torch.bmm(features, features.transpose(1, 2))
        i, j = torch.triu_indices(num_features, num_features, offset=1, device=features.device)
        return gram[:, i, j]


def _to_fused(fused_type):
    def convert(module: nn.Module, *, optimizer, backend) -> nn.Module:
        param = next(module.parameters())
        with torch.random.fork_rng(devices=[]):
            new = fused_type(*module.init_args, **module.init_kwargs, backend=backend)
        new.to(device=param.device, dtype=param.dtype).load_state_dict(module.state_dict())
        return new
    return convert


gem_kernels.register(ReferenceHSTULayer, _to_fused(HSTULayer))
gem_kernels.register(ReferenceWukongStack, _to_fused(WukongStack))
# The same Linear and ReLU children (the same parameters): only the forward differs.
gem_kernels.register(ReferenceMLP, lambda module, *, optimizer, backend: gem_kernels.nn.MLP.from_sequential(module, backend))
gem_kernels.register(EagerDotInteraction,
                     lambda module, *, optimizer, backend: gem_kernels.nn.DotInteraction(backend=backend))


def eager_collection_types() -> tuple[type, ...]:
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    return EmbeddingBagCollection, EmbeddingCollection


def is_eager_module(module: nn.Module) -> bool:
    return type(module) in (*eager_collection_types(), ReferenceHSTULayer, ReferenceWukongStack, EagerDotInteraction,
                            ReferenceMLP)


def _collection(eager, kernels: str, cfg: GemConfig) -> nn.Module:
    """TorchRec's collection as built (eager), or gk.torchrec's fused twin of it with row-wise Adagrad
    in the backward (the same tables, the same state_dict keys)."""
    if kernels == "eager":
        return eager
    from gem_kernels.torchrec import FusedEmbeddingBagCollection, FusedEmbeddingCollection

    from gem_kernels.torchrec import ZchEmbeddingBagCollection

    fused_type = {"EmbeddingBagCollection": FusedEmbeddingBagCollection,
                  "ManagedCollisionEmbeddingBagCollection": ZchEmbeddingBagCollection}.get(type(eager).__name__,
                                                                                            FusedEmbeddingCollection)
    with _own_rng():
        return fused_type.from_torchrec(eager, optimizer=gem_kernels.optim.ExactRowwiseAdagrad(lr=cfg.sparse_lr))


# ---------------------------------------------------------------------------------------------
# Sparse arch: one sum-pooled bag per table and user -> [B, T, D].
# ---------------------------------------------------------------------------------------------


class SparseArch(nn.Module):
    """Sum pooling of every table's bag: out[b, t] = sum_{i in bag(t, b)} W_t[i], [B, T, D].

    eager: torchrec's EmbeddingBagCollection (the model's eager RowwiseAdagrad trains its tables);
    fused: gk.torchrec.FusedEmbeddingBagCollection (one fused call, row-wise Adagrad in the backward).
    With cfg.hashed_ids the ids are raw 64-bit ids: eager wraps the collection in TorchRec's
    ManagedCollisionEmbeddingBagCollection (one MCHManagedCollisionModule per table, LRU, evicting
    every batch), fused is its gk.swap twin gk.torchrec.ZchEmbeddingBagCollection (LRU; the identity
    tables are in its state_dict, so checkpoints restore them).
    """

    def __init__(self, cfg: GemConfig, kernels: str):
        super().__init__()
        check_kernels(kernels)
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        self.num_tables, self.dim = cfg.num_tables, cfg.embedding_dim
        tables = [init_table(rows, cfg.embedding_dim) for rows in cfg.num_embeddings_per_table]
        configs = [EmbeddingBagConfig(name=f"table_{t}", embedding_dim=cfg.embedding_dim, num_embeddings=rows,
                                      feature_names=[name], pooling=PoolingType.SUM)
                   for t, (rows, name) in enumerate(zip(cfg.num_embeddings_per_table,
                                                        sparse_feature_names(cfg.num_tables)))]
        with _own_rng():
            ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        with torch.no_grad():
            for t, table in enumerate(tables):
                ebc.embedding_bags[f"table_{t}"].weight.copy_(table)
        self.hashed_ids = cfg.hashed_ids
        if cfg.hashed_ids:
            ebc = _managed_collision(ebc, configs)
        self.ebc = _collection(ebc, kernels, cfg)

    def forward(self, batch: Batch) -> torch.Tensor:
        out = self.ebc(batch.sparse_features())
        if self.hashed_ids:  # the managed-collision collections return (KeyedTensor, remapped KJT or None)
            out = out[0]
        return out.values().view(batch.batch_size, self.num_tables, self.dim)


def _managed_collision(ebc: nn.Module, configs) -> nn.Module:
    """TorchRec's MC-EBC around ``ebc``: per table an MCH module of num_embeddings slots (the last
    is the default row of ids without one), LRU, evicting on every training batch."""
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import LRU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule

    mcms = {c.name: MCHManagedCollisionModule(zch_size=c.num_embeddings, device=torch.device("cpu"),
                                              eviction_interval=1, eviction_policy=LRU_EvictionPolicy())
            for c in configs}
    return ManagedCollisionEmbeddingBagCollection(
        ebc, ManagedCollisionCollection(managed_collision_modules=mcms, embedding_configs=configs))


class SequenceEmbeddings(nn.Module):
    """Item + action embedding of every token (pooling "none"): ids [N], actions [N] -> [N, D].

    eager: torchrec EmbeddingCollection (tables "item_table", "action_table"); fused:
    gk.torchrec.FusedEmbeddingCollection (row-wise Adagrad in the backward). The action table has
    num_actions + 1 rows: the last is "candidate" (no action yet).
    """

    def __init__(self, cfg: GemConfig, kernels: str):
        super().__init__()
        from torchrec import EmbeddingCollection, EmbeddingConfig

        rows = (cfg.num_items, cfg.num_actions + 1)
        tables = [init_table(r, cfg.embedding_dim) for r in rows]
        names = ("item_table", "action_table")
        configs = [EmbeddingConfig(name=name, embedding_dim=cfg.embedding_dim, num_embeddings=r, feature_names=[feature])
                   for name, feature, r in zip(names, ("item", "action"), rows)]
        with _own_rng():
            ec = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
        with torch.no_grad():
            for name, table in zip(names, tables):
                ec.embeddings[name].weight.copy_(table)
        self.ec = _collection(ec, kernels, cfg)

    def forward(self, ids: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        n = ids.numel()
        lengths = torch.tensor([n, n], dtype=torch.int64, device=ids.device)
        out = self.ec(KeyedJaggedTensor(keys=["item", "action"], values=torch.cat([ids, actions]), lengths=lengths))
        return out["item"].values() + out["action"].values()


# ---------------------------------------------------------------------------------------------
# Sequence arch: [contextual tokens | history | candidates] per user -> HSTU -> candidate tokens.
# ---------------------------------------------------------------------------------------------


class SequenceLayout:
    """Where every row of the jagged HSTU input comes from, for one batch (index tensors on the
    batch's device; sizes from shapes only, so no host sync).

    User b's sequence is [c contextual tokens, L_b history items, K_b candidates] (length c + L_b + K_b);
    the K_b candidates are HSTU targets: each sees the context, the history and itself.
    """

    def __init__(self, batch: Batch, contextual_len: int):
        num_users, c = batch.batch_size, contextual_len
        num_history, num_rows = batch.history_ids.numel(), batch.candidate_ids.numel()
        self.num_targets = batch.num_candidates
        self.total = num_users * c + num_history + num_rows
        # One native pass on the CPU where ~40 small ATen ops (the reference twin) cost ~0.13 ms a
        # step at 8 users (bench/results/notes-fixed12.md).
        self.seq_offsets, self.rows, self.candidate_owner, self.timestamps, self.query_timestamps = \
            hstu_sequence_layout(batch.history_offsets, batch.num_candidates, batch.request_timestamps,
                                 batch.history_timestamps, c, num_rows)
        # Each user's candidates are contiguous rows of the R candidate rows: their offsets [B+1].
        self.candidate_offsets = _offsets(self.num_targets)
        # rows is in source order [context; history; candidates]: each kind's rows are a slice of it.
        self.context_rows = self.rows[:num_users * c]
        self.history_rows = self.rows[num_users * c:num_users * c + num_history]
        self.candidate_rows = self.rows[num_users * c + num_history:]


class SequenceArch(nn.Module):
    """HSTU over [contextual tokens | history | candidates]: the candidates' output tokens [R, D].

    Contextual tokens (InterFormer): Linear([dense_out, pooled sparse tokens]) -> contextual_len
    tokens of width D, prepended to each history. Items and actions are embedded together, then
    num_hstu_layers gk.nn.HSTULayer with relative position and log-time bias (generative-recommenders'
    convention: bucket(timestamp of the query's next item - timestamp of the key)); the candidates are the
    targets (num_targets = K_b), so each sees the history and itself, never another candidate.
    use_sequence=False: a candidate's token is its own (item + action) embedding.
    """

    def __init__(self, cfg: GemConfig, kernels: str):
        super().__init__()
        check_kernels(kernels)
        dim, c = cfg.embedding_dim, cfg.contextual_len
        self.use_sequence, self.contextual_len = cfg.use_sequence, c
        self.num_actions, self.max_len = cfg.num_actions, cfg.attention_max_len
        self.embeddings = SequenceEmbeddings(cfg, kernels)
        if cfg.use_sequence:
            self.context = nn.Linear((cfg.num_tables + 1) * dim, c * dim) if c else None
            layer_type = ReferenceHSTULayer if kernels == "eager" else HSTULayer
            self.layers = nn.ModuleList(
                layer_type(dim, cfg.num_heads, cfg.hstu_linear_dim, cfg.hstu_attention_dim, causal=True,
                           contextual_len=c, max_seq_len=self.max_len, num_time_buckets=cfg.num_time_buckets)
                for _ in range(cfg.num_hstu_layers))
        self.norm = nn.LayerNorm(dim)

    def embed(self, batch: Batch) -> torch.Tensor:
        """[history rows; candidate rows] embedded: [S + R, D] (the sparse part of the arch)."""
        candidate_actions = torch.full_like(batch.candidate_ids, self.num_actions)
        return self.embeddings(torch.cat([batch.history_ids, batch.candidate_ids]),
                               torch.cat([batch.history_actions, candidate_actions]))

    def forward(self, embedded: torch.Tensor, non_sequence: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        """embedded [S + R, D] (from `embed`), non_sequence [B, T + 1, D] -> candidate tokens [R, D]."""
        num_users, dim = non_sequence.shape[0], non_sequence.shape[2]
        if not self.use_sequence:
            return self.norm(embedded[embedded.shape[0] - layout.candidate_rows.numel():])
        rows = [embedded]
        if self.contextual_len:
            rows.insert(0, self.context(non_sequence.reshape(num_users, -1)).reshape(-1, dim))
        source = torch.cat(rows)
        # layout.rows is a permutation of [0, total) (every row is written once): no zero fill, and in
        # place, not index_copy's clone of the destination (a fill and a copy of [total, D] saved).
        # Measured and not kept (2-core Xeon, small config, one batch's 9043 rows of 32, 2026-12-07): this
        # index_copy_ takes 189 us at 1 thread, 80 at 2, a gather of the same rows (index_select) 97 / 22;
        # but x as a gather by the inverse permutation has index_select's backward, index_add (serial
        # scatter_add_), where index_copy_'s backward is that gather. Both directions as gathers need an
        # op of their own (or a torch.autograd.Function, whose Python ~15 us a call eats most of the
        # ~60 us left at 2 threads): not done.
        x = source.new_empty(layout.total, dim).index_copy_(0, layout.rows, source)
        for layer in self.layers:
            x = layer(x, layout.seq_offsets, self.max_len, num_targets=layout.num_targets,
                      timestamps=layout.timestamps, query_timestamps=layout.query_timestamps)
        # index_select: a gather whose backward is index_add (advanced indexing's is a slower index_put).
        # Measured and not kept (same machine and batch): that backward (zero fill + scatter_add_ of the
        # 1097 candidate rows into [9043, 32]) 62 / 52 us at 1 / 2 threads, zeros + index_copy_ (the rows
        # are distinct) 57 / 25 us: ~27 us at 2 threads, about a torch.autograd.Function's own cost.
        return self.norm(x.index_select(0, layout.candidate_rows))

    def rank(self, batch: Batch, non_sequence: torch.Tensor, layout: SequenceLayout,
             user_sizes: list[tuple[int, int]] | None = None, cache=None,
             user_ids: list[int] | None = None) -> torch.Tensor:
        """`forward`'s candidate tokens [R, D], M-FALCON style: a user's context and history rows run through
        the layers once per request (cold) or once per history (a kept `cache`), and its K candidates are
        scored against them, each seeing the context, the history and itself, never another candidate. A
        candidate keeps its position and timestamps of the full sequence, so the tokens equal `forward`'s.
        Forward only.

        Since no candidate sees another, M-FALCON's micro-batches of m candidates (GemModel.rank's
        candidates_per_microbatch) are independent: all of a user's micro-batches run side by side in one op
        call per layer (the [K/m, m] layout of the candidates is the [K] one), so m changes neither the
        result nor the work.
        - cache None (cold: nothing outlives the request): the history must be encoded anyway, so the
          work is `forward`'s, attention pair for pair (L^2/2 + K * L pairs per layer either way). It runs
          as `forward`: every layer is one fused pass over [context | history | candidates] of all users
          (gem_kernels.hstu_layer), the history's K/V never leaving the op.
        - a kept cache (serving): a user whose context + history rows the cache does not hold in every
          layer is encoded into it (HSTULayer.cached_forward with append=True, one call per layer); then
          its K candidates go through every layer in one cached_forward over the cached rows (a view of
          them, no copy, for an unpaged cache), at K * L attention work. When the cache holds every user,
          only the candidates are embedded.

        user_sizes: (sequence length, candidates) of every user, as Python ints; None reads them from
        `layout`. Given, the method reads no tensor's values (what torch.export needs).
        cache, user_ids: a gem_kernels.inference.KVCache kept across requests, and the users' keys in it
        (default 0 .. B-1). The caller keeps the cache in step with the user's history (append the new items,
        truncate or remove the user when its context changes)."""
        if not self.use_sequence or cache is None:
            return self(self.embed(batch), non_sequence, layout)
        num_users, dim = non_sequence.shape[0], non_sequence.shape[2]
        if user_sizes is None:
            user_sizes = list(zip(layout.seq_offsets.diff().tolist(), layout.num_targets.tolist()))
        lengths, num_candidates = [n for n, _ in user_sizes], [k for _, k in user_sizes]
        prefix_lengths = [n - k for n, k in user_sizes]
        starts = [sum(lengths[:user]) for user in range(num_users)]
        user_ids = list(range(num_users)) if user_ids is None else list(user_ids)
        cold = [any(cache.length(user_ids[user], index) != prefix_lengths[user] for index in range(len(self.layers)))
                for user in range(num_users)]
        candidates = self.embeddings(batch.candidate_ids, torch.full_like(batch.candidate_ids, self.num_actions))
        if any(cold):
            prefix_rows = [self.embeddings(batch.history_ids, batch.history_actions)]
            if self.contextual_len:
                prefix_rows.insert(0, self.context(non_sequence.reshape(num_users, -1)).reshape(-1, dim))
            x = candidates.new_zeros(layout.total, dim).index_copy(
                0, torch.cat([layout.context_rows, layout.history_rows]), torch.cat(prefix_rows))
        out = torch.empty_like(candidates)
        first_candidate = 0
        for user in range(num_users):
            key = user_ids[user]
            prefix = slice(starts[user], starts[user] + prefix_lengths[user])
            if cold[user]:
                cache.remove(key)
                h = x[prefix]
                for index, layer in enumerate(self.layers):
                    h = layer.cached_forward(h, cache, index, [key], self.max_len,
                                             timestamps=layout.timestamps[prefix],
                                             query_timestamps=layout.query_timestamps[prefix], append=True)
            if num_candidates[user] == 0:
                continue
            rows = slice(prefix.stop, starts[user] + lengths[user])  # the candidates' rows of the sequences
            scored = slice(first_candidate, first_candidate + num_candidates[user])
            first_candidate = scored.stop
            h = candidates[scored]
            targets = torch.tensor([num_candidates[user]], device=h.device)
            for index, layer in enumerate(self.layers):
                h = layer.cached_forward(h, cache, index, [key], self.max_len, num_targets=targets,
                                         timestamps=layout.timestamps[rows],
                                         query_timestamps=layout.query_timestamps[rows])
            out[scored] = h
        return self.norm(out)


# ---------------------------------------------------------------------------------------------
# Interaction arch: per (user, candidate) row, F = T + 2 tokens -> Wukong or dot -> over arch.
# ---------------------------------------------------------------------------------------------


class InteractionArch(nn.Module):
    """tokens [R, F, D] (dense out, pooled sparse, candidate token per row) -> over arch [R, H_last]:
    over_arch([dense_out, flatten(interaction(tokens))])."""

    def __init__(self, cfg: GemConfig, kernels: str):
        super().__init__()
        check_kernels(kernels)
        if cfg.interaction == "wukong":
            stack_type = ReferenceWukongStack if kernels == "eager" else WukongStack
            self.interaction = stack_type(cfg.wukong_layers, cfg.num_features, cfg.wukong_fm_out, cfg.wukong_lcb_out,
                                          cfg.embedding_dim, cfg.wukong_fm_rank, list(cfg.wukong_mlp))
        else:
            self.interaction = EagerDotInteraction() if kernels == "eager" else gem_kernels.nn.DotInteraction()
        self.over_arch = mlp((cfg.embedding_dim + cfg.interaction_width,) + cfg.over_arch_layers, final_activation=True,
                             kernels=kernels)

    def forward(self, tokens: torch.Tensor, dense: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [R, F, D]; dense: the rows' dense token [R, D] (equal to tokens[:, 0]) taken from its
        own source, or None to read it from tokens. From its own source its gradient goes there
        directly: through tokens[:, 0] the backward fills a zero [R, F, D], copies the slice's gradient
        in and adds it to the interaction's gradient of tokens, three passes over [R, F, D]."""
        interactions = self.interaction(tokens).flatten(1)
        # The over arch's first layer on [dense token, interactions] without their concatenation (a copy
        # of [R, D + I] forward, and backward its slices hand the interaction a strided gradient that the
        # fused op copies contiguous again): gk.nn.MLP's second input.
        return self.over_arch((tokens[:, 0] if dense is None else dense, interactions))


class TaskHeads(nn.Module):
    """One logit per task and row, binary cross-entropy against the labels."""

    def __init__(self, cfg: GemConfig):
        super().__init__()
        self.linear = nn.Linear(cfg.over_arch_layers[-1], cfg.num_tasks)

    def forward(self, over: torch.Tensor) -> torch.Tensor:
        return self.linear(over)


def bce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy with logits over the rows and the tasks (in fp32)."""
    return F.binary_cross_entropy_with_logits(logits.float(), labels)

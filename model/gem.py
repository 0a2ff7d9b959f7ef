"""GemModel: the GEM-like recommendation model (dense, sparse, HSTU sequence, Wukong or dot
interaction, multi-task heads), on TorchRec's eager modules or on gem_kernels' fused kernels."""

from __future__ import annotations

import time

import torch
from torch import nn

from gem_kernels import flops
from gem_kernels.ops.jagged import jagged_broadcast_cat

from .archs import (
    InteractionArch,
    eager_collection_types,
    is_eager_module,
    RowwiseAdagrad,
    SequenceArch,
    SequenceLayout,
    SparseArch,
    TaskHeads,
    bce_loss,
    check_kernels,
    mlp,
    mlp_flops,
)
from .config import GemConfig
from .data import Batch
from .flat_adam import FlatAdam

PHASES = ("sparse", "sequence", "interaction", "heads", "backward_optimizer")
# flops_by_component's keys that are model FLOPs (MFU's numerator); "optimizer" is not.
MODEL_FLOPS_COMPONENTS = ("sparse", "sequence", "interaction", "heads", "backward")
# torch.optim.Adam's update per element: lerp of m (2), v*b2 + (1-b2)*g^2 (3), sqrt(v)/c2 + eps (3),
# the addcdiv into the parameter (2).
ADAM_FLOPS_PER_ELEMENT = 10


def model_flops(flops_by_component: dict[str, float]) -> float:
    """MFU's numerator from GemModel.flops_by_component: the model components' FLOPs, no optimizer."""
    return sum(flops_by_component[k] for k in MODEL_FLOPS_COMPONENTS)


class PhaseTimer:
    """Marks the end of each phase of a step without a host sync: CUDA events on a GPU (read after the
    step's one sync), time.perf_counter on the CPU. `start()`, then `mark(phase)` in order, then
    `read()` -> {phase: ms}."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list[tuple[str, object]] = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [("start", self._now())]

    def mark(self, phase: str) -> None:
        if self._marks:
            self._marks.append((phase, self._now()))

    def read(self) -> dict[str, float]:
        if self.cuda and self._marks:
            self._marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (_, before), (phase, after) in zip(self._marks[:-1], self._marks[1:]):
            ms = before.elapsed_time(after) if self.cuda else (after - before) * 1e3
            out[phase] = out.get(phase, 0.0) + ms
        return out


class GemModel(nn.Module):
    """logits[R, num_tasks], one row per (user, candidate)::

        d = dense_arch(dense)                                  [B, D]
        e = sparse_arch(sparse features)                       [B, T, D] (sum-pooled bags)
        s = sequence_arch(history + candidates, context = proj([d, e]))   [R, D] candidate tokens
        o = interaction_arch([d, e, s] per row)                [R, H] (Wukong or DLRM dot, then over arch)
        logits = task_heads(o)                                 click, conversion

    Args:
        cfg: sizes.
        kernels: "eager" (TorchRec's collections, gem_kernels' reference backend = padded plain
            PyTorch) or "fused" (gem_kernels' fused embedding bags with row-wise Adagrad in the
            backward, jagged HSTU attention, fused interaction).
        seed: parameters come from torch.manual_seed(seed) in a forked CPU RNG (the global RNG is
            left alone), so both `kernels` start from identical parameters.
    """

    def __init__(self, cfg: GemConfig, kernels: str = "fused", seed: int = 0):
        super().__init__()
        check_kernels(kernels)
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.dense_arch = mlp((cfg.num_dense,) + cfg.dense_arch_layers + (cfg.embedding_dim,),
                                  final_activation=True, kernels=kernels)
            self.sparse_arch = SparseArch(cfg, kernels)
            self.sequence_arch = SequenceArch(cfg, kernels)
            self.interaction_arch = InteractionArch(cfg, kernels)
            self.task_heads = TaskHeads(cfg)

    def forward(self, batch: Batch, timer: PhaseTimer | None = None) -> torch.Tensor:
        """-> logits [R, num_tasks]. `timer` marks the end of the sparse, sequence and interaction phases."""
        dense_out = self.dense_arch(batch.dense)                                         # [B, D]
        pooled = self.sparse_arch(batch)                                                 # [B, T, D]
        embedded = self.sequence_arch.embed(batch)                                       # [S + R, D]
        _mark(timer, "sparse")
        layout = SequenceLayout(batch, self.cfg.contextual_len)
        non_sequence = torch.cat([dense_out.unsqueeze(1), pooled], dim=1)                 # [B, T + 1, D]
        candidates = self.sequence_arch(embedded, non_sequence, layout)                  # [R, D]
        _mark(timer, "sequence")
        tokens = interaction_tokens(non_sequence, candidates, layout)                     # [R, F, D]
        over = self.interaction_arch(tokens, dense_out.index_select(0, layout.candidate_owner))
        _mark(timer, "interaction")
        return self.task_heads(over)

    @torch.no_grad()
    def rank(self, batch: Batch, candidates_per_microbatch: int = 64,
             user_sizes: list[tuple[int, int]] | None = None, cache=None,
             user_ids: list[int] | None = None) -> torch.Tensor:
        """`forward`'s logits [R, num_tasks] by M-FALCON ranking: each user's contextual and history tokens
        are encoded once, and its candidates scored against them in micro-batches of
        `candidates_per_microbatch`, each seeing the context, the history and itself, never another
        candidate (so the micro-batches run together, in one op call per layer). Without a `cache` the
        request is cold and runs as `forward` (the same work, fused); with a gem_kernels.inference.KVCache
        kept across requests (`user_ids`: the users' keys in it) a user's history is encoded once, not per
        request (SequenceArch.rank). Equal to `forward` (tests/test_rank.py); forward only, under no_grad.
        user_sizes: see SequenceArch.rank (for torch.export: model/serving.py)."""
        if isinstance(candidates_per_microbatch, bool) or not isinstance(candidates_per_microbatch, int) \
                or candidates_per_microbatch < 1:
            raise ValueError(f"candidates_per_microbatch must be an int >= 1, got {candidates_per_microbatch!r}")
        dense_out = self.dense_arch(batch.dense)
        pooled = self.sparse_arch(batch)
        layout = SequenceLayout(batch, self.cfg.contextual_len)
        non_sequence = torch.cat([dense_out.unsqueeze(1), pooled], dim=1)
        candidates = self.sequence_arch.rank(batch, non_sequence, layout, user_sizes, cache, user_ids)
        tokens = interaction_tokens(non_sequence, candidates, layout)
        return self.task_heads(self.interaction_arch(tokens, dense_out.index_select(0, layout.candidate_owner)))

    def loss(self, batch: Batch, timer: PhaseTimer | None = None) -> torch.Tensor:
        """Mean binary cross-entropy over the rows and the tasks; `timer` also marks "heads"."""
        loss = bce_loss(self(batch, timer), batch.labels)
        _mark(timer, "heads")
        return loss

    @property
    def kernels(self) -> str:
        """"eager" while any eager leaf is left (TorchRec's collections, the reference-backend
        modules), else "fused" (also after gk.swap of an eager model)."""
        return "eager" if any(is_eager_module(m) for m in self.modules()) else "fused"

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The tables of TorchRec's eager collections, which a separate sparse optimizer trains (the
        fused collections update theirs in the backward)."""
        eager = eager_collection_types()
        return [p for m in self.modules() if type(m) in eager for p in m.parameters()]

    def fused_parameters(self) -> list[nn.Parameter]:
        """Parameters updated inside the backward (no optimizer may hold them)."""
        return [getattr(m, name) for m in self.modules() if hasattr(m, "fused_parameter_names")
                for name in m.fused_parameter_names()]

    def dense_parameters(self) -> list[nn.Parameter]:
        skip = {id(p) for p in self.embedding_parameters() + self.fused_parameters()}
        return [p for p in self.parameters() if id(p) not in skip]

    def make_optimizers(self) -> list[torch.optim.Optimizer]:
        """Adam for the dense parameters; row-wise Adagrad for the eager collections' tables (the
        fused collections run theirs in the backward: see fused_optimizer_state_dict)."""
        # torch's fused Adam, stepped as one call over flat buffers (model/flat_adam.py): the dense
        # parameters are ~55 small tensors (fused=True: 3.9 -> 0.7 ms per step on the small config,
        # 1 thread; flat: see FlatAdam).
        optimizers: list[torch.optim.Optimizer] = [FlatAdam(self.dense_parameters(), lr=self.cfg.dense_lr)]
        if self.embedding_parameters():
            optimizers.append(RowwiseAdagrad(self.embedding_parameters(), lr=self.cfg.sparse_lr))
        return optimizers

    def fused_optimizer_state_dict(self) -> dict[str, dict]:
        """The in-backward optimizers' state (row-wise Adagrad sums, step) per fused collection."""
        return {name: m.optimizer_state_dict() for name, m in self.named_modules() if hasattr(m, "optimizer_state_dict")}

    def load_fused_optimizer_state_dict(self, state: dict[str, dict]) -> None:
        modules = {name: m for name, m in self.named_modules() if hasattr(m, "load_optimizer_state_dict")}
        if set(state) != set(modules):
            raise ValueError(f"fused optimizer state is for modules {sorted(state)}, this model has {sorted(modules)}")
        for name, module in modules.items():
            module.load_optimizer_state_dict(state[name])

    def compile_arches(self, **kwargs) -> None:
        """torch.compile every dense arch in place (state_dict keys unchanged); the embedding
        lookups stay outside (KeyedJaggedTensor in, custom ops), and the phase marks sit between."""
        for module in (self.dense_arch, self.sequence_arch, self.interaction_arch, self.task_heads):
            module.compile(**kwargs)

    def flops_per_step(self, batch: Batch) -> int:
        """Model FLOPs of one training step (forward + backward) on `batch`, on the real jagged work:
        the sum of flops_by_component's model components (the optimizer update is not model work, as
        MFU conventionally counts it: see flops_by_component's "optimizer")."""
        return model_flops(self.flops_by_component(batch))

    def flops_by_component(self, batch: Batch) -> dict[str, int]:
        """FLOPs of one training step on `batch` by the phase that runs them (PHASES): the forward of
        "sparse" (dense arch, embedding-bag pooling), "sequence" (contextual projection, HSTU layers),
        "interaction" (Wukong or dot, over arch), "heads"; "backward" (every backward, run in the
        "backward_optimizer" phase); "optimizer": the updates (row-wise Adagrad of every table, Adam of
        the dense parameters), left out of the model FLOPs.

        Counted per op from gem_kernels.flops: the linear layers 2*m*n*k forward and twice that
        backward (the first dense layer once: its input, the dense features, needs no gradient); HSTU attention flops.jagged_attention over the real lengths (causal half, backward
        2.5x forward); Wukong layers flops.wukong_layer, the dot interaction flops.dot_interaction;
        embedding bags 2 FLOPs per looked-up element forward (pooling) and backward (the duplicate
        sums, flops.embedding_bag_backward_rowwise_adagrad less its update), the sequence tables
        (pooling "none") the backward only. Bias adds, activations, the loss and norms are not
        counted, except the Wukong layers' LayerNorms (8 FLOPs per element forward, 12 backward, as
        flops.wukong_layer counts its fused ops). Updates: flops.rowwise_adagrad_update per distinct
        row, ADAM_FLOPS_PER_ELEMENT per dense parameter element.
        """
        cfg = self.cfg
        dim, num_users = cfg.embedding_dim, batch.batch_size
        num_rows = batch.candidate_ids.numel()
        out = dict.fromkeys(("sparse", "sequence", "interaction", "heads", "backward", "optimizer"), 0)
        dense_sizes = (cfg.num_dense,) + cfg.dense_arch_layers + (dim,)
        dense = mlp_flops(dense_sizes, num_users)
        out["sparse"] += dense
        # The dense features need no gradient: the first layer's backward is its weight gradient only.
        out["backward"] += 2 * dense - mlp_flops(dense_sizes[:2], num_users)

        lookups = batch.sparse_lengths.view(cfg.num_tables, num_users).sum(1).tolist()
        starts = [0] + torch.tensor(lookups).cumsum(0).tolist()
        unique = [int(batch.sparse_values[a:b].unique().numel()) for a, b in zip(starts[:-1], starts[1:])]
        dims = [dim] * cfg.num_tables
        pooling = flops.embedding_bag(lookups, dims, num_users, 4, 8)[0]
        out["sparse"] += pooling
        out["backward"] += pooling
        out["optimizer"] += flops.rowwise_adagrad_update(unique, dims)
        tokens = batch.history_ids.numel() + num_rows
        seq_unique = [int(torch.cat([batch.history_ids, batch.candidate_ids]).unique().numel()),
                      int(batch.history_actions.unique().numel()) + 1]
        out["backward"] += flops.embedding_bag([tokens, tokens], [dim, dim], 1, 4, 8)[0]
        out["optimizer"] += flops.rowwise_adagrad_update(seq_unique, [dim, dim])

        if cfg.use_sequence:
            c = cfg.contextual_len
            context = 2 * num_users * (cfg.num_tables + 1) * dim * c * dim
            layout = SequenceLayout(batch, c)
            h, dl, da = cfg.num_heads, cfg.hstu_linear_dim, cfg.hstu_attention_dim
            projections = 2 * layout.total * dim * h * (2 * dl + 2 * da) + 2 * layout.total * h * dl * dim
            attention = flops.jagged_attention(layout.seq_offsets, h, da, dl, 4, causal=True)[0]
            attention_both = flops.jagged_attention(layout.seq_offsets, h, da, dl, 4, causal=True, backward=True)[0]
            out["sequence"] += context + cfg.num_hstu_layers * (projections + attention)
            out["backward"] += 2 * context + cfg.num_hstu_layers * (2 * projections + attention_both - attention)

        if cfg.interaction == "wukong":
            num_in = cfg.num_features
            for _ in range(cfg.wukong_layers):
                args = (num_rows, num_in, cfg.wukong_fm_out, cfg.wukong_lcb_out, dim, cfg.wukong_fm_rank,
                        list(cfg.wukong_mlp), 4)
                forward, both = flops.wukong_layer(*args)[0], flops.wukong_layer(*args, backward=True)[0]
                out["interaction"] += forward
                out["backward"] += both - forward
                num_in = cfg.wukong_fm_out + cfg.wukong_lcb_out
        else:
            args = (num_rows, cfg.num_features, dim, False, 4)
            forward, both = flops.dot_interaction(*args)[0], flops.dot_interaction(*args, backward=True)[0]
            out["interaction"] += forward
            out["backward"] += both - forward
        over = mlp_flops((dim + cfg.interaction_width,) + cfg.over_arch_layers, num_rows)
        heads = 2 * num_rows * cfg.over_arch_layers[-1] * cfg.num_tasks
        out["interaction"] += over
        out["heads"] += heads
        out["backward"] += 2 * (over + heads)
        out["optimizer"] += ADAM_FLOPS_PER_ELEMENT * sum(p.numel() for p in self.dense_parameters())
        return {k: int(v) for k, v in out.items()}


def interaction_tokens(non_sequence: torch.Tensor, candidates: torch.Tensor,
                       layout: SequenceLayout) -> torch.Tensor:
    """The interaction arch's input [R, F, D]: row r is its user's non-sequence tokens
    non_sequence[owner(r)] [T + 1, D], then its candidate token candidates[r].

    One jagged_broadcast_cat (each user's candidates are contiguous rows): one copy of [R, F, D] forward,
    and a backward that sums each user's rows (a segment sum) and hands the candidates their column.
    Before it: a gather of token rows from [non-sequence tokens; candidate tokens] (a cat, then
    index_select), whose backward was ATen's index_add (scatter_add_ on one thread into a zero fill).
    Measured (2-core Xeon, small config, old and new alternated step by step on the same batches,
    SCHED_FIFO, 96 pairs a run, busy host, 2026-12-07): 2 threads -0.25 and -0.28 ms a step (0.993x,
    0.991x), 1 thread -0.43 ms (0.992x). Measured and not kept: the dense rows per candidate
    (dense_out.index_select(0, candidate_owner) in GemModel.forward) as a jagged_broadcast_cat too:
    -0.12 / +0.16 ms at 2 threads, +0.15 ms at 1 against this op alone (within the pairs' spread; that
    index_select's backward scatters into only [B, D]).
    Tried and not kept: the old gather in a torch.autograd.Function whose backward is F.embedding_bag
    over the gradient rows (a segment sum of ~15 us): fwd+bwd alone at the model's shape 390 against the
    old gather's 496 us at 2 threads; the native op was taken instead (the two not compared in the step).
    """
    num_users, num_tokens, dim = non_sequence.shape
    return jagged_broadcast_cat(non_sequence.reshape(num_users, num_tokens * dim), layout.candidate_offsets,
                                candidates).view(-1, num_tokens + 1, dim)


def _mark(timer: PhaseTimer | None, phase: str) -> None:
    if timer is not None:
        timer.mark(phase)

"""Synthetic batches for the GEM-like model: dense features, TorchRec-style sparse features, a jagged
user history, and labels drawn from a fixed random "teacher" so that the loss can go down.

Layouts (TorchRec / FBGEMM vocabulary):
  dense           [B, num_dense] float32
  sparse_indices  [N] int64, sparse_offsets [T*B+1] int64, feature-major (KeyedJaggedTensor):
                  bag b of table t is sparse_indices[sparse_offsets[t*B+b] : sparse_offsets[t*B+b+1]]
  seq_ids         [S] int64 item ids, seq_timestamps [S] int64 (strictly increasing within a sequence),
  seq_offsets     [B+1] int64: sequence b is seq_ids[seq_offsets[b] : seq_offsets[b+1]]
  num_targets     [B] int64: the last num_targets[b] items of sequence b are targets (0 <= . <= L_b)
  labels          [B, num_tasks] float32 in {0, 1}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from .config import GemConfig

_SECONDS_PER_DAY = 86_400


@dataclass
class Batch:
    dense: torch.Tensor
    sparse_indices: torch.Tensor
    sparse_offsets: torch.Tensor
    seq_ids: torch.Tensor
    seq_timestamps: torch.Tensor
    seq_offsets: torch.Tensor
    num_targets: torch.Tensor
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.dense.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})

    def pin_memory(self) -> "Batch":
        return Batch(**{f.name: getattr(self, f.name).pin_memory() for f in fields(self)})


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def _zipf_ids(num_rows: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Ids in [0, num_rows) with P(id = k) ~ 1/(k+1) (log-uniform: id = floor((n+1)^u) - 1)."""
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    ids = torch.floor(torch.exp(u * math.log(num_rows + 1))).long() - 1
    return ids.clamp_(0, num_rows - 1)


def _id_scores(ids: torch.Tensor, salts: torch.Tensor) -> torch.Tensor:
    """A fixed pseudo-random score in [-1, 1) per (id, salt): ids [N], salts [K] or [N, K] -> [N, K] float64.

    A stateless hash (fract(sin(x) * 43758.5453)) so that the teacher needs no table of the
    vocabulary's size and is the same function in every batch.
    """
    x = ids.double().unsqueeze(1) * 12.9898 + salts.double() * 78.233
    return torch.frac(torch.sin(x).mul_(43758.5453)).abs_().mul_(2.0).sub_(1.0)


def _segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Sum of each segment of values [N, K] (0 for an empty segment) -> [len(offsets)-1, K]."""
    lengths = offsets.diff()
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=values.shape[0])
    return values.new_zeros((lengths.numel(), values.shape[1])).index_add_(0, segment, values)


def teacher_logits(cfg: GemConfig, dense: torch.Tensor, sparse_indices: torch.Tensor,
                   sparse_offsets: torch.Tensor, seq_ids: torch.Tensor, seq_offsets: torch.Tensor,
                   num_targets: torch.Tensor) -> torch.Tensor:
    """The fixed function labels are drawn from: [B, num_tasks] float64, on the CPU.

    logit[b, k] = dense[b] . w_k / sqrt(num_dense)
                + sum_t mean_{i in bag(t, b)} h(i, salt(t, k))
                + mean_{history items i of b} h(i, salt(T, k))
    with w_k ~ N(0, 1) and h a fixed hash into [-1, 1): every term is learnable by the model (the
    dense arch, the per-table embeddings, the item embeddings).
    """
    batch_size, num_tasks, num_tables = dense.shape[0], cfg.num_tasks, cfg.num_tables
    generator = torch.Generator().manual_seed(cfg.teacher_seed)
    w = torch.randn(cfg.num_dense, num_tasks, generator=generator, dtype=torch.float64)
    logits = dense.double() @ w / math.sqrt(cfg.num_dense)

    task = torch.arange(num_tasks)
    bag_table = torch.arange(num_tables).repeat_interleave(batch_size)
    index_table = torch.repeat_interleave(bag_table, sparse_offsets.diff(), output_size=sparse_indices.numel())
    # salt(t, k) = t * num_tasks + k: [N, K]
    scores = _id_scores(sparse_indices, index_table.unsqueeze(1) * num_tasks + task)
    bag_means = _segment_sum(scores, sparse_offsets) / sparse_offsets.diff().clamp(min=1).unsqueeze(1)  # [T*B, K]
    logits += bag_means.view(num_tables, batch_size, num_tasks).sum(0)

    # History items only: targets are what is being predicted, not evidence.
    lengths = seq_offsets.diff()
    history_lengths = lengths - num_targets
    positions = torch.arange(seq_ids.numel()) - torch.repeat_interleave(seq_offsets[:-1], lengths,
                                                                           output_size=seq_ids.numel())
    is_history = positions < torch.repeat_interleave(history_lengths, lengths, output_size=seq_ids.numel())
    item_scores = _id_scores(seq_ids, task + num_tables * num_tasks) * is_history.unsqueeze(1)
    logits += _segment_sum(item_scores, seq_offsets) / history_lengths.clamp(min=1).unsqueeze(1)
    return logits


def make_batch(cfg: GemConfig, batch_size: int, device: torch.device | str = "cpu", seed: int = 0) -> Batch:
    """A synthetic batch, deterministic per (cfg, batch_size, seed); generated on the CPU and moved.

    Bag sizes are uniform in [0, max_bag_size] (empty bags included), ids Zipf-like (P(k) ~ 1/(k+1));
    history lengths uniform in [0, max_seq_len] and forced to 0 with probability empty_seq_prob;
    timestamps strictly increasing within a sequence (gaps of 1 s to 1 day); num_targets uniform in
    [0, max_num_targets], at most the length. Labels ~ Bernoulli(sigmoid(2 * teacher_logits)).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
    generator = torch.Generator().manual_seed(seed)
    num_tables = cfg.num_tables

    dense = torch.randn(batch_size, cfg.num_dense, generator=generator)

    bag_lengths = torch.randint(0, cfg.max_bag_size + 1, (num_tables * batch_size,), generator=generator)
    sparse_offsets = _offsets(bag_lengths)
    per_table = bag_lengths.view(num_tables, batch_size).sum(1).tolist()
    sparse_indices = torch.cat([_zipf_ids(rows, count, generator)
                                for rows, count in zip(cfg.num_embeddings_per_table, per_table)])

    seq_lengths = torch.randint(0, cfg.max_seq_len + 1, (batch_size,), generator=generator)
    seq_lengths[torch.rand(batch_size, generator=generator) < cfg.empty_seq_prob] = 0
    seq_offsets = _offsets(seq_lengths)
    total = int(seq_offsets[-1])
    seq_ids = _zipf_ids(cfg.num_items, total, generator)
    gaps = torch.randint(1, _SECONDS_PER_DAY + 1, (total,), generator=generator)
    starts = torch.randint(1_600_000_000, 1_700_000_000, (batch_size,), generator=generator)
    running = torch.cumsum(gaps, 0)
    # Restart the running sum at each sequence: subtract the sum before the sequence's first item.
    before = torch.cat([torch.zeros(1, dtype=torch.int64), running])[seq_offsets[:-1]]
    seq_timestamps = running - torch.repeat_interleave(before - starts, seq_lengths, output_size=total)
    num_targets = torch.minimum(torch.randint(0, cfg.max_num_targets + 1, (batch_size,), generator=generator),
                                seq_lengths)

    logits = teacher_logits(cfg, dense, sparse_indices, sparse_offsets, seq_ids, seq_offsets, num_targets)
    labels = (torch.rand(logits.shape, generator=generator, dtype=torch.float64) < torch.sigmoid(2.0 * logits))

    batch = Batch(dense=dense, sparse_indices=sparse_indices, sparse_offsets=sparse_offsets, seq_ids=seq_ids,
                  seq_timestamps=seq_timestamps, seq_offsets=seq_offsets, num_targets=num_targets,
                  labels=labels.float())
    return batch.to(device)

"""Synthetic batches for the GEM-like model, with labels from a planted teacher.

A batch of B users (TorchRec / FBGEMM vocabulary, every index tensor int64):
  dense               [B, num_dense] float32
  sparse_values       [N] ids, sparse_lengths [T*B]: the KeyedJaggedTensor of the categorical
                      features, feature-major (bag b of table t has length sparse_lengths[t*B+b]);
                      `batch.sparse_features()` builds the torchrec KeyedJaggedTensor
  history_ids, history_actions, history_timestamps [S]: the users' histories back to back,
                      history_offsets [B+1]; timestamps strictly increasing within a history
  candidate_ids       [R] items to score, num_candidates [B] (K_b >= 1, R = sum K_b), all shown at
                      request_timestamps [B] (after the user's last event)
  labels              [R, num_tasks] float32 in {0, 1}, one row per (user, candidate): click, conversion
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields

import torch

from .config import GemConfig

_HOUR = 3600
_DAY = 24 * _HOUR


@dataclass
class Batch:
    dense: torch.Tensor
    sparse_values: torch.Tensor
    sparse_lengths: torch.Tensor
    history_ids: torch.Tensor
    history_actions: torch.Tensor
    history_timestamps: torch.Tensor
    history_offsets: torch.Tensor
    candidate_ids: torch.Tensor
    num_candidates: torch.Tensor
    request_timestamps: torch.Tensor
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.dense.shape[0]

    @property
    def sparse_offsets(self) -> torch.Tensor:
        return _offsets(self.sparse_lengths)

    def sparse_features(self):
        """The categorical features as a torchrec KeyedJaggedTensor, keys sparse_0 .. sparse_{T-1}."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        num_tables = self.sparse_lengths.numel() // max(self.batch_size, 1)
        return KeyedJaggedTensor(keys=sparse_feature_names(num_tables), values=self.sparse_values,
                                 lengths=self.sparse_lengths)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})


def sparse_feature_names(num_tables: int) -> list[str]:
    return [f"sparse_{t}" for t in range(num_tables)]


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = lengths.new_zeros(lengths.numel() + 1)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def _zipf_ids(num_rows: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Ids in [0, num_rows) with P(id = k) ~ 1/(k+1) (log-uniform: id = floor((n+1)^u) - 1)."""
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    ids = torch.floor(torch.exp(u * math.log(num_rows + 1))).long() - 1
    return ids.clamp_(0, num_rows - 1)


def _id_hash(ids: torch.Tensor, salts: torch.Tensor) -> torch.Tensor:
    """A fixed pseudo-random value in [-1, 1) per (id, salt): ids [N], salts [K] -> [N, K] float64.
    Stateless (fract(sin(x) * 43758.5453)), so the teacher needs no table of the vocabulary's size."""
    x = ids.double().unsqueeze(1) * 12.9898 + salts.double() * 78.233
    return torch.frac(torch.sin(x).mul_(43758.5453)).abs_().mul_(2.0).sub_(1.0)


def _segment_mean(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean of each segment of values [N, K] (0 for an empty one) -> [len(lengths), K]."""
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=values.shape[0])
    sums = values.new_zeros((lengths.numel(), values.shape[1])).index_add_(0, segment, values)
    return sums / lengths.clamp(min=1).unsqueeze(1)


# hashed_ids: table t's population at batch i is a window of HASHED_WINDOW x rows_t concepts that
# slides by rows_t // HASHED_DRIFT_DIVISOR concepts per batch; within it the newest concept is the most
# frequent (Zipf rank 0), so new ids arrive every batch and old ones fade; each concept is a fixed
# pseudo-random 64-bit id. With twice as many live ids as slots, the tables must evict.
HASHED_WINDOW = 2
HASHED_DRIFT_DIVISOR = 16


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX_A, _MIX_B = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _logical_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def raw_id(concepts: torch.Tensor, table: int) -> torch.Tensor:
    """The raw 64-bit id of each concept of table ``table``: splitmix64's finaliser of
    (concept + table * 2**40), in int64 arithmetic that wraps (any value, sign bit included)."""
    x = concepts + (table << 40)
    x = (x ^ _logical_shift(x, 30)) * _MIX_A
    x = (x ^ _logical_shift(x, 27)) * _MIX_B
    return x ^ _logical_shift(x, 31)


def _hashed_ids(num_rows: int, table: int, count: int, index: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` raw ids of table ``table`` at batch ``index`` (see HASHED_WINDOW)."""
    window = HASHED_WINDOW * num_rows
    newest = window - 1 + index * max(1, num_rows // HASHED_DRIFT_DIVISOR)
    return raw_id(newest - _zipf_ids(window, count, generator), table)


TEACHER_TASTE_DIM = 4
RECENCY_SECONDS = _DAY


def teacher_logits(cfg: GemConfig, batch: Batch) -> torch.Tensor:
    """The planted teacher: [R, num_tasks] float64, on the CPU. For candidate c of user b, task k::

        logit = 0.5 * dense_b . w_k / sqrt(num_dense)                    dense features
              + 0.5 * sum_t mean_{i in bag(t, b)} h(i, salt(t, k))       the categorical ids
              + 0.5 * h(c, salt_k)                                       the candidate
              + 2 * <v(c), mean_{j in history} v(j)>                     the user's taste (history)
              + 3 * tanh(sum_{j in history, j == c} a_k(action_j) * exp(-(t_request - t_j) / 1 day)) - 1
                                                                         re-engagement, with recency
              - 0.5 * k                                                  (conversions are rarer)

    h and v are fixed hashes into [-1, 1) (v in R^4), a_0 = 1 and a_k(a) = 2 (a + 1) / num_actions
    for the later tasks (a conversion follows the stronger past actions). Only a model that sees
    the history, its timestamps and its actions next to the candidate can learn the last two terms.
    """
    batch_size, num_tasks, num_tables = batch.batch_size, cfg.num_tasks, cfg.num_tables
    task = torch.arange(num_tasks)
    generator = torch.Generator().manual_seed(cfg.teacher_seed)
    w = torch.randn(cfg.num_dense, num_tasks, generator=generator, dtype=torch.float64)
    user = 0.5 * batch.dense.double() @ w / math.sqrt(cfg.num_dense)                          # [B, K]

    bag_table = torch.arange(num_tables).repeat_interleave(batch_size)
    index_table = torch.repeat_interleave(bag_table, batch.sparse_lengths, output_size=batch.sparse_values.numel())
    scores = _id_hash(batch.sparse_values, index_table.unsqueeze(1) * num_tasks + task)
    user += 0.5 * _segment_mean(scores, batch.sparse_lengths).view(num_tables, batch_size, num_tasks).sum(0)

    history_lengths = batch.history_offsets.diff()
    taste_salts = torch.arange(TEACHER_TASTE_DIM) + 1000
    taste = _segment_mean(_id_hash(batch.history_ids, taste_salts), history_lengths)          # [B, 4]

    owner = torch.repeat_interleave(torch.arange(batch_size), batch.num_candidates)           # [R]
    cand = batch.candidate_ids
    logits = user[owner] + 0.5 * _id_hash(cand, task + 2000)
    logits += 2.0 * (_id_hash(cand, taste_salts) * taste[owner]).sum(1, keepdim=True)

    # Re-engagement: the candidate's earlier occurrences in its user's history, padded [R, L].
    max_len = max(int(history_lengths.max()) if batch_size else 0, 1)
    seq = torch.repeat_interleave(torch.arange(batch_size), history_lengths)
    pos = torch.arange(batch.history_ids.numel()) - batch.history_offsets[:-1][seq]
    padded_ids = torch.full((batch_size, max_len), -1, dtype=torch.int64).index_put_((seq, pos), batch.history_ids)
    padded_ts = torch.zeros(batch_size, max_len, dtype=torch.int64).index_put_((seq, pos), batch.history_timestamps)
    padded_act = torch.zeros(batch_size, max_len, dtype=torch.int64).index_put_((seq, pos), batch.history_actions)
    match = (padded_ids[owner] == cand.unsqueeze(1)).double()                                  # [R, L]
    age = (batch.request_timestamps[owner].unsqueeze(1) - padded_ts[owner]).double()
    recency = torch.exp(-age.clamp(min=0) / RECENCY_SECONDS) * match
    action_weight = torch.ones(cfg.num_actions, num_tasks, dtype=torch.float64)
    action_weight[:, 1:] = (2.0 * (torch.arange(cfg.num_actions) + 1) / cfg.num_actions).double().unsqueeze(1)
    engagement = torch.einsum("rl,rlk->rk", recency, action_weight[padded_act[owner]])
    logits += 3.0 * torch.tanh(engagement) - 1.0
    return logits - 0.5 * task.double()


class SyntheticBatches:
    """Deterministic synthetic batches of `batch_size` users (default: the config's).

    `batches[i]` (or iterating) is training batch i; `held_out(i)` is batch i of a disjoint stream
    drawn the same way, for evaluation. Every batch is a pure function of (config, batch_size,
    seed, stream, i), generated on the CPU.

    Ids are Zipf-distributed (P(k) ~ 1/(k+1)); with ``hashed_ids`` the categorical ids are raw 64-bit
    ids of a drifting population (HASHED_WINDOW), the same Zipf over its concepts; bag sizes uniform in [0, max_bag_size]; history
    lengths lognormal (median seq_len_median, log-std seq_len_sigma) capped at max_seq_len, so
    empty histories occur; timestamps increase by exponential gaps (mean 8 hours), the request comes
    a little after the last event; K_b uniform in [1, max_num_candidates]; half the candidates
    are one of the user's last 8 items (re-engagement), the rest Zipf. Labels ~
    Bernoulli(sigmoid(teacher_logits)).
    """

    def __init__(self, config: GemConfig, batch_size: int | None = None, seed: int = 0):
        batch_size = config.batch_size if batch_size is None else batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.config, self.batch_size, self.seed = config, batch_size, seed

    def __getitem__(self, index: int) -> Batch:
        return self._make(index, held_out=False)

    def __iter__(self):
        index = 0
        while True:
            yield self[index]
            index += 1

    def held_out(self, index: int) -> Batch:
        return self._make(index, held_out=True)

    def _make(self, index: int, held_out: bool) -> Batch:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be an int >= 0, got {index!r}")
        # The CPU generator keeps 32 bits of its seed: mix (seed, stream, index) into 32 bits.
        key = hashlib.blake2b(f"{self.seed}/{int(held_out)}/{index}".encode(), digest_size=4).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key, "little"))
        return make_batch(self.config, self.batch_size, generator, index)


def make_batch(cfg: GemConfig, batch_size: int, generator: torch.Generator, index: int = 0) -> Batch:
    """Batch ``index`` drawn with `generator` (see SyntheticBatches for the distributions; the index
    only places the window of raw ids with ``cfg.hashed_ids``)."""
    num_tables = cfg.num_tables
    dense = torch.randn(batch_size, cfg.num_dense, generator=generator)

    sparse_lengths = torch.randint(0, cfg.max_bag_size + 1, (num_tables * batch_size,), generator=generator)
    per_table = sparse_lengths.view(num_tables, batch_size).sum(1).tolist()
    if cfg.hashed_ids:
        sparse_values = torch.cat([_hashed_ids(rows, t, count, index, generator)
                                   for t, (rows, count) in enumerate(zip(cfg.num_embeddings_per_table, per_table))])
    else:
        sparse_values = torch.cat([_zipf_ids(rows, count, generator)
                                   for rows, count in zip(cfg.num_embeddings_per_table, per_table)])

    normal = torch.randn(batch_size, generator=generator, dtype=torch.float64)
    lengths = torch.exp(math.log(cfg.seq_len_median) + cfg.seq_len_sigma * normal).floor().long()
    lengths = lengths.clamp_(0, cfg.max_seq_len)
    offsets = _offsets(lengths)
    total = int(offsets[-1])
    history_ids = _zipf_ids(cfg.num_items, total, generator)
    history_actions = torch.randint(0, cfg.num_actions, (total,), generator=generator)
    gaps = torch.empty(total, dtype=torch.float64).exponential_(1.0, generator=generator).mul_(8 * _HOUR).long() + 1
    starts = torch.randint(1_600_000_000, 1_700_000_000, (batch_size,), generator=generator)
    running = torch.cumsum(gaps, 0)
    # Restart the running sum at each history: subtract the sum before its first item.
    before = torch.cat([running.new_zeros(1), running])[offsets[:-1]]
    history_timestamps = running - torch.repeat_interleave(before - starts, lengths, output_size=total)
    last = torch.where(lengths > 0, torch.cat([history_timestamps, starts.new_zeros(1)])[(offsets[1:] - 1).clamp(min=0)],
                       starts)
    request_timestamps = last + torch.randint(60, 4 * _HOUR, (batch_size,), generator=generator)

    num_candidates = torch.randint(1, cfg.max_num_candidates + 1, (batch_size,), generator=generator)
    owner = torch.repeat_interleave(torch.arange(batch_size), num_candidates)
    num_rows = owner.numel()
    candidate_ids = _zipf_ids(cfg.num_items, num_rows, generator)
    recent = torch.minimum(lengths[owner], torch.tensor(8))
    back = (torch.rand(num_rows, generator=generator, dtype=torch.float64) * recent).long()  # 0 .. recent-1
    reengage = (torch.rand(num_rows, generator=generator) < 0.5) & (recent > 0)
    source = (offsets[1:][owner] - 1 - back).clamp(min=0)
    if total:
        candidate_ids = torch.where(reengage, history_ids[source.clamp(max=total - 1)], candidate_ids)

    batch = Batch(dense=dense, sparse_values=sparse_values, sparse_lengths=sparse_lengths, history_ids=history_ids,
                  history_actions=history_actions, history_timestamps=history_timestamps, history_offsets=offsets,
                  candidate_ids=candidate_ids, num_candidates=num_candidates, request_timestamps=request_timestamps,
                  labels=torch.empty(0))
    logits = teacher_logits(cfg, batch)
    batch.labels = (torch.rand(logits.shape, generator=generator, dtype=torch.float64)
                    < torch.sigmoid(logits)).float()
    return batch

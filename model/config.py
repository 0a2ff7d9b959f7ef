"""GemConfig: the sizes of the GEM-like recommendation model and of its synthetic data."""

from __future__ import annotations

from dataclasses import dataclass


INTERACTIONS = ("dot", "wukong")
TASKS = ("click", "conversion")


@dataclass(frozen=True)
class GemConfig:
    """Model and data sizes. Presets: `tiny()` (tests, seconds on a CPU), `small()` (CPU bench),
    `large()` (one H200 in bf16).

    One row of the interaction arch per (user, candidate): its F = num_tables + 2 tokens are the
    dense-arch output, one pooled embedding per sparse table and the candidate's HSTU output token,
    all of width embedding_dim (DLRM's dot interaction and Wukong's layers need one width).
    """

    # Dense features [B, num_dense] -> dense arch MLP -> [B, embedding_dim].
    num_dense: int = 13
    dense_arch_layers: tuple[int, ...] = (32,)
    # Sparse features: one sum-pooled bag per table and user; bag sizes uniform in [0, max_bag_size].
    num_embeddings_per_table: tuple[int, ...] = (1000, 1000, 1000, 1000)
    embedding_dim: int = 16
    max_bag_size: int = 4
    # hashed_ids: the categorical features are raw 64-bit ids (hashes) whose population drifts (new
    # ids every batch, old ones fading; model/data.py), looked up through zero-collision hashed
    # tables of num_embeddings_per_table slots (gk.torchrec.ZchEmbeddingBagCollection, fused; TorchRec's
    # ManagedCollisionEmbeddingBagCollection with MCH modules, eager), which admit and evict (LRU).
    hashed_ids: bool = False
    # User history: item ids, action ids, increasing timestamps; lognormal lengths (median
    # seq_len_median, log-std seq_len_sigma) capped at max_seq_len. K candidates per user, K uniform
    # in [1, max_num_candidates], appended to the history as HSTU targets.
    num_items: int = 2000
    num_actions: int = 4
    max_seq_len: int = 20
    seq_len_median: float = 8.0
    seq_len_sigma: float = 0.8
    max_num_candidates: int = 4
    # Sequence arch: contextual_len tokens projected from the non-sequence tokens are prepended
    # (InterFormer), then num_hstu_layers HSTU layers with relative position and time bias.
    # use_sequence=False drops the history: a candidate's token is its item embedding alone.
    use_sequence: bool = True
    contextual_len: int = 2
    num_hstu_layers: int = 2
    num_heads: int = 2
    hstu_linear_dim: int = 8
    hstu_attention_dim: int = 8
    num_time_buckets: int = 32
    # Interaction arch over the F tokens: "wukong" (GEM's choice, a stack of Wukong layers) or "dot"
    # (DLRM's pairwise dot products, upper triangle).
    interaction: str = "wukong"
    wukong_layers: int = 2
    wukong_fm_out: int = 4
    wukong_lcb_out: int = 4
    wukong_fm_rank: int = 4
    wukong_mlp: tuple[int, ...] = (64,)
    # Over arch MLP -> one logit per task (click, conversion).
    over_arch_layers: tuple[int, ...] = (64, 32)
    num_tasks: int = 2
    batch_size: int = 256
    # Learning rates: Adam for the dense parameters, row-wise Adagrad for the embedding tables.
    dense_lr: float = 3e-3
    sparse_lr: float = 0.05
    # Seed of the planted teacher the labels are drawn from (the same for every batch).
    teacher_seed: int = 1234

    def __post_init__(self) -> None:
        positive = dict(num_dense=self.num_dense, embedding_dim=self.embedding_dim, num_items=self.num_items,
                        num_actions=self.num_actions, max_seq_len=self.max_seq_len,
                        max_num_candidates=self.max_num_candidates, num_time_buckets=self.num_time_buckets,
                        num_heads=self.num_heads, hstu_linear_dim=self.hstu_linear_dim,
                        hstu_attention_dim=self.hstu_attention_dim, num_tasks=self.num_tasks,
                        batch_size=self.batch_size)
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        nonnegative = dict(max_bag_size=self.max_bag_size, contextual_len=self.contextual_len,
                           num_hstu_layers=self.num_hstu_layers)
        for name, value in nonnegative.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not self.num_embeddings_per_table or min(self.num_embeddings_per_table) < 1:
            raise ValueError(f"num_embeddings_per_table must be non-empty with every entry >= 1, "
                             f"got {self.num_embeddings_per_table}")
        if self.interaction not in INTERACTIONS:
            raise ValueError(f"interaction must be one of {INTERACTIONS}, got {self.interaction!r}")
        if self.interaction == "wukong":
            wukong = dict(wukong_layers=self.wukong_layers, wukong_fm_out=self.wukong_fm_out,
                          wukong_fm_rank=self.wukong_fm_rank)
            for name, value in wukong.items():
                if value < 1:
                    raise ValueError(f"{name} must be >= 1, got {value}")
            if self.wukong_lcb_out < 0:
                raise ValueError(f"wukong_lcb_out must be >= 0, got {self.wukong_lcb_out}")
        if not self.seq_len_median > 0 or not self.seq_len_sigma >= 0:
            raise ValueError(f"seq_len_median must be > 0 and seq_len_sigma >= 0, got {self.seq_len_median} "
                             f"and {self.seq_len_sigma}")
        if not isinstance(self.hashed_ids, bool):
            raise ValueError(f"hashed_ids must be a bool, got {self.hashed_ids!r}")
        if self.hashed_ids and min(self.num_embeddings_per_table) < 2:
            raise ValueError(f"hashed_ids needs num_embeddings_per_table >= 2 everywhere (one row is the default "
                             f"row of ids without a slot), got {self.num_embeddings_per_table}")
        for name in ("dense_lr", "sparse_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def num_tables(self) -> int:
        return len(self.num_embeddings_per_table)

    @property
    def num_features(self) -> int:
        """F: dense-arch output + one per table + the candidate's HSTU token."""
        return self.num_tables + 2

    @property
    def num_interactions(self) -> int:
        """F * (F - 1) / 2: the upper triangle (i < j) of the dot-product matrix."""
        return self.num_features * (self.num_features - 1) // 2

    @property
    def interaction_width(self) -> int:
        """Width of the interaction arch's output: the dot products, or the flattened Wukong tokens."""
        if self.interaction == "dot":
            return self.num_interactions
        return (self.wukong_fm_out + self.wukong_lcb_out) * self.embedding_dim

    @property
    def attention_max_len(self) -> int:
        """The longest jagged HSTU sequence: contextual tokens + history + candidates (the size of
        the relative position bias)."""
        return self.contextual_len + self.max_seq_len + self.max_num_candidates

    @property
    def task_names(self) -> tuple[str, ...]:
        return TASKS[: self.num_tasks] + tuple(f"task{k}" for k in range(len(TASKS), self.num_tasks))

    @classmethod
    def tiny(cls) -> "GemConfig":
        """Tests: a training step of batch 64 in a few ms on one core."""
        return cls(num_embeddings_per_table=(200, 200, 200), embedding_dim=16, num_items=300, max_seq_len=12,
                   seq_len_median=5.0, max_num_candidates=3, num_hstu_layers=1, wukong_layers=1,
                   wukong_mlp=(32,), over_arch_layers=(32,), batch_size=64)

    @classmethod
    def small(cls) -> "GemConfig":
        """CPU bench: a training step at batch 256 in tens of ms on 2 cores."""
        return cls(num_embeddings_per_table=(20_000,) * 8, embedding_dim=32, max_bag_size=8, num_items=50_000,
                   max_seq_len=64, seq_len_median=24.0, max_num_candidates=8, contextual_len=2,
                   num_hstu_layers=2, num_heads=2, hstu_linear_dim=16, hstu_attention_dim=16,
                   wukong_layers=2, wukong_fm_out=8, wukong_lcb_out=8, wukong_fm_rank=8, wukong_mlp=(128,),
                   over_arch_layers=(128, 64), batch_size=256)

    @classmethod
    def large(cls) -> "GemConfig":
        """One H200 in bf16: 8 tables x 500k rows and 1M items at D = 256 (~6 GB of fp32 tables
        with their row-wise state), histories up to 512 (median 200), 8 HSTU layers of 4 heads,
        batch 256 users (the eager baseline's padded attention must fit too)."""
        return cls(num_dense=64, dense_arch_layers=(512, 256), num_embeddings_per_table=(500_000,) * 8,
                   embedding_dim=256, max_bag_size=32, num_items=1_000_000, num_actions=8, max_seq_len=512,
                   seq_len_median=200.0, seq_len_sigma=0.7, max_num_candidates=32, contextual_len=4,
                   num_hstu_layers=8, num_heads=4, hstu_linear_dim=64, hstu_attention_dim=64, num_time_buckets=64,
                   wukong_layers=3, wukong_fm_out=16, wukong_lcb_out=16, wukong_fm_rank=32,
                   wukong_mlp=(2048, 2048), over_arch_layers=(2048, 1024, 512), batch_size=256)


PRESETS = {"tiny": GemConfig.tiny, "small": GemConfig.small, "large": GemConfig.large}

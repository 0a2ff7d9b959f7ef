"""GemConfig: the sizes of a GEM-like recommendation model and of its synthetic data."""

from __future__ import annotations

from dataclasses import dataclass


INTERACTIONS = ("dot", "wukong")


@dataclass(frozen=True)
class GemConfig:
    """Model and data sizes. `small()` fits a CPU test, `gpu()` a single-GPU benchmark.

    Features of the interaction arch, in order: the dense-arch output, one pooled embedding per
    sparse table, the pooled user-history representation; F = num_tables + 2, all of width
    embedding_dim (DLRM's dot interaction and Wukong's layers need one width).
    """

    # Dense features [B, num_dense] -> dense arch MLP -> [B, embedding_dim].
    num_dense: int = 13
    dense_arch_layers: tuple[int, ...] = (32,)
    # Sparse features: one sum-pooled embedding bag per table; bag sizes uniform in [0, max_bag_size].
    num_embeddings_per_table: tuple[int, ...] = (1000, 1000, 1000, 1000)
    embedding_dim: int = 16
    max_bag_size: int = 4
    # User history: item ids with timestamps, lengths uniform in [0, max_seq_len], the last
    # num_targets[b] (uniform in [0, max_num_targets]) items are targets.
    num_items: int = 2000
    max_seq_len: int = 20
    max_num_targets: int = 2
    num_time_buckets: int = 32
    num_attention_layers: int = 2
    num_heads: int = 2
    ffn_multiplier: int = 2
    # Interaction arch over the F features: "dot" (DLRM's pairwise dot products) or "wukong" (GEM's
    # choice: a stack of Wukong layers, each a factorization-machine block of wukong_fm_out features
    # (rank wukong_fm_rank, MLP wukong_mlp) and a linear-compression block of wukong_lcb_out).
    interaction: str = "dot"
    wukong_layers: int = 2
    wukong_fm_out: int = 4
    wukong_lcb_out: int = 4
    wukong_fm_rank: int = 4
    wukong_mlp: tuple[int, ...] = (64,)
    # Over arch MLP -> num_tasks logits.
    over_arch_layers: tuple[int, ...] = (64, 32)
    num_tasks: int = 2
    # Probability that a sequence is forced empty (on top of the uniform length draw), so that
    # zero-length histories are common even with long max_seq_len.
    empty_seq_prob: float = 0.1
    # Seed of the fixed "teacher" function the labels are drawn from (the same for every batch).
    teacher_seed: int = 1234

    def __post_init__(self) -> None:
        positive = dict(num_dense=self.num_dense, embedding_dim=self.embedding_dim, num_items=self.num_items,
                        num_time_buckets=self.num_time_buckets, num_heads=self.num_heads,
                        ffn_multiplier=self.ffn_multiplier, num_tasks=self.num_tasks)
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        nonnegative = dict(max_bag_size=self.max_bag_size, max_seq_len=self.max_seq_len,
                           max_num_targets=self.max_num_targets, num_attention_layers=self.num_attention_layers)
        for name, value in nonnegative.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
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
        if self.embedding_dim % self.num_heads:
            raise ValueError(f"embedding_dim ({self.embedding_dim}) must be divisible by num_heads ({self.num_heads})")
        if not 0.0 <= self.empty_seq_prob <= 1.0:
            raise ValueError(f"empty_seq_prob must be in [0, 1], got {self.empty_seq_prob}")

    @property
    def num_tables(self) -> int:
        return len(self.num_embeddings_per_table)

    @property
    def num_features(self) -> int:
        """F: dense-arch output + one per table + the user-history representation."""
        return self.num_tables + 2

    @property
    def num_interactions(self) -> int:
        """F * (F - 1) / 2: the upper triangle (i < j) of the dot-product matrix."""
        return self.num_features * (self.num_features - 1) // 2

    @property
    def interaction_width(self) -> int:
        """Width of the interaction arch's output: the dot products, or the flattened Wukong features."""
        if self.interaction == "dot":
            return self.num_interactions
        return (self.wukong_fm_out + self.wukong_lcb_out) * self.embedding_dim

    @property
    def head_dim(self) -> int:
        return self.embedding_dim // self.num_heads

    @classmethod
    def small(cls) -> "GemConfig":
        """CPU-sized: a training step at batch 256 takes well under a second on 2 cores."""
        return cls()

    @classmethod
    def gpu(cls) -> "GemConfig":
        """Single-GPU benchmark size: 16 tables x 100k rows and 500k items at D=128 (~1.1 GB of
        fp32 embeddings), histories up to 512 items, 4 attention layers of 4 heads."""
        return cls(
            num_dense=64,
            dense_arch_layers=(512, 256),
            num_embeddings_per_table=(100_000,) * 16,
            embedding_dim=128,
            max_bag_size=32,
            num_items=500_000,
            max_seq_len=512,
            max_num_targets=8,
            num_time_buckets=64,
            num_attention_layers=4,
            num_heads=4,
            ffn_multiplier=4,
            interaction="wukong",
            wukong_layers=2,
            wukong_fm_out=16,
            wukong_lcb_out=16,
            wukong_fm_rank=16,
            wukong_mlp=(1024,),
            over_arch_layers=(1024, 512, 256),
            num_tasks=4,
        )

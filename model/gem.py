"""GemModel: a GEM-like recommendation model (dense arch, sparse arch, sequence arch, DLRM dot or
Wukong interaction, over arch, task heads) on eager PyTorch or on gem_kernels' fused kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gem_kernels import flops

from .archs import InteractionArch, SequenceArch, SparseArch, check_kernels, mlp, mlp_flops
from .config import GemConfig
from .data import Batch


class GemModel(nn.Module):
    """logits[B, num_tasks] = task_heads(over_arch([d, interaction([d, e_1..e_T, u])]))

    d = dense_arch(dense) [B, D], e_t = sum-pooled bag of table t [B, D], u = mean over the user
    history after the attention layers [B, D] (0 for an empty history); interaction is DLRM's dot
    interaction or a Wukong stack (cfg.interaction).

    Args:
        cfg: sizes.
        kernels: "eager" (plain PyTorch) or "fused" (gem_kernels ops where they exist; see the
            switch tables in model/archs.py).
        seed: parameters are initialised from torch.manual_seed(seed) in a forked CPU RNG (the
            global RNG is left alone), so both `kernels` give identical parameters for one seed.
            None draws from the global RNG.
    """

    def __init__(self, cfg: GemConfig, kernels: str = "eager", seed: int | None = 0):
        super().__init__()
        check_kernels(kernels)
        self.cfg = cfg
        self.kernels = kernels
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self.dense_arch = mlp((cfg.num_dense,) + cfg.dense_arch_layers + (cfg.embedding_dim,),
                                  final_activation=True)
            self.sparse_arch = SparseArch(cfg, kernels)
            self.sequence_arch = SequenceArch(cfg, kernels)
            self.interaction_arch = InteractionArch(cfg, kernels)

    def forward(self, batch: Batch) -> torch.Tensor:
        """-> logits [B, num_tasks]."""
        dense_out = self.dense_arch(batch.dense)                                                  # [B, D]
        pooled = self.sparse_arch(batch.sparse_indices, batch.sparse_offsets, batch.batch_size)   # [B, T, D]
        user = self.sequence_arch(batch.seq_ids, batch.seq_timestamps, batch.seq_offsets, batch.num_targets)
        features = torch.cat([dense_out.unsqueeze(1), pooled, user.unsqueeze(1)], dim=1)         # [B, F, D]
        return self.interaction_arch(dense_out, features)

    def loss(self, batch: Batch) -> torch.Tensor:
        """Mean binary cross-entropy with logits over the batch and the tasks."""
        return F.binary_cross_entropy_with_logits(self(batch), batch.labels)

    def flops_per_step(self, batch: Batch) -> int:
        """Analytic FLOPs of one training step (forward + backward) on `batch`.

        Counts matmuls (2*m*n*k each) and attention on the real jagged lengths (QK^T and PV over the
        causal half: 2 * sum_b L_b^2 * D per layer); backward = 2x forward, so a step is 3x forward.
        Wukong layers count as gem_kernels.flops.wukong_layer does. Embedding pooling, the other norms,
        activations and the loss are not counted.
        """
        cfg = self.cfg
        rows, dim = batch.batch_size, cfg.embedding_dim
        lengths = batch.seq_offsets.diff().long()
        tokens = int(lengths.sum())
        forward = mlp_flops((cfg.num_dense,) + cfg.dense_arch_layers + (dim,), rows)
        ffn_dim = cfg.ffn_multiplier * dim
        per_layer = (2 * tokens * dim * 3 * dim              # qkv projection
                     + 2 * tokens * dim * dim                # output projection
                     + 2 * 2 * tokens * dim * ffn_dim        # FFN, two matmuls
                     + 2 * int((lengths * lengths).sum()) * dim)  # causal QK^T + PV, all heads
        forward += cfg.num_attention_layers * per_layer
        if cfg.interaction == "dot":
            forward += rows * cfg.num_interactions * 2 * dim     # one D-long dot per pair i < j
        else:
            num_in = cfg.num_features
            for _ in range(cfg.wukong_layers):
                forward += flops.wukong_layer(rows, num_in, cfg.wukong_fm_out, cfg.wukong_lcb_out, dim,
                                              cfg.wukong_fm_rank, list(cfg.wukong_mlp), 4)[0]
                num_in = cfg.wukong_fm_out + cfg.wukong_lcb_out
        forward += mlp_flops((dim + cfg.interaction_width,) + cfg.over_arch_layers + (cfg.num_tasks,), rows)
        return 3 * forward


def train_step(model: GemModel, batch: Batch, optimizer: torch.optim.Optimizer,
               autocast_dtype: torch.dtype | None = None) -> float:
    """One optimisation step: forward, backward, optimizer.step(). Returns the loss (a host sync).

    autocast_dtype (e.g. torch.bfloat16): the forward runs under torch.autocast on the batch's
    device (mixed precision: fp32 parameters, lower-precision products); the backward outside it."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    device_type = batch.labels.device.type
    with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = model.loss(batch)
    loss.backward()
    optimizer.step()
    return float(loss.detach())

"""``python -m model.train --distributed``: GemModel under TorchRec's DistributedModelParallel.

    torchrun --standalone --nproc_per_node 2 -m model.train --config tiny --distributed [--plan table_wise|column_wise|auto]

What is sharded how: the categorical tables (``sparse_arch``) become a gk.torchrec
``FusedEmbeddingBagCollection`` and the item/action tables of the sequence arch a
``FusedEmbeddingCollection``; both are sharded by the gem_kernels sharders under ``--plan``, and
every rank runs its shards with the fused kernel and its row-wise Adagrad. Everything else (dense,
HSTU, interaction, heads) is replicated and trained data-parallel (DMP's default DDP wrap, Adam).
Backend: NCCL when the device is a GPU (one per rank, ``LOCAL_RANK``), gloo on the CPU.

Data: rank r of W trains step i on batch ``i * W + r`` of the seeded stream (batches of
``batch_size // W`` users), so the global batch of a step is ``batch_size`` users on any W.
Checkpoints (``--checkpoint DIR``): torch.distributed.checkpoint (sharded tables + fused optimizer
state + dense + Adam), saved at the end, loadable at another world size (``--resume``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os

import torch
import torch.distributed as dist
from torch import nn

from .archs import sparse_feature_names
from .data import SyntheticBatches


class ShardableSparseArch(nn.Module):
    """SparseArch on a KJT-fed ``gk.torchrec.FusedEmbeddingBagCollection`` (the form DMP shards);
    same tables, same output [B, T, D]."""

    def __init__(self, arch: nn.Module, cfg):
        super().__init__()
        from torchrec import EmbeddingBagConfig, PoolingType

        from gem_kernels.torchrec import FusedEmbeddingBagCollection

        self.names = sparse_feature_names(cfg.num_tables)
        configs = [EmbeddingBagConfig(name=f"table_{t}", embedding_dim=cfg.embedding_dim, num_embeddings=rows,
                                      feature_names=[name], pooling=PoolingType.SUM)
                   for t, (rows, name) in enumerate(zip(cfg.num_embeddings_per_table, self.names))]
        self.ebc = FusedEmbeddingBagCollection(configs, optimizer=arch.ebc.optimizer, bounds_check="fatal")
        with torch.no_grad():
            for t in range(cfg.num_tables):
                self.ebc.weight(f"table_{t}").copy_(arch.ebc.weight(f"table_{t}"))
        self.num_tables, self.dim = cfg.num_tables, cfg.embedding_dim

    def forward(self, batch) -> torch.Tensor:
        pooled = self.ebc(batch.sparse_features())  # sharded: keys in the plan's order, so picked by name
        return torch.cat([pooled[name] for name in self.names], dim=1).view(batch.batch_size, self.num_tables,
                                                                            self.dim)

    def embedding_parameters(self) -> list:
        return []


class ShardableSequenceEmbeddings(nn.Module):
    """SequenceEmbeddings on a ``gk.torchrec.FusedEmbeddingCollection`` (tables item_table, action_table)."""

    def __init__(self, embeddings: nn.Module, cfg):
        super().__init__()
        from torchrec import EmbeddingConfig

        from gem_kernels.torchrec import FusedEmbeddingCollection

        rows = (cfg.num_items, cfg.num_actions + 1)
        configs = [EmbeddingConfig(name=name, embedding_dim=cfg.embedding_dim, num_embeddings=r, feature_names=[f])
                   for name, f, r in zip(("item_table", "action_table"), ("item", "action"), rows)]
        self.ec = FusedEmbeddingCollection(configs, optimizer=embeddings.ec.optimizer, bounds_check="fatal")
        with torch.no_grad():
            for t, name in enumerate(("item_table", "action_table")):
                self.ec.weight(name).copy_(embeddings.ec.weight(name))

    def forward(self, ids: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        n = ids.numel()
        lengths = torch.tensor([n, n], dtype=torch.int64, device=ids.device)
        out = self.ec(KeyedJaggedTensor(keys=["item", "action"], values=torch.cat([ids, actions]), lengths=lengths))
        return out["item"].values() + out["action"].values()

    def embedding_parameters(self) -> list:
        return []


class _Loss(nn.Module):
    """What DMP wraps: the model's loss (training) or logits (evaluation) through one forward, so
    DDP sees every step."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch, timer=None, logits: bool = False):
        return self.model(batch) if logits else self.model.loss(batch, timer)


class DistributedGem:
    """The part of GemModel's interface that model.train's loop uses, on the DMP-wrapped model."""

    def __init__(self, dmp, model):
        self.dmp, self.inner, self.cfg, self.kernels = dmp, model, model.cfg, model.kernels

    def train(self, mode: bool = True):
        self.dmp.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def loss(self, batch, timer=None):
        return self.dmp(batch, timer)

    def __call__(self, batch):
        return self.dmp(batch, None, True)

    def flops_per_step(self, batch) -> int:
        return self.inner.flops_per_step(batch)

    def flops_by_component(self, batch) -> dict[str, int]:
        return self.inner.flops_by_component(batch)

    def parameters(self):
        return self.dmp.parameters()


class RankBatches:
    """Rank r's share of the seeded stream: step i -> batch i * W + r (held-out batches: all ranks alike)."""

    def __init__(self, data: SyntheticBatches, rank: int, world: int):
        self.data, self.rank, self.world, self.batch_size = data, rank, world, data.batch_size

    def __getitem__(self, step: int):
        return self.data[step * self.world + self.rank]

    def held_out(self, i: int):
        return self.data.held_out(i)


def init(device: str) -> torch.device:
    """The process group of torchrun's environment: NCCL on GPUs (device cuda:LOCAL_RANK), gloo on CPUs."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        backend, where = "nccl", torch.device("cuda", local_rank)
    else:
        backend, where = "gloo", torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    return where


def shard(model: nn.Module, plan: str, device: torch.device):
    """GemModel (fused kernels) -> (DistributedGem, optimizers): tables sharded by the gem_kernels
    sharders under ``plan``, the rest data-parallel; optimizers = [fused tables', dense Adam]."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from gem_kernels.torchrec import FusedEmbeddingBagCollectionSharder, FusedEmbeddingCollectionSharder, sharding_plan

    if model.kernels != "fused":
        raise ValueError(f"--distributed shards the fused model; got --kernels {model.kernels!r}")
    cfg = model.cfg
    model.sparse_arch = ShardableSparseArch(model.sparse_arch, cfg)
    model.sequence_arch.embeddings = ShardableSequenceEmbeddings(model.sequence_arch.embeddings, cfg)
    model.to(device)
    wrapped = _Loss(model)
    sharders = [FusedEmbeddingBagCollectionSharder(), FusedEmbeddingCollectionSharder()]
    env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(wrapped, env=env, device=device, sharders=sharders,
                                   plan=sharding_plan(wrapped, sharders, plan, compute_device=device.type))
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adam(params, lr=cfg.dense_lr))
    return DistributedGem(dmp, model), [CombinedOptimizer([dmp.fused_optimizer, dense])]


def save(directory, gem: DistributedGem, optimizers, step: int, losses: list) -> None:
    """DCP checkpoint; the losses saved are the mean over ranks (DCP keeps one copy of a replicated
    tensor, so every rank must hold the same one)."""
    import torch.distributed.checkpoint as dcp

    mean_losses = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_losses)
    mean_losses /= dist.get_world_size()
    dcp.save({"model": gem.dmp.state_dict(), "optim": optimizers[0].state_dict(),
              "meta": {"step": torch.tensor(step), "losses": mean_losses}}, checkpoint_id=str(directory))


def load(directory, gem: DistributedGem, optimizers) -> tuple[int, list]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    num_losses = metadata.state_dict_metadata["meta.losses"]
    num_losses = num_losses.size[0] if isinstance(num_losses, TensorStorageMetadata) else 0
    state = {"model": gem.dmp.state_dict(), "optim": optimizers[0].state_dict(),
             "meta": {"step": torch.tensor(0), "losses": torch.zeros(num_losses, dtype=torch.float64)}}
    dcp.load(state, checkpoint_id=str(directory))
    gem.dmp.load_state_dict(state["model"])
    optimizers[0].load_state_dict(state["optim"])
    return int(state["meta"]["step"]), state["meta"]["losses"].tolist()


def main(args: argparse.Namespace, config_from_args, train, report) -> dict | None:
    """model.train's main with the model sharded; rank 0 prints and writes --json."""
    from .gem import GemModel

    device = init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    args.device = str(device)
    cfg = config_from_args(args)
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} must be a multiple of the world size {world}")
    local_cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size // world)
    model = GemModel(cfg, kernels=args.kernels, seed=args.seed)  # the same tables on every rank (seeded)
    gem, optimizers = shard(model, args.plan, device)
    data = RankBatches(SyntheticBatches(local_cfg, local_cfg.batch_size, seed=args.seed), rank, world)
    checkpoint, args.checkpoint = args.checkpoint, None  # model.train's torch.save checkpoints are single-process
    if rank == 0:
        print(f"distributed: world={world} backend={dist.get_backend()} plan={args.plan} config={args.config} "
              f"global batch={cfg.batch_size} ({local_cfg.batch_size} per rank)", flush=True)
    resume, args.resume, total_steps = args.resume, False, args.steps
    start_losses = None
    if resume:
        start, start_losses = load(checkpoint, gem, optimizers)
        data = _Offset(data, start)
        args.steps -= start
    args.no_progress = args.no_progress or rank != 0
    run = train(args, gem, optimizers, data)
    args.steps = total_steps
    if start_losses:
        run["losses"] = start_losses + run["losses"]
    if checkpoint is not None:
        save(checkpoint, gem, optimizers, len(run["losses"]), run["losses"])
    result = report(args, local_cfg, gem, run)
    result.update(world_size=world, plan=args.plan, global_batch_size=cfg.batch_size)
    dist.barrier()
    return result if rank == 0 else None


class _Offset:
    def __init__(self, data, start: int):
        self.data, self.start, self.batch_size = data, start, data.batch_size

    def __getitem__(self, step: int):
        return self.data[self.start + step]

    def held_out(self, i: int):
        return self.data.held_out(i)

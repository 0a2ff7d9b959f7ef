"""``python -m model.train --distributed``: GemModel under TorchRec's DistributedModelParallel.

    torchrun --standalone --nproc_per_node 2 -m model.train --config tiny --distributed [--plan table_wise|column_wise|auto]

What is sharded how: the categorical tables (``sparse_arch``) become a gk.torchrec
``FusedEmbeddingBagCollection`` (with ``--hashed-ids``: the model's ``ZchEmbeddingBagCollection``,
sharded table-wise by ``ZchEmbeddingBagCollectionSharder``, each owner remapping its tables' raw ids
of the global batch as the unsharded model does) and the item/action tables of the sequence arch a
``FusedEmbeddingCollection``; both are sharded by the gem_kernels sharders under ``--plan``, and
every rank runs its shards with the fused kernel and its row-wise Adagrad. Everything else (dense,
HSTU, interaction, heads) is replicated and trained data-parallel (DMP's default DDP wrap, Adam).
Backend: NCCL when the device is a GPU (one per rank, ``LOCAL_RANK``), gloo on the CPU.

Data: step i's global batch is batch i of the seeded stream (``batch_size`` users) on any W; rank
r of W trains its users ``[r * B / W, (r + 1) * B / W)``. Each rank's loss is its sum over rows
divided by the global batch's rows (times W, which DDP's and TorchRec's gradient averaging divide
back out), so the gradients, the updates and the reported loss (the mean over ranks) are the
global batch's whatever W is. Throughput figures in the JSON are global (all ranks); per-rank
ones carry ``_per_rank`` in their names.
Checkpoints (``--checkpoint DIR``): torch.distributed.checkpoint (sharded tables + fused optimizer
state + dense + Adam; hashed tables' identity tables and eviction state too), saved at the end,
loadable at another world size (``--resume``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shutil
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .archs import sparse_feature_names
from .data import SyntheticBatches
from .gem import model_flops


class ShardableSparseArch(nn.Module):
    """SparseArch on a KJT-fed ``gk.torchrec.FusedEmbeddingBagCollection`` (the form DMP shards);
    same tables, same output [B, T, D]. With hashed ids, the arch's own ``ZchEmbeddingBagCollection``
    (KJT-fed already)."""

    def __init__(self, arch: nn.Module, cfg):
        super().__init__()
        from torchrec import EmbeddingBagConfig, PoolingType

        from gem_kernels.torchrec import FusedEmbeddingBagCollection

        self.names = sparse_feature_names(cfg.num_tables)
        self.num_tables, self.dim, self.hashed_ids = cfg.num_tables, cfg.embedding_dim, cfg.hashed_ids
        if cfg.hashed_ids:
            self.ebc = arch.ebc
            return
        configs = [EmbeddingBagConfig(name=f"table_{t}", embedding_dim=cfg.embedding_dim, num_embeddings=rows,
                                      feature_names=[name], pooling=PoolingType.SUM)
                   for t, (rows, name) in enumerate(zip(cfg.num_embeddings_per_table, self.names))]
        self.ebc = FusedEmbeddingBagCollection(configs, optimizer=arch.ebc.optimizer, bounds_check="fatal")
        with torch.no_grad():
            for t in range(cfg.num_tables):
                self.ebc.weight(f"table_{t}").copy_(arch.ebc.weight(f"table_{t}"))

    def forward(self, batch) -> torch.Tensor:
        pooled = self.ebc(batch.sparse_features())  # sharded: keys in the plan's order, so picked by name
        if self.hashed_ids:  # (KeyedTensor, None), as the managed-collision collections return
            pooled = pooled[0]
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
    DDP sees every step. The loss is this rank's share of the global batch's mean (see the module
    docstring): ``mean_r * rows_r * W / global_rows``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch, timer=None, logits: bool = False):
        if logits:
            return self.model(batch)
        loss = self.model.loss(batch, timer)
        scale = getattr(batch, "global_share", None)
        return loss if scale is None else loss * scale


class DistributedGem:
    """The part of GemModel's interface that model.train's loop uses, on the DMP-wrapped model."""

    def __init__(self, dmp, model):
        self.dmp, self.inner, self.cfg, self.kernels = dmp, model, model.cfg, model.kernels

    @property
    def training(self) -> bool:
        return self.dmp.training

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


def _rank_batch_type():
    from .data import Batch

    @dataclasses.dataclass
    class RankBatch(Batch):
        """A rank's part of a global batch; ``global_share`` scales its mean loss (see ``_Loss``)."""

        global_share: float = 1.0

        def to(self, device, non_blocking: bool = False) -> "RankBatch":
            return RankBatch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                                for f in dataclasses.fields(Batch)}, global_share=self.global_share)

    return RankBatch


def split_batch(batch, rank: int, world: int):
    """Users ``[rank * B / W, (rank + 1) * B / W)`` of ``batch`` (B users, B a multiple of W), with
    ``global_share`` = rows_r * W / global rows: the factor that makes this rank's mean loss its
    share of the global batch's."""
    users = batch.batch_size // world
    lo, hi = rank * users, (rank + 1) * users
    num_tables = batch.sparse_lengths.numel() // max(batch.batch_size, 1)
    lengths = batch.sparse_lengths.view(num_tables, batch.batch_size)
    table_starts = torch.cat([lengths.new_zeros(1), lengths.sum(1).cumsum(0)])
    before = lengths[:, :lo].sum(1)
    sparse_values = torch.cat([batch.sparse_values[int(table_starts[t] + before[t]):
                                                   int(table_starts[t] + before[t] + lengths[t, lo:hi].sum())]
                               for t in range(num_tables)]) if num_tables else batch.sparse_values
    offsets = batch.history_offsets
    h_lo, h_hi = int(offsets[lo]), int(offsets[hi])
    candidate_offsets = torch.cat([batch.num_candidates.new_zeros(1), batch.num_candidates.cumsum(0)])
    c_lo, c_hi = int(candidate_offsets[lo]), int(candidate_offsets[hi])
    return _RANK_BATCH(dense=batch.dense[lo:hi], sparse_values=sparse_values,
                       sparse_lengths=lengths[:, lo:hi].reshape(-1), history_ids=batch.history_ids[h_lo:h_hi],
                       history_actions=batch.history_actions[h_lo:h_hi],
                       history_timestamps=batch.history_timestamps[h_lo:h_hi],
                       history_offsets=offsets[lo:hi + 1] - h_lo, candidate_ids=batch.candidate_ids[c_lo:c_hi],
                       num_candidates=batch.num_candidates[lo:hi],
                       request_timestamps=batch.request_timestamps[lo:hi], labels=batch.labels[c_lo:c_hi],
                       global_share=(c_hi - c_lo) * world / max(int(candidate_offsets[-1]), 1))


_RANK_BATCH = _rank_batch_type()


class RankBatches:
    """Rank r's share of the seeded stream: step i -> its users of global batch i (held-out
    batches: all ranks alike, whole)."""

    def __init__(self, data: SyntheticBatches, rank: int, world: int):
        self.data, self.rank, self.world = data, rank, world
        self.batch_size = data.batch_size // world

    def __getitem__(self, step: int):
        return split_batch(self.data[step], self.rank, self.world)

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
        timeout = datetime.timedelta(seconds=300)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # The agent's store outlives a restart: key this launch's rendezvous by its restart
            # count, or the relaunched ranks read the killed ranks' addresses and never connect.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timeout)
            dist.init_process_group(backend, store=dist.PrefixStore(f"gem_kernels/launch_{restart}", store),
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    return where


def shard(model: nn.Module, plan: str, device: torch.device):
    """GemModel (fused kernels) -> (DistributedGem, optimizers): tables sharded by the gem_kernels
    sharders under ``plan``, the rest data-parallel; optimizers = [fused tables', dense Adam]."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from gem_kernels.torchrec import (
        FusedEmbeddingBagCollectionSharder,
        FusedEmbeddingCollectionSharder,
        ZchEmbeddingBagCollectionSharder,
        sharding_plan,
    )

    if model.kernels != "fused":
        raise ValueError(f"--distributed shards the fused model; got --kernels {model.kernels!r}")
    cfg = model.cfg
    model.sparse_arch = ShardableSparseArch(model.sparse_arch, cfg)
    model.sequence_arch.embeddings = ShardableSequenceEmbeddings(model.sequence_arch.embeddings, cfg)
    model.to(device)
    wrapped = _Loss(model)
    sharders = [FusedEmbeddingBagCollectionSharder(), FusedEmbeddingCollectionSharder(),
                ZchEmbeddingBagCollectionSharder()]
    env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(wrapped, env=env, device=device, sharders=sharders,
                                   plan=sharding_plan(wrapped, sharders, plan, compute_device=device.type))
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adam(params, lr=cfg.dense_lr))
    return DistributedGem(dmp, model), [CombinedOptimizer([dmp.fused_optimizer, dense])]


def _staging(directory: Path) -> Path:
    return directory.parent / f".{directory.name}.staging"


def _previous(directory: Path) -> Path:
    return directory.parent / f".{directory.name}.previous"


def published(directory: Path) -> Path | None:
    """The complete checkpoint of ``directory``, or None. ``directory`` only ever appears complete
    (``save`` renames a finished one into place); in the instant between moving the previous one
    aside and renaming the new one in, the previous one (``.DIR.previous``) is the complete one."""
    for candidate in (directory, _previous(directory)):
        if (candidate / ".metadata").is_file():
            return candidate
    return None


def save(directory, gem: DistributedGem, optimizers, step: int, losses: list) -> None:
    """DCP checkpoint, written to ``.DIR.staging`` and published by renames once every rank has
    written its part: a process killed mid-write leaves the last complete checkpoint in place, never
    a torn one. The losses saved are the mean over ranks (DCP keeps one copy of a replicated tensor,
    so every rank must hold the same one)."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    staging, previous = _staging(directory), _previous(directory)
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a staging left by a killed run
    dist.barrier()
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_losses)
    mean_losses /= dist.get_world_size()
    dcp.save({"model": gem.dmp.state_dict(), "optim": optimizers[0].state_dict(),
              "meta": {"step": torch.tensor(step), "losses": mean_losses}}, checkpoint_id=str(staging))
    dist.barrier()  # every rank's part is written
    if dist.get_rank() == 0:
        if (directory / ".metadata").is_file():
            shutil.rmtree(previous, ignore_errors=True)
            directory.rename(previous)
        elif directory.exists():
            shutil.rmtree(directory)  # an empty or partial directory (created before any save)
        staging.rename(directory)
        shutil.rmtree(previous, ignore_errors=True)
    dist.barrier()


def load(directory, gem: DistributedGem, optimizers) -> tuple[int, list]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata()
        num_losses = metadata.state_dict_metadata["meta.losses"]
    except Exception as error:  # pickle, file and key errors alike: say which checkpoint could not be read
        raise ValueError(f"cannot read checkpoint {directory}/.metadata: {type(error).__name__}: {error}") from error
    num_losses = num_losses.size[0] if isinstance(num_losses, TensorStorageMetadata) else 0
    # Adam's state is created by its first step: materialise it (TorchRec's KeyedOptimizer.init_state,
    # a zero-gradient step) so that the template DCP loads into holds every saved tensor.
    optimizers[0].init_state()
    state = {"model": gem.dmp.state_dict(), "optim": optimizers[0].state_dict(),
             "meta": {"step": torch.tensor(0), "losses": torch.zeros(num_losses, dtype=torch.float64)}}
    dcp.load(state, checkpoint_id=str(directory))
    gem.dmp.load_state_dict(state["model"])
    optimizers[0].load_state_dict(state["optim"])
    return int(state["meta"]["step"]), state["meta"]["losses"].tolist()


def main(args: argparse.Namespace, config_from_args, train, report) -> dict | None:
    """model.train's main with the model sharded; rank 0 prints and writes --json."""
    from .gem import GemModel

    owns_group = not dist.is_initialized()  # torchrun's launch: this run makes the group, and ends it
    device = init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    args.device = str(device)
    cfg = config_from_args(args)
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} must be a multiple of the world size {world}")
    local_cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size // world)
    model = GemModel(cfg, kernels=args.kernels, seed=args.seed)  # the same tables on every rank (seeded)
    gem, optimizers = shard(model, args.plan, device)
    data = RankBatches(SyntheticBatches(cfg, cfg.batch_size, seed=args.seed), rank, world)
    if rank == 0:
        print(f"distributed: world={world} backend={dist.get_backend()} plan={args.plan} config={args.config} "
              f"global batch={cfg.batch_size} ({local_cfg.batch_size} per rank)", flush=True)
    args.no_progress = args.no_progress or rank != 0
    store = DcpStore(Path(args.checkpoint), gem, optimizers) if args.checkpoint is not None else None
    run = train(args, gem, optimizers, data, store)
    # Each rank's loss is its share of the global batch's mean (_Loss): the mean over ranks is the global loss.
    losses = torch.tensor(run["losses"], dtype=torch.float64)
    dist.all_reduce(losses)
    run["losses"] = (losses / world).tolist()
    # Throughput of all ranks together: every rank steps in lockstep on its share of the global batch.
    local_flops = run["flops"]  # per step, {component: FLOPs} of this rank's share
    keys = list(local_flops[0]) if local_flops else []
    flops = torch.tensor([[step[k] for k in keys] for step in local_flops], dtype=torch.float64)
    dist.all_reduce(flops)
    run["flops"] = [dict(zip(keys, row)) for row in flops.tolist()]
    result = report(args, cfg, gem, run)
    step_s = result["step_ms"] / 1e3 if result["step_ms"] else None
    result.update(world_size=world, plan=args.plan, global_batch_size=cfg.batch_size,
                  examples_per_s_per_rank=local_cfg.batch_size / step_s if step_s else None,
                  tflops_per_rank=(statistics.fmean(model_flops(step) for step in local_flops) / step_s / 1e12
                                   if step_s else None))
    for key in ("mfu", "mfu_vendor"):  # global TFLOP/s over the peak of all W devices
        if result.get(key) is not None:
            result[key] /= world
    if result.get("peak_tflops") is not None:
        result["peak_tflops"] *= world
    dist.barrier()
    if owns_group:
        # Ended here, after every rank's last collective (the barrier), not left to the interpreter's
        # exit: a gloo group still alive then can abort the process from its transport threads
        # (SIGABRT, "terminate called without an active exception"), which torchrun reads as a failed
        # rank and restarts the job. A group the caller made is the caller's to end.
        dist.destroy_process_group()
    return result if rank == 0 else None


class DcpStore:
    """model.train's checkpoint store for DMP: ``save``/``load`` above (DCP, published atomically)."""

    def __init__(self, directory: Path, gem: DistributedGem, optimizers):
        self.directory, self.gem, self.optimizers = directory, gem, optimizers

    def exists(self) -> bool:
        return published(self.directory) is not None

    def load(self) -> tuple[int, list]:
        return load(published(self.directory), self.gem, self.optimizers)

    def save(self, step: int, losses: list) -> None:
        save(self.directory, self.gem, self.optimizers, step, losses)

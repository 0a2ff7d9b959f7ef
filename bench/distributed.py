"""``python -m bench distributed``: a DLRM-shaped model under TorchRec's DistributedModelParallel on
gloo processes, its tables run by gem_kernels (our sharder) and by TorchRec's own FUSED kernel
(FBGEMM's TBE, ``EmbeddingBagCollectionSharder``) side by side in the same processes, same plan.

Model: T tables of R rows x D (sum pooling, bags of 1..2L-1 ids, uniform ids), 13 dense features,
dense arch [64, D], interaction = concat, over arch [64, 1], BCE; fused row-wise Adagrad on the
tables (both kernels), Adagrad on the dense part (DDP). The global batch is fixed: W ranks train
B / W samples each, one thread per rank (W = 1 and W = 2 on this 2-core machine: the scaling).

Per rank and step (median of the timed steps, the kernels' steps interleaved):
  step_ms       one training step (forward, backward, optimizers);
  comm_ms       time blocked in collectives: TorchRec's all-to-alls (ids out, pooled embeddings
                back, and their backward), DDP's gradient all-reduce and, for gem_kernels, the id
                agreement all-gather. The bench makes them synchronous to time them (an all-to-all
                wrapper and a DDP comm hook); on gloo/CPU they do not overlap compute anyway;
  compute_ms    step_ms - comm_ms;
  a2a_bytes     bytes this rank sends to other ranks in all-to-alls per step.
Results: bench/results/distributed-<timestamp>.json and a markdown table next to it.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

CONFIGS = {
    False: dict(tables=8, rows=100_000, dim=64, batch=2048, ids=20, warmup=2, steps=8),
    True: dict(tables=4, rows=5_000, dim=16, batch=256, ids=8, warmup=1, steps=3),
}
NUM_DENSE = 13
KERNELS = ("gem_kernels", "torchrec_fbgemm")
LOSS_ATOL = 1e-5  # per-step loss of the two sides, same weights and batches


class _Counters:
    def __init__(self):
        self.comm_s, self.a2a_bytes = 0.0, 0

    def reset(self):
        self.comm_s, self.a2a_bytes = 0.0, 0


class _Done:
    """A finished request: what TorchRec reads of a Work after the synchronous collective."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _instrument(counters: _Counters) -> None:
    """Synchronous, timed all-to-all / all-gather (bench processes only)."""
    import torch.distributed as dist

    a2a, gather = dist.all_to_all_single, dist.all_gather

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        row_bytes = input[0].numel() * input.element_size() if input.dim() and input.shape[0] else 0
        if input_split_sizes:
            counters.a2a_bytes += row_bytes * (sum(input_split_sizes) - input_split_sizes[rank])
        else:
            counters.a2a_bytes += row_bytes * input.shape[0] * (world - 1) // world
        began = time.perf_counter()
        a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=False)
        counters.comm_s += time.perf_counter() - began
        return _Done() if async_op else None

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        began = time.perf_counter()
        gather(tensor_list, tensor, group=group, async_op=False)
        counters.comm_s += time.perf_counter() - began
        return _Done() if async_op else None

    dist.all_to_all_single, dist.all_gather = all_to_all_single, all_gather


def _ddp_hook(counters: _Counters):
    import torch.distributed as dist

    def hook(state, bucket):
        began = time.perf_counter()
        buffer = bucket.buffer()
        dist.all_reduce(buffer)
        buffer.div_(dist.get_world_size())
        counters.comm_s += time.perf_counter() - began
        future = torch.futures.Future()
        future.set_result(buffer)
        return future

    return hook


def _model(cfg: dict):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from torchrec.models.dlrm import DLRM

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=cfg["dim"], num_embeddings=cfg["rows"],
                                 feature_names=[f"f{i}"], pooling=PoolingType.SUM) for i in range(cfg["tables"])]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE, dense_arch_layer_sizes=[64, cfg["dim"]],
                over_arch_layer_sizes=[64, 1], dense_device=torch.device("cpu"))


def _load_tables(dmp, cfg: dict) -> None:
    """One seeded set of tables for both sides (each sharder initialises its shards its own way):
    every local shard set to its slice of table t = randn(rows, dim) of seed t, scaled like
    TorchRec's default init."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            if not isinstance(value, ShardedTensor) or not key.endswith(".weight"):
                continue
            table = int(key.split(".")[-2][1:])  # ...embedding_bags.t<i>.weight
            full = torch.randn(cfg["rows"], cfg["dim"], generator=torch.Generator().manual_seed(table))
            full /= cfg["rows"] ** 0.5
            for shard in value.local_shards():
                offsets = shard.metadata.shard_offsets
                shard.tensor.copy_(full[tuple(slice(o, o + n) for o, n in zip(offsets, shard.tensor.shape))])


def _dmp(kernel: str, cfg: dict, counters: _Counters, lr: float = 0.05):
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import gem_kernels as gk
    from gem_kernels.torchrec.sharding import FusedEmbeddingBagCollectionSharder, sharding_plan

    torch.manual_seed(0)
    model = _model(cfg)
    if kernel == "gem_kernels":
        sharder = FusedEmbeddingBagCollectionSharder(optimizer=gk.optim.ExactRowwiseAdagrad(lr=lr, eps=1e-8),
                                                     module_type=EmbeddingBagCollection)
    else:
        sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                              "learning_rate": lr, "eps": 1e-8})
    plan = sharding_plan(model, [sharder], "table_wise", compute_device="cpu")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                   device=torch.device("cpu"), sharders=[sharder], plan=plan)
    _load_tables(dmp, cfg)
    ddp = dmp._dmp_wrapped_module
    if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        ddp.register_comm_hook(None, _ddp_hook(counters))
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=lr))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def _batches(cfg: dict, rank: int, world: int, count: int):
    from torchrec import KeyedJaggedTensor

    local = cfg["batch"] // world
    batches = []
    for step in range(count):
        g = torch.Generator().manual_seed(1000 * step + rank)
        lengths = torch.randint(1, 2 * cfg["ids"], (cfg["tables"] * local,), generator=g)
        values = torch.randint(0, cfg["rows"], (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(cfg["tables"])], values=values,
                                                 lengths=lengths)
        batches.append((torch.randn(local, NUM_DENSE, generator=g), kjt,
                        torch.randint(0, 2, (local,), generator=g).float()))
    return batches


def _worker(rank: int, world: int, port: int, cfg: dict, out_dir: str) -> None:
    import torch.distributed as dist

    import faulthandler

    # A rank that dies by a signal (SIGABRT, SIGSEGV) prints every thread's Python stack to stderr first:
    # what torch.multiprocessing's "terminated with signal" does not say.
    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    counters = _Counters()
    _instrument(counters)
    models = {k: _dmp(k, cfg, counters) for k in KERNELS}
    batches = _batches(cfg, rank, world, cfg["warmup"] + cfg["steps"])
    rows = {k: {"step_ms": [], "comm_ms": [], "a2a_bytes": [], "loss": []} for k in KERNELS}
    for i, (dense, kjt, labels) in enumerate(batches):
        for kernel in KERNELS:  # interleaved: a neighbour's load hits both alike
            dmp, opt = models[kernel]
            dist.barrier()
            counters.reset()
            began = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense, kjt).squeeze(-1), labels)
            loss.backward()
            opt.step()
            elapsed = time.perf_counter() - began
            if i >= cfg["warmup"]:
                rows[kernel]["step_ms"].append(elapsed * 1e3)
                rows[kernel]["comm_ms"].append(counters.comm_s * 1e3)
                rows[kernel]["a2a_bytes"].append(counters.a2a_bytes)
            rows[kernel]["loss"].append(float(loss.detach()))
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(rows, f)
    dist.destroy_process_group()


def _spawn(world: int, cfg: dict, timeout_s: float) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world, port, cfg, out_dir), nprocs=world, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in context.processes:
                    p.kill()
                raise TimeoutError(f"{world}-rank bench did not finish in {timeout_s:.0f} s")
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def run(quick: bool = False, out: Path | None = None, timeout_s: float = 540.0) -> dict:
    from bench import report

    cfg = CONFIGS[quick]
    import gem_kernels as gk

    started = time.perf_counter()
    worlds = {world: _spawn(world, cfg, timeout_s) for world in (1, 2)}
    # Verification before any time is reported: both sides started from the same weights and saw
    # the same batches, so every step's loss agrees (fp32 sums in another order; row-wise Adagrad).
    verified = {}
    for world, ranks in worlds.items():
        for rank, per_kernel in enumerate(ranks):
            ours, theirs = per_kernel["gem_kernels"]["loss"], per_kernel["torchrec_fbgemm"]["loss"]
            worst = max(abs(a - b) for a, b in zip(ours, theirs))
            verified[f"world{world}_rank{rank}"] = worst
            if worst > LOSS_ATOL:
                raise AssertionError(f"distributed bench: gem_kernels and TorchRec+FBGEMM losses differ by {worst:.3g} "
                                     f"> {LOSS_ATOL} (world {world}, rank {rank}): {ours} vs {theirs}")
    rows = []
    for world, ranks in worlds.items():
        for rank, per_kernel in enumerate(ranks):
            for kernel, m in per_kernel.items():
                step, comm = statistics.median(m["step_ms"]), statistics.median(m["comm_ms"])
                rows.append(dict(kernel=kernel, world=world, rank=rank, step_ms=step, comm_ms=comm,
                                 compute_ms=step - comm, a2a_bytes=int(statistics.median(m["a2a_bytes"])),
                                 examples_per_s=cfg["batch"] / world / (step / 1e3),
                                 loss_first=m["loss"][0], loss_last=m["loss"][-1]))
    summary = {}
    for kernel in KERNELS:
        step = {w: max(r["step_ms"] for r in rows if r["kernel"] == kernel and r["world"] == w) for w in worlds}
        summary[kernel] = dict(step_ms=step, global_examples_per_s={w: cfg["batch"] / (s / 1e3) for w, s in step.items()},
                               scaling_1_to_2=step[1] / step[2])
    for w in worlds:
        summary[f"speedup_world{w}"] = summary["torchrec_fbgemm"]["step_ms"][w] / summary["gem_kernels"]["step_ms"][w]
    result = dict(timestamp=report.utc_timestamp(), git_sha=report.git_sha(), quick=quick, config=cfg,
                  backend=gk.get_backend() if hasattr(gk, "get_backend") else None,
                  available_backends=gk.available_backends(), loadavg=os.getloadavg(), rows=rows, summary=summary,
                  seconds=time.perf_counter() - started, plan="table_wise", transport="gloo (CPU), 1 thread per rank",
                  loss_max_abs_diff=verified)
    out = Path(out or report.DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"distributed-{result['timestamp'].replace(':', '')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    stem.with_suffix(".md").write_text("\n".join(table_lines(result)) + "\n")
    print("\n".join(table_lines(result)))
    print(f"results: {stem.with_suffix('.json')}")
    return result


def table_lines(result: dict) -> list[str]:
    cfg = result["config"]
    lines = [f"distributed bench: {cfg['tables']} tables x {cfg['rows']} rows x D {cfg['dim']}, global batch "
             f"{cfg['batch']}, bags ~{cfg['ids']} ids, plan {result['plan']}, {result['transport']}; git "
             f"{result['git_sha']}; backends {result['available_backends']}",
             "", "| kernel | world | rank | step ms | compute ms | comm ms | a2a bytes/step | examples/s (rank) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['kernel']} | {r['world']} | {r['rank']} | {r['step_ms']:.2f} | {r['compute_ms']:.2f} | "
                     f"{r['comm_ms']:.2f} | {r['a2a_bytes']:,} | {r['examples_per_s']:.0f} |")
    s = result["summary"]
    lines.append("")
    for kernel in KERNELS:
        lines.append(f"{kernel}: step (slowest rank) {s[kernel]['step_ms'][1]:.2f} ms at W=1, "
                     f"{s[kernel]['step_ms'][2]:.2f} ms at W=2; scaling 1->2 processes "
                     f"{s[kernel]['scaling_1_to_2']:.2f}x")
    lines.append(f"gem_kernels vs TorchRec+FBGEMM (FUSED): {s['speedup_world1']:.2f}x at W=1, "
                 f"{s['speedup_world2']:.2f}x at W=2")
    return lines


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench distributed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from bench import unwritable

    why = unwritable(args.out) if args.out is not None else None
    if why:
        parser.error(f"--out {args.out}: {why}")
    run(args.quick, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The serving artefact: GemModel's KV-cached ranking of one request, exported with torch.export and
compiled into an AOTInductor package (CPU).

    python -m model.serving --preset tiny --history 64 --candidates 32 --microbatch 16 --out rank.pt2

writes rank.pt2; `torch._inductor.aoti_load_package("rank.pt2")(*request_tensors(...))` scores a request
(``import gem_kernels`` first: the package calls its custom ops). One request is one user: its shapes
(history length P, K candidates) are fixed at export; the micro-batch plan follows from them.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from torch import nn

from .config import PRESETS, GemConfig
from .data import Batch
from .gem import GemModel

INPUT_NAMES = ("dense", "sparse_values", "sparse_lengths", "history_ids", "history_actions", "history_timestamps",
               "candidate_ids", "request_timestamps")


class RankingModule(nn.Module):
    """forward(*request tensors) -> logits [K, num_tasks]: `model.rank` of one user's request, reading
    only shapes (so that torch.export traces it). The request tensors are Batch's fields of a batch of one
    user (see `request_tensors`)."""

    def __init__(self, model: GemModel, candidates_per_microbatch: int):
        super().__init__()
        self.model = model.eval()
        self.candidates_per_microbatch = candidates_per_microbatch

    def forward(self, dense, sparse_values, sparse_lengths, history_ids, history_actions, history_timestamps,
                candidate_ids, request_timestamps) -> torch.Tensor:
        num_history, num_candidates = history_ids.shape[0], candidate_ids.shape[0]
        batch = Batch(dense=dense, sparse_values=sparse_values, sparse_lengths=sparse_lengths,
                      history_ids=history_ids, history_actions=history_actions,
                      history_timestamps=history_timestamps,
                      history_offsets=torch.tensor([0, num_history], device=dense.device),
                      candidate_ids=candidate_ids,
                      num_candidates=torch.tensor([num_candidates], device=dense.device),
                      request_timestamps=request_timestamps, labels=dense.new_empty(0))
        sizes = [(self.model.cfg.contextual_len + num_history + num_candidates, num_candidates)]
        return self.model.rank(batch, self.candidates_per_microbatch, user_sizes=sizes)


def request_tensors(batch: Batch, user: int) -> tuple[torch.Tensor, ...]:
    """User `user`'s request from a batch, in RankingModule's argument order."""
    num_users = batch.batch_size
    num_tables = batch.sparse_lengths.numel() // max(num_users, 1)
    lengths = batch.sparse_lengths.view(num_tables, num_users)
    offsets = batch.sparse_offsets
    values = torch.cat([batch.sparse_values[offsets[t * num_users + user]:offsets[t * num_users + user + 1]]
                        for t in range(num_tables)])
    h0, h1 = batch.history_offsets[user], batch.history_offsets[user + 1]
    c0 = int(batch.num_candidates[:user].sum())
    c1 = c0 + int(batch.num_candidates[user])
    return (batch.dense[user:user + 1], values, lengths[:, user].contiguous(), batch.history_ids[h0:h1],
            batch.history_actions[h0:h1], batch.history_timestamps[h0:h1], batch.candidate_ids[c0:c1],
            batch.request_timestamps[user:user + 1])


def export_ranking(model: GemModel, example: tuple[torch.Tensor, ...], candidates_per_microbatch: int,
                   package_path: str) -> str:
    """torch.export of RankingModule on `example` (a request_tensors tuple), compiled into an AOTInductor
    package at `package_path` (returned)."""
    module = RankingModule(model, candidates_per_microbatch)
    with torch.no_grad():
        program = torch.export.export(module, example)
        # O0 for the generated wrapper: it is straight-line calls of the kernels and custom ops, and its
        # compile time dominates on small models.
        return torch._inductor.aoti_compile_and_package(
            program, package_path=package_path, inductor_configs={"aot_inductor.compile_wrapper_opt_level": "O0"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--history", type=int, default=64, help="history length P of the exported request")
    parser.add_argument("--candidates", type=int, default=32, help="candidates K of the exported request")
    parser.add_argument("--microbatch", type=int, default=16, help="candidates per micro-batch m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="rank.pt2", help="the AOTInductor package to write")
    args = parser.parse_args(argv)
    # Checked before the model is built and the (minutes-long) compile starts, naming the flag.
    for flag, value, least in (("--history", args.history, 0), ("--candidates", args.candidates, 1),
                               ("--microbatch", args.microbatch, 1), ("--seed", args.seed, 0)):
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    from .train import _unwritable

    problem = _unwritable(Path(args.out), directory=False)
    if problem is not None:
        parser.error(f"--out {args.out} {problem}")
    cfg: GemConfig = PRESETS[args.preset]()
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, args.history),
                              max_num_candidates=max(cfg.max_num_candidates, args.candidates))
    model = GemModel(cfg, "fused", seed=args.seed).eval()
    example = request_tensors(fixed_request(cfg, args.history, args.candidates, args.seed), 0)
    path = export_ranking(model, example, args.microbatch, args.out)
    print(f"wrote {path}: GemModel({args.preset}) ranking P={args.history} K={args.candidates} m={args.microbatch}")


def fixed_request(cfg: GemConfig, history: int, candidates: int, seed: int = 0) -> Batch:
    """A batch of one user with exactly `history` items and `candidates` candidates (synthetic ids)."""
    from .data import make_batch

    batch = make_batch(cfg, 1, torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    start = int(batch.request_timestamps[0]) - 3600 * history
    batch.history_ids = torch.randint(0, cfg.num_items, (history,), generator=g)
    batch.history_actions = torch.randint(0, cfg.num_actions, (history,), generator=g)
    batch.history_timestamps = start + torch.arange(history) * 3600
    batch.history_offsets = torch.tensor([0, history])
    batch.candidate_ids = torch.randint(0, cfg.num_items, (candidates,), generator=g)
    batch.num_candidates = torch.tensor([candidates])
    return batch


if __name__ == "__main__":
    main()

"""Bench of KV-cached HSTU ranking (issue 27 part 2, M-FALCON): the `ranking` family, and the second group of the
`inference` family (bench/inference.py). `python -m bench ranking` runs these rows alone (scripts/gpu_check.sh
does, on a GPU, where the inference family's budget would go to its quantized embedding bags first).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch

from .embedding_bag import SEED
from .harness import Case

# Seconds of timing (full, quick): whole model passes of up to 4.6k tokens.
FAMILY_BUDGET = {False: 300.0, True: 9.0}


def _ranking_request(cfg, history: int, candidates: int, copies: int = 1):
    """A batch of `copies` users with the same request: `history` items and `candidates` candidates each
    (copies = K with one candidate each is "every candidate alone", batched)."""
    from model.serving import fixed_request

    one = fixed_request(cfg, history, candidates, SEED)
    if copies == 1:
        return one
    per = candidates // copies
    per_table = one.sparse_values.split(one.sparse_lengths.tolist())
    return dataclasses.replace(
        one, dense=one.dense.repeat(copies, 1), sparse_values=torch.cat([v.repeat(copies) for v in per_table]),
        sparse_lengths=one.sparse_lengths.view(-1, 1).repeat(1, copies).reshape(-1),
        history_ids=one.history_ids.repeat(copies), history_actions=one.history_actions.repeat(copies),
        history_timestamps=one.history_timestamps.repeat(copies),
        history_offsets=torch.arange(copies + 1) * history, num_candidates=torch.full((copies,), per),
        request_timestamps=one.request_timestamps.repeat(copies))


def ranking_cases(quick: bool, device: torch.device) -> Iterator[Case]:
    """KV-cached ranking (issue 27 part 2, M-FALCON): GemModel(small)'s scores of one request (one user,
    history P, K candidates), three ways:
      rank m=16 / m=64  GemModel.rank cold (no cache outlives the request): the history must be encoded, so
                        it runs as the uncached pass (the same attention pairs; see SequenceArch.rank);
      rank m=.. warm    the user's KVCache already holds its history (serving: the cache outlives the
                        request, the history is encoded when it changes, not per request): the K candidates
                        in one gk.cached_jagged_attention call per layer (m changes no work: candidates never
                        see each other);
      uncached          GemModel.forward: history + all K candidates as targets in one pass (the baseline);
      alone             each candidate scored alone: K users with the same history and one candidate each,
                        in one forward (only where it costs under ~K * 1024^2 attention pairs).
    Every impl's scores are compared with the uncached pass's before timing (max |diff| in the notes; more
    than 1e-4 fails the case): the float64 rule needs a float64 model, which the fused tables refuse,
    so the case is marked unverified with that reason. ms is per request; examples/s are candidates/s;
    the JSON rows carry p99 (ms_p99, the max below 100 repeats)."""
    from model.config import GemConfig
    from model.gem import GemModel

    shapes = [(256, 32, (8,))] if quick else [(1024, 64, (16, 64)), (1024, 512, (16, 64)), (4096, 64, (16, 64)),
                                              (4096, 512, (16, 64))]
    for history, num_candidates, microbatches in shapes:
        cfg = dataclasses.replace(GemConfig.small(), max_seq_len=history, max_num_candidates=num_candidates)
        model = GemModel(cfg, "fused", seed=SEED).eval().to(device)
        request = _ranking_request(cfg, history, num_candidates).to(device)
        impls: dict[str, Callable] = {f"rank m={m}": (lambda m=m: model.rank(request, m)) for m in microbatches}
        for m in microbatches:
            warm = _warm_cache(model, request)
            impls[f"rank m={m} warm"] = lambda m=m, warm=warm: model.rank(request, m, cache=warm)
        impls["uncached"] = lambda: _no_grad(model, request)
        if num_candidates * history <= 64 * 1024:
            alone = _ranking_request(cfg, history, num_candidates, copies=num_candidates).to(device)
            impls["alone"] = lambda: _no_grad(model, alone)
        expected = impls["uncached"]()
        notes = []
        for name, impl in impls.items():
            diff = (impl() - expected).abs().max().item()
            if name != "alone" and diff > 1e-4:
                raise AssertionError(f"{name} scores differ from the uncached pass by {diff} (P={history}, "
                                     f"K={num_candidates})")
            notes.append(f"{name}: max |score - uncached| = {diff:.2e}" + (
                " (a candidate alone sits at the first target position: equal only while the pos bias is 0, as in "
                "this untrained model)" if name == "alone"
                else ""))
        yield Case(op="rank (KV-cached HSTU)", shape=f"GemModel(small) P={history} K={num_candidates}",
                   dtype=torch.float32, flops=0, bytes=0, impls=impls, baseline="uncached", notes=notes,
                   examples=num_candidates,
                   unverified="scores compared with the uncached pass before timing (notes), not by the float64 "
                              "rule: the fused model has no float64 run")


def _warm_cache(model, request):
    """A KVCache holding the request's user after one rank call."""
    from gem_kernels.inference import KVCache

    layer = model.sequence_arch.layers[0]
    cache = KVCache(len(model.sequence_arch.layers), layer.num_heads, layer.attention_dim, layer.linear_dim,
                    device=request.dense.device)
    model.rank(request, 64, cache=cache)
    return cache


def _no_grad(model, batch):
    with torch.no_grad():
        return model(batch)


def cases(quick: bool, device: torch.device) -> Iterator[Case]:
    yield from ranking_cases(quick, device)

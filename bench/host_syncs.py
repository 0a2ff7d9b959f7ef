"""Host syncs per training step of the model and per op (forward + backward).

    python -m bench.host_syncs [--device cpu|cuda] [--json PATH]

A host sync stalls the CPU until the GPU has drained its queue, so a training step should make as
few as possible. On a GPU the counter records torch.cuda.set_sync_debug_mode's warnings; on the
CPU it counts the calls that would sync with the same code on CUDA tensors
(gem_kernels/testing/sync_counter.py). Without a GPU the CUDA path is counted too: the `cpu`
backend with the front door taking its CUDA-tensor branches (checks the CUDA kernels need in
Python) while the CPU kernels compute; syncs inside the CUDA launchers are not seen there.

Each row counts the second call (the first may warm caches); the model step (GemConfig.tiny(),
batch 32) includes the optimizers' steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json

import torch

import gem_kernels as gk
from gem_kernels import _backend
from gem_kernels.testing.native import native_cpu_kernels
from gem_kernels.testing.sync_counter import SyncCounter


def _op_cases(device: torch.device):
    """(name, fn() running one forward + backward) for every public op, small shapes."""
    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(device).requires_grad_()

    lengths = torch.tensor([3, 0, 5, 2])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device)
    n, heads = int(lengths.sum()), 2

    def jagged_to_padded(backend):
        gk.jagged_to_padded(leaf(n, 4), offsets, 5, backend=backend).sum().backward()

    def padded_to_jagged(backend):
        gk.padded_to_jagged(leaf(4, 5, 4), offsets, n, backend=backend).sum().backward()

    def attention(backend):
        q, k, v = leaf(n, heads, 8), leaf(n, heads, 8), leaf(n, heads, 8)
        num_targets = torch.tensor([1, 0, 2, 0], device=device)
        gk.jagged_attention(q, k, v, offsets, 5, kind="hstu", causal=True, num_targets=num_targets,
                            backend=backend).sum().backward()

    tables = {}  # built outside the counted call: construction is not a step

    def embedding_bag(backend):
        if backend not in tables:
            tables[backend] = gk.FusedEmbeddingBag([gk.TableSpec(10, 4), gk.TableSpec(7, 4)], device=device,
                                                   backend=backend)
        ebc = tables[backend]
        indices = torch.randint(0, 7, (12,), generator=g).to(device)
        bag_offsets = torch.tensor([0, 2, 2, 5, 6, 9, 10, 11, 12], device=device)
        ebc(indices, bag_offsets).sum().backward()

    def dot_interaction(backend):
        gk.dot_interaction(leaf(3, 5, 4), backend=backend).sum().backward()

    def cross_layer(backend):
        gk.cross_layer(leaf(3, 6), leaf(3, 6), (leaf(6, 2), leaf(2, 6)), leaf(6), backend=backend).sum().backward()

    def fm_compress(backend):
        gk.fm_compress(leaf(3, 5, 4), leaf(5, 2), backend=backend).sum().backward()

    def feature_mix_norm(backend):
        gk.feature_mix_norm(leaf(3, 5, 4), leaf(6, 5), leaf(3, 2, 4), backend=backend).sum().backward()

    return [(f.__name__, f) for f in (jagged_to_padded, padded_to_jagged, attention, embedding_bag,
                                      dot_interaction, cross_layer, fm_compress, feature_mix_norm)]


def _count(fn, device: torch.device) -> tuple[int, dict]:
    fn()
    with SyncCounter(device) as syncs:
        fn()
    where = {kind: dict(places) for kind, places in syncs.where.items()}
    return syncs.count, where


def _model_cases(device: torch.device):
    from model import GemConfig, GemModel, SyntheticBatches
    from model.train import train_step

    for interaction in ("dot", "wukong"):
        cfg = dataclasses.replace(GemConfig.tiny(), interaction=interaction)
        batch = SyntheticBatches(cfg, batch_size=32)[0].to(device)
        for kernels in ("eager", "fused"):
            model = GemModel(cfg, kernels=kernels, seed=0).to(device)
            optimizers = model.make_optimizers()
            yield (f"train_step {interaction} {kernels}",
                   lambda m=model, o=optimizers, b=batch: train_step(m, b, o))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--where", action="store_true", help="print where each sync comes from")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    # (label, backend, native kernels' Python path)
    if device.type == "cuda":
        paths = [("cuda", "cuda", "cuda"), ("triton", "triton", "cuda"), ("reference", "reference", "cuda")]
    else:
        paths = [("cpu", "cpu", "cpu"), ("cuda path", "cpu", "cuda"), ("reference", "reference", "cpu")]
    rows = []
    for label, backend, native in paths:
        if backend not in gk.available_backends():
            continue
        with native_cpu_kernels(native) if device.type == "cpu" else contextlib.nullcontext():
            for name, fn in _op_cases(device):
                count, where = _count(lambda: fn(backend), device)
                rows.append(dict(what=name, path=label, syncs=count, where=where))
            if backend != "reference":
                with gk.use_backend(backend):
                    for name, fn in _model_cases(device):
                        count, where = _count(fn, device)
                        rows.append(dict(what=name, path=label, syncs=count, where=where))
    width = max(len(r["what"]) for r in rows)
    print(f"host syncs per call (forward + backward; model: one training step), device {device}")
    print(f"{'what':{width}}  " + "  ".join(f"{label:>10}" for label, *_ in paths))
    for what in dict.fromkeys(r["what"] for r in rows):
        cells = {r["path"]: r["syncs"] for r in rows if r["what"] == what}
        print(f"{what:{width}}  " + "  ".join(f"{cells.get(label, '-'):>10}" for label, *_ in paths))
    if args.where:
        for r in rows:
            if r["syncs"]:
                print(f"{r['what']} [{r['path']}]: {r['where']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

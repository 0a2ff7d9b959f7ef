"""Bench of the zch family (issue 28): raw-id embedding tables with eviction, per training step.

Stream: 26 features (one table each, D = 64), B = 4096 bags of 2 raw ids each; per table ids are
Zipf (alpha 1.05) ranks over a window of 4 x slots ids that slides by slots / 4 every step (new ids
arrive, old ones fade: after the STEPS batches, which are cycled, the window has moved 3 x slots, so
the ids of the first batch are long evicted when it comes round again), each rank scattered to a random 63-bit raw id. STEPS batches are built once
and cycled; both impls run the same stream from fresh modules with the same slot counts.

Cases:
- ``zch_step``: remap + forward + backward + row-wise Adagrad. "cpu": gk.torchrec's
  ZchEmbeddingBagCollection (LRU, ExactRowwiseAdagrad fused into the backward). "torchrec_mch":
  TorchRec's ManagedCollisionEmbeddingBagCollection with MCHManagedCollisionModule (LRU,
  eviction_interval 1), its EBC's dense gradient, then the same row-wise Adagrad on the rows the
  remapped KJT touched, in plain torch ops (TorchRec's unsharded EBC has no fused optimizer).
- ``zch_remap``: the remap alone: gk.zch_remap vs TorchRec's ManagedCollisionCollection (training).

Not verified against each other: the two are different eviction algorithms (TorchRec's MCH
re-sorts its table every eviction_interval; zch evicts per id), so their identity tables and outputs
differ by design (the reference backend, the same algorithm in plain Python, is too slow for this
stream: tests/test_zch.py checks cpu against it bit for bit). The notes give zch's hit rate,
evictions and unadmitted lookups per step, largest probe and probe overflows (over a second pass of
the stream, after a first one filled the tables), the ids TorchRec's MCH holds after one pass, each
impl's state bytes (weights, optimizer and identity/eviction state; TorchRec also makes a dense
[rows, D] gradient every step, given beside it) and its measured peak memory (``measure_peak``: the
resident-set high-water mark over two passes, each impl in a fresh process); the probe bound and overflows at 80 % load of a 2**20-slot table; and what TorchRec's MPZCH
(HashZchManagedCollisionModule) does when asked to train on the CPU.
"""

from __future__ import annotations

import os
from typing import Iterator

import torch

import gem_kernels as gk

from .harness import Case

NUM_FEATURES, DIM, IDS_PER_BAG, STEPS = 26, 64, 2, 12
# The setup before the first timed call (a pass of each impl filling its tables, two fresh processes
# measuring peak memory) takes minutes of a busy 2-core machine: more than the default 110 s share.
FAMILY_BUDGET = {False: 300.0, True: 9.0}
LR, EPS = 0.01, 1e-8


def stream(batch: int, slots: int, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of (values [26*B*2] raw int64, lengths [26*B]), feature-major."""
    g = torch.Generator().manual_seed(seed)
    window = 4 * slots
    zipf = torch.arange(1, window + 1, dtype=torch.float64).pow(-1.05)
    scatter = torch.randint(-(2**62), 2**62, (NUM_FEATURES, window + steps * (slots // 4) + 1), generator=g)
    out = []
    for step in range(steps):
        ranks = torch.multinomial(zipf.expand(NUM_FEATURES, -1), batch * IDS_PER_BAG, replacement=True, generator=g)
        ranks = ranks + step * (slots // 4)
        values = scatter.gather(1, ranks).reshape(-1)
        out.append((values, torch.full((NUM_FEATURES * batch,), IDS_PER_BAG, dtype=torch.int64)))
    return out


def _configs(slots: int):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=f"t{f}", embedding_dim=DIM, num_embeddings=slots, feature_names=[f"f{f}"])
            for f in range(NUM_FEATURES)]


def _kjt(values, lengths):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=[f"f{f}" for f in range(NUM_FEATURES)], values=values, lengths=lengths)


def _mch_modules(slots: int):
    from torchrec.modules.mc_modules import LRU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule

    configs = _configs(slots)
    mcms = {c.name: MCHManagedCollisionModule(zch_size=slots, device=torch.device("cpu"), eviction_interval=1,
                                              eviction_policy=LRU_EvictionPolicy()) for c in configs}
    return configs, ManagedCollisionCollection(managed_collision_modules=mcms, embedding_configs=configs)


class TorchRecMCH:
    """TorchRec's MC-EBC (MCH, LRU) + dense gradient + row-wise Adagrad on the touched rows."""

    def __init__(self, slots: int):
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

        configs, mcc = _mch_modules(slots)
        self.module = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=configs), mcc,
                                                             return_remapped_features=True)
        self.module.train()
        self.weights = [self.module._embedding_module.embedding_bags[c.name].weight for c in configs]
        self.state = [torch.zeros(slots) for _ in configs]
        self.hits = self.lookups = 0

    def step(self, values, lengths):
        out, remapped = self.module(_kjt(values, lengths))
        out.values().sum().backward()
        with torch.no_grad():
            for f, (w, state) in enumerate(zip(self.weights, self.state)):
                rows = remapped[f"f{f}"].values().unique()
                g = w.grad[rows]
                state[rows] += g.pow(2).mean(1)
                w[rows] -= LR * g / (state[rows].sqrt() + EPS).unsqueeze(1)
                w.grad = None
        return out.values()

    def state_bytes(self) -> int:
        return _bytes(self.module) + sum(s.nbytes for s in self.state)


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in list(module.parameters()) + list(module.buffers()))


def _zch_module(slots: int, backend: str):
    from gem_kernels.torchrec import ZchEmbeddingBagCollection

    module = ZchEmbeddingBagCollection(_configs(slots), optimizer=gk.optim.ExactRowwiseAdagrad(lr=LR, eps=EPS),
                                       eviction="lru", backend=backend)
    module.train()
    return module


def _zch_step(module):
    def step(values, lengths):
        out, _ = module(_kjt(values, lengths))
        out.values().sum().backward()
        return out.values()

    return step


def _cycle(batches, fn):
    state = {"i": 0}

    def call():
        values, lengths = batches[state["i"] % len(batches)]
        state["i"] += 1
        return fn(values, lengths)

    return call


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure_peak(impl: str, batch: int, slots: int) -> dict:
    """Peak memory of ``impl`` ("cpu" or "torchrec_mch") over two passes of the stream, in this
    process: the resident-set high-water mark (VmHWM, reset after the stream is built) above the
    resident set before the module existed: the module's state plus every step's transient tensors
    (TorchRec's dense [rows, D] gradients included)."""
    batches = stream(batch, slots, STEPS)
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the high-water mark (Linux >= 4.0)
        f.write("5")
    before = _rss_kib("VmRSS")
    step = _zch_step(_zch_module(slots, "cpu")) if impl == "cpu" else TorchRecMCH(slots).step
    for _ in range(2):
        for values, lengths in batches:
            step(values, lengths)
    return {"peak_mib": (_rss_kib("VmHWM") - before) / 1024}


def _peak_note(batch: int, slots: int) -> str:
    """Each impl's measured peak memory, each in a fresh process (so that one impl's freed pages do
    not serve the other's allocations)."""
    import json
    import subprocess
    import sys

    peaks = {}
    for impl in ("cpu", "torchrec_mch"):
        code = (f"import json, torch; torch.set_num_threads({torch.get_num_threads()}); from bench.hashed import "
                f"measure_peak; print(json.dumps(measure_peak({impl!r}, {batch}, {slots})))")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if run.returncode != 0:
            raise RuntimeError(f"peak memory of {impl} failed: {run.stderr.strip().splitlines()[-1:]}")
        peaks[impl] = json.loads(run.stdout.strip().splitlines()[-1])["peak_mib"]
    return (f"peak memory (resident-set high-water mark above the process before the module, two passes, a fresh "
            f"process each): zch cpu {peaks['cpu']:.1f} MiB, torchrec_mch {peaks['torchrec_mch']:.1f} MiB "
            f"(ratio {peaks['torchrec_mch'] / max(peaks['cpu'], 1e-9):.2f}x)")


def _probe_note() -> str:
    slots = 1 << 20
    tables = gk.ZchTables([slots], max_probe=32)
    ids = torch.randint(-(2**63), 2**63 - 1, (int(0.8 * slots),), generator=torch.Generator().manual_seed(1))
    ids = ids.unique()
    gk.zch_remap(ids, torch.tensor([0, ids.numel()]), tables, now=1)
    s = tables.stats()
    return (f"probe bound at 80 % load (2**20 slots, {ids.numel()} distinct random ids): max probe "
            f"{s['max_probe'][0]} cells (bound 32), probe overflows {s['probe_overflows'][0]}, "
            f"ids without a slot {s['unadmitted'][0]}")


def _mpzch_note(slots: int) -> str:
    """Whether TorchRec's MPZCH trains on the CPU here (the issue reports it does not)."""
    try:
        from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule
        from torchrec.sparse.jagged_tensor import JaggedTensor

        module = HashZchManagedCollisionModule(zch_size=slots, device=torch.device("cpu"), total_num_buckets=1)
        module.train()
        module({"t0": JaggedTensor(values=torch.arange(8), lengths=torch.tensor([8]))})
        return "TorchRec MPZCH (HashZchManagedCollisionModule) trained on the CPU here"
    except Exception as exc:  # noqa: BLE001  (the note reports whatever it raised)
        return f"TorchRec MPZCH (HashZchManagedCollisionModule) in training on the CPU: {type(exc).__name__}: " \
               f"{str(exc).splitlines()[0][:160]}"


def cases(quick: bool, device: torch.device) -> Iterator[Case]:
    if device.type != "cpu":
        return
    batch, slots = (512, 1024) if quick else (4096, 8192)
    batches = stream(batch, slots, STEPS)
    lookups = NUM_FEATURES * batch * IDS_PER_BAG
    shape = f"F={NUM_FEATURES} B={batch} L={IDS_PER_BAG} D={DIM} slots={slots}/table"
    unverified = ("different eviction algorithms by design (TorchRec's MCH re-sorts every eviction_interval, zch "
                  "evicts per id): identity tables and outputs differ; zch is checked against its oracle in tests")

    if "cpu" not in gk.available_backends():
        return
    module = _zch_module(slots, "cpu")
    step = _zch_step(module)
    for values, lengths in batches:  # one pass: the tables fill and start evicting
        step(values, lengths)
    before = module.zch.stats()
    for values, lengths in batches:
        step(values, lengths)
    after = module.zch.stats()
    delta = {k: sum(after[k]) - sum(before[k]) for k in after}
    notes = [f"zch cpu: hit rate {delta['hits'] / max(delta['lookups'], 1):.3f}, evictions/step "
             f"{delta['evictions'] / len(batches):.0f}, unadmitted/step {delta['unadmitted'] / len(batches):.0f}, "
             f"max probe {max(after['max_probe'])}, probe overflows {sum(after['probe_overflows'])}, state "
             f"{_bytes(module) / 2**20:.1f} MiB"]
    impls = {"cpu": _cycle(batches, step)}
    mch = TorchRecMCH(slots)
    for values, lengths in batches:
        mch.step(values, lengths)
    held = [int((m._mch_sorted_raw_ids != torch.iinfo(torch.int64).max).sum())
            for m in mch.module._managed_collision_collection._managed_collision_modules.values()]
    notes.append(f"torchrec_mch: ids held after one pass {sum(held)} of {NUM_FEATURES * slots} slots; state "
                 f"{mch.state_bytes() / 2**20:.1f} MiB (+ a dense [rows, D] gradient per step: "
                 f"{NUM_FEATURES * slots * DIM * 4 / 2**20:.1f} MiB)")
    impls["torchrec_mch"] = _cycle(batches, mch.step)
    # Two fresh processes (imports included) cost more than a quick run's budget: full runs only.
    notes += [_peak_note(batch, slots) if not quick else "peak memory: measured in the full run only",
              _probe_note(), _mpzch_note(slots), f"{lookups} raw ids per step"]
    yield Case(op="zch_step", shape=shape, dtype=torch.float32, flops=0,
               bytes=NUM_FEATURES * batch * DIM * 4, impls=impls, baseline="torchrec_mch", notes=notes,
               unverified=unverified, examples=batch)

    # The remap alone, on fresh modules warmed by one pass.
    tables = gk.ZchTables([slots] * NUM_FEATURES)
    id_offsets = torch.arange(0, NUM_FEATURES + 1) * batch * IDS_PER_BAG

    def zch_remap(values, lengths):
        return tables.remap(values, id_offsets, train=True, default_row=True)

    _, mcc = _mch_modules(slots)
    mcc.train()

    def mch_remap(values, lengths):
        return mcc(_kjt(values, lengths)).values()

    for values, lengths in batches:
        zch_remap(values, lengths)
        mch_remap(values, lengths)
    yield Case(op="zch_remap", shape=shape, dtype=torch.int64, flops=0, bytes=2 * lookups * 8,
               impls={"cpu": _cycle(batches, zch_remap), "torchrec_mch": _cycle(batches, mch_remap)},
               baseline="torchrec_mch", unverified=unverified, examples=batch,
               notes=[f"{lookups} raw ids per step"])

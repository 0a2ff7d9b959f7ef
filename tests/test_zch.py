"""Zero-collision hashing: gk.zch_remap / gk.ZchTables / gk.HashedEmbeddingBag on every backend.

Semantics are checked against ``Oracle``, a plain-Python model of the documented policy (dicts, a
min over candidates; no hashing, no heap), over streams of batches; the backends are checked
against each other bit for bit (identity tables, metadata, heap, index).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import gem_kernels as gk
from gem_kernels.nn.embedding_bag import TableSpec
from gem_kernels.reference.zch import STATE_FIELDS, fresh_row

from .utils import run_on_vector_path

BACKENDS = [b for b in ("reference", "cpu") if b in gk.available_backends()]
STATE_BUFFERS = ("slot_meta", "heap", "index", "pending", "table_state")


class Oracle:
    """One table's documented policy in plain Python: id -> [slot, count, last_seq, last_time]."""

    def __init__(self, slots: int, policy: str, ttl: int = 0, threshold: int = 1):
        self.slots, self.policy, self.ttl, self.threshold = slots, policy, ttl, threshold
        self.entries, self.pending, self.used, self.seq = {}, {}, 0, 0

    def key(self, e):
        return {"lru": (e[2],), "lfu": (e[1], e[2]), "ttl": (e[3], e[2])}[self.policy]

    def batch(self, ids, now):
        start, out = self.seq, []
        for x in ids:
            if x in self.entries:
                e = self.entries[x]
                self.seq += 1
                e[1], e[2], e[3] = e[1] + 1, self.seq, now
                out.append(e[0])
                continue
            if self.threshold > 1:
                self.pending[x] = self.pending.get(x, 0) + 1
                if self.pending[x] < self.threshold:
                    out.append(-1)
                    continue
            if self.used < self.slots:
                slot = self.used
                self.used += 1
            else:
                if self.policy == "ttl":
                    victim = min(self.entries, key=lambda i: self.key(self.entries[i]))
                    if now - self.entries[victim][3] < self.ttl:
                        victim = None
                else:
                    candidates = [i for i, e in self.entries.items() if e[2] <= start]  # not used this batch
                    victim = min(candidates, key=lambda i: self.key(self.entries[i])) if candidates else None
                if victim is None:
                    out.append(-1)
                    continue
                slot = self.entries.pop(victim)[0]
            self.pending.pop(x, None)
            self.seq += 1
            self.entries[x] = [slot, 1, self.seq, now]
            out.append(slot)
        return out

    def identity(self):
        ids = [None] * self.slots
        for x, e in self.entries.items():
            ids[e[0]] = x
        return ids


def drifting_stream(steps: int, tables: int, seed: int, per_table: int = 24, population: int = 30, drift: int = 4):
    """Batches of raw ids per table: a Zipf-like pick from a window of `population` ids that slides by
    `drift` each step (new ids arrive, old ones fade); ids are spread over the whole int64 range."""
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        batch = []
        for t in range(tables):
            base = step * drift
            picks = [base + min(int(rng.paretovariate(1.2)) - 1, population - 1) for _ in range(per_table)]
            batch.append([((p * 0x9E3779B97F4A7C15 + t) % 2**64) - 2**63 for p in picks])
        out.append(batch)
    return out


def run_stream(tables: gk.ZchTables, stream, backend, times=None):
    outs = []
    for step, batch in enumerate(stream):
        ids = torch.tensor([x for seg in batch for x in seg], dtype=torch.int64)
        lengths = [len(seg) for seg in batch]
        id_offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int64)
        now = times[step] if times else step + 1
        outs.append(gk.zch_remap(ids, id_offsets, tables, now=now, backend=backend).tolist())
    return outs


def identity(tables: gk.ZchTables, t: int):
    ids, used = tables.table_ids(t).tolist(), tables.table_used(t).tolist()
    return [x if u else None for x, u in zip(ids, used)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy,ttl,threshold", [("lru", None, 1), ("lfu", None, 1), ("ttl", 3, 1), ("lru", None, 3),
                                                  ("lfu", None, 2)])
def test_policy_matches_oracle(backend, policy, ttl, threshold):
    slots = [7, 16]
    stream = drifting_stream(steps=25, tables=2, seed=1)
    tables = gk.ZchTables(slots, eviction=policy, ttl=ttl, admission_threshold=threshold, admission_capacity=4096)
    oracles = [Oracle(s, policy, ttl or 0, threshold) for s in slots]
    evicted = 0
    for step, batch in enumerate(stream):
        got = run_stream(tables, [batch], backend, times=[step + 1])[0]
        want = [x for t, seg in enumerate(batch) for x in oracles[t].batch(seg, step + 1)]
        assert got == want, f"step {step}"
        for t, oracle in enumerate(oracles):
            assert identity(tables, t) == oracle.identity(), f"step {step} table {t}"
    stats = tables.stats()
    evicted = sum(stats["evictions"])
    assert evicted > 10, "the stream must exercise eviction"
    assert sum(stats["pending_replacements"]) == 0
    if threshold > 1:
        assert sum(stats["unadmitted"]) > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_ttl_in_seconds_and_timestamps_must_not_decrease(backend):
    tables = gk.ZchTables([2], eviction="ttl", ttl=10, ttl_unit="seconds")
    oracle = Oracle(2, "ttl", 10)
    times = [100, 100, 105, 111, 130]
    stream = [[[1, 2]], [[3]], [[1, 4]], [[5, 6]], [[7, 8, 9]]]
    got = run_stream(tables, stream, backend, times)
    assert got == [oracle.batch(b[0], now) for b, now in zip(stream, times)]
    with pytest.raises(ValueError, match="now must not decrease"):
        run_stream(tables, [[[1]]], backend, [129])


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_collisions_up_to_80_percent_load(backend):
    """Distinct ids (extreme values included) each get a slot of their own while the table is at most
    80 % full, within a probe bound of 32; filling it to 100 % gives the same."""
    slots = 2048 if backend == "cpu" else 512
    rng = random.Random(7)
    ids = list(dict.fromkeys([-(2**63), 2**63 - 1, 0, -1] + [rng.randrange(-(2**63), 2**63) for _ in range(slots)]))
    ids = ids[:slots]
    tables = gk.ZchTables([slots], max_probe=32)
    load80 = int(0.8 * slots)
    for part in (ids[:load80], ids[load80:]):
        out = gk.zch_remap(torch.tensor(part), torch.tensor([0, len(part)]), tables, now=1, backend=backend)
        assert (out >= 0).all()
        if part is ids[:load80]:
            stats = tables.stats()
            assert stats["probe_overflows"] == [0] and stats["max_probe"][0] <= 32
    assert sorted(tables.table_ids(0).tolist()) == sorted(ids)
    assert tables.stats()["used"] == [slots]
    # Looked up again, each id finds its own slot.
    again = gk.zch_remap(torch.tensor(ids), torch.tensor([0, slots]), tables, now=2, backend=backend)
    assert sorted(again.tolist()) == list(range(slots))


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the C++ extension is not built")
@pytest.mark.parametrize("policy,threshold", [("lru", 1), ("lfu", 2), ("ttl", 1)])
def test_same_state_on_every_backend_and_thread_count(policy, threshold):
    stream = drifting_stream(steps=12, tables=3, seed=3, per_table=40)
    states = []
    threads = torch.get_num_threads()
    try:
        for backend, n in (("reference", 1), ("cpu", 1), ("cpu", 2), ("cpu", 3)):
            torch.set_num_threads(n)
            tables = gk.ZchTables([9, 5, 31], eviction=policy, ttl=2 if policy == "ttl" else None,
                                  admission_threshold=threshold)
            outs = run_stream(tables, stream, backend)
            states.append((outs, {k: v.clone() for k, v in tables.state_dict().items()}))
    finally:
        torch.set_num_threads(threads)
    for outs, state in states[1:]:
        assert outs == states[0][0]
        for key, value in state.items():
            assert torch.equal(value, states[0][1][key]), key


def _stream_state(backend: str, device: str, policy: str, threshold: int, steps: int = 12, per_table: int = 40):
    """A 3-table HashedEmbeddingBag (Adam: element-wise state reset with the row) remapping an
    evicting stream on ``backend``: every batch's slots, and the final state_dict (weights, optimizer
    state, identity tables, metadata, heap, index, admission counts) on the CPU."""
    torch.manual_seed(0)
    module = gk.HashedEmbeddingBag([TableSpec(9, 4), TableSpec(5, 8), TableSpec(31, 4)], eviction=policy,
                                   ttl=2 if policy == "ttl" else None, admission_threshold=threshold,
                                   optimizer=gk.optim.ExactAdam(lr=0.1), seed=3, backend=backend).to(device)
    module.train()
    outs = []
    for batch in drifting_stream(steps=steps, tables=3, seed=3, per_table=per_table):
        ids = torch.tensor([x for seg in batch for x in seg], dtype=torch.int64, device=device)
        offsets = torch.tensor([0] + [len(seg) for seg in batch], device=device).cumsum(0)
        outs.append(module.remap(ids, offsets).cpu())
    return outs, {k: v.cpu() for k, v in module.state_dict().items()}


NEW_KERNEL_CASES = [("lru", 1), ("lfu", 2), ("ttl", 1), ("lru", 3)]


def _assert_same_stream_state(got, want):
    assert sum(want[1]["zch.table_state"][:, STATE_FIELDS.index("evictions")].tolist()) > 5  # it evicted
    for step, (a, b) in enumerate(zip(got[0], want[0])):
        assert torch.equal(a, b), f"step {step}"
    for key, value in want[1].items():
        assert torch.equal(got[1][key], value), key


@pytest.mark.skipif(os.environ.get("GK_CUDA_EMU") != "1", reason="runs the CUDA kernel's code under GK_CUDA_EMU=1 "
                    "(tests/cuda_emu); on a GPU see test_cuda_kernel_matches_cpu")
@pytest.mark.parametrize("policy,threshold", NEW_KERNEL_CASES)
def test_cuda_kernel_matches_reference_under_emulation(policy, threshold):
    """csrc/cuda/zch.cu, emulated on the CPU (it is then the `cpu` backend's zch_remap_native): the
    reference's slots, identity tables, eviction state and reset rows, bit for bit."""
    assert "cuda_emu" in torch._C._dispatch_dump("gem_kernels::zch_remap_native").split("CPU: registered at")[1]
    _assert_same_stream_state(_stream_state("cpu", "cpu", policy, threshold),
                              _stream_state("reference", "cpu", policy, threshold))


@pytest.mark.skipif("triton" not in gk.available_backends(), reason="triton is not installed")
@pytest.mark.parametrize("policy,threshold", NEW_KERNEL_CASES)
def test_triton_kernel_matches_reference(policy, threshold):
    """gem_kernels/triton/zch.py (TRITON_INTERPRET=1 on this CPU; CUDA tensors on a GPU): the
    reference's slots, identity tables, eviction state and reset rows, bit for bit (a short stream:
    the interpreter walks a table's ids one scalar op at a time)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _assert_same_stream_state(_stream_state("triton", device, policy, threshold, steps=7, per_table=24),
                              _stream_state("reference", "cpu", policy, threshold, steps=7, per_table=24))


@pytest.mark.skipif("triton" not in gk.available_backends(), reason="triton is not installed")
def test_triton_bad_values_and_empty_batch():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tables = gk.ZchTables([3, 4], admission_threshold=2, device=device)
    empty = gk.zch_remap(torch.empty(0, dtype=torch.int64, device=device), torch.zeros(3, dtype=torch.int64,
                                                                                       device=device), tables, now=1,
                         backend="triton")
    assert empty.numel() == 0 and tables.table_state[:, STATE_FIELDS.index("last_now")].tolist() == [1, 1]
    with pytest.raises(ValueError, match="id_offsets must be non-decreasing"):
        gk.zch_remap(torch.tensor([1, 2], device=device), torch.tensor([0, 3, 2], device=device), tables, now=2,
                     backend="triton")
    with pytest.raises(ValueError, match="now must not decrease"):
        gk.zch_remap(torch.tensor([1, 2], device=device), torch.tensor([0, 1, 2], device=device), tables, now=0,
                     backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available() or "cuda" not in gk.available_backends(),
                    reason="needs a CUDA GPU and the CUDA build")
@pytest.mark.parametrize("policy,threshold", NEW_KERNEL_CASES)
def test_cuda_kernel_matches_cpu(policy, threshold):
    _assert_same_stream_state(_stream_state("cuda", "cuda", policy, threshold),
                              _stream_state("reference", "cpu", policy, threshold))


@pytest.mark.parametrize("backend", BACKENDS)
def test_eval_only_looks_up(backend):
    tables = gk.ZchTables([4], admission_threshold=2)
    run_stream(tables, [[[1, 1, 2, 2, 3]]], backend)
    before = {k: v.clone() for k, v in tables.state_dict().items()}
    out = gk.zch_remap(torch.tensor([1, 2, 3, 9]), torch.tensor([0, 4]), tables, now=5, train=False, backend=backend)
    assert out.tolist() == [0, 1, -1, -1]
    for key in ("slot_meta", "heap", "index", "pending"):
        assert torch.equal(tables.state_dict()[key], before[key])


def _module(backend, **kw):
    kw.setdefault("optimizer", gk.optim.ExactRowwiseAdagrad(lr=0.1))
    return gk.HashedEmbeddingBag([TableSpec(4, 8), TableSpec(6, 16)], backend=backend, **kw)


def _batch(step, batch=3):
    """ids of 2 tables x `batch` bags, drifting so that the 4-row table evicts every step."""
    rng = random.Random(step)
    per_bag = [rng.randrange(1, 4) for _ in range(2 * batch)]
    ids = [step * 3 + rng.randrange(0, 6) + 1000 * (i // batch) for i, n in enumerate(per_bag) for _ in range(n)]
    offsets = [0]
    for n in per_bag:
        offsets.append(offsets[-1] + n)
    return torch.tensor(ids), torch.tensor(offsets)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_reused_slot_gets_fresh_weights_and_state(backend, optimizer):
    opt = gk.optim.ExactRowwiseAdagrad(lr=0.1) if optimizer == "rowwise_adagrad" else gk.optim.ExactAdam(lr=0.1)
    module = _module(backend, optimizer=opt, seed=5)
    module.train()
    reused = 0
    for step in range(6):
        ids, offsets = _batch(step)
        before_ids = module.zch.table_ids(0).clone()
        slots = module.remap(ids, offsets)
        after_ids = module.zch.table_ids(0)
        changed = [s for s in range(4) if module.zch.table_used(0)[s] and before_ids[s] != after_ids[s]]
        lo, hi = module.init_bounds[0].tolist()
        for s in changed:  # the new id's row: its fresh weights, zero state, before any update
            fresh = torch.tensor(fresh_row(int(after_ids[s]), 0, 8, 5, lo, hi), dtype=torch.float64).float()
            assert torch.equal(module.weight(0)[s].detach(), fresh)
            if optimizer == "rowwise_adagrad":
                assert module.momentum1[s] == 0
            else:
                assert (module.layout.table(module.momentum1, 0)[s] == 0).all()
                assert (module.layout.table(module.momentum2, 0)[s] == 0).all()
        reused += len(changed)
        out = gk.embedding_bag(module.weights, module.table_meta, slots, offsets, output_dim=module.output_dim,
                               bounds_check="skip", optimizer=module.optimizer, momentum1=module.momentum1,
                               momentum2=module.momentum2, step=module.step, backend=backend)
        out.sum().backward()
    assert reused >= 3, "the stream must reuse slots"


_FRESH_ROWS_CHECK = """
import torch, gem_kernels as gk
from gem_kernels.nn.embedding_bag import TableSpec
from gem_kernels.reference.zch import fresh_row
module = gk.HashedEmbeddingBag([TableSpec(3, 13), TableSpec(5, 64)], optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1),
                               seed=7, backend="cpu")
module.train()
ids = torch.arange(40, dtype=torch.int64) * 2654435761 - 2**40
for step in range(4):
    chunk = ids[10 * step:10 * step + 10]
    module.remap(torch.cat([chunk[:5], chunk[5:]]), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))
    for t, (rows, dim) in enumerate(((3, 13), (5, 64))):
        lo, hi = module.init_bounds[t].tolist()
        for s in range(rows):
            ident = int(module.zch.table_ids(t)[s])
            want = torch.tensor(fresh_row(ident, t, dim, 7, lo, hi), dtype=torch.float64).float()
            assert torch.equal(module.weight(t)[s].detach(), want), (step, t, s)
print("fresh rows ok")
"""


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the C++ extension is not built")
@pytest.mark.parametrize("avx512", ["as the CPU has it", "off"])
def test_cpu_fresh_rows_equal_the_reference_on_both_clones(avx512):
    """The C++ fresh rows are a vectorised loop with an AVX-512DQ clone taken where the CPU has it:
    both clones (GEM_KERNELS_NO_AVX512=1 forces the default one) write the reference's bits, at a dim
    with a vector tail (13) and a whole one (64). A fresh process: the clone is chosen once."""
    run_on_vector_path(_FRESH_ROWS_CHECK, avx512, "fresh rows ok")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("unadmitted", ["zeros", "default_row"])
def test_unadmitted_ids(backend, unadmitted):
    module = _module(backend, admission_threshold=2, unadmitted=unadmitted, pooling="sum")
    module.train()
    ids, offsets = torch.tensor([10, 11, 20]), torch.tensor([0, 2, 3])  # T=2, B=1: table 0 {10, 11}, table 1 {20}
    out = module(ids, offsets)
    if unadmitted == "zeros":
        assert (out == 0).all()
    else:
        default0, default1 = module.weight(0)[3].detach(), module.weight(1)[5].detach()
        torch.testing.assert_close(out.detach(), torch.cat([2 * default0, default1]).unsqueeze(0))
    out = module(ids, offsets)  # second sighting: admitted, fresh rows
    rows0 = [module.weight(0)[s].detach() for s in (0, 1)]
    assert module.zch.table_ids(0)[:2].tolist() == [10, 11]
    torch.testing.assert_close(out.detach()[0, :8], rows0[0] + rows0[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_resume_is_exact(backend):
    torch.manual_seed(0)
    first = _module(backend, eviction="lfu", admission_threshold=2)
    first.train()
    for step in range(4):
        first(*_batch(step)).sum().backward()
    state = {k: v.clone() for k, v in first.state_dict().items()}
    assert any(k.startswith("zch.") for k in state) and "zch.step" in state
    second = _module(backend, eviction="lfu", admission_threshold=2)
    second.load_state_dict(state)
    second.train()
    for step in range(4, 8):
        out1, out2 = first(*_batch(step)), second(*_batch(step))
        assert torch.equal(out1, out2)
        out1.sum().backward()
        out2.sum().backward()
    for key, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[key]), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_lookup_pools_the_remapped_rows_and_trains_only_live_rows(backend):
    module = _module(backend, pooling="mean", admission_threshold=2, optimizer=gk.optim.ExactSGD(lr=0.5))
    module.train()
    ids, offsets = torch.tensor([1, 2, 2, 7, 7, 8]), torch.tensor([0, 3, 6])  # T=2, B=1
    module(ids, offsets)  # 2 and 7 admitted (two sightings); 1 and 8 pending
    out = module(ids, offsets)  # 1 and 8 admitted now (their rows reset before the lookup read them)
    before = module.weights.detach().clone()
    table0 = module.zch.table_ids(0).tolist()
    rows = module.layout.table(before, 0)
    torch.testing.assert_close(out.detach()[0, :8], (rows[table0.index(1)] + 2 * rows[table0.index(2)]) / 3)
    out.sum().backward()
    moved = module.layout.table((module.weights.detach() != before).view(-1), 0).any(1)
    assert moved.tolist() == module.zch.table_used(0).tolist()  # the free slots are left alone


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_clear_errors(backend):
    tables = gk.ZchTables([4, 4])
    with pytest.raises(ValueError, match="ids must have dtype"):
        gk.zch_remap(torch.tensor([1.0]), torch.tensor([0, 1, 1]), tables, backend=backend)
    with pytest.raises(ValueError, match="id_offsets must have T\\+1 = 3"):
        gk.zch_remap(torch.tensor([1]), torch.tensor([0, 1]), tables, backend=backend)
    with pytest.raises(ValueError, match="id_offsets must start at 0 and end at ids.numel"):
        gk.zch_remap(torch.tensor([1]), torch.tensor([0, 1, 2]), tables, backend=backend)
    with pytest.raises(ValueError, match="id_offsets must be non-decreasing"):
        gk.zch_remap(torch.tensor([1, 2]), torch.tensor([0, 3, 2]),
                     tables, backend=backend)
    with pytest.raises(TypeError, match="now must be an int"):
        gk.zch_remap(torch.tensor([1]), torch.tensor([0, 1, 1]), tables, now=1.5, backend=backend)
    with pytest.raises(ValueError, match="eviction must be one of"):
        gk.ZchTables([4], eviction="fifo")
    with pytest.raises(ValueError, match="ttl must be an int >= 1"):
        gk.ZchTables([4], eviction="ttl")
    with pytest.raises(ValueError, match="ttl is only used with eviction 'ttl'"):
        gk.ZchTables([4], ttl=3)
    with pytest.raises(ValueError, match="slots\\[1\\] must be an int >= 1"):
        gk.ZchTables([4, 0])
    with pytest.raises(ValueError, match="unadmitted must be one of"):
        _module(backend, unadmitted="drop")
    seconds = _module(backend, eviction="ttl", ttl=5, ttl_unit="seconds")
    with pytest.raises(ValueError, match="timestamp is required"):
        seconds(*_batch(0))
    with pytest.raises(ValueError, match="offsets must have T\\*B\\+1"):
        _module(backend)(torch.tensor([1, 2]), torch.tensor([0, 1, 2, 2]))


def test_empty_batch():
    tables = gk.ZchTables([3, 3])
    for backend in BACKENDS:
        out = gk.zch_remap(torch.empty(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), tables,
                           backend=backend)
        assert out.shape == (0,)
    module = _module(BACKENDS[-1])
    module.train()
    assert module(torch.empty(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)).shape == (0, 24)


def test_stats_fields():
    assert STATE_FIELDS[0] == "used" and len(STATE_FIELDS) == gk.ZchTables([1]).table_state.shape[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    tables = gk.ZchTables([5, 3], eviction="lfu", admission_threshold=2)
    run_stream(tables, drifting_stream(steps=3, tables=2, seed=4, per_table=6), backend)
    empty = torch.empty(0, dtype=torch.int64)
    args = (torch.tensor([5, 6, 5, 7, 8]), torch.tensor([0, 3, 5]), tables.slot_meta, tables.heap, tables.index,
            tables.pending, tables.table_state, tables.layout, 1, 0, 10, 2, 32, True, False,
            torch.empty(0), empty, empty, empty, torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.float64), 0,
            backend)
    torch.library.opcheck(torch.ops.gem_kernels.zch_remap.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("call,node", [("remap", "remap_by_table"), ("__call__", "traced_call")])
def test_remap_traces_with_torch_fx(call, node):
    """The remap, and the fused remap + lookup of the forward, are one node of a torch.fx trace (they
    read sizes and the clock, which a trace cannot)."""

    class Remap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bags = _module(BACKENDS[-1])

        def forward(self, ids, offsets):
            return getattr(self.bags, call)(ids, offsets)

    module, twin = Remap(), Remap()
    twin.load_state_dict(module.state_dict())
    traced = torch.fx.symbolic_trace(module)
    assert node in [n.target.__name__ for n in traced.graph.nodes if n.op == "call_function"]
    module.train()
    twin.train()
    for step in range(3):
        ids, offsets = _batch(step)
        assert torch.equal(traced(ids, offsets), twin(ids, offsets))
    assert torch.equal(module.bags.zch.slot_meta, twin.bags.zch.slot_meta)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the C++ extension is not built")
@pytest.mark.parametrize("kernel", ["native", "triton"])
def test_native_call_with_malformed_state_raises(kernel):
    """A direct call of the schema (the native one: cpu, or cuda under GK_CUDA_EMU; or the triton
    kernel's) with inconsistent state raises instead of reading or writing outside its buffers."""
    if kernel == "triton":
        pytest.importorskip("triton")
        from gem_kernels.triton.zch import zch_remap as remap
    else:
        remap = torch.ops.gem_kernels.zch_remap_native
    empty, none = torch.empty(0, dtype=torch.int64), torch.empty(0)

    def call(tables, **change):
        args = dict(slot_meta=tables.slot_meta, heap=tables.heap, index=tables.index, pending=tables.pending,
                    table_state=tables.table_state, layout=tables.layout)
        args.update(change)
        return remap(
            torch.tensor([1, 2, 3]), torch.tensor([0, 3]), args["slot_meta"], args["heap"], args["index"],
            args["pending"], args["table_state"], args["layout"], 0, 0, 1, 1, 32, True, False, none, empty, empty,
            empty, none, none, torch.empty(0, dtype=torch.float64), 0)

    tables = gk.ZchTables([2])
    call(tables)  # fills both slots
    bad_state = tables.table_state.clone()
    bad_state[0, 0] = 5  # more slots used than the table has
    with pytest.raises(RuntimeError, match="table_state of table 0 is inconsistent"):
        call(tables, table_state=bad_state)
    bad_layout = tables.layout.clone()
    bad_layout[1, 1] = 3  # index cells not a power of two
    with pytest.raises(RuntimeError, match="zch_remap: state tensors do not match layout|layout of table 0"):
        call(tables, layout=bad_layout)
    bad_index = tables.index.clone()
    bad_index[:, 1] = torch.where(bad_index[:, 1] >= 0, 7, -1)  # slots beyond the table
    with pytest.raises(RuntimeError, match="index holds slot 7"):
        call(tables, index=bad_index)
    bad_heap = tables.heap.clone()
    bad_heap[:, 0] = 9
    with pytest.raises(RuntimeError, match="heap holds slot 9"):
        call(tables, heap=bad_heap, index=gk.ZchTables([2]).index.clone())

"""The gather peak (gem_kernels.testing.peaks, bench.peaks) and the embedding-bag rows' % of it."""

from __future__ import annotations

import time

import pytest
import torch

from bench import harness
from gem_kernels.testing.peaks import gather_gbps


def test_gather_peak_reads_the_given_rows(monkeypatch):
    """gather_gbps counts every looked-up row once (repeats too) over the time of reading them in
    order; the timing is pinned here so the byte count is what is checked."""
    tables = [torch.randn(100, 8), torch.randn(50, 16)]
    ids = [torch.tensor([3, 3, 99, 0]), torch.arange(50).repeat(100)]  # 5000 ids: two index_select blocks
    calls = []
    original = torch.index_select

    def counting(table, dim, index, out=None):
        calls.append(index.clone())
        return original(table, dim, index, out=out)

    monkeypatch.setattr(torch, "index_select", counting)
    monkeypatch.setattr("gem_kernels.testing.peaks.measure", lambda fn, device, settings: (fn(), harness.Timing([0.002], False))[1])
    gbps = gather_gbps(tables, ids, torch.device("cpu"))
    assert gbps == pytest.approx((4 * 8 + 5000 * 16) * 4 / 0.002 / 1e9)
    assert torch.equal(torch.cat(calls), torch.cat(ids))  # the rows in the case's order, nothing else


def test_gather_peak_is_measured():
    assert gather_gbps([torch.randn(1000, 64)], [torch.randint(0, 1000, (5000,))], torch.device("cpu")) > 0


def test_embedding_bag_row_reports_pct_of_its_gather_peak():
    case = harness.Case(op="embedding_bag fwd", shape="s", dtype=torch.float32, flops=0, bytes=1000,
                        formula_bytes=4000, impls={"a": lambda: None}, baseline="a", unverified="test",
                        gather_gbps=2.0)
    row = harness.make_row("embedding_bag", case, "a", harness.Timing([1e-6], False), torch.device("cpu"),
                           {"copy_gbps": 10.0}, "sha", "now")
    assert row["gbps_formula"] == pytest.approx(4.0) and row["pct_gather_peak"] == pytest.approx(200.0)
    assert row["pct_peak"] == pytest.approx(10.0)  # the copy peak's column, on the floor bytes, unchanged
    plain = harness.Case(op="x", shape="s", dtype=torch.float32, flops=0, bytes=1000, impls={"a": lambda: None},
                         baseline="a", unverified="test")
    assert harness.make_row("x", plain, "a", harness.Timing([0.001], False), torch.device("cpu"), {}, "s",
                            "n")["pct_gather_peak"] is None


def _xor_of_rows(table: torch.Tensor, ids: torch.Tensor) -> int:
    """The XOR of the 8-byte words of table[ids] (each row zero-padded to a whole word), in numpy."""
    import numpy as np

    rows = table[ids.long()].contiguous().view(torch.uint8).reshape(ids.numel(), table.shape[1] * table.element_size()).numpy()
    padded = np.zeros((rows.shape[0], -(-rows.shape[1] // 8) * 8), dtype=np.uint8)
    padded[:, :rows.shape[1]] = rows
    return int(np.bitwise_xor.reduce(padded.view(np.int64).ravel(), initial=0))


needs_ext = pytest.mark.skipif(__import__("gem_kernels")._backend._C is None, reason="gem_kernels._C not built")


@needs_ext
@pytest.mark.parametrize("distance", [0, 3, 16, 5000])
def test_prefetched_gather_reads_every_row_in_order(distance):
    """gather_rows_read (the prefetching gather roof's reader) XORs exactly the looked-up rows: row
    sizes of the unrolled kernels (128/256/512 bytes) and odd ones (12, 10, 1000 bytes), fp32 and
    fp16, int32 and int64 ids, repeats, an empty list, and enough ids to split over the threads."""
    from gem_kernels import _backend

    gen = torch.Generator().manual_seed(0)
    shapes = [(1000, 32, torch.float32), (300, 64, torch.float32), (97, 128, torch.float32), (59, 3, torch.float32),
              (40, 5, torch.float16), (7, 250, torch.float32), (5, 64, torch.bfloat16)]
    tables = [torch.randn(r, d, generator=gen).to(dt) for r, d, dt in shapes]
    sizes = [20000, 3000, 1, 0, 2561, 77, 5120]
    ids = [torch.randint(0, t.shape[0], (n,), generator=gen, dtype=torch.int32 if k % 2 else torch.int64)
           for k, (t, n) in enumerate(zip(tables, sizes))]
    expected = 0
    for table, table_ids in zip(tables, ids):
        expected ^= _xor_of_rows(table, table_ids)
    assert _backend._C.gather_rows_read(tables, ids, distance) == expected
    assert _backend._C.gather_rows_read([], [], distance) == 0


@needs_ext
def test_prefetched_gather_rejects_bad_input():
    from gem_kernels import _backend

    read = _backend._C.gather_rows_read
    table, ids = torch.randn(10, 4), torch.tensor([0, 9])
    with pytest.raises(IndexError, match=r"ids\[0\]\[1\] = 10 is out of range"):
        read([table], [torch.tensor([0, 10, 3])], 4)
    with pytest.raises(IndexError, match=r"= -1 is out of range"):
        read([table], [torch.tensor([-1])], 0)
    with pytest.raises(ValueError, match="same length"):
        read([table], [], 0)
    with pytest.raises(ValueError, match="prefetch_distance"):
        read([table], [ids], -1)
    with pytest.raises(ValueError, match="contiguous 2-D"):
        read([table.t()], [ids], 0)
    with pytest.raises(ValueError, match="1-D"):
        read([table], [ids[None]], 0)
    with pytest.raises(TypeError, match="int32 or int64"):
        read([table], [ids.float()], 0)


@needs_ext
def test_gather_roof_is_the_best_reader(monkeypatch):
    """gather_roof keeps the fastest of ATen's gather and every prefetch distance, and names it; the
    prefetching reader counts the bytes as gather_gbps does (timings pinned: the best is known)."""
    from gem_kernels.testing import peaks

    tables, ids = [torch.randn(100, 8)], [torch.arange(100).repeat(3)]
    monkeypatch.setattr(peaks, "gather_gbps", lambda *a, **k: 0.005)
    # seconds of each distance's timed calls: its p10 (0.004, 0.002, 0.001, 0.003) is what counts
    pinned = {0: [0.004] * 5, 4: [0.002] * 4 + [0.5], 8: [0.001] * 5, 16: [0.003] * 5}

    def fake_interleaved(calls, settings):
        assert list(calls) == [0, 4, 8, 16]
        for fn in calls.values():
            fn()  # the reader runs (and reads the rows) at each distance
        return pinned

    monkeypatch.setattr(peaks, "interleaved_seconds", fake_interleaved)
    monkeypatch.setattr(peaks, "PREFETCH_DISTANCES", (0, 4, 8, 16))
    roof = peaks.gather_roof(tables, ids, torch.device("cpu"))
    nbytes = 300 * 8 * 4
    assert roof["prefetched_gbps"] == pytest.approx({0: nbytes / 0.004 / 1e9, 4: nbytes / 0.002 / 1e9,
                                                     8: nbytes / 0.001 / 1e9, 16: nbytes / 0.003 / 1e9})
    assert roof["best"] == "prefetch 8" and roof["gbps"] == roof["prefetched_gbps"][8] and roof["aten_gbps"] == 0.005
    monkeypatch.setattr(peaks, "gather_gbps", lambda *a, **k: 1e9)
    assert peaks.gather_roof(tables, ids, torch.device("cpu"))["best"] == "aten"


def test_interleaved_seconds_times_the_candidates_round_robin(monkeypatch):
    """The roof's candidates are timed in turn within every round (a, b, c, a, b, c, ...), each warmed
    once first, until every one has min_repeats times and min_time per candidate has passed, or
    max_time per candidate: a drift of the host's speed then reaches all of them alike."""
    from gem_kernels.testing import peaks

    clock = [0.0]
    monkeypatch.setattr(peaks.time, "perf_counter", lambda: clock[0])
    order = []

    def call(key, cost):
        def fn():
            order.append(key)
            clock[0] += cost
        return fn

    calls = {"a": call("a", 1 / 64), "b": call("b", 3 / 64), "c": call("c", 2 / 64)}  # exact in binary
    settings = harness.Settings(min_repeats=4, min_time=0.05, max_time=10.0, warmup_time=0.0)
    seconds = peaks.interleaved_seconds(calls, settings)
    # the warm-up round, then rounds of 6/64 s until 4 rounds and 0.15 s (3 x min_time) have passed
    assert order == ["a", "b", "c"] * 5
    assert seconds == {"a": [1 / 64] * 4, "b": [3 / 64] * 4, "c": [2 / 64] * 4}
    order.clear()
    settings = harness.Settings(min_repeats=1000, min_time=0.0, max_time=0.04, warmup_time=0.0)
    seconds = peaks.interleaved_seconds(calls, settings)  # capped at 0.12 s: 2 rounds (12/64 s)
    assert order == ["a", "b", "c"] * 3 and len(seconds["b"]) == 2
    assert peaks.interleaved_seconds({}, settings) == {}


@needs_ext
def test_gather_roof_call_reads_the_rows_of_the_named_reader(monkeypatch):
    """gather_roof_call (what the bench interleaves with the impls) reads exactly the given rows with the
    reader gather_roof named: the prefetching reader at that distance, or ATen's index_select."""
    from gem_kernels.testing import peaks

    gen = torch.Generator().manual_seed(1)
    tables = [torch.randn(300, 64, generator=gen), torch.randn(50, 128, generator=gen)]
    ids = [torch.randint(0, 300, (5000,), generator=gen), torch.randint(0, 50, (7,), generator=gen)]
    expected = _xor_of_rows(tables[0], ids[0]) ^ _xor_of_rows(tables[1], ids[1])
    for best in ("prefetch 0", "prefetch 32"):
        assert peaks.gather_roof_call(tables, ids, best, torch.device("cpu"))() == expected
    calls, original = [], torch.index_select
    monkeypatch.setattr(torch, "index_select", lambda t, d, i, out=None: (calls.append(i.clone()), original(t, d, i, out=out))[1])
    peaks.gather_roof_call(tables, ids, "aten", torch.device("cpu"))()
    assert torch.equal(torch.cat(calls), torch.cat(ids))
    for bad in ("prefetch", "prefetch x", "index_select 4"):
        with pytest.raises(ValueError, match="best must be"):
            peaks.gather_roof_call(tables, ids, bad, torch.device("cpu"))


def _roof_case(impls, roof, **kw):
    return harness.Case(op="embedding_bag fwd", shape="s", dtype=torch.float32, flops=0, bytes=1000,
                        formula_bytes=4000, impls=impls, baseline="slow", unverified="test", gather_gbps=2.0,
                        gather_roof=roof, **kw)


# (Case field, row keys, the note's words, the table's words) of the two interleaved roofs.
ROOFS = {"gather": ("gather_roof", "gather_roof_ms", "pct_gather_peak", "gather roof timed interleaved",
                    "of gather (interleaved)"),
         "gemm": ("gemm_roof", "gemm_roof_ms", "pct_gemm_roof", "GEMM roof", "of its GEMMs (interleaved)")}


@pytest.mark.parametrize("kind", list(ROOFS))
def test_a_roof_is_timed_interleaved_with_the_impls(kind):
    """A case's gather roof (Case.gather_roof) or GEMM roof (Case.gemm_roof) is called round-robin
    between the impls' timed calls, gets no row of its own, and every row's % of it is its median over
    the impl's (timings of the real harness: only the bookkeeping is checked, no speed)."""
    field, ms_key, pct_key, note_words, table_words = ROOFS[kind]
    order = []

    def impl(name, seconds):
        return lambda: (order.append(name), time.sleep(seconds))

    impls = {"slow": impl("slow", 0.004), "fast": impl("fast", 0.001)}
    if kind == "gather":
        case = _roof_case(impls, impl("roof", 0.002))
    else:
        case = harness.Case(op="cross_layer", shape="s", dtype=torch.float32, flops=10, bytes=10, impls=impls,
                            baseline="slow", peak="matmul", unverified="test", gemm_roof=impl("roof", 0.002))
    settings = harness.Settings(min_repeats=4, min_time=0.0, max_time=1.0, warmup_time=0.0)
    result = harness.run_family("fake", iter([case]), torch.device("cpu"), settings, harness.Budget(30.0),
                                {"copy_gbps": 10.0}, "sha", "ts")
    assert {row["impl"] for row in result.rows} == {"slow", "fast"} and not result.errors
    timed = order[order.index("roof") - 2:]  # from the first timed round: slow, fast, roof, slow, ...
    assert timed[:6] == ["slow", "fast", "roof"] * 2
    notes = [n for n in result.notes if note_words in n]
    assert len(notes) == 1
    other = ROOFS["gemm" if kind == "gather" else "gather"][1]
    for row in result.rows:
        assert row[ms_key] > 0 and row[other] is None
        assert row[pct_key] == pytest.approx(100 * row[ms_key] / row["ms"])
        assert f"{row[ms_key]:.3f} ms" in notes[0]
    from bench.report import table_lines

    assert table_words in "\n".join(table_lines(result.rows))


def test_a_gather_roof_that_raises_is_an_error_and_rows_fall_back_to_the_premeasured_peak():
    def roof():
        raise RuntimeError("reader broke")

    case = _roof_case({"slow": lambda: None}, roof)
    settings = harness.Settings(min_repeats=2, min_time=0.0, max_time=0.1, warmup_time=0.0)
    result = harness.run_family("fake", iter([case]), torch.device("cpu"), settings, harness.Budget(30.0),
                                {"copy_gbps": 10.0}, "sha", "ts")
    assert any("gather roof raised" in e and "reader broke" in e for e in result.errors), result.errors
    (row,) = result.rows
    assert row["gather_roof_ms"] is None
    assert row["pct_gather_peak"] == pytest.approx(100 * row["gbps_formula"] / 2.0)


def test_an_impl_cannot_take_the_gather_roofs_name():
    with pytest.raises(ValueError, match="gather roof"):
        _roof_case({"slow": lambda: None, harness.GATHER_ROOF: lambda: None}, None)


def test_embedding_bag_case_interleaves_a_roof_reading_each_input_sets_rows(monkeypatch):
    """The bench's forward case gives the harness a roof call built with gather_roof's best reader on
    the case's tables, reading, call after call, the rows of the same rotating input sets as its impls."""
    from bench import embedding_bag

    built, read = [], []

    def fake_call(tables, ids, best, device):
        built.append((tables, ids, best))
        return lambda k=len(built) - 1: read.append(k)

    monkeypatch.setattr(embedding_bag, "gather_roof", lambda *a, **k: {"gbps": 1.0, "aten_gbps": 1.0,
                                                                        "prefetched_gbps": None, "best": "prefetch 16"})
    monkeypatch.setattr(embedding_bag, "gather_roof_call", fake_call)
    fwd = next(embedding_bag.cases(True, torch.device("cpu")))
    specs, batch = embedding_bag.table_specs(4, 1000, 20_000), 256  # the quick preset's two input sets
    assert len(built) == 2
    for k, (tables, ids, best) in enumerate(built):
        indices, offsets = embedding_bag.zipf_batch(specs, batch, embedding_bag.SEED + k)
        assert best == "prefetch 16" and [tuple(t.shape) for t in tables] == [(s.num_embeddings, s.embedding_dim)
                                                                             for s in specs]
        for t, part in enumerate(ids):
            assert torch.equal(part, indices[int(offsets[t * batch]):int(offsets[(t + 1) * batch])])
    for _ in range(3):
        fwd.gather_roof()
    assert read == [0, 1, 0]


def test_a_gemm_roof_that_raises_is_an_error_and_rows_have_no_pct_of_it():
    def roof():
        raise RuntimeError("mm broke")

    case = harness.Case(op="cross_layer", shape="s", dtype=torch.float32, flops=10, bytes=10,
                        impls={"slow": lambda: None}, baseline="slow", peak="matmul", unverified="test", gemm_roof=roof)
    settings = harness.Settings(min_repeats=2, min_time=0.0, max_time=0.1, warmup_time=0.0)
    result = harness.run_family("fake", iter([case]), torch.device("cpu"), settings, harness.Budget(30.0),
                                {"copy_gbps": 10.0}, "sha", "ts")
    assert any("GEMM roof raised" in e and "mm broke" in e for e in result.errors), result.errors
    (row,) = result.rows
    assert row["gemm_roof_ms"] is None and row["pct_gemm_roof"] is None
    with pytest.raises(ValueError, match="GEMM roof"):
        harness.Case(op="x", shape="s", dtype=torch.float32, flops=1, bytes=1, baseline="a", unverified="t",
                     impls={"a": lambda: None, harness.GEMM_ROOF: lambda: None})


@pytest.mark.parametrize("rank", [None, 4])
def test_cross_layer_gemm_roof_runs_the_layers_matrix_products(monkeypatch, rank):
    """The cross layer cases' GEMM roofs run exactly the layer's products: the forward's matmul FLOPs
    (2 B N^2, or 4 B N r at low rank) and three times that for forward + backward (flops.cross_layer
    less its elementwise 3 B N per pass), on the case's own input sets."""
    from bench import interaction

    mm_flops = []
    real_mm = torch.mm

    def counting_mm(a, b):
        mm_flops.append(2 * a.shape[0] * a.shape[1] * b.shape[1])
        return real_mm(a, b)

    cases = [c for c in interaction.cases(True, torch.device("cpu")) if c.op.startswith("cross_layer")
             and (("rank=" in c.shape) == (rank is not None))]
    assert len(cases) == 2 and all(c.gemm_roof is not None for c in cases)
    monkeypatch.setattr(torch, "mm", counting_mm)
    for case in cases:
        B, N = (int(part.split("=")[1]) for part in case.shape.split()[:2])
        mm_flops.clear()
        case.gemm_roof()
        elementwise = 3 * B * N * (2 if "fwd+bwd" in case.op else 1)
        assert sum(mm_flops) == case.flops - elementwise, (case.op, case.shape, mm_flops)

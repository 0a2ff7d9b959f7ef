"""The gather peak (gem_kernels.testing.peaks, bench.peaks) and the embedding-bag rows' % of it."""

from __future__ import annotations

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

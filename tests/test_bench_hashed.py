"""bench/hashed.py's measured peak memory (issue 28 bench): each impl's resident-set high-water mark
over two passes of the stream, above its fresh process before the module existed."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torchrec")


def test_peak_note_measures_each_impl_in_a_fresh_process():
    import gem_kernels as gk
    from bench.hashed import DIM, NUM_FEATURES, _peak_note

    if "cpu" not in gk.available_backends():
        pytest.skip("the C++ extension is not built")
    slots = 2048
    note = _peak_note(batch=16, slots=slots)
    peaks = {impl: float(v) for impl, v in re.findall(r"(zch cpu|torchrec_mch) ([0-9.]+) MiB", note)}
    assert peaks.keys() == {"zch cpu", "torchrec_mch"}, note
    # At least the fp32 weights of the 26 tables (both impls hold them), far below a GiB.
    for peak in peaks.values():
        assert NUM_FEATURES * slots * DIM * 4 / 2**20 <= peak < 1024, note

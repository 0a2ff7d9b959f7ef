"""docs/ops.md (op -> its four backends' file:function) is what scripts/gen_ops_doc.py reads from the sources."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gen():
    return runpy.run_path(str(ROOT / "scripts" / "gen_ops_doc.py"))


def test_ops_doc_is_up_to_date(gen):
    assert gen["main"](["--check"]) == 0, "docs/ops.md is stale: run python scripts/gen_ops_doc.py"


def test_ops_doc_check_fails_on_a_stale_doc(gen, tmp_path, monkeypatch):
    stale = tmp_path / "ops.md"
    stale.write_text(gen["render"]().replace("jagged_to_padded_cpu", "renamed_cpu"))
    monkeypatch.setitem(gen["main"].__globals__, "DOC", stale)
    assert gen["main"](["--check"]) == 1


def test_ops_doc_names_every_native_op_and_its_kernels(gen):
    """Every native schema has a row, its front door, reference and cpu kernel; cuda and triton for
    every family but the fused zch_embedding_bag_forward, which has none: on cuda and triton it is
    zch_remap's kernel, then the embedding-bag kernel; and hstu_sequence_layout, a CPU pass whose
    reference twin runs on every other device (index work, no kernel worth a GPU launch per op), and
    jagged_broadcast_cat and its backward likewise (a copy and a segment sum), linear and its
    backward (on the GPU, gk.nn.MLP runs torch's cuBLAS Linear), and fm_compress_backward_accumulate,
    whose front door runs fm_compress_backward and an add elsewhere."""
    import torch

    import gem_kernels  # noqa: F401  (loads the extension's schemas)

    rows = {line.split("|")[1].strip().strip("`"): [c.strip() for c in line.split("|")[2:-1]]
            for line in gen["render"]().splitlines() if line.startswith("| `")}
    native = {name.removeprefix("gem_kernels::").removesuffix("_native") for name in torch._C._dispatch_get_all_op_names()
              if name.startswith("gem_kernels::") and name.endswith("_native")}
    assert native and native == set(rows)
    from gem_kernels._backend import FAMILIES

    from gem_kernels.ops import cached_attention, zch

    for family in (zch.FAMILY, cached_attention.FAMILY, FAMILIES["hstu_layer"]):
        assert set(family.implemented) == {"reference", "cpu", "cuda", "triton"}
    for op, (front, reference, triton, cpu, cuda) in rows.items():
        assert "—" not in (front, reference, cpu), op
        cpu_only = op.startswith("zch_embedding_bag") or op in ("hstu_sequence_layout", "jagged_broadcast_cat",
                                                               "jagged_broadcast_cat_backward", "linear",
                                                               "linear_backward", "fm_compress_backward_accumulate")
        assert ("—" in (triton, cuda)) == cpu_only, op

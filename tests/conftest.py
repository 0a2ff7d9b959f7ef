"""Test session set-up.

Without a GPU the Triton backend runs in Triton's CPU interpreter, which must be switched on before
any @triton.jit function is defined, i.e. before gem_kernels' Triton modules are imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _seed_every_test():
    """Every test starts from the same RNG state, so its data does not depend on which tests ran
    before it: a failure in the whole suite reproduces when the test runs alone, and adding a test
    cannot change another's inputs (it once moved fm_compress's accuracy test onto a rare draw)."""
    torch.manual_seed(0)

if os.environ.get("GK_CUDA_EMU") == "1":
    # Run the CUDA kernels' code on CPU tensors (tests/cuda_emu): it replaces gem_kernels._C's CPU
    # kernels for this process, so the `cpu` backend's tests test the CUDA kernels.
    import gem_kernels  # noqa: F401  (loads gem_kernels._C first, whose CPU kernels are replaced)
    from tests.cuda_emu import build as _cuda_emu

    _cuda_emu.load()


def pytest_terminal_summary(terminalreporter):
    """The bad-input fuzz's counts per outcome class (tests/test_fuzz.py), whether or not -s is given."""
    import sys

    fuzz = sys.modules.get("tests.test_fuzz")
    if fuzz is not None and fuzz.SUMMARY:
        terminalreporter.section("bad-input fuzz")
        for line in fuzz.SUMMARY:
            terminalreporter.write_line(line)

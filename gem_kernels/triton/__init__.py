"""Triton kernels and their launch wrappers, one module per op family.

Importing a module here imports triton. Set TRITON_INTERPRET=1 before that import to run the
kernels on CPU tensors (slow; for tests on machines without a GPU).
"""
from __future__ import annotations

import os

# Read once: Triton decides at @triton.jit definition time, and torch.compile traces constants.
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_interpret() -> bool:
    """Whether Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    return _TRITON_INTERPRET

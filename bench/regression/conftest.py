"""pytest-benchmark regression suite: one quick case per op and backend (see README.md here).

Not collected by `pytest` / `pytest tests` (pyproject's testpaths is tests/); run it by path."""

import os

import torch

if not torch.cuda.is_available():
    # Triton on the CPU interpreter is far too slow to time; its cases skip there (see test_ops.py).
    os.environ.setdefault("TRITON_INTERPRET", "0")

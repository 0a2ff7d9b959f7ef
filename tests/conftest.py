"""Test session set-up.

Without a GPU the Triton backend runs in Triton's CPU interpreter, which must be switched on before
any @triton.jit function is defined, i.e. before gem_kernels' Triton modules are imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.manual_seed(0)

"""Which native kernel set the `cpu` backend's Python paths assume (see _backend.native_kernels)."""
from __future__ import annotations

import contextlib
from typing import Iterator

from .. import _backend

set_native_cpu_kernels = _backend.set_native_cpu_kernels


@contextlib.contextmanager
def native_cpu_kernels(kind: str) -> Iterator[None]:
    """Within the block, the `cpu` backend's Python paths (checks before the call, fake kernels)
    behave as for the `kind` ("cpu" or "cuda") native kernels; the previous kind comes back after."""
    previous = set_native_cpu_kernels(kind)
    try:
        yield
    finally:
        set_native_cpu_kernels(previous)

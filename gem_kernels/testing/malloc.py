"""keep_freed_cpu_memory: glibc malloc keeps freed CPU tensor memory for reuse instead of giving it back.

Why: glibc returns the free top of its heap to the OS once it exceeds M_TRIM_THRESHOLD, and serves
blocks above M_MMAP_THRESHOLD with fresh maps; both thresholds move with the program's history. A
training step frees and reallocates the same multi-MiB activations every step, so whenever the heap
was trimmed the next step's first writes fault every 4 KiB page in again and the kernel zeroes it
(seen in the small model's step as 40 to 950 minor faults per step, 1 thread, and as a 1.1 <-> 2.4 ms
flip of the HSTU UVQK forward's thread time). Fixing the thresholds keeps the pages mapped: the
cost is memory that stays resident after a peak (the same trade PyTorch's CUDA caching allocator
makes). `python -m model.train` and `python -m bench` call this once at start (both sides of
every bench comparison run in that one process); a library import never does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# What `python -m model.train` and `python -m bench` keep by default (--malloc-keep-mib).
DEFAULT_KEEP_MIB = 1024

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest M_MMAP_THRESHOLD glibc accepts on 64-bit (HEAP_MAX_SIZE / 2); blocks above it stay maps.
_MMAP_THRESHOLD_MAX = 32 << 20


@functools.cache
def _mallopt():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        # gnu_get_libc_version exists in glibc only: musl's mallopt is a no-op stub.
        libc.gnu_get_libc_version
        return libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None


def keep_freed_cpu_memory(max_idle_mib: int) -> bool:
    """Keep up to `max_idle_mib` MiB of freed heap mapped (M_TRIM_THRESHOLD), and serve blocks up to
    32 MiB from the heap (M_MMAP_THRESHOLD). 0 leaves glibc's defaults. Returns whether the settings
    were applied (False off glibc, or for 0)."""
    if isinstance(max_idle_mib, bool) or not isinstance(max_idle_mib, int) or max_idle_mib < 0:
        raise ValueError(f"max_idle_mib must be an int >= 0, got {max_idle_mib!r}")
    mallopt = _mallopt()
    if max_idle_mib == 0 or mallopt is None:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    ok &= mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(min(max_idle_mib << 20, 2**31 - 1)).value)
    return bool(ok)

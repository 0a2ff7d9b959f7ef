"""gem_kernels benchmarks: ``python -m bench [FAMILY ...] [--quick] [--list] [--device cpu|cuda]
[--out DIR] [--repeats N]``.

One module per op family (bench/<family>.py, registered in bench/__main__.py FAMILIES) exposes

    def cases(quick: bool, device: torch.device) -> Iterator[bench.harness.Case]

a generator that builds each case's inputs lazily and yields a ``Case`` (op, shape, dtype, analytic
flops and minimum bytes from gem_kernels.flops, ``impls`` = zero-arg callables doing one iteration
each, the ``baseline`` impl the speedup divides by, the ``peak`` kind, optional ``notes``, and
either a ``reference`` impl every other impl's output must match before it is timed (fwd+bwd impls
return their gradients too; ``state`` readers add updated tables and optimizer state) or an
``unverified="why"`` reason; ``compiled`` names the torch.compile'd impls, primed on every input set
before timing; ``examples``, the examples one call processes, adds examples/s to the notes). Inputs are rotated (``harness.rotate``) so caches do not flatter. A family that
cannot run here raises ``harness.SkipFamily(reason)``.

A run measures the machine's peaks once (bench/peaks.py), times every impl of every case
(bench/harness.py), prints progress to stderr and the table to stdout, and writes
bench/results/<device>-<timestamp>.{json,md,png} (the png: a roofline of each case's gem_kernels impl
and best peer), <device>-<timestamp>-speedup.png (speedups per family) and latest-<device>.* copies
(bench/report.py; ``python -m bench.report RUN.json`` redraws the markdown and figures).

Reading the output: ``ms`` is the median of the timed repeats (p10-p90 shows the spread, ``n`` the
count; ``*`` marks an impl stopped by its time cap); compile_s is the untimed compile-and-prime time
of a compiled impl; GB/s (floor) and TFLOP/s divide the analytic floor of bytes / FLOPs by the median
time, GB/s (FBGEMM formula) FBGEMM's every-lookup bytes (embedding bags); % peak is relative to the
measured copy bandwidth ("bw", floor bytes) for data-movement ops or to the dtype's measured matmul
peak ("mm"); speedup = baseline ms / impl ms; verified names what the impl matched (or FAILED /
UNVERIFIED with why).
On CPU the impls of a case are timed interleaved (round-robin), so load from other processes hits all
alike, and faults/call counts minor page faults per call: glibc maps every block over 32 MiB afresh,
so an op returning a large tensor (a padded batch) pays a first-touch fault per page on every call,
the same for every impl; with 4 KiB pages on a VM that costs more than the copy itself. The bench
therefore sets PyTorch's THP_MEM_ALLOC_ENABLE=1 (transparent huge pages for large tensors, 512x
fewer faults) unless told ``--no-thp``, and keeps freed heap mapped for reuse
(``--malloc-keep-mib``, as ``python -m model.train``); the results record both.
"""

import os as _os
import tempfile as _tempfile
from pathlib import Path as _Path


def unwritable(out_dir) -> str | None:
    """Why results cannot be written into ``out_dir`` (created if missing), or None when they can.

    Checked by the CLIs before a run starts (a run takes minutes; its results must not be lost
    at the end to a typo or a read-only path). Imports nothing heavy: ``python -m bench`` calls it
    before torch is imported."""
    path = _Path(out_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = _tempfile.mkstemp(prefix=".write-check-", dir=path)
        _os.close(fd)
        _os.unlink(probe)
    except OSError as exc:
        return f"cannot write results there ({type(exc).__name__}: {exc.strerror or exc})"
    return None

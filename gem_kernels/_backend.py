"""Which backends exist on this machine, and which one an op call runs on.

Backends:
  reference  plain PyTorch (gem_kernels.reference.*), always available, any device
  cpu        the C++ kernels of gem_kernels._C, CPU tensors
  cuda       the CUDA kernels of gem_kernels._C, CUDA tensors
  triton     the Triton kernels, CUDA tensors (or CPU tensors under TRITON_INTERPRET=1)
  auto       the first available of the family's `auto_cuda` order for CUDA tensors (cuda > triton,
             attention triton > cuda), cpu > reference for CPU tensors; see FAMILIES

Dispatch in one place: FAMILIES lists each op family's backends, its `auto` preference and, as
written-out lazy imports, the modules of its Python kernels; `kernel()` looks ops up there.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from .triton import triton_interpret

BACKENDS = ("reference", "cpu", "cuda", "triton")
_CHOICES = BACKENDS + ("auto",)

try:
    _C = importlib.import_module("gem_kernels._C")
    _EXT_ERROR: str | None = None
except ImportError as exc:  # the reference and triton backends still work
    _C = None
    _EXT_ERROR = f"gem_kernels._C failed to import ({exc}); rebuild with `pip install --no-build-isolation -e .`"

try:
    import triton  # noqa: F401

    _TRITON_ERROR: str | None = None
except ImportError as exc:
    _TRITON_ERROR = f"triton is not installed ({exc})"


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name but cannot run here or on these tensors."""


_EXT_WITH_CUDA = _C is not None and bool(_C.with_cuda())


def ext_with_cuda() -> bool:
    """Whether gem_kernels._C holds the CUDA kernels."""
    return _EXT_WITH_CUDA


def unavailable_reason(name: str) -> str | None:
    """None when backend `name` can run on this machine, else why not."""
    if name == "reference":
        return None
    if name == "cpu":
        return _EXT_ERROR
    if name == "cuda":
        if _EXT_ERROR:
            return _EXT_ERROR
        if not _EXT_WITH_CUDA:
            return "gem_kernels._C was built without CUDA (no nvcc or CPU-only torch at build time, or GEM_KERNELS_CUDA=0)"
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        return None
    if name == "triton":
        if _TRITON_ERROR:
            return _TRITON_ERROR
        if not torch.cuda.is_available() and not triton_interpret():
            return "no CUDA device for Triton; set TRITON_INTERPRET=1 before importing gem_kernels to run it on the CPU"
        return None
    raise ValueError(f"backend must be one of {_CHOICES}, got {name!r}")


def available_backends() -> list[str]:
    """The backends that can run on this machine, in BACKENDS order."""
    return [name for name in BACKENDS if unavailable_reason(name) is None]


# The process-wide default; `use_backend` sets it. A plain global (not thread-local) so that
# torch.compile guards on it like any other global.
_default_backend = "auto"


def get_backend() -> str:
    return _default_backend


class use_backend:
    """Select the backend of every gem_kernels op that gets no `backend=` keyword.

    As a call it sets the process-wide default; as a context manager it restores the previous
    default on exit::

        gem_kernels.use_backend("cpu")                 # from now on
        with gem_kernels.use_backend("reference"):     # only inside the block
            ...
    """

    def __init__(self, name: str):
        global _default_backend
        if name not in _CHOICES:
            raise ValueError(f"backend must be one of {_CHOICES}, got {name!r}")
        if name != "auto":
            reason = unavailable_reason(name)
            if reason is not None:
                raise BackendUnavailableError(f"backend {name!r} is not available: {reason}")
        self._previous = _default_backend
        _default_backend = name

    def __enter__(self) -> "use_backend":
        return self

    def __exit__(self, *exc) -> None:
        global _default_backend
        _default_backend = self._previous


def resolve_backend(backend: str | None, device: torch.device, family: "str | Family") -> str:
    """The concrete backend an op of `family` (a FAMILIES key, or a Family) runs on for tensors on `device`.

    `backend` is the op's keyword (None: the `use_backend` default). `auto` takes the first
    available backend of the family's preference for the device (Family.auto_order). Raises
    BackendUnavailableError when a named backend cannot run here or on this device, or the family
    has no kernels for it; ValueError for an unknown name.
    """
    fam = FAMILIES[family] if isinstance(family, str) else family
    name = _default_backend if backend is None else backend
    if name not in _CHOICES:
        raise ValueError(f"backend must be one of {_CHOICES}, got {name!r}")
    if name == "auto":
        for candidate in fam.auto_order(device):
            if candidate in fam.implemented and unavailable_reason(candidate) is None:
                return candidate
        return "reference"
    if name not in fam.implemented:
        raise BackendUnavailableError(f"backend {name!r} does not implement this op (it has {fam.implemented})")
    reason = unavailable_reason(name)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is not available: {reason}")
    if name == "cpu" and device.type != "cpu":
        raise BackendUnavailableError(f"backend 'cpu' runs on CPU tensors, got tensors on {device}")
    if name == "cuda" and device.type != "cuda":
        raise BackendUnavailableError(f"backend 'cuda' runs on CUDA tensors, got tensors on {device}")
    if name == "triton" and device.type != "cuda" and not (device.type == "cpu" and triton_interpret()):
        raise BackendUnavailableError(
            f"backend 'triton' runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {device}"
        )
    return name


# The kernels behind the native schemas on CPU tensors: gem_kernels._C's C++ kernels ("cpu"), or
# the CUDA kernels ("cuda") once tests/cuda_emu has compiled them for its CPU emulation of CUDA and
# registered them in their place (GK_CUDA_EMU=1). Python code whose behaviour depends on which
# native kernel runs (what it checks before the call, what a fake returns) asks native_kernels().
_native_cpu_kernels = "cpu"


def set_native_cpu_kernels(kind: str) -> str:
    """Make the native schemas' CPU kernels count as `kind` ("cpu" or "cuda"); returns the previous kind.
    Only for code that has registered the CUDA kernels on CPU tensors (tests/cuda_emu): use
    gem_kernels.testing.native_cpu_kernels, which also restores the previous kind."""
    global _native_cpu_kernels
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"kind must be 'cpu' or 'cuda', got {kind!r}")
    previous, _native_cpu_kernels = _native_cpu_kernels, kind
    return previous


def native_kernels(backend: str) -> str:
    """Which kernel set a native backend runs: "cpu" or "cuda" ("cuda" for backend "cpu" under the
    CUDA emulation)."""
    return _native_cpu_kernels if backend == "cpu" else backend


# ---------------------------------------------------------------------------------------------
# The dispatch table. The Python kernels' modules are imported on first use (so that
# `import gem_kernels` needs neither triton nor the kernel modules) by the loaders below, written
# out import by import so that find-usages and import-graph tools follow each op to its kernels.
# ---------------------------------------------------------------------------------------------


def _reference_jagged() -> ModuleType:
    from .reference import jagged
    return jagged


def _triton_jagged() -> ModuleType:
    from .triton import jagged
    return jagged


def _reference_embedding_bag() -> ModuleType:
    from .reference import embedding_bag
    return embedding_bag


def _triton_embedding_bag() -> ModuleType:
    from .triton import embedding_bag
    return embedding_bag


def _reference_attention() -> ModuleType:
    from .reference import attention
    return attention


def _triton_attention() -> ModuleType:
    from .triton import attention
    return attention


def _reference_hstu_layer() -> ModuleType:
    from .reference import hstu_layer
    return hstu_layer


def _triton_hstu_layer() -> ModuleType:
    from .triton import hstu_layer
    return hstu_layer


def _reference_interaction() -> ModuleType:
    from .reference import interaction
    return interaction


def _triton_interaction() -> ModuleType:
    from .triton import interaction
    return interaction


@dataclass(frozen=True)
class Family:
    """One op family's backends.

    reference, triton: loaders of the modules whose function <op> runs op <op> on that backend.
    implemented: the backends with kernels for every op of the family.
    auto_cuda: `auto`'s order on CUDA tensors (the first available wins; reference is the last
    resort). On CPU tensors `auto` is always cpu > reference.
    """

    reference: Callable[[], ModuleType]
    triton: Callable[[], ModuleType]
    implemented: tuple[str, ...] = BACKENDS
    auto_cuda: tuple[str, ...] = ("cuda", "triton")

    def auto_order(self, device: torch.device) -> tuple[str, ...]:
        return self.auto_cuda if device.type == "cuda" else ("cpu",)

    def module(self, backend: str) -> ModuleType:
        if backend == "reference":
            return self.reference()
        if backend == "triton":
            return self.triton()
        raise ValueError(f"backend {backend!r} has no Python module (cpu and cuda run native schemas)")


FAMILIES: dict[str, Family] = {
    "jagged": Family(_reference_jagged, _triton_jagged),
    "embedding_bag": Family(_reference_embedding_bag, _triton_embedding_bag),
    # triton first: its tiles run on the tensor cores (tl.dot with bf16/fp16/tf32 operands), while the
    # cuda kernels are plain fp32 CUDA-core loops, so triton is the faster-expected path at every
    # shape; cuda runs when named, or under `auto` when triton is missing.
    "attention": Family(_reference_attention, _triton_attention, auto_cuda=("triton", "cuda")),
    "interaction": Family(_reference_interaction, _triton_interaction),
    # The HSTU layer's projection halves: triton first for the attention's reason (its GEMM tiles run
    # tl.dot on the tensor cores; the cuda kernels' tiles are fp32 CUDA-core loops).
    "hstu_layer": Family(_reference_hstu_layer, _triton_hstu_layer, auto_cuda=("triton", "cuda")),
}


# op -> torch.ops.gem_kernels.<op>_native: the packet torch's namespace holds for the process (the
# native schemas are defined once, in C++), looked up once: in isolation 0.31 -> 0.08 us a call.
_NATIVE_OPS: dict[str, object] = {}


def kernel(family: str, op: str, backend: str):
    """The function that runs `op` of `family` on a concrete backend.

    Every backend exposes the same signature: `cpu`/`cuda` as the native schema
    torch.ops.gem_kernels.<op>_native (CPU/CUDA dispatch keys), `reference`/`triton` as the
    function <op> of the family's module in FAMILIES.
    """
    if backend in ("cpu", "cuda"):
        native = _NATIVE_OPS.get(op)
        if native is None:
            native = _NATIVE_OPS[op] = getattr(torch.ops.gem_kernels, f"{op}_native")
        return native
    fn = getattr(FAMILIES[family].module(backend), op)
    return _on_device_of_inputs(fn) if backend == "triton" else fn


@functools.cache
def _on_device_of_inputs(fn):
    """`fn` run with its first CUDA tensor argument's device current.

    A Triton launch goes to the current device and its current stream, whatever device the pointers
    live on; with tensors on cuda:1 and cuda:0 current it would run on the wrong GPU (an illegal
    address without peer access). The CUDA kernels carry a CUDAGuard for the same reason."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.device.type == "cuda":
                with torch.cuda.device(a.device):
                    return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return run

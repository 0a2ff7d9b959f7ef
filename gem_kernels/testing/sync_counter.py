"""Count host syncs: the calls that make the host wait for the GPU.

On a GPU, ``torch.cuda.set_sync_debug_mode("warn")`` makes PyTorch warn at every synchronising
call (a device-to-host copy, a stream synchronize); the counter records those warnings.

On the CPU nothing waits, so the counter counts the calls that *would* sync with the same code on
CUDA tensors:
  - reading a value: ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)`` (aten._local_scalar_dense),
    ``torch.equal``, ``.tolist()``, ``.cpu()``, ``.numpy()``;
  - an output whose size depends on the data: ``nonzero``, ``masked_select``, ``unique``,
    ``repeat_interleave`` without ``output_size``, boolean-mask indexing;
  but not torch.optim's reads of its step counters, which stay on the CPU next to GPU parameters.
It watches every ATen op through a TorchDispatchMode, and steps into gem_kernels' Python custom ops
(whose bodies a dispatch mode would otherwise treat as one opaque call) so their checks count too.
Syncs inside C++ launchers are invisible to it; the GPU mode sees them.

    with SyncCounter() as syncs:
        train_step(model, batch, optimizer)
    print(syncs.count, syncs.by_kind)
"""

from __future__ import annotations

import collections
import sys
import warnings

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ATen ops whose CUDA kernels copy a value to the host before returning. Composite ops (item,
# is_nonzero, allclose) reach the mode undecomposed inside a custom op's body and decomposed (to
# _local_scalar_dense) elsewhere; the mode sees one level only, so each read counts once.
_SYNC_OPS = {
    aten._local_scalar_dense.default: "item",
    aten.item.default: "item",
    aten.is_nonzero.default: "item",
    aten.allclose.default: "item",
    aten.equal.default: "equal",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.bincount.default: "bincount",
}
# Tensor methods that read data without an ATen op on a CPU tensor (on a CUDA tensor: a copy to host).
_SYNC_METHODS = ("tolist", "cpu", "numpy")


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counter: "SyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _SYNC_OPS.get(func)
        if (kind is None and func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
                and kwargs.get("output_size") is None):
            kind = "repeat_interleave"
        if kind is None and func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                kind = "bool_index"
        if kind is not None and not _from_host_state():
            self.counter._add(kind, func.name())
        opdef = OPDEFS.get(func.name().split(".")[0]) if func.namespace == "gem_kernels" else None
        if opdef is not None:
            # A Python custom op: run its body under this mode, so that what it reads counts.
            impl = opdef._backend_fns.get(_device_type(args), opdef._init_fn)
            with self:
                return impl(*args, **kwargs)
        return func(*args, **kwargs)


def _from_host_state() -> bool:
    """Whether torch.optim is reading its own step counter: those live on the CPU whatever the
    parameters' device (capturable=False, the default), so reading them never waits for a GPU."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("torch.optim"):
            return True
        frame = frame.f_back
    return False


def _device_type(args) -> str | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return None


class SyncCounter:
    """Counts host syncs in a `with` block: ``count`` in all, ``by_kind`` {kind: n}, ``where``
    {kind: {op or caller: n}}.

    device: "cuda" records torch.cuda.set_sync_debug_mode warnings; "cpu" (the default without a
    GPU) counts the would-be syncs listed in this module's docstring.
    """

    def __init__(self, device: str | torch.device | None = None):
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.device_type = device.type
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.where: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._undo: list = []

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())

    def _add(self, kind: str, where: str) -> None:
        self.by_kind[kind] += 1
        self.where[kind][where] += 1

    def __enter__(self) -> "SyncCounter":
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            self._warnings = warnings.catch_warnings(record=True)
            self._records = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            return self
        self._mode = _DispatchCounter(self)
        self._mode.__enter__()
        for name in _SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, original))
            self._undo.append((name, original))
        return self

    def _counting(self, name, original):
        def method(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "?")
            if not caller.startswith("triton"):  # the Triton interpreter's own reads of kernel arguments
                self._add(name, caller)
            return original(tensor, *args, **kwargs)

        return method

    def __exit__(self, *exc) -> None:
        if self.device_type == "cuda":
            torch.cuda.set_sync_debug_mode(self._previous_mode)
            self._warnings.__exit__(*exc)
            for record in self._records:
                if "synchroniz" in str(record.message):
                    self._add("cuda_sync", f"{record.filename}:{record.lineno}")
            return
        for name, original in reversed(self._undo):
            setattr(torch.Tensor, name, original)
        self._undo.clear()
        self._mode.__exit__(*exc)

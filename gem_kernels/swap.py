"""``gem_kernels.swap``: put the fused kernels into a model that was built without them, in one call.

    report = gk.swap(model, optimizer=None, backend=None, include=None, exclude=None)
    print(report)

Module instances are replaced in place (``setattr`` on their parent); no class is ever patched, so
other models, models built later and the classes themselves are untouched (Liger-Kernel's issues
show what class-level patching costs). A replacement keeps its original's parameter values, dtype
and device and the same ``state_dict()`` keys, so checkpoints load both ways; most replacements hold
the very same Parameter objects (an optimizer built before the swap keeps working), the TorchRec
collections repack their tables into one buffer (build the optimizer after the swap). Swapping a
swapped model changes nothing.

What is swapped (exact types; a subclass is skipped with a reason, since its forward may differ):

- ``torch.nn.EmbeddingBag`` (mode sum/mean) -> ``gem_kernels.nn.EmbeddingBag``;
- ``torch.nn.MultiheadAttention`` -> ``gem_kernels.nn.MultiheadAttention`` (self-attention calls with
  an end-padding key_padding_mask and/or a causal mask run on the jagged rows, any other call runs
  the original computation and counts in ``report.fallbacks``);
- ``torch.nn.TransformerEncoderLayer`` -> ``gem_kernels.nn.TransformerEncoderLayer``: under the same
  masks (and no active dropout) the whole layer (attention, LayerNorms, feed-forward) runs on the
  valid rows only; its ``self_attn`` is swapped as above for the calls it hands on to torch;
- TorchRec (only when ``torchrec`` is already imported): ``EmbeddingBagCollection`` and
  ``EmbeddingCollection`` -> ``gem_kernels.torchrec.FusedEmbeddingBagCollection`` /
  ``FusedEmbeddingCollection``; DLRM's ``InteractionArch`` -> the fused dot interaction;
  ``CrossNet`` / ``LowRankCrossNet`` -> the fused cross layers;
- whatever else was ``register()``-ed (the package's ``model/`` registers its eager modules).

``optimizer`` (a ``gem_kernels.optim`` config) makes the replaced embedding modules update their
rows inside the backward, as TorchRec's fused path does: ``report.fused_parameters`` names the
parameters the user's optimizer must no longer hold (their ``.grad`` stays None).
"""

from __future__ import annotations

import fnmatch
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from .optim import OPTIMIZERS


class SwapSkip(Exception):
    """Raised by a converter that cannot replace this module; the message is the report's reason."""


Converter = Callable[..., nn.Module]
_CONVERTERS: dict[type, Converter] = {}


# Quantizing converters, used instead of _CONVERTERS by swap(quantize=...) on modules in eval mode.
_QUANTIZERS: dict[type, Callable[..., nn.Module]] = {}


def register(eager_type: type, convert: Converter, quantize: bool = False) -> None:
    """Swap every module of exactly ``eager_type`` with ``convert(module, *, optimizer, backend)``.

    ``convert`` returns the replacement (same parameter values, dtype, device and ``state_dict()``
    keys) or raises ``SwapSkip(reason)``. A later registration of the same type replaces the earlier.
    ``quantize=True`` registers ``convert(module, *, weight_dtype, backend)`` for ``swap(quantize=...)``
    instead, run on modules in eval mode.
    """
    if not isinstance(eager_type, type) or not issubclass(eager_type, nn.Module):
        raise TypeError(f"eager_type must be a torch.nn.Module subclass, got {eager_type!r}")
    if not callable(convert):
        raise TypeError(f"convert must be callable, got {convert!r}")
    (_QUANTIZERS if quantize else _CONVERTERS)[eager_type] = convert


@dataclass
class SwapReport:
    """What ``swap`` did. ``fallbacks`` counts, live, the calls of swapped attention modules that ran
    the original computation (``fallback_reasons`` by reason)."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    fused_parameters: list[str] = field(default_factory=list)
    _attention: list = field(default_factory=list, repr=False)

    @property
    def fallbacks(self) -> int:
        return sum(m.fallbacks for m in self._live_attention())

    @property
    def fallback_reasons(self) -> dict[str, int]:
        reasons: dict[str, int] = {}
        for m in self._live_attention():
            for why, n in m.fallback_reasons.items():
                reasons[why] = reasons.get(why, 0) + n
        return reasons

    def _live_attention(self) -> list:
        return [m for m in (ref() for ref in self._attention) if m is not None]

    def __str__(self) -> str:
        lines = [f"gem_kernels.swap: {len(self.replaced)} replaced, {len(self.skipped)} skipped"]
        if self.replaced:
            width = max(len(p) for p, _, _ in self.replaced)
            lines += [f"  {p:<{width}}  {old} -> {new}" for p, old, new in self.replaced]
        if self.skipped:
            lines.append("skipped:")
            width = max(len(p) for p, _, _ in self.skipped)
            lines += [f"  {p:<{width}}  {t}: {why}" for p, t, why in self.skipped]
        if self.fused_parameters:
            lines.append("updated inside the backward (leave them out of your optimizer): "
                         + ", ".join(self.fused_parameters))
        if self._attention:
            lines.append(f"attention fallbacks so far: {self.fallbacks}")
        return "\n".join(lines)


def _patterns(name: str, value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Iterable):
        value = tuple(value)
        if all(isinstance(v, str) for v in value):
            return value
    raise ValueError(f"{name} must be None, a string or a list of strings (type names or path globs), got {value!r}")


def _matches(patterns: tuple[str, ...], path: str, module: nn.Module) -> bool:
    """A module matches a pattern equal to its type name (bare or qualified), or a glob matching its
    path or the path of one of its ancestors."""
    cls = type(module)
    names = {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}
    parts = path.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(p in names or any(fnmatch.fnmatchcase(q, p) for q in prefixes) for p in patterns)


def _converter(module: nn.Module, quantize: str | None = None) -> tuple[Converter | None, type | None]:
    """(converter, registered type): exact type match, else the registered type it subclasses (no converter)."""
    cls = type(module)
    if quantize is not None and not module.training and cls in _QUANTIZERS:
        return (lambda m, *, optimizer, backend: _QUANTIZERS[cls](m, weight_dtype=quantize, backend=backend)), cls
    if cls in _CONVERTERS:
        return _CONVERTERS[cls], cls
    for base in cls.__mro__[1:]:
        if base in _CONVERTERS:
            return None, base
    return None, None


def swap(model: nn.Module, optimizer=None, backend: str | None = None, include=None, exclude=None,
         quantize: str | None = None) -> SwapReport:
    """Replace, in place, the modules of ``model`` that have a fused counterpart; return the report.

    Args:
        model: any ``nn.Module``; its submodules are replaced (the root itself cannot be, in place).
        optimizer: None (gradients flow to your optimizer as before; ``nn.EmbeddingBag(sparse=True)``
            still gets a sparse gradient) or a ``gem_kernels.optim`` config (ExactSGD,
            ExactRowwiseAdagrad, ExactAdam): the embedding modules then update in the backward.
        backend: the backend of the fused ops ("reference" | "cpu" | "cuda" | "triton" | "auto";
            None: ``use_backend``'s default at call time).
        include: only swap modules matching one of these type names or path globs (a path glob also
            matches the module's descendants, e.g. ``"sparse_arch"``, ``"*.self_attn"``).
        exclude: never swap modules matching these (and leave their descendants alone).
        quantize: None, or a weight dtype of ``gem_kernels.QuantizedEmbeddingBag`` ("int8", "int4",
            "int2", "fp16", "fp8"): modules in eval mode with a quantizing converter (``nn.EmbeddingBag``)
            become quantized inference modules (FBGEMM's row-wise rule) instead.

    Returns:
        SwapReport: ``replaced`` [(path, old type, new type)], ``skipped`` [(path, type, reason)],
        ``fused_parameters`` (names of parameters updated inside the backward), ``fallbacks``; its
        ``str()`` is a table.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, OPTIMIZERS):
        raise ValueError(f"optimizer must be None or a gem_kernels.optim config "
                         f"({', '.join(o.__name__ for o in OPTIMIZERS)}), got {optimizer!r}")
    if backend is not None and not isinstance(backend, str):
        raise ValueError(f"backend must be None or a backend name, got {backend!r}")
    if quantize is not None:
        from .ops.quant_embedding_bag import WEIGHT_TYPES

        if quantize not in WEIGHT_TYPES:
            raise ValueError(f"quantize must be None or one of {tuple(WEIGHT_TYPES)}, got {quantize!r}")
    include, exclude = _patterns("include", include), _patterns("exclude", exclude)
    if "torchrec" in sys.modules:
        _register_torchrec()
    report = SwapReport()
    done: dict[int, nn.Module] = {}  # a module shared at several paths is converted once

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = f"{prefix}.{name}" if prefix else name
            if id(child) in done:
                parent._modules[name] = done[id(child)]
                continue
            if exclude and _matches(exclude, path, child):
                if _converter(child)[1] is not None or _is_swapped(child):
                    report.skipped.append((path, type(child).__name__, "excluded"))
                continue
            if _is_swapped(child):
                report.skipped.append((path, type(child).__name__, "already swapped"))
                continue
            convert, registered = _converter(child, quantize)
            if registered is None:
                visit(child, path)
                continue
            if convert is None:
                report.skipped.append((path, type(child).__name__,
                                       f"subclass of {registered.__name__}: its forward may differ (register() it)"))
                visit(child, path)
                continue
            if include and not _matches(include, path, child):
                report.skipped.append((path, type(child).__name__, "not matched by include"))
                continue
            try:
                new = convert(child, optimizer=optimizer, backend=backend)
            except SwapSkip as exc:
                report.skipped.append((path, type(child).__name__, str(exc)))
                visit(child, path)
                continue
            new.train(child.training)
            _SWAPPED_TYPES.add(type(new))
            parent._modules[name] = new
            done[id(child)] = new
            report.replaced.append((path, type(child).__name__, _public_name(type(new))))
            visit(new, path)  # e.g. the self_attn of a swapped TransformerEncoderLayer

    if _converter(model)[1] is not None and not _is_swapped(model):
        report.skipped.append(("", type(model).__name__, "the root module cannot be replaced in place: "
                                                          "swap a module that holds it"))
    visit(model, "")
    for path, module in model.named_modules():
        if _is_swapped(module):
            names = getattr(module, "fused_parameter_names", lambda: [])()
            report.fused_parameters += [f"{path}.{n}" if path else n for n in names]
            if hasattr(module, "fallbacks"):
                report._attention.append(weakref.ref(module))
    return report


def _public_name(cls: type) -> str:
    """``gem_kernels.nn.EmbeddingBag`` rather than the defining submodule's path."""
    module = cls.__module__
    for package in ("gem_kernels.nn", "gem_kernels.torchrec"):
        if module.startswith(package + "."):
            module = package
    return f"{module}.{cls.__qualname__}"


_SWAPPED_TYPES: set[type] = set()  # the types swap() put in, so that a second swap leaves them be


def _is_swapped(module: nn.Module) -> bool:
    return type(module) in _SWAPPED_TYPES


def _mark(cls: type) -> type:
    _SWAPPED_TYPES.add(cls)
    return cls


# ---------------------------------------------------------------------------------------------
# torch.nn converters
# ---------------------------------------------------------------------------------------------


def _convert_embedding_bag(module: nn.EmbeddingBag, *, optimizer, backend) -> nn.Module:
    from .nn.embedding_bag import EmbeddingBag

    if module.mode not in ("sum", "mean"):
        raise SwapSkip(f"mode {module.mode!r}: the fused op pools by sum or mean only")
    if module.max_norm is not None:
        raise SwapSkip(f"max_norm={module.max_norm}: renormalising looked-up rows is not fused")
    if module.scale_grad_by_freq:
        raise SwapSkip("scale_grad_by_freq=True is not fused")
    if module.weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise SwapSkip(f"weight dtype {module.weight.dtype}: the fused op takes float32/float16/bfloat16")
    if not module.weight.is_contiguous():
        raise SwapSkip("weight is not contiguous")
    return EmbeddingBag.from_torch(module, optimizer=optimizer, backend=backend)


def _convert_multihead_attention(module: nn.MultiheadAttention, *, optimizer, backend) -> nn.Module:
    from .nn.attention import MultiheadAttention

    if not module.batch_first:
        raise SwapSkip("batch_first=False")
    if not module._qkv_same_embed_dim:
        raise SwapSkip("kdim/vdim differ from embed_dim (not self-attention)")
    if module.bias_k is not None or module.add_zero_attn:
        raise SwapSkip("add_bias_kv or add_zero_attn")
    return MultiheadAttention.from_torch(module, backend=backend)


def _convert_transformer_encoder_layer(module: nn.TransformerEncoderLayer, *, optimizer, backend) -> nn.Module:
    from .nn.attention import TransformerEncoderLayer

    attn = module.self_attn
    if type(attn) is nn.MultiheadAttention:
        try:
            _convert_multihead_attention(attn, optimizer=optimizer, backend=backend)
        except SwapSkip as exc:
            raise SwapSkip(f"its self_attn: {exc}") from exc
    return TransformerEncoderLayer.from_torch(module, backend=backend)


def _register_builtin() -> None:
    from .nn.attention import MultiheadAttention, TransformerEncoderLayer
    from .nn.embedding_bag import EmbeddingBag

    _mark(EmbeddingBag)
    _mark(MultiheadAttention)
    _mark(TransformerEncoderLayer)
    register(nn.EmbeddingBag, _convert_embedding_bag)
    register(nn.MultiheadAttention, _convert_multihead_attention)
    register(nn.TransformerEncoderLayer, _convert_transformer_encoder_layer)


_register_builtin()


# ---------------------------------------------------------------------------------------------
# TorchRec converters: registered at the first swap() after torchrec was imported (by the model
# being swapped), so gem_kernels itself never imports torchrec.
# ---------------------------------------------------------------------------------------------

_TORCHREC_REGISTERED = False


@_mark
class FusedInteractionArch(nn.Module):
    """TorchRec DLRM ``InteractionArch`` on the fused dot interaction: the same output
    ``cat(dense, <x_i, x_j> for i < j over [dense, sparse_1..F])`` in ``triu_indices(F+1, F+1, 1)`` order."""

    def __init__(self, num_sparse_features: int, backend: str | None = None):
        super().__init__()
        self.F = num_sparse_features
        self.backend = backend

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        from .ops.interaction import dot_interaction

        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        return torch.cat((dense_features, dot_interaction(combined, False, backend=self.backend)), dim=1)


@_mark
class FusedCrossNet(nn.Module):
    """TorchRec ``CrossNet`` (full rank: ``kernels`` [N, N], ``bias`` [N, 1]) on fused cross layers;
    holds the original's ParameterLists (same state_dict keys, same Parameters)."""

    def __init__(self, kernels: nn.ParameterList, bias: nn.ParameterList, backend: str | None = None):
        super().__init__()
        self._num_layers = len(kernels)
        self.kernels, self.bias, self.backend = kernels, bias, backend

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from .ops.interaction import cross_layer

        x_l = input
        for layer in range(self._num_layers):
            x_l = cross_layer(input, x_l, self.kernels[layer], self.bias[layer].view(-1), backend=self.backend)
        return x_l


@_mark
class FusedLowRankCrossNet(nn.Module):
    """TorchRec ``LowRankCrossNet`` (``W_kernels`` [N, r], ``V_kernels`` [r, N], ``bias`` [N]) on fused
    cross layers: ``x_{l+1} = x_0 * (W (V x_l) + b) + x_l``."""

    def __init__(self, W_kernels: nn.ParameterList, V_kernels: nn.ParameterList, bias: nn.ParameterList,
                 backend: str | None = None):
        super().__init__()
        self._num_layers = len(W_kernels)
        self._low_rank = W_kernels[0].shape[1] if len(W_kernels) else 0
        self.W_kernels, self.V_kernels, self.bias, self.backend = W_kernels, V_kernels, bias, backend

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from .ops.interaction import cross_layer

        x_l = input
        for layer in range(self._num_layers):
            x_l = cross_layer(input, x_l, (self.W_kernels[layer], self.V_kernels[layer]), self.bias[layer],
                              backend=self.backend)
        return x_l


def _float_params(module: nn.Module) -> None:
    for name, p in module.named_parameters():
        if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise SwapSkip(f"parameter {name} has dtype {p.dtype}; the fused ops take float32/float16/bfloat16")


def _convert_interaction_arch(module, *, optimizer, backend) -> nn.Module:
    return FusedInteractionArch(module.F, backend=backend)


def _convert_crossnet(module, *, optimizer, backend) -> nn.Module:
    _float_params(module)
    return FusedCrossNet(module.kernels, module.bias, backend=backend)


def _convert_low_rank_crossnet(module, *, optimizer, backend) -> nn.Module:
    _float_params(module)
    if module._num_layers < 1:
        raise SwapSkip("no layers")
    return FusedLowRankCrossNet(module.W_kernels, module.V_kernels, module.bias, backend=backend)


def _torchrec_collections():
    try:
        from . import torchrec as gk_torchrec

        return gk_torchrec.FusedEmbeddingBagCollection, gk_torchrec.FusedEmbeddingCollection
    except (ImportError, AttributeError) as exc:
        raise SwapSkip(f"gem_kernels.torchrec is not available here ({type(exc).__name__}: {exc})") from exc


def _convert_ebc(module, *, optimizer, backend) -> nn.Module:
    fused_ebc, _ = _torchrec_collections()
    try:
        return fused_ebc.from_torchrec(module, optimizer=optimizer, backend=backend)
    except (ValueError, NotImplementedError) as exc:
        raise SwapSkip(str(exc)) from exc


def _convert_ec(module, *, optimizer, backend) -> nn.Module:
    _, fused_ec = _torchrec_collections()
    try:
        return fused_ec.from_torchrec(module, optimizer=optimizer, backend=backend)
    except (ValueError, NotImplementedError) as exc:
        raise SwapSkip(str(exc)) from exc


def _register_torchrec() -> None:
    global _TORCHREC_REGISTERED
    if _TORCHREC_REGISTERED:
        return
    _TORCHREC_REGISTERED = True
    from torchrec.models.dlrm import InteractionArch
    from torchrec.modules.crossnet import CrossNet, LowRankCrossNet
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    for eager_type, convert in ((EmbeddingBagCollection, _convert_ebc), (EmbeddingCollection, _convert_ec),
                                (InteractionArch, _convert_interaction_arch), (CrossNet, _convert_crossnet),
                                (LowRankCrossNet, _convert_low_rank_crossnet)):
        _CONVERTERS.setdefault(eager_type, convert)  # a user's own registration wins
    try:
        fused_ebc, fused_ec = _torchrec_collections()
        _mark(fused_ebc)
        _mark(fused_ec)
    except SwapSkip:
        pass

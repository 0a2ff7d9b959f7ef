"""``gem_kernels.swap``: put the fused kernels into a model that was built without them, in one call.

(This module is private: ``gem_kernels.swap`` is the function; ``register``, ``SwapSkip`` and
``SwapReport`` are ``gem_kernels.register`` / ``gem_kernels.SwapSkip`` / ``gem_kernels.SwapReport``.)

    report = gk.swap(model, optimizer=None, backend=None, include=None, exclude=None)
    print(report)

Module instances are replaced in place (``setattr`` on their parent); no class is ever patched, so
other models, models built later and the classes themselves are untouched (Liger-Kernel's issues
show what class-level patching costs). A replacement keeps its original's parameter values, dtype
and device and the same ``state_dict()`` keys, so checkpoints load both ways; most replacements hold
the very same Parameter objects (an optimizer built before the swap keeps working), the TorchRec
collections repack their tables into one buffer: build the optimizer after the swap, or hand the
one built before to ``swap(model, optimizer=torch_optimizer)``, which puts the packed buffer in the
param group that held the tables (one packed buffer per group where the groups split a collection's
tables, state carried over). Swapping a swapped model changes nothing.

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
  ``FusedEmbeddingCollection`` (``PartitionedEmbeddingBagCollection`` / ``PartitionedEmbeddingCollection``,
  one fused collection per param group, where a torch optimizer's groups split the tables); DLRM's ``InteractionArch`` -> the fused dot interaction;
  ``CrossNet`` / ``LowRankCrossNet`` -> the fused cross layers;
- whatever else was ``register()``-ed (the package's ``model/`` registers its eager modules).

``optimizer`` (a ``gem_kernels.optim`` config) makes the replaced embedding modules update their
rows inside the backward, as TorchRec's fused path does: ``report.fused_parameters`` names the
parameters the user's optimizer must no longer hold (their ``.grad`` stays None). A
``torch.optim.Optimizer`` instead is rewired: see ``swap``.

Frozen tables (``requires_grad=False``) stay frozen: the replacement's parameter keeps the flag and
a fused optimizer never updates it. When ``auto`` (or the default backend) resolves to the
``reference`` backend (the extension is not built), ``report.notes`` says so and a one-time
RuntimeWarning is raised: the swapped model then runs plain PyTorch, not fused kernels.

Every replacement traces with ``torch.fx`` / ``torchrec.fx.symbolic_trace`` (as one call node) and
refuses ``torch.jit.script`` with a message naming ``torch.export``.
"""

from __future__ import annotations

import copy
import fnmatch
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ._validate import FLOAT_DTYPES
from .nn.embedding_bag import check_backend, reference_fallback
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
    A replacement that packs several Parameters into one, with state_dict views of their names into
    it, can define ``split_by_keys(parts)`` (see ``swap``'s torch optimizer).
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
    """What ``swap`` did. ``fallbacks`` counts, live, the calls of swapped attention modules and
    TransformerEncoderLayers that ran the original computation (``fallback_reasons`` by reason);
    ``notes`` says what the user should know about how the replacements run (e.g. the reference
    backend standing in for an unbuilt extension)."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    fused_parameters: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
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
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _patterns(name: str, value) -> tuple[str, ...] | None:
    """None (no filter) or the patterns; an empty list is a filter that matches nothing."""
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Iterable) and not isinstance(value, Mapping):  # a dict would give its keys only
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
            still gets a sparse gradient), a ``gem_kernels.optim`` config (ExactSGD,
            ExactRowwiseAdagrad, ExactAdam): the embedding modules then update in the backward, or
            your ``torch.optim.Optimizer`` to rewire (below).
        backend: the backend of the fused ops ("reference" | "cpu" | "cuda" | "triton" | "auto";
            None: ``use_backend``'s default at call time).
        include: only swap modules matching one of these type names or path globs (a path glob also
            matches the module's descendants, e.g. ``"sparse_arch"``, ``"*.self_attn"``).
        exclude: never swap modules matching these (and leave their descendants alone).
        quantize: None, or a weight dtype of ``gem_kernels.QuantizedEmbeddingBag`` ("int8", "int4",
            "int2", "fp16", "fp8"): modules in eval mode with a quantizing converter (``nn.EmbeddingBag``)
            become quantized inference modules (FBGEMM's row-wise rule) instead.

    A ``torch.optim.Optimizer`` as ``optimizer`` (one built before the swap, the usual order in
    training scripts, stepped or not) is rewired in place: the modules swap with optimizer=None, and
    where a replacement repacks Parameters the optimizer held (the TorchRec collections' per-table
    weights) the packed Parameter takes their place in their param group, keeping the group's
    settings, and their state (momentum_buffer, Adagrad's sum, Adam's moments: each table's rows
    in its place in the packed state; scalars such as ``step``). Where the groups split a
    collection's tables (per-table lr, weight decay on some tables, tables left out of the
    optimizer), or tables hold state that cannot share one Parameter (another ``step``), the
    collection becomes a ``gem_kernels.torchrec.PartitionedEmbeddingBagCollection`` /
    ``PartitionedEmbeddingCollection``: one fused collection, one packed Parameter, per group, the
    same outputs and state_dict keys (one fused call per part). Refused (ValueError, the model and
    the optimizer left as they were): optimizer state of another shape than the table's or a scalar
    (e.g. a per-row accumulator), optimizers that update by a Parameter's 2-D shape (Adafactor, Muon),
    and a registered replacement that packs Parameters of different groups but has no
    ``split_by_keys(parts)``. The packed state follows each table by its state_dict key, which must
    be a view into the packed Parameter; a replacement without such views (the ZCH collection) takes
    its tables' one group and untouched initial state only.

    Returns:
        SwapReport: ``replaced`` [(path, old type, new type)], ``skipped`` [(path, type, reason)],
        ``fused_parameters`` (names of parameters updated inside the backward), ``fallbacks``; its
        ``str()`` is a table.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    torch_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    if torch_optimizer is not None:
        optimizer = None
    if optimizer is not None and not isinstance(optimizer, OPTIMIZERS):
        raise ValueError(f"optimizer must be None, a gem_kernels.optim config "
                         f"({', '.join(o.__name__ for o in OPTIMIZERS)}) or a torch.optim.Optimizer, got {optimizer!r}")
    check_backend(backend)
    if quantize is not None:
        from .ops.quant_embedding_bag import WEIGHT_TYPES

        if quantize not in WEIGHT_TYPES:
            raise ValueError(f"quantize must be None or one of {tuple(WEIGHT_TYPES)}, got {quantize!r}")
    include, exclude = _patterns("include", include), _patterns("exclude", exclude)
    if "torchrec" in sys.modules:
        _register_torchrec()
    report = SwapReport()
    done: dict[int, nn.Module] = {}  # a module shared at several paths is converted once
    replacements: list[tuple[nn.Module, nn.Module]] = []
    undo: list[tuple[nn.Module, str, nn.Module]] = []

    group_of = _param_groups(torch_optimizer) if torch_optimizer is not None else {}

    def visit(parent: nn.Module, prefix: str, fresh: bool = False) -> None:
        """``fresh``: ``parent`` is a replacement just put in (its swapped children are its own parts)."""
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = f"{prefix}.{name}" if prefix else name
            if id(child) in done:
                parent._modules[name] = done[id(child)]
                undo.append((parent, name, child))
                continue
            if exclude is not None and _matches(exclude, path, child):
                if _converter(child)[1] is not None or _is_swapped(child):
                    report.skipped.append((path, type(child).__name__, "excluded"))
                continue
            if _is_swapped(child):
                if not fresh:
                    report.skipped.append((path, type(child).__name__, "already swapped"))
                continue
            convert, registered = _converter(child, quantize)
            if registered is None:
                visit(child, path, fresh)
                continue
            if convert is None:
                report.skipped.append((path, type(child).__name__,
                                       f"subclass of {registered.__name__}: its forward may differ (register() it)"))
                visit(child, path)
                continue
            if include is not None and not _matches(include, path, child):
                report.skipped.append((path, type(child).__name__, "not matched by include"))
                visit(child, path)  # a filter selects: a child of an unmatched module may match
                continue
            try:
                new = convert(child, optimizer=optimizer, backend=backend)
            except SwapSkip as exc:
                report.skipped.append((path, type(child).__name__, str(exc)))
                visit(child, path)
                continue
            if not isinstance(new, nn.Module):
                raise TypeError(f"the converter registered for {registered.__name__} ({convert!r}) returned "
                                f"{type(new).__name__} for {path!r}; it must return an nn.Module or raise SwapSkip")
            if torch_optimizer is not None:
                new = _split_by_optimizer(torch_optimizer, group_of, child, new)
            new.train(child.training)
            _SWAPPED_TYPES.add(type(new))
            parent._modules[name] = new
            undo.append((parent, name, child))
            done[id(child)] = new
            report.replaced.append((path, type(child).__name__, _public_name(type(new))))
            replacements.append((child, new))
            visit(new, path, fresh=True)  # e.g. the self_attn of a swapped TransformerEncoderLayer

    if _converter(model)[1] is not None and not _is_swapped(model):
        report.skipped.append(("", type(model).__name__, "the root module cannot be replaced in place: "
                                                          "swap a module that holds it"))
    try:
        visit(model, "")
        plan = _rewire_plan(torch_optimizer, replacements) if torch_optimizer is not None else []
    except ValueError:
        for parent, name, child in reversed(undo):  # refused: the model is left as it was
            parent._modules[name] = child
        raise
    if torch_optimizer is not None:
        _rewire(torch_optimizer, plan)
    for path, module in model.named_modules():
        if _is_swapped(module):
            names = getattr(module, "fused_parameter_names", lambda: [])()
            for name in names:  # a swapped module and its swapped parts (Partitioned*) name the same
                name = f"{path}.{name}" if path else name
                if name not in report.fused_parameters:
                    report.fused_parameters.append(name)
            if hasattr(module, "fallbacks"):
                report._attention.append(weakref.ref(module))
    _note_reference_backend(report, model, backend)
    return report


def _note_reference_backend(report: SwapReport, model: nn.Module, backend: str | None) -> None:
    """``report.notes`` (and the one-time warning) when the replacements run on the reference backend."""
    if not report.replaced:
        return
    devices = {p.device for p in model.parameters()} or {torch.device("cpu")}
    for device in sorted(devices, key=str):
        for family in ("embedding_bag", "attention", "interaction"):
            message = reference_fallback(backend, device, family)
            if message is not None and message not in report.notes:
                report.notes.append(message)


# torch optimizers whose update depends on a Parameter's shape (factored or orthogonalised 2-D
# updates): a table packed into a flat Parameter would train differently under them.
_SHAPE_DEPENDENT = tuple(getattr(torch.optim, n) for n in ("Adafactor", "Muon") if hasattr(torch.optim, n))


def _param_groups(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(Parameter) -> the index of the param group that holds it."""
    return {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}


def _sources(old: nn.Module, new: nn.Module) -> dict[int, tuple[nn.Parameter, list]] | None:
    """Where the Parameters of ``old`` that ``new`` repacks went, each followed by its name (the
    swap keeps state_dict keys): {id(new Parameter): (it, [(name, old Parameter, its [rows, dim] view
    in the new one)])}; {} when ``new`` repacks nothing, None when a repacked Parameter has no view
    of its name in ``new`` (a replacement that moves elements, e.g. the ZCH collection's rows)."""
    new_params = {id(p): p for p in new.parameters()}
    dropped = [(n, p) for n, p in old.named_parameters() if id(p) not in new_params]
    if not dropped:
        return {}
    views = new.state_dict(keep_vars=True)
    sources: dict[int, tuple[nn.Parameter, list]] = {}
    for name, p in dropped:
        view = views.get(name)
        base = getattr(view, "_base", None)
        if base is None or id(base) not in new_params or view.shape != p.shape:
            return None
        sources.setdefault(id(base), (base, []))[1].append((name, p, view))
    return sources


def _part_key(optimizer: torch.optim.Optimizer, group_of: dict[int, int], p: nn.Parameter, owner: str) -> tuple:
    """Parameters of equal keys can share one packed Parameter: the same param group (None: not in
    the optimizer) and state that packs, i.e. the same keys, elementwise tensors (shaped like the
    Parameter: Adagrad's sum, Adam's exp_avg, momentum_buffer) and equal scalars (Adam's step).
    ValueError for state of another shape, which has no packed form."""
    signature = []
    for key, value in sorted((optimizer.state.get(p) or {}).items()):
        if isinstance(value, torch.Tensor) and value.shape == p.shape:
            signature.append((key, "elementwise", value.dtype, value.device))
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            signature.append((key, "scalar", value.dtype, value.device, value.item()))
        elif isinstance(value, torch.Tensor):
            raise ValueError(f"{type(optimizer).__name__} holds state {key!r} of shape {tuple(value.shape)} for a "
                             f"table of shape {tuple(p.shape)} of a {owner}: only state shaped like the table, or "
                             f"scalars, can be packed; build the optimizer after gk.swap")
        else:
            signature.append((key, "value", repr(value)))
    return group_of.get(id(p)), tuple(signature)


def _split_by_optimizer(optimizer: torch.optim.Optimizer, group_of: dict[int, int], old: nn.Module,
                        new: nn.Module) -> nn.Module:
    """``new``, or, where the optimizer puts Parameters that ``new`` packs into one in param groups of
    their own (per-table lr, weight decay...) or holds state that cannot share one Parameter,
    ``new.split_by_keys(parts)``: one packed Parameter per part. ValueError if ``new`` cannot split."""
    sources = _sources(old, new)
    if not sources:
        return new
    if isinstance(optimizer, _SHAPE_DEPENDENT) and any(id(p) in group_of for _, pairs in sources.values()
                                                        for _, p, _ in pairs):
        raise ValueError(f"optimizer {type(optimizer).__name__} updates a Parameter by its 2-D shape; the swap packs "
                         f"the tables of a {type(old).__name__} into a flat Parameter, which it would train "
                         f"differently: leave the module out (gk.swap(..., exclude=...)) or use an elementwise "
                         f"optimizer (SGD, Adagrad, Adam, ...)")
    parts, split = [], False
    for _, pairs in sources.values():
        by_key: dict[tuple, list[str]] = {}
        for name, p, _ in pairs:
            by_key.setdefault(_part_key(optimizer, group_of, p, type(old).__name__), []).append(name)
        parts += by_key.values()
        split |= len(by_key) > 1
    if not split:
        return new
    if not hasattr(new, "split_by_keys"):
        raise ValueError(f"optimizer puts parameters of a {type(old).__name__} that its replacement "
                         f"{type(new).__name__} packs into one Parameter in different param groups or with different "
                         f"state ({parts}), and {type(new).__name__} cannot split them: use one group for them, or "
                         f"build the optimizer after gk.swap")
    return new.split_by_keys(parts)


def _rewire_plan(optimizer: torch.optim.Optimizer, replacements) -> list[tuple[int, list, list, dict | None]]:
    """[(param group, the Parameters a replacement dropped, the ones it added, the added one's
    optimizer state)] for the replacements whose Parameters the optimizer holds. A packed Parameter
    (one per param group after ``_split_by_optimizer``) takes its tables' state, packed like them."""
    group_of = _param_groups(optimizer)
    plan = []
    for old, new in replacements:
        sources = _sources(old, new)
        if sources is None:
            plan += _opaque_plan(optimizer, group_of, old, new)
            continue
        for base, pairs in sources.values():
            g = group_of.get(id(pairs[0][1]))
            if g is not None:
                plan.append((g, [p for _, p, _ in pairs], [base], _packed_state(optimizer, base, pairs)))
    return plan


def _packed_state(optimizer: torch.optim.Optimizer, base: nn.Parameter, pairs: list) -> dict | None:
    """The state of the packed ``base`` from its tables' (of one part key): elementwise tensors
    copied into each table's place, scalars taken once."""
    states = [optimizer.state.get(p) for _, p, _ in pairs]
    if not states[0]:
        return None
    packed = {}
    for key, first in states[0].items():
        if isinstance(first, torch.Tensor) and first.shape == pairs[0][1].shape:
            value = torch.zeros(base.shape, dtype=first.dtype, device=first.device)
            for (_, _, view), state in zip(pairs, states):
                value.as_strided(view.shape, view.stride(), view.storage_offset() - base.storage_offset()).copy_(
                    state[key])
        else:
            value = first.clone() if isinstance(first, torch.Tensor) else copy.deepcopy(first)
        packed[key] = value
    return packed


def _opaque_plan(optimizer: torch.optim.Optimizer, group_of: dict[int, int], old: nn.Module,
                 new: nn.Module) -> list[tuple[int, list, list, dict | None]]:
    """The plan for a replacement whose new Parameters do not show where each old one went: all of
    them take the one param group of the old ones, with untouched initial state only."""
    old_params, new_params = list(old.parameters()), list(new.parameters())
    new_ids, old_ids = {id(p) for p in new_params}, {id(p) for p in old_params}
    dropped = [p for p in old_params if id(p) not in new_ids]
    held = [p for p in dropped if id(p) in group_of]
    if not held:
        return []
    name = type(old).__name__
    if len(held) != len(dropped):
        raise ValueError(f"optimizer holds {len(held)} of the {len(dropped)} parameters of a {name} that the swap "
                         f"repacks into one buffer: put all of them in the optimizer or none")
    groups = sorted({group_of[id(p)] for p in held})
    settings = [{k: v for k, v in optimizer.param_groups[g].items() if k != "params"} for g in groups]
    if any(repr(s) != repr(settings[0]) for s in settings):
        raise ValueError(f"optimizer puts the tables of a {name} in param groups {groups} with different settings "
                         f"{settings}; the swap packs them into one Parameter, which takes one group's settings: "
                         f"use one group for them, or build the optimizer after gk.swap")
    added = [p for p in new_params if id(p) not in old_ids]
    return [(groups[0], held, added, _initial_state(optimizer, held, added, name))]


def _initial_state(optimizer: torch.optim.Optimizer, held: list, added: list, name: str) -> dict | None:
    """The state the added Parameter starts with: None where the optimizer holds none for ``held``,
    else the same untouched initial state (e.g. Adagrad's accumulator at initial_accumulator_value,
    step 0) over the added Parameter's shape. State after a step cannot be repacked: ValueError."""
    states = [optimizer.state.get(p) or {} for p in held]
    if not any(states):
        return None
    stepped = ValueError(f"optimizer already holds state after a step for the tables of a {name}; the packed "
                         f"Parameter cannot take per-table state over: swap before the first step, or build the "
                         f"optimizer after gk.swap")
    if len(added) != 1 or any(s.keys() != states[0].keys() for s in states):
        raise stepped
    new = {}
    for key, first in states[0].items():
        values = [s[key] for s in states]
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise stepped
        fills = {float(v.reshape(-1)[0]) for v in values if v.numel()}
        if len(fills) > 1 or any(v.numel() and not bool((v == v.reshape(-1)[0]).all()) for v in values):
            raise stepped
        if key == "step" and fills - {0.0}:
            raise stepped
        fill = fills.pop() if fills else 0.0
        new[key] = (torch.full_like(added[0], fill, dtype=first.dtype, memory_format=torch.preserve_format)
                    if first.shape == held[0].shape else first.clone())
    return new


def _rewire(optimizer: torch.optim.Optimizer, plan) -> None:
    """Each replacement's new Parameters go into the group that held the ones it dropped, in their place."""
    for g, held, added, state in plan:
        held_ids = {id(p) for p in held}
        for p in held:
            optimizer.state.pop(p, None)
        if state is not None:
            optimizer.state[added[0]] = state
        for i, group in enumerate(optimizer.param_groups):
            params = group["params"]
            if i == g:
                at = next(k for k, p in enumerate(params) if id(p) in held_ids)
                params[at:at] = added
            group["params"] = [p for p in params if id(p) not in held_ids]



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
    if module.weight.dtype not in FLOAT_DTYPES:
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
    from .nn.interaction import FusedCrossNet, FusedInteractionArch, FusedLowRankCrossNet

    for fused in (EmbeddingBag, MultiheadAttention, TransformerEncoderLayer, FusedInteractionArch, FusedCrossNet,
                  FusedLowRankCrossNet):
        _mark(fused)
    register(nn.EmbeddingBag, _convert_embedding_bag)
    register(nn.MultiheadAttention, _convert_multihead_attention)
    register(nn.TransformerEncoderLayer, _convert_transformer_encoder_layer)


_register_builtin()


# ---------------------------------------------------------------------------------------------
# TorchRec converters: registered at the first swap() after torchrec was imported (by the model
# being swapped), so gem_kernels itself never imports torchrec.
# ---------------------------------------------------------------------------------------------

_TORCHREC_REGISTERED = False


def _float_params(module: nn.Module) -> None:
    for name, p in module.named_parameters():
        if p.dtype not in FLOAT_DTYPES:
            raise SwapSkip(f"parameter {name} has dtype {p.dtype}; the fused ops take float32/float16/bfloat16")


def _convert_interaction_arch(module, *, optimizer, backend) -> nn.Module:
    from .nn.interaction import FusedInteractionArch

    return FusedInteractionArch(module.F, backend=backend)


def _convert_crossnet(module, *, optimizer, backend) -> nn.Module:
    from .nn.interaction import FusedCrossNet

    _float_params(module)
    return FusedCrossNet(module.kernels, module.bias, backend=backend)


def _convert_low_rank_crossnet(module, *, optimizer, backend) -> nn.Module:
    from .nn.interaction import FusedLowRankCrossNet

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
        collections = _torchrec_collections()
        from .torchrec import PartitionedEmbeddingBagCollection, PartitionedEmbeddingCollection

        for swapped in (*collections, PartitionedEmbeddingBagCollection, PartitionedEmbeddingCollection):
            _mark(swapped)
    except SwapSkip:
        pass

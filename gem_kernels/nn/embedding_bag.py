"""``FusedEmbeddingBag``: T embedding tables in one packed buffer, looked up in one call (FBGEMM TBE)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .. import _backend
from .._validate import FLOAT_DTYPES, INT64_MAX, check_int64
from ..ops.embedding_bag import FAMILY, embedding_bag, embedding_bag_per_sample_weights_backward_op
from .._embedding_bag import (POOLING_CODES, SUM, TableLayout, TableMeta, advise_huge_pages, check_module_options,
                              pack_tables)
from ._fx import NotScriptable, is_proxy, trace_call


def check_backend(backend) -> None:
    """At construction (not at the first forward): None or one of the backend names."""
    if backend is not None and backend not in _backend._CHOICES:
        raise ValueError(f"backend must be None or one of {_backend._CHOICES}, got {backend!r}")


_REFERENCE_WARNED = False


def reference_fallback(backend: str | None, device, family: str) -> str | None:
    """Why ``auto`` (asked for, or the default) runs ``family`` on the reference backend (plain PyTorch,
    not fused) for tensors on ``device``; None when it does not. Warns once per process: a fused
    module that silently runs the reference is a slow surprise."""
    global _REFERENCE_WARNED
    name = _backend.get_backend() if backend is None else backend
    device = torch.device(device if device is not None else "cpu")
    if name != "auto" or device.type == "meta":
        return None
    if _backend.resolve_backend("auto", device, family) != "reference":
        return None
    reasons = [f"{b}: {_backend.unavailable_reason(b)}" for b in _backend.FAMILIES[family].auto_order(device)
               if _backend.unavailable_reason(b) is not None]
    message = (f"backend 'auto' runs the {family} ops on the 'reference' backend (plain PyTorch, not the fused "
               f"kernels) for {device.type} tensors ({'; '.join(reasons) or 'no fused backend implements it'})")
    if not _REFERENCE_WARNED:
        _REFERENCE_WARNED = True
        warnings.warn(f"gem_kernels: {message}", RuntimeWarning, stacklevel=3)
    return message


def torch_bags(input, offsets, per_sample_weights, include_last_offset: bool):
    """torch.nn.EmbeddingBag's call convention -> (indices [L], offsets [B+1] in indices' dtype,
    per_sample_weights [L] or None): a 2-D input [B, L] is one bag per row (offsets must be None); a
    1-D input takes 1-D offsets of the B bag starts, or of B+1 bounds with include_last_offset."""
    if not isinstance(input, torch.Tensor) or input.dim() not in (1, 2):
        raise ValueError(f"input must be a 1-D or 2-D tensor of ids, got "
                         f"{tuple(input.shape) if isinstance(input, torch.Tensor) else type(input).__name__}")
    if per_sample_weights is not None and per_sample_weights.shape != input.shape:
        raise ValueError(f"per_sample_weights must have input's shape {tuple(input.shape)}, got "
                         f"{tuple(per_sample_weights.shape)}")
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("offsets must be None with a 2-D input (each row is one bag)")
        batch, length = input.shape
        offsets = torch.arange(batch + 1, dtype=input.dtype, device=input.device) * length
        return input.reshape(-1), offsets, None if per_sample_weights is None else per_sample_weights.reshape(-1)
    if offsets is None or offsets.dim() != 1:
        raise ValueError(f"offsets must be a 1-D tensor with a 1-D input, got "
                         f"{None if offsets is None else tuple(offsets.shape)}")
    offsets = offsets.to(input.dtype)
    if not include_last_offset:
        offsets = torch.cat([offsets, offsets.new_full((1,), input.shape[0])])
    return input, offsets, per_sample_weights


class PackedTables(NotScriptable, nn.Module):
    """A module whose tables are packed in one buffer: ``layout`` (a ``TableLayout``: Python ints, to
    slice and size buffers by) and ``table_meta`` (its tensors for the op, held as non-persistent
    buffers so that ``.to()`` moves them).

    The fused optimizer's state (``momentum1``, ``momentum2``: fp32, packed like the rows or the
    weights; ``step``) has one API on every such module: ``optimizer_state_dict()`` /
    ``load_optimizer_state_dict()``; the state carries its tables' names and shapes, so a load checks
    the layout (and, for the same tables in another order, follows each table by name). It stays fp32 through ``.half()`` / ``.to(dtype)``, and a module
    built on the meta device is materialised by ``to_empty()`` with its layout rebuilt and its
    optimizer state zero.
    """

    def _set_layout(self, layout: TableLayout, device) -> None:
        self.layout = layout
        for name, value in layout.meta(device)._asdict().items():
            self.register_buffer(name, value, persistent=False)

    @property
    def table_meta(self) -> TableMeta:
        return TableMeta(*(getattr(self, name) for name in TableMeta._fields))

    def _state_table_names(self) -> list[str]:
        """The name of each packed table, in layout order (the keys of the optimizer state)."""
        raise NotImplementedError

    def _register_optimizer_state(self, optimizer, device, *, persistent: bool) -> None:
        """The buffers ``momentum1`` / ``momentum2`` (fp32, sized by the layout for ``optimizer``) and
        ``step`` (int64 scalar), all zero; the momenta get huge-page advice before their first touch."""
        size1, size2 = self.layout.state_sizes(optimizer.name if optimizer is not None else None)
        for name, size in (("momentum1", size1), ("momentum2", size2)):
            buffer = torch.empty(size, dtype=torch.float32, device=device)
            advise_huge_pages(buffer)
            self.register_buffer(name, buffer.zero_(), persistent=persistent)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device), persistent=persistent)

    def _apply(self, fn, recurse=True):
        state = {n: self._buffers[n] for n in ("momentum1", "momentum2") if self._buffers.get(n) is not None}
        was_meta = self.weights_offsets.is_meta
        super()._apply(fn, recurse)
        device = self.weights_offsets.device
        # The layout's tensors are facts of the Python layout: after to_empty() they would hold
        # uninitialised memory, so they are rebuilt on every move.
        for name, value in self.layout.meta(device)._asdict().items():
            self._buffers[name] = value
        for name, old in state.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:  # .half() / .to(dtype): the state stays fp32, values kept
                self._buffers[name] = (new.float() if old.is_meta else old.to(device=new.device, dtype=torch.float32))
        if was_meta and device.type != "meta":
            with torch.no_grad():
                for name in ("momentum1", "momentum2", "step"):
                    self._buffers[name].zero_()
        return self

    def optimizer_state_dict(self) -> dict:
        """The fused optimizer's state: ``optimizer`` (its name or None), ``tables`` [(name, rows, dim)]
        (the layout the packed state follows), ``momentum1`` / ``momentum2`` (fp32, packed like the
        rows (row-wise Adagrad) or the weights (Adam)) and ``step``. Copies, on the module's device."""
        return {"optimizer": self.optimizer.name if self.optimizer is not None else None,
                "tables": [(n, r, d) for n, r, d in zip(self._state_table_names(), self.layout.rows, self.layout.dims)],
                "momentum1": self.momentum1.clone(), "momentum2": self.momentum2.clone(), "step": self.step.clone()}

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Load what ``optimizer_state_dict()`` gave (of this module, or of one with the same tables in
        another order: the state follows each table by name)."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be the dict of optimizer_state_dict(), got {type(state).__name__}")
        missing = [k for k in ("momentum1", "momentum2", "step") if k not in state]
        if missing:
            raise ValueError(f"state is missing the keys {missing} (it has {sorted(state)})")
        mine = self.optimizer.name if self.optimizer is not None else None
        if "optimizer" in state and state["optimizer"] != mine:
            raise ValueError(f"state is of optimizer {state['optimizer']!r}, this module's is {mine!r}")
        for key in ("momentum1", "momentum2", "step"):
            if not isinstance(state[key], torch.Tensor):
                raise TypeError(f"state[{key!r}] must be a tensor, got {type(state[key]).__name__}")
        momentum1, momentum2 = state["momentum1"], state["momentum2"]
        tables = [(n, r, d) for n, r, d in zip(self._state_table_names(), self.layout.rows, self.layout.dims)]
        theirs = [tuple(t) for t in state.get("tables", tables)]
        if theirs != tables:
            momentum1, momentum2 = self._reorder_state(theirs, tables, momentum1, momentum2)
        with torch.no_grad():
            for key, value in (("momentum1", momentum1), ("momentum2", momentum2), ("step", state["step"])):
                target = getattr(self, key)
                if value.shape != target.shape:
                    raise ValueError(f"{key} must have shape {tuple(target.shape)}, got {tuple(value.shape)}")
                target.copy_(value)

    def _reorder_state(self, theirs, tables, momentum1, momentum2):
        """The packed state of tables ``theirs`` rearranged into this module's table order."""
        if sorted(theirs) != sorted(tables):
            raise ValueError(f"state is of the tables {theirs} [(name, rows, dim)], this module has {tables}")
        src = pack_tables([r for _, r, _ in theirs], [d for _, _, d in theirs])
        index = {n: t for t, (n, _, _) in enumerate(theirs)}
        out = []
        for flat in (momentum1, momentum2):
            if flat.numel() == 0:
                out.append(flat)
            elif flat.numel() == src.num_rows:  # one value per row
                out.append(torch.cat([flat[src.rows_offsets[index[n]]:src.rows_offsets[index[n] + 1]]
                                      for n, _, _ in tables]))
            elif flat.numel() == src.num_elements:  # one value per weight element
                out.append(torch.cat([src.table(flat, index[n]).reshape(-1) for n, _, _ in tables]))
            else:
                raise ValueError(f"state has {flat.numel()} values per momentum; tables {theirs} have "
                                 f"{src.num_rows} rows and {src.num_elements} elements")
        return out[0], out[1]


@dataclass(frozen=True)
class TableSpec:
    """One table: ``num_embeddings`` rows of ``embedding_dim`` features."""

    num_embeddings: int
    embedding_dim: int

    def __post_init__(self):
        for name in ("num_embeddings", "embedding_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
            check_int64(name, value)
        if self.num_embeddings * self.embedding_dim > INT64_MAX:
            raise ValueError(f"num_embeddings * embedding_dim is out of range: {self.num_embeddings} * "
                             f"{self.embedding_dim} elements do not fit in int64")


class FusedEmbeddingBag(PackedTables):
    """T embedding bags in one packed weight buffer, with an optional optimizer fused into the backward.

    ``out = ebc(indices, offsets, per_sample_weights=None)``: indices [N] int32/int64 local to their
    table; offsets [T*B+1] (feature-major: bag b of table t is ``indices[offsets[t*B+b]:offsets[t*B+b+1]]``).
    Output [B, sum_t D_t] (tables concatenated in order) for pooling "sum"/"mean", [N, D] for "none"
    (every table of dim D); ``per_sample_weights`` [N] (any pooling; mean = weighted sum / length) receive a gradient when they
    require one. See ``gem_kernels.ops.embedding_bag.embedding_bag`` for the exact semantics.

    ``optimizer=None``: ``self.weights`` is an ``nn.Parameter`` that receives a dense gradient, so any
    torch optimizer works. With a ``gem_kernels.optim`` config the backward updates the touched rows
    in place (duplicates summed first, one update per row) and ``self.weights.grad`` stays None.
    The optimizer state (``momentum1``, ``momentum2``, ``step``) is in ``state_dict()``.
    """

    def __init__(self, tables: list[TableSpec], pooling: str = "sum", dtype: torch.dtype = torch.float32,
                 device=None, optimizer=None, bounds_check: str = "fatal", backend: str | None = None):
        super().__init__()
        tables = list(tables)
        if not tables or not all(isinstance(t, TableSpec) for t in tables):
            raise ValueError(f"tables must be a non-empty list of TableSpec, got {tables!r}")
        if pooling not in POOLING_CODES:
            raise ValueError(f"pooling must be one of {tuple(POOLING_CODES)}, got {pooling!r}")
        check_module_options(optimizer, bounds_check)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
        check_backend(backend)
        dims = [t.embedding_dim for t in tables]
        if pooling == "none" and len(set(dims)) != 1:
            raise ValueError(f"pooling 'none' needs every table to have the same embedding_dim, got {dims}")
        self.tables = tables
        self.pooling, self.bounds_check, self.optimizer, self.backend = pooling, bounds_check, optimizer, backend
        self._set_layout(pack_tables([t.num_embeddings for t in tables], dims), device)
        self.output_dim = self.layout.output_dim(pooled=pooling != "none")
        self.weights = nn.Parameter(torch.empty(self.layout.num_elements, dtype=dtype, device=device))
        advise_huge_pages(self.weights)
        self._register_optimizer_state(optimizer, device, persistent=True)
        reference_fallback(backend, device, "embedding_bag")
        self.reset_parameters()

    def _state_table_names(self) -> list[str]:
        return [f"table{t}" for t in range(len(self.tables))]

    def reset_parameters(self) -> None:
        """N(0, 1) like ``nn.EmbeddingBag``; optimizer state to zero."""
        with torch.no_grad():
            nn.init.normal_(self.weights)
            self.momentum1.zero_()
            self.momentum2.zero_()
            self.step.zero_()

    @property
    def num_tables(self) -> int:
        return len(self.tables)

    def weight(self, t: int) -> torch.Tensor:
        """Table t as a [rows_t, D_t] view into the packed buffer (writes go to the module's weights)."""
        return self.layout.table(self.weights, t)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if is_proxy(indices, offsets, per_sample_weights):
            return trace_call(self, indices, offsets, per_sample_weights)
        return embedding_bag(self.weights, self.table_meta, indices, offsets, per_sample_weights,
                             output_dim=self.output_dim, pooling=self.pooling, bounds_check=self.bounds_check,
                             optimizer=self.optimizer if self.weights.requires_grad else None, momentum1=self.momentum1, momentum2=self.momentum2,
                             step=self.step, backend=self.backend)

    @classmethod
    def from_embedding_bags(cls, bags: list[nn.EmbeddingBag], optimizer=None, bounds_check: str = "fatal",
                            backend: str | None = None) -> "FusedEmbeddingBag":
        """One module holding copies of the weights of ``bags`` (same mode, dtype and device)."""
        bags = list(bags)
        if not bags or not all(isinstance(b, nn.EmbeddingBag) for b in bags):
            raise ValueError("bags must be a non-empty list of torch.nn.EmbeddingBag")
        modes = {b.mode for b in bags}
        if len(modes) != 1 or next(iter(modes)) not in ("sum", "mean"):
            raise ValueError(f"bags must share one mode, 'sum' or 'mean', got {sorted(modes)}")
        dtypes = {b.weight.dtype for b in bags}
        devices = {b.weight.device for b in bags}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"bags must share one dtype and device, got {dtypes} and {devices}")
        if any(b.max_norm is not None or b.padding_idx is not None for b in bags):
            raise ValueError("bags with max_norm or padding_idx are not supported")
        tables = [TableSpec(b.num_embeddings, b.embedding_dim) for b in bags]
        module = cls(tables, pooling=next(iter(modes)), dtype=next(iter(dtypes)), device=next(iter(devices)),
                     optimizer=optimizer, bounds_check=bounds_check, backend=backend)
        with torch.no_grad():
            for t, bag in enumerate(bags):
                module.weight(t).copy_(bag.weight)
        return module

    def extra_repr(self) -> str:
        dims = sorted({t.embedding_dim for t in self.tables})
        return (f"num_tables={self.num_tables}, rows={self.layout.num_rows}, dims={dims}, "
                f"pooling={self.pooling!r}, dtype={self.weights.dtype}, optimizer={self.optimizer}, "
                f"bounds_check={self.bounds_check!r}")


class _SparseGradEmbeddingBag(torch.autograd.Function):
    """The fused forward with the backward of ``nn.EmbeddingBag(sparse=True)``: a sparse COO gradient
    of the [rows, D] weight (one row per lookup, duplicates left uncoalesced, as torch gives it)."""

    @staticmethod
    def forward(ctx, weight, indices, offsets, per_sample_weights, module):
        with torch.no_grad():
            out = module._lookup(weight.detach(), indices, offsets, per_sample_weights)
        if per_sample_weights is None:
            per_sample_weights = weight.new_empty(0)
        ctx.save_for_backward(weight, indices, offsets, per_sample_weights, *module.table_meta)
        ctx.mean = module.mode == "mean"
        ctx.backend = _backend.resolve_backend(module.backend, weight.device, FAMILY)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, indices, offsets, per_sample_weights, *meta = ctx.saved_tensors
        lengths = offsets.diff()
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=indices.device), lengths,
                                      output_size=indices.numel())
        rows = grad_out[bag]
        scale = None
        if ctx.mean:
            scale = (1.0 / lengths.clamp(min=1).to(grad_out.dtype))[bag]
        elif per_sample_weights.numel():
            scale = per_sample_weights.to(grad_out.dtype)
        grad_psw = None
        if ctx.needs_input_grad[3]:  # per_sample_weights come with mode "sum" only
            grad_psw = embedding_bag_per_sample_weights_backward_op(
                grad_out.contiguous(), weight.view(-1), *meta, indices, offsets, SUM, ctx.backend).to(per_sample_weights.dtype)
        if scale is not None:
            rows = rows * scale.unsqueeze(1)
        grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_weight = torch.sparse_coo_tensor(indices.long().unsqueeze(0), rows.to(weight.dtype), weight.shape,
                                                  check_invariants=False)
        return grad_weight, None, None, grad_psw, None


class EmbeddingBag(PackedTables):
    """Drop-in for ``torch.nn.EmbeddingBag`` on the fused embedding-bag op (one table).

    Same constructor and call signature (``forward(input, offsets=None, per_sample_weights=None)``:
    1-D ``input`` with ``offsets``, or 2-D ``input`` [B, L] of fixed-length bags), the same ``.weight``
    [num_embeddings, embedding_dim] Parameter and ``state_dict()`` keys. Modes "sum" and "mean";
    ``per_sample_weights`` with "sum"; ``include_last_offset``; ``padding_idx`` (those lookups are
    left out of their bag and of its mean, and the row gets no gradient, as in torch).
    ``sparse=True`` (and no fused optimizer) gives ``weight`` a sparse COO gradient like torch's.
    Not supported (ValueError): mode "max", ``max_norm``, ``scale_grad_by_freq``.

    Keyword-only extras: ``optimizer`` (a ``gem_kernels.optim`` config: the backward updates the
    looked-up rows in place and ``weight.grad`` stays None; the state, e.g. row-wise Adagrad's
    ``momentum1``, is in non-persistent buffers so that ``state_dict()`` keys stay torch's: save it with
    ``optimizer_state_dict()``, restore it with ``load_optimizer_state_dict()``),
    ``bounds_check`` ("fatal": an out-of-range id raises IndexError) and ``backend``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean", sparse: bool = False,
                 _weight: torch.Tensor | None = None, include_last_offset: bool = False,
                 padding_idx: int | None = None, device=None, dtype=None, *, optimizer=None,
                 bounds_check: str = "fatal", backend: str | None = None):
        super().__init__()
        TableSpec(num_embeddings, embedding_dim)  # checks both
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean' (the fused op has no 'max'), got {mode!r}")
        if max_norm is not None:
            raise ValueError(f"max_norm must be None (renormalising rows in the lookup is not fused), got {max_norm}")
        if scale_grad_by_freq:
            raise ValueError("scale_grad_by_freq must be False, got True")
        check_module_options(optimizer, bounds_check)
        check_backend(backend)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be within [-{num_embeddings}, {num_embeddings}), got {padding_idx}")
            padding_idx = padding_idx % num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.max_norm, self.norm_type, self.scale_grad_by_freq = max_norm, norm_type, scale_grad_by_freq
        self.mode, self.sparse, self.include_last_offset, self.padding_idx = mode, sparse, include_last_offset, padding_idx
        self.optimizer, self.bounds_check, self.backend = optimizer, bounds_check, backend
        if _weight is None:
            self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
            self.reset_parameters()
        else:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"_weight must have shape {(num_embeddings, embedding_dim)}, got {tuple(_weight.shape)}")
            self.weight = _weight if isinstance(_weight, nn.Parameter) else nn.Parameter(_weight)
        if self.weight.dtype not in FLOAT_DTYPES:
            raise ValueError(f"weight dtype must be one of {FLOAT_DTYPES}, got {self.weight.dtype}")
        if not self.weight.is_contiguous():
            raise ValueError(f"weight must be contiguous (the fused update writes it in place), got stride "
                             f"{self.weight.stride()}")
        self._set_layout(pack_tables([num_embeddings], [embedding_dim]), self.weight.device)
        self._register_optimizer_state(optimizer, self.weight.device, persistent=False)
        reference_fallback(backend, self.weight.device, "embedding_bag")

    def _state_table_names(self) -> list[str]:
        return ["weight"]

    def reset_parameters(self) -> None:
        """N(0, 1) like ``nn.EmbeddingBag``, the padding row zero."""
        with torch.no_grad():
            nn.init.normal_(self.weight)
            if self.padding_idx is not None:
                self.weight[self.padding_idx].zero_()

    @classmethod
    def from_torch(cls, bag: nn.EmbeddingBag, optimizer=None, bounds_check: str = "fatal",
                   backend: str | None = None) -> "EmbeddingBag":
        """The fused twin of ``bag``, holding the very same ``weight`` Parameter (so an optimizer built on
        ``bag.parameters()`` keeps working when ``optimizer`` is None)."""
        return cls(bag.num_embeddings, bag.embedding_dim, max_norm=bag.max_norm, norm_type=bag.norm_type,
                   scale_grad_by_freq=bag.scale_grad_by_freq, mode=bag.mode, sparse=bag.sparse, _weight=bag.weight,
                   include_last_offset=bag.include_last_offset, padding_idx=bag.padding_idx, optimizer=optimizer,
                   bounds_check=bounds_check, backend=backend)

    def fused_parameter_names(self) -> list[str]:
        """Parameters updated inside the backward (their ``.grad`` stays None)."""
        return ["weight"] if self.optimizer is not None else []

    def _lookup(self, weight: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None) -> torch.Tensor:
        # A frozen weight (requires_grad False) is never updated, whatever else needs a gradient.
        return embedding_bag(weight.view(-1), self.table_meta, indices, offsets, per_sample_weights,
                             output_dim=self.embedding_dim, pooling=self.mode, bounds_check=self.bounds_check,
                             optimizer=self.optimizer if self.weight.requires_grad else None, momentum1=self.momentum1, momentum2=self.momentum2,
                             step=self.step, backend=self.backend)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if is_proxy(input, offsets, per_sample_weights):
            return trace_call(self, input, offsets, per_sample_weights)
        if per_sample_weights is not None and self.mode != "sum":
            raise ValueError(f"per_sample_weights are only supported with mode 'sum', got mode {self.mode!r}")
        user_offsets = offsets
        indices, offsets, per_sample_weights = torch_bags(input, offsets, per_sample_weights, self.include_last_offset)
        if self.padding_idx is not None:
            keep = indices != self.padding_idx
            kept_before = torch.cat([keep.new_zeros(1, dtype=offsets.dtype), keep.cumsum(0).to(offsets.dtype)])
            offsets = kept_before[offsets.long()]
            indices = indices[keep]
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights[keep]
        try:
            if self.sparse and self.optimizer is None and torch.is_grad_enabled() and self.weight.requires_grad:
                return _SparseGradEmbeddingBag.apply(self.weight, indices, offsets, per_sample_weights, self)
            return self._lookup(self.weight, indices, offsets, per_sample_weights)
        except ValueError:
            # The op saw the offsets with input's length appended; name what the user passed, as torch does.
            if input.dim() == 1 and not self.include_last_offset and user_offsets.numel():
                last = int(user_offsets[-1])
                if last > input.shape[0]:
                    raise ValueError(f"offsets[-1] = {last} is greater than input's length {input.shape[0]}") from None
            raise

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}"
        for name in ("sparse", "include_last_offset"):
            if getattr(self, name):
                s += f", {name}=True"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.optimizer is not None:
            s += f", optimizer={self.optimizer}"
        return s

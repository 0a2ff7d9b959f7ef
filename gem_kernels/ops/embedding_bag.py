"""Fused multi-table embedding bags (TBE): the front door (validation, torch.library ops, fakes, autograd).

Packed layout (FBGEMM TBE): T tables back to back in one flat ``weights`` buffer, described by the
three int64 tensors of a ``TableMeta`` (gem_kernels/_embedding_bag.py; ``pack_tables`` builds them).
Bag b of table t is ``indices[offsets[t*B+b] : offsets[t*B+b+1]]`` (feature-major, TorchRec KJT).

The forward op is differentiable w.r.t. ``weights`` and ``per_sample_weights``
(``embedding_bag_per_sample_weights_backward``). With ``optimizer="none"`` its backward returns
the dense gradient of the flat buffer; with a fused optimizer the backward applies the update in
place to ``weights`` and the optimizer state (``embedding_bag_backward_fused``, which mutates them)
and returns no gradient, like FBGEMM's TBE.
"""

from __future__ import annotations

import weakref

import torch

from .._autograd import register_autograd
from .._backend import FAMILIES, kernel, native_kernels, resolve_backend
from .._validate import (FLOAT_DTYPES, INDEX_DTYPES, check_nonnegative_int, check_offsets_meta, check_offsets_values,
                         check_same_device, check_tensor, per_sample_weights_arg)
from .._embedding_bag import (
    BOUNDS_CHECK_CODES,
    NONE,
    OPT_NONE,
    OPT_ROWWISE_ADAGRAD,
    OPTIMIZER_CODES,
    POOLING_CODES,
    SKIP,
    TableMeta,
    kept_mask,
)

FAMILY = "embedding_bag"
IMPLEMENTED = FAMILIES[FAMILY].implemented


def _output_shape(indices: torch.Tensor, offsets: torch.Tensor, num_tables: int, output_dim: int,
                  pooling: int) -> tuple:
    if pooling == NONE:
        return (indices.shape[0], output_dim)
    return ((offsets.shape[0] - 1) // num_tables if num_tables else 0, output_dim)


# check_tables' passes, by id of the weights_offsets tensor (a weak reference to it confirms the id;
# the entry goes with the tensor): a module passes the same metadata tensors at every call, so their
# values are read once, and again after any of them changes (its version counter or storage) or a
# size or option of the call does.
_TABLES_CHECKED: dict[int, tuple] = {}


def check_tables(weights: torch.Tensor, meta: TableMeta, output_dim: int, pooling: int, momentum1: torch.Tensor,
                 optimizer: int) -> None:
    """Data checks of the table metadata (ValueError naming the table and the values): every table
    has D_t >= 1 and rows_t >= 1 and lies inside ``weights`` without overlapping another (a GPU
    kernel updates each row from one program, so aliased tables would race); output_dim matches
    D_offsets; row-wise Adagrad's momentum1 has rows_offsets[-1] elements.

    Reads the 3T+2 metadata values in one copy (one device sync on GPU, beside offsets' own), once per
    metadata and sizes (_TABLES_CHECKED; in isolation 6.8 -> 2.1 us a call on the CPU): called inside the
    ops' real kernels only, never while tracing."""
    first, second, third = meta
    try:
        key = (first._version, second._version, third._version, first.data_ptr(), second.data_ptr(),
               third.data_ptr(), weights.numel(), output_dim, pooling, momentum1.numel(), optimizer)
    except RuntimeError:  # inference tensors have no version counter: checked at every call
        key = None
    checked = _TABLES_CHECKED.get(id(first))
    if (checked is not None and checked[0]() is first and checked[1] is second and checked[2] is third
            and checked[3] == key):
        return
    _check_tables(weights, meta, output_dim, pooling, momentum1, optimizer)
    if key is not None:
        ident = id(first)
        _TABLES_CHECKED[ident] = (weakref.ref(first, lambda _: _TABLES_CHECKED.pop(ident, None)), second, third, key)


def _check_tables(weights: torch.Tensor, meta: TableMeta, output_dim: int, pooling: int, momentum1: torch.Tensor,
                  optimizer: int) -> None:
    num_tables = meta.weights_offsets.numel()
    values = torch.cat(meta).tolist()
    w_off, d_off, r_off = values[:num_tables], values[num_tables:2 * num_tables + 1], values[2 * num_tables + 1:]
    if d_off[0] != 0 or r_off[0] != 0:
        raise ValueError(f"D_offsets[0] and rows_offsets[0] must be 0, got {d_off[0]} and {r_off[0]}")
    extents = []
    for t, start in enumerate(w_off):
        dim, rows = d_off[t + 1] - d_off[t], r_off[t + 1] - r_off[t]
        if dim < 1 or rows < 1:
            raise ValueError(f"table {t} must have D >= 1 and rows >= 1, got D = {dim} (D_offsets) and rows = {rows} "
                             f"(rows_offsets)")
        if start < 0 or start + rows * dim > weights.numel():
            raise ValueError(f"table {t} ({rows} x {dim} at weights_offsets[{t}] = {start}) does not fit in weights "
                             f"of {weights.numel()} elements")
        extents.append((start, start + rows * dim, t))
    extents.sort()
    for (_, end, t), (start, _, u) in zip(extents, extents[1:]):
        if start < end:
            raise ValueError(f"tables {t} and {u} overlap in weights (weights_offsets {w_off[t]} and {w_off[u]})")
    if pooling == NONE:
        dims = {d_off[t + 1] - d_off[t] for t in range(len(w_off))}
        if dims != {output_dim}:
            raise ValueError(f"pooling 'none' needs every table's D equal to output_dim {output_dim}, got D "
                             f"{sorted(dims)}")
    elif d_off[-1] != output_dim:
        raise ValueError(f"output_dim must equal D_offsets[-1] = {d_off[-1]} for pooled output, got {output_dim}")
    if optimizer == OPT_ROWWISE_ADAGRAD and momentum1.numel() != r_off[-1]:
        raise ValueError(f"momentum1 must have rows_offsets[-1] = {r_off[-1]} elements for rowwise_adagrad, got "
                         f"{momentum1.numel()}")


# ---------------------------------------------------------------------------------------------
# torch.library ops. `backend` is a concrete backend name, resolved by the public function below.
# pooling, bounds_check and optimizer are the integer codes of gem_kernels/_embedding_bag.py.
# per_sample_weights is an empty tensor when absent.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("gem_kernels::embedding_bag", mutates_args=())
def embedding_bag_op(weights: torch.Tensor, momentum1: torch.Tensor, momentum2: torch.Tensor, step: torch.Tensor,
                     weights_offsets: torch.Tensor, D_offsets: torch.Tensor, rows_offsets: torch.Tensor,
                     indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor, output_dim: int,
                     pooling: int, bounds_check: int, optimizer: int, lr: float, eps: float, beta1: float,
                     beta2: float, weight_decay: float, backend: str) -> torch.Tensor:
    """Forward. The optimizer state and scalars are inputs only so that the backward can reach them."""
    meta = TableMeta(weights_offsets, D_offsets, rows_offsets)
    check_tables(weights, meta, output_dim, pooling, momentum1, optimizer)
    native = native_kernels(backend)
    if native != "cpu":  # the C++ kernel checks them itself, same messages, without the ATen-op overhead
        check_offsets_values("offsets", offsets, indices.shape[0])
    if native == "cuda" and bounds_check != SKIP:  # the CUDA kernel only drops bad indices: raise/warn here
        kept_mask(rows_offsets, indices, offsets, bounds_check)
    return kernel(FAMILY, "embedding_bag_forward", backend)(weights, *meta, indices, offsets, per_sample_weights,
                                                            output_dim, pooling, bounds_check)


# Fake kernels: one per op, registered below each custom op and again for its native schema
# (csrc/ops.cpp), whose arguments are the custom op's without `backend` (and, for the forward,
# without the optimizer's). They read shapes only, so they name the arguments up to the last they need.
def _forward_fake(weights, weights_offsets, D_offsets, rows_offsets, indices, offsets, per_sample_weights,
                  output_dim, pooling, *_):
    return weights.new_empty(_output_shape(indices, offsets, weights_offsets.shape[0], output_dim, pooling))


def _backward_fake(grad_output, weights, *_):
    return weights.new_empty(weights.shape)


def _backward_fused_fake(*_):
    return None


def _per_sample_weights_backward_fake(grad_output, weights, weights_offsets, D_offsets, rows_offsets, indices, *_):
    return weights.new_empty(indices.shape, dtype=torch.float32)


@embedding_bag_op.register_fake
def _embedding_bag_fake(weights, momentum1, momentum2, step, *rest):
    return _forward_fake(weights, *rest)


@torch.library.custom_op("gem_kernels::embedding_bag_backward", mutates_args=())
def embedding_bag_backward_op(grad_output: torch.Tensor, weights: torch.Tensor, weights_offsets: torch.Tensor,
                              D_offsets: torch.Tensor, rows_offsets: torch.Tensor, indices: torch.Tensor,
                              offsets: torch.Tensor, per_sample_weights: torch.Tensor, pooling: int,
                              backend: str) -> torch.Tensor:
    """Dense gradient [weights.numel()] of the flat weights (duplicates summed, dropped indices ignored)."""
    return kernel(FAMILY, "embedding_bag_backward", backend)(
        grad_output, weights, weights_offsets, D_offsets, rows_offsets, indices, offsets, per_sample_weights, pooling)


embedding_bag_backward_op.register_fake(_backward_fake)


@torch.library.custom_op("gem_kernels::embedding_bag_backward_fused",
                         mutates_args=("weights", "momentum1", "momentum2", "step"))
def embedding_bag_backward_fused_op(grad_output: torch.Tensor, weights: torch.Tensor, momentum1: torch.Tensor,
                                    momentum2: torch.Tensor, step: torch.Tensor, weights_offsets: torch.Tensor,
                                    D_offsets: torch.Tensor, rows_offsets: torch.Tensor, indices: torch.Tensor,
                                    offsets: torch.Tensor, per_sample_weights: torch.Tensor, pooling: int,
                                    optimizer: int, lr: float, eps: float, beta1: float, beta2: float,
                                    weight_decay: float, backend: str) -> None:
    """One fused optimizer step, in place on weights/momentum1/momentum2; step += 1."""
    kernel(FAMILY, "embedding_bag_backward_fused", backend)(
        grad_output, weights, momentum1, momentum2, step, weights_offsets, D_offsets, rows_offsets, indices, offsets,
        per_sample_weights, pooling, optimizer, lr, eps, beta1, beta2, weight_decay)


embedding_bag_backward_fused_op.register_fake(_backward_fused_fake)


@torch.library.custom_op("gem_kernels::embedding_bag_per_sample_weights_backward", mutates_args=())
def embedding_bag_per_sample_weights_backward_op(grad_output: torch.Tensor, weights: torch.Tensor,
                                                 weights_offsets: torch.Tensor, D_offsets: torch.Tensor,
                                                 rows_offsets: torch.Tensor, indices: torch.Tensor,
                                                 offsets: torch.Tensor, pooling: int, backend: str) -> torch.Tensor:
    """fp32 [N]: <the output-gradient row index i was pooled into, its weight row> (0 for a dropped index)."""
    return kernel(FAMILY, "embedding_bag_per_sample_weights_backward", backend)(
        grad_output, weights, weights_offsets, D_offsets, rows_offsets, indices, offsets, pooling)


embedding_bag_per_sample_weights_backward_op.register_fake(_per_sample_weights_backward_fake)


def _setup(ctx, inputs, output):
    (weights, momentum1, momentum2, step, weights_offsets, D_offsets, rows_offsets, indices, offsets,
     per_sample_weights, _output_dim, pooling, _bounds_check, optimizer, lr, eps, beta1, beta2, weight_decay,
     backend) = inputs
    # The per-sample-weight gradient reads the weights as they were in the forward. Without a fused
    # optimizer they are saved (autograd's version counter catches an in-place change before the
    # backward); with one they are the state below, read before this backward's own update.
    psw_grad = per_sample_weights.requires_grad
    ctx.save_for_backward(weights_offsets, D_offsets, rows_offsets, indices, offsets, per_sample_weights,
                          weights if psw_grad and optimizer == OPT_NONE else None)
    ctx.pooling, ctx.optimizer, ctx.backend = pooling, optimizer, backend
    ctx.hyperparams = (lr, eps, beta1, beta2, weight_decay)
    if optimizer == OPT_NONE:
        ctx.weights_shape, ctx.weights_dtype = weights.shape, weights.dtype
    else:
        # Held as plain attributes, not saved tensors: the fused backward mutates them, and a second
        # forward sharing the weights must still be able to run its own backward afterwards.
        ctx.state = (weights, momentum1, momentum2, step)


def _backward(ctx, grad_output):
    *meta, indices, offsets, per_sample_weights, saved_weights = ctx.saved_tensors
    grad_output = grad_output.contiguous()
    grad_weights = grad_psw = None
    if ctx.needs_input_grad[9]:
        weights = saved_weights if ctx.optimizer == OPT_NONE else ctx.state[0]
        grad_psw = embedding_bag_per_sample_weights_backward_op(grad_output, weights, *meta, indices, offsets,
                                                                ctx.pooling, ctx.backend)
    if ctx.optimizer == OPT_NONE:
        if ctx.needs_input_grad[0]:
            weights_like = grad_output.new_empty(ctx.weights_shape, dtype=ctx.weights_dtype)
            grad_weights = embedding_bag_backward_op(grad_output, weights_like, *meta, indices, offsets,
                                                     per_sample_weights, ctx.pooling, ctx.backend)
    else:
        weights, momentum1, momentum2, step = ctx.state
        embedding_bag_backward_fused_op(grad_output, weights, momentum1, momentum2, step, *meta, indices, offsets,
                                        per_sample_weights, ctx.pooling, ctx.optimizer, *ctx.hyperparams,
                                        ctx.backend)
    return (grad_weights,) + (None,) * 8 + (grad_psw,) + (None,) * 10


register_autograd(embedding_bag_op, _backward, setup_context=_setup)


if hasattr(torch.ops.gem_kernels, "embedding_bag_forward_native"):
    for _name, _fake in (("forward", _forward_fake), ("backward", _backward_fake),
                         ("backward_fused", _backward_fused_fake),
                         ("per_sample_weights_backward", _per_sample_weights_backward_fake)):
        torch.library.register_fake(f"gem_kernels::embedding_bag_{_name}_native")(_fake)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def _code(name: str, value: str, codes: dict) -> int:
    if value not in codes:
        raise ValueError(f"{name} must be one of {tuple(codes)}, got {value!r}")
    return codes[value]


def embedding_bag(weights: torch.Tensor, tables: TableMeta, indices: torch.Tensor, offsets: torch.Tensor,
                  per_sample_weights: torch.Tensor | None = None, *, output_dim: int, pooling: str = "sum",
                  bounds_check: str = "fatal", optimizer=None, momentum1: torch.Tensor | None = None,
                  momentum2: torch.Tensor | None = None, step: torch.Tensor | None = None,
                  backend: str | None = None) -> torch.Tensor:
    """Look up and pool T tables' bags in one call (FBGEMM TBE / TorchRec EmbeddingBagCollection).

    ``out[b, D_offsets[t]:D_offsets[t+1]] = sum_i w_i * W_t[indices[i]]  for i in offsets[t*B+b] : offsets[t*B+b+1]``
    (``mean`` divides by the bag's kept length, also with per-sample weights: weighted sum / length, as
    FBGEMM's TBE; an empty bag gives zeros); ``pooling="none"``:
    ``out[i] = w_i * W_t[indices[i]]`` ([N, D], every table of dim D). Reference: per-table
    ``torch.nn.functional.embedding_bag``.

    Args:
        weights: flat [sum_t rows_t * D_t] float32/float16/bfloat16, the packed tables.
        tables: a ``TableMeta`` (weights_offsets, D_offsets, rows_offsets: int64 [T], [T+1], [T+1]); a
            module's is ``module.table_meta``, ``pack_tables(rows, dims).meta(device)`` builds one.
        indices: [N] int32/int64, row ids local to their table.
        offsets: [T*B+1] int32/int64 (either dtype with either indices' dtype: a mix is cast to int64 once,
            as FBGEMM's TBE does); offsets[0] == 0, nondecreasing, offsets[-1] == N.
        per_sample_weights: [N] float or None, any pooling. It is differentiable:
            ``d out / d w_i = <grad of the output row i was pooled into, W_t[indices[i]]>`` (divided by
            the bag's kept length for mean; 0 for a dropped index), computed from the weights before a
            fused optimizer's update (FBGEMM's order).
        output_dim: D_offsets[-1] for sum/mean, the shared D for "none" (a Python int, so shapes are static).
        pooling: "sum" | "mean" | "none".
        bounds_check: "fatal" (IndexError naming table, bag and value) | "warn" (warn once per call and
            drop bad indices) | "skip" (drop silently). Negative indices are out of range.
        optimizer: None, or a ``gem_kernels.optim`` config: the backward then updates ``weights``,
            ``momentum1`` (row-wise Adagrad: fp32 [rows_offsets[-1]]; Adam: fp32 like weights),
            ``momentum2`` (Adam) and ``step`` (int64 scalar, += 1 per backward) in place.
        backend: "reference" | "cpu" | "cuda" | "triton" | "auto"; None uses ``use_backend``'s default.

    Returns:
        [B, output_dim] (sum/mean) or [N, output_dim] (none), weights' dtype.
    """
    check_tensor("weights", weights, dtypes=FLOAT_DTYPES, dims=(1,))
    if not weights.is_contiguous():  # the kernels update it in place, so it cannot be copied
        raise ValueError(f"weights must be contiguous, got stride {weights.stride()}")
    if not isinstance(tables, tuple) or len(tables) != len(TableMeta._fields):
        raise TypeError(f"tables must be a TableMeta {TableMeta._fields}, got {type(tables).__name__}")
    tables = TableMeta(*tables)
    for name, meta in tables._asdict().items():
        check_tensor(name, meta, dtypes=(torch.int64,), dims=(1,))
    num_tables = tables.weights_offsets.shape[0]
    if tables.D_offsets.shape[0] != num_tables + 1 or tables.rows_offsets.shape[0] != num_tables + 1:
        raise ValueError(f"D_offsets and rows_offsets must have T+1 = {num_tables + 1} elements, got "
                         f"{tables.D_offsets.shape[0]} and {tables.rows_offsets.shape[0]}")
    if num_tables < 1:
        raise ValueError("weights_offsets must describe at least one table, got 0")
    check_tensor("indices", indices, dtypes=INDEX_DTYPES, dims=(1,))
    check_offsets_meta("offsets", offsets)
    if offsets.dtype != indices.dtype:
        # TorchRec emits int64 ids with int32 lengths/offsets; FBGEMM's TBE accepts the mix and casts
        # once at its front door, so do we (to int64: widening never changes a value).
        indices, offsets = indices.long(), offsets.long()
    if (offsets.shape[0] - 1) % num_tables != 0:
        raise ValueError(f"offsets must have T*B+1 elements with T = {num_tables} tables, got {offsets.shape[0]}")
    pooling_code = _code("pooling", pooling, POOLING_CODES)
    bounds_code = _code("bounds_check", bounds_check, BOUNDS_CHECK_CODES)
    if isinstance(output_dim, bool) or not isinstance(output_dim, int):
        raise ValueError(f"output_dim must be an int >= 0, got {output_dim!r}")
    check_nonnegative_int("output_dim", output_dim)
    per_sample_weights = per_sample_weights_arg(per_sample_weights, indices, weights.device)
    check_same_device(weights=weights, indices=indices, offsets=offsets, per_sample_weights=per_sample_weights,
                      **tables._asdict())
    if optimizer is None:
        opt_code, hyper = OPT_NONE, (0.0, 0.0, 0.0, 0.0, 0.0)
        momentum1 = momentum2 = step = weights.new_empty(0, dtype=torch.float32)
    else:
        if getattr(optimizer, "name", None) not in OPTIMIZER_CODES:
            raise ValueError(f"optimizer must be None or a gem_kernels.optim config, got {optimizer!r}")
        opt_code, hyper = OPTIMIZER_CODES[optimizer.name], optimizer.hyperparams()
        empty = weights.new_empty(0, dtype=torch.float32)
        momentum1 = empty if momentum1 is None else momentum1
        momentum2 = empty if momentum2 is None else momentum2
        if step is None:
            raise ValueError("step must be an int64 scalar tensor when an optimizer is given")
        check_tensor("step", step, dtypes=(torch.int64,), dims=(0,))
        for name, state in (("momentum1", momentum1), ("momentum2", momentum2)):
            check_tensor(name, state, dtypes=(torch.float32,), dims=(1,))
            if not state.is_contiguous():  # updated in place, so it cannot be copied
                raise ValueError(f"{name} must be contiguous, got stride {state.stride()}")
        # Row-wise Adagrad's state length (rows_offsets[-1]) is data: check_tables checks it.
        need1 = {"sgd": 0, "rowwise_adagrad": None, "adam": weights.shape[0]}[optimizer.name]
        need2 = weights.shape[0] if optimizer.name == "adam" else 0
        if need1 is not None and momentum1.shape[0] != need1:
            raise ValueError(f"momentum1 must have {need1} elements for {optimizer.name}, got {momentum1.shape[0]}")
        if momentum2.shape[0] != need2:
            raise ValueError(f"momentum2 must have {need2} elements for {optimizer.name}, got {momentum2.shape[0]}")
        check_same_device(weights=weights, momentum1=momentum1, momentum2=momentum2, step=step)
    name = resolve_backend(backend, weights.device, FAMILY)
    return embedding_bag_op(weights, momentum1, momentum2, step, *(m.contiguous() for m in tables),
                            indices.contiguous(), offsets.contiguous(), per_sample_weights.contiguous(), output_dim,
                            pooling_code, bounds_code, opt_code, *hyper, name)

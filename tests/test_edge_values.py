"""Edge values the front doors must name (issue 19's validation gaps): non-finite optimizer settings,
integers beyond int64, pad values a dtype cannot hold, and low-rank cross layers with N = 0.

Every case here failed before the fix it guards (a silent NaN update, a schema error that names no
argument, an inf pad on one backend and a conversion error on another, a shape error at N = 0)."""

import math

import pytest
import torch

import gem_kernels as gk
from gem_kernels.ops.interaction import IMPLEMENTED as INTERACTION_BACKENDS

from .utils import assert_close, device_backend_params, offsets_from_lengths, reference_params

# Validation and N = 0 are the reference's own behaviour too: it runs with the kernels here.
BACKEND_PARAMS = device_backend_params() + reference_params()

# ---------------------------------------------------------------------------------------------
# Optimizer settings
# ---------------------------------------------------------------------------------------------

NON_FINITE = (math.nan, math.inf, -math.inf)
OPTIMIZER_FIELDS = [
    (gk.optim.ExactSGD, "lr"),
    (gk.optim.ExactSGD, "weight_decay"),
    (gk.optim.ExactRowwiseAdagrad, "lr"),
    (gk.optim.ExactRowwiseAdagrad, "eps"),
    (gk.optim.ExactRowwiseAdagrad, "weight_decay"),
    (gk.optim.ExactAdam, "lr"),
    (gk.optim.ExactAdam, "eps"),
    (gk.optim.ExactAdam, "weight_decay"),
]


@pytest.mark.parametrize("value", NON_FINITE, ids=("nan", "inf", "-inf"))
@pytest.mark.parametrize("config,field", OPTIMIZER_FIELDS, ids=[f"{c.__name__}.{f}" for c, f in OPTIMIZER_FIELDS])
def test_optimizer_rejects_non_finite(config, field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        config(**{field: value})


@pytest.mark.parametrize("betas", [(math.nan, 0.999), (0.9, math.nan), (0.9, math.inf), (-math.inf, 0.9)])
def test_adam_rejects_non_finite_betas(betas):
    with pytest.raises(ValueError, match=r"betas\[[01]\] must be a float in \[0, 1\)"):
        gk.optim.ExactAdam(betas=betas)


@pytest.mark.parametrize("betas", [0.9, "ab", (0.9,), (0.9, 0.99, 0.999), None, (True, 0.9)])
def test_adam_betas_must_be_two_floats(betas):
    with pytest.raises(ValueError, match=r"betas"):
        gk.optim.ExactAdam(betas=betas)


def test_adam_betas_scalar_message():
    with pytest.raises(ValueError, match=r"betas must be two floats in \[0, 1\), got 0.9"):
        gk.optim.ExactAdam(betas=0.9)


def test_optimizer_finite_settings_still_accepted():
    gk.optim.ExactSGD(lr=0.5, weight_decay=0.0)
    gk.optim.ExactRowwiseAdagrad(lr=1, eps=0.0, weight_decay=1e-4)
    gk.optim.ExactAdam(lr=1e-3, betas=[0.0, 0.5], eps=0, weight_decay=0)


# ---------------------------------------------------------------------------------------------
# Integers beyond int64: a ValueError naming the argument, before the schema sees them
# ---------------------------------------------------------------------------------------------

HUGE = [2**63, 2**64 + 5, 10**30]
VERY_NEGATIVE = [-(2**63) - 1, -(10**30)]


def _jagged_inputs(device, dtype=torch.float32):
    values = torch.randn(5, 3, device=device, dtype=dtype)
    return values, offsets_from_lengths([3, 0, 2], device=device)


@pytest.mark.parametrize("value", HUGE + VERY_NEGATIVE)
@pytest.mark.parametrize("device,backend", BACKEND_PARAMS)
def test_jagged_int_out_of_range(device, backend, value):
    values, offsets = _jagged_inputs(device)
    message = "out of range" if value > 0 or value < -(2**63) else ">= 0"
    with pytest.raises(ValueError, match=rf"max_len .*{message}"):
        gk.jagged_to_padded(values, offsets, value, backend=backend)
    padded = torch.randn(3, 4, 3, device=device)
    with pytest.raises(ValueError, match=rf"total_len .*{message}"):
        gk.padded_to_jagged(padded, offsets, value, backend=backend)


@pytest.mark.parametrize("value", HUGE + VERY_NEGATIVE)
@pytest.mark.parametrize("arg", ["max_seq_len", "contextual_len", "max_attn_len"])
@pytest.mark.parametrize("device,backend", BACKEND_PARAMS)
def test_attention_int_out_of_range(device, backend, arg, value):
    q = torch.randn(5, 2, 4, device=device)
    offsets = offsets_from_lengths([3, 2], device=device)
    kwargs = dict(max_seq_len=4)
    kwargs[arg] = value
    max_seq_len = kwargs.pop("max_seq_len")
    with pytest.raises(ValueError, match=rf"^{arg} (is out of range|must be >= 0)"):
        gk.jagged_attention(q, q, q, offsets, max_seq_len, backend=backend, **kwargs)


@pytest.mark.parametrize("value", HUGE + VERY_NEGATIVE)
@pytest.mark.parametrize("device,backend", BACKEND_PARAMS)
def test_embedding_bag_output_dim_out_of_range(device, backend, value):
    ebc = gk.FusedEmbeddingBag([gk.TableSpec(4, 3)], device=device, backend=backend)
    indices = torch.tensor([0, 1, 3], device=device)
    offsets = torch.tensor([0, 2, 3], device=device)
    with pytest.raises(ValueError, match=r"^output_dim (is out of range|must be >= 0)"):
        gk.embedding_bag(ebc.weights, ebc.table_meta, indices, offsets, output_dim=value, backend=backend)


# ---------------------------------------------------------------------------------------------
# pad_value the dtype cannot hold: a ValueError naming it on every backend
# ---------------------------------------------------------------------------------------------

UNHOLDABLE = [
    (torch.float16, 1e6),
    (torch.float16, -65520.0),
    (torch.bfloat16, 1e39),
    (torch.float32, 1e39),
    (torch.float32, -1e300),
    (torch.float32, 10**400),  # a Python int beyond float64
]


@pytest.mark.parametrize("dtype,pad_value", UNHOLDABLE, ids=[f"{str(d)[6:]}-{p:.0e}" if isinstance(p, float) else f"{str(d)[6:]}-int" for d, p in UNHOLDABLE])
@pytest.mark.parametrize("device,backend", BACKEND_PARAMS)
def test_pad_value_out_of_dtype_range(device, backend, dtype, pad_value):
    values, offsets = _jagged_inputs(device, dtype)
    with pytest.raises(ValueError, match=r"^pad_value is out of range for torch\."):
        gk.jagged_to_padded(values, offsets, 4, pad_value=pad_value, backend=backend)


@pytest.mark.parametrize("pad_value", [math.inf, -math.inf, 65504.0, -65504.0])
@pytest.mark.parametrize("device,backend", BACKEND_PARAMS)
def test_pad_value_holdable_extremes_agree(device, backend, pad_value):
    values, offsets = _jagged_inputs(device, torch.float16)
    out = gk.jagged_to_padded(values, offsets, 4, pad_value=pad_value, backend=backend)
    expected = gk.jagged_to_padded(values.cpu(), offsets.cpu(), 4, pad_value=pad_value, backend="reference")
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    assert out[1, 0, 0].item() == pad_value


def test_pad_value_nan_pads_with_nan():
    values, offsets = _jagged_inputs("cpu", torch.bfloat16)
    for backend in ("reference", "cpu"):
        out = gk.jagged_to_padded(values, offsets, 4, pad_value=math.nan, backend=backend)
        assert out[1].isnan().all() and not out[0, :3].isnan().any()


def test_native_jagged_to_padded_rejects_unholdable_pad_value():
    """The C++ kernel re-checks: a direct torch.ops call gets the same ValueError, not an inf pad."""
    values, offsets = _jagged_inputs("cpu", torch.float16)
    with pytest.raises(ValueError, match="pad_value is out of range"):
        torch.ops.gem_kernels.jagged_to_padded_native(values, offsets, 4, 1e6)
    out = torch.ops.gem_kernels.jagged_to_padded_native(values, offsets, 4, -math.inf)
    assert out[1, 0, 0].item() == -math.inf


# ---------------------------------------------------------------------------------------------
# cross_layer with N = 0: valid for both forms, output [B, 0], every gradient empty
# ---------------------------------------------------------------------------------------------

CROSS_PARAMS = device_backend_params(tuple(b for b in INTERACTION_BACKENDS if b != "reference")) + reference_params()


@pytest.mark.parametrize("rank", [None, 1, 3], ids=["full", "rank1", "rank3"])
@pytest.mark.parametrize("batch", [0, 4])
@pytest.mark.parametrize("device,backend", CROSS_PARAMS)
def test_cross_layer_zero_features(device, backend, batch, rank):
    x0 = torch.randn(batch, 0, device=device, requires_grad=True)
    xl = torch.randn(batch, 0, device=device, requires_grad=True)
    bias = torch.randn(0, device=device, requires_grad=True)
    if rank is None:
        weights = (torch.randn(0, 0, device=device, requires_grad=True),)
        weight = weights[0]
    else:
        weights = (torch.randn(0, rank, device=device, requires_grad=True),
                   torch.randn(rank, 0, device=device, requires_grad=True))
        weight = weights
    out = gk.cross_layer(x0, xl, weight, bias, backend=backend)
    assert out.shape == (batch, 0)
    grads = torch.autograd.grad(out.sum(), (x0, xl, *weights, bias), allow_unused=True)
    for g, t in zip(grads, (x0, xl, *weights, bias)):
        assert g is None or g.shape == t.shape


@pytest.mark.parametrize("device,backend", CROSS_PARAMS)
def test_cross_layer_low_rank_still_matches_reference(device, backend):
    """The shape rule (v 2-D: low rank) must not change the N > 0 results."""
    torch.manual_seed(3)
    x0, xl = torch.randn(5, 7, device=device), torch.randn(5, 7, device=device)
    u, v, bias = torch.randn(7, 2, device=device), torch.randn(2, 7, device=device), torch.randn(7, device=device)
    out = gk.cross_layer(x0, xl, (u, v), bias, backend=backend)
    expected = x0 * (xl @ v.t() @ u.t() + bias) + xl
    assert_close(out, expected, torch.float32, atol=1e-4, rtol=1e-4)


def test_native_cross_layer_tells_rank_by_shape():
    """Direct calls of the C++ op: an empty 2-D v [r, 0] is low rank (p [B, r]), an empty 1-D v full rank."""
    x = torch.randn(3, 0)
    out, z, p = torch.ops.gem_kernels.cross_layer_native(x, x, torch.randn(0, 2), torch.randn(2, 0), torch.randn(0))
    assert out.shape == (3, 0) and p.shape == (3, 2)
    out, z, p = torch.ops.gem_kernels.cross_layer_native(x, x, torch.randn(0, 0), torch.randn(0), torch.randn(0))
    assert out.shape == (3, 0) and p.shape == (0,)
    grads = torch.ops.gem_kernels.cross_layer_backward_native(torch.randn(3, 0), x, x, torch.randn(0, 2),
                                                              torch.randn(2, 0), z, torch.randn(3, 2))
    assert [tuple(g.shape) for g in grads] == [(3, 0), (3, 0), (0, 2), (2, 0), (0,)]


# ---------------------------------------------------------------------------------------------
# Direct calls of the CPU TBE's backward ops check what the forward checked for the Python op
# ---------------------------------------------------------------------------------------------


def _tbe_native_args(**change):
    args = dict(weights=torch.randn(43), w_off=torch.tensor([0, 15]), d_off=torch.tensor([0, 3, 7]),
                r_off=torch.tensor([0, 5, 12]), indices=torch.tensor([0, 4, 4, 1, 6, 0, 2]),
                offsets=torch.tensor([0, 3, 4, 4, 7]), psw=torch.empty(0), grad=torch.randn(2, 7))
    args.update(change)
    return args


@pytest.mark.parametrize("change,match", [
    (dict(grad=torch.randn(1, 1)), "grad_output has 1 rows"),
    (dict(grad=torch.randn(2, 3)), "grad_output is too narrow"),
    (dict(offsets=torch.tensor([0, 3, 2, 4, 7])), "offsets must be nondecreasing"),
    (dict(offsets=torch.tensor([0, 3, 4, 4, 9])), r"offsets\[-1\] must equal the number of rows 7"),
    (dict(d_off=torch.tensor([-5, 3, 7])), r"D_offsets\[0\] and rows_offsets\[0\] must be 0"),
    (dict(d_off=torch.tensor([0, 2**61, 2**62 + 3]), r_off=torch.tensor([0, 4, 8])), "does not fit in weights"),
], ids=["grad_rows", "grad_narrow", "offsets_decreasing", "offsets_last", "d_off_first", "rows_x_D_overflow"])
@pytest.mark.parametrize("op", ["backward", "backward_fused"])
def test_native_tbe_backward_checks_direct_calls(op, change, match):
    a = _tbe_native_args(**change)
    meta = (a["w_off"], a["d_off"], a["r_off"], a["indices"], a["offsets"], a["psw"])
    with pytest.raises((RuntimeError, ValueError), match=match):
        if op == "backward":
            torch.ops.gem_kernels.embedding_bag_backward_native(a["grad"], a["weights"], *meta, 0)
        else:
            torch.ops.gem_kernels.embedding_bag_backward_fused_native(
                a["grad"], a["weights"], torch.empty(0), torch.empty(0), torch.zeros((), dtype=torch.int64), *meta, 0,
                1, 0.1, 0.0, 0.0, 0.0, 0.0)

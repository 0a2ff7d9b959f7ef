"""jagged_to_padded / padded_to_jagged: every backend against the reference, forward and gradients."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gem_kernels as gk
from gem_kernels.ops.jagged import (jagged_to_padded_backward_op, jagged_to_padded_op, padded_to_jagged_backward_op,
                                   padded_to_jagged_op)

from .utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cpu_kernel_only,
    device_backend_params,
    offsets_from_lengths,
    poison_allocator,
    randn_nonzero,
    reference_params,
)

# (lengths, max_len): empty batch, zero-length sequences, L = 1, odd sizes, truncation, max_len 0.
CASES = [
    ([], 4),
    ([0], 3),
    ([0, 0, 0], 2),
    ([1], 1),
    ([5, 0, 3, 97, 1], 97),
    ([5, 0, 3, 97, 1], 59),  # truncates the 97
    ([7, 2], 0),
    ([59, 1025, 0, 13], 128),
]
FEATURE_SHAPES = [(), (1,), (3,), (59,), (128,)]


def loop_jagged_to_padded(values, offsets, max_len, pad_value):
    """Independent oracle for the reference: one sequence at a time."""
    out = values.new_full((offsets.numel() - 1, max_len, *values.shape[1:]), pad_value)
    for b in range(offsets.numel() - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        n = min(end - start, max_len)
        out[b, :n] = values[start:start + n]
    return out


def loop_padded_to_jagged(padded, offsets):
    out = padded.new_zeros((int(offsets[-1]), *padded.shape[2:]))
    for b in range(offsets.numel() - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        n = min(end - start, padded.shape[1])
        out[start:start + n] = padded[b, :n]
    return out


def _loop_grad(out, inp, grad):
    """The gradient through a loop oracle; a loop that copied nothing has none (zeros)."""
    if not out.requires_grad:
        return torch.zeros_like(inp)
    return torch.autograd.grad(out, inp, grad)[0]


@pytest.mark.parametrize("lengths,max_len", CASES)
@pytest.mark.parametrize("feat", [(), (3,)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_reference_matches_loop(lengths, max_len, feat, dtype, index_dtype):
    """The reference, forward and both gradients, against the loop (autograd through its copies)."""
    offsets = offsets_from_lengths(lengths, index_dtype)
    values = randn_nonzero(int(offsets[-1]), *feat, dtype=dtype).requires_grad_(True)
    padded = gk.jagged_to_padded(values, offsets, max_len, pad_value=-3.0, backend="reference")
    expected = loop_jagged_to_padded(values, offsets, max_len, -3.0)
    assert padded.dtype == dtype
    torch.testing.assert_close(padded, expected, rtol=0, atol=0)
    grad = randn_nonzero(*padded.shape, dtype=dtype)
    torch.testing.assert_close(torch.autograd.grad(padded, values, grad)[0], _loop_grad(expected, values, grad),
                               rtol=0, atol=0)
    dense = randn_nonzero(*padded.shape, dtype=dtype).requires_grad_(True)
    jagged = gk.padded_to_jagged(dense, offsets, backend="reference")
    expected = loop_padded_to_jagged(dense, offsets)
    torch.testing.assert_close(jagged, expected, rtol=0, atol=0)
    grad = randn_nonzero(*jagged.shape, dtype=dtype)
    torch.testing.assert_close(torch.autograd.grad(jagged, dense, grad)[0], _loop_grad(expected, dense, grad),
                               rtol=0, atol=0)


def _inputs(lengths, feat, dtype, index_dtype, device):
    offsets = offsets_from_lengths(lengths, index_dtype, device)
    values = randn_nonzero(int(offsets[-1]), *feat, dtype=dtype, device=device)
    return values, offsets


@pytest.mark.parametrize("device,backend", device_backend_params())
@pytest.mark.parametrize("lengths,max_len", CASES)
@pytest.mark.parametrize("feat", FEATURE_SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_forward_and_backward(device, backend, lengths, max_len, feat, dtype, index_dtype):
    if backend == "triton" and device == "cpu" and (dtype != torch.float32 and feat not in [(), (3,)]):
        pytest.skip("interpreter: one dtype sweep on small shapes keeps CI short (fp32 covers the rest)")
    values, offsets = _inputs(lengths, feat, dtype, index_dtype, device)
    values.requires_grad_(True)
    nbytes = (offsets.numel() - 1) * max_len * max([1, *feat]) * values.element_size()

    poison_allocator(nbytes, device)
    padded = gk.jagged_to_padded(values, offsets, max_len, pad_value=7.5, backend=backend)
    expected = gk.jagged_to_padded(values, offsets, max_len, pad_value=7.5, backend="reference")
    assert padded.shape == (offsets.numel() - 1, max_len, *feat) and padded.dtype == dtype
    torch.testing.assert_close(padded, expected, rtol=0, atol=0)  # a copy: exact

    grad_padded = randn_nonzero(*padded.shape, dtype=dtype, device=device)
    poison_allocator(values.numel() * values.element_size(), device)
    (grad_values,) = torch.autograd.grad(padded, values, grad_padded)
    (expected_grad,) = torch.autograd.grad(expected, values, grad_padded)
    torch.testing.assert_close(grad_values, expected_grad, rtol=0, atol=0)

    # padded_to_jagged forward and its backward (jagged_to_padded with pad 0).
    dense = randn_nonzero(*padded.shape, dtype=dtype, device=device).requires_grad_(True)
    poison_allocator(values.numel() * values.element_size(), device)
    jagged = gk.padded_to_jagged(dense, offsets, backend=backend)
    expected_jagged = gk.padded_to_jagged(dense, offsets, backend="reference")
    assert jagged.shape == values.shape
    torch.testing.assert_close(jagged, expected_jagged, rtol=0, atol=0)
    grad_jagged = randn_nonzero(*jagged.shape, dtype=dtype, device=device)
    poison_allocator(nbytes, device)
    (grad_dense,) = torch.autograd.grad(jagged, dense, grad_jagged)
    (expected_grad_dense,) = torch.autograd.grad(expected_jagged, dense, grad_jagged)
    torch.testing.assert_close(grad_dense, expected_grad_dense, rtol=0, atol=0)


@pytest.mark.parametrize("device,backend", reference_params() + device_backend_params())
def test_roundtrip_and_total_len(device, backend):
    values, offsets = _inputs([4, 0, 9, 2], (5,), torch.float32, torch.int64, device)
    padded = gk.jagged_to_padded(values, offsets, 9, backend=backend)
    back = gk.padded_to_jagged(padded, offsets, total_len=values.shape[0], backend=backend)
    torch.testing.assert_close(back, values, rtol=0, atol=0)


@pytest.mark.parametrize("device,backend", reference_params() + device_backend_params())
def test_noncontiguous_inputs(device, backend):
    values, offsets = _inputs([3, 6, 1], (8,), torch.float32, torch.int32, device)
    values_t = values.t().contiguous().t()  # same values, column-major
    assert not values_t.is_contiguous()
    torch.testing.assert_close(gk.jagged_to_padded(values_t, offsets, 6, backend=backend),
                               loop_jagged_to_padded(values, offsets.cpu(), 6, 0.0), rtol=0, atol=0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 40), min_size=0, max_size=12),
    max_len=st.integers(0, 45),
    dim=st.integers(1, 70),
    pad=st.floats(-10, 10, allow_nan=False),
)
def test_fuzz_cpu_against_reference(lengths, max_len, dim, pad):
    values, offsets = _inputs(lengths, (dim,), torch.float32, torch.int64, "cpu")
    got = gk.jagged_to_padded(values, offsets, max_len, pad, backend="cpu")
    torch.testing.assert_close(got, gk.jagged_to_padded(values, offsets, max_len, pad, backend="reference"),
                               rtol=0, atol=0)
    dense = randn_nonzero(len(lengths), max_len, dim)
    torch.testing.assert_close(gk.padded_to_jagged(dense, offsets, backend="cpu"),
                               gk.padded_to_jagged(dense, offsets, backend="reference"), rtol=0, atol=0)


@pytest.mark.triton
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(0, 20), min_size=0, max_size=5), max_len=st.integers(0, 24),
       dim=st.integers(1, 40))
def test_fuzz_triton_against_reference(lengths, max_len, dim):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "triton" not in gk.available_backends():
        pytest.skip("triton backend unavailable here")
    values, offsets = _inputs(lengths, (dim,), torch.float32, torch.int64, device)
    torch.testing.assert_close(gk.jagged_to_padded(values, offsets, max_len, 1.5, backend="triton"),
                               gk.jagged_to_padded(values, offsets, max_len, 1.5, backend="reference"),
                               rtol=0, atol=0)
    dense = randn_nonzero(len(lengths), max_len, dim, device=device)
    torch.testing.assert_close(gk.padded_to_jagged(dense, offsets, backend="triton"),
                               gk.padded_to_jagged(dense, offsets, backend="reference"), rtol=0, atol=0)



@pytest.mark.triton
def test_triton_position_blocks_grid_stride(monkeypatch):
    """With grid axis 1 capped (CUDA stops it at 65535 blocks) the programs stride over the rest of
    the positions: every element is still written, in both directions."""
    if "triton" not in gk.available_backends():
        pytest.skip("triton backend unavailable here")
    import gem_kernels.triton.jagged as tri

    monkeypatch.setattr(tri, "MAX_POSITION_BLOCKS", 2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = [70, 0, 5, 101]  # up to 7 blocks of 16 positions on 2 programs per sequence
    values, offsets = _inputs(lengths, (3,), torch.float32, torch.int64, device)
    for max_len in (101, 40):  # 40: sequences past max_len, whose rows padded_to_jagged zero-fills
        torch.testing.assert_close(gk.jagged_to_padded(values, offsets, max_len, 1.5, backend="triton"),
                                   gk.jagged_to_padded(values, offsets, max_len, 1.5, backend="reference"),
                                   rtol=0, atol=0)
        dense = randn_nonzero(len(lengths), max_len, 3, device=device)
        torch.testing.assert_close(gk.padded_to_jagged(dense, offsets, backend="triton"),
                                   gk.padded_to_jagged(dense, offsets, backend="reference"), rtol=0, atol=0)

# ------------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the argument, on every backend (validation runs before dispatch).
# ------------------------------------------------------------------------------------------------

BAD_J2P = [
    (lambda: (torch.ones(3, 2), torch.tensor([0, 2, 1, 3])), "nondecreasing"),
    (lambda: (torch.ones(3, 2), torch.tensor([1, 2, 3])), r"offsets\[0\] must be 0"),
    (lambda: (torch.ones(3, 2), torch.tensor([0, 2, 4])), r"offsets\[-1\] must equal the number of rows 3"),
    (lambda: (torch.ones(3, 2, dtype=torch.int64), torch.tensor([0, 3])), "values must have dtype"),
    (lambda: (torch.ones(3, 2, dtype=torch.float64), torch.tensor([0, 3])), "values must have dtype"),
    (lambda: (torch.ones(3, 2), torch.tensor([0.0, 3.0])), "offsets must have dtype"),
    (lambda: (torch.ones(3, 2, 2), torch.tensor([0, 3])), "values must have 1 or 2 dims"),
    (lambda: (torch.ones(3, 2), torch.tensor([[0, 3]])), "offsets must have 1 dims"),
    (lambda: (torch.ones(3, 2), torch.tensor([], dtype=torch.int64)), "offsets must have at least one element"),
    (lambda: ([1.0, 2.0], torch.tensor([0, 2])), "values must be a torch.Tensor"),
]


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("make,match", BAD_J2P)
def test_jagged_to_padded_rejects_bad_input(backend, make, match):
    if backend not in gk.available_backends():
        pytest.skip(f"{backend} backend unavailable here")
    values, offsets = make()
    with pytest.raises(ValueError, match=match):
        gk.jagged_to_padded(values, offsets, 4, backend=backend)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_bad_scalars_and_padded_shapes(backend):
    if backend not in gk.available_backends():
        pytest.skip(f"{backend} backend unavailable here")
    values, offsets = torch.ones(3, 2), torch.tensor([0, 1, 3])
    with pytest.raises(ValueError, match="max_len must be >= 0, got -1"):
        gk.jagged_to_padded(values, offsets, -1, backend=backend)
    with pytest.raises(ValueError, match="max_len must be an int"):
        gk.jagged_to_padded(values, offsets, 2.5, backend=backend)
    with pytest.raises(ValueError, match="pad_value must be a float"):
        gk.jagged_to_padded(values, offsets, 2, pad_value="x", backend=backend)
    with pytest.raises(ValueError, match=r"offsets must have padded.shape\[0\] \+ 1 = 3 elements, got 4"):
        gk.padded_to_jagged(torch.ones(2, 4, 2), torch.tensor([0, 1, 2, 3]), backend=backend)
    with pytest.raises(ValueError, match="padded must have 2 or 3 dims"):
        gk.padded_to_jagged(torch.ones(2), offsets, backend=backend)
    with pytest.raises(ValueError, match=r"offsets\[-1\] must equal the number of rows 5, got 3"):
        gk.padded_to_jagged(torch.ones(2, 4, 2), offsets, total_len=5, backend=backend)
    with pytest.raises(ValueError, match="nondecreasing"):
        gk.padded_to_jagged(torch.ones(2, 4, 2), torch.tensor([0, 3, 1]), backend=backend)


def test_device_mismatch_is_value_error():
    values = torch.ones(3, 2, device="meta")
    with pytest.raises(ValueError, match="offsets is on cpu but values is on meta"):
        gk.jagged_to_padded(values, torch.tensor([0, 3]), 4)


# ------------------------------------------------------------------------------------------------
# torch.library registration: opcheck (schema, fake, autograd, aot dispatch) and torch.compile.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_opcheck(backend, index_dtype):
    offsets = offsets_from_lengths([3, 0, 5, 1], index_dtype)
    values = randn_nonzero(9, 4).requires_grad_(True)
    torch.library.opcheck(jagged_to_padded_op, (values, offsets, 4, 0.5, backend))
    dense = randn_nonzero(4, 4, 4).requires_grad_(True)
    torch.library.opcheck(padded_to_jagged_op, (dense, offsets, 9, backend))
    # total_len = -1: the output size is data dependent (an unbacked SymInt under tracing).
    torch.library.opcheck(padded_to_jagged_op, (dense, offsets, -1, backend),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    # The backward ops (each other's gradient, so double backward works too).
    torch.library.opcheck(jagged_to_padded_backward_op, (dense, offsets, 9, backend))
    torch.library.opcheck(padded_to_jagged_backward_op, (values, offsets, 4, backend))


def test_opcheck_native_ops():
    offsets = offsets_from_lengths([3, 0, 5, 1])
    values = randn_nonzero(9, 4)
    torch.library.opcheck(torch.ops.gem_kernels.jagged_to_padded_native.default, (values, offsets, 4, 0.5))
    torch.library.opcheck(torch.ops.gem_kernels.padded_to_jagged_native.default,
                          (randn_nonzero(4, 4, 4), offsets, 9))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()

    def fn(values, offsets):
        padded = gk.jagged_to_padded(values, offsets, 6, pad_value=0.0, backend=backend)
        return gk.padded_to_jagged(padded * 2.0, offsets, total_len=values.shape[0], backend=backend)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    offsets = offsets_from_lengths([2, 0, 8, 5])
    values = randn_nonzero(15, 3).requires_grad_(True)
    out = compiled(values, offsets)
    expected = fn(values, offsets)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    (g,) = torch.autograd.grad(out.sum(), values)
    (g_ref,) = torch.autograd.grad(expected.sum(), values)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=0)


def test_torch_compile_inductor_data_dependent_size():
    torch._dynamo.reset()

    def fn(padded, offsets):
        return gk.padded_to_jagged(padded, offsets, backend="cpu").sum(0)

    compiled = torch.compile(fn, fullgraph=True)
    offsets = offsets_from_lengths([2, 0, 3])
    padded = randn_nonzero(3, 4, 5)
    torch.testing.assert_close(compiled(padded, offsets), fn(padded, offsets))


@pytest.fixture
def store_kind(request):
    """Force the C++ kernels' store kind for outputs over 32 MiB (0 normal, 1 streaming), restored after."""
    from gem_kernels import _backend

    if "cpu" not in gk.available_backends():
        pytest.skip("cpu backend unavailable here")
    previous = _backend._C.set_streaming_stores(request.param)
    yield request.param
    _backend._C.set_streaming_stores(previous)


@cpu_kernel_only
def test_cpu_store_kind_is_measured_once_or_taken_from_the_environment(monkeypatch):
    from gem_kernels import _backend

    if "cpu" not in gk.available_backends():
        pytest.skip("cpu backend unavailable here")
    C = _backend._C
    previous = C.set_streaming_stores(-1)
    try:
        for value, want in (("1", True), ("0", False)):
            monkeypatch.setenv("GEM_KERNELS_STREAMING_STORES", value)
            C.set_streaming_stores(-1)
            assert C.streaming_stores() is want
        monkeypatch.setenv("GEM_KERNELS_STREAMING_STORES", "1")
        assert C.streaming_stores() is False  # decided once: the environment is read only before that
        monkeypatch.delenv("GEM_KERNELS_STREAMING_STORES")
        C.set_streaming_stores(-1)
        assert C.streaming_stores() in (True, False)  # measured on this machine
        with pytest.raises(RuntimeError, match="mode must be"):
            C.set_streaming_stores(2)
    finally:
        C.set_streaming_stores(previous)


@cpu_kernel_only
@pytest.mark.parametrize("store_kind", [0, 1], ids=["normal_stores", "streaming_stores"], indirect=True)
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 256), (torch.float16, 259), (torch.bfloat16, 513)])
def test_cpu_large_outputs_use_streaming_path(dtype, dim, store_kind):
    """Outputs over 32 MiB take the huge-page path of the C++ kernels, with streaming or normal
    stores (the machine decides; both are run here); odd dims put every row at a different 32-byte
    phase."""
    elem = torch.empty((), dtype=dtype).element_size()
    max_len = (32 << 20) // (80 * dim * elem) + 1
    lengths = torch.randint(0, max_len + max_len // 5, (80,), generator=torch.Generator().manual_seed(1))
    lengths[3] = 0
    values, offsets = _inputs(lengths.tolist(), (dim,), dtype, torch.int64, "cpu")
    assert 80 * max_len * dim * values.element_size() >= 32 << 20
    padded = gk.jagged_to_padded(values, offsets, max_len, pad_value=-1.25, backend="cpu")
    torch.testing.assert_close(padded, gk.jagged_to_padded(values, offsets, max_len, -1.25, backend="reference"),
                               rtol=0, atol=0)
    big = randn_nonzero(80, 40, dim, dtype=dtype)  # short max_len: most rows are zero-filled tails
    torch.testing.assert_close(gk.padded_to_jagged(big, offsets, backend="cpu"),
                               gk.padded_to_jagged(big, offsets, backend="reference"), rtol=0, atol=0)

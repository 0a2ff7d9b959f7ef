"""gem_kernels.ops.jagged.jagged_broadcast_cat: out[n] = cat(dense[b], jagged[n]) for n in offsets[b] :
offsets[b+1]; its backward a segment sum of dense's columns and a copy of jagged's. The native CPU pass
against an independent oracle (Python loops), the reference twin, the fp64 ground truth (FlashAttention's
rule for the sums), thread counts, bad values, opcheck and double backward."""

import pytest
import torch

from gem_kernels.ops.jagged import (
    jagged_broadcast_cat,
    jagged_broadcast_cat_backward_op,
    jagged_broadcast_cat_op,
)
from gem_kernels.reference import jagged as reference

from .utils import INDEX_DTYPES, assert_close_vs_eager, offsets_from_lengths, poison_allocator, randn_nonzero

NATIVE = hasattr(torch.ops.gem_kernels, "jagged_broadcast_cat_native")
needs_native = pytest.mark.skipif(not NATIVE, reason="gem_kernels._C without jagged_broadcast_cat_native")

LENGTHS = [
    [],                    # no sequence
    [0],                   # one empty sequence
    [1],
    [3, 0, 0, 5, 1],       # empty sequences between and at no end
    [0, 4, 0],
    [59, 1, 97, 2],        # odd sizes
    [4] * 33 + [0, 7] * 20,  # many sequences (the model's ~4 candidates per user)
]
WIDTHS = [(32, 32), (288, 32), (5, 0), (0, 3), (1, 7), (33, 17)]  # (K, S): the model's two calls first


def _loops(dense, offsets, jagged, grad):
    """Oracle: the forward row by row, the backward's sums in fp64, sequence by sequence."""
    off = offsets.tolist()
    rows = [torch.cat([dense[b], jagged[n]]) for b in range(len(off) - 1) for n in range(off[b], off[b + 1])]
    out = torch.stack(rows) if rows else dense.new_empty((0, dense.shape[1] + jagged.shape[1]))
    K = dense.shape[1]
    grad_dense = torch.zeros(dense.shape, dtype=torch.float64)
    for b in range(len(off) - 1):
        for n in range(off[b], off[b + 1]):
            grad_dense[b] += grad[n, :K].double()
    return out, grad_dense, grad[:, K:]


def _inputs(lengths, K, S, dtype=torch.float32, index_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(lengths, dtype=index_dtype)
    N = int(offsets[-1])
    dense = randn_nonzero(len(lengths), K, dtype=dtype, generator=g)
    jagged = randn_nonzero(N, S, dtype=dtype, generator=g)
    grad = randn_nonzero(N, K + S, dtype=dtype, generator=g)
    return dense, offsets, jagged, grad


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("K, S", WIDTHS)
def test_forward_and_backward_against_loops(K, S, dtype, index_dtype):
    for i, lengths in enumerate(LENGTHS):
        dense, offsets, jagged, grad = _inputs(lengths, K, S, dtype, index_dtype, seed=i)
        want_out, want_dense64, want_jagged = _loops(dense, offsets, jagged, grad)
        dense.requires_grad_(), jagged.requires_grad_()
        poison_allocator(grad.numel() * 4, "cpu")
        out = jagged_broadcast_cat(dense, offsets, jagged)
        assert out.dtype == dtype and torch.equal(out, want_out), (lengths, K, S)
        poison_allocator(grad.numel() * 4, "cpu")
        got_dense, got_jagged = torch.autograd.grad(out, (dense, jagged), grad)
        assert torch.equal(got_jagged, want_jagged), (lengths, K, S)
        # The sums by FlashAttention's rule against fp64: at most 2x the error of eager's sum in dtype
        # (a sequence without rows gets exact zeros: no error allowed there either).
        eager = reference.jagged_broadcast_cat_backward(grad.float(), offsets, K)[0].to(dtype)
        assert_close_vs_eager(got_dense, want_dense64, eager, dtype, msg=f"{lengths} K={K} S={S}")
        assert not got_dense.isnan().any()
        if dtype == torch.float32:
            # fp32 sums in row order: the reference twin's index_add, bit for bit.
            assert torch.equal(got_dense, reference.jagged_broadcast_cat_backward(grad, offsets, K)[0])


@needs_native
def test_float64_ground_truth_is_exact():
    from gem_kernels.reference import float64_ground_truth

    dense, offsets, jagged, grad = _inputs([3, 0, 5, 1], 6, 2, torch.float64)
    with float64_ground_truth():
        dense.requires_grad_(), jagged.requires_grad_()
        out = jagged_broadcast_cat(dense, offsets, jagged)
        got_dense, got_jagged = torch.autograd.grad(out, (dense, jagged), grad)
    want_out, want_dense, want_jagged = _loops(dense.detach(), offsets, jagged.detach(), grad)
    assert torch.equal(out, want_out) and torch.equal(got_jagged, want_jagged)
    torch.testing.assert_close(got_dense, want_dense, rtol=1e-15, atol=1e-15)


@needs_native
@pytest.mark.parametrize("K, S", [(288, 32), (32, 0)])
def test_same_bits_at_one_and_two_threads(K, S):
    """Large enough that the pass runs on both threads (one task per ~1 MB): each sequence is summed by
    one thread, in row order, so the bits do not depend on the thread count."""
    dense, offsets, jagged, grad = _inputs([4, 0, 7, 3, 5] * 300, K, S)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append((jagged_broadcast_cat_op(dense, offsets, jagged),
                            *jagged_broadcast_cat_backward_op(grad, offsets, K)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_reference_twin_against_loops():
    """The twin that runs on every other device, against the oracle."""
    for K, S in WIDTHS:
        for i, lengths in enumerate(LENGTHS):
            dense, offsets, jagged, grad = _inputs(lengths, K, S, seed=i)
            want_out, want_dense64, want_jagged = _loops(dense, offsets, jagged, grad)
            assert torch.equal(reference.jagged_broadcast_cat(dense, offsets, jagged), want_out)
            got_dense, got_jagged = reference.jagged_broadcast_cat_backward(grad, offsets, K)
            torch.testing.assert_close(got_dense, want_dense64.float(), rtol=1e-5, atol=1e-5)
            assert torch.equal(got_jagged, want_jagged)


@needs_native
@pytest.mark.parametrize("offsets, match", [
    ([1, 2, 4], r"offsets\[0\] must be 0"),
    ([0, 3, 2], "nondecreasing"),
    ([0, 2, 3], r"offsets\[-1\] must equal the number of rows 4"),
])
def test_refuses_bad_offset_values(offsets, match):
    with pytest.raises(ValueError, match=match):
        jagged_broadcast_cat(torch.randn(2, 3), torch.tensor(offsets), torch.randn(4, 1))


@needs_native
@pytest.mark.parametrize("offsets, match", [
    ([0, 2, 3], r"offsets\[-1\] the number of gradient rows 4"),
    ([1, 2, 4], r"offsets\[0\] must be 0"),
    ([0, 3, 2, 4], "nondecreasing"),
])
def test_backward_op_refuses_offsets_that_do_not_cover_its_rows(offsets, match):
    """The backward op called directly (not through autograd, whose forward checked the offsets) refuses
    offsets that would leave grad_jagged rows unwritten or write out of range."""
    grad = torch.randn(4, 5)
    with pytest.raises(ValueError, match=match):
        torch.ops.gem_kernels.jagged_broadcast_cat_backward(grad, torch.tensor(offsets), 3)


def test_refuses_bad_arguments():
    dense, offsets, jagged = torch.randn(2, 3), torch.tensor([0, 1, 4]), torch.randn(4, 1)
    with pytest.raises(ValueError, match="offsets must have dense.shape"):
        jagged_broadcast_cat(dense, offsets[:2], jagged)
    with pytest.raises(ValueError, match="jagged must have dtype"):
        jagged_broadcast_cat(dense, offsets, jagged.int())
    with pytest.raises(ValueError, match="dense must have 2 dims"):
        jagged_broadcast_cat(dense.view(-1), offsets, jagged)
    with pytest.raises(ValueError, match="offsets"):
        jagged_broadcast_cat(dense, offsets.float(), jagged)


def test_mixed_dtypes_promote_as_cat_does():
    """Under autocast the model's dense rows are fp32 and its candidates bf16: the result is torch.cat's."""
    dense, offsets, jagged, _ = _inputs([2, 0, 3], 4, 3)
    jagged = jagged.bfloat16().requires_grad_()
    dense.requires_grad_()
    out = jagged_broadcast_cat(dense, offsets, jagged)
    want = torch.cat([dense.repeat_interleave(offsets.diff(), 0), jagged], 1)
    assert out.dtype == want.dtype == torch.float32 and torch.equal(out, want)
    grads = torch.autograd.grad(out, (dense, jagged), torch.ones_like(out))
    assert grads[1].dtype == torch.bfloat16 and grads[0].dtype == torch.float32


@needs_native
def test_noncontiguous_inputs():
    dense, offsets, jagged, _ = _inputs([2, 0, 3], 8, 6)
    got = jagged_broadcast_cat(dense.t().contiguous().t(), offsets, jagged[:, ::2])
    assert torch.equal(got, _loops(dense, offsets, jagged[:, ::2], torch.zeros(5, 11))[0])


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_opcheck(index_dtype):
    dense, offsets, jagged, grad = _inputs([2, 0, 3, 1], 5, 3, index_dtype=index_dtype)
    torch.library.opcheck(jagged_broadcast_cat_op, (dense.requires_grad_(), offsets, jagged.requires_grad_()))
    torch.library.opcheck(jagged_broadcast_cat_backward_op, (grad.requires_grad_(), offsets, 5))
    if NATIVE:
        torch.library.opcheck(torch.ops.gem_kernels.jagged_broadcast_cat_native.default,
                              (dense.detach(), offsets, jagged.detach()), test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(torch.ops.gem_kernels.jagged_broadcast_cat_backward_native.default,
                              (grad.detach(), offsets, 5), test_utils=("test_schema", "test_faketensor"))


def test_gradcheck_and_double_backward():
    """fp64: the backward is the forward's adjoint, and the backward op's gradient is the forward again."""
    dense, offsets, jagged, _ = _inputs([2, 0, 3, 1], 4, 2, torch.float64)
    from gem_kernels.reference import float64_ground_truth

    with float64_ground_truth():
        torch.autograd.gradcheck(lambda d, j: jagged_broadcast_cat(d, offsets, j),
                                 (dense.requires_grad_(), jagged.requires_grad_()))
        torch.autograd.gradgradcheck(lambda d, j: jagged_broadcast_cat(d, offsets, j), (dense, jagged))

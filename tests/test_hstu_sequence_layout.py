"""gem_kernels.ops.jagged.hstu_sequence_layout: the native CPU pass against its plain-PyTorch twin."""

import pytest
import torch

from gem_kernels.ops.jagged import hstu_sequence_layout
from gem_kernels.reference.jagged import hstu_sequence_layout as reference

NATIVE = hasattr(torch.ops.gem_kernels, "hstu_sequence_layout_native")
needs_native = pytest.mark.skipif(not NATIVE, reason="gem_kernels._C without hstu_sequence_layout_native")


def _inputs(history_lengths, num_candidates, seed=0):
    gen = torch.Generator().manual_seed(seed)
    history_lengths = torch.tensor(history_lengths, dtype=torch.int64)
    num_candidates = torch.tensor(num_candidates, dtype=torch.int64)
    history_offsets = torch.cat([history_lengths.new_zeros(1), history_lengths.cumsum(0)])
    history_timestamps = torch.randint(0, 10**9, (int(history_offsets[-1]),), generator=gen)
    request_timestamps = torch.randint(0, 10**9, (num_candidates.numel(),), generator=gen)
    return history_offsets, num_candidates, request_timestamps, history_timestamps


def _cases():
    yield [], []                               # no user
    yield [0], [0]                             # one empty user
    yield [5], [1]
    yield [0, 3, 0, 1], [2, 0, 0, 3]           # users without history, without candidates, without both
    yield [3, 0], [0, 0]                       # a last history item followed by another user's rows
    gen = torch.Generator().manual_seed(1)
    for users in (2, 7, 33, 256):
        yield (torch.randint(0, 21, (users,), generator=gen).tolist(),
               torch.randint(0, 5, (users,), generator=gen).tolist())


@needs_native
@pytest.mark.parametrize("contextual_len", [0, 1, 2, 3])
def test_native_equals_reference(contextual_len):
    for i, (history_lengths, num_candidates) in enumerate(_cases()):
        args = _inputs(history_lengths, num_candidates, seed=i)
        num_rows = sum(num_candidates)
        got = hstu_sequence_layout(*args, contextual_len, num_rows)
        want = reference(*args, contextual_len, num_rows)
        for name, g, w in zip(("seq_offsets", "rows", "candidate_owner", "timestamps", "query_timestamps"), got, want):
            assert g.dtype == w.dtype == torch.int64, name
            assert torch.equal(g, w), (name, history_lengths, num_candidates, g, w)


def test_layout_semantics():
    """The documented layout, element by element, on both paths (int32 inputs take the reference)."""
    history_lengths, num_candidates, c = [2, 0, 3], [1, 2, 0], 2
    args = _inputs(history_lengths, num_candidates)
    history_offsets, _, request, history_ts = args
    for inputs in (args, tuple(t.int() for t in args)):
        seq_offsets, rows, owner, ts, qts = hstu_sequence_layout(*inputs, c, 3)
        assert seq_offsets.tolist() == [0, 5, 9, 14]
        assert owner.tolist() == [0, 1, 1]
        # Source rows [context of users 0, 1, 2; history; candidates] -> their sequence rows.
        assert rows.tolist() == [0, 1, 5, 6, 9, 10] + [2, 3, 11, 12, 13] + [4, 7, 8]
        assert sorted(rows.tolist()) == list(range(14))
        for user in range(3):
            seq = slice(int(seq_offsets[user]), int(seq_offsets[user + 1]))
            hist = history_ts[int(history_offsets[user]):int(history_offsets[user + 1])].to(ts.dtype)
            r = int(request[user])
            assert ts[seq][:c].tolist() == [r] * c
            assert ts[seq][c:c + hist.numel()].tolist() == hist.tolist()
            assert ts[seq][c + hist.numel():].tolist() == [r] * num_candidates[user]
            # Query: the next history item, the request for the last one (user 2 has no candidate).
            assert qts[seq][c:c + hist.numel()].tolist() == hist[1:].tolist() + [r] * (hist.numel() > 0)
            assert qts[seq][:c].tolist() == [r] * c


@needs_native
@pytest.mark.parametrize("change, match", [
    (lambda a: (a[0] + 1,) + a[1:], r"history_offsets\[0\] must be 0"),
    (lambda a: (a[0].flip(0) * 0 + torch.tensor([0, 3, 1, 4]),) + a[1:], "nondecreasing"),
    (lambda a: (a[0] * 2,) + a[1:], r"history_offsets\[-1\]"),
    (lambda a: (a[0], torch.tensor([1, -1, 3])) + a[2:], "num_candidates must be >= 0"),
    (lambda a: (a[0], torch.tensor([1, 1, 2])) + a[2:], "sum to num_rows"),
])
def test_native_refuses_bad_values(change, match):
    args = change(_inputs([1, 2, 1], [1, 0, 2]))
    with pytest.raises(ValueError, match=match):
        hstu_sequence_layout(*args, 2, 3)


def test_refuses_bad_arguments():
    args = _inputs([1, 2], [1, 1])
    with pytest.raises(ValueError, match="request_timestamps"):
        hstu_sequence_layout(args[0], args[1], args[2][:1], args[3], 2, 2)
    with pytest.raises(ValueError, match="history_offsets"):
        hstu_sequence_layout(args[0][:2], *args[1:], 2, 2)
    with pytest.raises((TypeError, ValueError), match="history_timestamps"):
        hstu_sequence_layout(*args[:3], args[3].float(), 2, 2)
    with pytest.raises(ValueError, match="contextual_len"):
        hstu_sequence_layout(*args, -1, 2)
    with pytest.raises(ValueError, match="num_rows"):
        hstu_sequence_layout(*args, 2, 1.5)


@needs_native
def test_opcheck():
    args = _inputs([3, 0, 2], [1, 2, 1])
    torch.library.opcheck(torch.ops.gem_kernels.hstu_sequence_layout_native.default, (*args, 2, 4),
                          test_utils=("test_schema", "test_faketensor"))

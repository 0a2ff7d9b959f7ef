"""gk.cached_jagged_attention: the last delta rows of the full jagged attention, and generative-recommenders'
pytorch_cached_hstu_mha."""

from __future__ import annotations

import pytest
import torch

import gem_kernels as gk
from gem_kernels.ops.cached_attention import cached_jagged_attention_fwd_op

from .utils import assert_close, offsets_from_lengths, randn_nonzero

# cpu runs the CUDA kernel under GK_CUDA_EMU=1 (tests/cuda_emu); triton runs in the interpreter here.
BACKENDS = ("reference", "cpu", pytest.param("triton", marks=pytest.mark.triton))


def _case(lengths, delta, *, H=2, D=5, Dv=3, max_seq_len=None, seed=0, dtype=torch.float32, num_buckets=0,
          pos=False):
    """(full q, k, v, seq_offsets, max_seq_len, delta_q, extras): delta_q is q's last delta rows of every sequence."""
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(lengths)
    n = int(offsets[-1])
    max_seq_len = max_seq_len or max(max(lengths, default=1), 1)
    q, k = (randn_nonzero(n, H, D, generator=g, dtype=dtype) for _ in range(2))
    v = randn_nonzero(n, H, Dv, generator=g, dtype=dtype)
    rows = torch.cat([torch.arange(int(e) - delta, int(e)) for e in offsets[1:]]) if lengths else \
        torch.zeros(0, dtype=torch.long)
    extras = {}
    if pos:
        extras["pos_bias"] = torch.randn(H, 2 * max_seq_len - 1, generator=g)
    if num_buckets:
        extras["time_bias"] = torch.randn(1, num_buckets + 1, generator=g)
        extras["timestamps"] = torch.randint(0, 5000, (n,), generator=g).sort().values
    return q, k, v, offsets, max_seq_len, rows, extras


def _full_rows(q, k, v, offsets, max_seq_len, rows, kind, query_timestamps=None, **kw):
    full_tq = None
    if query_timestamps is not None:
        full_tq = kw["timestamps"].clone()
        full_tq[rows] = query_timestamps
    out = gk.jagged_attention(q, k, v, offsets, max_seq_len, kind=kind, causal=True, backend="reference",
                              query_timestamps=full_tq, **kw)
    return out[rows]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["hstu", "softmax"])
@pytest.mark.parametrize("options", [
    {},
    {"num_targets": [2, 3, 3, 1, 3]},
    {"contextual_len": 2, "num_targets": [3, 1, 2, 3, 3]},
    {"max_attn_len": 4},
    {"pos": True, "num_buckets": 7},
    {"pos": True, "num_buckets": 7, "contextual_len": 1, "num_targets": [3, 3, 3, 3, 3], "query_ts": True},
])
def test_equals_last_rows_of_full_attention(backend, kind, options):
    # 131 and 259: the delta rows span query tiles of the cpu kernel (128 rows) and start mid-tile.
    lengths, delta = [3, 8, 131, 4, 259], 3
    options = dict(options)
    q, k, v, offsets, max_seq_len, rows, extras = _case(lengths, delta, num_buckets=options.pop("num_buckets", 0),
                                                        pos=options.pop("pos", False), max_seq_len=300)
    if "num_targets" in options:
        options["num_targets"] = torch.tensor(options["num_targets"])
    query_ts = None
    if options.pop("query_ts", False):
        query_ts = extras["timestamps"][rows] + 17
    expected = _full_rows(q, k, v, offsets, max_seq_len, rows, kind, query_timestamps=query_ts, **extras, **options)
    out = gk.cached_jagged_attention(q[rows], k, v, offsets, max_seq_len, kind=kind, query_timestamps=query_ts,
                                     backend=backend, **extras, **options)
    assert out.shape == (len(rows), 2, 3)
    assert_close(out, expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["hstu", "softmax"])
def test_delta_spanning_several_query_tiles(backend, kind):
    # delta = 70: two query tiles of triton's interpreter (64 rows), five of the cuda kernel's (16), and
    # a whole sequence (length 70) next to longer ones.
    lengths, delta = [70, 131, 200], 70
    q, k, v, offsets, max_seq_len, rows, extras = _case(lengths, delta, num_buckets=5, pos=True)
    num_targets = torch.tensor([0, 65, 70])
    expected = _full_rows(q, k, v, offsets, max_seq_len, rows, kind, num_targets=num_targets, **extras)
    out = gk.cached_jagged_attention(q[rows], k, v, offsets, max_seq_len, kind=kind, num_targets=num_targets,
                                     backend=backend, **extras)
    assert_close(out, expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_follow_the_full_op(backend, dtype):
    lengths, delta = [5, 140, 7], 4
    q, k, v, offsets, max_seq_len, rows, _ = _case(lengths, delta, dtype=dtype)
    expected = gk.jagged_attention(q.float(), k.float(), v.float(), offsets, max_seq_len, kind="hstu",
                                   backend="reference")[rows]
    eager = gk.jagged_attention(q, k, v, offsets, max_seq_len, kind="hstu", backend="reference")[rows]
    out = gk.cached_jagged_attention(q[rows], k, v, offsets, max_seq_len, backend=backend)
    assert out.dtype == dtype
    err = (out.float() - expected).abs().max().item()
    eager_err = (eager.float() - expected).abs().max().item()
    assert err <= 2 * eager_err + torch.finfo(dtype).eps


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [{}, {"num_targets": True}, {"contextual_len": 2}, {"max_attn_len": 3}])
def test_equals_generative_recommenders_cached_hstu_mha(backend, options):
    pytest.importorskip("fbgemm_gpu", reason="GR's cached attention pads with fbgemm's jagged_to_padded_dense")
    gr = pytest.importorskip("generative_recommenders.ops.pytorch.pt_hstu_attention",
                             reason="generative-recommenders is not importable (put its checkout on PYTHONPATH)")
    lengths, delta, max_seq_len = [6, 9, 133, 4], 4, 140
    q, k, v, offsets, _, rows, _ = _case(lengths, delta, max_seq_len=max_seq_len, D=8, Dv=8)
    num_targets = torch.tensor([4, 2, 4, 3]) if options.get("num_targets") else None
    c, mal = options.get("contextual_len", 0), options.get("max_attn_len", 0)
    alpha = 0.37
    expected = gr.pytorch_cached_hstu_mha(max_seq_len, alpha, q[rows], k, v, offsets, num_targets=num_targets,
                                          max_attn_len=mal, contextual_seq_len=c)
    out = gk.cached_jagged_attention(q[rows], k, v, offsets, max_seq_len, kind="hstu", num_targets=num_targets,
                                     contextual_len=c, max_attn_len=mal, scale=alpha, backend=backend)
    assert_close(out, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches(backend):
    q = torch.zeros(0, 2, 4)
    out = gk.cached_jagged_attention(q, q, torch.zeros(0, 2, 3), torch.zeros(1, dtype=torch.long), 5,
                                     backend=backend)
    assert out.shape == (0, 2, 3)
    # delta = 0 with sequences: no query rows.
    _, k, v, offsets, max_seq_len, _, _ = _case([3, 0, 2], 0)
    out = gk.cached_jagged_attention(torch.zeros(0, 2, 5), k, v, offsets, max_seq_len, backend=backend)
    assert out.shape == (0, 2, 3)
    # A zero-length sequence needs delta = 0; whole rows of delta == L are the full attention.
    q, k, v, offsets, max_seq_len, rows, _ = _case([3, 3], 3)
    assert_close(gk.cached_jagged_attention(q, k, v, offsets, max_seq_len, backend=backend),
                 gk.jagged_attention(q, k, v, offsets, max_seq_len, kind="hstu", backend="reference"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_name_the_argument(backend):
    q, k, v, offsets, max_seq_len, rows, extras = _case([4, 6], 2, num_buckets=3)
    dq = q[rows]

    def call(**kw):
        args = dict(delta_q=dq, k=k, v=v, seq_offsets=offsets, max_seq_len=max_seq_len, backend=backend)
        args.update(kw)
        return gk.cached_jagged_attention(**args)

    with pytest.raises(ValueError, match="delta_q must have B \\* delta rows"):
        call(delta_q=q[:5])
    with pytest.raises(ValueError, match="sequence 0 has length 4"):
        call(delta_q=q[:10])
    with pytest.raises(ValueError, match="k must have delta_q's dtype"):
        call(k=k.half())
    with pytest.raises(ValueError, match="k must have shape"):
        call(k=k[:, :1])
    with pytest.raises(ValueError, match="v must have shape"):
        call(v=v[:3])
    with pytest.raises(ValueError, match="kind must be one of"):
        call(kind="relu")
    with pytest.raises(ValueError, match="max_seq_len must be >= every sequence length"):
        call(max_seq_len=5)
    with pytest.raises(ValueError, match="num_targets\\[1\\] must be in"):
        call(num_targets=torch.tensor([1, 7]))
    with pytest.raises(ValueError, match="seq_offsets\\[-1\\] must equal"):
        call(seq_offsets=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="query_timestamps must have B \\* delta = 4"):
        call(time_bias=extras["time_bias"], timestamps=extras["timestamps"], query_timestamps=torch.zeros(3).long())
    with pytest.raises(ValueError, match="timestamps must have N = 10"):
        call(time_bias=extras["time_bias"], timestamps=extras["timestamps"][:4])
    with pytest.raises(ValueError, match="delta_q must have 0 rows when B = 0"):
        call(seq_offsets=torch.zeros(1, dtype=torch.long))


def test_cuda_backend_refuses_cpu_tensors():
    q, k, v, offsets, max_seq_len, rows, _ = _case([4, 6], 2)
    with pytest.raises(gk.BackendUnavailableError, match="backend 'cuda'"):
        gk.cached_jagged_attention(q[rows], k, v, offsets, max_seq_len, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("backend", ["cuda", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("kind", ["hstu", "softmax"])
def test_gpu_backends_equal_last_rows_of_full_attention(backend, kind):
    lengths, delta = [3, 8, 131, 4, 259], 3
    q, k, v, offsets, max_seq_len, rows, extras = _case(lengths, delta, num_buckets=7, pos=True, max_seq_len=300)
    num_targets = torch.tensor([3, 3, 3, 3, 3])
    query_ts = extras["timestamps"][rows] + 17
    expected = _full_rows(q, k, v, offsets, max_seq_len, rows, kind, query_timestamps=query_ts, contextual_len=1,
                          num_targets=num_targets, **extras)
    cuda = {name: t.cuda() for name, t in extras.items()}
    out = gk.cached_jagged_attention(q[rows].cuda(), k.cuda(), v.cuda(), offsets.cuda(), max_seq_len, kind=kind,
                                     num_targets=num_targets.cuda(), contextual_len=1, query_timestamps=query_ts.cuda(),
                                     backend=backend, **cuda)
    assert_close(out.cpu(), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_raises(backend):
    q, k, v, offsets, max_seq_len, rows, _ = _case([4, 6], 2)
    dq = q[rows].requires_grad_()
    out = gk.cached_jagged_attention(dq, k, v, offsets, max_seq_len, backend=backend)
    with pytest.raises(RuntimeError, match="forward-only"):
        out.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    q, k, v, offsets, max_seq_len, rows, extras = _case([4, 6, 3], 2, num_buckets=3, pos=True)
    args = (q[rows], k, v, offsets, max_seq_len, "softmax", 0.5, torch.tensor([1, 2, 0]), 1, 0, extras["pos_bias"],
            extras["time_bias"], extras["timestamps"], None, backend)
    torch.library.opcheck(cached_jagged_attention_fwd_op, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))

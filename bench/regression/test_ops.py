"""One quick timed case per op and backend; each verified against the reference before timing."""

from __future__ import annotations

import pytest
import torch

import gem_kernels as gk
from gem_kernels import _backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_NATIVE = "cuda" if DEVICE == "cuda" else "cpu"


def _backends():
    params = []
    for backend in ("reference", _NATIVE, "triton"):
        reason = _backend.unavailable_reason(backend)
        if backend == "triton" and DEVICE == "cpu":
            reason = "Triton runs only in the CPU interpreter here: too slow to time"
        params.append(pytest.param(backend, marks=[pytest.mark.skip(reason=reason)] if reason else [], id=backend))
    return params


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _cases():
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    lengths = torch.randint(0, 64, (32,), generator=g)
    offsets = torch.zeros(33, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    offsets = offsets.to(DEVICE)
    values = rnd(int(lengths.sum()), 64)
    padded = rnd(32, 64, 64)
    specs = [gk.TableSpec(1000, 64)] * 4
    module = gk.FusedEmbeddingBag(specs, device=DEVICE)
    bag_lengths = torch.randint(0, 20, (4 * 64,), generator=g)
    bag_offsets = torch.zeros(4 * 64 + 1, dtype=torch.int64)
    bag_offsets[1:] = bag_lengths.cumsum(0)
    indices = torch.randint(0, 1000, (int(bag_lengths.sum()),), generator=g).to(DEVICE)
    bag_offsets = bag_offsets.to(DEVICE)
    qkv_len = torch.randint(1, 48, (8,), generator=g)
    seq = torch.zeros(9, dtype=torch.int64)
    seq[1:] = qkv_len.cumsum(0)
    n = int(seq[-1])
    q, k, v = rnd(n, 2, 32), rnd(n, 2, 32), rnd(n, 2, 32)
    seq = seq.to(DEVICE)
    x, x0 = rnd(64, 27, 32), rnd(64, 128)
    w, b = rnd(128, 128) / 12, rnd(128) / 12
    y, mix = rnd(27, 8), rnd(16, 27) / 5
    return {
        "jagged_to_padded": lambda be: gk.jagged_to_padded(values, offsets, 64, backend=be),
        "padded_to_jagged": lambda be: gk.padded_to_jagged(padded, offsets, backend=be),
        "embedding_bag": lambda be: gk.embedding_bag(module.weights, module.table_meta, indices, bag_offsets, None,
                                                     output_dim=module.output_dim, backend=be),
        "jagged_attention_softmax": lambda be: gk.jagged_attention(q, k, v, seq, 48, kind="softmax", backend=be),
        "jagged_attention_hstu": lambda be: gk.jagged_attention(q, k, v, seq, 48, kind="hstu", backend=be),
        "dot_interaction": lambda be: gk.dot_interaction(x, backend=be),
        "cross_layer": lambda be: gk.cross_layer(x0, x0, w, b, backend=be),
        "fm_compress": lambda be: gk.fm_compress(x, y, backend=be),
        "feature_mix_norm": lambda be: gk.feature_mix_norm(x, mix, backend=be),
    }


CASES = _cases()


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("op", list(CASES))
def test_op(benchmark, op, backend):
    fn = CASES[op]
    with torch.no_grad():
        expected = fn("reference")
        got = fn(backend)
        # NOTE: fp32 sums in another order than the reference's: a few ulps of the sums.
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

        def call():
            fn(backend)
            _sync()

        benchmark.group = op
        benchmark(call)

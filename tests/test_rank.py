"""KV-cached ranking: gk.inference.KVCache, HSTULayer.cached_forward and GemModel.rank equal the uncached model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gem_kernels as gk
from gem_kernels.inference import KVCache
from gem_kernels.nn import HSTULayer
from model.config import GemConfig
from model.data import make_batch
from model.gem import GemModel

from .utils import assert_close, offsets_from_lengths

H, DA, DL = 2, 4, 3


def _rows(n, dim, seed):
    return torch.randn(n, H, dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("page_size", [None, 1, 3])
def test_kv_cache_append_truncate_gather(page_size):
    cache = KVCache(2, H, DA, DL, page_size=page_size)
    expected = {}
    for user, n in ((7, 5), (2, 0), (9, 4)):
        k, v, ts = _rows(n, DA, user), _rows(n, DL, user + 100), torch.arange(n) * 10 + user
        cache.append(1, user, k, v, ts)
        expected[user] = (k, v, ts)
    more = (_rows(2, DA, 55), _rows(2, DL, 56), torch.tensor([100, 101]))
    cache.append(1, 7, *more)
    expected[7] = tuple(torch.cat([a, b]) for a, b in zip(expected[7], more))
    cache.truncate(9, 1)
    expected[9] = tuple(t[:1] for t in expected[9])
    k, v, ts, offsets = cache.gather(1, [9, 7, 2, 4])
    assert offsets.tolist() == [0, 1, 8, 8, 8]
    for name, i in (("k", 0), ("v", 1), ("ts", 2)):
        got = (k, v, ts)[i]
        assert torch.equal(got, torch.cat([expected[9][i], expected[7][i]])), name
    assert cache.length(7, 1) == 7 and cache.length(7, 0) == 0 and cache.length(4, 1) == 0
    row_bytes = H * (DA + DL) * 4 + 8
    assert cache.nbytes() == 8 * row_bytes
    if page_size is not None:
        stats = cache.memory_stats()
        # Truncation returned user 9's pages: it holds one row, so ceil(1 / page) pages.
        used = -(-7 // page_size) + -(-1 // page_size)
        assert stats["pages"] - stats["free_pages"] == used
        assert cache.reserved_bytes() >= cache.nbytes()
    cache.remove(7)
    assert cache.gather(1, [7])[1].shape == (0, H, DL) and cache.users(1) == [2, 9]


def test_kv_cache_paged_users_share_the_pool_without_moving_rows():
    cache = KVCache(1, H, DA, DL, page_size=2, num_pages=4)
    a, b = _rows(3, DA, 1), _rows(3, DA, 2)
    cache.append(0, 0, a, _rows(3, DL, 3))
    cache.append(0, 1, b, _rows(3, DL, 4))
    pages_0 = list(cache._pages[0][0])
    cache.append(0, 0, _rows(5, DA, 5), _rows(5, DL, 6))  # grows the pool past 4 pages
    assert cache._pages[0][0][:2] == pages_0
    assert cache.memory_stats()["pages"] >= 6
    assert torch.equal(cache.gather(0, [1])[0], b)
    cache.truncate(0, 0)
    assert cache.memory_stats()["free_pages"] == cache.memory_stats()["pages"] - 2


def test_kv_cache_bad_arguments():
    with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
        KVCache(1, 0, DA, DL)
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        KVCache(1, H, DA, DL, page_size=0)
    cache = KVCache(1, H, DA, DL)
    with pytest.raises(ValueError, match="k must have shape \\[n, 2, 4\\]"):
        cache.append(0, 0, _rows(2, DL, 0), _rows(2, DL, 0))
    with pytest.raises(IndexError, match="layer must be an int in \\[0, 1\\)"):
        cache.append(3, 0, _rows(2, DA, 0), _rows(2, DL, 0))
    with pytest.raises(ValueError, match="length must be an int >= 0"):
        cache.truncate(0, -1)
    cache.append(0, 0, _rows(2, DA, 0), _rows(2, DL, 0), torch.arange(2))
    with pytest.raises(ValueError, match="has rows with timestamps"):
        cache.append(0, 0, _rows(2, DA, 0), _rows(2, DL, 0))


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    layer = gk.nn.HSTULayer(8, H, DL, DA, **kw).eval()
    with torch.no_grad():
        for p in layer.bias.parameters():  # nonzero biases, so that a wrong position or timestamp shows
            p.normal_()
    return layer


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("page_size", [None, 2])
def test_layer_cached_forward_equals_forward(backend, page_size):
    """Encode each user's first rows, then score the rest in two steps with gaps: equals forward's rows."""
    max_seq_len = 20
    layer = _layer(contextual_len=1, max_seq_len=max_seq_len, num_time_buckets=6, backend=backend)
    prefix, targets = [5, 9], 6
    lengths = [p + targets for p in prefix]
    offsets = offsets_from_lengths(lengths)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(int(offsets[-1]), 8, generator=g)
    ts = torch.randint(0, 10**6, (x.shape[0],), generator=g).sort().values
    qts = ts + 5
    num_targets = torch.tensor([targets, targets])
    with torch.no_grad():
        expected = layer(x, offsets, max_seq_len, num_targets=num_targets, timestamps=ts, query_timestamps=qts)
        cache = KVCache(1, H, DA, DL, page_size=page_size)
        for b, (start, p) in enumerate(zip(offsets[:-1].tolist(), prefix)):
            rows = slice(start, start + p)
            got = layer.cached_forward(x[rows], cache, 0, [b], max_seq_len, timestamps=ts[rows],
                                       query_timestamps=qts[rows], append=True)
            assert_close(got, expected[rows])
        for k0, m in ((0, 2), (2, 4)):  # two micro-batches of both users at once
            rows = torch.cat([torch.arange(s + p + k0, s + p + k0 + m) for s, p in zip(offsets[:-1].tolist(), prefix)])
            got = layer.cached_forward(x[rows], cache, 0, [0, 1], max_seq_len, num_targets=torch.tensor([k0 + m] * 2),
                                       timestamps=ts[rows], query_timestamps=qts[rows],
                                       delta_start=[p + k0 for p in prefix])
            assert_close(got, expected[rows])


def test_cached_forward_bad_arguments():
    layer = _layer(max_seq_len=10)
    cache = KVCache(1, H, DA, DL)
    cache.append(0, 0, _rows(3, DA, 0), _rows(3, DL, 0))
    with torch.no_grad():
        with pytest.raises(ValueError, match="delta_x must have len\\(users\\) \\* delta rows"):
            layer.cached_forward(torch.randn(3, 8), cache, 0, [0, 1], 10)
        with pytest.raises(ValueError, match="delta_start must be"):
            layer.cached_forward(torch.randn(2, 8), cache, 0, [0], 10, delta_start=[1])
    with pytest.raises(ValueError, match="causal"):
        _layer(causal=False).cached_forward(torch.randn(2, 8), cache, 0, [0], 10)


def _model(seed=0):
    cfg = dataclasses.replace(GemConfig.tiny(), num_hstu_layers=2, max_num_candidates=7, contextual_len=2,
                              num_time_buckets=8)
    model = GemModel(cfg, "fused", seed=seed).eval()
    with torch.no_grad():
        for layer in model.sequence_arch.layers:
            for p in layer.bias.parameters():
                p.normal_(generator=torch.Generator().manual_seed(seed + p.numel()))
    return cfg, model


@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("page_size", ["cold", None, 4])
def test_rank_equals_forward(m, page_size):
    """Cold (no cache: runs as forward) and with a fresh kept cache, unpaged or paged (history encoded into it,
    then every candidate of a user scored in one cached pass per layer)."""
    cfg, model = _model()
    batch = make_batch(cfg, 6, torch.Generator().manual_seed(3))
    assert int(batch.num_candidates.max()) > 3  # several micro-batches for m = 1, 3
    with torch.no_grad():
        expected = model(batch)
    layer = model.sequence_arch.layers[0]
    cache = None if page_size == "cold" else KVCache(cfg.num_hstu_layers, layer.num_heads, layer.attention_dim,
                                                     layer.linear_dim, page_size=page_size)
    got = model.rank(batch, candidates_per_microbatch=m, cache=cache)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_rank_runs_every_microbatch_in_one_pass(monkeypatch):
    """No loop over micro-batches: a cold request makes no cached call (it is one fused pass per layer), and a
    warm user's K candidates take one cached_forward per layer whatever m (K / m of them before)."""
    cfg, model = _model()
    batch = make_batch(cfg, 3, torch.Generator().manual_seed(3))
    calls = []
    original = HSTULayer.cached_forward
    monkeypatch.setattr(HSTULayer, "cached_forward", lambda self, *a, **kw: calls.append(kw) or original(self, *a, **kw))
    model.rank(batch, candidates_per_microbatch=1)
    assert calls == []
    layer = model.sequence_arch.layers[0]
    cache = KVCache(cfg.num_hstu_layers, layer.num_heads, layer.attention_dim, layer.linear_dim)
    scored = int((batch.num_candidates > 0).sum())
    model.rank(batch, candidates_per_microbatch=1, cache=cache)  # also encodes the 3 histories: a call per layer
    assert len(calls) == cfg.num_hstu_layers * (3 + scored)
    calls.clear()
    model.rank(batch, candidates_per_microbatch=1, cache=cache)
    assert len(calls) == cfg.num_hstu_layers * scored
    assert all(not kw.get("append", False) for kw in calls)


def test_rank_reuses_a_kept_cache():
    """A cache kept across requests is not encoded again: a second request of the same shapes but another
    history is scored against the first one's cached rows (the caller's to keep in step)."""
    cfg, model = _model()
    batch = make_batch(cfg, 3, torch.Generator().manual_seed(3))
    layer = model.sequence_arch.layers[0]
    cache = KVCache(cfg.num_hstu_layers, layer.num_heads, layer.attention_dim, layer.linear_dim, page_size=4)
    with torch.no_grad():
        expected = model(batch)
    torch.testing.assert_close(model.rank(batch, 2, cache=cache, user_ids=[10, 11, 12]), expected, atol=1e-5,
                               rtol=1e-5)
    assert cache.users(0) == [10, 11, 12]
    other = dataclasses.replace(batch, history_ids=torch.flip(batch.history_ids, [0]))
    torch.testing.assert_close(model.rank(other, 2, cache=cache, user_ids=[10, 11, 12]), expected, atol=1e-5,
                               rtol=1e-5)
    cache.remove(11)  # encoded again from `other`'s history: user 11's scores change
    moved = model.rank(other, 2, cache=cache, user_ids=[10, 11, 12])
    with torch.no_grad():
        fresh = model(other)
    rows = torch.repeat_interleave(torch.arange(3), batch.num_candidates) == 1
    torch.testing.assert_close(moved[rows], fresh[rows], atol=1e-5, rtol=1e-5)


def test_rank_bad_microbatch():
    cfg, model = _model()
    batch = make_batch(cfg, 2, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="candidates_per_microbatch must be an int >= 1"):
        model.rank(batch, candidates_per_microbatch=0)

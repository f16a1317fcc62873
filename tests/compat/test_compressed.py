"""Facade 002: compressed multi-head KV cache (quality contract, documented API, paging).

The quantiser's own building blocks are tested in test_turboquant.py.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from paged_kv.compat.compressed import (
    DimensionMismatch,
    KvCacheCompressor,
    KvCacheConfig,
    MultiHeadKvCache,
    NonFiniteInput,
    compressed_pool,
)
from paged_kv.errors import InvalidArgumentError, OutOfBlocksError, PagedKVError

D = 16
CFG = KvCacheConfig(D, 4, 32, 7)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def filled(
    n: int, cfg: KvCacheConfig = CFG, seed: int = 0, **kw
) -> tuple[KvCacheCompressor, torch.Tensor, torch.Tensor]:
    """A compressor holding n random (key, value) pairs; returns it with the keys and values."""
    c = KvCacheCompressor(cfg, **kw)
    keys, values = randn(n, cfg.head_dim, seed=seed), randn(n, cfg.head_dim, seed=seed + 1000)
    for k, v in zip(keys, values):
        c.push(k, v)
    return c, keys, values


def state(c: KvCacheCompressor) -> tuple:
    """Everything observable about a compressor (and its pool's page accounting)."""
    q = np.linspace(-1, 1, c.config.head_dim)
    return (
        c.len(), c.num_pages, c.pool.manager.gpu.num_free,
        c.decode_keys().tobytes(), c.decode_values().tobytes(), c.attention_scores(q).tobytes(),
    )


def mh_state(m: MultiHeadKvCache) -> tuple:
    return tuple(state(m.head(h)) for h in range(m.num_heads()))


# -- quality: the documented contract ------------------------------------------
def scores_over_seeds(bits: int, projections: int, seeds: int, keys: torch.Tensor, q: torch.Tensor):
    """Per seed, the estimated and the decode-based scores of every key: two ``[seeds, n]`` arrays.

    A MultiHeadKvCache of ``seeds`` heads seeds head h with ``seed + h``: one independent quantiser each.
    """
    cfg = KvCacheConfig(keys.shape[1], bits, projections, 1000)
    m = MultiHeadKvCache(seeds, cfg)
    for k in keys:
        m.push_token(k.expand(seeds, -1), k.expand(seeds, -1))
    est = np.stack(m.attention_scores(q.expand(seeds, -1)))
    via_decode = np.stack([m.head(h).decode_keys() @ q.numpy() for h in range(seeds)]) / math.sqrt(cfg.head_dim)
    return est, via_decode


def test_scores_are_unbiased_over_seeds_while_plain_decoding_is_not():
    keys, q = randn(4, D, seed=3), randn(D, seed=4)
    true = (keys @ q).numpy() / math.sqrt(D)
    n = 400
    est, via_decode = scores_over_seeds(1, 16, n, keys, q)
    err = est - true
    z = err.mean(0) / (err.std(0) / math.sqrt(n))
    assert np.all(np.abs(z) < 4), z  # the QJL-corrected estimator is unbiased
    # The codes alone shrink inner products (by ~2/pi at 1 bit): a detectable bias the sketch removes.
    ratio = via_decode.mean(0) / true
    assert np.all(np.abs(ratio - 2 / math.pi) < 0.15), ratio


def rmse(bits: int, projections: int) -> float:
    keys, q = randn(6, D, seed=5), randn(D, seed=6)
    est, _ = scores_over_seeds(bits, projections, 24, keys, q)
    return float(np.sqrt(((est - (keys @ q).numpy() / math.sqrt(D)) ** 2).mean()))


def test_score_error_falls_as_bits_grow():
    errors = [rmse(bits, 16) for bits in (1, 2, 4, 8)]
    assert all(a > 1.5 * b for a, b in zip(errors, errors[1:])), errors


def test_score_error_falls_as_projections_grow():
    errors = [rmse(1, m) for m in (4, 32, 256)]
    assert all(a > 1.5 * b for a, b in zip(errors, errors[1:])), errors


def test_decode_reconstructs_keys_and_values_within_the_quantiser_error():
    cfg = KvCacheConfig(32, 8, 32, 1)
    c, keys, values = filled(20, cfg)
    for got, want in ((c.decode_keys(), keys), (c.decode_values(), values)):
        assert got.dtype == np.float32 and got.shape == (20, 32)
        rel = np.linalg.norm(got - want.numpy(), axis=1) / np.linalg.norm(want.numpy(), axis=1)
        assert rel.max() < 0.02
    true = (keys @ randn(32, seed=9)).numpy() / math.sqrt(32)
    assert np.allclose(c.attention_scores(randn(32, seed=9)), true, atol=0.05)


def test_decode_with_residual_is_unbiased_and_zero_vectors_stay_zero():
    n = 200
    m = MultiHeadKvCache(n, KvCacheConfig(8, 1, 8, 5))
    k = randn(8, seed=11)
    m.push_token(k.expand(n, -1), torch.zeros(n, 8))
    dec = np.stack([m.head(h).decode_keys(with_residual=True)[0] for h in range(n)])
    z = (dec.mean(0) - k.numpy()) / (dec.std(0) / math.sqrt(n))
    assert np.all(np.abs(z) < 4), z
    assert not np.allclose(dec[0], m.head(0).decode_keys()[0])  # the residual term is really added
    assert np.all(m.head(3).decode_values(with_residual=True) == 0)
    assert np.all(m.head(3).attention_scores(randn(8)) != 0)


@pytest.mark.parametrize("head_dim, bits", [(1, 1), (5, 3), (7, 16)])
def test_odd_sizes_and_widths_round_trip(head_dim, bits):
    cfg = KvCacheConfig(head_dim, bits, 9, 3)
    c, keys, values = filled(6, cfg, block_size=4)
    scale = np.linalg.norm(keys.numpy(), axis=1, keepdims=True)
    tol = 1e-3 if bits == 16 else 0.6  # 16 bits: nearly exact; 3 bits in 5 dims: coarse
    assert np.all(np.abs(c.decode_keys() - keys.numpy()) <= tol * scale)
    if head_dim == 1:  # the rotation is +-1 and the 1-bit levels +-1: one dimension is stored exactly
        assert np.allclose(c.decode_values(), values.numpy(), rtol=1e-6)


def test_same_seed_same_codes_other_seed_other_codes():
    a, keys, _ = filled(5)
    b, _, _ = filled(5)
    other, _, _ = filled(5, dataclasses.replace(CFG, seed=8))
    q = randn(D, seed=2)
    assert np.array_equal(a.attention_scores(q), b.attention_scores(q))
    assert not np.array_equal(a.attention_scores(q), other.attention_scores(q))


# -- KvCacheCompressor: documented methods --------------------------------------
def test_push_len_is_empty_and_accepted_input_kinds():
    c = KvCacheCompressor(CFG)
    assert c.len() == 0 and c.is_empty() and len(c) == 0
    assert c.attention_scores([0.5] * D).shape == (0,)
    assert c.decode_keys().shape == (0, D) and c.compression_ratio() == 1.0
    k = randn(D)
    c.push(k, k)  # torch
    c.push(k.numpy().astype(np.float64), k.numpy())  # NumPy of any float dtype
    c.push(k.tolist(), list(range(D)))  # plain sequences, ints included
    assert c.len() == 3 and not c.is_empty()
    scores = c.attention_scores(k.tolist())
    assert scores.dtype == np.float32 and scores.shape == (3,)
    assert scores[0] == scores[1] == scores[2]
    assert np.linalg.norm(c.decode_values()[2] - np.arange(D)) < 0.2 * np.linalg.norm(np.arange(D))


@pytest.mark.parametrize(
    "key, value, error, name",
    [
        (np.ones(D + 1), np.ones(D), DimensionMismatch, "key"),
        (np.ones(D), np.ones(D - 1), DimensionMismatch, "value"),
        (np.ones((1, D)), np.ones(D), DimensionMismatch, "key"),
        (np.ones(D), [float("nan")] * D, NonFiniteInput, "value"),
        (np.r_[np.ones(D - 1), np.inf], np.ones(D), NonFiniteInput, "key"),
        (np.ones(D), np.full(D, 1e39), NonFiniteInput, "value"),  # overflows float32
        (np.full(D, 1e38), np.ones(D), NonFiniteInput, "key=.*norm 4e"),  # finite, but its norm 4e38 is not
        ("abc", np.ones(D), InvalidArgumentError, "key"),
        (np.ones(D, dtype=bool), np.ones(D), InvalidArgumentError, "key"),
    ],
)
def test_push_errors_are_typed_named_and_change_nothing(key, value, error, name):
    c, _, _ = filled(5, block_size=4)
    before = state(c)
    with pytest.raises(error, match=name) as info:
        c.push(key, value)
    assert isinstance(info.value, (PagedKVError, ValueError))
    assert state(c) == before


def test_attention_scores_errors():
    c, _, _ = filled(3)
    with pytest.raises(DimensionMismatch, match="query"):
        c.attention_scores(np.ones(D - 1))
    with pytest.raises(NonFiniteInput, match="query"):
        c.attention_scores(np.r_[np.nan, np.ones(D - 1)])


def test_a_query_of_any_finite_float32_scores_finite():
    # Queries are not stored, so their norm has no float32 limit: a query of norm 6.8e38 (past float32's
    # maximum, every element finite) scored -inf or NaN when the estimate ran in float32. Its scores are
    # the unit query's, scaled (a power of two: exact); a score past float32's range is +-inf, never NaN.
    c = KvCacheCompressor(CFG)
    for k, v in zip(randn(5, D, seed=1) / 64, randn(5, D, seed=2)):
        c.push(k, v)
    c.push(np.full(D, 2.0**120), np.ones(D))  # a key whose score with the big query is ~2^241
    big, unit = c.attention_scores(np.full(D, 2.0**127)), c.attention_scores(np.ones(D))
    assert big.dtype == np.float32 and np.isfinite(big[:5]).all() and np.isposinf(big[5])
    assert np.allclose(big[:5].astype(np.float64) / 2.0**127, unit[:5], rtol=1e-5, atol=0)
    m = MultiHeadKvCache(2, CFG)
    for t in range(4):
        m.push_token(randn(2, D, seed=t) / 64, randn(2, D, seed=t + 10))
    scaled, plain = m.attention_scores(np.full((2, D), 2.0**127)), m.attention_scores(np.ones((2, D)))
    for h in range(2):
        assert np.isfinite(scaled[h]).all() and np.allclose(scaled[h] / 2.0**127, plain[h], rtol=1e-5, atol=0)
        assert np.array_equal(scaled[h], m.head(h).attention_scores(np.full(D, 2.0**127)))


def test_compression_ratio_counts_the_pages_held():
    cfg = KvCacheConfig(64, 4, 32, 0)
    c, _, _ = filled(1, cfg, block_size=4)
    page = c.pool.bytes_per_page
    assert page == 2 * 4 * cfg.record_bytes and c.nbytes == page
    assert c.compression_ratio() == pytest.approx(2 * 64 * 4 / page)  # one token in a whole page
    for k in randn(3, 64):
        c.push(k, k)
    full = 2 * 64 * 4 / (2 * cfg.record_bytes)  # full pages: 512 float bytes per 88 record bytes
    assert c.compression_ratio() == pytest.approx(full) and full > 5
    finer, _, _ = filled(4, dataclasses.replace(cfg, bits=8), block_size=4)
    assert finer.compression_ratio() < c.compression_ratio()


def test_pages_follow_the_length_and_clear_returns_them():
    c = KvCacheCompressor(CFG, block_size=4)
    free = c.pool.manager.gpu.num_free
    for i, k in enumerate(randn(10, D), start=1):
        c.push(k, -k)
        assert c.num_pages == math.ceil(i / 4)
    c.clear()
    assert c.len() == 0 and c.num_pages == 0 and c.pool.manager.gpu.num_free >= free
    c.push(randn(D), randn(D))  # usable again
    assert c.len() == 1
    c.pool.manager.check()


def test_evict_outside_window_drops_whole_leading_pages():
    c, keys, _ = filled(10, block_size=4)  # pages hold tokens 0-3, 4-7, 8-9
    decoded = c.decode_keys()
    q = randn(D, seed=3)
    scores = c.attention_scores(q)
    c.evict_outside_window(10)
    assert c.len() == 10 and c.num_pages == 3
    c.evict_outside_window(5)  # keeps 5..9: the first page goes back, the second keeps 3 live slots
    assert c.len() == 5 and c.num_pages == 2
    assert np.array_equal(c.decode_keys(), decoded[5:])
    assert np.array_equal(c.attention_scores(q), scores[5:])
    more = randn(3, D, seed=4)
    for k in more:
        c.push(k, k)
    assert c.len() == 8 and c.num_pages == 3  # slots 5..7 | 8..11 | 12
    after, _, _ = filled(0)
    for k in torch.cat([keys[5:], more]):
        after.push(k, k)
    assert np.array_equal(c.decode_keys(), after.decode_keys())
    c.evict_outside_window(0)
    assert c.is_empty() and c.num_pages == 0
    c.pool.manager.check()
    with pytest.raises(InvalidArgumentError, match="window_size"):
        c.evict_outside_window(-1)


def test_copy_shares_pages_and_diverges_both_ways():
    a, _, _ = filled(6, block_size=4)
    used = a.pool.manager.gpu.num_used
    snap = state(a)
    b = a.copy()
    assert a.pool.manager.gpu.num_used == used  # no page copied
    assert b._seq.block_table() == a._seq.block_table()
    k = randn(D, seed=5)
    b.push(k, k)  # lands in the shared, half-full last page: copied for b only
    assert state(a)[3:] == snap[3:] and a.len() == 6
    assert b.len() == 7 and np.array_equal(b.decode_keys()[:6], a.decode_keys())
    a.push(-k, -k)
    assert not np.array_equal(a.decode_keys()[6], b.decode_keys()[6])
    b.evict_outside_window(2)
    assert a.len() == 7 and np.array_equal(a.decode_keys()[:6], np.frombuffer(snap[3], np.float32).reshape(6, D))
    for clone in (copy.copy(a), copy.deepcopy(a)):
        assert np.array_equal(clone.decode_values(), a.decode_values())
    a.pool.manager.check()


def test_random_push_evict_copy_clear_match_a_model():
    rng = np.random.default_rng(5)
    keys, q = randn(60, D, seed=6), randn(D, seed=7)
    ref, _, _ = filled(0)
    for k in keys:
        ref.push(k, -k)
    want = ref.attention_scores(q)  # per token: a score does not depend on the other keys held
    pool = compressed_pool(CFG, block_size=4)
    caches = [(KvCacheCompressor(CFG, pool=pool), [])]  # (cache, indices of the keys it holds)
    pushed = 0
    for step in range(100):
        cache, held = caches[int(rng.integers(len(caches)))]
        op = rng.choice(["push", "evict", "copy", "clear"], p=[0.55, 0.25, 0.15, 0.05])
        if op == "push" and pushed < len(keys):
            cache.push(keys[pushed], -keys[pushed])
            held.append(pushed)
            pushed += 1
        elif op == "evict":
            window = int(rng.integers(len(held) + 2))
            cache.evict_outside_window(window)
            del held[: max(0, len(held) - window)]
        elif op == "copy":  # at most 4 caches: a fifth copy replaces an older copy
            twin = (cache.copy(), list(held))
            if len(caches) < 4:
                caches.append(twin)
            else:
                caches[int(rng.integers(1, 4))] = twin
        elif op == "clear":
            cache.clear()
            held.clear()
        for c, h in caches:
            assert c.len() == len(h) and np.array_equal(c.attention_scores(q), want[h]), step
            assert c.num_pages <= -(-len(h) // 4) + (1 if h else 0)  # at most one page of evicted slots
        pool.manager.check()


def test_caches_sharing_one_pool_stay_isolated():
    pool = compressed_pool(CFG, block_size=4)
    a, _, _ = filled(5, pool=pool)
    b, _, _ = filled(7, pool=pool, seed=50)
    alone, _, _ = filled(5, block_size=4)
    assert np.array_equal(a.decode_keys(), alone.decode_keys())
    a.clear()
    assert b.len() == 7 and b.decode_keys().shape == (7, D)
    with pytest.raises(InvalidArgumentError, match="pool"):
        KvCacheCompressor(dataclasses.replace(CFG, bits=5), pool=pool)
    with pytest.raises(InvalidArgumentError, match="config"):
        KvCacheCompressor({"head_dim": 4})


def test_full_fixed_pool_raises_and_changes_nothing():
    pool = compressed_pool(CFG, block_size=2, num_blocks=1)
    c, _, _ = filled(2, pool=pool)
    before = state(c)
    with pytest.raises(OutOfBlocksError):
        c.push(randn(D), randn(D))
    assert state(c) == before
    shared = c.copy()  # a shared, full page: the next push needs a new page either way
    with pytest.raises(OutOfBlocksError):
        shared.push(randn(D), randn(D))
    assert state(shared) == state(c) == before


# -- MultiHeadKvCache -----------------------------------------------------------
def test_multi_head_seeds_each_head_and_matches_single_heads():
    m = MultiHeadKvCache(3, CFG)
    assert m.num_heads() == 3 and m.is_empty() and m.len() == 0
    keys, values = randn(4, 3, D, seed=1), randn(4, 3, D, seed=2)
    for k, v in zip(keys, values):
        m.push_token(k, [row.tolist() for row in v])  # a 2-D tensor, or a list of vectors
    assert m.len() == 4 and len(m) == 4 and not m.is_empty()
    q = randn(3, D, seed=3)
    scores = m.attention_scores(q)
    assert len(scores) == 3 and all(s.shape == (4,) for s in scores)
    for h in range(3):
        assert m.head(h).config.seed == CFG.seed + h
        single = KvCacheCompressor(dataclasses.replace(CFG, seed=CFG.seed + h))
        for k, v in zip(keys[:, h], values[:, h]):
            single.push(k, v)
        # the same quantiser: equal up to float rounding of batched vs single-head matmuls
        assert np.allclose(scores[h], single.attention_scores(q[h]), rtol=1e-5, atol=1e-6)
        assert np.allclose(m.head(h).decode_values(), single.decode_values(), rtol=1e-5, atol=1e-6)
    assert m.head(3) is None and m.head(-1) is None
    wrap = MultiHeadKvCache(2, dataclasses.replace(CFG, seed=2**64 - 1))
    assert wrap.head(1).config.seed == 0
    m.clear()
    assert m.is_empty() and all(m.head(h).num_pages == 0 for h in range(3))


def test_multi_head_scores_when_empty_and_when_heads_differ_in_length():
    m = MultiHeadKvCache(2, CFG, block_size=4)
    assert [s.shape for s in m.attention_scores(np.ones((2, D)))] == [(0,), (0,)]
    for t in range(6):
        m.push_token(randn(2, D, seed=t), randn(2, D, seed=t + 1))
    q = randn(2, D, seed=7)
    full = m.attention_scores(q)
    m.head(0).evict_outside_window(2)  # a head evicted on its own: scored one head at a time
    assert m.len() == 2 and m.head(1).len() == 6
    uneven = m.attention_scores(q)
    assert np.array_equal(uneven[0], full[0][4:]) and np.array_equal(uneven[1], full[1])


def test_multi_head_constructor_errors():
    with pytest.raises(InvalidArgumentError, match="num_heads"):
        MultiHeadKvCache(0, CFG)
    with pytest.raises(InvalidArgumentError, match="config"):
        MultiHeadKvCache(2, None)


@pytest.mark.parametrize(
    "keys, values, error, name",
    [
        (np.ones((2, D)), np.ones((3, D)), DimensionMismatch, "keys"),
        (np.ones((3, D)), [np.ones(D)] * 2, DimensionMismatch, "values"),
        (np.ones((3, D)), [np.ones(D), np.ones(D), np.ones(D + 1)], DimensionMismatch, r"values\[2\]"),
        (np.ones((3, D + 1)), np.ones((3, D)), DimensionMismatch, "keys"),
        (np.ones((3, D)), [np.ones(D), np.ones(D), np.r_[np.ones(D - 1), np.nan]], NonFiniteInput, r"values\[2\]"),
        (np.r_[np.ones((2, D)), np.full((1, D), np.inf)], np.ones((3, D)), NonFiniteInput, "keys"),
        (np.ones((3, D)), [np.ones(D), np.full(D, 1e38), np.ones(D)], NonFiniteInput, r"values\[1\]=.*norm 4e"),
        (5, np.ones((3, D)), InvalidArgumentError, "keys"),
    ],
)
def test_push_token_checks_every_head_before_writing_any(keys, values, error, name):
    m = MultiHeadKvCache(3, CFG, block_size=4)
    for t in range(5):
        m.push_token(randn(3, D, seed=t), randn(3, D, seed=t + 9))
    before = mh_state(m)
    with pytest.raises(error, match=name):
        m.push_token(keys, values)
    assert mh_state(m) == before


def test_multi_head_attention_scores_errors():
    m = MultiHeadKvCache(2, CFG)
    m.push_token(randn(2, D), randn(2, D))
    with pytest.raises(DimensionMismatch, match="queries"):
        m.attention_scores([np.ones(D)])
    with pytest.raises(NonFiniteInput, match=r"queries\[1\]"):
        m.attention_scores([np.ones(D), np.full(D, np.nan)])


def test_multi_head_push_that_runs_out_of_pages_writes_no_head():
    pool = compressed_pool(CFG, block_size=2, num_blocks=3)  # 3 heads fit one page each, not two
    m = MultiHeadKvCache(3, CFG, pool=pool)
    for t in range(2):
        m.push_token(randn(3, D, seed=t), randn(3, D, seed=t))
    before = mh_state(m)
    with pytest.raises(OutOfBlocksError):
        m.push_token(randn(3, D), randn(3, D))
    assert mh_state(m) == before
    pool.manager.check()


@pytest.mark.parametrize("tokens", [0, 3, 4])
def test_multi_head_push_that_fails_mid_write_gives_every_slot_back(monkeypatch, tokens):
    m = MultiHeadKvCache(2, CFG, block_size=4)
    for t in range(tokens):
        m.push_token(randn(2, D, seed=t), randn(2, D, seed=t + 1))
    before = mh_state(m)

    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(m.pool.storage, "write", broken)
    with pytest.raises(RuntimeError):
        m.push_token(randn(2, D), randn(2, D))
    assert mh_state(m) == before
    m.pool.manager.check()


def test_multi_head_copy_shares_pages_and_diverges():
    m = MultiHeadKvCache(2, CFG, block_size=4)
    for t in range(6):
        m.push_token(randn(2, D, seed=t), randn(2, D, seed=t + 1))
    used = m.pool.manager.gpu.num_used
    snap = mh_state(m)
    c = m.copy()
    assert m.pool.manager.gpu.num_used == used
    c.push_token(randn(2, D, seed=99), randn(2, D, seed=98))
    assert [s[3:] for s in mh_state(m)] == [s[3:] for s in snap]
    assert c.len() == 7 and m.len() == 6
    m.evict_outside_window(1)
    assert m.len() == 1 and c.len() == 7
    assert np.array_equal(c.head(1).decode_keys()[:6], np.frombuffer(snap[1][3], np.float32).reshape(6, D))
    assert copy.copy(c).len() == 7
    assert 0 < c.compression_ratio() and MultiHeadKvCache(1, CFG).compression_ratio() == 1.0
    m.pool.manager.check()

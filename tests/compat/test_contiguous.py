"""Facade 001: contiguous.KvCache (float32, KvCacheAccess, snapshots, payloads) on pages."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import safetensors.numpy
import torch

from paged_kv.compat.contiguous import KvCache, KvCacheAccess, KvCacheSnapshot, KvStatePayload
from paged_kv.compat.pool import KVPool
from paged_kv.errors import InvalidArgumentError, OutOfBlocksError, OutOfRangeError, PagedKVError

L, KV, BS = 2, 6, 4


def tokens(seed: int, n: int, layers: int = L, kv_dim: int = KV) -> np.ndarray:
    """Random float32 per-token vectors [n, layers, 2, kv_dim] (layer, key/value)."""
    return np.random.default_rng(seed).standard_normal((n, layers, 2, kv_dim)).astype(np.float32)


def fill(cache: KvCache, data: np.ndarray) -> None:
    """Store and advance every token of ``data`` [n, L, 2, KV]."""
    for tok in data:
        for layer in range(cache.num_layers()):
            cache.store_kv(layer, tok[layer, 0], tok[layer, 1])
        cache.advance()


def flat(data: np.ndarray, layer: int, which: int) -> np.ndarray:
    return data[:, layer, which].reshape(-1)


def state(cache: KvCache) -> tuple:
    layers = [(cache.get_keys(i).tobytes(), cache.get_values(i).tobytes()) for i in range(cache.num_layers())]
    return cache.seq_len(), layers, cache.memory_usage_bytes(), cache.pool.manager.gpu.num_free


def new(max_seq_len: int = 32, **kw) -> KvCache:
    return KvCache(L, max_seq_len, KV, block_size=BS, **kw)


def test_empty_cache_accessors():
    cache = new(32)
    assert (cache.num_layers(), cache.max_seq_len(), cache.kv_dim(), cache.seq_len()) == (L, 32, KV, 0)
    assert cache.get_keys(0).shape == (0,) and cache.get_keys(0).dtype == np.float32
    assert cache.memory_usage_bytes() == 0
    assert isinstance(cache, KvCacheAccess)


def test_store_advance_get_round_trip_exactly():
    data = tokens(0, 9)
    cache = new()
    fill(cache, data)
    assert cache.seq_len() == 9
    for layer in range(L):
        np.testing.assert_array_equal(cache.get_keys(layer), flat(data, layer, 0))
        np.testing.assert_array_equal(cache.get_values(layer), flat(data, layer, 1))


def test_stored_token_is_invisible_until_advance_and_can_be_overwritten():
    data = tokens(1, 3)
    cache = new()
    fill(cache, data[:2])
    cache.store_kv(0, data[2, 0, 0], data[2, 0, 1])
    assert cache.seq_len() == 2 and cache.get_keys(0).size == 2 * KV
    cache.store_kv(0, -data[2, 0, 0], data[2, 0, 1])  # same position again
    cache.advance()
    np.testing.assert_array_equal(cache.get_keys(0)[-KV:], -data[2, 0, 0])


def test_inputs_accept_lists_and_tensors():
    cache = new()
    key = [float(i) for i in range(KV)]
    cache.store_kv(0, key, torch.arange(KV, dtype=torch.float64))
    cache.advance()
    np.testing.assert_array_equal(cache.get_keys(0), np.arange(KV, dtype=np.float32))
    np.testing.assert_array_equal(cache.get_values(0), np.arange(KV, dtype=np.float32))


def cache_on_a_recycled_page() -> KvCache:
    """An empty cache whose pool's only page was filled with non-zero data by another cache."""
    pool = KVPool(num_layers=L, num_kv_heads=1, head_dim=KV, block_size=BS, num_blocks=1)
    other = KvCache(L, 32, KV, pool=pool)
    fill(other, tokens(2, BS))
    other.clear()
    return KvCache(L, 32, KV, pool=pool)


def test_position_advanced_without_store_reads_zero_even_on_a_recycled_page():
    cache = cache_on_a_recycled_page()
    cache.advance()
    cache.store_kv(1, np.ones(KV), np.ones(KV))
    cache.advance()
    np.testing.assert_array_equal(cache.get_keys(0), np.zeros(2 * KV, np.float32))
    np.testing.assert_array_equal(cache.get_values(1), np.r_[np.zeros(KV), np.ones(KV)].astype(np.float32))


def test_position_advanced_after_a_restore_never_shows_another_caches_data():
    cache = cache_on_a_recycled_page()
    snap = [np.ones(KV, np.float32)] * L
    cache.restore_from_snapshot(snap, snap, 1)  # takes the recycled page for position 0
    cache.advance()  # position 1, never stored, shares that page
    np.testing.assert_array_equal(cache.get_keys(0), np.r_[np.ones(KV), np.zeros(KV)].astype(np.float32))
    np.testing.assert_array_equal(cache.get_values(1), np.r_[np.ones(KV), np.zeros(KV)].astype(np.float32))


def test_for_each_visits_every_token_in_order():
    data = tokens(3, 5)
    cache = new()
    fill(cache, data)
    seen_k, seen_v = [], []
    cache.for_each_key(1, lambda pos, row: seen_k.append((pos, row.copy())))
    cache.for_each_value(0, lambda pos, row: seen_v.append((pos, row.copy())))
    assert [p for p, _ in seen_k] == list(range(5))
    for pos, row in seen_k:
        np.testing.assert_array_equal(row, data[pos, 1, 0])
    for pos, row in seen_v:
        np.testing.assert_array_equal(row, data[pos, 0, 1])


def test_for_each_checks_layer_and_callable_before_calling():
    cache = new()
    fill(cache, tokens(4, 2))
    calls = []
    with pytest.raises(OutOfRangeError, match="layer"):
        cache.for_each_key(L, lambda *a: calls.append(a))
    with pytest.raises(InvalidArgumentError, match="f="):
        cache.for_each_value(0, "not callable")
    assert calls == []


def test_advance_and_store_past_max_seq_len_raise_and_change_nothing():
    cache = new(3)
    fill(cache, tokens(5, 3))
    before = state(cache)
    with pytest.raises(OutOfRangeError, match="max_seq_len=3"):
        cache.advance()
    with pytest.raises(OutOfRangeError, match="seq_len"):
        cache.store_kv(0, np.zeros(KV), np.zeros(KV))
    assert state(cache) == before


@pytest.mark.parametrize("layer, key, value, err, name", [
    (L, np.zeros(KV), np.zeros(KV), OutOfRangeError, "layer"),
    (-1, np.zeros(KV), np.zeros(KV), OutOfRangeError, "layer"),
    (1.0, np.zeros(KV), np.zeros(KV), InvalidArgumentError, "layer"),
    (0, np.zeros(KV - 1), np.zeros(KV), InvalidArgumentError, "key"),
    (0, np.zeros(KV), np.zeros(KV + 1), InvalidArgumentError, "value"),
    (0, np.zeros((1, KV)), np.zeros(KV), InvalidArgumentError, "key"),
    (0, np.zeros(KV), ["x"] * KV, InvalidArgumentError, "value"),
])
def test_bad_store_raises_typed_error_and_changes_nothing(layer, key, value, err, name):
    cache = new()
    fill(cache, tokens(6, 2))
    cache.store_kv(0, np.ones(KV), np.ones(KV))  # a pending token must survive too
    before = state(cache)
    with pytest.raises(err, match=name) as info:
        cache.store_kv(layer, key, value)
    assert isinstance(info.value, PagedKVError)
    assert state(cache) == before
    cache.advance()
    np.testing.assert_array_equal(cache.get_keys(0)[-KV:], np.ones(KV, np.float32))


def test_truncate_rolls_back_speculation_and_returns_pages():
    data = tokens(7, 11)
    cache = new()
    fill(cache, data)
    assert cache.memory_usage_bytes() == 3 * cache.pool.bytes_per_page
    cache.truncate(5)  # the draft diverged at position 5
    assert cache.seq_len() == 5 and cache.memory_usage_bytes() == 2 * cache.pool.bytes_per_page
    fill(cache, data[:2])  # continue generating from the divergence position
    np.testing.assert_array_equal(cache.get_keys(1), np.r_[flat(data[:5], 1, 0), flat(data[:2], 1, 0)])
    cache.truncate(100)  # never extends
    assert cache.seq_len() == 7
    with pytest.raises(InvalidArgumentError, match="n="):
        cache.truncate(-1)


def test_clear_returns_every_page():
    cache = new()
    fill(cache, tokens(8, 6))
    cache.clear()
    assert cache.seq_len() == 0 and cache.memory_usage_bytes() == 0 and cache.get_keys(0).size == 0


def test_memory_follows_tokens_not_max_seq_len():
    cache = new(1_000_000)
    page = cache.pool.bytes_per_page
    assert page == 2 * L * BS * KV * 4
    for n in range(1, 2 * BS + 2):
        fill(cache, tokens(n, 1))
        assert cache.memory_usage_bytes() == -(-n // BS) * page


def test_snapshot_holds_only_valid_elements_and_restores():
    data = tokens(9, 6)
    cache = new()
    fill(cache, data)
    snap = cache.snapshot()
    assert isinstance(snap, KvCacheSnapshot) and snap.seq_len == 6
    assert [k.size for k in snap.keys] == [6 * KV] * L
    fill(cache, tokens(10, 3))
    other = new()
    other.restore_from_snapshot(snap.keys, snap.values, snap.seq_len)
    cache.restore_from_snapshot(snap.keys, snap.values, snap.seq_len)
    for c in (cache, other):
        assert c.seq_len() == 6
        np.testing.assert_array_equal(c.get_values(1), flat(data, 1, 1))
    snap.keys[0][:] = 0  # the snapshot is a copy
    assert cache.get_keys(0).any()


@pytest.mark.parametrize("case, err, name", [
    ("fewer key layers", InvalidArgumentError, "len\\(keys\\)"),
    ("fewer value layers", InvalidArgumentError, "len\\(values\\)"),
    ("short layer", InvalidArgumentError, "keys\\[1\\]"),
    ("wrong seq_len", InvalidArgumentError, "values\\[0\\]"),
    ("past max_seq_len", OutOfRangeError, "seq_len"),
    ("negative seq_len", InvalidArgumentError, "seq_len"),
])
def test_restore_checks_preconditions_and_changes_nothing(case, err, name):
    cache = new(8)
    fill(cache, tokens(11, 5))
    snap = cache.snapshot()
    keys, values, n = list(snap.keys), list(snap.values), snap.seq_len
    if case == "fewer key layers":
        keys = keys[:1]
    elif case == "fewer value layers":
        values = values[:1]
    elif case == "short layer":
        keys[1] = keys[1][:-1]
    elif case == "wrong seq_len":
        n = 4
        keys = [k[: 4 * KV] for k in keys]
    elif case == "past max_seq_len":
        n, keys, values = 9, [np.zeros(9 * KV)] * L, [np.zeros(9 * KV)] * L
    else:
        n = -1
    fill(cache, tokens(12, 1))
    before = state(cache)
    with pytest.raises(err, match=name):
        cache.restore_from_snapshot(keys, values, n)
    assert state(cache) == before


def test_payload_round_trips_through_safetensors_bytes():
    data = tokens(13, 7)
    cache = new()
    fill(cache, data)
    blob = cache.to_payload().to_bytes()
    tensors = safetensors.numpy.load(blob)  # a standard safetensors file
    np.testing.assert_array_equal(tensors["keys.1"], data[:, 1, 0])
    payload = KvStatePayload.from_bytes(blob)
    assert (payload.num_layers, payload.kv_dim, payload.seq_len) == (L, KV, 7)
    fresh = new()
    fresh.restore_from_payload(payload)
    assert state(fresh)[:2] == state(cache)[:2]


def test_empty_payload_round_trips():
    payload = KvStatePayload.from_bytes(new().to_payload().to_bytes())
    assert payload.seq_len == 0 and payload.kv_dim == KV
    cache = new()
    fill(cache, tokens(14, 3))
    cache.restore_from_payload(payload)
    assert cache.seq_len() == 0 and cache.memory_usage_bytes() == 0


@pytest.mark.parametrize("other, err, name", [
    (lambda: KvCache(L + 1, 32, KV), InvalidArgumentError, "payload.num_layers"),
    (lambda: KvCache(L, 32, KV + 2), InvalidArgumentError, "payload.kv_dim"),
    (lambda: KvCache(L, 3, KV), OutOfRangeError, "payload.seq_len"),
])
def test_restore_from_payload_rejects_mismatches(other, err, name):
    source = new()
    fill(source, tokens(15, 4))
    target = other()
    fill(target, tokens(16, 2, target.num_layers(), target.kv_dim()))
    before = state(target)
    with pytest.raises(err, match=name):
        target.restore_from_payload(source.to_payload())
    assert state(target) == before


def test_payload_rejects_malformed_input():
    blob = new().to_payload().to_bytes()
    for bad in (b"", b"garbage", blob[:-1]):
        with pytest.raises(InvalidArgumentError, match="data"):
            KvStatePayload.from_bytes(bad)
    with pytest.raises(InvalidArgumentError, match="data"):
        KvStatePayload.from_bytes("text")
    foreign = safetensors.numpy.save({"weights": np.zeros((2, 2), np.float32)})
    with pytest.raises(InvalidArgumentError, match="keys"):
        KvStatePayload.from_bytes(foreign)
    with pytest.raises(InvalidArgumentError, match="keys\\[0\\]"):
        KvStatePayload(1, KV, 2, [np.zeros(KV)], [np.zeros(2 * KV)])
    with pytest.raises(InvalidArgumentError, match="payload"):
        new().restore_from_payload(b"bytes")


def test_copy_shares_pages_and_diverges():
    data = tokens(17, 6)
    cache = new()
    fill(cache, data)
    free = cache.pool.manager.gpu.num_free
    for make in (KvCache.copy, copy.copy, copy.deepcopy):
        twin = make(cache)
        assert cache.pool.manager.gpu.num_free == free  # no page copied yet
        twin.truncate(5)
        fill(twin, -data[:1])  # overwrites position 5 in a shared page
        assert twin.seq_len() == 6 and cache.seq_len() == 6
        np.testing.assert_array_equal(cache.get_keys(0), flat(data, 0, 0))
        np.testing.assert_array_equal(twin.get_keys(0)[-KV:], -data[0, 0, 0])
        del twin  # its private page goes back at once
    fill(cache, data[:1])
    assert cache.seq_len() == 7


def test_heads_split_lets_caches_share_a_model_shaped_pool():
    pool = KVPool(num_layers=L, num_kv_heads=2, head_dim=KV // 2, block_size=BS)
    a, b = KvCache(L, 32, KV, pool=pool), KvCache(L, 32, KV, pool=pool)
    da, db = tokens(18, 5), tokens(19, 5)
    for i in range(5):
        fill(a, da[i:i + 1])
        fill(b, db[i:i + 1])
    np.testing.assert_array_equal(a.get_keys(1), flat(da, 1, 0))
    np.testing.assert_array_equal(b.get_values(0), flat(db, 0, 1))
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        KvCache(L, 32, 5, num_kv_heads=2)
    with pytest.raises(InvalidArgumentError, match="pool.num_layers"):
        KvCache(L + 1, 32, KV, pool=pool)


def test_restore_on_a_full_fixed_pool_raises_and_keeps_the_old_state():
    pool = KVPool(num_layers=L, num_kv_heads=1, head_dim=KV, block_size=BS, num_blocks=2)
    cache = KvCache(L, 32, KV, pool=pool)
    fill(cache, tokens(20, BS + 1))
    snap = cache.snapshot()
    before = state(cache)
    with pytest.raises(OutOfBlocksError):
        cache.restore_from_snapshot(snap.keys, snap.values, snap.seq_len)
    assert state(cache) == before


def test_abstract_trait_provides_for_each_from_get_keys():
    class Dense(KvCacheAccess):
        def __init__(self):
            self.rows = [np.arange(3, dtype=np.float32), np.ones(3, np.float32)]

        def seq_len(self): return 2
        def store_kv(self, layer, key, value): raise NotImplementedError
        def get_keys(self, layer): return np.concatenate(self.rows)
        def get_values(self, layer): return -np.concatenate(self.rows)
        def advance(self): raise NotImplementedError
        def kv_dim(self): return 3

    seen = []
    Dense().for_each_value(0, lambda pos, row: seen.append((pos, row.tolist())))
    assert seen == [(0, [0.0, -1.0, -2.0]), (1, [-1.0, -1.0, -1.0])]
    with pytest.raises(TypeError):
        KvCacheAccess()

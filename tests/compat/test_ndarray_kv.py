"""Facade 000: ndarray_kv.KvCache (float64 per-layer [seq_len, num_heads, head_dim]) on pages."""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest
import torch

from paged_kv.compat.ndarray_kv import (
    CapacityExceeded,
    InvalidArgument,
    KvCache,
    KvCacheError,
    LayerOutOfBounds,
    ShapeMismatch,
)
from paged_kv.compat.pool import KVPool
from paged_kv.errors import InvalidArgumentError, OutOfBlocksError, OutOfRangeError, PagedKVError

L, H, D, BS = 2, 3, 4, 4


def rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random float64 rows [n, H, D]."""
    return rng.standard_normal((n, H, D))


def state(cache: KvCache) -> tuple:
    """Everything observable about a cache, for before/after comparisons."""
    kv = [(k.tobytes(), v.tobytes(), k.shape) for k, v in (cache.get_kv(i) for i in range(cache.num_layers))]
    return cache.seq_len, cache.current_len(), cache.memory_usage_bytes(), kv, cache.pool.manager.gpu.num_free


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def test_new_cache_is_empty_and_exposes_documented_fields():
    cache = KvCache(L, H, D, 64, block_size=BS)
    assert (cache.num_layers, cache.num_heads, cache.head_dim, cache.max_seq_len) == (L, H, D, 64)
    assert cache.seq_len == cache.current_len() == 0
    assert cache.memory_usage_bytes() == 0
    for k in cache.keys + cache.values:
        assert k.shape == (0, H, D) and k.dtype == np.float64


def test_appends_concatenate_per_layer_and_read_back_exactly(rng):
    cache = KvCache(L, H, D, 64, block_size=BS)
    k1, v1, k2, v2 = rows(rng, 3), rows(rng, 3), rows(rng, 6), rows(rng, 6)
    cache.append_kv(0, k1, v1)
    cache.append_kv(0, k2, v2)
    cache.append_kv(1, k1[:2], v1[:2])
    k, v = cache.get_kv(0)
    np.testing.assert_array_equal(k, np.concatenate([k1, k2]))
    np.testing.assert_array_equal(v, np.concatenate([v1, v2]))
    np.testing.assert_array_equal(cache.keys[1], k1[:2])
    np.testing.assert_array_equal(cache.values[1], v1[:2])
    assert cache.seq_len == cache.current_len() == 9


def test_current_len_follows_layer_zero(rng):
    cache = KvCache(L, H, D, 64, block_size=BS)
    cache.append_kv(1, rows(rng, 5), rows(rng, 5))
    assert cache.current_len() == cache.seq_len == 0
    assert cache.get_kv(1)[0].shape == (5, H, D)
    cache.append_kv(0, rows(rng, 2), rows(rng, 2))
    assert cache.current_len() == 2


@pytest.mark.parametrize("kind", ["list", "float32", "torch"])
def test_accepts_nested_lists_numpy_and_torch(rng, kind):
    k, v = rows(rng, 2), rows(rng, 2)
    convert = {"list": lambda a: a.tolist(), "float32": lambda a: a.astype(np.float32),
               "torch": lambda a: torch.from_numpy(a)}[kind]
    cache = KvCache(L, H, D, 8, block_size=BS)
    cache.append_kv(0, convert(k), convert(v))
    want = k.astype(np.float32).astype(np.float64) if kind == "float32" else k
    np.testing.assert_array_equal(cache.get_kv(0)[0], want)


def test_zero_token_append_changes_nothing():
    cache = KvCache(L, H, D, 8, block_size=BS)
    before = state(cache)
    cache.append_kv(0, np.zeros((0, H, D)), np.zeros((0, H, D)))
    assert state(cache) == before


@pytest.mark.parametrize("layer", [L, 100, -1])
def test_get_kv_out_of_range_is_none(layer):
    assert KvCache(L, H, D, 8).get_kv(layer) is None


def test_get_kv_rejects_non_integer_layer():
    with pytest.raises(InvalidArgument, match="layer"):
        KvCache(L, H, D, 8).get_kv("0")


def test_returned_arrays_are_read_only_copies(rng):
    cache = KvCache(L, H, D, 8, block_size=BS)
    k = rows(rng, 2)
    cache.append_kv(0, k, k)
    got = cache.get_kv(0)[0]
    with pytest.raises(ValueError):
        got[0, 0, 0] = 99.0
    k[0, 0, 0] = 99.0  # the caller's input is not aliased either
    assert cache.keys[0][0, 0, 0] != 99.0


BAD_APPENDS = [
    # (layer, k shape or value, v shape or value, error class, builtin kind, name in message)
    (L, (1, H, D), (1, H, D), LayerOutOfBounds, IndexError, "layer"),
    (-1, (1, H, D), (1, H, D), LayerOutOfBounds, IndexError, "layer"),
    ("x", (1, H, D), (1, H, D), InvalidArgument, ValueError, "layer"),
    (0, (H, D), (H, D), ShapeMismatch, ValueError, "new_k"),
    (0, (1, 1, H, D), (1, 1, H, D), ShapeMismatch, ValueError, "new_k"),
    (0, (1, H + 1, D), (1, H + 1, D), ShapeMismatch, ValueError, "new_k"),
    (0, (1, H, D - 1), (1, H, D - 1), ShapeMismatch, ValueError, "new_k"),
    (0, (2, H, D), (1, H, D), ShapeMismatch, ValueError, "new_v"),
    (0, (1, H, D), (1, H, D + 1), ShapeMismatch, ValueError, "new_v"),
    (0, "text", (1, H, D), ShapeMismatch, ValueError, "new_k"),
    (0, (1, H, D), [[["a"] * D] * H], ShapeMismatch, ValueError, "new_v"),
    (0, [[[0.0] * D] * H, [[0.0] * D]], (2, H, D), ShapeMismatch, ValueError, "new_k"),  # ragged
    (0, np.ones((1, H, D), bool), (1, H, D), ShapeMismatch, ValueError, "new_k"),
    (0, torch.ones((1, H, D), dtype=torch.complex64), (1, H, D), ShapeMismatch, ValueError, "new_k"),
    (0, (6, H, D), (6, H, D), CapacityExceeded, IndexError, "new_k"),
]


@pytest.mark.parametrize("layer, k, v, err, builtin, name", BAD_APPENDS)
def test_bad_appends_raise_typed_errors_and_change_nothing(rng, layer, k, v, err, builtin, name):
    cache = KvCache(L, H, D, 8, block_size=BS)
    cache.append_kv(0, rows(rng, 3), rows(rng, 3))
    before = state(cache)
    make = lambda s: rng.standard_normal(s) if isinstance(s, tuple) else s  # noqa: E731
    with pytest.raises(err, match=name) as info:
        cache.append_kv(layer, make(k), make(v))
    assert isinstance(info.value, KvCacheError) and isinstance(info.value, builtin)
    assert state(cache) == before


def test_fills_exactly_to_max_seq_len(rng):
    cache = KvCache(1, H, D, 5, block_size=BS)
    cache.append_kv(0, rows(rng, 5), rows(rng, 5))
    assert cache.seq_len == 5
    with pytest.raises(CapacityExceeded, match="max_seq_len=5"):
        cache.append_kv(0, rows(rng, 1), rows(rng, 1))


@pytest.mark.parametrize("args", [(0, H, D, 8), (L, 0, D, 8), (L, H, 0, 8), (L, H, D, -1), (L, H, D, 1.5)])
def test_constructor_rejects_bad_geometry(args):
    with pytest.raises(InvalidArgumentError):
        KvCache(*args)


def test_memory_follows_pages_held_not_max_seq_len(rng):
    cache = KvCache(L, H, D, 1_000_000, block_size=BS)
    page = 2 * L * BS * H * D * 8  # K and V, every layer, 8 bytes per float64 slot
    assert cache.pool.bytes_per_page == page
    for total in (1, BS, BS + 1, 3 * BS + 2):
        cache.append_kv(0, rows(rng, total - cache.seq_len), rows(rng, total - cache.seq_len))
        assert cache.memory_usage_bytes() == -(-total // BS) * page


def test_copy_shares_pages_then_diverges(rng):
    cache = KvCache(L, H, D, 64, block_size=BS)
    k, v = rows(rng, 6), rows(rng, 6)
    cache.append_kv(0, k, v)
    cache.append_kv(1, k, v)
    free = cache.pool.manager.gpu.num_free
    twin = cache.copy()
    assert cache.pool.manager.gpu.num_free == free  # no page copied
    k2, v2 = rows(rng, 1), rows(rng, 1)
    twin.append_kv(0, k2, v2)  # writes into the shared, partly filled last page
    cache.append_kv(1, -k2, -v2)
    np.testing.assert_array_equal(cache.get_kv(0)[0], k)
    np.testing.assert_array_equal(twin.get_kv(0)[0], np.concatenate([k, k2]))
    np.testing.assert_array_equal(twin.get_kv(1)[1], v)
    np.testing.assert_array_equal(cache.get_kv(1)[1], np.concatenate([v, -v2]))
    assert (cache.seq_len, twin.seq_len) == (6, 7)


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy])
def test_copy_module_uses_copy_on_write(rng, how):
    cache = KvCache(L, H, D, 64, block_size=BS)
    cache.append_kv(0, rows(rng, 4), rows(rng, 4))
    free = cache.pool.manager.gpu.num_free
    twin = how(cache)
    assert isinstance(twin, KvCache) and cache.pool.manager.gpu.num_free == free
    twin.append_kv(0, rows(rng, 1), rows(rng, 1))
    assert cache.seq_len == 4 and twin.seq_len == 5


def test_caches_sharing_a_pool_see_only_their_own_data(rng):
    pool = KVPool(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float64, block_size=BS)
    a, b = KvCache(L, H, D, 64, pool=pool), KvCache(L, H, D, 64, pool=pool)
    ka, kb = rows(rng, 7), rows(rng, 9)
    for i in range(7):  # interleaved appends land on interleaved pages
        a.append_kv(0, ka[i:i + 1], ka[i:i + 1])
        b.append_kv(0, kb[i:i + 1], kb[i:i + 1])
    b.append_kv(0, kb[7:], kb[7:])
    np.testing.assert_array_equal(a.get_kv(0)[0], ka)
    np.testing.assert_array_equal(b.get_kv(0)[1], kb)
    assert a.pool is b.pool is pool


def test_shared_pool_must_match_geometry():
    pool = KVPool(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float32, block_size=BS)
    with pytest.raises(InvalidArgumentError, match="pool.dtype"):
        KvCache(L, H, D, 8, pool=pool)
    pool64 = KVPool(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float64, block_size=BS)
    with pytest.raises(InvalidArgumentError, match="pool.num_kv_heads"):
        KvCache(L, H + 1, D, 8, pool=pool64)
    with pytest.raises(InvalidArgumentError, match="pool.block_size"):
        KvCache(L, H, D, 8, pool=pool64, block_size=BS * 2)


def test_full_fixed_pool_raises_and_changes_nothing(rng):
    pool = KVPool(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float64, block_size=BS, num_blocks=2)
    cache = KvCache(L, H, D, 64, pool=pool)
    cache.append_kv(0, rows(rng, 2 * BS - 1), rows(rng, 2 * BS - 1))
    twin = cache.copy()  # shares both pages: a write into the last one needs a copy, and none is free
    before = state(twin)
    with pytest.raises(OutOfBlocksError):
        twin.append_kv(0, rows(rng, 1), rows(rng, 1))
    assert state(twin) == before
    with pytest.raises(OutOfBlocksError):
        cache.append_kv(0, rows(rng, 3), rows(rng, 3))
    assert cache.seq_len == 2 * BS - 1


def test_append_to_a_shorter_layer_that_cannot_copy_every_shared_page_takes_none(rng):
    pool = KVPool(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float64, block_size=BS, num_blocks=3)
    cache = KvCache(L, H, D, 64, pool=pool)
    cache.append_kv(0, rows(rng, BS + 1), rows(rng, BS + 1))  # two pages, the last one partly filled
    cache.append_kv(1, rows(rng, 1), rows(rng, 1))
    twin = cache.copy()  # shares both pages; one page is free
    before = state(cache)
    with pytest.raises(OutOfBlocksError):  # layer 1 rows 1..BS+1 grow the last page and write both: two copies
        cache.append_kv(1, rows(rng, BS + 1), rows(rng, BS + 1))
    assert state(cache) == before and pool.manager.gpu.num_free == 1
    assert twin.seq_len == BS + 1


def test_dropping_a_cache_returns_its_pages(rng):
    pool = KVPool(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float64, block_size=BS, num_blocks=8)
    cache = KvCache(L, H, D, 64, pool=pool)
    cache.append_kv(0, rows(rng, 3 * BS), rows(rng, 3 * BS))
    assert pool.manager.gpu.num_free == 5
    del cache
    gc.collect()
    assert pool.manager.gpu.num_free == 8


def test_errors_share_the_project_base():
    for err in (KvCacheError, InvalidArgument, ShapeMismatch, LayerOutOfBounds, CapacityExceeded):
        assert issubclass(err, PagedKVError) and issubclass(err, KvCacheError)
    assert issubclass(LayerOutOfBounds, OutOfRangeError) and issubclass(ShapeMismatch, InvalidArgumentError)


def test_compat_package_lists_the_facades_and_imports_them_lazily():
    import subprocess
    import sys

    import paged_kv.compat as compat

    assert compat.FACADES == ("ndarray_kv", "contiguous", "compressed", "quantized", "dynamic")
    assert set(compat.FACADES) <= set(dir(compat))
    assert compat.ndarray_kv.KvCache is KvCache
    with pytest.raises(AttributeError, match="no_such_facade"):
        compat.no_such_facade  # noqa: B018
    probe = "import sys, paged_kv.compat; print(sorted(m for m in sys.modules if m.startswith('paged_kv.compat.')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""Facade 004: paged_kv.compat.dynamic.KVCache / KVCacheEntry (transformers DynamicCache port) on pages."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from paged_kv.compat.dynamic import KVCache, KVCacheEntry
from paged_kv.compat.pool import KVPool
from paged_kv.errors import (
    InvalidArgumentError,
    OutOfBlocksError,
    OutOfRangeError,
    PagedKVError,
    SequenceStateError,
)

B, H, D = 2, 3, 8


def kv(t: int, *, batch: int = B, heads: int = H, dim: int = D, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, t, dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def state(cache: KVCache) -> tuple:
    """Everything observable: layer count, batch, per-layer lengths and contents, pages held, block tables."""
    entries = [cache.get(i) for i in range(cache.num_layers())]
    data = [None if e is None else (e.seq_len(), e.key, e.value) for e in entries]
    pool = cache.pool
    used = None if pool is None else (pool.manager.gpu.num_used, pool.spec.num_layers)
    return cache.num_layers(), cache.batch_size(), cache.seq_len(), data, used, [r.block_table() for r in cache._rows]


def same_state(a: tuple, b: tuple) -> bool:
    if a[:3] != b[:3] or a[4:] != b[4:] or len(a[3]) != len(b[3]):
        return False
    for x, y in zip(a[3], b[3]):
        if (x is None) != (y is None):
            return False
        if x is not None and not (x[0] == y[0] and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])):
            return False
    return True


# -- the documented behaviour (the seed's own tests first) ---------------------------------
def test_seed_basic():
    cache = KVCache.with_num_layers(2)
    assert cache.is_empty() and cache.seq_len() == 0
    k, v = cache.update(0, torch.zeros(1, 4, 5, 64), torch.zeros(1, 4, 5, 64))
    assert k.shape == v.shape == (1, 4, 5, 64) and cache.seq_len() == 5
    k, v = cache.update(0, torch.zeros(1, 4, 1, 64), torch.zeros(1, 4, 1, 64))
    assert k.shape == v.shape == (1, 4, 6, 64) and cache.seq_len() == 6


def test_seed_clear():
    cache = KVCache.with_num_layers(2)
    cache.update(0, torch.zeros(1, 4, 5, 64), torch.zeros(1, 4, 5, 64))
    assert not cache.is_empty()
    cache.clear()
    assert cache.is_empty() and cache.seq_len() == 0 and cache.num_layers() == 2
    assert cache.get(0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_update_returns_the_concatenation_of_every_input(dtype, block_size):
    cache = KVCache(block_size=block_size)
    ks, vs = {0: [], 1: []}, {0: [], 1: []}
    for step, t in enumerate([5, 1, 0, 3, 1, 9]):
        for layer in (0, 1):
            k, v = kv(t, dtype=dtype, seed=10 * step + layer)
            ks[layer].append(k)
            vs[layer].append(v)
            got_k, got_v = cache.update(layer, k, v)
            assert got_k.dtype == dtype and got_k.is_contiguous()
            assert torch.equal(got_k, torch.cat(ks[layer], 2)) and torch.equal(got_v, torch.cat(vs[layer], 2))
    assert cache.seq_len() == cache.cache_position() == 19
    entry = cache.get(1)
    assert entry.seq_len() == 19 and torch.equal(entry.key, torch.cat(ks[1], 2))


def test_first_update_sets_later_ones_append_and_seq_len_follows_layer_0():
    cache = KVCache.with_num_layers(3)
    k, v = kv(4)
    cache.update(2, k, v)  # layer 2 first: layer 0 has no entry, seq_len stays 0
    assert cache.seq_len() == 0 and cache.is_empty() and cache.get(0) is None
    assert cache.get(2).seq_len() == 4
    k0, v0 = kv(2, seed=1)
    got = cache.update(0, k0, v0)  # first update of layer 0 sets it
    assert torch.equal(got[0], k0) and cache.seq_len() == 2
    cache.update(2, *kv(3, seed=2))  # layer 2 runs ahead: seq_len still follows layer 0
    assert cache.seq_len() == 2 and cache.get(2).seq_len() == 7
    assert torch.equal(cache.get(2).key[:, :, :4], k) and torch.equal(cache.get(0).value, v0)


def test_layers_beyond_the_count_are_added_on_demand():
    cache = KVCache()
    assert cache.num_layers() == 0 and cache.get(0) is None
    k, v = kv(3)
    cache.update(4, k, v)
    assert cache.num_layers() == 5 and [cache.get(i) is None for i in range(5)] == [True] * 4 + [False]
    assert cache.pool.spec.num_layers == 5
    cache.update(0, k, v)
    cache.update(7, k, v)  # the private pool gains layers; earlier layers keep their data
    assert cache.num_layers() == 8 and torch.equal(cache.get(4).key, k) and torch.equal(cache.get(7).value, v)
    assert cache.get(8) is None and cache.get(-1) is None and cache.get(100) is None


def test_layers_updated_in_any_order_each_write_at_their_own_length():
    cache = KVCache(block_size=4)
    ref: dict[int, list] = {0: [], 1: [], 2: []}
    order = [2, 0, 1, 1, 0, 2, 2, 2, 0, 1]
    for i, layer in enumerate(order):
        k, v = kv(1 + i % 3, seed=i)
        ref[layer].append(k)
        got_k, _ = cache.update(layer, k, v)
        assert torch.equal(got_k, torch.cat(ref[layer], 2))
    for layer, parts in ref.items():
        assert torch.equal(cache.get(layer).key, torch.cat(parts, 2))
    longest = max(sum(p.shape[2] for p in parts) for parts in ref.values())
    assert cache.num_pages == B * -(-longest // 4)  # rows reserve up to the longest layer, no more


# -- errors: typed, named, nothing changed ------------------------------------------------
def filled(**kw) -> KVCache:
    cache = KVCache.with_num_layers(2, block_size=4, **kw)
    for layer in (0, 1):
        cache.update(layer, *kv(5, seed=layer))
    return cache


BAD_UPDATES = [
    ("key", lambda: (0, "not a tensor", kv(1)[1]), InvalidArgumentError),
    ("value", lambda: (0, kv(1)[0], [1.0]), InvalidArgumentError),
    ("key.shape", lambda: (0, torch.zeros(B, H, D), torch.zeros(B, H, D)), InvalidArgumentError),
    ("key.shape", lambda: (0, *kv(1, batch=3)), InvalidArgumentError),  # batch
    ("key.shape", lambda: (1, *kv(1, heads=2)), InvalidArgumentError),  # head count
    ("key.shape", lambda: (0, *kv(1, dim=4)), InvalidArgumentError),  # head size
    ("value.shape", lambda: (0, kv(1)[0], kv(2)[1]), InvalidArgumentError),
    ("key.dtype", lambda: (0, *kv(1, dtype=torch.float16)), InvalidArgumentError),
    ("value.dtype", lambda: (0, kv(1)[0], kv(1, dtype=torch.float64)[1]), InvalidArgumentError),
    ("key.dtype", lambda: (0, torch.zeros(B, H, 1, D, dtype=torch.int32), torch.zeros(B, H, 1, D)),
     InvalidArgumentError),
    ("layer_idx", lambda: (-1, *kv(1)), OutOfRangeError),
    ("layer_idx", lambda: (True, *kv(1)), InvalidArgumentError),
    ("layer_idx", lambda: (1.0, *kv(1)), InvalidArgumentError),
    ("layer_idx", lambda: (1 << 12, *kv(1)), OutOfRangeError),
]


@pytest.mark.parametrize(("name", "args", "error"), BAD_UPDATES)
def test_bad_update_raises_named_typed_error_and_changes_nothing(name, args, error):
    cache = filled()
    before = state(cache)
    with pytest.raises(error) as info:
        cache.update(*args())
    assert isinstance(info.value, PagedKVError) and str(info.value).startswith(f"{name}=")
    assert same_state(before, state(cache))


def test_first_update_with_empty_dims_is_rejected():
    for shape in [(0, H, 1, D), (B, 0, 1, D), (B, H, 1, 0)]:
        cache = KVCache()
        with pytest.raises(InvalidArgumentError, match="key.shape"):
            cache.update(0, torch.zeros(shape), torch.zeros(shape))
        assert cache.num_layers() == 0 and cache.pool is None


def test_bad_constructor_and_extra_method_arguments():
    with pytest.raises(OutOfRangeError, match="^block_size="):
        KVCache(block_size=0)
    with pytest.raises(InvalidArgumentError, match="^dtype="):
        KVCache(dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="^device="):
        KVCache(device="no-such-device")
    with pytest.raises(InvalidArgumentError, match="^pool="):
        KVCache(pool="pool")
    with pytest.raises(OutOfRangeError, match="^num_layers="):
        KVCache.with_num_layers(-1)
    cache = filled()
    before = state(cache)
    for call, error, name in [
        (lambda: cache.select_rows([0, 2]), OutOfRangeError, "indices"),
        (lambda: cache.select_rows([]), InvalidArgumentError, "indices"),
        (lambda: cache.select_rows(torch.tensor([0.0])), InvalidArgumentError, "indices"),
        (lambda: cache.select_rows(5), InvalidArgumentError, "indices"),
        (lambda: cache.truncate(-1), InvalidArgumentError, "new_len"),
        (lambda: cache.truncate(1, layer_idx=2), OutOfRangeError, "layer_idx"),
        (lambda: cache.get("0"), InvalidArgumentError, "layer_idx"),
    ]:
        with pytest.raises(error, match=f"^{name}="):
            call()
        assert same_state(before, state(cache))


def test_out_of_pages_in_a_fixed_pool_raises_and_changes_nothing():
    pool = KVPool(num_layers=2, num_kv_heads=H, head_dim=D, block_size=4, num_blocks=5)
    cache = KVCache(pool=pool)
    cache.update(0, *kv(4))  # 2 rows x 1 page
    twin = cache.copy()  # shares both pages
    cache.update(1, *kv(4, seed=1))  # copy-on-write: 2 more pages -> 4 of 5 used
    before, twin_before = state(cache), state(twin)
    with pytest.raises(OutOfBlocksError):
        cache.update(0, *kv(1, seed=2))  # needs 2 new pages
    assert same_state(before, state(cache)) and same_state(twin_before, state(twin))
    twin.clear()
    cache.update(0, *kv(1, seed=2))  # fits now
    assert cache.seq_len() == 5
    pool.manager.check()


def test_shared_pool_fixes_geometry_and_layer_count():
    pool = KVPool(num_layers=2, num_kv_heads=H, head_dim=D, block_size=4)
    cache = KVCache(pool=pool)
    with pytest.raises(InvalidArgumentError, match=r"^key.shape=.*\[\*, 3, \*, 8\]"):
        cache.update(0, *kv(1, heads=2))
    with pytest.raises(OutOfRangeError, match="^layer_idx=2"):
        cache.update(2, *kv(1))
    with pytest.raises(InvalidArgumentError, match="^pool.block_size"):
        KVCache(pool=pool, block_size=8)
    with pytest.raises(OutOfRangeError, match="^num_layers="):
        KVCache.with_num_layers(3, pool=pool)
    assert cache.num_layers() == 0 and pool.manager.gpu.num_used == 0


def test_entry_errors_and_stale_entries():
    with pytest.raises(InvalidArgumentError, match="^value.shape"):
        KVCacheEntry(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 2, 4))
    cache = filled()
    entry = cache.get(0)
    with pytest.raises(InvalidArgumentError, match="^new_key|^key.shape"):
        entry.update(*kv(1, heads=1))
    assert entry.seq_len() == 5
    cache.clear()
    assert entry.seq_len() == 0
    with pytest.raises(SequenceStateError, match="^entry="):
        entry.key


# -- paging ---------------------------------------------------------------------------------
def test_pages_follow_the_tokens_and_clear_and_truncate_return_them():
    cache = KVCache(block_size=4)
    for t in range(1, 10):
        cache.update(0, *kv(1, seed=t))
        assert cache.num_pages == B * -(-t // 4)
        assert cache.nbytes == cache.num_pages * cache.pool.bytes_per_page
    pool = cache.pool
    keep = cache.get(0).key[:, :, :5]
    cache.truncate(5)
    assert cache.seq_len() == 5 and cache.num_pages == B * 2 and pool.manager.gpu.num_used == B * 2
    assert torch.equal(cache.get(0).key, keep)
    cache.truncate(50)  # never extends
    assert cache.seq_len() == 5
    cache.clear()
    assert pool.manager.gpu.num_used == 0 and cache.nbytes == 0
    pool.manager.check()


def test_truncate_one_layer_keeps_pages_the_others_use():
    cache = filled()
    cache.truncate(1, layer_idx=0)
    assert cache.seq_len() == 1 and cache.get(1).seq_len() == 5 and cache.num_pages == B * 2
    cache.truncate(1, layer_idx=1)
    assert cache.num_pages == B


def test_drop_front_gives_leading_pages_back_and_shifts_every_layer():
    cache = filled()  # layers 0 and 1 hold 5 positions of 2 rows: 2 pages per row
    cache.update(0, *kv(4, seed=7))  # layer 0 now holds 9: 3 pages per row
    keys0, values1 = cache.get(0).key, cache.get(1).value
    pool = cache.pool
    assert cache.droppable_pages() == 1  # layer 1's 5 positions fill one whole page
    assert cache.droppable_pages(keep_last=1) == 1 and cache.droppable_pages(keep_last=2) == 0
    cache.drop_front(1)
    assert cache.get(0).seq_len() == 5 and cache.get(1).seq_len() == 1 and cache.num_pages == B * 2
    assert pool.manager.gpu.num_used == B * 2
    assert torch.equal(cache.get(0).key, keys0[:, :, 4:]) and torch.equal(cache.get(1).value, values1[:, :, 4:])
    k, v = kv(1, seed=8)
    got = cache.update(1, k, v)  # appends after the kept position
    assert torch.equal(got[0][:, :, -1:], k) and torch.equal(got[1][:, :, :1], values1[:, :, 4:])
    cache.drop_front(0)
    assert cache.get(0).seq_len() == 5
    pool.manager.check()


def test_drop_front_keeps_pages_a_copy_shares_and_refuses_positions_a_layer_lacks():
    cache = filled()
    twin = cache.copy()
    keys = twin.get(0).key
    cache.drop_front(1)
    assert torch.equal(twin.get(0).key, keys) and cache.pool.manager.gpu.num_used == B * 2
    before = state(cache)
    with pytest.raises(OutOfRangeError, match="^num_pages="):
        cache.drop_front(1)  # layer 1 holds 1 position: no whole page
    with pytest.raises(OutOfRangeError, match="^num_pages="):
        cache.drop_front(-1)
    with pytest.raises(InvalidArgumentError, match="^keep_last="):
        cache.droppable_pages(keep_last=-1)
    assert same_state(before, state(cache))
    cache.update(2, *kv(8, seed=3))  # a layer updated for the first time writes at position 0
    assert cache.droppable_pages() == 0
    assert KVCache().droppable_pages() == 0 and KVCache.with_num_layers(2).droppable_pages() == 0


def test_quantized_storage_dtype_is_close_and_counts_scales():
    cache = KVCache(block_size=4, dtype=torch.int8)
    k, v = kv(6)
    got_k, got_v = cache.update(0, k, v)
    assert got_k.dtype == torch.float32
    scale = k.abs().amax(-1, keepdim=True) / 127  # one scale per (row, head, position)
    assert bool(((got_k - k).abs() <= scale / 2 + 1e-6).all())
    assert cache.pool.bytes_per_page == 2 * 4 * H * (D + 4)  # K and V codes plus float32 scales


def test_copy_shares_pages_and_both_sides_diverge_safely():
    cache = filled()
    pool = cache.pool
    used = pool.manager.gpu.num_used
    twins = [cache.copy(), copy.copy(cache), copy.deepcopy(cache)]
    assert pool.manager.gpu.num_used == used and all(t.pool is pool for t in twins)
    original = (cache.get(0).key, cache.get(1).value)
    twin = twins[0]
    k, v = kv(1, seed=9)
    twin.update(0, k, v)
    assert torch.equal(cache.get(0).key, original[0]) and cache.seq_len() == 5
    assert torch.equal(twin.get(0).key[:, :, 5:], k) and torch.equal(twin.get(0).key[:, :, :5], original[0])
    cache.truncate(2)
    cache.update(1, *kv(3, seed=10))  # overwrite positions the twins still share
    for t in twins:
        assert torch.equal(t.get(1).value, original[1])
    pool.manager.check()


def test_entry_is_a_paged_dynamic_entry():
    k, v = kv(3)
    entry = KVCacheEntry(k, v, block_size=2)
    assert entry.seq_len() == 3 and torch.equal(entry.key, k) and torch.equal(entry.value, v)
    k2, v2 = kv(2, seed=1)
    twin = entry.copy()
    got = entry.update(k2, v2)
    assert torch.equal(got[0], torch.cat([k, k2], 2)) and torch.equal(got[1], torch.cat([v, v2], 2))
    assert twin.seq_len() == 3 and torch.equal(twin.value, v)
    cache = KVCache()
    cache.update(0, k, v)
    view = cache.get(0)
    view.update(k2, v2)  # a live view: appends to the cache's layer
    assert cache.seq_len() == 5 and torch.equal(cache.get(0).key, torch.cat([k, k2], 2))


def test_select_rows_is_a_block_table_edit():
    cache = filled()
    pool = cache.pool
    keys = cache.get(0).key
    used = pool.manager.gpu.num_used
    cache.select_rows(torch.tensor([1, 1, 1, 0]))  # row 1 three times, row 0 once: forks only
    assert cache.batch_size() == 4 and pool.manager.gpu.num_used == used
    assert torch.equal(cache.get(0).key, keys[[1, 1, 1, 0]])
    cache.select_rows([2])  # the others go back to the pool
    assert cache.batch_size() == 1 and pool.manager.gpu.num_used == 2
    assert torch.equal(cache.get(1).value, filled().get(1).value[[1]])
    pool.manager.check()


def test_caches_sharing_a_pool_do_not_see_each_other():
    pool = KVPool(num_layers=1, num_kv_heads=H, head_dim=D, block_size=4)
    a, b = KVCache(pool=pool), KVCache(pool=pool)
    ka, va = kv(6, seed=1)
    kb, vb = kv(3, seed=2)
    a.update(0, ka, va)
    b.update(0, kb, vb)
    a.clear()
    kc, vc = kv(7, seed=3)
    a.update(0, kc, vc)  # reuses freed pages
    assert torch.equal(b.get(0).key, kb) and torch.equal(a.get(0).key, kc)
    assert pool.manager.gpu.num_used == a.num_pages + b.num_pages


def test_new_geometry_after_clear():
    cache = filled()
    cache.clear()
    k, v = kv(2, batch=3, heads=1, dim=4, dtype=torch.float16)
    got = cache.update(0, k, v)
    assert torch.equal(got[0], k) and cache.batch_size() == 3 and cache.pool.spec.num_kv_heads == 1


def test_equal_rows_keep_sharing_their_pages():
    cache = KVCache(block_size=4)
    k, v = kv(6, batch=2)
    k, v = k[[0, 0, 0, 1]], v[[0, 0, 0, 1]]  # a prompt repeated for 3 beams, and another
    assert torch.equal(cache.update(0, k, v)[0], k)
    assert cache.num_pages == 2 * 2 and cache.pool.manager.gpu.num_used == 4
    k1, v1 = kv(6, batch=2, seed=1)
    got = cache.update(1, k1[[0, 0, 0, 1]], v1[[0, 0, 0, 1]])  # equal again: written once, still shared
    assert torch.equal(got[1], v1[[0, 0, 0, 1]]) and cache.num_pages == 4
    k2, v2 = kv(6, batch=4, seed=2)
    assert torch.equal(cache.update(2, k2, v2)[0], k2)  # rows differ now: copy-on-write
    assert cache.num_pages == 4 * 2
    for layer, (kk, vv) in enumerate([(k, v), (k1[[0, 0, 0, 1]], v1[[0, 0, 0, 1]]), (k2, v2)]):
        assert torch.equal(cache.get(layer).key, kk) and torch.equal(cache.get(layer).value, vv)
    cache.pool.manager.check()


def test_equal_rows_never_write_pages_someone_else_holds():
    cache = KVCache(block_size=4)
    rep = lambda t: t.repeat(3, 1, 1, 1)  # noqa: E731
    k, v = kv(3, batch=1)
    for layer in (0, 1):
        cache.update(layer, rep(k), rep(v))  # one run of 3 rows sharing one page
    twin = cache.copy()  # holds the same page: the run no longer owns it alone
    cache.truncate(0, layer_idx=1)
    k1, v1 = kv(3, batch=1, seed=1)
    got = cache.update(1, rep(k1), rep(v1))  # equal rows again, but the page must be copied, not written
    assert torch.equal(got[0], rep(k1)) and torch.equal(twin.get(1).key, rep(k))
    assert cache.num_pages == 3 and twin.num_pages == 1 and cache.pool.manager.gpu.num_used == 4  # 3 copies


def test_rows_differing_only_in_the_sign_of_zero_are_not_merged():
    cache = KVCache()
    k = torch.zeros(2, 1, 1, 2)
    k[1] = -0.0
    got, _ = cache.update(0, k, k)
    assert torch.equal(torch.signbit(got), torch.signbit(k)) and cache.num_pages == 2


# -- a seeded random walk against a torch.cat / index_select reference ------------------------
def check_against(cache: KVCache, ref: dict) -> None:
    for layer in range(cache.num_layers()):
        entry = cache.get(layer)
        if layer not in ref:
            assert entry is None
            continue
        assert torch.equal(entry.key, ref[layer][0]) and torch.equal(entry.value, ref[layer][1])


def random_walk(seed: int, device: str = "cpu", steps: int = 120) -> None:
    rng = random.Random(seed)
    caches = [(KVCache(block_size=rng.choice([1, 3, 4]), device=device), {})]
    for step in range(steps):
        i = rng.randrange(len(caches))
        cache, ref = caches[i]
        op = rng.random()
        batch = cache.batch_size() or 2
        if op < 0.6:
            layer, t = rng.randrange(3), rng.randrange(4)
            k, v = (x.to(device) for x in kv(t, batch=batch, seed=step))
            if rng.random() < 0.5:  # runs of equal rows, as beam search's repeated prompt
                dup = sorted(rng.randrange(batch) for _ in range(batch))
                k, v = k[dup], v[dup]
            old = ref.get(layer)
            ref[layer] = (k, v) if old is None else (torch.cat([old[0], k], 2), torch.cat([old[1], v], 2))
            got = cache.update(layer, k, v)
            assert torch.equal(got[0], ref[layer][0]) and torch.equal(got[1], ref[layer][1])
        elif op < 0.75 and cache.batch_size():
            picked = [rng.randrange(batch) for _ in range(rng.randint(1, 4))]
            cache.select_rows(picked)
            for layer, (k, v) in ref.items():
                ref[layer] = (k[picked], v[picked])
        elif op < 0.85:
            twin = cache.copy()
            caches.append((twin, dict(ref)))
        elif op < 0.9:
            n = rng.randrange(6)
            cache.truncate(n)
            ref.update({layer: (k[:, :, :n], v[:, :, :n]) for layer, (k, v) in ref.items()})
        elif op < 0.95:
            pages = rng.randint(0, cache.droppable_pages())
            cache.drop_front(pages)
            shift = pages * (cache.pool.block_size if pages else 0)
            ref.update({layer: (k[:, :, shift:], v[:, :, shift:]) for layer, (k, v) in ref.items()})
        else:
            cache.clear()
            ref.clear()
        check_against(cache, ref)
    for cache, ref in caches:
        check_against(cache, ref)
        cache.pool.manager.check()


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_matches_the_reference(seed):
    random_walk(seed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_random_walk_on_gpu_matches_the_reference():
    random_walk(0, device="cuda")

"""BlockPool: refcounts, free stack, LRU of cached-evictable blocks and the hash map."""

from __future__ import annotations

import pytest

from paged_kv.block_pool import BlockPool, InvariantError
from paged_kv.errors import OutOfBlocksError, PagedKVError

P = b"p" * 32  # a parent hash


def h(i: int) -> bytes:
    """A distinct fake block hash."""
    return i.to_bytes(32, "little")


def register(pool: BlockPool, block: int, h: bytes, parent: bytes, tokens: tuple[int, ...]) -> None:
    """Register one block (a one-block chain)."""
    pool.register_chain((block,), (h,), parent, (tokens,))


def lookup(pool: BlockPool, h: bytes, parent: bytes, tokens: tuple[int, ...]) -> int | None:
    """The cached block under ``h`` if its parent and tokens match too (a one-block chain), else None."""
    hits = pool.lookup_chain(parent, (h,), (tokens,), 1)
    return hits[0] if hits else None


def is_evictable(pool: BlockPool, block: int) -> bool:
    """Whether ``block`` is free but still holds cached content."""
    return pool.count_evictable((block,)) == 1


def block_hash(pool: BlockPool, block: int) -> bytes | None:
    """The hash a block is cached under, or None."""
    return pool.hash_of[block]


def state(pool: BlockPool) -> tuple:
    """Everything a pool holds, for before/after comparison."""
    return (
        pool.num_blocks, list(pool.ref_counts), list(pool._free),
        {p: list(v) for p, v in pool._evictable.items() if v}, dict(pool._cached),
        list(pool.hash_of), list(pool._parent), list(pool._tokens), pool.num_evictions,
    )


def cached_pool(n: int, cached: list[int]) -> BlockPool:
    """A pool of ``n`` blocks whose ``cached`` blocks were registered (hash i) then freed in that order."""
    pool = BlockPool(n)
    blocks = pool.take(n)
    for b in cached:
        register(pool, b, h(b), P, (b,))
    pool.release(b for b in blocks if b not in cached)
    pool.release(cached)
    return pool


def test_fresh_pool_counts():
    pool = BlockPool(5, "cpu")
    assert (pool.num_free, pool.num_used, pool.num_cached, pool.num_evictable) == (5, 0, 0, 0)
    assert pool.name == "cpu"
    pool.check([0] * 5)


def test_take_hands_out_lowest_ids_first_with_refcount_one():
    pool = BlockPool(6)
    assert pool.take(2) == [0, 1]
    assert pool.take(3) == [2, 3, 4]
    assert pool.ref_counts == [1, 1, 1, 1, 1, 0]
    assert pool.take(0) == []
    assert (pool.num_free, pool.num_used) == (1, 5)
    pool.check([1, 1, 1, 1, 1, 0])


def test_take_too_many_raises_and_changes_nothing():
    pool = cached_pool(4, [1, 2])
    pool.take(1)
    before = state(pool)
    with pytest.raises(OutOfBlocksError, match=r"^num_blocks=4: expected at most 3 free gpu blocks$"):
        pool.take(4)
    assert state(pool) == before


def test_release_frees_uncached_and_keeps_cached_evictable():
    pool = BlockPool(3)
    a, b, c = pool.take(3)
    register(pool, b, h(1), P, (7,))
    pool.release([a, b])
    assert pool.num_free == 2 and pool.num_evictable == 1 and pool.num_cached == 1
    assert is_evictable(pool, b) and not is_evictable(pool, a) and not is_evictable(pool, c)
    assert block_hash(pool, b) == h(1) and block_hash(pool, a) is None
    pool.check([0, 0, 1])


def test_shared_block_stays_in_use_until_last_release():
    pool = BlockPool(2)
    (b,) = pool.take(1)
    pool.touch(b)
    pool.release([b])
    assert pool.ref_counts[b] == 1 and pool.num_used == 1
    pool.release([b])
    assert pool.ref_counts[b] == 0 and pool.num_free == 2


def test_take_uses_uncached_blocks_before_evicting():
    pool = cached_pool(4, [0, 1])  # 2 and 3 free, 0 and 1 cached-evictable
    assert sorted(pool.take(2)) == [2, 3]
    assert pool.num_evictions == 0 and pool.num_cached == 2


def test_take_evicts_least_recently_freed_first():
    pool = cached_pool(4, [2, 0, 3, 1])  # freed in this order
    assert pool.take(1) == [2]
    assert pool.take(2) == [0, 3]
    assert pool.num_evictions == 3
    assert pool.num_cached == 1 and block_hash(pool, 1) == h(1)
    assert lookup(pool, h(2), P, (2,)) is None
    pool.check([1, 0, 1, 1])


def test_touch_revives_an_evictable_block_and_renews_its_recency():
    pool = cached_pool(3, [0, 1, 2])
    pool.touch(0)
    assert not is_evictable(pool, 0) and pool.ref_counts[0] == 1 and pool.num_free == 2
    pool.release([0])  # now the most recently freed
    assert pool.take(2) == [1, 2]
    assert pool.take(1) == [0]


def test_lookup_requires_hash_parent_and_tokens_to_match():
    pool = BlockPool(2)
    (b,) = pool.take(1)
    register(pool, b, h(5), P, (1, 2))
    assert lookup(pool, h(5), P, (1, 2)) == b
    assert lookup(pool, h(6), P, (1, 2)) is None
    assert lookup(pool, h(5), b"q" * 32, (1, 2)) is None  # same hash, other parent: a collision
    assert lookup(pool, h(5), P, (1, 3)) is None  # same hash, other tokens: a collision


def test_register_keeps_the_first_block_for_a_hash_and_one_hash_per_block():
    pool = BlockPool(3)
    a, b, _ = pool.take(3)
    register(pool, a, h(1), P, (1,))
    register(pool, b, h(1), P, (1,))
    assert block_hash(pool, b) is None and lookup(pool, h(1), P, (1,)) == a
    register(pool, a, h(2), P, (2,))
    assert block_hash(pool, a) == h(1) and lookup(pool, h(2), P, (2,)) is None
    assert pool.num_cached == 1


def test_unregister_forgets_the_content():
    pool = BlockPool(2)
    a, b = pool.take(2)
    register(pool, a, h(1), P, (1,))
    pool.unregister(a)
    pool.unregister(b)  # no-op on an unhashed block
    assert lookup(pool, h(1), P, (1,)) is None and pool.num_cached == 0
    pool.release([a, b])
    assert pool.num_evictable == 0 and pool.num_free == 2
    pool.check([0, 0])


def test_reset_cache_forgets_hashes_of_used_and_evictable_blocks():
    pool = BlockPool(4)
    blocks = pool.take(4)
    for b in blocks:
        register(pool, b, h(b), P, (b,))
    pool.release(blocks[:2])
    pool.reset_cache()
    assert (pool.num_cached, pool.num_evictable, pool.num_free) == (0, 0, 2)
    assert all(block_hash(pool, b) is None for b in blocks)
    pool.release(blocks[2:])
    assert pool.num_free == 4 and pool.num_evictable == 0
    pool.check([0] * 4)


def test_grow_adds_free_blocks_after_the_old_free_ones():
    pool = BlockPool(3)
    pool.take(2)
    pool.grow(2)
    assert pool.num_blocks == 5 and pool.num_free == 3
    assert pool.take(3) == [2, 3, 4]
    pool.check([1] * 5)
    pool.grow(0)
    assert pool.num_blocks == 5


def test_empty_pool():
    pool = BlockPool(0, "cpu")
    assert pool.take(0) == []
    with pytest.raises(OutOfBlocksError, match="cpu"):
        pool.take(1)
    pool.check([])


def test_check_detects_refcount_mismatch():
    pool = BlockPool(3)
    pool.take(1)
    with pytest.raises(InvariantError, match="refcounts differ"):
        pool.check([0, 0, 0])


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda p: p._free.append(2),  # 2 twice in the free list
        lambda p: p._free.append(0),  # an in-use block also free
        lambda p: p._evictable.setdefault(0, {}).__setitem__(2, None),  # both free and evictable
        lambda p: p.hash_of.__setitem__(2, h(9)),  # a free block with a hash
        lambda p: p._cached.__setitem__(h(9), 0),  # a stale hash map entry
        lambda p: p._cached.__setitem__(h(1), 2),  # hash of block 1 maps elsewhere
    ],
)
def test_check_detects_corrupted_state(corrupt):
    pool = BlockPool(3)
    pool.take(2)
    register(pool, 1, h(1), P, (1,))
    pool.check([1, 1, 0])
    corrupt(pool)
    with pytest.raises(InvariantError) as info:
        pool.check([1, 1, 0])
    assert isinstance(info.value, PagedKVError) and isinstance(info.value, AssertionError)

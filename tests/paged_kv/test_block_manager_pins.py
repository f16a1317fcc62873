"""Pinned prefixes and eviction by request priority in the block manager."""

from __future__ import annotations

import pytest

from paged_kv import BlockManager, BlockManagerConfig
from paged_kv.errors import DuplicateSequenceError, UnknownSequenceError

BS = 4


def manager(num_blocks: int = 6) -> BlockManager:
    return BlockManager(BlockManagerConfig(num_blocks=num_blocks, block_size=BS, watermark=0.0))


def cached_after(bm: BlockManager, ids: list[int]) -> int:
    """Cached tokens a request of ``ids`` plus one more token would find."""
    return bm.num_cached_tokens(ids + [0])


def test_a_pinned_prefix_survives_a_pool_full_of_other_prompts():
    bm = manager()
    system = list(range(100, 108))  # 2 full blocks
    bm.allocate("s", system + [1])
    bm.free("s")
    assert bm.pin("sys", system) == 8
    for i in range(5):  # each other prompt takes every block the pin leaves: without it, the system prompt goes
        bm.allocate(i, list(range(i * 20, i * 20 + 16)))
        bm.free(i)
        assert cached_after(bm, system) == 8
    bm.check()
    bm.unpin("sys")
    bm.allocate("x", list(range(500, 524)))  # all 6 blocks: the unpinned prefix is evicted now
    assert cached_after(bm, system) == 0
    bm.check()


def test_pin_holds_only_what_is_cached_and_names_bad_ids():
    bm = manager()
    assert bm.pin("p", list(range(8))) == 0  # nothing cached: nothing held
    with pytest.raises(DuplicateSequenceError, match="pin_id"):
        bm.pin("p", list(range(8)))
    with pytest.raises(UnknownSequenceError, match="pin_id"):
        bm.unpin("nope")
    bm.unpin("p")
    assert bm.pinned == {}
    bm.check()


def test_eviction_takes_the_least_important_priority_first_then_lru():
    bm = manager(num_blocks=4)
    important, routine, older = list(range(0, 5)), list(range(10, 15)), list(range(20, 25))
    bm.allocate("old", older, priority=0)
    bm.free("old")
    bm.allocate("imp", important, priority=-5)  # vLLM: a lower value is more important
    bm.free("imp")
    bm.allocate("rt", routine, priority=3)
    bm.free("rt")
    # 3 cached blocks (1 full block each), 1 free: taking 3 blocks evicts priority 3, then 0, then -5
    bm.allocate("a", list(range(40, 48)))  # 2 blocks: the free one, then the least important (routine)
    assert [cached_after(bm, p[:4]) for p in (important, older, routine)] == [4, 4, 0]
    bm.allocate("b", list(range(60, 64)))  # 1 block: the older priority-0 one goes before the important one
    assert [cached_after(bm, p[:4]) for p in (important, older)] == [4, 0]
    bm.check()


def test_a_fork_inherits_its_parents_priority():
    bm = manager(num_blocks=4)
    bm.allocate("p", list(range(4)) + [9], priority=7)
    bm.fork("p", "c")
    bm.free("p")
    bm.allocate("keep", list(range(30, 34)) + [1], priority=0)
    bm.free("keep")
    bm.free("c")  # the shared block now evictable at the child's priority, 7
    bm.allocate("x", list(range(50, 62)))  # 3 blocks: the 2 free ones, then priority 7 goes before priority 0
    assert cached_after(bm, list(range(30, 34))) == 4
    assert cached_after(bm, list(range(4))) == 0
    bm.check()


def test_every_int64_priority_is_accepted_and_orders_eviction():
    bm = manager(num_blocks=3)
    lowest, highest = -(1 << 63), (1 << 63) - 1  # vLLM's priority is any int64
    bm.allocate("keep", list(range(4)) + [9], priority=lowest)
    bm.free("keep")
    bm.allocate("drop", list(range(10, 14)) + [9], priority=highest)
    bm.free("drop")
    bm.allocate("x", list(range(20, 28)))  # 2 blocks: the free one, then the least important (highest value)
    assert [cached_after(bm, list(range(4))), cached_after(bm, list(range(10, 14)))] == [4, 0]
    bm.check()


def test_pinned_blocks_apart_from_a_prompt_are_those_it_would_not_hit():
    bm = manager(num_blocks=8)
    assert bm.num_pinned_blocks_apart(list(range(12))) == 0  # no pin
    bm.allocate("s", list(range(8)) + [1])
    bm.free("s")
    bm.pin("sys", list(range(8)))  # 2 blocks
    assert bm.num_pinned_blocks == 2
    assert bm.num_pinned_blocks_apart(list(range(8)) + list(range(50, 70))) == 0  # extends the pin: shares both
    assert bm.num_pinned_blocks_apart(list(range(6))) == 1  # shares the first block only
    assert bm.num_pinned_blocks_apart(list(range(8))) == 1  # a hit never covers the last token
    assert bm.num_pinned_blocks_apart([9] + list(range(8))) == 2
    assert bm.num_pinned_blocks_apart(list(range(9)), cache_salt="tenant") == 2  # another tenant shares nothing
    assert bm.num_pinned_blocks_apart(9) == 2  # anonymous tokens share nothing


@pytest.mark.parametrize("cut", ["truncate", "drop_front"])
def test_blocks_a_sequence_gives_up_early_are_evictable_at_its_priority(cut):
    bm = manager(num_blocks=4)
    bm.allocate("keep", list(range(30, 34)) + [1], priority=0)
    bm.free("keep")
    bm.allocate("low", list(range(4)) + [9], priority=7)  # its full first block is cached
    if cut == "truncate":
        bm.truncate("low", 0)
    else:
        bm.drop_front("low", 2)
    assert bm.stats().num_evictable == 2
    bm.allocate("x", list(range(50, 62)))  # 3 blocks: the 2 free ones, then priority 7 goes before priority 0
    assert cached_after(bm, list(range(30, 34))) == 4
    assert cached_after(bm, list(range(4))) == 0
    bm.check()

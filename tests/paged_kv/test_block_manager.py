"""BlockManager unit tests: every public method, every error path, prefix cache, CoW, swap, stats."""

from __future__ import annotations

import copy
import random

import pytest
from bm_helpers import blocks_to_append_all, cached_hash, make, snapshot

import paged_kv.block_hash as hash_mod
from paged_kv import BlockManager
from paged_kv.block_pool import InvariantError
from paged_kv.config import MAX_BLOCKS
from paged_kv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfBlocksError,
    OutOfRangeError,
    PagedKVError,
    SequenceStateError,
    UnknownSequenceError,
)


def populated() -> BlockManager:
    """gpu 8 blocks, cpu 3: 'a' = 6 tokens [0,1], 'b' its fork, 's' swapped out (2 cpu blocks)."""
    m = make(num_cpu_blocks=3, track_changes=True)  # the journal is in the snapshot: a failed call records nothing
    m.allocate("a", list(range(6)))
    m.fork("a", "b")
    m.allocate("s", list(range(10, 15)))
    m.swap_out(["s"])
    return m


ERROR_CASES = [
    ("allocate-dup", lambda m: m.allocate("a", [1]), DuplicateSequenceError, r"^seq_id='a'"),
    ("allocate-unhashable", lambda m: m.allocate(["l"], [1]), InvalidArgumentError, r"^seq_id=\['l'\]"),
    ("allocate-neg-id", lambda m: m.allocate("n", [1, -1]), InvalidArgumentError, r"^token_ids=-1"),
    ("allocate-float-id", lambda m: m.allocate("n", [1.5]), InvalidArgumentError, r"^token_ids=1.5"),
    ("allocate-huge-id", lambda m: m.allocate("n", [1 << 63]), InvalidArgumentError, rf"^token_ids={1 << 63}"),
    ("allocate-str", lambda m: m.allocate("n", "abc"), InvalidArgumentError, r"^token_ids='str'"),
    ("allocate-neg-count", lambda m: m.allocate("n", -3), InvalidArgumentError, r"^token_ids=-3"),
    ("allocate-int-salt", lambda m: m.allocate("n", [1], cache_salt=7), InvalidArgumentError, r"^cache_salt="),
    ("allocate-int-salt", lambda m: m.allocate("n", [1], cache_salt=3), InvalidArgumentError, r"^cache_salt=3"),
    ("allocate-neg-look", lambda m: m.allocate("n", [1], num_lookahead_slots=-1), PagedKVError,
     r"^num_lookahead_slots=-1"),
    ("allocate-float-look", lambda m: m.allocate("n", [1], num_lookahead_slots=1.0), InvalidArgumentError,
     r"^num_lookahead_slots=1.0"),
    ("allocate-oob", lambda m: m.allocate("n", 100), OutOfBlocksError, r"^token_ids \(len 100\)"),
    ("allocate-oob-ids", lambda m: m.allocate("n", list(range(40))), OutOfBlocksError, r"^token_ids \(len 40\)"),
    ("append-unknown", lambda m: m.append("zz", [1]), UnknownSequenceError, r"^seq_id='zz'"),
    ("append-swapped", lambda m: m.append("s", [1]), SequenceStateError, r"^seq_id='s'.*swapped"),
    ("append-neg-id", lambda m: m.append("a", [-2]), InvalidArgumentError, r"^token_ids=-2"),
    ("append-none", lambda m: m.append("a", None), InvalidArgumentError, r"^token_ids="),
    ("append-neg-look", lambda m: m.append("a", [1], num_lookahead_slots=-1), PagedKVError, r"^num_lookahead_slots"),
    ("append-oob", lambda m: m.append("a", 100), OutOfBlocksError, r"^token_ids \(len 100\).*seq_id='a'"),
    ("fork-unknown", lambda m: m.fork("zz", "c"), UnknownSequenceError, r"^seq_id='zz'"),
    ("fork-swapped", lambda m: m.fork("s", "c"), SequenceStateError, r"^seq_id='s'"),
    ("fork-dup", lambda m: m.fork("a", "b"), DuplicateSequenceError, r"^child_id='b'"),
    ("fork-self", lambda m: m.fork("a", "a"), DuplicateSequenceError, r"^child_id='a'"),
    ("fork-unhashable", lambda m: m.fork("a", {}), InvalidArgumentError, r"^child_id=\{\}"),
    ("free-unknown", lambda m: m.free("zz"), UnknownSequenceError, r"^seq_id='zz'"),
    ("free-unhashable", lambda m: m.free([1]), UnknownSequenceError, r"^seq_id=\[1\]"),
    ("truncate-unknown", lambda m: m.truncate("zz", 0), UnknownSequenceError, r"^seq_id='zz'"),
    ("truncate-swapped", lambda m: m.truncate("s", 0), SequenceStateError, r"^seq_id='s'"),
    ("truncate-neg", lambda m: m.truncate("a", -1), OutOfRangeError, r"^num_tokens=-1"),
    ("truncate-grow", lambda m: m.truncate("a", 7), OutOfRangeError, r"^num_tokens=7: .*\[0, 6\]"),
    ("truncate-float", lambda m: m.truncate("a", 2.0), InvalidArgumentError, r"^num_tokens=2.0"),
    ("drop-unknown", lambda m: m.drop_front("zz", 1), UnknownSequenceError, r"^seq_id='zz'"),
    ("drop-swapped", lambda m: m.drop_front("s", 1), SequenceStateError, r"^seq_id='s'"),
    ("drop-neg", lambda m: m.drop_front("a", -1), OutOfRangeError, r"^num_blocks=-1"),
    ("drop-too-many", lambda m: m.drop_front("a", 3), OutOfRangeError, r"^num_blocks=3: .*\[0, 2\]"),
    ("drop-float", lambda m: m.drop_front("a", 1.0), InvalidArgumentError, r"^num_blocks=1.0"),
    ("swap-out-unknown", lambda m: m.swap_out(["zz"]), UnknownSequenceError, r"^seq_id='zz'"),
    ("swap-out-swapped", lambda m: m.swap_out(["s"]), SequenceStateError, r"^seq_id='s'"),
    ("swap-out-oob", lambda m: m.swap_out(["a"]), OutOfBlocksError, r"blocks=2: expected at most 1 free cpu"),
    ("swap-in-unknown", lambda m: m.swap_in(["zz"]), UnknownSequenceError, r"^seq_id='zz'"),
    ("swap-in-resident", lambda m: m.swap_in(["a"]), SequenceStateError, r"^seq_id='a': expected a swapped-out"),
    ("swap-out-group-unknown", lambda m: m.swap_out(["a", "zz"]), UnknownSequenceError, r"^seq_id='zz'"),
    ("swap-out-group-swapped", lambda m: m.swap_out(["a", "s"]), SequenceStateError, r"^seq_id='s'"),
    ("swap-out-group-dup", lambda m: m.swap_out(["a", "a"]), InvalidArgumentError,
     r"^seq_id='a': expected each sequence at most once"),
    ("swap-out-group-str", lambda m: m.swap_out("ab"), InvalidArgumentError, r"^seq_ids='ab'"),
    ("swap-out-group-iter", lambda m: m.swap_out(3), InvalidArgumentError, r"^seq_ids=3"),
    ("swap-out-group-oob", lambda m: m.swap_out(["a", "b"]), OutOfBlocksError,
     r"^seq_ids=\['a', 'b'\] hold blocks=2: expected at most 1 free cpu blocks"),
    ("swap-in-group-resident", lambda m: m.swap_in(["s", "a"]), SequenceStateError,
     r"^seq_id='a': expected a swapped-out"),
    ("swap-in-group-unknown", lambda m: m.swap_in(["s", "zz"]), UnknownSequenceError, r"^seq_id='zz'"),
    ("swap-in-group-dup", lambda m: m.swap_in(["s", "s"]), InvalidArgumentError, r"^seq_id='s'"),
    ("can-swap-out-group-swapped", lambda m: m.can_swap_out(["s"]), SequenceStateError, r"^seq_id='s'"),
    ("can-swap-in-group-unknown", lambda m: m.can_swap_in(["zz"]), UnknownSequenceError, r"^seq_id='zz'"),
    ("can-alloc-bad", lambda m: m.can_allocate("abc"), InvalidArgumentError, r"^token_ids="),
    ("can-alloc-salt", lambda m: m.can_allocate([1], cache_salt=1), InvalidArgumentError, r"^cache_salt=1"),
    ("can-alloc-look", lambda m: m.can_allocate([1], num_lookahead_slots=-1), PagedKVError, r"^num_lookahead_slots"),
    ("can-alloc-look-t", lambda m: m.can_allocate([1], num_lookahead_slots="2"), PagedKVError, "num_lookahead"),
    ("can-append-unknown", lambda m: m.can_append("zz"), UnknownSequenceError, r"^seq_id='zz'"),
    ("can-append-swapped", lambda m: m.can_append("s"), SequenceStateError, r"^seq_id='s'"),
    ("can-append-neg", lambda m: m.can_append("a", -1), InvalidArgumentError, r"^num_new_tokens=-1"),
    ("to-append-neg", lambda m: m.num_blocks_to_append("a", -1), InvalidArgumentError, r"^num_new_tokens=-1"),
    ("to-append-swapped", lambda m: m.num_blocks_to_append("s"), SequenceStateError, r"^seq_id='s'"),
    ("can-append-all-pairs-neg", lambda m: m.can_append_all([("a", 1), ("b", -1)]), InvalidArgumentError,
     r"^num_new_tokens=-1"),
    ("can-append-all-pairs-unknown", lambda m: m.can_append_all([("zz", 1)]), UnknownSequenceError, r"^seq_id"),
    ("can-append-all-pairs-swapped", lambda m: m.can_append_all([("s", 1)]), SequenceStateError, r"^seq_id='s'"),
    ("can-append-all-pairs-dup", lambda m: m.can_append_all([("a", 1), ("a", 1)]), InvalidArgumentError,
     r"^seq_id='a': expected each sequence at most once"),
    ("can-append-all-pairs-shape", lambda m: m.can_append_all(["a"]), InvalidArgumentError, r"^requests='a'"),
    ("can-append-all-pairs-iter", lambda m: m.can_append_all(3), InvalidArgumentError, r"^requests=3"),
    ("to-write-all-gap", lambda m: m.num_blocks_to_write_all([("a", 7, 8)]), OutOfRangeError, r"^start=7: .*\[0, 6\]"),
    ("to-write-all-reversed", lambda m: m.num_blocks_to_write_all([("a", 3, 2)]), InvalidArgumentError, r"^end=2"),
    ("to-write-all-pair", lambda m: m.num_blocks_to_write_all([("a", 3)]), InvalidArgumentError, r"^requests="),
    ("append-all-unknown", lambda m: m.append_all([("a", [1]), ("zz", [1])]), UnknownSequenceError, r"^seq_id='zz'"),
    ("append-all-unhashable", lambda m: m.append_all([([1], [1])]), UnknownSequenceError, r"^seq_id=\[1\]"),
    ("append-all-swapped", lambda m: m.append_all([("a", [1]), ("s", [1])]), SequenceStateError, r"^seq_id='s'"),
    ("append-all-dup", lambda m: m.append_all([("a", [1]), ("a", [2])]), InvalidArgumentError,
     r"^seq_id='a': expected each sequence at most once"),
    ("append-all-neg-id", lambda m: m.append_all([("a", [1]), ("b", [-2])]), InvalidArgumentError, r"^token_ids=-2"),
    ("append-all-none", lambda m: m.append_all([("a", None)]), InvalidArgumentError, r"^token_ids="),
    ("append-all-shape", lambda m: m.append_all(["a"]), InvalidArgumentError, r"^requests='a'"),
    ("append-all-iter", lambda m: m.append_all(3), InvalidArgumentError, r"^requests=3"),
    ("append-all-oob", lambda m: m.append_all([("a", [1]), ("b", 100)]), OutOfBlocksError,
     r"^token_ids \(len 100\): needs 25 blocks for seq_id='b', expected at most 5 free"),
    ("can-append-all-unknown", lambda m: m.can_append_all([("zz", 1)]), UnknownSequenceError, r"^seq_id='zz'"),
    ("can-append-all-neg", lambda m: m.can_append_all([("a", -1)]), InvalidArgumentError, r"^num_new_tokens=-1"),
    ("can-append-look", lambda m: m.can_append("a", 1, num_lookahead_slots=-4), PagedKVError, r"^num_lookahead"),
    ("can-swap-out-unknown", lambda m: m.can_swap_out(["zz"]), UnknownSequenceError, r"^seq_id='zz'"),
    ("can-swap-out-swapped", lambda m: m.can_swap_out(["s"]), SequenceStateError, r"^seq_id='s'"),
    ("can-swap-in-unknown", lambda m: m.can_swap_in(["zz"]), UnknownSequenceError, r"^seq_id='zz'"),
    ("cached-bad", lambda m: m.num_cached_tokens([-1]), InvalidArgumentError, r"^token_ids=-1"),
    ("cached-salt", lambda m: m.num_cached_tokens([1], cache_salt=1.5), InvalidArgumentError, r"^cache_salt="),
    ("table-unknown", lambda m: m.block_table("zz"), UnknownSequenceError, r"^seq_id='zz'"),
    ("num-tokens-unknown", lambda m: m.num_tokens("zz"), UnknownSequenceError, r"^seq_id='zz'"),
    ("is-swapped-unknown", lambda m: m.is_swapped("zz"), UnknownSequenceError, r"^seq_id='zz'"),
    ("write-unknown", lambda m: m.prepare_write("zz", 0, 1), UnknownSequenceError, r"^seq_id='zz'"),
    ("write-swapped", lambda m: m.prepare_write("s", 0, 1), SequenceStateError, r"^seq_id='s'"),
    ("write-past-blocks", lambda m: m.prepare_write("a", 0, 9), OutOfRangeError, r"^end=9: .*\[0, 8\]"),
    ("write-reversed", lambda m: m.prepare_write("a", 3, 2), OutOfRangeError, r"^start=3"),
    ("write-neg", lambda m: m.prepare_write("a", -1, 2), OutOfRangeError, r"^start=-1"),
    ("can-write-range", lambda m: m.can_prepare_write("a", 0, 9), OutOfRangeError, r"^end=9"),
    ("add-neg", lambda m: m.add_blocks(-1), OutOfRangeError, r"^num_blocks=-1"),
    ("add-huge", lambda m: m.add_blocks(MAX_BLOCKS), OutOfRangeError, r"^num_blocks="),
]


@pytest.mark.parametrize(("call", "exc", "match"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_bad_calls_raise_a_typed_error_naming_the_argument_and_change_nothing(call, exc, match):
    m = populated()
    before = snapshot(m)
    with pytest.raises(exc, match=match) as info:
        call(m)
    assert isinstance(info.value, PagedKVError)
    assert snapshot(m) == before
    m.check()


def test_free_twice_raises_unknown():
    m = make()
    m.allocate("a", [1, 2, 3])
    m.free("a")
    before = snapshot(m)
    with pytest.raises(UnknownSequenceError, match="seq_id='a'"):
        m.free("a")
    assert snapshot(m) == before


def test_allocate_out_of_blocks_with_revivable_hits_changes_nothing():
    m = make(num_blocks=4)
    m.allocate("p", list(range(9)))  # 2 cached full blocks + 1
    m.free("p")  # 2 evictable, 2 free
    prompt = list(range(8)) + list(range(100, 109))  # 2 hits to revive + 3 new = 5 > 4
    before = snapshot(m)
    assert not m.can_allocate(prompt)
    with pytest.raises(OutOfBlocksError):
        m.allocate("q", prompt)
    assert snapshot(m) == before
    assert m.allocate("q", prompt[:12]) == 8  # 2 revived + 1 new fits


def test_append_out_of_blocks_for_the_copy_changes_nothing():
    m = make(num_blocks=3)
    m.allocate("a", [1, 2])
    m.fork("a", "b")
    m.allocate("full", 8)  # takes the 2 other blocks
    before = snapshot(m)
    assert not m.can_append("a", 1)
    with pytest.raises(OutOfBlocksError, match="needs 1 blocks"):
        m.append("a", [3])  # the shared block needs a copy, none is free
    assert snapshot(m) == before
    m.free("b")
    assert m.append("a", [3]) == []  # now private: written in place


def test_swap_in_out_of_blocks_changes_nothing():
    m = make(num_blocks=4)
    m.allocate("s", list(range(8)))
    m.swap_out(["s"])
    m.allocate("fill", 12)  # 3 of 4 blocks
    before = snapshot(m)
    assert not m.can_swap_in(["s"])
    with pytest.raises(OutOfBlocksError, match="expected at most 1 free gpu"):
        m.swap_in(["s"])
    assert snapshot(m) == before


def test_prepare_write_out_of_blocks_changes_nothing():
    m = make(num_blocks=3)
    m.allocate("a", list(range(8)))
    m.fork("a", "b")
    m.allocate("c", 4)
    before = snapshot(m)
    assert not m.can_prepare_write("a", 0, 8)
    with pytest.raises(OutOfBlocksError, match="needs 2 blocks"):
        m.prepare_write("a", 0, 8)
    assert snapshot(m) == before


# -- queries, allocate, lookahead ---------------------------------------------
def test_allocate_gives_blocks_for_prompt_and_lookahead():
    m = make()
    assert m.allocate("a", [5, 6, 7, 8, 9]) == 0
    assert m.block_table("a") == [0, 1] and m.num_tokens("a") == 5 and not m.is_swapped("a")
    m.allocate("b", [1], num_lookahead_slots=3)
    assert m.block_table("b") == [2]
    m.allocate("c", [1], num_lookahead_slots=4)
    assert m.block_table("c") == [3, 4] and m.num_tokens("c") == 1
    m.allocate("e", [])
    assert m.block_table("e") == [] and m.num_tokens("e") == 0
    assert m.seq_ids() == ["a", "b", "c", "e"] and "a" in m and "z" not in m
    m.check()


def test_block_table_is_a_copy():
    m = make()
    m.allocate("a", [1, 2])
    m.block_table("a").append(99)
    assert m.block_table("a") == [0]


def test_any_hashable_seq_id_works():
    m = make()
    m.allocate(7, [1])
    m.allocate(("req", 1), 3)
    m.fork(7, None)
    assert m.seq_ids() == [7, ("req", 1), None]
    m.check()


def test_append_grows_and_uses_lookahead_blocks():
    m = make()
    m.allocate("a", [1, 2, 3])
    assert m.append("a", [4]) == [] and m.block_table("a") == [0]
    assert m.append("a", [5], num_lookahead_slots=4) == [] and m.block_table("a") == [0, 1, 2]
    assert m.append("a", [6, 7, 8, 9]) == [] and m.block_table("a") == [0, 1, 2]  # already reserved
    assert m.append("a", 0) == [] and m.num_tokens("a") == 9
    assert m.append("a", 4) == [] and m.block_table("a") == [0, 1, 2, 3] and m.num_tokens("a") == 13
    m.check()


def test_can_append_matches_append():
    m = make(num_blocks=3)
    m.allocate("a", [1, 2, 3])
    assert m.can_append("a", 1) and m.can_append("a", 9) and not m.can_append("a", 10)
    assert m.can_append("a", 5, num_lookahead_slots=4) and not m.can_append("a", 5, num_lookahead_slots=5)
    assert m.can_append("a", 0)
    with pytest.raises(OutOfBlocksError):
        m.append("a", 5, num_lookahead_slots=5)
    m.append("a", 9)
    assert m.block_table("a") == [0, 1, 2] and not m.can_append("a", 1)


def test_num_blocks_to_append_counts_new_blocks_and_copies():
    m = make()
    m.allocate("a", [1, 2, 3, 4, 5, 6])
    assert [m.num_blocks_to_append("a", n) for n in (0, 1, 2, 3, 10)] == [0, 0, 0, 1, 2]
    assert m.num_blocks_to_append("a", 1, num_lookahead_slots=2) == 1
    m.fork("a", "b")  # the half-full last block is shared now: the first write copies it
    assert [m.num_blocks_to_append("b", n) for n in (0, 1, 3)] == [0, 1, 2]
    free = m.gpu.num_free
    m.append("b", 3)
    assert m.gpu.num_free == free - 2


def test_append_all_cost_counts_k_minus_1_copies_of_a_block_k_sequences_share():
    m = make(num_blocks=16)
    m.allocate("a", [1, 2, 3, 4, 5, 6])  # blocks [0, 1], the last half full
    m.fork("a", "b")
    m.fork("a", "c")
    assert blocks_to_append_all(m, []) == 0
    assert blocks_to_append_all(m, [("a", 1)]) == 1
    assert blocks_to_append_all(m, [("a", 1), ("b", 1)]) == 2
    assert blocks_to_append_all(m, [("a", 1), ("b", 1), ("c", 1)]) == 2  # c finds block 1 its own
    assert blocks_to_append_all(m, [("a", 0), ("b", 1), ("c", 1)]) == 2  # a holds it: c copies too
    assert blocks_to_append_all(m, [("a", 3), ("b", 1), ("c", 3)]) == 4  # 2 copies + 2 new blocks
    free = m.gpu.num_free
    for seq_id in "abc":
        m.append(seq_id, [7])
    assert m.gpu.num_free == free - 2 and m.num_cow_copies == 2
    m.check()


def _random_shared_manager(rng: random.Random) -> BlockManager:
    """Sequences forked from one another at random lengths, with shared partial and full blocks."""
    m = make(num_blocks=64, block_size=4, enable_prefix_caching=rng.random() < 0.5)
    m.allocate(0, [rng.randrange(50) for _ in range(rng.randrange(1, 12))])
    for seq_id in range(1, rng.randrange(2, 7)):
        m.fork(rng.randrange(seq_id), seq_id)
        if rng.random() < 0.5:
            m.append(seq_id, [rng.randrange(50) for _ in range(rng.randrange(0, 6))])
    return m


@pytest.mark.parametrize("seed", range(40))
def test_append_all_cost_is_what_the_appends_take(seed):
    rng = random.Random(seed)
    m = _random_shared_manager(rng)
    ids = m.seq_ids()
    rng.shuffle(ids)
    requests = [(s, rng.randrange(0, 7)) for s in ids[: rng.randrange(1, len(ids) + 1)]]
    expected = blocks_to_append_all(m, requests)
    work = copy.deepcopy(m)
    for seq_id, n in requests:
        work.append(seq_id, [rng.randrange(50) for _ in range(n)])
    assert m.gpu.num_free - work.gpu.num_free == expected
    grown = sum(len(work.block_table(s)) - len(m.block_table(s)) for s, _ in requests)
    assert work.num_cow_copies - m.num_cow_copies == expected - grown
    work.check()


@pytest.mark.parametrize("seed", range(40))
def test_num_blocks_to_write_all_is_what_append_then_prepare_write_take(seed):
    rng = random.Random(1000 + seed)
    m = _random_shared_manager(rng)
    requests = []
    for seq_id in m.seq_ids():
        start = rng.randrange(m.num_tokens(seq_id) + 1)
        requests.append((seq_id, start, start + rng.randrange(0, 7)))
    rng.shuffle(requests)
    expected = m.num_blocks_to_write_all(requests)
    work = copy.deepcopy(m)
    for seq_id, start, end in requests:
        work.append(seq_id, max(0, end - work.num_tokens(seq_id)))
        work.prepare_write(seq_id, start, end)
    assert m.gpu.num_free - work.gpu.num_free == expected
    work.check()


def test_append_all_cost_matches_num_blocks_to_append_for_one_sequence():
    m = populated()
    for seq_id in "ab":
        for n in range(10):
            assert blocks_to_append_all(m, [(seq_id, n)]) == m.num_blocks_to_append(seq_id, n)
            assert blocks_to_append_all(m, iter([(seq_id, n)])) == m.num_blocks_to_append(seq_id, n)


def test_can_allocate_watermark():
    m = make(num_blocks=10, watermark=0.2)  # keeps 2 blocks in reserve
    assert m.config.watermark_blocks == 2
    assert m.can_allocate(32) and not m.can_allocate(33)
    assert m.can_allocate(28, num_lookahead_slots=4) and not m.can_allocate(28, num_lookahead_slots=5)
    m.allocate("big", 33)  # allocate itself may dip into the reserve
    assert m.gpu.num_free == 1 and not m.can_allocate(1)


def test_can_swap_in_respects_the_watermark():
    m = make(num_blocks=10, watermark=0.2)
    m.allocate("s", 12)
    m.swap_out(["s"])
    m.allocate("fill", 20)  # 5 free, s needs 3, reserve 2
    assert m.can_swap_in(["s"])
    m.append("fill", 1)
    assert not m.can_swap_in(["s"])
    m.swap_in(["s"])  # the reserve is for running sequences: swap_in may use it
    assert m.gpu.num_free == 1


# -- prefix cache ---------------------------------------------------------
def test_prefix_hits_count_full_blocks_and_never_the_last_token():
    m = make(num_blocks=16)
    prompt = list(range(10))  # 2 full blocks + 2
    assert m.allocate("a", prompt) == 0
    m.free("a")
    assert m.num_cached_tokens(prompt) == 8
    assert m.num_cached_tokens(prompt[:9]) == 8
    assert m.num_cached_tokens(prompt[:8]) == 4  # the last token is always computed
    assert m.num_cached_tokens(prompt[:5]) == 4
    assert m.num_cached_tokens(prompt[:4]) == 0
    assert m.num_cached_tokens(prompt[:8] + [77, 78, 79, 80, 81]) == 8
    assert m.num_cached_tokens([]) == 0 and m.num_cached_tokens(10) == 0
    assert m.allocate("b", prompt[:9]) == 8
    assert m.block_table("b")[:2] == [0, 1]
    m.check()


def test_prefix_hits_stop_at_the_first_miss():
    m = make(num_blocks=16)
    m.allocate("a", list(range(13)))
    other_head = [99, 1, 2, 3] + list(range(4, 13))
    assert m.num_cached_tokens(other_head) == 0  # later blocks chain over the head
    other_middle = list(range(4)) + [99, 5, 6, 7] + list(range(8, 13))
    assert m.num_cached_tokens(other_middle) == 4


def test_hits_on_blocks_in_use_share_them():
    m = make()
    m.allocate("a", list(range(9)))
    assert m.allocate("b", list(range(8)) + [50, 51]) == 8
    assert m.block_table("b") == [0, 1, 3]
    assert m.gpu.ref_counts[:4] == [2, 2, 1, 1]
    m.free("a")
    assert m.gpu.ref_counts[:4] == [1, 1, 0, 1] and m.stats().num_evictable == 0
    m.check()


def test_cache_salts_never_share():
    m = make(num_blocks=16)
    prompt = list(range(9))
    m.allocate("a", prompt, cache_salt="tenant-a")
    assert m.num_cached_tokens(prompt, cache_salt="tenant-a") == 8
    assert m.num_cached_tokens(prompt, cache_salt="tenant-b") == 0
    assert m.num_cached_tokens(prompt) == 0
    assert m.allocate("b", prompt, cache_salt="tenant-b") == 0
    assert m.allocate("c", prompt, cache_salt="") == 0
    assert m.allocate("d", prompt, cache_salt="tenant-a") == 8
    m.check()


def test_root_hashes_of_many_salts_stay_bounded_and_correct():
    m = make(num_blocks=16)
    m.allocate("a", list(range(9)), cache_salt="tenant-0")
    for i in range(hash_mod.ROOT_CACHE_SIZE + 10):  # more salts than the root cache keeps
        m.num_cached_tokens([1], cache_salt=f"other-{i}")
    assert hash_mod._root_cached.cache_info().currsize <= hash_mod.ROOT_CACHE_SIZE
    assert m.num_cached_tokens(list(range(9)), cache_salt="tenant-0") == 8  # its root, recomputed, still hits
    assert m.num_cached_tokens(list(range(9))) == 0


def test_a_hash_collision_never_serves_other_tokens(monkeypatch):
    def colliding(parent, contents):
        return [b"c" * 32] * len(contents)

    monkeypatch.setattr(hash_mod, "chain_hashes", colliding)
    m = make(num_blocks=16)
    m.allocate("a", [1, 2, 3, 4, 5])
    assert cached_hash(m, m.block_table("a")[0]) == b"c" * 32  # the patch is in effect
    assert m.num_cached_tokens([1, 2, 3, 4, 5]) == 4  # same tokens: a real hit
    assert m.num_cached_tokens([9, 9, 9, 9, 5]) == 0  # same hash, other tokens
    assert m.allocate("b", [9, 9, 9, 9, 5]) == 0
    assert m.block_table("b")[0] != m.block_table("a")[0]
    # same hash and tokens but another parent (salt): the parent check refuses it
    assert m.allocate("c", [1, 2, 3, 4, 5], cache_salt="x") == 0
    m.check()


def test_anonymous_tokens_are_never_cached():
    m = make(num_blocks=16)
    m.allocate("a", 9)
    assert m.stats().num_cached == 0
    m.append("a", 8)
    m.free("a")
    assert m.stats().num_cached == 0 and m.stats().num_evictable == 0
    m.allocate("b", list(range(4)) + [1])
    m.append("b", 3)  # anonymous tokens make the rest of the sequence uncacheable
    m.append("b", [7, 7, 7, 7, 7])
    assert m.stats().num_cached == 1
    assert m.num_cached_tokens(list(range(4)) + [1, 0, 0, 0] + [7, 7, 7, 7, 7]) == 4


def test_prefix_caching_disabled():
    m = make(enable_prefix_caching=False)
    m.allocate("a", list(range(9)))
    m.append("a", list(range(8)))
    m.free("a")
    assert m.stats().num_cached == 0
    assert m.allocate("b", list(range(9))) == 0 and m.num_cached_tokens(list(range(9))) == 0


def test_append_registers_blocks_it_fills():
    m = make(num_blocks=16)
    m.allocate("a", [1, 2])
    m.append("a", [3, 4, 5])
    m.append("a", [6, 7, 8, 9])
    assert m.stats().num_cached == 2
    assert m.num_cached_tokens(list(range(1, 10))) == 8
    assert m.num_cached_tokens([1, 2, 3, 4, 5, 6, 7, 0, 9]) == 4


# -- eviction order ---------------------------------------------------------
def test_uncached_free_blocks_are_reused_before_evicting():
    m = make(num_blocks=4)
    m.allocate("a", list(range(9)))  # blocks 0,1 cached, block 2 partial
    m.free("a")
    m.allocate("b", 8)
    assert sorted(m.block_table("b")) == [2, 3]
    assert m.stats().num_evictions == 0 and m.num_cached_tokens(list(range(9))) == 8


def test_tail_blocks_of_a_freed_sequence_are_evicted_before_its_head():
    m = make(num_blocks=4)
    m.allocate("a", list(range(9)))
    m.free("a")
    m.allocate("b", 8)
    m.allocate("c", 1)
    assert m.block_table("c") == [1]  # the tail full block goes first
    assert m.stats().num_evictions == 1
    assert m.num_cached_tokens(list(range(9))) == 4  # the head still hits


def test_least_recently_freed_is_evicted_first():
    m = make(num_blocks=3)
    m.allocate("x", [1, 1, 1, 1])
    m.allocate("y", [2, 2, 2, 2])
    m.allocate("z", [3, 3, 3, 3])
    m.free("y")
    m.free("x")
    m.free("z")
    m.allocate("n", 1)
    assert m.block_table("n") == [1]  # y's block
    assert m.allocate("x2", [1, 1, 1, 1, 9]) == 4  # x is revived: now most recently used
    m.free("x2")
    m.free("n")
    m.allocate("n2", 8)
    assert m.block_table("n2") == [1, 2]  # n's uncached block, then z (freed before x2)
    assert m.num_cached_tokens([1, 1, 1, 1, 9]) == 4


def test_reset_prefix_cache():
    m = make(num_blocks=8)
    m.allocate("a", list(range(9)))
    m.allocate("keep", list(range(20, 29)))
    m.free("a")
    assert m.stats().num_cached == 4 and m.stats().num_evictable == 2
    m.reset_prefix_cache()
    s = m.stats()
    assert (s.num_cached, s.num_evictable, s.num_free) == (0, 0, 5)
    assert m.num_cached_tokens(list(range(9))) == 0 and m.num_cached_tokens(list(range(20, 29))) == 0
    m.append("keep", [29, 30, 31])  # keeps working; its next full block is cached again
    assert m.stats().num_cached == 1
    m.free("keep")
    assert m.stats().num_evictable == 1 and m.gpu.num_free == 8
    m.check()


# -- fork and copy-on-write ---------------------------------------------------
def test_fork_shares_every_block():
    m = make()
    m.allocate("a", list(range(6)), num_lookahead_slots=4)
    m.fork("a", "b")
    assert m.block_table("b") == m.block_table("a") == [0, 1, 2]
    assert m.num_tokens("b") == 6 and m.gpu.ref_counts[:3] == [2, 2, 2]
    m.free("a")
    assert m.gpu.ref_counts[:3] == [1, 1, 1] and m.block_table("b") == [0, 1, 2]
    m.check()


def test_first_writer_copies_second_writes_in_place():
    m = make()
    m.allocate("a", list(range(6)))
    m.fork("a", "b")
    assert m.append("b", [100]) == [(1, 2)]
    assert m.block_table("b") == [0, 2] and m.block_table("a") == [0, 1]
    assert m.gpu.ref_counts[:3] == [2, 1, 1]
    assert m.append("a", [200]) == []  # block 1 is private again
    assert m.block_table("a") == [0, 1]
    assert m.stats().num_cow_copies == 1
    m.check()


def test_append_on_a_block_boundary_copies_nothing():
    m = make()
    m.allocate("a", list(range(8)))
    m.fork("a", "b")
    assert m.append("b", [1, 2]) == [] and m.block_table("b") == [0, 1, 2]
    assert m.stats().num_cow_copies == 0


def test_a_shared_lookahead_block_is_copied_when_written():
    m = make()
    m.allocate("a", list(range(4)), num_lookahead_slots=8)  # blocks 0 full, 1 and 2 reserved
    m.fork("a", "b")
    copies = m.append("b", [1, 2, 3, 4, 5])  # lands in blocks 1 and 2
    assert copies == [(1, 3), (2, 4)]
    assert m.block_table("b") == [0, 3, 4] and m.block_table("a") == [0, 1, 2]
    assert m.stats().num_cow_copies == 2
    m.check()


def test_fork_of_an_anonymous_sequence_stays_uncached():
    m = make()
    m.allocate("a", 3)
    m.fork("a", "b")
    m.append("b", [1, 2, 3, 4, 5])
    assert m.stats().num_cached == 0


# -- truncate ---------------------------------------------------------------
def test_truncate_frees_whole_blocks_past_the_new_end():
    m = make()
    m.allocate("a", list(range(10)), num_lookahead_slots=4)
    assert m.block_table("a") == [0, 1, 2, 3]
    m.truncate("a", 10)
    assert m.block_table("a") == [0, 1, 2]  # lookahead slots are dropped
    m.truncate("a", 5)
    assert m.block_table("a") == [0, 1] and m.num_tokens("a") == 5
    m.truncate("a", 4)
    assert m.block_table("a") == [0]
    m.truncate("a", 0)
    assert m.block_table("a") == [] and m.num_tokens("a") == 0
    assert m.gpu.num_free == 8 and m.stats().num_evictable == 2  # its two full blocks stay cached
    m.append("a", [0, 1, 2])
    m.check()


def test_draft_slots_are_never_hashed_and_truncate_to_the_own_length_keeps_the_hashes():
    """Speculative decoding's use: drafts in lookahead slots, the accepted ones appended after, the rest dropped."""
    from paged_kv.block_hash import BlockHashes

    m = make(num_blocks=16)
    hashes = BlockHashes(4)
    m.allocate("a", [1, 2, 3], hashes=hashes)
    m.append("a", [4], num_lookahead_slots=6)  # a token, then 6 drafts' slots (positions 4..9)
    assert len(m.block_table("a")) == 3 and m.num_tokens("a") == 4
    assert m.num_cached_tokens([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 4  # only [1, 2, 3, 4] is cached: no draft block
    m.append("a", [5, 6, 7])  # 3 drafts accepted: their slots exist, no block taken
    assert len(m.block_table("a")) == 3 and m.gpu.num_free == 13
    assert m.num_cached_tokens([1, 2, 3, 4, 5, 6, 7, 0, 9]) == 4  # the second block is not full yet
    m.truncate("a", 7)  # the blocks past the kept tokens are freed; the sequence's hashes are its own still
    assert len(m.block_table("a")) == 2 and m.gpu.num_free == 14
    m.append("a", [8, 9])
    assert m.num_cached_tokens([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8 and hashes.num_tokens == 9  # extended in place
    m.check()


def test_append_after_truncate_into_a_cached_block_unregisters_it():
    m = make(num_blocks=16)
    m.allocate("a", list(range(9)))
    m.truncate("a", 6)  # block 1 (cached [4..7]) now partial, private
    assert m.num_cached_tokens(list(range(9))) == 8  # its content is still intact
    assert m.append("a", [99, 98]) == []  # written in place: leaves the cache
    assert m.num_cached_tokens(list(range(9))) == 4
    assert m.num_cached_tokens([0, 1, 2, 3, 4, 5, 99, 98, 0]) == 8  # cached under its new content
    m.check()


def test_append_after_truncate_into_a_shared_cached_block_copies_it():
    m = make(num_blocks=16)
    m.allocate("a", list(range(9)))
    m.truncate("a", 6)
    assert m.allocate("b", list(range(9))) == 8  # b shares block 1 through the cache
    assert m.append("a", [99]) == [(1, 3)]
    assert m.block_table("b")[:2] == [0, 1] and m.block_table("a") == [0, 3]
    assert m.num_cached_tokens(list(range(9))) == 8  # block 1 keeps [4..7] for b
    m.check()


def test_truncate_then_swap_in_does_not_recache_stale_hashes():
    m = make(num_blocks=16)
    m.allocate("a", list(range(9)))
    m.append("a", 1)  # anonymous: 'a' is no longer cacheable
    m.truncate("a", 2)  # block 0 now holds [0, 1] only
    m.append("a", [50, 51, 52, 53, 54, 55])  # overwrites slots 2..7 of block 0
    m.swap_out(["a"])
    m.swap_in(["a"])
    assert m.num_cached_tokens(list(range(9))) == 0  # block 0 content is [0, 1, 50, 51]
    m.check()


# -- swap ---------------------------------------------------------------------
def test_swap_out_and_in_return_block_mappings():
    m = make(num_blocks=8, num_cpu_blocks=4)
    m.allocate("x", 4)
    m.allocate("a", 6)
    assert m.swap_out(["a"]) == [(1, 0), (2, 1)]
    assert m.is_swapped("a") and m.block_table("a") == [0, 1] and m.num_tokens("a") == 6
    s = m.stats()
    assert (s.num_cpu_used, s.num_used) == (2, 1)
    m.allocate("y", 4)
    assert m.block_table("y") == [1]  # the most recently freed block is reused first
    assert m.can_swap_in(["a"])
    assert m.swap_in(["a"]) == [(0, 2), (1, 3)]
    assert not m.is_swapped("a") and m.block_table("a") == [2, 3] and m.stats().num_cpu_used == 0
    m.check()


def test_swap_in_re_registers_full_blocks():
    m = make(num_blocks=8, num_cpu_blocks=4)
    prompt = list(range(9))
    m.allocate("a", prompt)
    m.swap_out(["a"])
    m.reset_prefix_cache()  # the GPU copies are gone from the cache
    assert m.num_cached_tokens(prompt) == 0
    m.swap_in(["a"])
    assert m.num_cached_tokens(prompt) == 8
    assert m.allocate("b", prompt) == 8 and m.block_table("b")[:2] == m.block_table("a")[:2]
    m.check()


def test_swap_of_an_empty_sequence_and_free_while_swapped():
    m = make(num_cpu_blocks=0)
    m.allocate("e", [])
    assert m.can_swap_out(["e"]) and m.swap_out(["e"]) == [] and m.is_swapped("e")
    m.free("e")
    m2 = make(num_cpu_blocks=2)
    m2.allocate("a", 8)
    m2.swap_out(["a"])
    assert m2.stats().num_cpu_used == 2
    m2.free("a")
    assert m2.stats().num_cpu_used == 0 and m2.gpu.num_free == 8
    m2.check()


def test_can_swap_out_and_in_match_the_actions():
    m = make(num_blocks=4, num_cpu_blocks=2)
    m.allocate("a", 9)
    assert not m.can_swap_out(["a"])
    m.truncate("a", 8)
    assert m.can_swap_out(["a"])
    m.swap_out(["a"])
    m.allocate("fill", 12)
    assert not m.can_swap_in(["a"])
    m.truncate("fill", 8)
    assert m.can_swap_in(["a"])
    m.swap_in(["a"])
    assert not m.can_swap_in(["a"])  # resident: nothing to swap in


# -- prepare_write, add_blocks ----------------------------------------------
def test_prepare_write_copies_shared_blocks_and_unregisters_private_ones():
    m = make(num_blocks=16)
    m.allocate("a", list(range(13)))
    m.fork("a", "b")
    assert m.can_prepare_write("b", 2, 6)
    assert m.prepare_write("b", 2, 6) == [(0, 4), (1, 5)]
    assert m.block_table("b") == [4, 5, 2, 3] and m.block_table("a") == [0, 1, 2, 3]
    assert m.num_cached_tokens(list(range(13))) == 12  # a's blocks keep their content
    m.free("a")
    assert m.prepare_write("b", 8, 9) == []  # private and cached: leaves the cache
    assert m.num_cached_tokens(list(range(13))) == 8
    m.append("b", [1, 2, 3])
    assert m.stats().num_cached == 2  # b is no longer cacheable
    assert m.prepare_write("b", 3, 3) == [] and m.can_prepare_write("b", 0, 16)
    m.check()


def test_prepare_write_of_the_tail_stops_caching_it():
    m = make(num_blocks=16)
    m.allocate("a", list(range(6)))
    m.prepare_write("a", 4, 6)  # slots 4, 5 get other content
    m.append("a", [6, 7, 8])
    assert m.num_cached_tokens(list(range(9))) == 4
    m.check()


def test_add_blocks_grows_the_pool():
    m = make(num_blocks=2)
    m.allocate("a", 8)
    assert not m.can_allocate(1)
    m.add_blocks(3)
    assert m.stats().num_blocks == 5 and m.gpu.num_free == 3
    m.allocate("b", 12)
    assert m.block_table("b") == [2, 3, 4]
    m.add_blocks(0)
    m.check()


def test_add_blocks_keeps_the_watermark_a_fraction_of_the_grown_pool():
    m = make(num_blocks=10, num_cpu_blocks=10, watermark=0.2)  # 2 blocks in reserve
    m.add_blocks(90)  # 100 blocks: 20 in reserve, as vLLM's watermark is a fraction of the GPU blocks
    assert m.can_allocate(80 * 4) and not m.can_allocate(80 * 4 + 1)
    assert m.config.num_blocks == 100 and m.config.watermark_blocks == 20
    m.allocate("s", 40)
    m.swap_out(["s"])
    m.allocate("fill", 80 * 4)  # 20 free, s needs 10: the reserve of the grown pool would be broken
    assert not m.can_swap_in(["s"])
    m.check()


# -- stats and check ------------------------------------------------------------
def test_stats_usage_and_fragmentation():
    m = make(num_blocks=8)
    assert m.stats().usage == 0.0 and m.stats().fragmentation == 0.0
    m.allocate("a", 5)  # 2 blocks, 3 empty slots
    s = m.stats()
    assert (s.num_used, s.num_free, s.num_sequences) == (2, 6, 1)
    assert s.usage == 0.25 and s.fragmentation == 3 / 8
    m.fork("a", "b")  # shared blocks count once
    assert m.stats().usage == 0.25 and m.stats().fragmentation == 3 / 8
    m.allocate("c", 4, num_lookahead_slots=4)  # 1 full + 1 empty reserved block
    assert m.stats().fragmentation == 7 / 16
    m.swap_out(["c"])
    assert m.stats().fragmentation == 3 / 8 and m.stats().num_cpu_used == 2


def test_stats_hit_rates_lifetime_and_since_reset():
    m = make(num_blocks=16)
    prompt = list(range(9))
    m.allocate("a", prompt)
    m.allocate("b", prompt)
    s = m.stats()
    assert s.hit_rate == s.hit_rate_since_reset == 8 / 18
    m.reset_prefix_cache()
    assert m.stats().hit_rate == 8 / 18 and m.stats().hit_rate_since_reset == 0.0
    m.allocate("c", prompt)  # the cache was reset: a miss (and it registers again)
    m.allocate("d", prompt)
    m.allocate("anon", 20)  # anonymous tokens are not lookups
    m.num_cached_tokens(prompt)  # a query is not a lookup either
    assert m.stats().hit_rate_since_reset == 8 / 18
    assert m.stats().hit_rate == 16 / 36


def test_a_first_chunk_counts_its_whole_prompt_as_looked_up():
    m = make(num_blocks=16)
    prompt = list(range(17))
    m.allocate("a", prompt)  # registers 4 full blocks
    assert m.allocate("b", prompt[:9], num_queried=17) == 8  # a chunk of the prompt: 2 blocks hit
    m.allocate("c", prompt[:5])  # another caller: the tokens allocated are the lookup
    s = m.stats()
    assert (s.num_queried_tokens, s.num_hit_tokens) == (17 + 17 + 5, 8 + 4)
    assert s.hit_rate == 12 / 39


def test_stats_evictions_and_cow_counts():
    m = make(num_blocks=2)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.fork("a", "b")
    m.free("a")
    m.free("b")
    assert m.stats().num_evictable == 1 and m.stats().num_evictions == 0
    m.allocate("c", 8)
    assert m.stats().num_evictions == 1 and m.stats().num_cached == 0
    m.free("c")
    m.allocate("e", [1])
    m.fork("e", "f")
    m.append("f", [2])
    assert m.stats().num_cow_copies == 1


def test_check_detects_a_corrupted_manager():
    m = make()
    m.allocate("a", list(range(6)))
    m.check()
    m._seqs["a"].blocks.append(7)
    with pytest.raises(InvariantError, match="refcounts"):
        m.check()
    m._seqs["a"].blocks[:] = [0]
    with pytest.raises(InvariantError, match="1 blocks for 6 tokens"):
        m.check()
    m._seqs["a"].blocks[:] = [0, 1]
    m._seqs["a"].hashes.hashes.append(b"x" * 32)
    with pytest.raises(InvariantError, match="2 hashes for 6 tokens"):
        m.check()

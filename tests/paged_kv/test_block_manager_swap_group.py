"""Swapping a set of sequences together: each shared block moves once and stays shared in both pools."""

from __future__ import annotations

import copy
import random

import pytest
from bm_helpers import distinct_blocks, make, snapshot

from paged_kv import BlockManager, BlockManagerConfig
from paged_kv.errors import OutOfBlocksError


def test_a_forked_pair_moves_its_three_blocks_once_each_way_and_stays_shared():
    """The issue's example: 3 copies each way (not 6), tables shared in the CPU pool and back."""
    bm = BlockManager(BlockManagerConfig(num_blocks=16, block_size=4, num_cpu_blocks=16))
    bm.allocate("a", list(range(10)))
    bm.fork("a", "b")  # tables [0, 1, 2] [0, 1, 2]
    assert distinct_blocks(bm, ["a", "b"]) == 3 and bm.can_swap_out(["a", "b"])
    assert bm.swap_out(["a", "b"]) == [(0, 0), (1, 1), (2, 2)]
    assert bm.block_table("a") == bm.block_table("b") == [0, 1, 2]
    assert bm.cpu.ref_counts[:3] == [2, 2, 2] and bm.stats().num_cpu_used == 3 and bm.stats().num_used == 0
    assert bm.can_swap_in(["a", "b"])
    mapping = bm.swap_in(["b", "a"])
    assert len(mapping) == 3 and sorted(src for src, _ in mapping) == [0, 1, 2]
    assert bm.block_table("a") == bm.block_table("b") == [dst for _, dst in mapping]
    assert bm.stats().num_used == 3 and bm.stats().num_cpu_used == 0
    assert bm.num_cached_tokens(list(range(10))) == 8  # full blocks registered again on swap-in
    bm.check()
    bm.append("a", [99])  # still copy-on-write: the shared last block is copied for the writer
    assert bm.block_table("a")[:2] == bm.block_table("b")[:2] and bm.block_table("a")[2] != bm.block_table("b")[2]


def test_one_by_one_swaps_still_work_and_copy_shared_blocks_per_sequence():
    """The single-sequence calls are the one-element group: a sequence alone gets its own copies."""
    m = make(num_blocks=16, block_size=4, num_cpu_blocks=16)
    m.allocate("a", list(range(10)))
    m.fork("a", "b")
    assert len(m.swap_out(["a"])) == 3 and len(m.swap_out(["b"])) == 3
    assert m.stats().num_cpu_used == 6
    m.check()


def test_a_group_sharing_blocks_with_a_sequence_outside_it():
    """Blocks also held outside the set stay on the GPU for that sequence; the set shares its own copies."""
    m = make(num_blocks=16, block_size=4, num_cpu_blocks=16)
    m.allocate("a", list(range(6)))  # [0, 1]
    m.fork("a", "b")
    m.fork("a", "c")
    m.append("c", [7, 8, 9])  # c: [0, 2]  (copy of 1, then full)
    assert m.swap_out(["a", "b"]) == [(0, 0), (1, 1)]
    assert m.gpu.ref_counts[0] == 1 and m.block_table("c")[0] == 0
    assert m.block_table("a") == m.block_table("b") == [0, 1] and m.cpu.ref_counts[:2] == [2, 2]
    m.free("a")
    assert m.cpu.ref_counts[:2] == [1, 1]
    m.swap_in(["b"])
    assert m.stats().num_cpu_used == 0
    m.check()


@pytest.mark.parametrize("seed", range(30))
def test_group_swap_keeps_distinct_block_count_and_sharing(seed):
    """Random forked families: out and back in, the same number of distinct blocks, shared where they were."""
    rng = random.Random(seed)
    m = make(num_blocks=64, block_size=4, num_cpu_blocks=64, enable_prefix_caching=rng.random() < 0.5)
    m.allocate(0, [rng.randrange(5) for _ in range(rng.randrange(1, 20))])
    for sid in range(1, rng.randrange(2, 8)):
        m.fork(rng.randrange(sid), sid)
        if rng.random() < 0.6:
            m.append(sid, [rng.randrange(5) for _ in range(rng.randrange(0, 7))])
    group = rng.sample(m.seq_ids(), rng.randrange(1, len(m.seq_ids()) + 1))
    before = {s: m.block_table(s) for s in group}
    distinct = len({b for t in before.values() for b in t})
    assert distinct_blocks(m, group) == distinct
    out = m.swap_out(group)
    assert len(out) == distinct and m.stats().num_cpu_used == distinct
    back = m.swap_in(group)
    assert len(back) == distinct and distinct_blocks(m, group) == distinct
    old_to_new = {}  # the same logical sharing: one new block per old block, and no two old ones merged
    for s in group:
        for old, new in zip(before[s], m.block_table(s)):
            assert old_to_new.setdefault(old, new) == new
    assert len(set(old_to_new.values())) == len(old_to_new) == distinct
    m.check()


def test_can_swap_group_counts_shared_blocks_once():
    m = make(num_blocks=16, block_size=4, num_cpu_blocks=3)
    m.allocate("a", list(range(10)))
    m.fork("a", "b")
    assert m.can_swap_out(["a", "b"])  # 3 distinct blocks fit in 3 (6 table entries would not)
    m.swap_out(["a", "b"])
    m.allocate("fill", 4 * 14)  # 14 of 16 GPU blocks taken: 2 free
    assert not m.can_swap_in(["a", "b"])
    m.truncate("fill", 4 * 13)
    assert m.can_swap_in(["a", "b"]) and not m.can_swap_in(["a", "fill"])  # fill is resident
    m.swap_in(["a", "b"])
    m.check()


def test_swap_in_group_out_of_blocks_changes_nothing():
    m = make(num_blocks=4, block_size=4, num_cpu_blocks=4)
    m.allocate("a", list(range(10)))
    m.fork("a", "b")
    m.swap_out(["a", "b"])
    m.allocate("fill", 8)
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match=r"^seq_ids=\['a', 'b'\] hold blocks=3: expected at most 2 free gpu"):
        m.swap_in(["a", "b"])
    assert snapshot(m) == before
    work = copy.deepcopy(m)
    work.free("fill")
    assert len(work.swap_in(iter(["a", "b"]))) == 3

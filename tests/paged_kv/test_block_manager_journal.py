"""The table journal (``track_changes=True``): what each operation records, and replaying it gives every table."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
from bm_helpers import assert_mirror_matches, make, random_op, replay

from paged_kv import RELEASED, BlockManager, BlockManagerConfig, InvalidArgumentError, OutOfBlocksError

BS = 4


def tracked(**kw) -> BlockManager:
    """A small tracking manager (gpu 16 blocks of 4, cpu 8), its journal empty."""
    return make(num_blocks=16, block_size=BS, num_cpu_blocks=8, track_changes=True, **kw)


def test_a_manager_tracks_nothing_unless_asked():
    m = make()
    m.allocate("a", [1, 2, 3])
    assert m._journal is None  # nothing grows unbounded for facade users
    with pytest.raises(InvalidArgumentError, match=r"^track_changes=False: expected a manager built with"):
        m.take_table_changes()


def test_allocate_records_every_block_hits_and_lookahead_included():
    m = tracked()
    m.allocate("p", list(range(9)))
    m.free("p")  # blocks 0, 1 stay cached
    m.take_table_changes()
    assert m.allocate("a", list(range(9)) + [7], num_lookahead_slots=4) == 8
    table = m.block_table("a")
    assert table[:2] == [0, 1] and len(table) == 4  # the hits, a new block, a lookahead block
    assert m.take_table_changes() == [("a", i, b) for i, b in enumerate(table)]
    assert m.take_table_changes() == []  # taking clears


def test_append_records_copy_on_write_replacements_then_new_blocks():
    m = tracked()
    m.allocate("a", [1, 2, 3, 4, 5, 6])  # [0, 1], block 1 half full
    m.fork("a", "b")
    m.take_table_changes()
    assert m.append("b", list(range(7))) == [(1, 2)]  # 2 into block 1 (copied), 4 into a new one, 1 more
    assert m.take_table_changes() == [("b", 1, 2), ("b", 2, 3), ("b", 3, 4)]
    assert m.append("a", [9]) == []  # block 1 is a's alone now: written in place, nothing set
    assert m.take_table_changes() == []


def test_fork_records_the_childs_blocks_and_free_a_release():
    m = tracked()
    m.allocate("a", list(range(10)))
    m.take_table_changes()
    m.fork("a", "b")
    m.fork("a", "c", num_tokens=5)
    assert m.take_table_changes() == [("b", 0, 0), ("b", 1, 1), ("b", 2, 2), ("c", 0, 0), ("c", 1, 1)]
    m.free("b")
    assert m.take_table_changes() == [("b", RELEASED, RELEASED)] and RELEASED == -1


def test_swap_out_releases_each_table_and_swap_in_records_every_block():
    m = tracked()
    m.allocate("a", list(range(6)))
    m.fork("a", "b")
    m.take_table_changes()
    m.swap_out(["a", "b"])
    assert m.take_table_changes() == [("a", RELEASED, RELEASED), ("b", RELEASED, RELEASED)]
    m.allocate("x", 4)  # takes block 0 back
    m.take_table_changes()
    mapping = dict(m.swap_in(["b", "a"]))
    assert m.take_table_changes() == [("b", 0, mapping[0]), ("b", 1, mapping[1]),
                                      ("a", 0, mapping[0]), ("a", 1, mapping[1])]  # fmt: skip


def test_prepare_write_records_its_replacements_only():
    m = tracked()
    m.allocate("a", list(range(13)))  # [0, 1, 2, 3]
    m.fork("a", "b")
    m.take_table_changes()
    assert m.prepare_write("b", 2, 6) == [(0, 4), (1, 5)]
    assert m.take_table_changes() == [("b", 0, 4), ("b", 1, 5)]
    assert m.prepare_write("b", 2, 6) == [] and m.take_table_changes() == []  # now private: written in place


def test_drop_front_records_every_remaining_entry_and_truncate_nothing():
    m = tracked()
    m.allocate("a", list(range(13)))  # [0, 1, 2, 3]
    m.take_table_changes()
    m.drop_front("a", 1)
    assert m.take_table_changes() == [("a", 0, 1), ("a", 1, 2), ("a", 2, 3)]
    m.drop_front("a", 0)
    m.truncate("a", 3)  # drops entries 1 and 2: a reader never reads past the table's end
    m.add_blocks(2)
    m.reset_prefix_cache()
    assert m.take_table_changes() == [] and m.block_table("a") == [1]
    m.append("a", list(range(6)))  # entry 1 is set again, then entry 2: over the stale ones in a replayed row
    table = m.block_table("a")
    assert m.take_table_changes() == [("a", 1, table[1]), ("a", 2, table[2])] and len(table) == 3


def test_a_failed_call_records_nothing():
    m = tracked()
    m.allocate("a", [1, 2, 3, 4, 5, 6])
    m.fork("a", "b")
    m.allocate("big", 4 * 13)  # 1 block left
    journal = list(m._journal)
    with pytest.raises(OutOfBlocksError):
        m.append_all([("a", [7]), ("b", list(range(9)))])  # a's copy fits, b's does not
    with pytest.raises(OutOfBlocksError):
        m.allocate("c", 8)
    assert m._journal == journal


def test_a_journal_replayed_onto_rows_kept_on_a_copy_gives_the_tables():
    """What a persistent device table does: apply each step's changes to its rows, never re-read a table."""
    m = tracked()
    m.allocate("a", list(range(6)))
    rows = replay(m.take_table_changes())
    m.fork("a", "b")
    m.append_all([("a", [1]), ("b", [2])])  # b copies the shared block
    m.swap_out(["a"])
    replay(m.take_table_changes(), rows)
    assert set(rows) == {"b"} and rows["b"] == m.block_table("b")
    m.swap_in(["a"])
    m.truncate("b", 2)
    m.append("b", [5, 6, 7])
    replay(m.take_table_changes(), rows)
    assert_mirror_matches(m, rows)


@pytest.mark.parametrize("seed", range(6))
def test_replaying_the_journal_from_the_start_gives_every_resident_table(seed):
    """Thousands of random operations (refused ones included), replayed at random points and at the end."""
    rng = random.Random(seed)
    m = BlockManager(BlockManagerConfig(num_blocks=48, block_size=BS, num_cpu_blocks=12, watermark=0.0),
                     track_changes=True)  # fmt: skip
    live: list[int] = []
    ids = itertools.count()
    journal: list = []
    for step in range(2000):
        try:
            random_op(m, rng, live, ids)
        except OutOfBlocksError:
            pass
        if rng.random() < 0.05:
            journal += m.take_table_changes()
            assert_mirror_matches(m, replay(copy.copy(journal)))
    assert_mirror_matches(m, replay(journal + m.take_table_changes()))

"""Persistent block tables: rows follow the block manager's journal with updates that grow with the change."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from paged_kv import BlockManager, BlockManagerConfig
from paged_kv.errors import OutOfRangeError
from scheduler.runner.block_tables import BlockTables


def _tables(num_blocks=64, width=8, rows=64, num_cpu_blocks=0) -> tuple[BlockManager, BlockTables]:
    config = BlockManagerConfig(num_blocks=num_blocks, block_size=4, watermark=0.0, num_cpu_blocks=num_cpu_blocks)
    return BlockManager(config, track_changes=True), BlockTables(width, num_blocks, torch.device("cpu"), rows=rows)


def _told(bm: BlockManager, tables: BlockTables) -> list[tuple[int, int, int]]:
    """Apply the manager's journal; return the device updates it made, applied to the device rows."""
    tables.apply(bm.take_table_changes())
    rows, cols, ids = tables.take_updates()
    tables.apply_updates(*(torch.from_numpy(a) for a in (rows, cols, ids)))
    return list(zip(rows.tolist(), cols.tolist(), ids.tolist()))


def _assert_mirrors(bm: BlockManager, tables: BlockTables, seq_ids) -> None:
    for seq_id in seq_ids:
        row, table = int(tables.rows([seq_id])[0]), bm.block_table(seq_id)
        assert tables.host[row, : len(table)].tolist() == table
        assert tables.table[row, : len(table)].tolist() == table


def test_rows_update_only_the_entries_a_step_changed():
    bm, tables = _tables()
    bm.allocate("a", list(range(10)))  # 3 blocks
    updates = _told(bm, tables)
    row = int(tables.rows(["a"])[0])
    assert [(r, c) for r, c, _ in updates] == [(row, 0), (row, 1), (row, 2)]
    bm.append("a", [1])  # 11 tokens: same blocks
    assert _told(bm, tables) == []
    bm.append("a", [2, 3])  # 13 tokens: a fourth block, and nothing else changed
    assert [(c, i) for _, c, i in _told(bm, tables)] == [(3, bm.block_table("a")[3])]
    _assert_mirrors(bm, tables, ["a"])


def test_copy_on_write_replacement_is_told():
    bm, tables = _tables()
    bm.allocate("a", list(range(6)))
    bm.fork("a", "b")
    _told(bm, tables)
    copies = bm.append("b", [7])  # b's shared partial last block is copied
    assert copies
    assert [(c, i) for _, c, i in _told(bm, tables)] == [(1, copies[0][1])]
    _assert_mirrors(bm, tables, ["a", "b"])


def test_a_later_entry_wins_over_an_earlier_one_of_the_same_slot():
    """A fork then a copy-on-write of the child's shared block, in one journal slice: the copy is what stays."""
    bm, tables = _tables()
    bm.allocate("a", list(range(6)))
    _told(bm, tables)
    bm.fork("a", "b")
    copies = bm.append("b", [7])
    updates = _told(bm, tables)
    row_b = int(tables.rows(["b"])[0])
    assert [(c, i) for r, c, i in updates if r == row_b] == [(0, bm.block_table("b")[0]), (1, copies[0][1])]
    _assert_mirrors(bm, tables, ["a", "b"])


def test_released_rows_are_reused_and_rows_grow_past_their_capacity():
    bm, tables = _tables(rows=2)
    for i in range(5):
        bm.allocate(i, [i] * 5)
    _told(bm, tables)
    assert len(tables) == 5 and tables.host.shape[0] == 8
    _assert_mirrors(bm, tables, range(5))
    freed = int(tables.rows([3])[0])
    bm.free(3)
    bm.allocate("new", list(range(100, 109)))
    _told(bm, tables)
    assert int(tables.rows(["new"])[0]) == freed  # the released row, reused
    _assert_mirrors(bm, tables, [0, 1, 2, 4, "new"])
    assert len(tables) == 5


def test_a_table_wider_than_the_rows_is_rejected():
    bm, tables = _tables(width=2)
    bm.allocate("a", list(range(12)))  # 3 blocks
    with pytest.raises(OutOfRangeError, match="block table entry of 'a'"):
        tables.apply(bm.take_table_changes())
    assert len(tables) == 0 and not tables.host.any() and tables.take_updates()[0].size == 0


@pytest.mark.parametrize("seed", range(4))
def test_the_journal_keeps_every_row_equal_to_its_table(seed):
    """Random allocate / append / fork / free / swap traffic, told step by step: rows equal the tables throughout."""
    rng = random.Random(seed)
    bm, tables = _tables(num_blocks=96, width=24, rows=4, num_cpu_blocks=96)
    live: list[int] = []
    for step in range(200):
        resident = [s for s in live if not bm.is_swapped(s)]
        op = rng.choice(["allocate", "append", "append", "fork", "free", "swap"])
        prompt = [rng.randrange(8) for _ in range(rng.randrange(1, 20))]
        if (op == "allocate" or not resident) and bm.can_allocate(prompt):
            bm.allocate(step, prompt)
            live.append(step)
        elif (op == "append" and max(map(bm.num_tokens, resident)) < 90
              and bm.can_append_all([(s, 1) for s in resident])):
            bm.append_all([(s, [rng.randrange(8)]) for s in resident])
        elif op == "fork" and bm.num_tokens(resident[0]) < 80:
            bm.fork(rng.choice(resident), step)
            live.append(step)
        elif op in ("free", "allocate") and live:
            victim = rng.choice(live)
            bm.free(victim)
            live.remove(victim)
        elif op == "swap":
            swapped = [s for s in live if bm.is_swapped(s)]
            if swapped and bm.can_swap_in(swapped):
                bm.swap_in(swapped)
            elif bm.can_swap_out(resident[:2]):
                bm.swap_out(resident[:2])
        if rng.random() < 0.5:  # a step: the journal so far is applied
            _told(bm, tables)
            _assert_mirrors(bm, tables, [s for s in live if not bm.is_swapped(s)])
    assert np.all(tables.table.numpy() == tables.host)

"""Persistent block tables: rows follow the block manager's tables with updates that grow with the change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_kv import BlockManager, BlockManagerConfig
from paged_kv.errors import OutOfRangeError
from scheduler.runner.block_tables import BlockTables


def _tables(num_blocks=64, width=8, rows=64) -> tuple[BlockManager, BlockTables]:
    bm = BlockManager(BlockManagerConfig(num_blocks=num_blocks, block_size=4, watermark=0.0))
    return bm, BlockTables(bm, width, torch.device("cpu"), rows=rows)


def _applied(tables: BlockTables) -> list[tuple[int, int, int]]:
    rows, cols, ids = tables.take_updates()
    tables.apply_updates(*(torch.from_numpy(a) for a in (rows, cols, ids)))
    return list(zip(rows.tolist(), cols.tolist(), ids.tolist()))


def _assert_mirrors(bm: BlockManager, tables: BlockTables, seq_ids) -> None:
    for seq_id in seq_ids:
        row, table = tables.sync(seq_id, bm.num_tokens(seq_id)), bm.block_table(seq_id)
        assert tables.host[row, : len(table)].tolist() == table
        assert tables.table[row, : len(table)].tolist() == table


def test_rows_update_only_the_entries_a_step_changed():
    bm, tables = _tables()
    bm.allocate("a", list(range(10)))  # 3 blocks
    row = tables.sync("a", 10)
    assert [(r, c) for r, c, _ in _applied(tables)] == [(row, 0), (row, 1), (row, 2)]
    bm.append("a", [1])  # 11 tokens: same blocks
    assert tables.sync("a", 11) == row and _applied(tables) == []
    bm.append("a", [2, 3])  # 13 tokens: a fourth block
    tables.sync("a", 13)
    assert [(c, i) for _, c, i in _applied(tables)] == [(2, bm.block_table("a")[2]), (3, bm.block_table("a")[3])]
    _assert_mirrors(bm, tables, ["a"])


def test_copy_on_write_replacement_is_picked_up_when_forced():
    bm, tables = _tables()
    bm.allocate("a", list(range(6)))
    bm.fork("a", "b")
    tables.sync("a", 6), tables.sync("b", 6)
    _applied(tables)
    copies = bm.append("b", [7])  # b's shared partial last block is copied
    assert copies
    tables.sync("b", 7, force=True)
    assert [(c, i) for _, c, i in _applied(tables)] == [(1, copies[0][1])]
    _assert_mirrors(bm, tables, ["a", "b"])


def test_released_rows_are_reused_and_rows_grow_past_their_capacity():
    bm, tables = _tables(rows=2)
    for i in range(5):
        bm.allocate(i, [i] * 5)
        tables.sync(i, 5)
    assert len(tables) == 5 and tables.host.shape[0] == 8
    _applied(tables)
    _assert_mirrors(bm, tables, range(5))
    tables.release(3)
    bm.free(3)
    bm.allocate("new", list(range(100, 109)))
    tables.sync("new", 9)
    _applied(tables)
    _assert_mirrors(bm, tables, [0, 1, 2, 4, "new"])
    tables.release("never-seen")  # a no-op
    assert len(tables) == 5


def test_a_table_wider_than_the_rows_is_rejected():
    bm, tables = _tables(width=2)
    bm.allocate("a", list(range(12)))  # 3 blocks
    with pytest.raises(OutOfRangeError):
        tables.sync("a", 12)
    assert len(tables) == 0 and np.all(tables.synced == 0)

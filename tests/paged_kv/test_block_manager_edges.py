"""Edges of the block manager's public surface: a no-op that stays one, membership, the constructor."""

from __future__ import annotations

import pytest
from bm_helpers import snapshot

from paged_kv import BlockManager, BlockManagerConfig, InvalidArgumentError


def shared_cached() -> BlockManager:
    """'a' holds 10 ids in blocks of 4 (two full, cached); 'b' is its fork, sharing all three."""
    m = BlockManager(BlockManagerConfig(num_blocks=16, block_size=4))
    m.allocate("a", list(range(10)))
    m.fork("a", "b")
    return m


@pytest.mark.parametrize("pos", [0, 4, 5, 8, 10, 12])
def test_an_empty_prepare_write_changes_nothing_and_keeps_the_prefix_hit(pos):
    m = shared_cached()
    before = snapshot(m)
    assert m.prepare_write("b", pos, pos) == []
    assert snapshot(m) == before
    assert m.num_cached_tokens(list(range(9))) == 8  # both full blocks still hit


def test_a_non_empty_prepare_write_mid_block_still_unhashes_what_it_overwrites():
    m = shared_cached()
    m.prepare_write("a", 5, 6)  # 'a' gets a private copy of block 1, about to be overwritten
    assert m.block_table("a")[1] != m.block_table("b")[1]
    assert m.num_cached_tokens(list(range(9))) == 8  # the shared original (still 'b''s) keeps its hash


@pytest.mark.parametrize("seq_id", [["a"], {"a": 1}, {1, 2}])
def test_an_unhashable_id_is_never_in_the_manager(seq_id):
    m = shared_cached()
    before = snapshot(m)
    assert (seq_id in m) is False
    assert "a" in m and "zz" not in m
    assert snapshot(m) == before


@pytest.mark.parametrize("config", [None, {"num_blocks": 4}, 4, "BlockManagerConfig(num_blocks=4)"])
def test_the_constructor_takes_only_a_config(config):
    with pytest.raises(InvalidArgumentError, match=r"^config='\w+': expected a BlockManagerConfig$"):
        BlockManager(config)

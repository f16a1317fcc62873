"""Sizing the KV pool from gpu_memory_utilization: the arithmetic of size_pool, on any machine."""

from __future__ import annotations

import pytest

from paged_kv.errors import OutOfBlocksError
from scheduler.runner.memory import GIB, size_pool

BLOCK = 2 << 20  # bytes per KV block


def plan(**kw):
    """size_pool on an 80 GiB device with 70 GiB free, 2 GiB of own weights, 1 GiB transient, unless overridden."""
    args = dict(utilization=0.5, total=80 * GIB, free=70 * GIB, in_use=2 * GIB, activations=GIB // 2,
                graphs=GIB // 2, bytes_per_block=BLOCK)  # fmt: skip
    return size_pool(**(args | kw))


def test_the_pool_gets_the_share_less_own_memory_activations_and_graphs():
    p = plan()
    assert p.budget == 40 * GIB and p.in_use == 2 * GIB
    assert p.num_blocks == (40 - 2 - 1) * GIB // BLOCK


def test_memory_that_others_hold_does_not_count_against_the_share():
    assert plan(free=50 * GIB).num_blocks == plan().num_blocks  # 20 GiB more held by another process


def test_a_pool_that_does_not_fit_in_the_free_memory_raises_naming_the_free_memory():
    with pytest.raises(OutOfBlocksError, match=r"gpu_memory_utilization=0.5: .*20.00 GiB free of 80.00 GiB"):
        plan(free=20 * GIB)
    assert plan(free=38 * GIB).num_blocks == 37 * GIB // BLOCK  # exactly fits: pool + transient == free


def test_a_share_with_no_room_for_a_block_raises_naming_what_took_it():
    with pytest.raises(OutOfBlocksError, match=r"gpu_memory_utilization=0.05: .*holds 3.50 GiB"):
        plan(utilization=0.05, in_use=3 * GIB + GIB // 2)
    assert plan(utilization=0.05, in_use=3 * GIB - BLOCK).num_blocks == 1  # 4 GiB share: one block left

"""Hypothesis: lists that are valid but for ONE almost-valid element are rejected, and change nothing.

"Almost valid" is what a caller's bug produces: a bool from a mask, an integral float from a
division, a NumPy float, a negative or an int64-overflowing id, NaN. The same list with that
element made valid must go through, so a rejection is always for that element.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from bad_input_machinery import state as snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from paged_kv import BlockManager, BlockManagerConfig, PagedKVError
from paged_kv.kv_cache import KVCacheSpec, PagedKVCache

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None)
ALMOST_IDS = st.one_of(
    st.booleans(),
    st.integers(0, 50).map(float),  # integral floats: 2.0 is no id
    st.floats(0.1, 50.0).filter(lambda x: not x.is_integer()),
    st.integers(0, 50).map(np.float64),
    st.sampled_from([-1, -(1 << 40), 1 << 63, math.nan, math.inf, None, "3", b"3"]),
)


@st.composite
def one_bad(draw, valid: st.SearchStrategy, length: tuple[int, int]):
    """(list with one almost-valid element, the same list made valid, the bad element's index)."""
    items = draw(st.lists(valid, min_size=length[0], max_size=length[1]))
    i = draw(st.integers(0, len(items) - 1))
    bad = draw(ALMOST_IDS)
    return items[:i] + [bad] + items[i + 1 :], items, i


def assert_rejected(call, value: object, name: str) -> None:
    """``call(value)`` raises a PagedKVError whose message names ``name``."""
    try:
        call(value)
    except PagedKVError as e:
        assert name in str(e)
    else:
        raise AssertionError(f"accepted {value!r}")


def manager() -> BlockManager:
    """A manager holding 'a' (9 ids in blocks of 4)."""
    m = BlockManager(BlockManagerConfig(num_blocks=32, block_size=4))
    m.allocate("a", list(range(9)))
    return m


@SETTINGS
@given(case=one_bad(st.integers(0, 1000), (1, 20)))
def test_allocate_and_append_reject_one_almost_valid_id(case):
    ids, valid, _ = case
    m = manager()
    before = snapshot(m)
    for call in (lambda t: m.allocate("n", t), lambda t: m.append("a", t), m.can_allocate, m.num_cached_tokens):
        assert_rejected(call, ids, "token_ids")
        assert snapshot(m) == before
    m.allocate("n", valid)  # the valid twin goes through


@SETTINGS
@given(case=one_bad(st.tuples(st.integers(0, 3), st.integers(4, 7)), (1, 4)))
def test_block_mappings_reject_one_almost_valid_pair(case):
    pairs, valid, i = case
    bad = pairs[i]
    pairs[i] = (bad, valid[i][1]) if isinstance(bad, bool) else (valid[i][0], bad)  # one bad id inside a pair
    cache = PagedKVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2), 8)
    before = [t.clone() for t in cache.tensors()]
    for call in (lambda p: cache.copy_blocks(p), lambda p: kernels.copy_blocks(cache.tensors(), p)):
        assert_rejected(call, pairs, "block_mapping")
        assert all(torch.equal(a, b) for a, b in zip(before, cache.tensors()))
    distinct = {dst: src for src, dst in valid}  # the valid twin (dst ids made distinct)
    cache.copy_blocks([(src, dst) for dst, src in distinct.items()])


@SETTINGS
@given(case=one_bad(st.integers(0, 7), (1, 3)))
def test_block_tables_reject_one_almost_valid_id(case):
    table, valid, _ = case
    cache = PagedKVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2), 8)
    for call in (lambda t: cache.slots(t, 0, 1), lambda t: cache.gather(0, t, 0, 1)):
        assert_rejected(call, table, "block_table")
    assert cache.slots(valid, 0, 2 * len(valid)).numel() == 2 * len(valid)

"""``BlockManager.append_all``: exactly a loop of ``append``, all or nothing, journaling the table entries it sets."""

from __future__ import annotations

import copy
import itertools

import pytest
from bm_helpers import BS, VOCAB, cached_hash, make, random_op, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_kv import BlockManager
from paged_kv.errors import InvalidArgumentError, OutOfBlocksError, PagedKVError


@st.composite
def managers(draw) -> BlockManager:
    """A small pool after the stateful test's random operations: prefix hits, forks (shared blocks),
    appends, frees (cached blocks left to evict), truncations, in-place writes, windows and swaps."""
    rng = draw(st.randoms(use_true_random=False))
    m = make(num_blocks=draw(st.integers(4, 20)), block_size=BS, num_cpu_blocks=8,
             enable_prefix_caching=draw(st.booleans()), track_changes=True)  # fmt: skip
    live: list[int] = []
    ids = itertools.count()
    for _ in range(draw(st.integers(1, 16))):
        try:
            random_op(m, rng, live, ids)
        except OutOfBlocksError:
            pass
    resident = [s for s in live if not m.is_swapped(s)]
    for sid in draw(st.lists(st.sampled_from(resident), max_size=3)) if resident else []:
        m.truncate(sid, draw(st.integers(0, m.num_tokens(sid))))  # often into a cached block, written again next
    m.take_table_changes()  # the journal starts empty
    return m


one_token = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=1)
valid_specs = st.one_of(
    one_token, one_token, one_token,  # mostly a decode step
    st.lists(st.integers(0, VOCAB - 1), max_size=2 * BS),
    st.integers(0, BS + 1),  # anonymous tokens
)
invalid_specs = st.sampled_from([[-1], [1 << 63], [1.5], "ab", None])


@st.composite
def requests_for(draw, m: BlockManager, *, valid: bool) -> list[tuple[object, object]]:
    """Distinct sequences in random order, each with a token spec: resident ones with valid specs, or
    (``valid=False``) swapped and unknown ones too, and some invalid specs."""
    if valid:
        candidates, specs = [s for s in m.seq_ids() if not m.is_swapped(s)], valid_specs
    else:
        candidates, specs = [*m.seq_ids(), "unknown"], st.one_of(valid_specs, invalid_specs)
    ids = draw(st.lists(st.sampled_from(candidates), unique=True)) if candidates else []
    return [(sid, draw(specs)) for sid in ids]


def run_loop(m: BlockManager, requests) -> tuple[list, PagedKVError | None]:
    """``append`` each request in turn; the copies made, and the first error (the loop stops there)."""
    copies = []
    try:
        for sid, spec in requests:
            copies += m.append(sid, spec)
    except PagedKVError as err:
        return copies, err
    return copies, None


def apply_changes(tables: dict, changed: list) -> dict:
    """Old block tables with the ``(seq_id, index, block)`` entries written in order."""
    tables = copy.deepcopy(tables)
    for sid, i, block in changed:
        table = tables[sid]
        assert i <= len(table), "a change past the end of the table"
        table[i:i + 1] = [block]
    return tables


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(st.data(), st.booleans())
def test_append_all_is_a_loop_of_append_or_changes_nothing(data, valid):
    """Same tables, copies, hashes, stats as the loop; on failure the loop's first error and an unchanged manager."""
    m = data.draw(managers())
    requests = data.draw(requests_for(m, valid=valid))
    loop, batch = copy.deepcopy(m), copy.deepcopy(m)
    expected, loop_err = run_loop(loop, requests)
    before, tables = snapshot(batch), {s: batch.block_table(s) for s in batch.seq_ids()}
    try:
        got, err = batch.append_all(requests), None
    except PagedKVError as e:
        got, err = None, e
    if loop_err is not None:
        assert type(err) is type(loop_err) and str(err) == str(loop_err)
        assert snapshot(batch) == before and batch.take_table_changes() == []
        return
    assert err is None and got == expected
    assert snapshot(batch) == snapshot(loop)  # tables, token records, hashes, pools, counters, journal, stats
    changed = batch.take_table_changes()
    new_tables = {s: batch.block_table(s) for s in batch.seq_ids()}
    assert apply_changes(tables, changed) == new_tables
    assert {sid for sid, _, _ in changed} <= {sid for sid, _ in requests}
    batch.check()


def test_a_decode_step_reports_only_the_new_blocks():
    """One token each: nothing reported for appends inside a block, the new block for one that crosses."""
    m = make(num_blocks=16, block_size=BS, track_changes=True)
    m.allocate("a", [1, 2, 3])  # [0], room for one more
    m.allocate("b", [1, 2, 3, 4])  # [1], full: the next token needs a new block
    m.allocate("c", [5, 6])  # [2]
    m.take_table_changes()
    assert m.append_all([("a", [4]), ("b", [5]), ("c", [7])]) == []
    assert m.take_table_changes() == [("b", 1, 3)]
    assert [m.block_table(s) for s in "abc"] == [[0], [1, 3], [2]]
    assert m.num_cached_tokens([1, 2, 3, 4, 9]) == BS  # a's block filled and was registered (as b's first)
    m.check()


def test_a_shared_last_block_is_copied_once_and_reported():
    """Forks sharing a partial block: the first writers copy it, the last writes in place, as the loop does."""
    m = make(num_blocks=16, block_size=BS, track_changes=True)
    m.allocate("a", [1, 2, 3, 4, 5, 6])  # [0, 1]
    m.fork("a", "b")
    m.fork("a", "c")
    assert m.can_append_all([("a", 1), ("b", 1), ("c", 1)])
    m.take_table_changes()
    assert m.append_all([("a", [7]), ("b", [8]), ("c", [9])]) == [(1, 2), (1, 3)]
    assert m.take_table_changes() == [("a", 1, 2), ("b", 1, 3)]
    assert [m.block_table(s) for s in "abc"] == [[0, 2], [0, 3], [0, 1]]
    assert m.num_cow_copies == 2
    m.check()


def test_out_of_blocks_in_a_later_request_changes_nothing():
    """The pool runs out at the third request: the first two (a block filled, a block taken) are not applied."""
    m = make(num_blocks=6, block_size=BS)
    m.allocate("a", [1, 2, 3, 4])  # [0], full
    m.allocate("b", [5, 6, 7])  # [1]
    m.allocate("c", [8, 9, 10, 11])  # [2], full; 3 blocks left
    requests = [("b", [1]), ("a", [9]), ("c", list(range(9)))]  # 0 + 1 + 3 blocks
    assert not m.can_append_all([(s, len(t)) for s, t in requests])
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match=r"^token_ids \(len 9\): needs 3 blocks for seq_id='c', .* 2 free"):
        m.append_all(requests)
    assert snapshot(m) == before
    assert m.append_all(requests[:2] + [("c", list(range(8)))]) == [] and m.gpu.num_free == 0


def test_each_sequence_at_most_once():
    m = make()
    m.allocate("a", [1, 2])
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError, match=r"^seq_id='a': expected each sequence at most once"):
        m.append_all([("a", [3]), ("a", [4])])
    assert snapshot(m) == before


def test_requests_may_be_any_iterable_of_pairs():
    m, n = make(), make()
    for x in (m, n):
        x.allocate("a", [1, 2])
        x.allocate("b", [3])
    assert m.append_all(iter([["a", [3]], ("b", (4, 5))])) == n.append_all([("a", [3]), ("b", [4, 5])]) == []
    assert snapshot(m) == snapshot(n)


def test_writing_into_a_cached_block_after_truncate_unregisters_it():
    """The fast path forgets the cached identity of a private block it writes in place, as ``append`` does."""
    m = make(num_blocks=8, block_size=BS)
    m.allocate("a", [1, 2, 3, 4, 5])  # block 0 full and cached
    m.truncate("a", 2)  # block 0 still cached, about to be written at slot 2
    loop = copy.deepcopy(m)
    loop.append("a", [7])
    assert m.append_all([("a", [7])]) == []
    assert cached_hash(m, 0) is None and m.num_cached_tokens([1, 2, 3, 4, 5]) == 0
    assert snapshot(m) == snapshot(loop)

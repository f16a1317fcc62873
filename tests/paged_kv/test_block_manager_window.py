"""BlockManager.drop_front: a sliding window that releases whole leading blocks."""

from __future__ import annotations

from bm_helpers import cached_hash, make, snapshot

from paged_kv.block_hash import block_bytes, hash_blocks, root_hash

BS = 4


def test_drop_front_releases_leading_blocks_and_shifts_positions():
    m = make()
    m.allocate("a", list(range(10)))
    assert m.block_table("a") == [0, 1, 2]
    before = snapshot(m)
    m.drop_front("a", 0)  # nothing dropped: nothing changes, caching included
    assert snapshot(m) == before
    free = m.gpu.num_free
    m.drop_front("a", 1)
    assert m.block_table("a") == [1, 2] and m.num_tokens("a") == 6 and m.gpu.num_free == free + 1
    m.check()
    m.append("a", [7, 7])  # lands at positions 6, 7: the rest of block 2
    assert m.block_table("a") == [1, 2] and m.num_tokens("a") == 8
    m.check()
    m.drop_front("a", 2)
    assert m.block_table("a") == [] and m.num_tokens("a") == 0
    m.check()
    m.append("a", [1, 2, 3, 4, 5])
    assert m.num_tokens("a") == 5 and len(m.block_table("a")) == 2
    m.check()


def test_drop_front_past_the_tokens_keeps_the_lookahead_blocks_left():
    m = make()
    m.allocate("a", 5, num_lookahead_slots=7)  # 12 slots: 3 blocks, 5 tokens
    m.drop_front("a", 2)
    assert m.num_tokens("a") == 0 and m.block_table("a") == [2]
    m.check()
    assert m.append("a", 4) == [] and m.block_table("a") == [2]
    m.check()


def test_drop_front_of_a_fork_only_drops_its_references():
    m = make()
    m.allocate("a", list(range(9)))
    m.fork("a", "b")
    m.drop_front("b", 2)
    assert m.block_table("a") == [0, 1, 2] and m.block_table("b") == [2] and m.num_tokens("b") == 1
    assert m.gpu.ref_counts[:3] == [1, 1, 2]
    m.check()
    assert m.append("b", [5]) == [(2, 3)]  # block 2 is still shared with 'a': copied first
    assert m.block_table("a") == [0, 1, 2] and m.block_table("b") == [3]
    m.check()


def test_dropped_full_blocks_stay_cached_but_no_new_block_is_registered():
    m = make(num_blocks=16)
    prompt = list(range(9))
    m.allocate("a", prompt)
    m.drop_front("a", 1)  # block 0 becomes evictable, still cached
    assert m.stats().num_evictable == 1 and m.num_cached_tokens(prompt) == 8
    m.check()
    m.append("a", [9, 10, 11])  # fills the block of original positions 8..11
    assert cached_hash(m, m.block_table("a")[-1]) is None  # computed without the dropped tokens
    assert m.num_cached_tokens(list(range(13))) == 8
    m.check()


def test_swap_in_after_drop_front_re_registers_with_the_true_parent():
    m = make(num_blocks=16, num_cpu_blocks=4)
    prompt = list(range(13))
    hashes = hash_blocks(root_hash(None), prompt, BS)
    m.allocate("a", prompt)
    m.drop_front("a", 1)
    m.swap_out(["a"])
    m.reset_prefix_cache()  # forget every hash: only swap_in can register 'a's blocks again
    m.check()
    m.swap_in(["a"])
    table = m.block_table("a")
    assert [cached_hash(m, b) for b in table] == [hashes[1], hashes[2], None]
    assert m.gpu.lookup_chain(hashes[0], hashes[1:], block_bytes(prompt, BS)[1:], 2) == table[:2]
    m.check()


def test_truncate_after_drop_front_forgets_the_hashes_past_the_cut():
    m = make(num_blocks=16, num_cpu_blocks=4)
    m.allocate("a", list(range(13)))
    m.drop_front("a", 1)
    m.truncate("a", 6)  # block 1 (original positions 8..11) keeps 2 tokens
    m.append("a", [50, 51])  # overwrites it in place
    m.swap_out(["a"])
    m.reset_prefix_cache()
    m.swap_in(["a"])
    table = m.block_table("a")
    assert cached_hash(m, table[0]) is not None and cached_hash(m, table[1]) is None
    m.check()

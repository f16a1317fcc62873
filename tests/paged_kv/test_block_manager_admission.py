"""``admission``: one query for a group's prefix hits and whether it fits; ``fork`` of a prefix."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
from bm_helpers import BS, make, random_op

from paged_kv import BlockHashes, BlockManager, InvalidArgumentError, OutOfBlocksError, SequenceStateError


def random_manager(seed: int, watermark: float = 0.0) -> tuple[BlockManager, random.Random]:
    """A small pool after random operations: cached, evictable, shared and swapped blocks."""
    rng = random.Random(seed)
    m = make(num_blocks=rng.randrange(6, 24), block_size=BS, num_cpu_blocks=8, watermark=watermark)
    live: list[int] = []
    ids = itertools.count()
    for _ in range(rng.randrange(1, 30)):
        try:
            random_op(m, rng, live, ids)
        except OutOfBlocksError:
            pass
    return m, rng


def random_prompt(rng: random.Random) -> list[int]:
    """A prompt that often shares a prefix with the random operations' prompts."""
    head = rng.choice([[1, 2, 3, 0] * 4, [2, 2, 1, 0] * 4, [3, 1, 0, 2] * 4])[: rng.randrange(17)]
    return head + [rng.randrange(4) for _ in range(rng.randrange(1, 12))]


def allocated_above_watermark(m: BlockManager, prompts: list[list[int]], num_tokens: list[int]) -> bool:
    """Whether allocating ``num_tokens[i]`` tokens of each prompt in turn succeeds above the watermark (on a copy)."""
    work = copy.deepcopy(m)
    try:
        for i, (prompt, n) in enumerate(zip(prompts, num_tokens)):
            work.allocate(("new", i), prompt[:n])
    except OutOfBlocksError:
        return False
    return work.num_free_blocks >= work.config.watermark_blocks


@pytest.mark.parametrize("seed", range(60))
def test_fits_is_exact_for_one_request(seed):
    m, rng = random_manager(seed, watermark=rng_watermark(seed))
    prompt = random_prompt(rng)
    admission = m.admission([(prompt, None)])
    (cached,) = admission.cached
    assert cached == m.num_cached_tokens(prompt)
    for n in range(cached, len(prompt) + 1):
        expected = allocated_above_watermark(m, [prompt], [n])
        assert admission.fits([n]) == expected == m.can_allocate(prompt[:n]), n


def rng_watermark(seed: int) -> float:
    """No reserve for most seeds, a reserve of a few blocks for some."""
    return 0.0 if seed % 3 else 0.2


@pytest.mark.parametrize("seed", range(80))
def test_fits_for_a_group_never_says_yes_wrongly(seed):
    m, rng = random_manager(1000 + seed, watermark=rng_watermark(seed))
    base = random_prompt(rng)
    prompts = [base if rng.random() < 0.5 else random_prompt(rng) for _ in range(rng.randrange(2, 5))]
    admission = m.admission([(p, None) for p in prompts])
    assert list(admission.cached) == [m.num_cached_tokens(p) for p in prompts]
    for _ in range(5):
        num_tokens = [rng.randrange(c, len(p) + 1) for c, p in zip(admission.cached, prompts)]
        if admission.fits(num_tokens):
            assert allocated_above_watermark(m, prompts, num_tokens)


def test_a_group_sharing_a_cached_prompt_counts_its_blocks_once():
    """Samples of a prompt whose blocks are cached and evictable: revived once, shared by all (not one copy each)."""
    m = make(num_blocks=10, block_size=BS)
    prompt = list(range(17))  # 4 full blocks + 1
    m.allocate("p", prompt)
    m.free("p")  # 4 cached, evictable
    m.allocate("other", 4 * 3)  # 3 blocks in use: 7 free, 4 of them the evictable prompt blocks
    three, four = m.admission([(prompt, None)] * 3), m.admission([(prompt, None)] * 4)
    assert three.cached == (16,) * 3 and four.cached == (16,) * 4
    assert three.fits([17] * 3)  # 4 revived + 3 new last blocks == 7
    assert allocated_above_watermark(m, [prompt] * 3, [17] * 3)
    assert not four.fits([17] * 4) and not allocated_above_watermark(m, [prompt] * 4, [17] * 4)


def test_a_later_request_hitting_an_earlier_ones_new_blocks_is_counted_as_new():
    """The documented bound: blocks the group registers itself are not counted as hits."""
    m = make(num_blocks=4, block_size=BS)
    prompt = list(range(9))  # 2 full blocks + 1: 3 blocks, none cached
    admission = m.admission([(prompt, None), (prompt, None)])
    assert admission.cached == (0, 0)
    assert not admission.fits([9, 9])  # 6 blocks counted, 4 free
    assert allocated_above_watermark(m, [prompt, prompt], [9, 9])  # the second shares 2: 4 taken


def test_hits_on_an_evictable_chain_the_first_request_does_not_revive_count_as_new():
    """An earlier request's new blocks may evict a later one's hits: the bound counts them as new."""
    m = make(num_blocks=5, block_size=BS)
    cached = list(range(9))
    m.allocate("p", cached)
    m.free("p")  # blocks 0, 1 cached and evictable, 2 free
    admission = m.admission([([7] * 13, None), (cached, None)])
    assert admission.cached == (0, 8)
    assert not admission.fits([13, 9])  # 4 + 3 counted > 5 (the first's 4 new blocks evict both hits)
    assert not allocated_above_watermark(m, [[7] * 13, cached], [13, 9])
    assert admission.fits([5, 9])  # 2 + 3: yes, even with the hits evicted
    assert allocated_above_watermark(m, [[7] * 13, cached], [5, 9])


def test_a_stale_admission_raises_and_queries_do_not_make_it_stale():
    m = make(num_blocks=16, block_size=BS)
    m.allocate("a", list(range(9)))
    admission = m.admission([(list(range(9)), None)])
    m.num_cached_tokens(list(range(9)))
    m.can_allocate([1, 2, 3])
    m.admission([([5], None)])
    m.stats()
    assert admission.fits([9])
    m.free("a")
    stale = r"^admission=Admission\(cached=\(8,\)\): expected an Admission of the manager as it is now"
    with pytest.raises(SequenceStateError, match=stale):
        admission.fits([9])
    fresh = m.admission([(list(range(9)), None)])
    assert fresh.fits([9]) and fresh.cached == (8,)


@pytest.mark.parametrize("change", [
    lambda m: m.allocate("b", [1]), lambda m: m.append("a", [1]), lambda m: m.append_all([("a", [1])]),
    lambda m: m.fork("a", "c"), lambda m: m.free("a"), lambda m: m.swap_out(["a"]), lambda m: m.truncate("a", 2),
    lambda m: m.drop_front("a", 1), lambda m: m.prepare_write("a", 0, 2), lambda m: m.add_blocks(1),
    lambda m: m.reset_prefix_cache(),
])  # fmt: skip
def test_every_change_makes_an_admission_stale(change):
    m = make(num_blocks=16, block_size=BS)
    m.allocate("a", list(range(9)))
    admission = m.admission([([1, 2, 3], None)])
    change(m)
    with pytest.raises(SequenceStateError, match="^admission="):
        admission.fits([3])


def test_free_blocks_and_usage_need_no_pool():
    m = make(num_blocks=8, block_size=BS)
    assert (m.num_free_blocks, m.usage) == (8, 0.0)
    m.allocate("a", list(range(9)))
    assert (m.num_free_blocks, m.usage) == (5, 3 / 8) == (m.stats().num_free, m.stats().usage)
    m.free("a")
    assert (m.num_free_blocks, m.usage) == (8, 0.0)  # cached blocks are evictable: free


# -- fork of a prefix -----------------------------------------------------------------------------
def test_fork_of_a_prefix_shares_the_blocks_covering_it():
    m = make(num_blocks=16, block_size=BS)
    m.allocate("a", list(range(10)), num_lookahead_slots=4)  # [0, 1, 2, 3]
    m.fork("a", "b", num_tokens=6)
    assert m.block_table("b") == [0, 1] and m.num_tokens("b") == 6
    assert m.gpu.ref_counts[:4] == [2, 2, 1, 1]
    m.fork("a", "c", num_tokens=8)  # on a block boundary
    m.fork("a", "e", num_tokens=0)
    assert m.block_table("c") == [0, 1] and m.block_table("e") == [] and m.num_tokens("e") == 0
    m.check()


def test_the_first_write_into_a_shared_partial_block_copies_it():
    m = make(num_blocks=16, block_size=BS)
    m.allocate("a", list(range(10)))  # [0, 1, 2]
    m.fork("a", "b", num_tokens=6)  # block 1 holds 6 of b's tokens: partial for b, full for a
    assert m.append("b", [60, 61]) == [(1, 3)]
    assert m.block_table("b") == [0, 3] and m.block_table("a") == [0, 1, 2]
    assert m.append("b", [62, 63]) == [] and m.block_table("b") == [0, 3, 4]
    m.fork("a", "c", num_tokens=8)
    assert m.append("c", [80]) == [] and m.block_table("c") == [0, 1, 5]  # a boundary: nothing copied
    assert m.num_cached_tokens(list(range(10))) == 8  # a's blocks keep their content
    assert m.num_cached_tokens([0, 1, 2, 3, 4, 5, 60, 61, 9]) == 8  # b's copy is cached under its own ids
    m.check()


def test_a_fork_of_a_prefix_gets_a_copy_of_the_parents_hashes_cut_there():
    m = make(num_blocks=16, block_size=BS)
    h = BlockHashes(BS)
    m.allocate("a", list(range(10)), hashes=h)
    m.fork("a", "b", num_tokens=5)
    m.append("b", [50, 51, 52])  # fills b's block 1 with other ids
    assert h.num_tokens == 10  # the parent's object is not the child's
    assert m.num_cached_tokens([0, 1, 2, 3, 4, 50, 51, 52, 9]) == 8
    assert m.num_cached_tokens(list(range(10))) == 8


def test_a_fork_takes_the_childs_own_hashes_covering_its_continuation():
    m = make(num_blocks=16, block_size=BS)
    parent = BlockHashes(BS)
    m.allocate("a", list(range(10)), hashes=parent)
    child = parent.copy(6)
    child.extend([60, 61, 62, 63, 64])  # the child's own continuation, hashed ahead
    m.fork("a", "b", num_tokens=6, hashes=child)
    blocks = len(child.hashes)
    m.append("b", [60, 61, 62])  # already covered: read, not hashed again
    assert child.num_tokens == 11 and len(child.hashes) == blocks == 2
    m.append("b", [63, 64, 65])  # past the object: the manager extends it
    assert child.num_tokens == 12 and len(child.hashes) == 3
    assert m.num_cached_tokens([0, 1, 2, 3, 4, 5, 60, 61, 62, 63, 64, 65, 0]) == 12
    too_short = r"^hashes=BlockHashes.*: expected a BlockHashes covering at least 6 tokens"
    with pytest.raises(InvalidArgumentError, match=too_short):
        m.fork("a", "c", num_tokens=6, hashes=parent.copy(5))
    assert "c" not in m

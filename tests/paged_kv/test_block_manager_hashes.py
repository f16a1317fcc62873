"""Kept block hashes: a stream's blocks are hashed once, however often it is looked up, admitted or allocated."""

from __future__ import annotations

from collections import Counter

import pytest
from bm_helpers import make

import paged_kv.block_hash as hash_mod
from paged_kv import BlockHashes, InvalidArgumentError

BS = 4


@pytest.fixture
def hashed(monkeypatch) -> Counter:
    """Every block hash computed from now on, counted by its input (parent hash + the block's int64 ids)."""
    hash_mod.salt_root(None), hash_mod.salt_root("t")  # roots are cached apart: compute them before counting
    seen: Counter = Counter()
    real = hash_mod.sha256

    def counting(data: bytes = b""):
        if len(data) == 32 + 8 * BS:  # a block of BS ids after its parent (a root's input is shorter)
            seen[data] += 1
        return real(data)

    monkeypatch.setattr(hash_mod, "sha256", counting)
    return seen


def test_admission_can_allocate_allocate_and_appends_hash_each_block_once(hashed):
    m = make(num_blocks=32, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2
    h = BlockHashes(BS)
    admission = m.admission([(prompt, h)])
    assert admission.cached == (0,) and admission.fits([10])
    assert m.can_allocate(prompt, hashes=h) and m.num_cached_tokens(prompt, hashes=h) == 0
    assert m.allocate("a", prompt, hashes=h) == 0
    assert len(hashed) == 2  # nothing hashed twice so far
    m.append("a", [10, 11, 12])  # fills block 2
    m.append_all([("a", [13])])  # the decode path
    m.append_all([("a", [14])])
    m.append("a", [15, 16, 17, 18, 19])  # fills blocks 3 and 4
    assert h.num_tokens == 20 and len(h.hashes) == 5  # the manager extended the caller's object
    assert len(hashed) == 5 and set(hashed.values()) == {1}
    assert m.num_cached_tokens(list(range(21))) == 20  # the blocks were registered, under the right hashes


def test_a_re_admission_after_free_with_the_same_object_hashes_nothing_new(hashed):
    """An engine keeps a request's hashes across preemption (recompute): nothing is hashed again."""
    m = make(num_blocks=32, block_size=BS)
    tokens = list(range(14))
    h = BlockHashes(BS)
    m.allocate("a", tokens[:6], hashes=h)
    m.append("a", tokens[6:])  # the request generated 8 more tokens
    m.free("a")  # preempted for recompute
    before = sum(hashed.values())
    admission = m.admission([(tokens, h)])
    assert admission.cached == (12,) and admission.fits([14])
    assert m.allocate("a", tokens, hashes=h) == 12
    assert m.num_cached_tokens(tokens, hashes=h) == 12
    assert sum(hashed.values()) == before == 3


def test_an_object_ahead_of_the_sequence_is_only_read_until_the_sequence_catches_up(hashed):
    """Chunked prefill: the engine hashes the whole prompt once; chunks and later appends hash nothing new."""
    m = make(num_blocks=32, block_size=BS)
    prompt = list(range(17))
    h = BlockHashes(BS)
    h.extend(prompt)  # 4 blocks
    assert m.allocate("a", prompt[:5], hashes=h) == 0  # a first chunk
    assert m.num_cached_tokens(prompt[:9], hashes=h) == 4  # only block 0 is full in the sequence: only it is cached
    m.append("a", prompt[5:12])
    m.append_all([("a", [12])])
    assert m.num_cached_tokens(prompt[:14], hashes=h) == 12
    assert h.num_tokens == 17 and len(hashed) == 4 and set(hashed.values()) == {1}
    m.append("a", prompt[13:] + [99, 98, 97])  # past the object: extended by the new ids only
    assert h.num_tokens == 20 and len(hashed) == 5


@pytest.mark.parametrize("anonymous", [False, True])
def test_nothing_is_hashed_without_prefix_caching_or_for_anonymous_tokens(hashed, anonymous):
    m = make(num_blocks=32, block_size=BS, enable_prefix_caching=anonymous)
    h = BlockHashes(BS)
    tokens = 9 if anonymous else list(range(9))
    assert m.admission([(tokens, h)]).cached == (0,)
    assert m.allocate("a", tokens, hashes=h) == 0 and m.num_cached_tokens(tokens, hashes=h) == 0
    m.append("a", [1] * 8)
    assert not hashed and h.num_tokens == 0  # a given object is left alone


def test_the_object_must_match_the_managers_block_size_and_the_calls_salt():
    m = make(num_blocks=32, block_size=BS)
    with pytest.raises(InvalidArgumentError, match=r"^hashes.block_size=8: expected 4"):
        m.allocate("a", [1, 2], hashes=BlockHashes(8))
    with pytest.raises(InvalidArgumentError, match=r"^hashes.root="):
        m.allocate("a", [1, 2], hashes=BlockHashes(BS, cache_salt="t"))
    with pytest.raises(InvalidArgumentError, match=r"^hashes='list'"):
        m.num_cached_tokens([1, 2], hashes=[b"x" * 32])
    assert m.allocate("a", list(range(9)), cache_salt="t", hashes=BlockHashes(BS, cache_salt="t")) == 0
    assert m.num_cached_tokens(list(range(9)), cache_salt="t") == 8 and m.num_cached_tokens(list(range(9))) == 0


def test_edits_by_position_never_cut_the_callers_object():
    m = make(num_blocks=32, block_size=BS)
    h = BlockHashes(BS)
    m.allocate("a", list(range(10)), hashes=h)
    m.truncate("a", 5)
    assert h.num_tokens == 10  # the manager cut a private copy
    m.append("a", [50, 51, 52])  # extends the copy, not the caller's object
    assert h.num_tokens == 10 and m.num_cached_tokens([0, 1, 2, 3, 4, 50, 51, 52, 9]) == 8

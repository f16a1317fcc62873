"""Per-request cache salts: prefix-cache blocks are shared only between requests with the same salt."""

from __future__ import annotations

import pytest
from sched_helpers import SHARED, make_engine

from paged_kv.errors import InvalidArgumentError
from scheduler import SamplingParams


def _cached_tokens_after(engine, salt_a, salt_b) -> int:
    """Run a request with ``salt_a``, then the same prompt with ``salt_b``; the second one's prefix hits."""
    prompt = SHARED + [1, 2, 3]
    engine.generate([prompt], SamplingParams(max_tokens=2, cache_salt=salt_a), use_tqdm=False)
    before = engine.block_manager.stats()
    engine.generate([prompt], SamplingParams(max_tokens=2, cache_salt=salt_b), use_tqdm=False)
    stats = engine.block_manager.stats()
    return stats.hit_rate - before.hit_rate


@pytest.mark.parametrize(("a", "b", "shared"), [("t1", "t1", True), ("t1", "t2", False), (None, "t1", False)])
def test_prefix_cache_is_shared_only_within_a_salt(tiny_hf, a, b, shared):
    engine = make_engine(tiny_hf)
    gain = _cached_tokens_after(engine, a, b)
    assert (gain > 0) is shared


@pytest.mark.parametrize("salt", ["", 3, b"x"])
def test_bad_cache_salt_raises(salt):
    with pytest.raises(InvalidArgumentError, match="cache_salt"):
        SamplingParams(cache_salt=salt)


@pytest.mark.parametrize("stop", [[""], [3], b"x", 5])
def test_bad_stop_strings_raise(stop):
    with pytest.raises(InvalidArgumentError, match="stop"):
        SamplingParams(stop=stop)


def test_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_num_cached_tokens_is_the_prefix_cache_hit_at_admission(tiny_hf):
    engine = make_engine(tiny_hf, max_num_batched_tokens=16, max_num_seqs=4)  # the prompt prefills in chunks
    prompt = SHARED + [1, 2, 3]
    salted = [SamplingParams(max_tokens=2, cache_salt=s) for s in ("a", "a", "b")]
    (first,) = engine.generate([prompt], salted[0], use_tqdm=False)
    second, other = engine.generate([prompt, prompt], salted[1:], use_tqdm=False)
    assert (first.num_cached_tokens, other.num_cached_tokens) == (0, 0)
    assert second.num_cached_tokens == (len(prompt) - 1) // 4 * 4  # whole blocks, never the last token

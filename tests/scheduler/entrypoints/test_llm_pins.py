"""The offline LLM's pinned prefixes and request priorities: what they keep cached when the pool is short."""

from __future__ import annotations

import pytest

from paged_kv.errors import InvalidArgumentError, UnknownSequenceError
from scheduler.core.config import CacheConfig, EngineConfig
from scheduler.core.params import SamplingParams
from scheduler.entrypoints.llm import LLM
from scheduler.model.loader import load_model

ONE = SamplingParams(max_tokens=1, ignore_eos=True)
SYSTEM = "the quick brown fox jumps over the lazy dog, hello world"


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir)


def small_llm(loaded, blocks: int) -> LLM:
    """An LLM whose device pool holds ``blocks`` blocks of 4 tokens (no watermark)."""
    cache = CacheConfig(block_size=4, num_gpu_blocks=blocks, watermark=0.0)
    return LLM(loaded, engine_config=EngineConfig(cache=cache, device="cpu"))


def fill_pool(llm: LLM, rounds: int = 3) -> None:
    """Prompts that, one after another, need every block of the pool a pin leaves."""
    for i in range(rounds):
        llm.generate([list(range(20 + 7 * i, 20 + 7 * i + 22))], ONE)


def test_a_pinned_text_prompt_is_held_on_return_and_survives_a_full_pool(loaded):
    llm = small_llm(loaded, blocks=12)
    ids, _ = llm.encode(SYSTEM)
    full = len(ids) // 4 * 4
    pin = llm.pin_prefix(SYSTEM)
    assert llm.engine.pins.held == {pin: full} and not llm.engine.has_unfinished_requests()
    fill_pool(llm)
    (out,) = llm.generate([ids + [5]], ONE)
    assert out.num_cached_tokens == full
    llm.unpin(pin)
    fill_pool(llm)
    assert llm.engine.block_manager.num_cached_tokens(ids + [5]) < full  # evictable again
    with pytest.raises(UnknownSequenceError, match="pin_id"):
        llm.unpin(pin)


def test_pin_prefix_takes_token_ids_and_a_salt(loaded):
    llm = small_llm(loaded, blocks=12)
    ids = list(range(30, 39))
    pin = llm.pin_prefix(ids, cache_salt="tenant-a")
    assert llm.engine.pins.held == {pin: 8}
    assert llm.generate([ids + [1]], ONE)[0].num_cached_tokens == 0  # another tenant's (no salt) finds nothing
    (out,) = llm.generate([ids + [1]], SamplingParams(max_tokens=1, cache_salt="tenant-a"))
    assert out.num_cached_tokens == 8
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        llm.pin_prefix([1, 2])  # shorter than a block: nothing to pin


@pytest.mark.parametrize("important", [0, 1])
def test_priority_decides_whose_cached_blocks_are_evicted_first(loaded, important):
    llm = small_llm(loaded, blocks=8)
    prompts = [list(range(40, 49)), list(range(60, 69))]  # 2 full blocks each
    priority = [5, 5]
    priority[important] = -1  # vLLM: lower is more important
    llm.generate(prompts, ONE, priority=priority)
    llm.generate([list(range(100, 121))], ONE)  # 6 blocks: the free ones, then 2 of the 4 cached
    cached = [llm.engine.block_manager.num_cached_tokens(p + [0]) for p in prompts]
    assert cached[important] == 8 and cached[1 - important] == 0


def test_a_priority_per_prompt_must_match_the_prompts(loaded):
    llm = small_llm(loaded, blocks=8)
    with pytest.raises(InvalidArgumentError, match="priority"):
        llm.generate(["a", "b"], ONE, priority=[1])
    assert not llm.engine.has_unfinished_requests()

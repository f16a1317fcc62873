"""``LLMEngine.reset_prefix_cache``: every cached block forgotten, running requests and pinned prefixes untouched."""

from __future__ import annotations

import pytest
from sched_helpers import tiny_llama

from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler.core.kv_events_config import KVEventsConfig

SYSTEM = list(range(100, 120))  # 5 full blocks of 4
PROMPT = SYSTEM + [7, 8, 9]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama()


def engine(hf_model, *, step_tokens: int = 64, offload: int = 0, kv_events: KVEventsConfig | None = None
           ) -> LLMEngine:  # fmt: skip
    """A CPU engine over 32 blocks of 4 tokens, no watermark, ``step_tokens`` new tokens a step (chunked prefill)."""
    cache = CacheConfig(block_size=4, num_gpu_blocks=32, watermark=0.0, kv_offloading_bytes=offload, host_store="write")
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=step_tokens)
    return LLMEngine.from_hf(hf_model, EngineConfig(cache=cache, scheduler=sched, device="cpu", kv_events=kv_events))


def cached_tokens(eng: LLMEngine, prompt: list[int] = PROMPT) -> int:
    """Tokens of ``prompt`` a new request finds cached (it runs to its end)."""
    return eng.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0].num_cached_tokens


def run_idle(eng: LLMEngine) -> dict[str, list[int]]:
    """Step until nothing is left; each finished request's first sample's tokens."""
    done = {}
    while eng.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished}
    return done


def test_a_reset_forgets_every_cached_block_and_returns_how_many(hf_model):
    eng = engine(hf_model)
    cached_tokens(eng)
    assert cached_tokens(eng) == 20  # the prompt's full blocks but its last token's
    num_cached = eng.block_manager.gpu.num_cached
    assert eng.reset_prefix_cache() == num_cached > 0
    assert eng.block_manager.gpu.num_cached == 0 and eng.block_manager.num_free_blocks == 32
    assert eng.block_manager.stats().hit_rate_since_reset == 0.0
    assert cached_tokens(eng) == 0
    eng.block_manager.check()


def test_an_idle_reset_of_an_empty_cache_forgets_nothing(hf_model):
    eng = engine(hf_model)
    assert eng.reset_prefix_cache() == 0
    eng.block_manager.check()


def test_a_request_running_across_a_reset_gets_its_lone_output_and_leaks_no_block(hf_model):
    alone = engine(hf_model).generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    eng = engine(hf_model, step_tokens=8)  # the prompt is prefilled in 3 steps
    cached_tokens(eng)
    eng.add_request("r", PROMPT, GREEDY)
    eng.step()
    eng.step()
    assert eng.reset_prefix_cache() > 0
    assert eng.block_manager.gpu.num_cached <= 1  # at most the block its next step registered
    assert run_idle(eng) == {"r": alone}
    assert eng.block_manager.gpu.num_used == 0
    eng.block_manager.check()


def test_a_held_pin_stays_cached_across_a_reset(hf_model):
    eng = engine(hf_model)
    pin = eng.pin_prefix(SYSTEM)
    run_idle(eng)
    cached_tokens(eng, SYSTEM + [1, 2, 3, 4, 5])
    assert eng.reset_prefix_cache() == 1  # the other prompt's one full block past SYSTEM
    assert eng.pins.held == {pin: 20} and eng.block_manager.num_pinned_blocks == 5
    assert cached_tokens(eng) == 20
    eng.unpin(pin)
    eng.block_manager.check()


def test_a_pin_whose_warm_up_runs_across_a_reset_still_takes_hold(hf_model):
    eng = engine(hf_model, step_tokens=8)  # the warm-up prefills SYSTEM in 3 steps
    pin = eng.pin_prefix(SYSTEM)
    eng.step()
    eng.reset_prefix_cache()  # forgets the blocks the warm-up registered so far
    assert run_idle(eng) == {}  # warm-ups' outputs never reach the caller
    assert eng.pins.held == {pin: 20}
    assert cached_tokens(eng) == 20
    eng.block_manager.check()


def test_a_reset_forgets_the_host_tier_too(hf_model):
    eng = engine(hf_model, offload=1 << 20)
    cached_tokens(eng)
    eng.step()  # nothing to run: the step's host-tier stores
    assert eng.block_manager.stats().num_host_cached > 0
    eng.reset_prefix_cache()
    assert eng.block_manager.stats().num_host_cached == 0 and cached_tokens(eng) == 0


def test_a_reset_publishes_all_blocks_cleared_at_once_then_the_pinned_blocks_again(hf_model):
    eng = engine(hf_model, kv_events=KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
    batches = []
    eng.cache_events.publisher.publish = batches.append
    pin = eng.pin_prefix(SYSTEM)
    run_idle(eng)
    cached_tokens(eng)
    batches.clear()
    eng.reset_prefix_cache()
    [batch] = batches
    cleared, stored = batch.events
    assert type(cleared).__name__ == "AllBlocksCleared"
    assert stored.block_hashes == [h for b, h, _, _ in _chain(eng, pin)] and stored.token_ids == SYSTEM
    eng.shutdown()


def _chain(eng: LLMEngine, pin: str) -> list[tuple]:
    """The pin's blocks as the device pool caches them, in chain order."""
    records = {r[0]: r for r in eng.block_manager.gpu.cached_blocks()}
    return [records[b] for b in eng.block_manager._pins[pin]]

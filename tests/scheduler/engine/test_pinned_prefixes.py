"""Pinned prefixes across a failed step: the reset forgets their blocks, so each pin is computed again."""

from __future__ import annotations

import logging

import pytest
from sched_helpers import tiny_llama

from paged_kv.errors import InvalidArgumentError, UnknownSequenceError
from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

SYSTEM = list(range(100, 120))  # 5 full blocks of 4
TWO = SamplingParams(max_tokens=2)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama()


def engine(hf_model, blocks: int = 16) -> LLMEngine:
    """A CPU engine over ``blocks`` blocks of 4 tokens, no watermark."""
    cache = CacheConfig(block_size=4, num_gpu_blocks=blocks, watermark=0.0)
    return LLMEngine.from_hf(hf_model, EngineConfig(cache=cache, device="cpu"))


def fail_next_step(eng: LLMEngine, monkeypatch) -> None:
    """Make the next model step raise (as a lost device would), and only that one."""
    execute = eng.runner.execute

    def once(step):
        monkeypatch.setattr(eng.runner, "execute", execute)
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng.runner, "execute", once)
    eng.add_request("victim", list(range(40, 50)), TWO)
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()


def run_idle(eng: LLMEngine) -> None:
    """Step until nothing is left; no warm-up output may reach the caller."""
    while eng.has_unfinished_requests():
        assert all(not o.request_id.startswith("paged-kv-pin-") for o in eng.step())


def cached_tokens_of_system(eng: LLMEngine) -> int:
    """Tokens of SYSTEM a new request finds cached."""
    return eng.generate([SYSTEM + [7]], SamplingParams(max_tokens=1), use_tqdm=False)[0].num_cached_tokens


def test_a_held_pin_is_computed_again_after_a_failed_step_and_keeps_its_blocks_once(hf_model, monkeypatch):
    eng = engine(hf_model)
    pin = eng.pin_prefix(SYSTEM)
    run_idle(eng)
    assert eng.pins.held == {pin: 20}
    fail_next_step(eng, monkeypatch)
    assert eng.pins.is_waiting(pin) and eng.pins.held == {}  # the reset forgot its blocks: nothing held for no hit
    run_idle(eng)
    assert eng.pins.held == {pin: 20}
    assert cached_tokens_of_system(eng) == 20
    assert eng.block_manager.num_pinned_blocks == 5
    eng.block_manager.check()


def test_a_pin_waiting_for_its_warm_up_when_a_step_fails_still_takes_hold(hf_model, monkeypatch):
    eng = engine(hf_model)
    pin = eng.pin_prefix(SYSTEM)
    fail_next_step(eng, monkeypatch)  # the warm-up request is aborted with the victim
    assert eng.pins.is_waiting(pin)
    run_idle(eng)
    assert eng.pins.held == {pin: 20}
    assert cached_tokens_of_system(eng) == 20


def test_a_pin_restored_after_a_failed_step_can_be_unpinned_once(hf_model, monkeypatch):
    eng = engine(hf_model)
    pin = eng.pin_prefix(SYSTEM)
    run_idle(eng)
    fail_next_step(eng, monkeypatch)
    eng.unpin(pin)  # while its new warm-up waits
    run_idle(eng)
    assert eng.pins.held == {} and not eng.pins.is_waiting(pin)
    assert eng.block_manager.num_pinned_blocks == 0
    with pytest.raises(UnknownSequenceError, match="pin_id"):
        eng.unpin(pin)
    eng.block_manager.check()


def test_a_pin_refused_at_its_warm_up_leaves_no_pin_that_a_failed_step_would_warm_up_again(hf_model, monkeypatch):
    eng = engine(hf_model)
    with pytest.raises(InvalidArgumentError):  # 17 blocks of 4: its warm-up request can never fit 16
        eng.pin_prefix(list(range(60, 128)))
    pin = eng.pin_prefix(SYSTEM)
    run_idle(eng)
    fail_next_step(eng, monkeypatch)  # restores every pin: the refused one would be refused again, first
    run_idle(eng)
    assert eng.pins.held == {pin: 20}
    assert cached_tokens_of_system(eng) == 20


def test_a_pin_whose_warm_up_is_refused_after_admission_is_dropped_with_a_warning(hf_model, caplog):
    # the second pin's warm-up is admitted, then refused: the first pin, taken meanwhile, holds the room it needs
    cache = CacheConfig(block_size=2, num_gpu_blocks=12, watermark=0.25)
    sched = SchedulerConfig(max_num_batched_tokens=11, max_num_seqs=2, enable_chunked_prefill=False)
    eng = LLMEngine.from_hf(hf_model, EngineConfig(cache=cache, scheduler=sched, device="cpu"))
    first = eng.pin_prefix([7, 1, 9, 3, 5, 11, 2, 8])
    second = eng.pin_prefix([7, 1, 9, 3, 5, 11, 2, 8, 4, 6, 10], cache_salt="s")
    with caplog.at_level(logging.WARNING, "scheduler.engine.pinned_prefixes"):
        run_idle(eng)
    assert eng.pins.held == {first: 8} and not eng.pins.is_waiting(second)
    assert f"pin {second} is dropped: its warm-up request failed" in caplog.text
    with pytest.raises(UnknownSequenceError):
        eng.unpin(second)

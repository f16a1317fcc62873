"""The offline LLM marks a request that fails alone (``error``) and finishes the others with the same text."""

from __future__ import annotations

import pytest
from fault_helpers import FAULT_SALT, FaultyTokenizer, plant_sampling_fault
from sched_helpers import assert_all_freed

from scheduler.core.config import CacheConfig, EngineConfig
from scheduler.core.params import SamplingParams
from scheduler.entrypoints.llm import LLM

PROMPTS = ["hello world", "the quick brown fox", "numbers: 1 2 3"]
FAULTY = "a library opens at nine"
PARAMS = [SamplingParams(max_tokens=12, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=1.0, seed=4, ignore_eos=True, stop=["ab"]),
          SamplingParams(max_tokens=8, n=2, temperature=0.9, seed=6, ignore_eos=True)]  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, engine_config=EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=256),
                                                          device="cpu"))  # fmt: skip


def _texts(outputs) -> list:
    return [[(s.text, s.token_ids, s.finish_reason) for s in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def reference(llm) -> list:
    return _texts(llm.generate(PROMPTS, PARAMS))


def test_a_detokenization_fault_fails_its_request_alone(llm, reference):
    tokenizer = llm.processor.tokenizer
    llm.processor.tokenizer = FaultyTokenizer(tokenizer, llm.encode(FAULTY)[0])
    try:
        *good, bad = llm.generate([*PROMPTS, FAULTY], [*PARAMS, SamplingParams(max_tokens=6, n=2, seed=1)])
    finally:
        llm.processor.tokenizer = tokenizer
    assert bad.error == "detokenization failed: ValueError: planted detokenization fault"
    assert [s.finish_reason for s in bad.outputs] == ["error"] * len(bad.outputs)
    assert _texts(good) == reference
    assert_all_freed(llm.engine)


def test_a_sampling_fault_fails_its_request_alone(llm, reference, monkeypatch):
    plant_sampling_fault(monkeypatch, after=2)
    *good, bad = llm.generate([*PROMPTS, FAULTY], [*PARAMS, SamplingParams(max_tokens=6, cache_salt=FAULT_SALT)])
    assert bad.error == "sampling failed: RuntimeError: planted sampling fault"
    assert [(len(s.token_ids), s.finish_reason) for s in bad.outputs] == [(2, "error")]
    assert _texts(good) == reference
    assert_all_freed(llm.engine)


def test_a_model_step_failure_raises_and_leaves_nothing_behind(llm, reference, monkeypatch):
    def run(out):
        raise RuntimeError("planted forward fault")

    monkeypatch.setattr(llm.engine.runner, "run", run)
    with pytest.raises(RuntimeError, match="planted"):
        llm.generate(PROMPTS, PARAMS)
    assert not llm.processor.has_unfinished()
    assert_all_freed(llm.engine)
    monkeypatch.undo()
    assert _texts(llm.generate(PROMPTS, PARAMS)) == reference

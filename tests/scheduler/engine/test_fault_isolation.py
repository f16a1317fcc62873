"""A request's own failure fails it alone (the others keep their tokens, nothing leaks); a model-step failure, all."""

from __future__ import annotations

import logging

import pytest
from fault_helpers import plant_bookkeeping_fault, plant_sampling_fault
from sched_helpers import assert_all_freed, make_engine

from scheduler import SamplingParams
from scheduler.engine.faults import isolate

BAD = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)  # the faulty request's, by identity


def _good(prompts) -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy, seeded and n = 2 seeded requests (their tokens do not depend on the batch)."""
    return {
        "greedy": (prompts[0], SamplingParams(max_tokens=10, ignore_eos=True)),
        "seeded": (prompts[2], SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=5, ignore_eos=True)),
        "pair": (prompts[3], SamplingParams(max_tokens=8, n=2, temperature=0.8, top_p=0.9, seed=9, ignore_eos=True)),
    }


def _run(engine, requests: dict) -> dict:
    """Add every request, step to the end; every output by request id (failed ones included)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step()}
    return done


def _tokens(outputs: dict, ids) -> dict:
    return {rid: [s.token_ids for s in outputs[rid].outputs] for rid in ids}


@pytest.fixture
def reference(tiny_hf, prompts) -> dict:
    """The good requests' tokens without the faulty one."""
    good = _good(prompts)
    return _tokens(_run(make_engine(tiny_hf), good), good)


@pytest.mark.parametrize("after", [0, 4], ids=["at its first token", "mid-decode"])
def test_a_sampling_fault_fails_its_request_alone(tiny_hf, prompts, reference, monkeypatch, caplog, after):
    plant_sampling_fault(monkeypatch, lambda p: p is BAD, after=after)
    engine = make_engine(tiny_hf)
    with caplog.at_level(logging.ERROR, "scheduler.engine.llm_engine"):
        done = _run(engine, {**_good(prompts), "bad": (prompts[1], BAD)})
    bad = done["bad"]
    assert bad.finished and bad.error == "sampling failed: RuntimeError: planted sampling fault"
    assert [(len(s.token_ids), s.finish_reason) for s in bad.outputs] == [(after, "error")]
    assert _tokens(done, reference) == reference  # seeded generators were restored after the failed batch
    assert "request bad failed and is aborted alone: sampling failed" in caplog.text
    assert_all_freed(engine)


def test_a_value_that_breaks_the_sampler_fails_only_its_request(tiny_hf, prompts, reference):
    broken = SamplingParams(max_tokens=6, temperature=1.0)
    object.__setattr__(broken, "top_k", 10**20)  # as if it slipped past validation: int64 overflows in the sampler
    engine = make_engine(tiny_hf)
    done = _run(engine, {**_good(prompts), "bad": (prompts[1], broken)})
    assert _tokens(done, reference) == reference
    if done["bad"].error is not None:  # a sampler that accepts the value lets it finish normally
        assert done["bad"].error.startswith("sampling failed: ") and done["bad"].outputs[0].finish_reason == "error"
    assert_all_freed(engine)


def test_a_bookkeeping_fault_fails_its_request_alone(tiny_hf, prompts, reference, monkeypatch):
    engine = make_engine(tiny_hf)
    plant_bookkeeping_fault(monkeypatch, engine.scheduler, lambda p: p is BAD, after=3)
    done = _run(engine, {**_good(prompts), "bad": (prompts[1], BAD)})
    assert done["bad"].error == "token bookkeeping failed: KeyError: 'planted bookkeeping fault'"
    assert done["bad"].outputs[0].finish_reason == "error"
    assert _tokens(done, reference) == reference
    assert_all_freed(engine)


def test_a_model_step_failure_aborts_every_request_and_logs_the_cause(tiny_hf, prompts, reference, caplog):
    engine = make_engine(tiny_hf)
    run, calls = engine.runner.run, []

    def failing(out):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("planted forward fault")
        return run(out)

    engine.runner.run = failing
    for rid, (prompt, params) in _good(prompts).items():
        engine.add_request(rid, prompt, params)
    with caplog.at_level(logging.ERROR, "scheduler.engine.llm_engine"), pytest.raises(RuntimeError, match="planted"):
        while engine.has_unfinished_requests():
            engine.step()
    assert "engine step failed (RuntimeError: planted forward fault); aborting all 3 live requests" in caplog.text
    assert_all_freed(engine)
    assert _tokens(_run(engine, _good(prompts)), reference) == reference  # the engine serves on


def test_isolate_finds_each_failing_owner_by_halving():
    calls = []

    def run(items):
        calls.append(len(items))
        if {3, 6} & set(items):
            raise ValueError(items)
        return [10 * i for i in items]

    failed = {}
    assert isolate(list(range(8)), run, lambda i: i, failed) == [0, 10, 20, 40, 50, 70]
    assert sorted(failed) == [3, 6] and len(calls) == 1 + 2 + 4 + 4

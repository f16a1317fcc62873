"""Greedy generation through the engine equals transformers' generate(do_sample=False), token for token."""

from __future__ import annotations

import pytest
from sched_helpers import ENGINE_CASES, GREEDY, greedy_reference, make_engine, tiny_llama

CASES = ENGINE_CASES


def _run_traced(engine, prompts, params):
    """generate(), recording each step's (num_tokens, start) pairs."""
    trace = []
    schedule = engine.scheduler.schedule

    def traced():
        out = schedule()
        trace.append([(s.start, s.num_tokens, s.seq.num_tokens) for s in out.scheduled])
        return out

    engine.scheduler.schedule = traced
    return engine.generate(prompts, params, use_tqdm=False), trace


def test_the_oracle_agrees_when_eos_is_a_greedy_token(prompts, hf_greedy):
    """A model whose EOS id is one of its greedy tokens: the engine under GREEDY (ignore_eos) emits it and goes
    on, and greedy_reference does the same (it blocks nothing, as transformers' min_new_tokens would)."""
    eos = hf_greedy[0][3]
    hf = tiny_llama(seed=0, eos_token_id=eos)  # tiny_hf's weights, with an EOS id it picks at step 3
    assert hf.generation_config.eos_token_id == eos
    (out,) = make_engine(hf).generate(prompts[:1], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy[0] == greedy_reference(hf, prompts[:1])[0]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(case, tiny_hf, prompts, hf_greedy):
    kwargs, expect = CASES[case]
    engine = make_engine(tiny_hf, **kwargs)
    outs, trace = _run_traced(engine, prompts, GREEDY)
    for prompt, out, ref in zip(prompts, outs, hf_greedy):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"
    stats = engine.block_manager.stats()
    if expect == "hits":
        assert stats.hit_rate > 0.1
    elif expect == "chunks":
        assert any(n < total - start for step in trace for start, n, total in step), "no prompt was split"
    elif expect in ("recompute", "swap"):
        assert engine.scheduler.num_preemptions[expect] >= 3
    assert stats.num_used == 0 and stats.num_sequences == 0
    engine.block_manager.check()


def test_greedy_matches_with_requests_arriving_mid_run(tiny_hf, prompts, hf_greedy):
    """Requests added while others decode join the running batch and still match."""
    engine = make_engine(tiny_hf, max_num_batched_tokens=16, max_num_seqs=4)
    done, pending = {}, list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, GREEDY)
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    assert [done[f"r{i}"] for i in range(len(prompts))] == hf_greedy

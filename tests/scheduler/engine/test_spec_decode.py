"""Speculative decoding in the engine: greedy outputs with n-gram drafts equal those without, token for token, under
chunked prefill, prefix caching, preemption (recompute and swap), n > 1 and stops; rejected drafts never reach the
prefix cache; requests it cannot serve exactly decode without drafts."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from sched_helpers import ENGINE_CASES, NUM_NEW, after_each_schedule, make_engine, tiny_llama
from spec_helpers import (
    SPEC,
    assert_drafts_accepted_and_rejected,
    repeating_prompts,
    run_with_drafts,
    run_without_drafts,
    token_ids,
)

from scheduler import SamplingParams
from scheduler.core.speculative_config import SpeculativeConfig

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)

CASES = ENGINE_CASES | {
    "priority_policy": (dict(scheduling_policy="priority", num_blocks=24, max_num_batched_tokens=32, max_num_seqs=8),
                        None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_drafts_equals_without(case, looping_hf):
    kwargs, expect = CASES[case]
    prompts = repeating_prompts()
    ref = run_without_drafts(looping_hf, prompts, GREEDY, **kwargs)
    outs, engine = run_with_drafts(looping_hf, prompts, GREEDY, **kwargs)
    assert token_ids(outs) == token_ids(ref)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_drafts_accepted_and_rejected(engine)
    stats = engine.block_manager.stats()
    if expect == "hits":
        assert stats.hit_rate > 0.1
    elif expect in ("recompute", "swap"):
        assert engine.scheduler.num_preemptions[expect] >= 2


def test_greedy_with_drafts_equals_transformers(tiny_hf, prompts, hf_greedy):
    params = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)
    outs, engine = run_with_drafts(tiny_hf, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy
    assert engine.spec.stats.num_draft_tokens > 0


def test_drafts_count_against_the_step_budget_beside_prefill_chunks(looping_hf):
    steps = []  # per step: its batched tokens, and (start, new tokens, drafts, outputs, prompt length) per sequence

    def record(out):
        seqs = [(s.start, s.num_tokens, len(s.drafts), s.seq.num_outputs, s.seq.prompt_len) for s in out.scheduled]
        steps.append((out.num_batched_tokens, seqs))
        ran = {s.seq for s in out.scheduled}
        waiting = [s for g in engine.scheduler.running for s in g.active() if s not in ran and s.num_uncomputed == 1]
        assert not (out.num_draft_tokens and waiting), "drafts took the budget of a decode sequence's own token"

    kwargs = dict(max_num_batched_tokens=8, max_num_seqs=4)
    engine = make_engine(looping_hf, speculative=replace(SPEC, num_speculative_tokens=6), **kwargs)
    after_each_schedule(engine, record)
    outs = engine.generate(repeating_prompts(), GREEDY, use_tqdm=False)
    assert token_ids(outs) == token_ids(run_without_drafts(looping_hf, repeating_prompts(), GREEDY, **kwargs))
    seqs = [s for _, step in steps for s in step]
    assert any(drafts for _, _, drafts, _, _ in seqs)
    assert any(start + n < prompt_len for start, n, _, _, prompt_len in seqs)  # prompts were split
    for batched, step in steps:
        assert batched == sum(n + drafts for _, n, drafts, _, _ in step) <= 8
        for _, n, drafts, outputs, _ in step:
            if drafts:  # a decode step of one token, its drafts within max_tokens
                assert n == 1 and outputs + drafts < GREEDY.max_tokens


def test_parallel_samples_draft_each_on_its_own(looping_hf):
    params = SamplingParams(n=3, max_tokens=30, ignore_eos=True)
    prompts = repeating_prompts()[:3]
    ref = run_without_drafts(looping_hf, prompts, params)
    outs, engine = run_with_drafts(looping_hf, prompts, params)
    assert token_ids(outs) == token_ids(ref)
    assert all(len(o.outputs) == 3 for o in outs)
    assert_drafts_accepted_and_rejected(engine)


def test_parallel_samples_with_preemption(looping_hf):
    params = SamplingParams(n=2, max_tokens=30, ignore_eos=True)
    kwargs = dict(num_blocks=36, max_num_batched_tokens=32, max_num_seqs=8)
    ref = run_without_drafts(looping_hf, repeating_prompts(), params, **kwargs)
    outs, engine = run_with_drafts(looping_hf, repeating_prompts(), params, **kwargs)
    assert token_ids(outs) == token_ids(ref)
    assert engine.scheduler.num_preemptions["recompute"] >= 1


def _multi_token_steps(looping_hf, prompts, params):
    """A run with drafts that records, per request, each verification's (first output index, tokens), in order."""
    engine = make_engine(looping_hf, speculative=SPEC)
    verify, steps = engine.spec.sample_and_verify, {}

    def recorded(*args, **kwargs):
        tokens = verify(*args, **kwargs)
        by_seq = {}
        for t in tokens:
            by_seq.setdefault(t.group.request_id, (t.seq.num_outputs, []))[1].append(t.token_id)
        for request_id, emitted in by_seq.items():
            steps.setdefault(request_id, []).append(emitted)
        return tokens

    engine.spec.sample_and_verify = recorded
    return engine.generate(prompts, params, use_tqdm=False), steps


def _stop_among_accepted_drafts(looping_hf) -> tuple[list[int], int, list[int]]:
    """(prompt, stop token, its tokens without the stop): a token that a verification emits with later tokens after
    it, and that appears there first in its sample. The prompts go on with their first outputs: drafts copy the
    loops already in them, so tokens new to the sample come among accepted drafts."""
    outs, _ = _multi_token_steps(looping_hf, repeating_prompts(), GREEDY)
    prompts = [p + o.outputs[0].token_ids[:cut] for p, o in zip(repeating_prompts(), outs) for cut in (3, 6, 12)]
    outs, steps = _multi_token_steps(looping_hf, prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        for start, ids in steps.get(out.request_id, []):
            for j, t in enumerate(ids[:-1]):
                if tokens.index(t) == start + j:
                    return prompt, t, tokens
    raise AssertionError("no verification kept a token new to its sample with others after it")


def test_a_stop_token_among_accepted_drafts_ends_the_sample_there(looping_hf):
    prompt, stop, unstopped = _stop_among_accepted_drafts(looping_hf)
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop,))
    ref = run_without_drafts(looping_hf, [prompt], params)
    (out,), engine = run_with_drafts(looping_hf, [prompt], params)
    assert out.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert out.outputs[0].token_ids[-1] == stop and out.outputs[0].finish_reason == "stop"
    assert len(out.outputs[0].token_ids) < len(unstopped)


def test_metrics_count_the_kept_tokens_only(looping_hf):
    """A stop among accepted drafts drops the tokens after it: the step metrics do not count them."""
    prompt, stop, _ = _stop_among_accepted_drafts(looping_hf)
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop,))
    (out,), engine = run_with_drafts(looping_hf, [prompt], params)
    kept = len(out.outputs[0].token_ids)
    assert sum(s.num_generated_tokens for s in engine.metrics.steps) == kept
    assert engine.metrics_summary().generated_tokens == kept


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8, 13])
def test_max_tokens_is_reached_exactly(looping_hf, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ref = run_without_drafts(looping_hf, repeating_prompts(), params)
    outs, _ = run_with_drafts(looping_hf, repeating_prompts(), params)
    assert token_ids(outs) == token_ids(ref)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)


def test_the_model_context_caps_the_drafts(looping_hf):
    short = tiny_llama(0, initializer_range=0.02, max_position_embeddings=40)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    prompts = [p[:20] for p in repeating_prompts()]
    ref = run_without_drafts(short, prompts, params)
    outs, engine = run_with_drafts(short, prompts, params)
    assert token_ids(outs) == token_ids(ref)
    assert all(len(p) + len(o.outputs[0].token_ids) == 40 for p, o in zip(prompts, outs))
    assert engine.spec.stats.num_drafts > 0


def test_logprobs_with_drafts_equal_those_without(looping_hf):
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3)
    ref = run_without_drafts(looping_hf, repeating_prompts(), params)
    outs, engine = run_with_drafts(looping_hf, repeating_prompts(), params)
    assert engine.spec.stats.num_accepted_tokens > 0
    for a, b in zip(outs, ref):
        sa, sb = a.outputs[0], b.outputs[0]
        assert sa.token_ids == sb.token_ids and sa.ranks == sb.ranks
        assert sa.logprobs == pytest.approx(sb.logprobs, abs=1e-4)
        assert [set(t) for t in sa.top_logprobs] == [set(t) for t in sb.top_logprobs]


def test_random_sampling_with_drafts_runs_seeded_and_frees_everything(looping_hf):
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.05, top_k=3, seed=5)
    a, engine = run_with_drafts(looping_hf, repeating_prompts(), params)
    b, _ = run_with_drafts(looping_hf, repeating_prompts(), params)
    assert token_ids(a) == token_ids(b)  # seeded: reproducible with drafts too
    assert all(len(o.outputs[0].token_ids) == 30 for o in a)
    assert engine.spec.stats.num_accepted_tokens > 0


def test_random_rows_whose_distribution_is_one_token_equal_greedy(looping_hf):
    """top_k=1 leaves one token: the rejection rule accepts exactly the drafts the argmax chain does."""
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, top_k=1)
    outs, engine = run_with_drafts(looping_hf, repeating_prompts(), params)
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    assert token_ids(outs) == token_ids(run_without_drafts(looping_hf, repeating_prompts(), greedy))
    assert_drafts_accepted_and_rejected(engine)


def test_prompt_logprobs_requests_decode_without_drafts(looping_hf):
    params = SamplingParams(max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    ref = run_without_drafts(looping_hf, repeating_prompts(), params)
    outs, engine = run_with_drafts(looping_hf, repeating_prompts(), params)
    assert token_ids(outs) == token_ids(ref)
    assert engine.spec.stats.num_drafts == 0


# each control, with values that change the looping model's greedy outputs (its loops repeat 105, 5, 82 165 235...)
CONTROLS = {
    "presence_penalty": dict(presence_penalty=0.1),  # penalties break the loops: small ones leave drafts accepted
    "frequency_penalty": dict(frequency_penalty=0.05),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "logit_bias": dict(logit_bias={5: -100.0, 105: -2.0, 235: 0.5}),
    "allowed_token_ids": dict(allowed_token_ids=sorted({t for p in repeating_prompts() for t in p} - {105})),
    "bad_words_single": dict(bad_words_token_ids=((105,), (5,))),
    "bad_words_multi": dict(bad_words_token_ids=((82, 165), (250, 5, 250), (17, 122, 17))),
    "min_tokens": dict(min_tokens=20, stop_token_ids=(105, 5, 37)),
}


def _controlled(name: str, max_tokens: int = 40, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **CONTROLS[name], **extra)


@pytest.mark.parametrize("name", list(CONTROLS))
def test_greedy_with_logits_controls_equals_without_drafts(looping_hf, name):
    """Each control is applied to every draft row as the one-token path applies it at that position."""
    params = _controlled(name)
    ref = run_without_drafts(looping_hf, repeating_prompts(), params)
    outs, engine = run_with_drafts(looping_hf, repeating_prompts(), params)
    assert token_ids(outs) == token_ids(ref)
    assert token_ids(ref) != token_ids(run_without_drafts(looping_hf, repeating_prompts(), GREEDY))  # it acts
    assert_drafts_accepted_and_rejected(engine)


@pytest.mark.parametrize("name", ["frequency_penalty", "repetition_penalty", "bad_words_multi", "min_tokens"])
def test_random_rows_of_one_token_with_controls_equal_greedy(looping_hf, name):
    """top_k=1 after the controls leaves one token: the rejection rule then follows the controlled argmax chain."""
    params = _controlled(name, temperature=0.8, top_k=1)
    outs, engine = run_with_drafts(looping_hf, repeating_prompts(), params)
    assert token_ids(outs) == token_ids(run_without_drafts(looping_hf, repeating_prompts(), _controlled(name)))
    assert_drafts_accepted_and_rejected(engine)


@pytest.mark.parametrize("name", ["presence_penalty", "repetition_penalty", "bad_words_multi", "min_tokens"])
def test_logits_controls_with_parallel_samples_and_preemption(looping_hf, name):
    params = _controlled(name, max_tokens=30, n=2)
    kwargs = dict(num_blocks=36, max_num_batched_tokens=32, max_num_seqs=8)
    ref = run_without_drafts(looping_hf, repeating_prompts(), params, **kwargs)
    outs, engine = run_with_drafts(looping_hf, repeating_prompts(), params, **kwargs)
    assert token_ids(outs) == token_ids(ref)
    assert engine.scheduler.num_preemptions["recompute"] >= 1
    assert_drafts_accepted_and_rejected(engine)


def test_min_tokens_drafts_before_it_is_reached(looping_hf):
    """Draft rows before ``min_tokens`` outputs mask the stop tokens: drafts run from the first output on."""
    params = _controlled("min_tokens")
    drafted_at = []  # outputs of each drafting sequence when its drafts were scheduled
    engine = make_engine(looping_hf, speculative=SPEC)
    after_each_schedule(engine, lambda out: drafted_at.extend(s.seq.num_outputs for s in out.scheduled if s.drafts))
    outs = engine.generate(repeating_prompts(), params, use_tqdm=False)
    assert token_ids(outs) == token_ids(run_without_drafts(looping_hf, repeating_prompts(), params))
    assert any(n < params.min_tokens for n in drafted_at)
    stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert stopped and all(len(o.token_ids) >= params.min_tokens for o in stopped)


def test_a_selection_hook_step_runs_no_drafts(looping_hf):
    from scheduler.core.scheduler_output import SampledToken

    engine = make_engine(looping_hf, speculative=SPEC)
    engine.add_request("r", repeating_prompts()[0], GREEDY)

    def first_token(out, logits):
        assert not out.num_draft_tokens
        return [SampledToken(g, s, int(logits[row].argmax()), 0.0) for g, s, row in out.samples]

    for _ in range(12):
        engine.step(first_token)
    assert engine.spec.stats.num_drafts == 0
    engine.abort("r")


@pytest.mark.parametrize("seed", range(6))
def test_random_configs_greedy_with_drafts_equals_without(looping_hf, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(8) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 4))]
    spec = SpeculativeConfig(num_speculative_tokens=rng.randint(1, 6), prompt_lookup_min=1,
                             prompt_lookup_max=rng.randint(1, 4))  # fmt: skip
    kwargs = dict(num_blocks=rng.choice([24, 256]), max_num_batched_tokens=rng.choice([8, 16, 64]),
                  block_size=rng.choice([1, 4, 16]), max_num_seqs=4)  # fmt: skip
    kwargs["num_blocks"] = max(kwargs["num_blocks"], 2 * -(-64 // kwargs["block_size"]))
    params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True)
    ref = run_without_drafts(looping_hf, prompts, params, **kwargs)
    outs, _ = run_with_drafts(looping_hf, prompts, params, speculative=spec, **kwargs)
    assert token_ids(outs) == token_ids(ref)

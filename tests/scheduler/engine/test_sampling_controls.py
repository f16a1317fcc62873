"""Logits controls through the engine: each changes greedy outputs as it must, equals transformers where it has a
twin, and leaves parallel samples, beam search and preemption as they were."""

from __future__ import annotations

import pytest
import torch
from sched_helpers import NUM_NEW, make_engine, tiny_llama

from paged_kv.errors import InvalidArgumentError, OutOfRangeError
from scheduler import BeamSearch, BeamSearchParams, SamplingParams


def _gen(engine, prompts, **kw) -> list[list[int]]:
    """Output tokens of every prompt, greedy unless told, NUM_NEW tokens each unless told."""
    kw = {"max_tokens": NUM_NEW, "ignore_eos": True} | kw
    return [o.outputs[0].token_ids for o in engine.generate(prompts, SamplingParams(**kw), use_tqdm=False)]


def _next_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' logits for the token after ``ids``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]


def test_a_large_negative_bias_removes_the_greedy_token(tiny_hf, prompts, hf_greedy):
    engine = make_engine(tiny_hf)
    first = hf_greedy[2][0]
    out = _gen(engine, [prompts[2]], logit_bias={first: -100.0})[0]
    assert first not in out
    assert out[0] == int(_next_logits(tiny_hf, prompts[2]).topk(2).indices[1])
    assert _gen(engine, [prompts[2]], logit_bias={first: 100.0 - 1e-3})[0] == [first] * NUM_NEW  # and a large one


def test_allowed_token_ids_confine_every_token(tiny_hf, prompts):
    allowed = [3, 17, 42, 99, 200]
    outs = _gen(make_engine(tiny_hf), prompts[:4], allowed_token_ids=allowed, temperature=1.0, seed=0)
    assert all(t in allowed for out in outs for t in out)
    greedy = _gen(make_engine(tiny_hf), [prompts[0]], allowed_token_ids=allowed)[0]
    assert greedy[0] == allowed[int(_next_logits(tiny_hf, prompts[0])[allowed].argmax())]


def test_min_tokens_delays_eos_and_stop_tokens(prompts, hf_greedy):
    eos = hf_greedy[0][0]  # the greedy first token of prompt 0 is this model's EOS
    engine = make_engine(tiny_llama(seed=0, eos_token_id=eos))
    plain = engine.generate([prompts[0]], SamplingParams(max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == [eos] and plain.finish_reason == "stop"
    delayed = engine.generate([prompts[0]], SamplingParams(max_tokens=8, min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(delayed.token_ids) >= 4 and eos not in delayed.token_ids[:4]
    stop = hf_greedy[1][0]  # a stop token is held back alike
    held = _gen(engine, [prompts[1]], max_tokens=6, min_tokens=3, stop_token_ids=[stop], ignore_eos=False)[0]
    assert len(held) >= 3 and stop not in held[:3]


def test_repetition_penalty_equals_transformers_generate(tiny_hf, prompts, hf_greedy):
    engine = make_engine(tiny_hf, max_num_batched_tokens=32, max_num_seqs=8)  # chunked prompts, mixed batches
    picked = [prompts[i] for i in (0, 1, 2, 3, 6)]
    penalties = (1.5, 1.0, 0.7, 1.3, 2.0)
    params = [SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, repetition_penalty=r) for r in penalties]
    outs = engine.generate(picked, params, use_tqdm=False)
    for prompt, p, out in zip(picked, params, outs):
        ids = torch.tensor([prompt])
        ref = tiny_hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
            pad_token_id=0, repetition_penalty=p.repetition_penalty,
        )  # fmt: skip
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist(), p.repetition_penalty
    assert outs[1].outputs[0].token_ids == hf_greedy[1]  # the neutral request beside them is plain greedy


def test_presence_and_frequency_penalties_follow_their_formula(tiny_hf, prompts):
    engine = make_engine(tiny_hf)
    for prompt, (f, p) in zip(prompts[:3], [(1.5, 0.0), (0.0, 2.0), (-0.5, 1.0)]):
        out = _gen(engine, [prompt], frequency_penalty=f, presence_penalty=p)[0]
        ids = list(prompt)
        for token in out:  # the reference: transformers' logits, OpenAI's penalties over the output so far
            logits, generated = _next_logits(tiny_hf, ids), ids[len(prompt) :]
            for t in set(generated):
                logits[t] -= f * generated.count(t) + p
            assert token == int(logits.argmax())
            ids.append(token)


def test_bad_words_block_the_last_token_of_a_word_after_its_prefix(tiny_hf, prompts, hf_greedy):
    engine = make_engine(tiny_hf)
    base = hf_greedy[3]
    word = (base[2], base[3])
    out = _gen(engine, [prompts[3]], bad_words_token_ids=[word])[0]
    assert out[:3] == base[:3] and out[3] != base[3]
    assert all(out[i : i + 2] != list(word) for i in range(len(out) - 1))
    single = _gen(engine, [prompts[3]], bad_words_token_ids=[(base[0],), (base[1],)])[0]
    assert base[0] not in single and base[1] not in single


def _prompt_logprobs_reference(hf, prompt: list[int], k: int) -> list[dict[int, float] | None]:
    """transformers' log-softmax over the prompt: entry i scores prompt token i, with the top k."""
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    out: list[dict[int, float] | None] = [None]
    for i in range(1, len(prompt)):
        top = logp[i - 1].topk(k) if k else None
        out.append({prompt[i]: float(logp[i - 1, prompt[i]])} | ({} if top is None else dict(
            zip(top.indices.tolist(), top.values.tolist()))))  # fmt: skip
    return out


def _assert_scored_like(got, want):
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert list(g) == list(w)  # the prompt token first, then the top ones in order
        assert list(g.values()) == pytest.approx(list(w.values()), abs=1e-4)


PROMPT_LOGPROB_CASES = {
    "whole prompt": dict(),
    "chunked prefill": dict(max_num_batched_tokens=8, max_num_seqs=4),
    "prefix-cache hit of another request": dict(),
}


@pytest.mark.parametrize("case", list(PROMPT_LOGPROB_CASES))
def test_prompt_logprobs_equal_transformers_log_softmax(case, tiny_hf, prompts):
    engine = make_engine(tiny_hf, **PROMPT_LOGPROB_CASES[case])
    picked = [prompts[1], prompts[3], prompts[4], prompts[6]]  # two share 40 tokens; one has a single token
    if case.startswith("prefix"):
        _gen(engine, picked, max_tokens=2)  # caches every prompt's blocks
        assert engine.block_manager.num_cached_tokens(prompts[6]) == 60
    starts, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: (out := schedule(), starts.extend(s.start for s in out.scheduled))[0]
    params = [SamplingParams(max_tokens=3, prompt_logprobs=k) for k in (0, 2, 1, 3)]
    outs = engine.generate(picked, params, use_tqdm=False)
    for prompt, p, out in zip(picked, params, outs):
        _assert_scored_like(out.prompt_logprobs, _prompt_logprobs_reference(tiny_hf, prompt, p.prompt_logprobs))
    assert starts.count(0) == len(picked)  # every prompt ran from its first token: no cached block was read
    assert all(o.prompt_logprobs is None for o in engine.generate(picked[:1], SamplingParams(), use_tqdm=False))


def test_prompt_logprobs_survive_preemption_in_the_middle_of_a_prompt(tiny_hf, prompts):
    engine = make_engine(tiny_hf, num_blocks=20, max_num_batched_tokens=8, max_num_seqs=4)
    engine.add_request("decoder", prompts[2], SamplingParams(max_tokens=40, ignore_eos=True))
    long = engine.add_request("long", prompts[6], SamplingParams(max_tokens=4, prompt_logprobs=1))  # admitted last
    done, requeued_owing = {}, 0
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step()}
        requeued_owing += long in engine.scheduler.waiting and 1 < len(long.prompt_logprobs) < len(prompts[6])
    assert requeued_owing  # preempted for recompute with part of its prompt scored
    _assert_scored_like(done["long"].prompt_logprobs, _prompt_logprobs_reference(tiny_hf, prompts[6], 1))


def test_prompt_and_sampled_tokens_carry_their_rank_in_the_vocabulary(tiny_hf, prompts):
    """Every prompt token's and every sampled token's rank under the model's raw logits, as vLLM counts it (the
    tokens with a logit at least its own), past the top ones asked for too (they used to have none)."""
    engine = make_engine(tiny_hf)
    params = SamplingParams(max_tokens=6, temperature=1.5, seed=4, n=2, prompt_logprobs=1, ignore_eos=True)
    (out,) = engine.generate([prompts[2]], params, use_tqdm=False)
    prompt = prompts[2]
    with torch.no_grad():
        logits = tiny_hf(torch.tensor([prompt])).logits[0].float()  # [P, V]
    want = [None] + [int((logits[i - 1] >= logits[i - 1, prompt[i]]).sum()) for i in range(1, len(prompt))]
    assert out.prompt_ranks == want and max(want[1:]) > 2  # most prompt tokens are far from the top two
    for sample in out.outputs:
        ids = prompt + sample.token_ids
        with torch.no_grad():
            logits = tiny_hf(torch.tensor([ids])).logits[0].float()
        rows = range(len(prompt) - 1, len(ids) - 1)
        assert sample.ranks == [int((logits[i] >= logits[i, ids[i + 1]]).sum()) for i in rows]
    assert max(r for s in out.outputs for r in s.ranks) > 1  # sampled, not greedy


def test_parallel_samples_each_keep_their_own_penalty_counts(tiny_hf, prompts):
    penalties = dict(repetition_penalty=1.4, frequency_penalty=0.8, presence_penalty=0.5, temperature=1.0)
    engine = make_engine(tiny_hf)
    together = engine.generate([prompts[2]], SamplingParams(max_tokens=10, n=3, seed=11, **penalties), use_tqdm=False)
    for sample in together[0].outputs:  # sample i draws from the seed the engine derives for it: alone, the same
        seed = 11 if sample.index == 0 else hash((11, sample.index)) & ((1 << 63) - 1)
        alone = _gen(make_engine(tiny_hf), [prompts[2]], max_tokens=10, seed=seed, **penalties)[0]
        assert sample.token_ids == alone


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_leaves_penalized_outputs_unchanged(tiny_hf, prompts, mode):
    controls = [dict(repetition_penalty=1.3), dict(frequency_penalty=1.0, logit_bias={5: 3.0}),
                dict(presence_penalty=1.5, min_tokens=4), dict(temperature=1.0, seed=3, repetition_penalty=0.8)]
    params = [SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, **c) for c in controls * 2]
    picked = (prompts[:4] * 2)[: len(params)]
    roomy = make_engine(tiny_hf).generate(picked, params, use_tqdm=False)
    small = make_engine(tiny_hf, num_blocks=20, num_cpu_blocks=64, preemption_mode=mode, max_num_batched_tokens=32,
                        max_num_seqs=8)  # fmt: skip
    tight = small.generate(picked, params, use_tqdm=False)
    assert small.scheduler.num_preemptions[mode] >= 2
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


def test_beam_search_is_unaffected_by_penalized_requests(tiny_hf, beam_prompts):
    params = BeamSearchParams(width=3, max_tokens=6)
    before = BeamSearch(make_engine(tiny_hf)).generate(beam_prompts[1:3], params, use_tqdm=False)
    engine = make_engine(tiny_hf)
    _gen(engine, beam_prompts, repetition_penalty=1.5, frequency_penalty=1.0)
    after = BeamSearch(engine).generate(beam_prompts[1:3], params, use_tqdm=False)
    assert [[h.token_ids for h in r.hypotheses] for r in after] == [[h.token_ids for h in r.hypotheses] for r in before]


def test_negative_seeds_and_the_largest_top_k_sample_reproducibly(tiny_hf, prompts):
    engine = make_engine(tiny_hf)
    runs = [_gen(engine, [prompts[1]], temperature=1.0, seed=s, top_k=k) for s, k in ((-7, 0), (-7, 2**31 - 1), (7, 0))]
    assert runs[0] == runs[1] != runs[2]
    assert _gen(engine, [prompts[1]], temperature=1.0, seed=-(1 << 63)) == _gen(
        make_engine(tiny_hf), [prompts[1]], temperature=1.0, seed=-(1 << 63))  # fmt: skip


BAD_IDS = {
    "logit bias past the vocabulary": (dict(logit_bias={256: 1.0}), OutOfRangeError, "logit_bias"),
    "allowed id past the vocabulary": (dict(allowed_token_ids=[1, 300]), OutOfRangeError, "allowed_token_ids"),
    "bad word id past the vocabulary": (dict(bad_words_token_ids=[(1, 256)]), OutOfRangeError, "bad_words_token_ids"),
    "bad words with no tokenizer": (dict(bad_words=["hello"]), InvalidArgumentError, "bad_words"),
}


@pytest.mark.parametrize("case", list(BAD_IDS))
def test_control_ids_are_checked_against_the_vocabulary(tiny_hf, case):
    kwargs, error, name = BAD_IDS[case]
    engine = make_engine(tiny_hf)
    with pytest.raises(error, match=name):
        engine.add_request("x", [1, 2], SamplingParams(**kwargs))
    assert not engine.scheduler.requests and not engine.has_unfinished_requests()

"""A step with drafts reads its results back in one device->host transfer: the sampled rows' tokens (logprobs,
ranks, top logprobs), the prompt rows' logprobs and the verification's verdicts together; nothing changes."""

from __future__ import annotations

import pytest
import torch
from sched_helpers import make_engine
from spec_helpers import SPEC, repeating_prompts

from scheduler import SamplingParams
from scheduler.engine.spec_decode import SpecDecode

HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__")  # every way a tensor syncs


def mixed_requests() -> list[tuple[list[int], SamplingParams]]:
    """Drafting requests (greedy with logprobs, penalized, seeded n = 2, bad words) beside requests that sample
    one token per step with prompt logprobs (served without drafts) in the same steps."""
    prompts = repeating_prompts()
    drafting = [
        SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.05, logprobs=1),
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, top_p=0.9, seed=11, n=2, logprobs=2),
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.05, top_k=3, seed=5, presence_penalty=0.1),
        SamplingParams(max_tokens=24, ignore_eos=True, bad_words_token_ids=((82, 165),), logprobs=2),
    ]
    plain = [SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=2, logprobs=2, temperature=0.9, seed=3,
                            repetition_penalty=1.1)] * 2  # fmt: skip
    return list(zip(prompts, drafting)) + list(zip(prompts[:2], plain))


def outputs(engine) -> list:
    """Every sample's tokens, logprobs, top logprobs and ranks, and each request's prompt logprobs."""
    requests = mixed_requests()
    outs = engine.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [(o.prompt_logprobs, [(c.token_ids, c.logprobs, c.top_logprobs, c.ranks) for c in o.outputs])
            for o in outs]  # fmt: skip


def count_host_reads(engine, monkeypatch) -> list[tuple[int, int, int]]:
    """Patch the tensor's host reads (a read inside another counts once); returns the (growing) list of (draft
    tokens, other sampled rows, host reads) of each step's choosing of its tokens."""
    calls, inside, steps, real_choose = [0], [False], [], engine._choose
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):
            if inside[0]:
                return _real(self, *args, **kwargs)
            calls[0], inside[0] = calls[0] + 1, True
            try:
                return _real(self, *args, **kwargs)
            finally:
                inside[0] = False

        monkeypatch.setattr(torch.Tensor, name, counted)

    def choose(out, logits, failures):
        before = calls[0]
        tokens = real_choose(out, logits, failures)
        steps.append((out.num_draft_tokens, len(out.samples) - len(out.draft_rows), calls[0] - before))
        return tokens

    monkeypatch.setattr(engine, "_choose", choose)
    return steps


def test_a_step_with_drafts_and_sampled_rows_reads_back_once(looping_hf, monkeypatch):
    engine = make_engine(looping_hf, speculative=SPEC)
    steps = count_host_reads(engine, monkeypatch)
    outputs(engine)
    both = [s for s in steps if s[0] and s[1]]
    assert both and engine.spec.stats.num_accepted_tokens > 0  # steps with drafts beside sampled rows ran
    assert all(reads == 1 for _, _, reads in steps), steps


def test_one_transfer_changes_no_output(looping_hf, monkeypatch):
    """The same run with sampling and verification fetched apart (two transfers, as before): every token, logprob,
    top logprob, rank and prompt logprob is the same, penalties and seeds included."""
    one = outputs(make_engine(looping_hf, speculative=SPEC))

    def apart(self, out, logits, rows, entries, sampling, sampling_failed, verify_failed):
        sampled = sampling.sample_each(out, logits, rows, sampling_failed)
        return sampled + self.verify(out, logits, entries, sampling, verify_failed)

    monkeypatch.setattr(SpecDecode, "sample_and_verify", apart)
    engine = make_engine(looping_hf, speculative=SPEC)
    assert outputs(engine) == one
    assert engine.spec.stats.num_accepted_tokens > 0


def test_requests_without_drafts_get_the_tokens_they_get_with_speculation_off(looping_hf):
    """The plain (prompt-logprobs) requests sampled in the steps with drafts equal a run without speculation."""
    with_drafts = outputs(make_engine(looping_hf, speculative=SPEC))
    without = outputs(make_engine(looping_hf))
    assert with_drafts[-2:] == without[-2:]
    greedy = [i for i, (_, s) in enumerate(mixed_requests()) if s.temperature == 0.0 and s.seed is None]
    assert [with_drafts[i][1][0][0] for i in greedy] == [without[i][1][0][0] for i in greedy]
    for i in greedy:
        assert with_drafts[i][1][0][1] == pytest.approx(without[i][1][0][1], abs=1e-4)

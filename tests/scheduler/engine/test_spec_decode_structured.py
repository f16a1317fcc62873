"""Speculative decoding for requests with structured outputs: drafts the grammar refuses are trimmed before the step,
each verification row is masked with the grammar after the drafts before it, and the matcher ends in the state it has
when fed the output one token at a time. Greedy outputs equal those without drafts, token for token."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from sched_helpers import after_each_schedule, assert_all_freed
from spec_helpers import SPEC, assert_drafts_accepted_and_rejected, token_ids
from structured_helpers import SPECS, check_output, structured_engine, texts_of

from scheduler import SamplingParams
from scheduler.core.sequence import Sequence
from scheduler.core.structured_params import StructuredOutputsParams

KINDS = ["json", "regex", "choice", "grammar"]
# text in each language: prompts that repeat it make the n-gram proposer draft what the grammar lets the model write
EXAMPLES = {"json": '{"name":"ab","age":7,"ok":true,"colour":"red"}', "regex": "abc-12", "choice": "green",
            "grammar": "(1+22+3)"}  # fmt: skip
PREEMPTING = {
    "recompute": dict(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=8),
    "swap": dict(num_blocks=64, num_cpu_blocks=128, preemption_mode="swap", max_num_batched_tokens=32, max_num_seqs=8),
}


@pytest.fixture(scope="module")
def tok():
    """The tiny tokenizer of the structured engines."""
    return structured_engine()[1]


def repeating(tok, kind: str) -> list[list[int]]:
    """Prompts that repeat text of ``kind``'s language."""
    text = EXAMPLES[kind]
    return [tok.encode((text + " ") * 3), tok.encode("x " + text + " " + text), tok.encode(text + "\n" + text)]


def greedy(spec: StructuredOutputsParams, **kw) -> SamplingParams:
    """Greedy sampling constrained by ``spec``."""
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 80), structured_outputs=spec, **kw)


def grammar_start(spec: StructuredOutputsParams, seq: Sequence) -> int | None:
    """The output index the grammar holds from (None: its marker is not written yet)."""
    marker = spec.waits(seq.token_ids[: seq.prompt_len])
    if marker is None:
        return 0
    out = seq.output_token_ids
    return next((i for i in range(len(marker), len(out) + 1) if tuple(out[i - len(marker) : i]) == marker), None)


def assert_matchers_follow_outputs(engine) -> None:
    """Every live constrained sequence's matcher is in the state of a fresh one fed its output token by token."""
    vocab = engine.structured.vocab_size
    for group in engine.scheduler.requests.values():
        spec = group.params.structured_outputs
        for seq in group.seqs:
            if spec is None or seq.matcher is None or seq.is_finished:
                continue
            fresh = xgr.GrammarMatcher(engine.structured.grammar(spec))
            start = grammar_start(spec, seq)
            fed = seq.output_token_ids[start:] if start is not None else []
            assert all(fresh.accept_token(t) for t in fed)
            masks = xgr.allocate_token_bitmask(2, vocab)
            seq.matcher.fill_next_token_bitmask(masks, 0)
            fresh.fill_next_token_bitmask(masks, 1)
            assert torch.equal(masks[0], masks[1]) and seq.matcher.is_terminated() == fresh.is_terminated()


def checked(engine):
    """``engine`` with the matcher invariant asserted after every step; returns it."""
    step = engine.step

    def checked_step(*args, **kwargs):
        finished = step(*args, **kwargs)
        assert_matchers_follow_outputs(engine)
        return finished

    engine.step = checked_step
    return engine


def count_trims(monkeypatch) -> list[int]:
    """Patch ``Sequence.grammar_walk`` to note every draft it refuses; returns the (growing) list of their counts."""
    trims, walk = [], Sequence.grammar_walk

    def noted(seq, drafts, visit=None):
        allowed = walk(seq, drafts, visit)
        if allowed < len(drafts):
            trims.append(len(drafts) - allowed)
        return allowed

    monkeypatch.setattr(Sequence, "grammar_walk", noted)
    return trims


class Oracle:
    """A proposer that drafts the known continuation of each token stream (a reference run's outputs), the draft
    at ``wrong`` of each proposal replaced by ``other`` (a draft to reject or to trim); after the reference ends,
    ``tail`` follows it."""

    def __init__(self, runs: list[list[int]], *, wrong: int = 2, other: int = 5, tail: tuple[int, ...] = ()) -> None:
        self.runs, self.wrong, self.other, self.tail = [r + list(tail) for r in runs], wrong, other, tail

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to ``k`` (4) tokens of the run ``token_ids`` starts, one of them wrong."""
        k = 4 if k is None else min(k, 4)
        run = next((r for r in self.runs if r[: len(token_ids)] == list(token_ids)), [])
        drafts = run[len(token_ids) : len(token_ids) + k]
        if len(drafts) > self.wrong:
            drafts[self.wrong] = self.other
        return drafts


def test_only_prompt_logprobs_and_callers_forks_keep_constrained_requests_off_drafts():
    from scheduler.engine.spec_decode import SpecDecode

    assert SpecDecode.serves(greedy(SPECS["json"]))
    assert not SpecDecode.serves(greedy(SPECS["json"], prompt_logprobs=1))
    assert not SpecDecode.serves(greedy(SPECS["json"]), fork_samples=False)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_with_drafts_equals_without(tok, kind, monkeypatch):
    """n-gram drafts from prompts in the grammar's language: some accepted, some rejected, some trimmed; the tokens
    and logprobs are those without drafts, every output in the language, no request fails."""
    prompts = repeating(tok, kind)
    params = greedy(SPECS[kind], logprobs=2)
    reference = structured_engine()[0].generate(prompts, params, use_tqdm=False)
    trims = count_trims(monkeypatch)
    engine = checked(structured_engine(speculative=SPEC)[0])
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == token_ids(reference)
    logprobs = [[lp for o in run for lp in o.outputs[0].logprobs] for run in (outs, reference)]
    assert logprobs[0] == pytest.approx(logprobs[1], abs=1e-5)
    assert_drafts_accepted_and_rejected(engine)
    assert all(o.error is None and o.outputs[0].finish_reason == "stop" for o in outs)  # no token was refused
    for texts in texts_of(outs, tok):
        check_output(SPECS[kind], texts[0])
    if kind != "choice":  # the proposer drafted what the grammar refuses: trimmed before the step
        assert trims
    assert_all_freed(engine)


def test_a_refused_draft_and_those_after_it_never_run(tok):
    """The scheduler keeps the drafts up to the first the grammar refuses (vLLM trims them alike)."""
    prompts = repeating(tok, "regex")
    reference = structured_engine()[0].generate(prompts, greedy(SPECS["regex"]), use_tqdm=False)
    engine = checked(structured_engine(speculative=SPEC)[0])
    runs = [p + o.outputs[0].token_ids for p, o in zip(prompts, reference)]
    refused = tok.encode("{")[0]  # never in the regex's language
    engine.scheduler.proposer = Oracle(runs, wrong=1, other=refused)
    drafted = []
    after_each_schedule(engine, lambda out: drafted.extend(s.drafts for s in out.scheduled if s.drafts))
    outs = engine.generate(prompts, greedy(SPECS["regex"]), use_tqdm=False)
    assert token_ids(outs) == token_ids(reference)
    assert drafted and all(len(d) == 1 and refused not in d for d in drafted)  # the second draft was the refused one
    assert engine.spec.stats.num_accepted_tokens == engine.spec.stats.num_draft_tokens  # the oracle's first is right


@pytest.mark.parametrize("kind", KINDS)
def test_the_marker_of_start_after_among_the_drafts(tok, kind, monkeypatch):
    """A grammar that starts after a marker: drafts write the marker and go on in the grammar's language in the same
    step; the rows after the marker are masked, those before it free; the outputs equal those without drafts."""
    prompts = [tok.encode(t) for t in ("hello world", "the quick brown fox", "numbers: 1 2 3")]
    free = structured_engine()[0].generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                           use_tqdm=False)  # fmt: skip
    marker = [tuple(o.outputs[0].token_ids[2:4]) for o in free]  # written from the 3rd output token on
    spec = SPECS[kind]
    specs = [StructuredOutputsParams(**{kind: getattr(spec, kind)}, start_after=m,
                                     disable_any_whitespace=spec.disable_any_whitespace) for m in marker]  # fmt: skip
    params = [greedy(s, max_tokens=160) for s in specs]
    reference = structured_engine()[0].generate(prompts, params, use_tqdm=False)
    engine = checked(structured_engine(speculative=SPEC)[0])
    runs = [p + o.outputs[0].token_ids for p, o in zip(prompts, reference)]
    engine.scheduler.proposer = Oracle(runs, wrong=3, other=runs[0][-2])
    crossing = []

    def record(out):
        for s in out.scheduled:
            m = s.seq.grammar_after
            if s.drafts and m is not None:  # the marker ends at a draft: masked rows follow in the same query
                tail = [*s.seq.token_ids[-len(m) :], *s.drafts]
                crossing.extend(j for j in range(len(s.drafts)) if tuple(tail[j + 1 : j + 1 + len(m)]) == m)

    after_each_schedule(engine, record)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == token_ids(reference)
    assert crossing and engine.spec.stats.num_accepted_tokens > 0
    for o, m in zip(outs, marker):
        tokens = o.outputs[0].token_ids
        assert o.outputs[0].finish_reason == "stop" and tuple(tokens[2:4]) == m
        check_output(SPECS[kind], tok.decode(tokens[4:], skip_special_tokens=True))


def test_eos_among_the_drafts_ends_the_sample_there(tok):
    """Drafts that finish the grammar with its stop token: EOS is kept and ends the sample; the drafts after it are
    trimmed (a terminated grammar allows nothing more)."""
    prompts = repeating(tok, "choice")
    params = greedy(SPECS["choice"], ignore_eos=True)  # the grammar's end still stops it
    reference = structured_engine()[0].generate(prompts, params, use_tqdm=False)
    engine = checked(structured_engine(speculative=SPEC)[0])
    runs = [p + o.outputs[0].token_ids for p, o in zip(prompts, reference)]
    engine.scheduler.proposer = Oracle(runs, wrong=8, tail=(40, 41, 42))  # nothing wrong; tokens after the EOS
    eos, drafted = tok.eos_token_id, []
    after_each_schedule(engine, lambda out: drafted.extend(s.drafts for s in out.scheduled if s.drafts))
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == token_ids(reference)
    assert any(d[-1] == eos for d in drafted) and not any(40 in d for d in drafted)
    assert all(o.outputs[0].token_ids[-1] == eos and o.outputs[0].finish_reason == "stop" for o in outs)


@pytest.mark.parametrize("kind", ["json", "regex", "grammar"])
def test_seeded_parallel_samples_draft_each_on_its_own_grammar(tok, kind):
    """n > 1, seeded: each fork drafts with its own matcher; every sample is in the language and the run repeats."""
    prompts = repeating(tok, kind)[:2]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, n=3, max_tokens=80, structured_outputs=SPECS[kind])
    runs = []
    for _ in range(2):
        engine = checked(structured_engine(speculative=SPEC)[0])
        runs.append(token_ids(engine.generate(prompts, params, use_tqdm=False)))
        assert engine.spec.stats.num_drafts > 0 and engine.spec.stats.num_accepted_tokens > 0
        assert_all_freed(engine)
    assert runs[0] == runs[1]
    for request in runs[0]:
        assert len(request) == 3 and len({tuple(t) for t in request}) > 1
        for tokens in request:
            assert tokens[-1] == tok.eos_token_id
            check_output(SPECS[kind], tok.decode(tokens, skip_special_tokens=True))


@pytest.mark.parametrize("mode", list(PREEMPTING))
def test_preemption_between_drafting_steps_changes_nothing(tok, mode):
    """Recompute and swap preempt sequences that drafted in earlier steps (their matchers were rolled back each time):
    the outputs equal a run without drafts or preemption."""
    prompts = [p for kind in KINDS for p in repeating(tok, kind)]
    params = [greedy(SPECS[kind], n=2 if kind == "regex" else 1, max_tokens=60) for kind in KINDS for _ in range(3)]
    reference = structured_engine()[0].generate(prompts, params, use_tqdm=False)
    engine = checked(structured_engine(speculative=SPEC, **PREEMPTING[mode])[0])
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.scheduler.num_preemptions[mode] >= 1 and engine.spec.stats.num_accepted_tokens > 0
    assert token_ids(outs) == token_ids(reference)
    assert_all_freed(engine)


def test_an_aborted_drafting_request_frees_everything(tok):
    engine = checked(structured_engine(speculative=SPEC)[0])
    engine.add_request("a", repeating(tok, "json")[0], greedy(SPECS["json"]))
    while engine.spec.stats.num_drafts == 0:
        engine.step()
    engine.abort("a")
    assert not engine.has_unfinished_requests()
    assert_all_freed(engine)


def test_grammar_walk_rolls_back_and_visits_each_position(tok):
    """The walk stops at the first refused draft, sees the matcher after each allowed prefix, and leaves it as it
    was; before a marker it visits nothing, and from the draft after it on, the grammar holds."""
    engine = structured_engine()[0]
    grammar = engine.structured.grammar(SPECS["regex"])
    a, b, dash, one, brace = (tok.encode(c)[0] for c in ("a", "b", "-", "1", "{"))
    seq = Sequence(0, 0, [1, 2, 3])
    seq.matcher = xgr.GrammarMatcher(grammar)
    seen = []
    assert seq.grammar_walk([a, b, dash, brace, one], lambda j, m: seen.append(j)) == 3
    assert seen == [0, 1, 2, 3]
    assert seq.matcher.accept_token(a) and not seq.matcher.accept_token(dash)  # back at the start: one letter
    waiting = Sequence(1, 0, [1, 2, 3])
    waiting.matcher, waiting.grammar_after = xgr.GrammarMatcher(grammar), (7, 8)
    seen.clear()
    assert waiting.grammar_walk([5, 7, 8, a, b, brace], lambda j, m: seen.append(j)) == 5
    assert seen == [3, 4, 5] and waiting.grammar_after == (7, 8)
    assert waiting.matcher.accept_token(a) and not waiting.matcher.accept_token(dash)

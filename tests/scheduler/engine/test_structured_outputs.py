"""Structured outputs through xgrammar on the engine: every output in its language, sampled, forked, preempted."""

from __future__ import annotations

import math

import pytest
import xgrammar as xgr
from structured_helpers import (
    SCHEMA,
    SPECS,
    TEXTS,
    TOKENIZER_VOCAB,
    check_output,
    structured_engine,
    texts_of,
)

from paged_kv.errors import InvalidArgumentError, SequenceStateError
from scheduler import SamplingParams
from scheduler.core.sequence import Sequence
from scheduler.core.structured_params import StructuredOutputsParams
from scheduler.engine.llm_engine import LLMEngine

SAMPLING = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=1.0, seed=5, top_p=0.95)}
PREEMPTING = {
    "recompute": dict(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=8),
    "swap": dict(num_blocks=64, num_cpu_blocks=128, preemption_mode="swap", max_num_batched_tokens=32, max_num_seqs=8),
}


@pytest.fixture(scope="module")
def tiny():
    """(engine, tokenizer, prompts): structured outputs enabled, model rows padded past the tokenizer's ids."""
    engine, tokenizer = structured_engine()
    return engine, tokenizer, [tokenizer.encode(t) for t in TEXTS]


def _params(spec, sampling="greedy", **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 96)
    return SamplingParams(structured_outputs=spec, **SAMPLING[sampling], **kw)


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("kind", list(SPECS))
def test_every_output_is_in_its_language(tiny, kind, sampling):
    engine, tokenizer, prompts = tiny
    if kind == "json_object":  # an unbounded language: on some prompts the random model never closes its object
        prompts = prompts[1:4]
    outs = engine.generate(prompts, _params(SPECS[kind], sampling), use_tqdm=False)
    for out, texts in zip(outs, texts_of(outs, tokenizer)):
        sample = out.outputs[0]
        assert sample.finish_reason == "stop" and sample.token_ids[-1] == tokenizer.eos_token_id
        assert max(sample.token_ids) < TOKENIZER_VOCAB  # the model's padded rows are never allowed
        check_output(SPECS[kind], texts[0])


def test_constrained_and_free_requests_share_a_batch(tiny):
    """Only the constrained rows are masked: free requests in the same steps generate what they do alone."""
    engine, tokenizer, prompts = tiny
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = engine.generate(prompts, free, use_tqdm=False)
    params = [free] * len(prompts) + [_params(SPECS["json"])] * len(prompts)
    mixed = engine.generate(prompts * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[: len(prompts)]] == [o.outputs[0].token_ids for o in alone]
    for texts in texts_of(mixed[len(prompts) :], tokenizer):
        check_output(SPECS["json"], texts[0])


def test_free_steps_never_touch_xgrammar(tiny, monkeypatch):
    """A step without a constrained sample fills no bitmask and launches no mask."""
    engine, _, prompts = tiny
    monkeypatch.setattr(engine.structured, "_filler", None)  # any use would raise
    outs = engine.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)


@pytest.mark.parametrize("kind", ["json", "regex", "grammar"])
def test_parallel_samples_each_follow_the_grammar(tiny, kind):
    """n > 1: every fork gets its own matcher at its first sample; seeded samples differ and all are valid."""
    engine, tokenizer, prompts = tiny
    outs = engine.generate(prompts[:2], _params(SPECS[kind], "seeded", n=4), use_tqdm=False)
    for out, texts in zip(outs, texts_of(outs, tokenizer)):
        assert len(texts) == 4 and len(set(texts)) > 1
        for text in texts:
            check_output(SPECS[kind], text)


@pytest.mark.parametrize("mode", list(PREEMPTING))
def test_preemption_keeps_outputs_valid_and_unchanged(tiny, mode):
    """Recompute and swap keep each sequence's matcher: the outputs equal a run without preemption."""
    _, tokenizer, prompts = tiny
    params = [_params(SPECS[k], s, n=2 if k == "regex" else 1, max_tokens=100) for k in ("json", "regex", "grammar")
              for s in SAMPLING] * 3  # fmt: skip
    batch = [prompts[i % len(prompts)] for i in range(len(params))]
    reference = structured_engine()[0].generate(batch, params, use_tqdm=False)
    engine = structured_engine(**PREEMPTING[mode])[0]
    outs = engine.generate(batch, params, use_tqdm=False)
    assert engine.scheduler.num_preemptions[mode] >= 1
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in reference]
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    for p, texts in zip(params, texts_of(outs, tokenizer)):
        for text in texts:
            check_output(p.structured_outputs, text)


def test_grammar_end_stops_the_sample_even_with_ignore_eos(tiny):
    engine, tokenizer, prompts = tiny
    (out,) = engine.generate(prompts[:1], _params(SPECS["choice"], ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids[-1] == tokenizer.eos_token_id


def test_logprobs_are_those_of_the_masked_distribution(tiny):
    """As in vLLM: logprobs of the masked logits; the allowed first tokens (prefixes of a choice) sum to one."""
    engine, tokenizer, prompts = tiny
    spec = StructuredOutputsParams(choice=("red", "green", "blue"))
    (out,) = engine.generate(prompts[:1], _params(spec, logprobs=64), use_tqdm=False)
    top, chosen = out.outputs[0].top_logprobs[0], out.outputs[0].logprobs[0]
    allowed = {t: v for t, v in top.items() if v > -math.inf}
    assert 3 <= len(allowed) < len(top)  # the forbidden tokens come back at -inf
    assert all(any(c.startswith(tokenizer.decode([t])) for c in spec.choice) for t in allowed)
    assert math.isclose(sum(math.exp(v) for v in allowed.values()), 1.0, rel_tol=1e-5)
    assert chosen == max(allowed.values())


def test_model_rows_fewer_than_the_tokenizers_ids():
    """A model with fewer rows than the tokenizer has ids: the bitmask covers the rows only."""
    engine, tokenizer = structured_engine(vocab_size=300)
    prompts = [list(range(start, start + 6)) for start in (40, 90, 200)]
    outs = engine.generate(prompts, _params(SPECS["json"]), use_tqdm=False)
    for texts in texts_of(outs, tokenizer):
        check_output(SPECS["json"], texts[0])


def test_compiles_once_per_constraint_in_a_bounded_lru():
    engine, tokenizer = structured_engine(cache_size=2)
    prompt, other = tokenizer.encode(TEXTS[0]), StructuredOutputsParams(json=SCHEMA)  # whitespace allowed: another
    engine.generate([prompt] * 3, _params(SPECS["json"]), use_tqdm=False)
    for i in range(3):
        same = StructuredOutputsParams(json=dict(SCHEMA), disable_any_whitespace=True)
        engine.add_request(f"r{i}", prompt, _params(same))
    assert engine.structured.num_compiled == 1  # equal schemas from other dicts too
    engine.check_request("a", prompt, _params(other))
    engine.check_request("b", prompt, _params(SPECS["regex"]))  # evicts the first schema (least recently used)
    engine.check_request("c", prompt, _params(SPECS["json"]))
    assert engine.structured.num_compiled == 4


INVALID = {
    "json": StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
    "regex": StructuredOutputsParams(regex="a(b"),
    "grammar": StructuredOutputsParams(grammar='root ::= "a" undefined_rule'),
}


@pytest.mark.parametrize("kind", list(INVALID))
def test_an_invalid_constraint_is_refused_at_add_request(tiny, kind):
    engine, tokenizer, prompts = tiny
    before = (len(engine.scheduler.requests), engine.structured.num_compiled)
    with pytest.raises(InvalidArgumentError, match=rf"structured_outputs\.{kind}="):
        engine.add_request("bad", prompts[0], _params(INVALID[kind]))
    assert not engine.has_unfinished_requests() and "bad" not in engine.scheduler.requests
    assert len(engine.scheduler.requests) == before[0]


def test_structured_outputs_need_a_tokenizer(tiny_hf):
    engine = LLMEngine.from_hf(tiny_hf)
    with pytest.raises(InvalidArgumentError, match="structured_outputs.*enable_structured_outputs"):
        engine.add_request("r", [1, 2], _params(SPECS["regex"]))
    assert not engine.has_unfinished_requests()


def test_beam_search_style_requests_are_refused(tiny):
    """A request whose caller forks and selects its own tokens (a beam search) would bypass the mask."""
    engine, _, prompts = tiny
    with pytest.raises(InvalidArgumentError, match="fork_samples"):
        engine.add_request("beams", prompts[0], _params(SPECS["regex"], n=2), fork_samples=False)
    assert not engine.has_unfinished_requests()


def test_a_selection_hook_is_refused_while_a_request_is_constrained(tiny):
    """A hook picks from unmasked logits: the engine refuses it, unchanged, while a constrained request is live."""
    engine, _, prompts = tiny
    engine.add_request("r", prompts[0], _params(SPECS["choice"]))
    with pytest.raises(InvalidArgumentError, match="select"):
        engine.step(lambda out, logits: [])
    assert engine.scheduler.requests["r"].seqs[0].num_computed == 0
    engine.abort("r")


def test_a_sequence_appends_only_what_its_grammar_allows(tiny):
    """append_token advances the matcher and refuses a forbidden token unchanged; a fork advances on its own."""
    engine, tokenizer, _ = tiny
    seq = Sequence(0, 0, [1, 2])
    seq.matcher = xgr.GrammarMatcher(engine.structured.grammar(SPECS["choice"]))
    (r,) = tokenizer.encode("r")[:1]
    with pytest.raises(SequenceStateError, match="token_id"):
        seq.append_token(tokenizer.encode("z")[0], 0.0)
    assert seq.output_token_ids == []
    seq.append_token(r, 0.0)
    child = seq.fork(1, 1)
    for token in tokenizer.encode("ed"):
        child.append_token(token, 0.0)
    child.append_token(tokenizer.eos_token_id, 0.0)
    assert child.matcher.is_terminated() and not seq.matcher.is_terminated()
    with pytest.raises(SequenceStateError):
        seq.append_token(tokenizer.eos_token_id, 0.0)  # "r" is no choice yet

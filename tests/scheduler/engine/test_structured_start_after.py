"""Structured outputs that start after a marker (``StructuredOutputsParams.start_after``), as vLLM starts its grammar
after a reasoning model's ``</think>``: free before the marker, in the grammar's language after it.

The tiny random model writes no ``</think>`` of its own: a marker is either taken from its own greedy output
(tokens it writes anyway) or forced at a chosen place by ``structured_helpers.force_tokens``.
"""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from sched_helpers import assert_all_freed
from structured_helpers import SPECS, TEXTS, check_output, force_tokens, scripted, structured_engine

from paged_kv.errors import OutOfRangeError
from scheduler import SamplingParams
from scheduler.core.sequence import Sequence
from scheduler.core.structured_params import StructuredOutputsParams

PREEMPTING = {
    "recompute": dict(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=8),
    "swap": dict(num_blocks=64, num_cpu_blocks=128, preemption_mode="swap", max_num_batched_tokens=32, max_num_seqs=8),
}
SEEDED = dict(temperature=1.0, seed=5, top_p=0.95)


@pytest.fixture(scope="module")
def tiny():
    """(engine, tokenizer, prompts, marker): structured outputs enabled; ``marker`` is ``</think>``'s 7 tokens."""
    engine, tokenizer = structured_engine()
    return engine, tokenizer, [tokenizer.encode(t) for t in TEXTS], tuple(tokenizer.encode("</think>"))


def after(spec: StructuredOutputsParams, marker) -> StructuredOutputsParams:
    """``spec`` starting after ``marker``."""
    return StructuredOutputsParams(**{spec.kind: getattr(spec, spec.kind)}, start_after=marker,
                                   disable_any_whitespace=spec.disable_any_whitespace)  # fmt: skip


def tail_text(tokenizer, token_ids: list[int]) -> str:
    """The text of output tokens, special tokens (the closing EOS) left out."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def own_markers(free: list[list[int]], length: int) -> list[tuple[int, tuple[int, ...]]]:
    """For each free greedy output: (p, marker), ``length`` tokens it writes first at ``p = 2 + its index``."""
    chosen = []
    for i, tokens in enumerate(free):
        p = 2 + i
        marker = tuple(tokens[p : p + length])
        assert all(tuple(tokens[j : j + length]) != marker for j in range(p)), "written earlier: pick another"
        chosen.append((p, marker))
    return chosen


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("kind", ["regex", "json", "choice", "grammar"])
def test_the_output_is_free_up_to_the_marker_and_in_the_language_after_it(tiny, kind, length):
    """Up to and including the marker the tokens are the model's unconstrained greedy ones; after it, the grammar's
    language, ending with EOS. One batch mixes samples still waiting and samples already constrained."""
    engine, tokenizer, prompts, _ = tiny
    prompts = prompts[:4]  # their free greedy outputs hold no EOS in their first 32 tokens
    free = [o.outputs[0].token_ids for o in engine.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)]  # fmt: skip
    markers = own_markers(free, length)
    params = [SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=after(SPECS[kind], m))
              for _, m in markers]  # fmt: skip
    outs = engine.generate(prompts, params, use_tqdm=False)
    for (p, marker), reference, out in zip(markers, free, outs):
        tokens, end = out.outputs[0].token_ids, p + length
        assert tokens[:end] == reference[:end] and tuple(tokens[p:end]) == marker
        assert out.outputs[0].finish_reason == "stop" and tokens[-1] == tokenizer.eos_token_id
        check_output(SPECS[kind], tail_text(tokenizer, tokens[end:]))


def test_a_prefix_cache_hit_changes_nothing(tiny):
    """A prompt found in the prefix cache (its samples start with computed tokens) waits and starts alike."""
    engine, tokenizer, prompts, _ = tiny
    prompt = [t for p in prompts for t in p]  # several full blocks
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    ((p, marker),) = own_markers([free], 2)
    params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=after(SPECS["regex"], marker))
    first, again = (engine.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert first.outputs[0].token_ids[: p + 2] == free[: p + 2]
    check_output(SPECS["regex"], tail_text(tokenizer, first.outputs[0].token_ids[p + 2 :]))


def test_the_same_language_compiles_once_wherever_it_starts(tiny):
    engine, _, prompts, marker = tiny
    engine.check_request("a", prompts[0], SamplingParams(structured_outputs=SPECS["regex"]))
    before = engine.structured.num_compiled
    for m in (marker, marker[:1], (5, 6)):
        engine.check_request("a", prompts[0], SamplingParams(structured_outputs=after(SPECS["regex"], m)))
    assert engine.structured.num_compiled == before
    assert after(SPECS["regex"], marker).language == SPECS["regex"] and after(SPECS["regex"], marker) != SPECS["regex"]


def test_parallel_samples_each_start_their_grammar_after_their_own_marker(tiny, monkeypatch):
    """n = 4, seeded: sample i writes 2 i free tokens (the seeded model's own), then the marker (forced), then its
    grammar's language; the samples are independent (each its own matcher, started at its own step)."""
    engine, tokenizer, prompts, marker = tiny
    reference = engine.generate(prompts[:1], SamplingParams(n=4, max_tokens=8, ignore_eos=True, **SEEDED),
                                use_tqdm=False)[0]  # fmt: skip
    force_tokens(engine, monkeypatch, scripted({i: [-1] * (2 * i) + list(marker) for i in range(4)}))
    spec = after(SPECS["regex"], marker)
    (out,) = engine.generate(prompts[:1], SamplingParams(n=4, max_tokens=64, structured_outputs=spec, **SEEDED),
                             use_tqdm=False)  # fmt: skip
    tails = []
    for i, (sample, free) in enumerate(zip(out.outputs, reference.outputs)):
        start = 2 * i + len(marker)
        assert sample.token_ids[: 2 * i] == free.token_ids[: 2 * i]  # free: the unconstrained seeded tokens
        assert tuple(sample.token_ids[2 * i : start]) == marker and sample.finish_reason == "stop"
        tails.append(tail_text(tokenizer, sample.token_ids[start:]))
        check_output(SPECS["regex"], tails[-1])
    assert len(set(tails)) > 1


@pytest.mark.parametrize("mode", list(PREEMPTING))
def test_preemption_keeps_the_waiting_and_the_started_grammars(mode, monkeypatch):
    """Recompute and swap keep each sequence's wait for its marker and its matcher: the outputs equal a run without
    preemption, every sample in its language after its marker."""
    reference_engine, tokenizer = structured_engine()
    engine = structured_engine(**PREEMPTING[mode])[0]
    marker = tuple(tokenizer.encode("</think>"))
    script = scripted({0: [-1] * 3 + list(marker), 1: [-1] * 9 + list(marker)})
    for e in (reference_engine, engine):
        force_tokens(e, monkeypatch, script)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = [SamplingParams(n=2, max_tokens=100, structured_outputs=after(SPECS[k], marker), **sampling)
              for k in ("json", "regex", "grammar") for sampling in (dict(temperature=0.0), SEEDED)] * 3  # fmt: skip
    batch = [prompts[i % len(prompts)] for i in range(len(params))]
    reference = reference_engine.generate(batch, params, use_tqdm=False)
    outs = engine.generate(batch, params, use_tqdm=False)
    assert engine.scheduler.num_preemptions[mode] >= 1
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in reference]
    for p, out in zip(params, outs):
        for sample, free in zip(out.outputs, (3, 9)):
            assert sample.finish_reason == "stop"
            check_output(SPECS[p.structured_outputs.kind], tail_text(tokenizer, sample.token_ids[free + len(marker) :]))
    assert_all_freed(engine)


def test_eos_before_the_marker_ends_the_sample_with_no_grammar_applied(tiny):
    """As vLLM: a sample that ends while waiting is all free (here its first token, a strongly favoured EOS, which
    the regex would forbid there); a prompt that ends with the marker starts the grammar at once."""
    engine, tokenizer, prompts, marker = tiny
    eos = tokenizer.eos_token_id
    favoured = dict(temperature=0.0, max_tokens=64, logit_bias={eos: 100.0})
    (waiting,) = engine.generate(prompts[:1], SamplingParams(structured_outputs=after(SPECS["regex"], marker),
                                                             **favoured), use_tqdm=False)  # fmt: skip
    assert waiting.outputs[0].token_ids == [eos] and waiting.outputs[0].finish_reason == "stop"
    (held,) = engine.generate(prompts[:1], SamplingParams(structured_outputs=SPECS["regex"], **favoured),
                              use_tqdm=False)  # fmt: skip
    assert held.outputs[0].token_ids[0] != eos  # from the first token, the grammar forbids the EOS
    ended = [prompts[0] + list(marker)]  # the thinking ended in the prompt: no wait
    (started,) = engine.generate(ended, SamplingParams(structured_outputs=after(SPECS["regex"], marker), **favoured),
                                 use_tqdm=False)  # fmt: skip
    (plain,) = engine.generate(ended, SamplingParams(structured_outputs=SPECS["regex"], **favoured), use_tqdm=False)
    assert started.outputs[0].token_ids == plain.outputs[0].token_ids
    check_output(SPECS["regex"], tail_text(tokenizer, started.outputs[0].token_ids))


def assert_unfed(engine, seq, spec) -> None:
    """``seq``'s matcher (made at its first sample, though its grammar waits) has accepted nothing yet."""
    fresh = xgr.GrammarMatcher(engine.structured.grammar(spec))
    masks = [xgr.allocate_token_bitmask(1, engine.structured.vocab_size) for _ in range(2)]
    seq.matcher.fill_next_token_bitmask(masks[0])
    fresh.fill_next_token_bitmask(masks[1])
    assert torch.equal(masks[0], masks[1]) and not seq.matcher.is_terminated()


def test_an_aborted_waiting_request_frees_its_blocks(tiny):
    engine, _, prompts, marker = tiny
    engine.add_request("w", prompts[0], SamplingParams(max_tokens=50, structured_outputs=after(SPECS["json"], marker)))
    for _ in range(4):
        engine.step()
    seq = engine.scheduler.requests["w"].seqs[0]
    assert seq.num_outputs >= 3 and seq.grammar_after == marker  # still waiting
    assert_unfed(engine, seq, SPECS["json"])
    engine.abort("w")
    assert not engine.has_unfinished_requests()
    assert_all_freed(engine)


def test_a_sequence_waits_for_its_marker_and_its_fork_with_it():
    """``grammar_after`` clears once the output ends with the marker, not before (a prefix of it, or the marker
    split by another token); a fork waits on its own."""
    seq = Sequence(0, 0, [7, 8])
    seq.grammar_after = (1, 2)
    for token in (1, 3, 2, 1):
        seq.append_token(token, 0.0)
        assert not seq.grammar_holds
    child = seq.fork(1, 1)
    seq.append_token(2, 0.0)
    assert seq.grammar_holds and seq.grammar_after is None
    assert child.grammar_after == (1, 2)
    child.append_token(5, 0.0)
    assert not child.grammar_holds


def test_a_start_after_past_the_model_rows_is_refused_unchanged(tiny):
    engine, _, prompts, _ = tiny
    before = (dict(engine.scheduler.requests), engine.structured.num_compiled)
    spec = StructuredOutputsParams(regex="a+", start_after=[5, engine.structured.vocab_size])
    with pytest.raises(OutOfRangeError, match=r"^structured_outputs\.start_after="):
        engine.add_request("bad", prompts[0], SamplingParams(structured_outputs=spec))
    assert (dict(engine.scheduler.requests), engine.structured.num_compiled) == before

"""LLM(speculative_config=...): text outputs with drafts equal those without, a stop string among accepted drafts
ends the sample at the token that completes it, and a structured-output request decodes without drafts."""

from __future__ import annotations

import pytest

from paged_kv.errors import InvalidArgumentError, PagedKVError
from scheduler.core.config import CacheConfig, EngineConfig
from scheduler.core.params import SamplingParams
from scheduler.core.speculative_config import SpeculativeConfig
from scheduler.core.structured_params import StructuredOutputsParams

ENGINE = EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=256), device="cpu")
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = ["the cat sat on the mat, the cat sat on the", "a b c a b c a b", "hello world"]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(looping_model_dir):
    from scheduler.entrypoints.llm import LLM

    return LLM(looping_model_dir, engine_config=ENGINE)


@pytest.fixture(scope="module")
def drafting(looping_model_dir):
    from scheduler.entrypoints.llm import LLM

    return LLM(looping_model_dir, engine_config=ENGINE, speculative_config=SPEC)


def _texts(outs):
    return [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def test_the_dict_becomes_the_engine_config_and_a_bad_one_is_refused(drafting, looping_model_dir):
    from scheduler.entrypoints.llm import LLM

    assert drafting.engine.config.speculative_config == SpeculativeConfig(**SPEC)
    assert drafting.engine.config.cache == ENGINE.cache  # the rest of engine_config kept
    with pytest.raises(PagedKVError, match="^num_speculative_tokens="):
        LLM(looping_model_dir, speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(InvalidArgumentError, match="^speculative_config="):
        LLM(looping_model_dir, speculative_config="ngram")  # type: ignore[arg-type]


def test_greedy_text_with_drafts_equals_without(plain, drafting):
    before = drafting.engine.spec.stats.copy()
    assert _texts(drafting.generate(PROMPTS, GREEDY)) == _texts(plain.generate(PROMPTS, GREEDY))
    stats = drafting.engine.spec.stats
    assert stats.num_accepted_tokens > before.num_accepted_tokens
    assert stats.num_draft_tokens - before.num_draft_tokens > stats.num_accepted_tokens - before.num_accepted_tokens


def _verifications(llm, prompt: str, params: SamplingParams) -> tuple[list[int], list[tuple[int, int]]]:
    """A run's output tokens, and (outputs before it, tokens emitted) of each verification of a run of one prompt."""
    spec, steps = llm.engine.spec, []
    verify = spec.sample_and_verify  # a step with drafts: the one prompt's sequence is verified, nothing sampled

    def recorded(*args, **kwargs):
        tokens = verify(*args, **kwargs)
        if tokens:
            steps.append((tokens[0].seq.num_outputs, len(tokens)))
        return tokens

    spec.sample_and_verify = recorded
    try:
        (out,) = llm.generate([prompt], params)
    finally:
        del spec.sample_and_verify
    return out.outputs[0].token_ids, steps


def test_a_stop_string_among_accepted_drafts_ends_the_sample_at_its_token(plain, drafting):
    prompt = PROMPTS[0]
    tokens, steps = _verifications(drafting, prompt, GREEDY)
    tok = drafting.tokenizer
    # a token that a verification emitted before others, whose text ends a string seen nowhere earlier
    stop = end = None
    for start, n in steps:
        if n < 2 or start == 0:
            continue
        text = tok.decode(tokens[: start + 1])
        for size in range(2, 8):
            candidate = text[-size:]
            if candidate.strip() and text.find(candidate) == len(text) - size and prompt.find(candidate) < 0:
                stop, end = candidate, start + 1
                break
        if stop:
            break
    assert stop is not None, "no verification emitted several tokens after a fresh string"
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,))
    (want,) = plain.generate([prompt], params)
    kept, stop_steps = _verifications(drafting, prompt, params)
    assert kept == want.outputs[0].token_ids and want.outputs[0].finish_reason == "stop"
    assert len(kept) == end  # the sample ends at the token that completes the stop string
    assert any(start < end < start + n for start, n in stop_steps)  # which a verification emitted before others
    assert stop not in want.outputs[0].text  # cut before the stop string (not kept in the output)
    assert drafting.engine.block_manager.seq_ids() == []


def test_structured_outputs_with_drafts_equal_those_without(plain, drafting):
    """Structured outputs draft too (their drafts trimmed and rows masked by the grammar): the same greedy text."""
    params = SamplingParams(max_tokens=12, structured_outputs=StructuredOutputsParams(regex="(ab|cd){2,5}"))
    before = drafting.engine.spec.stats.num_drafts
    assert _texts(drafting.generate(PROMPTS[:2], params)) == _texts(plain.generate(PROMPTS[:2], params))
    assert drafting.engine.spec.stats.num_drafts > before

"""Sampling controls at the text level: bad words tokenized as vLLM does, min_tokens with stop strings,
prompt logprobs."""

from __future__ import annotations

import pytest

from paged_kv.errors import InvalidArgumentError
from scheduler.core.config import CacheConfig, EngineConfig
from scheduler.core.params import SamplingParams
from scheduler.entrypoints.llm import LLM
from scheduler.entrypoints.output_processor import with_bad_word_ids

GREEDY = dict(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, engine_config=EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=256),
                                                          device="cpu"))  # fmt: skip


def _contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_tokenize_alone_and_after_a_space_as_in_vllm(llm):
    tok = llm.tokenizer
    words = with_bad_word_ids(SamplingParams(bad_words=["hello", " the", "zzq"]), tok).bad_words_token_ids
    # "hello" and "the" have a word-start token after a space (same length, another first id): both kept;
    # " zzq" is one token longer than "zzq" (a lone space token), so only the bare form is kept
    assert words == ((259, 266), (281, 266), (260,), (261,), (92, 92, 83))
    assert [tok.encode(w, add_special_tokens=False) for w in ("hello", " hello", "the", " the", "zzq")] == [
        list(w) for w in words]  # fmt: skip
    given = SamplingParams(bad_words=["hello"], bad_words_token_ids=[(5,)])
    assert with_bad_word_ids(given, tok) is given  # ids given by the caller are kept


def test_bad_words_keep_their_tokens_out_of_the_output(llm):
    base = llm.generate("the quick brown fox", SamplingParams(**GREEDY))[0].outputs[0]
    word = next(w for t in base.token_ids if (w := llm.tokenizer.decode([t]).strip()).isalpha())
    params = SamplingParams(**GREEDY, bad_words=[word])
    out = llm.generate("the quick brown fox", params)[0].outputs[0]
    ids = with_bad_word_ids(params, llm.tokenizer).bad_words_token_ids
    assert any(_contains(base.token_ids, w) for w in ids)
    assert not any(_contains(out.token_ids, w) for w in ids) and out.token_ids != base.token_ids


def test_a_bad_word_that_tokenizes_to_nothing_is_refused(llm):
    with pytest.raises(InvalidArgumentError, match="bad_words"):
        llm.generate(["hello", "the"], SamplingParams(bad_words=["   "]))
    assert not llm.engine.has_unfinished_requests()


def test_min_tokens_holds_stop_strings_back_over_its_tokens(llm):
    base = llm.generate("hello world", SamplingParams(**GREEDY))[0].outputs[0]
    stop = base.text[:2]  # the very first characters: a stop string at once without min_tokens
    early = llm.generate("hello world", SamplingParams(**GREEDY, stop=[stop]))[0].outputs[0]
    assert (early.text, early.finish_reason) == ("", "stop")
    held = llm.generate("hello world", SamplingParams(**GREEDY, stop=[stop], min_tokens=6))[0].outputs[0]
    assert held.token_ids[:6] == base.token_ids[:6] and len(held.token_ids) >= 6
    assert held.text.startswith(llm.tokenizer.decode(base.token_ids[:6]))


def test_prompt_logprobs_reach_the_text_output(llm):
    (out,) = llm.generate("the quick brown fox", SamplingParams(max_tokens=2, prompt_logprobs=2))
    (ref,) = llm.engine.generate([out.prompt_token_ids], SamplingParams(max_tokens=2, prompt_logprobs=2),
                                 use_tqdm=False)  # fmt: skip
    assert out.prompt_logprobs == ref.prompt_logprobs
    assert out.prompt_ranks == ref.prompt_ranks and out.outputs[0].ranks == ref.outputs[0].ranks
    assert out.prompt_ranks[0] is None and all(r >= 1 for r in out.prompt_ranks[1:] + out.outputs[0].ranks)
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    assert [next(iter(d)) for d in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]
    assert llm.generate("the quick", SamplingParams(max_tokens=1))[0].prompt_logprobs is None

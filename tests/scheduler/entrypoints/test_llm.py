"""The text-level LLM API: loading a local folder, text outputs, chat, stop strings, seeds, errors."""

from __future__ import annotations

import dataclasses

import pytest
from text_helpers import first_text_token

from paged_kv.errors import InvalidArgumentError
from scheduler.core.config import CacheConfig, EngineConfig
from scheduler.core.params import SamplingParams
from scheduler.engine.beam_search import BeamSearch, BeamSearchParams
from scheduler.entrypoints.llm import LLM
from scheduler.model import loader
from scheduler.model.loader import load_model

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, engine_config=EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=256),
                                                          device="cpu"))  # fmt: skip


def test_text_equals_the_decode_of_the_tokens_and_the_engine_output(llm):
    (out,) = llm.generate(["hello world"], GREEDY)
    sample = out.outputs[0]
    assert out.prompt == "hello world" and out.prompt_token_ids == llm.tokenizer.encode("hello world")
    assert len(sample.token_ids) == 24 and sample.finish_reason == "length"
    assert sample.text == llm.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    (ref,) = llm.engine.generate([out.prompt_token_ids], GREEDY, use_tqdm=False)
    assert ref.outputs[0].token_ids == sample.token_ids
    assert llm.engine.block_manager.seq_ids() == []


def test_token_id_prompts_and_string_prompts_agree(llm):
    ids = llm.tokenizer.encode("the quick brown fox")
    a, b = llm.generate([ids, "the quick brown fox"], GREEDY)
    assert a.outputs[0].text == b.outputs[0].text and a.prompt is None


def test_stop_string_cuts_the_text_before_it(llm):
    full = llm.generate("hello world", GREEDY)[0].outputs[0].text
    k = next(i for i in range(4, len(full) - 3) if full.find(full[i : i + 3]) == i and full[i : i + 3].strip())
    stop = full[k : k + 3]
    (out,) = llm.generate("hello world", SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop, "\x00zz"]))
    s = out.outputs[0]
    assert (s.text, s.finish_reason, s.stop_reason) == (full[:k], "stop", stop)
    assert len(s.token_ids) < 24  # generation ended early
    assert llm.engine.block_manager.seq_ids() == [] and not llm.engine.has_unfinished_requests()


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hello there"}]
    (out,) = llm.chat(messages, GREEDY)
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert out.prompt_token_ids == list(ids)
    assert out.outputs[0].text == llm.generate([list(ids)], GREEDY)[0].outputs[0].text


CONTINUED = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "the quick"}]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ suffix | default('') }}"


@pytest.mark.parametrize(("messages", "options"), [
    (CONTINUED, {"add_generation_prompt": False}),
    (CONTINUED, {"add_generation_prompt": False, "continue_final_message": True}),
    (CONTINUED, {"chat_template": TEMPLATE, "chat_template_kwargs": {"suffix": "bot:"}}),
    (CONTINUED, {"add_special_tokens": True, "add_generation_prompt": True}),
])  # fmt: skip
def test_chat_options_render_as_transformers_renders(llm, messages, options):
    tok = llm.tokenizer
    kw = {k: v for k, v in options.items() if k not in ("chat_template_kwargs", "add_special_tokens")}
    text = tok.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **kw},
                                   **options.get("chat_template_kwargs", {}))  # fmt: skip
    ids = tok(text, add_special_tokens=options.get("add_special_tokens", False))["input_ids"]
    assert llm.chat_prompt(messages, **options) == ids
    (out,) = llm.chat(messages, GREEDY, **options)
    assert out.prompt_token_ids == ids and out.outputs[0].text == llm.generate([ids], GREEDY)[0].outputs[0].text


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
TOOL_TEMPLATE = "{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}{{ messages[-1]['content'] }}"


@pytest.mark.parametrize("template", [None, TOOL_TEMPLATE])
def test_chat_gives_tools_to_the_template_as_transformers_does(llm, template):
    messages = CONTINUED[:1]
    text = llm.tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=template, add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    (out,) = llm.chat(messages, GREEDY, tools=TOOLS, chat_template=template)
    assert llm.chat_prompt(messages, tools=TOOLS, chat_template=template) == out.prompt_token_ids == ids
    assert (text == "[weather]hello there") == (template is not None)


@pytest.mark.parametrize("tools", [[], "weather", [["weather"]]])
def test_bad_tools_are_typed_errors_naming_them(llm, tools):
    with pytest.raises(InvalidArgumentError, match=r"^tools(\[0\])?=.*expected"):
        llm.chat(CONTINUED, GREEDY, tools=tools)
    assert not llm.engine.has_unfinished_requests()


def test_continue_final_message_ends_the_prompt_with_the_assistants_text(llm):
    ids = llm.chat_prompt(CONTINUED, add_generation_prompt=False, continue_final_message=True)
    closed = llm.chat_prompt(CONTINUED, add_generation_prompt=False)
    assert llm.tokenizer.decode(ids).endswith("assistant\nthe quick") and closed[: len(ids)] == ids
    assert llm.tokenizer.decode(closed[len(ids) :]).startswith("<|im_end|>")


@pytest.mark.parametrize(("options", "name"), [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is True by default
    ({"add_generation_prompt": 1}, "add_generation_prompt"),
    ({"add_special_tokens": None}, "add_special_tokens"),
    ({"continue_final_message": "yes", "add_generation_prompt": False}, "continue_final_message"),
    ({"chat_template": ""}, "chat_template"),
    ({"chat_template": 3}, "chat_template"),
    ({"chat_template": "{% if %}"}, "chat_template"),
    ({"chat_template": "{{ raise_exception('no') }}"}, "chat_template"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"continue_final_message": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {3: "x"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
])  # fmt: skip
def test_bad_chat_options_are_typed_errors_naming_them(llm, options, name):
    for call in (llm.chat_prompt, lambda m, **kw: llm.chat(m, GREEDY, **kw)):
        with pytest.raises(InvalidArgumentError, match=f"^{name}=.*expected"):
            call(CONTINUED, **options)
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.seq_ids() == []


def test_continue_final_message_leaves_any_roles_final_message_open_as_transformers(llm):
    user_last = CONTINUED[:1]  # vLLM and transformers continue a user's message too
    ids = llm.chat_prompt(user_last, add_generation_prompt=False, continue_final_message=True)
    ref = llm.tokenizer.apply_chat_template(user_last, add_generation_prompt=False, continue_final_message=True)
    assert ids == list(ref["input_ids"])
    assert llm.tokenizer.decode(ids).endswith(user_last[-1]["content"])


def test_seeded_samples_repeat_and_differ_between_seeds(llm):
    p = lambda seed: SamplingParams(max_tokens=16, temperature=1.0, seed=seed, n=2, ignore_eos=True)  # noqa: E731
    a, b, c = llm.generate(["hello", "hello", "hello"], [p(1), p(1), p(2)])
    texts = lambda o: [s.text for s in o.outputs]  # noqa: E731
    assert texts(a) == texts(b) and texts(a) != texts(c)
    assert texts(a)[0] != texts(a)[1]  # the n samples draw their own tokens


def test_logprobs_are_reported_per_token(llm):
    (out,) = llm.generate("hello", SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True))
    s = out.outputs[0]
    assert len(s.logprobs) == len(s.top_logprobs) == 5
    assert all(len(top) >= 3 and max(top.values()) >= lp - 1e-5 for lp, top in zip(s.logprobs, s.top_logprobs))


@pytest.mark.parametrize("bad", [[{"role": "user"}], [], "hi"])
def test_bad_chat_messages_raise(llm, bad):
    with pytest.raises(InvalidArgumentError, match="messages"):
        llm.chat(bad if bad != "hi" else [bad])


def test_a_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(InvalidArgumentError):
        llm.generate(["hello", [1] * 600], GREEDY)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("name", ["nope", "weights.bin", "empty-dir"])
def test_load_model_rejects_paths_that_are_not_a_model(tmp_path, name):
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(InvalidArgumentError, match="model"):
        load_model(tmp_path / name)


def test_a_gguf_file_loads_through_transformers_gguf_support(tmp_path, monkeypatch):
    calls = []
    fake = lambda folder, overrides=None, **kw: calls.append((folder, overrides, kw)) or ("m", "t")  # noqa: E731
    monkeypatch.setattr(loader, "_from_pretrained", fake)
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "tiny.Q4.gguf"), "llama")  # a header only: the loader reads its keys
    writer.add_block_count(2), writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.close()
    loaded = load_model(tmp_path / "tiny.Q4.gguf")
    assert calls == [(str(tmp_path), {}, {"gguf_file": "tiny.Q4.gguf"})] and loaded.name == "tiny.Q4"
    (tmp_path / "bad.gguf").write_bytes(b"GGUF")  # truncated: refused before transformers reads it
    with pytest.raises(InvalidArgumentError, match="a readable GGUF file"):
        load_model(tmp_path / "bad.gguf")
    assert len(calls) == 1


def test_a_sample_ended_by_a_stop_string_stops_generating_while_its_siblings_run(llm):
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=2, ignore_eos=True)
    free = [s.text for s in llm.generate("hello", p)[0].outputs]
    stop = next(free[0][i : i + 2] for i in range(2, len(free[0]) - 2) if free[0][i : i + 2] not in free[1])
    steps_before = len(llm.engine.metrics.steps)
    (out,) = llm.generate("hello", SamplingParams(**{**p.__dict__, "stop": (stop,)}))
    generated = sum(s.num_generated_tokens for s in llm.engine.metrics.steps[steps_before:])
    first, second = out.outputs
    assert first.finish_reason == "stop" and first.text == free[0][: free[0].find(stop)]
    assert second.text == free[1] and second.finish_reason == "length"
    assert generated == len(first.token_ids) + len(second.token_ids) < 40  # the stopped sample took no more steps


def test_a_request_aborted_before_its_first_sample_reports_each_of_its_samples(llm):
    llm.processor.add("early", llm.tokenizer.encode("hello world"), SamplingParams(n=3, max_tokens=4))
    out = llm.processor.abort("early").result()
    assert [(s.index, s.finish_reason, s.text, s.token_ids) for s in out.outputs] == [
        (i, "abort", "", []) for i in range(3)]  # fmt: skip
    assert not llm.engine.has_unfinished_requests()


def test_a_prompt_near_the_context_is_answered_up_to_it(llm):
    """As vLLM's LLM: max_tokens past the model context (the default 16 too) stops at the context with "length";
    only a prompt longer than the context is refused (it used to refuse prompt + max_tokens > context)."""
    context = llm.engine.model.config.max_position_embeddings
    ids = llm.tokenizer.encode("hello world") * context
    outs = llm.generate([ids[: context - 3], ids[:context]], SamplingParams(ignore_eos=True))
    assert [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs] == [(3, "length"), (1, "length")]
    with pytest.raises(InvalidArgumentError, match="model context"):
        llm.generate([ids[: context + 1]], SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished_requests()


def test_a_stop_token_ends_the_text_before_it_and_is_the_stop_reason(llm):
    tokens = llm.generate("hello world", GREEDY)[0].outputs[0].token_ids
    k = first_text_token(llm.tokenizer, tokens)
    (out,) = llm.generate("hello world", SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[tokens[k]]))
    s = out.outputs[0]
    assert s.token_ids == tokens[: k + 1]  # the stop token is the last token, without text of its own
    assert (s.text, s.finish_reason, s.stop_reason) == (llm.tokenizer.decode(tokens[:k]), "stop", tokens[k])


def test_eos_ends_the_text_before_it_with_no_stop_reason(tiny_model_dir):
    llm = LLM(tiny_model_dir, engine_config=EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=64),
                                                         device="cpu"))  # fmt: skip
    tokens = llm.generate("hello world", GREEDY)[0].outputs[0].token_ids
    k = first_text_token(llm.tokenizer, tokens)
    llm.engine.scheduler.eos_token_ids = frozenset({tokens[k]})  # a model whose EOS is a token with text
    (eos,) = llm.generate("hello world", SamplingParams(max_tokens=24))
    assert (eos.outputs[0].text, eos.outputs[0].stop_reason) == (llm.tokenizer.decode(tokens[:k]), None)
    ignored = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[tokens[k]])
    assert llm.generate("hello world", ignored)[0].outputs[0].stop_reason == tokens[k]  # a stop token, not EOS


def test_beam_search_takes_text_prompts_and_gives_each_hypothesis_its_text(llm):
    """vLLM's LLM.beam_search: text or token prompts in, every hypothesis with its text; the beams are the engine's
    BeamSearch's (transformers' semantics, tested against generate(num_beams=...) in test_beam_search)."""
    ids = llm.tokenizer.encode("the quick brown fox")
    params = BeamSearchParams(width=3, max_tokens=8, ignore_eos=True)
    text_out, ids_out = llm.beam_search(["the quick brown fox", ids], params)
    (ref,) = BeamSearch(llm.engine).generate([ids], params)
    for out in (text_out, ids_out):
        assert out.prompt_token_ids == ids and len(out.hypotheses) == 3
        assert [h.token_ids for h in out.hypotheses] == [h.token_ids for h in ref.hypotheses]
        assert [h.text for h in out.hypotheses] == [
            llm.tokenizer.decode(h.token_ids, skip_special_tokens=True) for h in ref.hypotheses
        ]
    assert all(h.text is None for h in ref.hypotheses)  # the token-level search has no tokenizer
    (single,) = llm.beam_search(ids, params)  # one prompt, as a token id list
    assert [(h.token_ids, h.text) for h in single.hypotheses] == [(h.token_ids, h.text) for h in ids_out.hypotheses]
    assert llm.engine.block_manager.seq_ids() == []


def test_beam_search_text_leaves_out_the_stop_token_as_generate_does(llm):
    """Width 1 is greedy: with a stop token id, the hypothesis ends on it ("stop") and its text is generate's."""
    prompt = "hello world"
    (greedy,) = llm.generate([prompt], GREEDY)
    stop = greedy.outputs[0].token_ids[4]
    (req,) = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop]))
    sample = req.outputs[0]
    (out,) = llm.beam_search(prompt, BeamSearchParams(width=1, max_tokens=24, ignore_eos=True, stop_token_ids=(stop,)))
    (best,) = out.hypotheses
    assert (best.token_ids, best.finish_reason) == (sample.token_ids, "stop") and best.token_ids[-1] == stop
    assert best.text == sample.text and sample.text  # the stop token's text left out of both
    with pytest.raises(InvalidArgumentError, match="prompts"):
        llm.beam_search([], BeamSearchParams())


def test_beam_search_keeps_the_stop_token_text_when_asked(llm):
    """include_stop_str_in_output (vLLM's BeamSearchParams field): the stop token's text ends the hypothesis' text,
    as it ends generate's sample's with the same flag."""
    prompt = "hello world"
    (greedy,) = llm.generate([prompt], GREEDY)
    stop = greedy.outputs[0].token_ids[4]
    kept = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop], include_stop_str_in_output=True)
    (req,) = llm.generate([prompt], kept)
    params = BeamSearchParams(width=1, max_tokens=24, ignore_eos=True, stop_token_ids=(stop,))
    (cut,) = llm.beam_search(prompt, params)
    (out,) = llm.beam_search(prompt, dataclasses.replace(params, include_stop_str_in_output=True))
    best = out.hypotheses[0]
    assert best.token_ids == cut.hypotheses[0].token_ids and best.finish_reason == "stop"
    assert best.text == req.outputs[0].text == cut.hypotheses[0].text + llm.tokenizer.decode([stop])


def test_beam_search_hypotheses_carry_the_stop_token_that_ended_them(llm):
    """vLLM's BeamSearchSequence.stop_reason: a hypothesis ended by a stop id or EOS holds that token's id, one
    ended at max_tokens holds None."""
    prompt = "hello world"
    (first,) = llm.beam_search(prompt, BeamSearchParams(width=3, max_tokens=8, ignore_eos=True))
    stop = first.hypotheses[0].token_ids[2]  # on the best path: some hypotheses end on it
    (out,) = llm.beam_search(prompt, BeamSearchParams(width=3, max_tokens=8, ignore_eos=True, stop_token_ids=(stop,)))
    assert {h.finish_reason for h in out.hypotheses} == {"stop", "length"}
    assert [h.stop_reason for h in out.hypotheses] == [stop if h.finish_reason == "stop" else None
                                                      for h in out.hypotheses]  # fmt: skip
    assert all(h.token_ids[-1] == stop for h in out.hypotheses if h.finish_reason == "stop")
    scheduler, eos_ids = llm.engine.scheduler, llm.engine.scheduler.eos_token_ids
    scheduler.eos_token_ids = frozenset({stop})  # the same token as the model's EOS
    try:
        (eos,) = llm.beam_search(prompt, BeamSearchParams(width=3, max_tokens=8))
    finally:
        scheduler.eos_token_ids = eos_ids
    assert [(h.token_ids, h.stop_reason) for h in eos.hypotheses] == [(h.token_ids, h.stop_reason)
                                                                      for h in out.hypotheses]  # fmt: skip

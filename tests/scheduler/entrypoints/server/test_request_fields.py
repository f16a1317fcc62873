"""Every field of OpenAI's and vLLM's completion and chat requests is honoured or refused with a 400 naming it.

The fields come from the installed ``openai`` package's request types and from vLLM's
``CompletionRequest`` / ``ChatCompletionRequest`` (``vllm/entrypoints/openai/protocol.py``: the
sampling and extra parameters, the legacy ``best_of`` and ``guided_*`` fields included). Each
gets a value that asks for something: an honoured field answers 200 and its value reaches the
engine's SamplingParams (or its effect shows in the response); a refused one answers 400 with
``param`` naming it. A pass-through field (vLLM's SamplingParams names) is honoured exactly when
the engine's SamplingParams has it.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from server_helpers import CHAT, refused, sse_events

from scheduler.core.params import SamplingParams
from scheduler.engine.beam_selection import BeamSearchParams
from scheduler.entrypoints.server import sampling

PROMPT = "hello world the quick"
VLLM_SHARED = [
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words", "structured_outputs", "priority",
    "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "best_of", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "response_format",
]  # fmt: skip
VLLM_COMPLETION = VLLM_SHARED + [
    "truncation_side", "logprob_token_ids", "prompt_embeds", "add_special_tokens", "return_token_offsets",
    "ec_transfer_params", "repetition_detection", "thinking_token_budget",
]  # fmt: skip
VLLM_CHAT = VLLM_SHARED + [
    "reasoning_effort", "include_reasoning", "parallel_tool_calls", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs", "structural_tag", "max_repetition_pattern_size", "min_repetition_pattern_size",
    "repetition_min_count",
]  # fmt: skip


@dataclass
class Sent:
    """What one request gave: the response, and what the app handed to the engine."""

    response: httpx.Response
    params: list[SamplingParams]
    prompts: list[list[int]]
    logs: str
    served: object

    def tokens(self, text: str = "", **kw) -> list[int]:
        """The token ids of ``text`` (default: the completion prompt) as the served model's tokenizer gives them."""
        return self.served.llm.tokenizer.encode(text or PROMPT, **kw)

    @property
    def body(self) -> dict:
        """The JSON body (the last event's, for a stream)."""
        if self.response.headers["content-type"].startswith("text/event-stream"):
            return sse_events(self.response.text)[-1]
        return self.response.json()


Check = Callable[[str, Sent], None]


def _ok(check: Callable[[Sent], object]) -> Check:
    def run(field: str, sent: Sent) -> None:
        assert sent.response.status_code == 200, (field, sent.response.text)
        assert check(sent) is not False, (field, sent.body)

    return run


def _param(attr: str, value: object) -> Check:
    return _ok(lambda s: all(getattr(p, attr) == value for p in s.params) and s.params)


def _refused(field: str, sent: Sent) -> None:
    refused(sent.response, field)


def _plain(value: object) -> object:
    """A value as compared: sequences as lists, mappings as dicts."""
    if isinstance(value, dict):
        return dict(value)
    return list(value) if isinstance(value, (list, tuple, set, frozenset)) else value


def _pass_through(engine_value: object) -> Check:
    """Honoured with this engine value when SamplingParams has the field, else refused naming it."""

    def run(field: str, sent: Sent) -> None:
        if field in {f.name for f in dataclasses.fields(SamplingParams)}:
            _ok(lambda s: all(_plain(getattr(p, field)) == _plain(engine_value) for p in s.params))(field, sent)
        else:
            _refused(field, sent)

    return run


def _choices(n: int) -> Check:
    return _ok(lambda s: len(s.body["choices"]) == n)


def _usage_on_every_chunk(sent: Sent) -> bool:
    """A final usage chunk, and (continuous_usage_stats, vLLM) a running usage on every chunk before it."""
    events = sse_events(sent.response.text)
    return bool(events[-1]["usage"]["completion_tokens"]) and all(e["usage"]["prompt_tokens"] for e in events)


def _rendered(messages: list[dict] = CHAT, **kw) -> Check:
    """The prompt handed to the engine is transformers' rendering of ``messages`` with these arguments."""
    return _ok(lambda s: s.prompts == [s.served.llm.tokenizer.apply_chat_template(messages, **kw)["input_ids"]])


REFUSED = _refused
CONTINUED = [*CHAT, {"role": "assistant", "content": "hello"}]
# field -> (a value that asks for something, the check, other fields it needs)
SHARED: dict[str, tuple[object, Check, dict]] = {
    "model": ("{model}", _ok(lambda s: s.body["model"] and s.params), {}),
    "max_tokens": (3, _param("max_tokens", 3), {}),
    "temperature": (0.5, _param("temperature", 0.5), {}),
    "top_p": (0.5, _param("top_p", 0.5), {}),
    "n": (2, _choices(2), {"temperature": 1.0}),
    "best_of": (2, _ok(lambda s: len(s.body["choices"]) == 1 and s.params[0].n == 2), {"temperature": 1.0}),
    "seed": (7, _param("seed", 7), {}),
    "stop": (["zz"], _param("stop", ("zz",)), {}),
    "stream": (True, _ok(lambda s: s.body["choices"][0]["finish_reason"]), {}),
    "stream_options": ({"include_usage": True, "continuous_usage_stats": True}, _ok(_usage_on_every_chunk),
                       {"stream": True}),
    "user": ("user-7", _ok(lambda s: "user 'user-7'" in s.logs), {}),
    "frequency_penalty": (0.5, _pass_through(0.5), {}),
    "presence_penalty": (0.5, _pass_through(0.5), {}),
    "repetition_penalty": (1.2, _pass_through(1.2), {}),
    "min_p": (0.1, _pass_through(0.1), {}),
    "min_tokens": (2, _pass_through(2), {}),
    "logit_bias": ({"5": 10}, _pass_through({5: 10.0}), {}),
    "allowed_token_ids": ([1, 2, 3], _pass_through([1, 2, 3]), {}),
    "bad_words": (["hello"], _pass_through(["hello"]), {}),
    "prompt_logprobs": (1, _ok(lambda s: s.params[0].prompt_logprobs == 1 and (
        s.body.get("prompt_logprobs") or s.body["choices"][0]["prompt_logprobs"])[0] is None), {}),  # fmt: skip
    "top_k": (5, _param("top_k", 5), {}),
    "ignore_eos": (True, _param("ignore_eos", True), {}),
    "stop_token_ids": ([7], _param("stop_token_ids", (7,)), {}),
    "cache_salt": ("tenant", _param("cache_salt", "tenant"), {}),
    "truncate_prompt_tokens": (1, _ok(lambda s: len(s.prompts) == 1 and len(s.prompts[0]) == 1), {}),
    "request_id": ("abc", _ok(lambda s: s.body["id"].endswith("-abc")), {}),
    "response_format": ({"type": "json_object"}, _ok(lambda s: all(p.structured_outputs.json_object for p in s.params)
                                                     and s.params), {}),
    "structured_outputs": ({"regex": "a+"}, _ok(lambda s: all(p.structured_outputs.regex == "a+" for p in s.params)
                                                and s.params), {}),
    **{name: ("a+", REFUSED, {}) for name in ("guided_json", "guided_regex", "guided_grammar", "structural_tag",
                                              "guided_decoding_backend", "guided_whitespace_pattern")},  # fmt: skip
    "guided_choice": (["a", "b"], REFUSED, {}),
    "use_beam_search": (True, _ok(lambda s: [(type(p), p.width, p.max_tokens) for p in s.params]
                                  == [(BeamSearchParams, 1, 4)]), {}),  # fmt: skip
    "length_penalty": (0.5, _param("length_penalty", 0.5), {"use_beam_search": True}),
    "include_stop_str_in_output": (True, _pass_through(True), {}),
    "skip_special_tokens": (False, _pass_through(False), {}),
    "spaces_between_special_tokens": (False, REFUSED, {}),
    "priority": (3, _ok(lambda s: s.params), {}),  # reaches add_request: test_server_tiers
    "logits_processors": (["my.Processor"], REFUSED, {}),
    "return_token_ids": (True, REFUSED, {}),
    "kv_transfer_params": ({"a": 1}, REFUSED, {}),
    "vllm_xargs": ({"a": 1}, REFUSED, {}),
}
COMPLETION = SHARED | {
    "prompt": (["hello", "world"], _choices(2), {}),
    "logprobs": (2, _ok(lambda s: s.params[0].logprobs == 2 and s.body["choices"][0]["logprobs"]["tokens"]), {}),
    "echo": (True, _ok(lambda s: s.body["choices"][0]["text"].startswith(PROMPT)), {}),
    "suffix": ("!", REFUSED, {}),
    "truncation_side": ("right", _ok(lambda s: s.prompts == [s.tokens()[:2]]), {"truncate_prompt_tokens": 2}),
    "return_tokens_as_token_ids": (True, _ok(lambda s: s.body["choices"][0]["logprobs"]["tokens"][0].startswith(
        "token_id:")), {"logprobs": 1}),  # fmt: skip
    "add_special_tokens": (False, _ok(lambda s: s.prompts == [s.tokens(add_special_tokens=False)]), {}),
    "logprob_token_ids": ([1], REFUSED, {}),
    "prompt_embeds": ("AAAA", REFUSED, {}),
    "return_token_offsets": (True, REFUSED, {}),
    "ec_transfer_params": ({"a": 1}, REFUSED, {}),
    "repetition_detection": ({"max_pattern_size": 4}, REFUSED, {}),
    "thinking_token_budget": (10, REFUSED, {}),
}
CHAT_FIELDS = SHARED | {
    "messages": (CHAT[1:], _ok(lambda s: s.body["choices"][0]["message"]["role"] == "assistant"), {}),
    "max_completion_tokens": (3, _param("max_tokens", 3), {}),
    "logprobs": (True, _ok(lambda s: s.body["choices"][0]["logprobs"]["content"]), {}),
    "top_logprobs": (2, _ok(lambda s: all(len(t["top_logprobs"]) == 2
                                          for t in s.body["choices"][0]["logprobs"]["content"])),
                     {"logprobs": True}),  # fmt: skip
    "return_tokens_as_token_ids": (True, _ok(lambda s: s.body["choices"][0]["logprobs"]["content"][0]["token"]
                                             .startswith("token_id:")), {"logprobs": True}),  # fmt: skip
    "parallel_tool_calls": (False, _ok(lambda s: s.params), {}),
    "prompt_cache_key": ("key", _ok(lambda s: s.params), {}),
    "safety_identifier": ("id-9", _ok(lambda s: "user 'id-9'" in s.logs), {}),
    "include_reasoning": (False, _ok(lambda s: s.params), {}),
    "audio": ({"voice": "alloy", "format": "wav"}, REFUSED, {}),
    "function_call": ("auto", REFUSED, {}),
    "functions": ([{"name": "f"}], REFUSED, {}),
    "metadata": ({"k": "v"}, REFUSED, {}),
    "modalities": (["text", "audio"], REFUSED, {}),
    "moderation": ({"model": "omni"}, REFUSED, {}),
    "prediction": ({"type": "content", "content": "x"}, REFUSED, {}),
    "prompt_cache_options": ({"retention": "24h"}, REFUSED, {}),
    "prompt_cache_retention": ("24h", REFUSED, {}),
    "reasoning_effort": ("low", _rendered(add_generation_prompt=True, reasoning_effort="low", enable_thinking=True),
                         {}),  # a template variable (the tiny model's template reads neither)
    "service_tier": ("flex", REFUSED, {}),
    "store": (True, REFUSED, {}),
    "tool_choice": ({"type": "function", "function": {"name": "f"}}, _ok(lambda s: s.params[0].structured_outputs
                    and s.body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"),
                    {"tools": [{"type": "function", "function": {"name": "f"}}]}),  # fmt: skip
    "tools": ([{"type": "function", "function": {"name": "f"}}], _ok(lambda s: s.body["choices"][0]["message"]
                                                                     ["content"]), {"tool_choice": "none"}),
    "verbosity": ("low", REFUSED, {}),
    "web_search_options": ({}, REFUSED, {}),
    "echo": (True, REFUSED, {}),
    "add_generation_prompt": (False, _rendered(add_generation_prompt=False), {}),
    "continue_final_message": (True, _rendered(CONTINUED, add_generation_prompt=False, continue_final_message=True),
                               {"add_generation_prompt": False, "messages": CONTINUED}),  # fmt: skip
    "add_special_tokens": (True, _ok(lambda s: s.prompts == [s.tokens(s.served.llm.tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False), add_special_tokens=True)]), {}),
    "documents": ([{"title": "a", "text": "b"}], REFUSED, {}),
    "chat_template": ("{{ messages }}", REFUSED, {}),  # without --trust-request-chat-template
    "chat_template_kwargs": ({"a": 1}, _rendered(add_generation_prompt=True, a=1), {}),
    "mm_processor_kwargs": ({"a": 1}, REFUSED, {}),
    "max_repetition_pattern_size": (2, REFUSED, {}),
    "min_repetition_pattern_size": (2, REFUSED, {}),
    "repetition_min_count": (2, REFUSED, {}),
}
ENDPOINTS = {
    "completions": (completion_create_params.CompletionCreateParamsBase, VLLM_COMPLETION, COMPLETION,
                    {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}),
    "chat/completions": (chat_create_params.CompletionCreateParamsBase, VLLM_CHAT, CHAT_FIELDS,
                         {"messages": CHAT, "max_tokens": 4, "temperature": 0}),
}  # fmt: skip


def _fields(path: str) -> list[str]:
    openai_type, vllm_fields, _, _ = ENDPOINTS[path]
    return sorted(set(typing.get_type_hints(openai_type)) | set(vllm_fields))


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_every_openai_and_vllm_field_has_a_case(path):
    assert set(_fields(path)) <= set(ENDPOINTS[path][2]), set(_fields(path)) - set(ENDPOINTS[path][2])


@pytest.mark.parametrize(("path", "field"), [(p, f) for p in ENDPOINTS for f in _fields(p)])
def test_each_field_is_honoured_or_refused_naming_it(served, captured, caplog, path, field):
    _, _, cases, base = ENDPOINTS[path]
    value, check, needs = cases[field]
    value = served.model if value == "{model}" else value
    caplog.set_level(logging.INFO, logger="paged_kv.server")
    r = served.post(path, {"model": served.model, **base, **needs, field: value})
    calls = captured[-1:] if r.status_code == 200 else []
    params = [p for _, ps in calls for p in ps]
    check(field, Sent(r, params, [ids for prompts, _ in calls for ids, _ in prompts], caplog.text, served))
    assert served.post(path, {"model": served.model, **base}).status_code == 200  # and the server serves on


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize(("field", "value"), [("n", True), ("max_tokens", "4"), ("temperature", "0.5"),
                                              ("stream", 1), ("seed", 1.0), ("stop", 5), ("wizard", 1)])  # fmt: skip
def test_no_coercion_and_no_unknown_field(served, path, field, value):
    base = ENDPOINTS[path][3]
    error = refused(served.post(path, {"model": served.model, **base, field: value}), field)
    assert ("unknown field" in error["message"]) == (field == "wizard")


def test_null_is_the_default_and_neutral_values_are_accepted(served, captured):
    base = {"model": served.model, "messages": CHAT, "max_tokens": 3}
    neutral = {"temperature": None, "tools": None, "tool_choice": "none", "store": False, "service_tier": "auto",
               "response_format": {"type": "text"}, "modalities": ["text"], "length_penalty": 1,
               "presence_penalty": 0, "logit_bias": {}, "stream_options": None}  # fmt: skip
    assert served.post("chat/completions", base | neutral).status_code == 200
    (_, (params,)) = captured[-1]
    assert params.temperature == 1.0 and params.max_tokens == 3


def test_a_pass_through_field_reaches_sampling_params_exactly_when_it_has_the_field(served, captured, monkeypatch):
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    missing = [n for n in sampling.PASS_THROUGH if n not in names]
    extended = dataclasses.make_dataclass("WithEveryField", [(n, object, None) for n in missing],
                                          bases=(SamplingParams,), frozen=True, kw_only=True)  # fmt: skip
    body = {"model": served.model, "prompt": "hello", "max_tokens": 3, "presence_penalty": 0.5,
            "logit_bias": {"7": -3}, "allowed_token_ids": [4, 5], "bad_words": ["x"]}  # fmt: skip
    monkeypatch.setattr(sampling, "SamplingParams", extended)
    assert served.post("completions", body).status_code == 200
    ((_, (params,)),) = captured
    assert (params.presence_penalty, _plain(params.logit_bias)) == (0.5, {7: -3.0})
    assert (_plain(params.allowed_token_ids), _plain(params.bad_words)) == ([4, 5], ["x"])
    monkeypatch.setattr(sampling, "sampling_param_names", lambda: frozenset(names) - {"presence_penalty"})
    error = refused(served.post("completions", body), "presence_penalty")
    assert "does not support presence_penalty" in error["message"] and len(captured) == 1


@pytest.mark.parametrize(("field", "value"), [("logit_bias", {"abc": 1}), ("logit_bias", {"99999": 1}),
                                              ("allowed_token_ids", [99999]), ("logit_bias", {"1": 101})])  # fmt: skip
def test_token_ids_of_pass_through_fields_are_checked_against_the_vocabulary(served, monkeypatch, field, value):
    names = {f.name for f in dataclasses.fields(SamplingParams)} | {field}
    monkeypatch.setattr(sampling, "sampling_param_names", lambda: frozenset(names))
    refused(served.post("completions", {"model": served.model, "prompt": "hi", "max_tokens": 2, field: value}), field)

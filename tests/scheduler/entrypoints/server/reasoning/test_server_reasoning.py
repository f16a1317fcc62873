"""Reasoning outputs on /v1/chat/completions with the official client: whole, streamed, hidden, with tools, and
constrained answers whose grammar starts after the thinking.

One server serves the module, with ``--reasoning-parser deepseek_r1`` and "auto" tool choice (hermes).
The tiny model is random and never thinks: ``force_thinking`` makes each sample start with a thinking
block (the tokens the server waits for included); the answer after it is the model's own, held by the
request's constraint through the real engine, which starts it after the end tag.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
from server_helpers import CHAT, force_thinking, serving

from scheduler.entrypoints.server.config import ServerConfig
from scheduler.entrypoints.server.reasoning.output import PARSERS

THOUGHT = "let me see"  # the thinking force_thinking writes
ANSWER = r"[A-Za-z ]{2,12}"  # an answer the grammar holds
CALL = '{"name": "clock", "arguments": {"utc": true}}'
AFTER = r'<tool_call>\{"name": "clock", "arguments": \{"utc": true\}\}</tool_call>'
CLOCK = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
         "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
CONSTRAINTS = {  # each constraint a reasoning parser used to refuse, and the check of its answer
    "named": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "clock"}}},
    "required": {"tools": TOOLS, "tool_choice": "required"},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "clock", "schema": CLOCK}}},
}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """A server splitting out deepseek_r1 reasoning, with "auto" tool choice (hermes)."""
    config = ServerConfig(reasoning_parser="deepseek_r1", enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serving(tiny_model_dir, config) as s:
        yield s


@pytest.fixture
def thinking(served, monkeypatch):
    """Every sample of the test starts with ``<think>`` THOUGHT ``</think>``."""
    force_thinking(served, monkeypatch, THOUGHT)


def create(served, client, regex: str | None = ANSWER, **kw):
    """A greedy chat completion of CHAT whose answer the regex holds (None: no constraint)."""
    constraint = {} if regex is None else {"structured_outputs": {"regex": regex}}
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model=served.model, messages=CHAT, temperature=0.0,
                                          extra_body={**constraint, **kw.pop("extra", {})}, **kw)  # fmt: skip


def streamed(served, client, regex: str | None = ANSWER, **kw) -> list[tuple[str, str]]:
    """Each streamed delta's (field, text) pieces, in order: reasoning, content, and a call's name ("call")."""
    out = []
    for chunk in create(served, client, regex, stream=True, **kw):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            out += [("reasoning", extra["reasoning"])] if extra.get("reasoning") else []
            out += [("content", choice.delta.content)] if choice.delta.content else []
            out += [("call", c.function.name) for c in choice.delta.tool_calls or [] if c.function.name]
    return out


def test_the_thinking_is_split_out_of_the_answer_and_its_tokens_count(served, client, thinking, monkeypatch):
    message = (out := create(served, client, None, max_tokens=24)).choices[0].message  # a free answer
    reasoning, content = message.model_extra["reasoning"], message.content
    assert message.model_extra["reasoning_content"] == reasoning == THOUGHT and content
    front = served.app.state.frontend  # the same greedy answer, read with no parser
    monkeypatch.setattr(front, "config", dataclasses.replace(front.config, reasoning_parser=None))
    raw = create(served, client, None, max_tokens=24)
    assert raw.choices[0].message.content == f"<think>{reasoning}</think>{content}"
    assert "reasoning" not in (raw.choices[0].message.model_extra or {})  # no parser: no such field
    assert out.usage.completion_tokens == raw.usage.completion_tokens  # the thinking's tokens count


def test_a_stream_sends_the_reasoning_then_the_content_of_the_whole_answer(served, client, thinking):
    message = create(served, client).choices[0].message
    pieces = streamed(served, client)
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and kinds.count("reasoning") > 1
    assert "".join(t for k, t in pieces if k == "reasoning") == message.model_extra["reasoning"]
    assert "".join(t for k, t in pieces if k == "content") == message.content
    kw = {"model": served.model, "messages": CHAT, "temperature": 0.0, "max_tokens": 200,
          "extra_body": {"structured_outputs": {"regex": ANSWER}}}  # fmt: skip
    with client.chat.completions.stream(**kw) as stream:  # the client's own accumulator joins the deltas
        joined = stream.get_final_completion().choices[0].message
    assert (joined.model_extra["reasoning"], joined.content) == (message.model_extra["reasoning"], message.content)


def test_include_reasoning_false_drops_the_reasoning_and_keeps_the_content(served, client, thinking):
    message = create(served, client).choices[0].message
    hidden = create(served, client, extra={"include_reasoning": False}).choices[0].message
    assert hidden.model_extra["reasoning"] is None and hidden.model_extra["reasoning_content"] is None
    assert hidden.content == message.content
    pieces = streamed(served, client, extra={"include_reasoning": False})
    assert pieces and all(kind == "content" for kind, _ in pieces)
    assert "".join(t for _, t in pieces) == message.content


def test_tool_calls_are_read_from_the_content_after_the_thinking_only(served, client, monkeypatch):
    kw = {"tools": TOOLS, "tool_choice": "auto"}
    force_thinking(served, monkeypatch, THOUGHT)
    after = create(served, client, AFTER, **kw).choices[0]  # the regex holds the answer after the thinking
    assert [c.function.name for c in after.message.tool_calls] == ["clock"] and after.finish_reason == "tool_calls"
    assert after.message.content is None and after.message.model_extra["reasoning"] == THOUGHT
    pieces = streamed(served, client, AFTER, **kw)
    assert [t for k, t in pieces if k != "reasoning"] == ["clock"]  # the call's first delta, after the thinking
    assert "".join(t for k, t in pieces if k == "reasoning") == after.message.model_extra["reasoning"]
    thought = f"<tool_call>{CALL}</tool_call>"
    force_thinking(served, monkeypatch, thought)
    inside = create(served, client, "Hi", **kw).choices[0]  # a call written while thinking is no call
    assert not inside.message.tool_calls and inside.finish_reason == "stop"
    assert inside.message.model_extra["reasoning"] == thought and inside.message.content == "Hi"
    pieces = streamed(served, client, "Hi", **kw)
    assert "".join(t for k, t in pieces if k == "reasoning") == thought
    assert "".join(t for k, t in pieces if k != "reasoning") == "Hi"


def test_qwen3_without_thinking_reads_an_untagged_answer_as_content(served, client, monkeypatch):
    answer = r"[A-Za-z]{2,8}"
    assert create(served, client, answer).choices[0].message.content is None  # deepseek_r1: all thinking
    front = served.app.state.frontend
    monkeypatch.setattr(front, "config", dataclasses.replace(front.config, reasoning_parser="qwen3"))
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = create(served, client, answer, extra=off).choices[0].message
    assert message.model_extra["reasoning"] is None and message.content
    assert create(served, client, answer).choices[0].message.content is None  # thinking on: all thinking


def answer_of(name: str, message) -> dict:
    """The checked answer of a CONSTRAINTS request: its call's arguments, or its JSON content."""
    if name == "json_schema":
        assert not message.tool_calls
        value = json.loads(message.content)
    else:
        (call,) = message.tool_calls
        value = json.loads(call.function.arguments)
        assert call.function.name == "clock" and message.content == ""
    jsonschema.validate(value, CLOCK)
    return value


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_a_constraint_holds_the_answer_after_the_thinking(served, client, thinking, name):
    """A named or "required" tool choice and a json_schema response_format are served with a parser (they were
    refused): the thinking is free, the grammar holds the answer after it (a valid call, valid JSON); streamed,
    the reasoning comes first and the pieces join into the whole answer."""
    body = CONSTRAINTS[name]
    whole = create(served, client, None, extra=body).choices[0]
    assert whole.message.model_extra["reasoning"] == THOUGHT and whole.finish_reason in ("stop", "tool_calls")
    answer_of(name, whole.message)
    kinds, reasoning, content, calls = [], "", "", {}
    for chunk in create(served, client, None, stream=True, extra=body):
        for choice in chunk.choices:
            delta = choice.delta
            if (delta.model_extra or {}).get("reasoning"):
                kinds.append("reasoning")
                reasoning += delta.model_extra["reasoning"]
            for call in delta.tool_calls or []:
                kinds.append("answer")
                calls.setdefault(call.index, ["", ""])
                calls[call.index][0] += call.function.name or ""
                calls[call.index][1] += call.function.arguments or ""
            if delta.content:
                kinds.append("answer")
                content += delta.content
    assert kinds == sorted(kinds, key=lambda k: k == "answer")  # the thinking first
    assert "reasoning" in kinds and "answer" in kinds
    assert reasoning == THOUGHT
    expected = [[c.function.name, c.function.arguments] for c in whole.message.tool_calls or []]
    assert [calls[i] for i in sorted(calls)] == expected
    assert content == ("" if expected else whole.message.content)


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_qwen3_without_thinking_holds_the_answer_from_the_first_token(served, client, monkeypatch, name):
    """With thinking off the grammar starts at the first token (no thinking to wait for): a valid answer at once;
    with thinking on, the same request waits for an end tag this model never writes (all reasoning, no answer)."""
    front = served.app.state.frontend
    monkeypatch.setattr(front, "config", dataclasses.replace(front.config, reasoning_parser="qwen3"))
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = create(served, client, None, extra={**CONSTRAINTS[name], **off}).choices[0].message
    assert message.model_extra["reasoning"] is None
    answer_of(name, message)
    waiting = create(served, client, None, max_tokens=12, extra=CONSTRAINTS[name]).choices[0]
    assert waiting.finish_reason == "length" and waiting.message.model_extra["reasoning"]
    if name == "json_schema":
        assert waiting.message.content is None
    else:  # a named call is always one call: with no answer, its arguments are empty
        assert waiting.message.content == ""
        assert all(c.function.arguments == "" for c in waiting.message.tool_calls or [])


def test_mistral_splits_think_tags_keeps_special_tokens_and_starts_a_named_call_after_them(
        served, client, monkeypatch, captured):  # fmt: skip
    """--reasoning-parser mistral (Magistral): [THINK]...[/THINK] is the reasoning, the text keeps special tokens
    (its tags are some in Mistral's tokenizers), an answer without [THINK] is content, and a named tool choice's
    grammar starts after [/THINK]'s tokens."""
    front = served.app.state.frontend
    monkeypatch.setattr(front, "config", dataclasses.replace(front.config, reasoning_parser="mistral"))
    untagged = create(served, client, r"[A-Za-z]{2,8}").choices[0].message
    assert untagged.model_extra["reasoning"] is None and untagged.content  # deepseek_r1 would make it all thinking
    force_thinking(served, monkeypatch, THOUGHT, parser="mistral")
    message = create(served, client).choices[0].message
    assert (message.model_extra["reasoning"], message.model_extra["reasoning_content"]) == (THOUGHT, THOUGHT)
    assert re.fullmatch(ANSWER, message.content)
    pieces = streamed(served, client)
    assert "".join(t for k, t in pieces if k == "reasoning") == THOUGHT
    assert "".join(t for k, t in pieces if k == "content") == message.content
    named = create(served, client, None, extra=CONSTRAINTS["named"]).choices[0].message
    assert named.model_extra["reasoning"] == THOUGHT and answer_of("named", named)
    assert captured and all(not params.skip_special_tokens for _, [params] in captured)
    [(_, [params])] = captured[-1:]
    assert params.structured_outputs.start_after == front.reasoning_ends["mistral"]  # the grammar waits for [/THINK]


def template_ending(tail: str) -> str:
    """A chat template writing the messages, then ``tail`` where the answer starts."""
    return "{% for m in messages %}{{ m.content }}\n{% endfor %}" + tail


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3", "mistral"])
def test_a_prompt_that_ended_the_thinking_makes_the_output_content_from_the_first_token(
        served, client, monkeypatch, parser):  # fmt: skip
    """A template that closes the thinking in the prompt (Qwen3's with thinking off writes <think>\\n\\n</think>\\n\\n)
    leaves no thinking to the output: all content, whole and streamed, and its grammar holds from the first token
    (it used to wait for an end tag that never comes, the answer read as reasoning)."""
    rules = PARSERS[parser]
    front = served.app.state.frontend
    options = dataclasses.replace(front.config, reasoning_parser=parser, trust_request_chat_template=True)
    monkeypatch.setattr(front, "config", options)
    ended = {"chat_template": template_ending(f"{rules.start}\n\n{rules.end}\n\n")}
    answer = r"[A-Za-z]{2,8}"
    message = create(served, client, answer, extra=ended).choices[0].message
    assert message.model_extra["reasoning"] is None and re.fullmatch(answer, message.content)
    pieces = streamed(served, client, answer, extra=ended)
    assert pieces and {kind for kind, _ in pieces} == {"content"} and "".join(t for _, t in pieces) == message.content
    schema = create(served, client, None, extra={**CONSTRAINTS["json_schema"], **ended}).choices[0].message
    assert schema.model_extra["reasoning"] is None and answer_of("json_schema", schema)


def test_a_prompt_that_opened_the_thinking_makes_an_untagged_output_reasoning(served, client, monkeypatch):
    """qwen3 with thinking off reads an untagged output as content, unless the prompt itself ends inside an open
    <think> (a template that prefills it): then it is thinking, as deepseek_r1 reads it."""
    front = served.app.state.frontend
    options = dataclasses.replace(front.config, reasoning_parser="qwen3", trust_request_chat_template=True)
    monkeypatch.setattr(front, "config", options)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    answer = r"[A-Za-z]{2,8}"
    plain = create(served, client, answer, extra={**off, "chat_template": template_ending("")}).choices[0].message
    assert plain.model_extra["reasoning"] is None and plain.content
    opened = {**off, "chat_template": template_ending("<think>\n")}
    message = create(served, client, answer, max_tokens=8, extra=opened).choices[0].message
    assert message.model_extra["reasoning"] and message.content is None
    assert "".join(t for k, t in streamed(served, client, answer, max_tokens=8, extra=opened)
                   if k == "reasoning") == message.model_extra["reasoning"]  # fmt: skip

"""Reasoning outputs on /v1/chat/completions with the official client: whole, streamed, hidden, with tools.

One server serves the module, with ``--reasoning-parser deepseek_r1`` and "auto" tool choice (hermes).
The tiny model is random: a regex constraint (``structured_outputs``, which holds the whole output,
thinking included) makes it write a thinking block and an answer.
"""

from __future__ import annotations

import dataclasses

import pytest
from server_helpers import CHAT, refused, serving

from scheduler.entrypoints.server.config import ServerConfig

THINK = r"<think>[a-z ]{2,12}</think>[A-Za-z ]{2,12}"  # a thinking block, then an answer
CALL = '{"name": "clock", "arguments": {"utc": true}}'
AFTER = r'<think>[a-z ]{2,8}</think><tool_call>\{"name": "clock", "arguments": \{"utc": true\}\}</tool_call>'
INSIDE = r'<think><tool_call>\{"name": "clock", "arguments": \{"utc": true\}\}</tool_call></think>Hi'
CLOCK = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}
TOOLS = [{"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """A server splitting out deepseek_r1 reasoning, with "auto" tool choice (hermes)."""
    config = ServerConfig(reasoning_parser="deepseek_r1", enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serving(tiny_model_dir, config) as s:
        yield s


def create(served, client, regex: str = THINK, **kw):
    """A greedy chat completion of CHAT whose output the regex shapes."""
    return client.chat.completions.create(model=served.model, messages=CHAT, temperature=0.0, max_tokens=200,
                                          extra_body={"structured_outputs": {"regex": regex}, **kw.pop("extra", {})},
                                          **kw)  # fmt: skip


def streamed(served, client, regex: str = THINK, **kw) -> list[tuple[str, str]]:
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


def test_the_thinking_is_split_out_of_the_answer_and_its_tokens_count(served, client, monkeypatch):
    message = (out := create(served, client)).choices[0].message
    reasoning, content = message.model_extra["reasoning"], message.content
    assert message.model_extra["reasoning_content"] == reasoning and reasoning and content
    front = served.app.state.frontend  # the same greedy answer, read with no parser
    monkeypatch.setattr(front, "config", dataclasses.replace(front.config, reasoning_parser=None))
    raw = create(served, client)
    assert raw.choices[0].message.content == f"<think>{reasoning}</think>{content}"
    assert "reasoning" not in (raw.choices[0].message.model_extra or {})  # no parser: no such field
    assert out.usage.completion_tokens == raw.usage.completion_tokens  # the thinking's tokens count


def test_a_stream_sends_the_reasoning_then_the_content_of_the_whole_answer(served, client):
    message = create(served, client).choices[0].message
    pieces = streamed(served, client)
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and kinds.count("reasoning") > 1
    assert "".join(t for k, t in pieces if k == "reasoning") == message.model_extra["reasoning"]
    assert "".join(t for k, t in pieces if k == "content") == message.content
    kw = {"model": served.model, "messages": CHAT, "temperature": 0.0, "max_tokens": 200,
          "extra_body": {"structured_outputs": {"regex": THINK}}}  # fmt: skip
    with client.chat.completions.stream(**kw) as stream:  # the client's own accumulator joins the deltas
        joined = stream.get_final_completion().choices[0].message
    assert (joined.model_extra["reasoning"], joined.content) == (message.model_extra["reasoning"], message.content)


def test_include_reasoning_false_drops_the_reasoning_and_keeps_the_content(served, client):
    message = create(served, client).choices[0].message
    hidden = create(served, client, extra={"include_reasoning": False}).choices[0].message
    assert hidden.model_extra["reasoning"] is None and hidden.model_extra["reasoning_content"] is None
    assert hidden.content == message.content
    pieces = streamed(served, client, extra={"include_reasoning": False})
    assert pieces and all(kind == "content" for kind, _ in pieces)
    assert "".join(t for _, t in pieces) == message.content


def test_tool_calls_are_read_from_the_content_after_the_thinking_only(served, client):
    kw = {"tools": TOOLS, "tool_choice": "auto"}
    after = create(served, client, AFTER, **kw).choices[0]
    assert [c.function.name for c in after.message.tool_calls] == ["clock"] and after.finish_reason == "tool_calls"
    assert after.message.content is None and after.message.model_extra["reasoning"]
    pieces = streamed(served, client, AFTER, **kw)
    assert [t for k, t in pieces if k != "reasoning"] == ["clock"]  # the call's first delta, after the thinking
    assert "".join(t for k, t in pieces if k == "reasoning") == after.message.model_extra["reasoning"]
    inside = create(served, client, INSIDE, **kw).choices[0]  # a call written while thinking is no call
    assert not inside.message.tool_calls and inside.finish_reason == "stop"
    thought = f"<tool_call>{CALL}</tool_call>"
    assert inside.message.model_extra["reasoning"] == thought and inside.message.content == "Hi"
    pieces = streamed(served, client, INSIDE, **kw)
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


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "clock"}}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_a_constraint_that_leaves_no_room_for_thinking_is_refused(served, client, body, param):
    r = served.post("chat/completions", {"model": served.model, "messages": CHAT, "max_tokens": 4, **body})
    assert "--reasoning-parser" in refused(r, param)["message"]
    text = create(served, client, extra={"response_format": {"type": "text"}}).choices[0].message  # no constraint
    assert text.model_extra["reasoning"] and text.content

"""A tool choice's constraint and answers without a server: "required"'s schema, messages and deltas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from scheduler.entrypoints.server.config import TOOL_CALL_PARSERS
from scheduler.entrypoints.server.protocol import ChatCompletionRequest
from scheduler.entrypoints.server.sampling import FieldError
from scheduler.entrypoints.server.tool_calling.choice import (
    ToolOutput,
    keeps_special_tokens,
    required_schema,
    tool_output,
)
from scheduler.entrypoints.server.tool_calling.parsers import PARSERS

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
SHAPE = {"type": "object", "properties": {"at": {"$ref": "#/$defs/point"}}, "required": ["at"],
         "$defs": {"point": POINT}}  # fmt: skip


def request(tools: list[dict], **kw) -> ChatCompletionRequest:
    """A validated chat request with these tools."""
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in tools]
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools, **kw})


def test_required_schema_takes_one_call_or_more_of_the_tools_with_their_defs_shared():
    body = request([("draw", SHAPE), ("erase", POINT)])
    schema = required_schema(body.tools, parallel=True)
    jsonschema.validate([{"name": "draw", "parameters": {"at": {"x": 1}}}, {"name": "erase", "parameters": {"x": 2}}],
                        schema)  # fmt: skip
    for bad in ([], [{"name": "draw", "parameters": {"at": {"x": "1"}}}], [{"name": "erase", "parameters": {}}],
                [{"name": "paint", "parameters": {"x": 1}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call only
        jsonschema.validate([{"name": "erase", "parameters": {"x": 2}}] * 2, required_schema(body.tools, False))
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]


def test_two_tools_with_different_defs_under_one_name_are_refused_naming_tools():
    other = {**SHAPE, "$defs": {"point": {"type": "string"}}}
    with pytest.raises(FieldError) as err:
        required_schema(request([("draw", SHAPE), ("move", other)]).tools, parallel=True)
    assert err.value.param == "tools" and "point" in str(err.value)


ERASE = [("erase", {"x": 1})]


@pytest.mark.parametrize(("choice", "text", "content", "calls", "finish"), [
    ("auto", 'ok <tool_call>{"name": "erase", "arguments": {"x": 1}}</tool_call>', "ok ", ERASE, "tool_calls"),
    ("auto", "just text", "just text", [], "stop"),
    ("required", '[{"name": "erase", "parameters": {"x": 1}}]', "", ERASE, "tool_calls"),
    ({"type": "function", "function": {"name": "erase"}}, '{"x": 1}', "", ERASE, "stop"),
])  # fmt: skip
def test_a_message_and_its_deltas_hold_the_same_content_calls_and_finish(choice, text, content, calls, finish):
    out = tool_output(request([("erase", POINT)], tool_choice=choice))
    message, whole_finish = out.message(text, "stop")
    made = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    assert (message["content"], made, whole_finish) == (content, calls, finish)
    streamed, chunks = ToolOutput(out.choice), []
    for i in range(0, len(text), 3):
        chunks.append(streamed.delta(1, text[i : i + 3], "stop" if i + 3 >= len(text) else None))
    said = "".join(d.get("content", "") for d, _ in chunks)
    args = "".join(c["function"]["arguments"] for d, _ in chunks for c in d.get("tool_calls", []))
    assert said == (content or "") and chunks[-1][1] == finish
    assert args == "".join(c["function"]["arguments"] for c in message.get("tool_calls", []))
    assert tool_output(request([("erase", POINT)], tool_choice="none")) is None


@pytest.mark.parametrize(("choice", "text"), [
    ("auto", '<tool_call>{"name": "erase", "arguments": {"x": 1'),
    ("required", '[{"name": "erase", "parameters": {"x": 1'),
    ({"type": "function", "function": {"name": "erase"}}, '{"x": 1'),
])  # fmt: skip
def test_a_call_cut_off_by_max_tokens_finishes_with_length_whole_and_streamed(choice, text):
    """"tool_calls" tells a client to run the calls; one cut off has arguments that are no JSON yet (as OpenAI)."""
    out = tool_output(request([("erase", POINT)], tool_choice=choice))
    message, finish = out.message(text, "length")
    assert message["tool_calls"][0]["function"]["arguments"] == '{"x": 1' and finish == "length"
    assert out.delta(0, text, "length")[1] == "length"


def test_a_required_calls_first_delta_names_it_and_one_delta_holds_one_entry_per_call():
    out = tool_output(request([("erase", POINT)], tool_choice="required"))
    text = '[{"name": "erase", "parameters": {"x": 12}}]'
    named = text.index("erase") + len('erase"')
    first, _ = out.delta(0, text[:named], None)
    [call] = first["tool_calls"]
    assert call["function"] == {"name": "erase", "arguments": ""} and call["id"].startswith("chatcmpl-tool-")
    later, _ = out.delta(0, text[named : text.index(": 12")], None)
    assert later == {"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]}
    whole, _ = ToolOutput("required").delta(0, text, "stop")
    assert [c["function"] for c in whole["tool_calls"]] == [{"name": "erase", "arguments": '{"x": 12}'}]


AUTO_TEXTS = {  # each parser's format of "ok", then a call of erase(x=1)
    "hermes": 'ok <tool_call>{"name": "erase", "arguments": {"x": 1}}</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "erase", "parameters": {"x": 1}} ok',
    "pythonic": "[erase(x=1)] ok",
    "mistral": 'ok [TOOL_CALLS][{"name": "erase", "arguments": {"x": 1}}]',
    "qwen3_coder": "ok <tool_call>\n<function=erase>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "deepseek_v3": "ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>erase\n```json\n"
                   '{"x": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek_v31": 'ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>erase<｜tool▁sep｜>{"x": 1}'
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
}


def test_the_registry_has_a_reader_for_each_parser_the_server_takes():
    assert tuple(PARSERS) == TOOL_CALL_PARSERS == tuple(AUTO_TEXTS)


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_auto_reads_with_the_servers_parser_whole_and_streamed(parser):
    text = AUTO_TEXTS[parser]
    out = tool_output(request([("erase", POINT)], tool_choice="auto"), parser)
    message, finish = out.message(text, "stop")
    [call] = message["tool_calls"]
    assert (message["content"].strip(), call["function"]["name"], finish) == ("ok", "erase", "tool_calls")
    assert json.loads(call["function"]["arguments"]) == {"x": 1}
    chunks = [out.delta(0, text[i : i + 2], "stop" if i + 2 >= len(text) else None) for i in range(0, len(text), 2)]
    assert "".join(d.get("content", "") for d, _ in chunks) == message["content"] and chunks[-1][1] == "tool_calls"
    args = "".join(c["function"]["arguments"] for d, _ in chunks for c in d.get("tool_calls", []))
    assert args == call["function"]["arguments"]
    for other in (p for p in TOOL_CALL_PARSERS if p != parser):  # another format: all content, no call
        message, finish = tool_output(request([("erase", POINT)], tool_choice="auto"), other).message(text, "stop")
        assert (message, finish) == ({"role": "assistant", "content": text}, "stop")


@pytest.mark.parametrize(("parser", "kept"), [("hermes", True), ("mistral", True), ("llama3_json", False),
                                              ("pythonic", False), ("qwen3_coder", True), ("deepseek_v3", True),
                                              ("deepseek_v31", True), (None, False)])  # fmt: skip
def test_auto_keeps_special_tokens_where_the_parsers_tags_may_be_ones(parser, kept):
    assert keeps_special_tokens(request([("erase", POINT)], tool_choice="auto"), parser) is kept
    assert not keeps_special_tokens(request([("erase", POINT)], tool_choice="required"), parser)

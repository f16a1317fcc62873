"""A response request as the chat completion it is served as: items to messages, fields to chat fields."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError

from scheduler.entrypoints.server.responses.conversation import (
    chat_request,
    input_messages,
    output_messages,
    renamed,
)
from scheduler.entrypoints.server.responses.protocol import ResponsesRequest
from scheduler.entrypoints.server.sampling import FieldError

CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}


def request(**kw) -> ResponsesRequest:
    """A response request (input "hi" unless given)."""
    return ResponsesRequest.model_validate({"input": "hi"} | kw)


def test_calls_join_the_assistant_message_before_them_or_open_one():
    items = [{"role": "assistant", "content": "let me see"}, CALL, CALL | {"call_id": "c2"},
             {"type": "function_call_output", "call_id": "c1", "output": "1"}, CALL | {"call_id": "c3"}]
    messages = input_messages(request(input=items))
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
    assert [c["id"] for c in messages[0]["tool_calls"]] == ["c1", "c2"] and messages[0]["content"] == "let me see"
    assert messages[1] == {"role": "tool", "content": "1", "tool_call_id": "c1"}
    assert messages[2]["content"] is None and messages[2]["tool_calls"][0]["id"] == "c3"


def test_an_output_becomes_the_assistant_turn_without_its_thinking():
    output = [{"type": "reasoning", "id": "rs", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
              {"type": "message", "content": [{"type": "output_text", "text": "ok"}]},
              {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]  # fmt: skip
    (message,) = output_messages(output)
    assert message["content"] == "ok" and message["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


def test_the_chat_request_takes_the_response_fields_under_chat_names():
    body = request(instructions="be brief", max_output_tokens=5, tools=[{"type": "function", "name": "f"}],
                   tool_choice={"type": "function", "name": "f"}, top_k=3, stop="x",
                   text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}})  # fmt: skip
    chat = chat_request(body, [{"role": "user", "content": "before"}])
    assert [m.content for m in chat.messages] == ["be brief", "before", "hi"]
    assert chat.max_completion_tokens == 5 and chat.top_k == 3 and chat.stop == ["x"]
    assert chat.tool_choice.function.name == "f" and chat.tools[0].function.name == "f"
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}


def test_a_chat_field_refusal_is_named_as_the_response_field():
    with pytest.raises(RequestValidationError) as info:
        chat_request(request(input=[CALL | {"arguments": "{"}]), [])
    assert info.value.errors()[0]["loc"][:2] == ("body", "input")
    error = renamed(FieldError("response_format", "response_format={}: expected a schema"))
    assert (error.param, str(error)) == ("text", "text={}: expected a schema")
    other = FieldError("seed", "seed=1: expected 2")
    assert renamed(other) is other

"""A response request as the chat completion it is served as: items to messages, fields to chat fields."""

from __future__ import annotations

import pytest

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
    error = renamed(FieldError("response_format", "response_format={}: expected a schema"))
    assert (error.param, str(error)) == ("text", "text={}: expected a schema")
    other = FieldError("seed", "seed=1: expected 2")
    assert renamed(other) is other


@pytest.mark.parametrize(("items", "where"), [
    ([CALL | {"arguments": "{"}], "input[0].arguments"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, CALL, CALL | {"arguments": "[1"}],
     "input[3].arguments"),  # the second call of the assistant message input[1] opened
    ([CALL, {"type": "function_call_output", "call_id": "c1", "output": "1"}, CALL | {"arguments": "x"}],
     "input[2].arguments"),
])  # fmt: skip
def test_a_refused_message_is_named_as_the_input_item_it_came_from(items, where):
    """Chat's refusal of a message names the item (after the instructions and the history, which chat counts)."""
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(FieldError) as info:
        chat_request(request(input=items, instructions="be brief"), history)
    assert info.value.param == "input" and str(info.value).startswith(where + ": "), str(info.value)
    assert "messages" not in str(info.value)


def test_a_refused_history_message_names_previous_response_id():
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]  # fmt: skip
    with pytest.raises(FieldError) as info:
        chat_request(request(), history)
    assert info.value.param == "previous_response_id" and str(info.value).startswith("previous_response_id: ")


def test_a_call_cut_off_by_the_response_end_is_left_out_of_the_continuation():
    cut = {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"unit": "c', "status": "incomplete"}
    output = [{"type": "message", "content": [{"type": "output_text", "text": "ok"}], "status": "completed"},
              CALL | {"status": "completed"}, cut]  # fmt: skip
    (message,) = output_messages(output)
    assert message["content"] == "ok" and [c["id"] for c in message["tool_calls"]] == ["c1"]
    assert output_messages([cut]) == []
    messages = input_messages(request(input=[{"role": "user", "content": "q"}, cut]))  # sent back as input
    assert messages == [{"role": "user", "content": "q"}]

"""A response request as the chat completion it is served as: its items as chat messages, its fields as chat fields.

The chat pipeline then does all the rest (rendering, sampling checks, tool calling, reasoning,
structured outputs), so a response is rendered and sampled exactly as the equivalent chat
completion. The mapping:

- ``instructions``: a system message first (this request's only: never carried over);
- a string ``input``: one user message; a message item: a message of its role (``developer`` as chat
  takes it), its parts' text joined;
- ``function_call`` items: the ``tool_calls`` of an assistant message (the message item just before
  them, if it is the assistant's, else a new one), each ``arguments`` JSON text as chat takes it;
  ``function_call_output`` items: ``tool`` messages answering their ``call_id``; ``reasoning`` items:
  nothing (a chat message has no thinking to render);
- ``previous_response_id``: the stored response's conversation (its input messages, those of its own
  previous responses first) and its output (message text and calls as an assistant message) come
  before the new input;
- ``tools`` (flat) become chat's ``{"type": "function", "function": {...}}``, ``tool_choice``
  ``{"type": "function", "name"}`` chat's named choice, ``max_output_tokens`` ``max_completion_tokens``,
  ``text.format`` ``response_format``.

A chat field's refusal is answered under the response's name for it (``CHAT_TO_RESPONSES``).
"""

from __future__ import annotations

from typing import Any

from scheduler.entrypoints.server.protocol import ChatCompletionRequest
from scheduler.entrypoints.server.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    MessageItem,
    ResponsesRequest,
)
from scheduler.entrypoints.server.sampling import FieldError
from scheduler.entrypoints.server.utility_routes import parse_body

Message = dict[str, Any]  # a chat message as ChatCompletionRequest takes it
# a chat field -> the response field that asked for it
CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}


def input_messages(body: ResponsesRequest) -> list[Message]:
    """The request's ``input`` as chat messages (without ``instructions``)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[Message] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            _add_call(messages, item.call_id, item.name, item.arguments)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
    return messages  # reasoning items: nothing to render


def output_messages(output: list[dict[str, Any]]) -> list[Message]:
    """A response's output items as the chat messages a continuation renders (its thinking left out)."""
    messages: list[Message] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            messages.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            _add_call(messages, item["call_id"], item["name"], item["arguments"])
    return messages


def _add_call(messages: list[Message], call_id: str, name: str, arguments: str) -> None:
    """Add a call to the last message if it is the assistant's, else in a new assistant message."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def chat_request(body: ResponsesRequest, history: list[Message]) -> ChatCompletionRequest:
    """The chat completion ``body`` is served as, after the conversation ``history`` (a previous response's)."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    fields = {
        "model": body.model, "messages": system + history + input_messages(body),
        "tools": [t.chat_tool() for t in body.tools] or None, "tool_choice": _tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls, "max_completion_tokens": body.max_output_tokens,
        "response_format": body.text.format.response_format(), "stream": body.stream, "user": body.user,
        "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
        **body.extensions(),
    }  # fmt: skip
    return parse_body(ChatCompletionRequest, fields, rename=CHAT_TO_RESPONSES)


def _tool_choice(body: ResponsesRequest) -> str | dict | None:
    """The chat's ``tool_choice`` of the response's."""
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def renamed(error: FieldError) -> FieldError:
    """A chat field's refusal under the response field that asked for it (the same error for any other field)."""
    name = CHAT_TO_RESPONSES.get(error.param)
    if name is None:
        return error
    message = str(error)
    message = name + message[len(error.param) :] if message.startswith(error.param) else message
    return FieldError(name, message)

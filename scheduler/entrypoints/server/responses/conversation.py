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
  ``text.format`` ``response_format``, ``reasoning.effort`` ``reasoning_effort`` (a chat template variable).

A chat field's refusal is answered under the response's name for it (``CHAT_TO_RESPONSES``); a chat message's
under the item it came from (``input[3].arguments: ...``, param ``input``; ``instructions``; the stored history's
``previous_response_id``), never under a chat message's position the client did not send.

A ``function_call`` cut off by its response's end (``max_output_tokens`` reached mid-arguments: its item
"incomplete", its arguments unfinished JSON) was never made: a continuation (``previous_response_id``, or the
item sent back with its "incomplete" status) leaves it out of the rendered conversation, the text before it
kept, so the model answers again from there. vLLM renders every call item as a call, whatever its status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi.exceptions import RequestValidationError

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
CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
                     "reasoning_effort": "reasoning"}
# a chat message's or call's field -> the input item's field it came from
ITEM_FIELDS = {"content": "content", "arguments": "arguments", "name": "name", "tool_call_id": "call_id",
               "id": "call_id"}


@dataclass
class Origin:
    """Where a chat message came from, for a refusal to name: the item (``input[i]``, ``instructions``,
    ``previous_response_id``) and, for each of its tool calls, the ``function_call`` item it is."""

    item: str
    calls: list[str] = field(default_factory=list)


def input_messages(body: ResponsesRequest) -> list[Message]:
    """The request's ``input`` as chat messages (without ``instructions``)."""
    return _input(body)[0]


def _input(body: ResponsesRequest) -> tuple[list[Message], list[Origin]]:
    """The request's ``input`` as chat messages, and the item each came from."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}], [Origin("input")]
    messages: list[Message] = []
    origins: list[Origin] = []
    for i, item in enumerate(body.input):
        name = f"input[{i}]"
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
            origins.append(Origin(name))
        elif isinstance(item, FunctionCallItem) and item.status != "incomplete":  # cut off: no call was made
            if _add_call(messages, item.call_id, item.name, item.arguments):
                origins.append(Origin(name))
            origins[-1].calls.append(name)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
            origins.append(Origin(name))
    return messages, origins  # reasoning items: nothing to render


def output_messages(output: list[dict[str, Any]]) -> list[Message]:
    """A response's output items as the chat messages a continuation renders: its thinking left out, and a call
    cut off by the response's end (its item "incomplete", its arguments unfinished) too: it was never made."""
    messages: list[Message] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            messages.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call" and item.get("status") != "incomplete":
            _add_call(messages, item["call_id"], item["name"], item["arguments"])
    return messages


def _add_call(messages: list[Message], call_id: str, name: str, arguments: str) -> bool:
    """Add a call to the last message if it is the assistant's, else in a new assistant message (True)."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
        return False
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return True


def chat_request(body: ResponsesRequest, history: list[Message]) -> ChatCompletionRequest:
    """The chat completion ``body`` is served as, after the conversation ``history`` (a previous response's); a
    message chat refuses is a 400 naming the item it came from (``input[i]``, ``instructions``, the history)."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages, origins = _input(body)
    origins = [Origin("instructions")] * len(system) + [Origin("previous_response_id")] * len(history) + origins
    fields = {
        "model": body.model, "messages": system + history + messages,
        "tools": [t.chat_tool() for t in body.tools] or None, "tool_choice": _tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls, "max_completion_tokens": body.max_output_tokens,
        "response_format": body.text.format.response_format(), "stream": body.stream, "user": body.user,
        "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
        "reasoning_effort": body.reasoning and body.reasoning.effort,
        **body.extensions(),
    }  # fmt: skip
    try:
        return parse_body(ChatCompletionRequest, fields, rename=CHAT_TO_RESPONSES)
    except RequestValidationError as e:
        raise _located(e, origins) from None


def _located(error: RequestValidationError, origins: list[Origin]) -> Exception:
    """A chat message's refusal as the item it came from (``input[2].arguments: ...``), naming the request's
    field (``input``, ``instructions``, ``previous_response_id``); any other refusal as it is."""
    first = error.errors()[0]
    loc = first.get("loc", ())[1:]  # after "body"
    if len(loc) < 2 or loc[0] != "input" or not isinstance(loc[1], int):
        return error
    origin, rest = origins[loc[1]], loc[2:]
    name = origin.item
    if len(rest) >= 2 and rest[0] == "tool_calls" and rest[1] in range(len(origin.calls)):
        name, rest = origin.calls[rest[1]], rest[2:]
    part = ITEM_FIELDS.get(rest[-1]) if rest and name.startswith("input[") else None  # an item's own field
    where = f"{name}.{part}" if part else name
    return FieldError(name.split("[", 1)[0], f"{where}: {first['msg']}")


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

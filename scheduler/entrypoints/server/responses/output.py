"""Response bodies and stream events (OpenAI's Responses shapes) from the chat pipeline's message and deltas.

A response is served as a chat completion (``conversation``); its chat message, or each streamed
chat delta, becomes output items in this order: a ``reasoning`` item (the thinking
``--reasoning-parser`` split out), a ``message`` item with one ``output_text`` part (the content;
none when it is empty), one ``function_call`` item per tool call (``call_id`` the chat call's id).
A stream opens an item when its first piece comes and closes it when another kind of piece opens the
next one or the answer ends; so its items, and the response its ``response.completed`` event carries,
are the whole response's (but for an "auto" answer with text after a call: a stream cannot reopen the
message it closed, and sends a second message item).

``status`` is "incomplete" (``incomplete_details.reason`` "max_output_tokens") when the sample ran out
of tokens (``max_output_tokens`` or the context), else "completed"; the last item of an incomplete
response is "incomplete", every other item "completed". ``usage.output_tokens_details.reasoning_tokens``
counts the thinking's tokens up to and including its end tag (all of them when it never ended);
``input_tokens_details.cached_tokens`` the prompt's prefix-cache hits, ``cache_write_tokens`` 0.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from scheduler.entrypoints.output_processor import TextCompletion, TextRequestOutput
from scheduler.entrypoints.server.protocol import ChatCompletionRequest
from scheduler.entrypoints.server.responses.protocol import ResponsesRequest
from scheduler.entrypoints.server.serving import ResponseContext, usage
from scheduler.entrypoints.server.tool_calling.protocol import NamedToolChoice

Item = dict[str, Any]  # an output item
Event = dict[str, Any]  # a stream event


def new_id(prefix: str) -> str:
    """A fresh id of an object of the API: ``<prefix>_<32 hex digits>``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_tokens(sample: TextCompletion, ctx: ResponseContext, tokenizer) -> int:
    """The sample's thinking tokens: up to and including the first token that completes its end tag, all of
    them when the tag never came; 0 without a reasoning parser or when the sample did not think."""
    if ctx.reasoning is None or ctx.reasoning.message(sample.text)[0]["reasoning"] is None:
        return 0
    ids, end = sample.token_ids, ctx.reasoning.rules.end
    decode = lambda k: tokenizer.decode(ids[:k], skip_special_tokens=False)  # noqa: E731
    if end not in decode(len(ids)):
        return len(ids)
    low, high = 1, len(ids)  # the shortest prefix that holds the tag (a prefix's text only grows)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if end in decode(mid) else (mid + 1, high)
    return low


@dataclass
class ResponseBuilder:
    """One response's id, time, echoed settings and bodies, from its request and its chat completion's context."""

    request: ResponsesRequest
    chat: ChatCompletionRequest
    ctx: ResponseContext
    tokenizer: object
    id: str = field(init=False)  # vLLM's request_id when given (as vLLM), else resp_<hex>
    created_at: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.request.request_id or new_id("resp")

    def body(self, status: str, output: list[Item], usage_: dict | None) -> dict:
        """The Response object: its state, output and usage, and the request's settings echoed."""
        r = self.request
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": incomplete, "model": self.ctx.model, "output": output, "usage": usage_,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id, "metadata": r.metadata or {},
            "parallel_tool_calls": r.parallel_tool_calls, "temperature": r.temperature, "top_p": r.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in r.tools], "tool_choice": self._tool_choice(),
            "text": {"format": r.text.format.echoed()}, "reasoning": r.reasoning and r.reasoning.model_dump(),
            "store": r.store, "user": r.user, "safety_identifier": r.safety_identifier,
            "prompt_cache_key": r.prompt_cache_key, "background": False, "truncation": "disabled",
            "top_logprobs": 0, "service_tier": "default",
        }  # fmt: skip

    def _tool_choice(self) -> str | dict:
        """The tool choice served (the chat's default when unset), in the Responses shape."""
        choice = self.chat.chosen_tool
        return {"type": "function", "name": choice.function.name} if isinstance(choice, NamedToolChoice) else choice

    def usage(self, results: list[TextRequestOutput]) -> dict:
        """Responses' usage of the finished request (one prompt, one sample)."""
        chat = usage(results, [r.outputs for r in results])
        thinking = sum(reasoning_tokens(s, self.ctx, self.tokenizer) for r in results for s in r.outputs)
        return {
            "input_tokens": chat["prompt_tokens"], "output_tokens": chat["completion_tokens"],
            "total_tokens": chat["total_tokens"], "output_tokens_details": {"reasoning_tokens": thinking},
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
        }  # fmt: skip

    def whole(self, results: list[TextRequestOutput]) -> dict:
        """The finished response, from the chat completion's message."""
        choice = self.ctx.response(results)["choices"][0]
        message, status = choice["message"], _status(choice["finish_reason"])
        output = [_reasoning_item(new_id("rs"), message.get("reasoning") or "")] if message.get("reasoning") else []
        if message.get("content"):
            output.append(_message_item(new_id("msg"), message["content"]))
        for call in message.get("tool_calls") or []:
            output.append(_call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
        return self.body(status, _statuses(output, status), self.usage(results))


def _status(finish_reason: str | None) -> str:
    """The response's status of its sample's finish reason: cut off by its length limit is "incomplete"."""
    return "incomplete" if finish_reason == "length" else "completed"


def _statuses(output: list[Item], status: str) -> list[Item]:
    """The items with their status: the last one's the response's, every other "completed"."""
    for i, item in enumerate(output):
        item["status"] = status if i == len(output) - 1 else "completed"
    return output


def _reasoning_item(item_id: str, text: str) -> Item:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "in_progress"}  # fmt: skip


def _message_item(item_id: str, text: str) -> Item:
    return {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress",
            "content": [_text_part(text)]}  # fmt: skip


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str) -> Item:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": "in_progress"}  # fmt: skip


def sse_event(event: Event) -> str:
    """One server-sent event of a Responses stream (its type as the event name, as OpenAI sends it)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


@dataclass
class ResponseStream:
    """A streamed response's events, from the chat deltas of its one sample; ``sequence_number`` counts them."""

    builder: ResponseBuilder
    output: list[Item] = field(default_factory=list)  # items opened so far; the last one is open until closed
    finish_reason: str | None = None
    _open: bool = False
    _sequence: int = 0

    def start(self) -> list[Event]:
        """``response.created`` and ``response.in_progress``: the response, no output yet."""
        body = self.builder.body("in_progress", [], None)
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def feed(self, chunk: dict) -> list[Event]:
        """The events of one chat chunk: its reasoning, content and calls' pieces, in that order."""
        choice = chunk["choices"][0]
        delta, self.finish_reason = choice["delta"], choice["finish_reason"] or self.finish_reason
        events = self._text("reasoning", delta.get("reasoning")) + self._text("message", delta.get("content"))
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def finish(self, results: list[TextRequestOutput]) -> tuple[list[Event], dict]:
        """The last events (the open item's end, ``response.completed`` or ``.incomplete``) and the response."""
        status = _status(self.finish_reason)
        events = self._close(status)
        body = self.builder.body(status, self.output, self.builder.usage(results))
        return events + [self._event(f"response.{status}", response=body)], body

    def error(self, message: str) -> Event:
        """An ``error`` event: the request failed on the engine (the stream ends with it, as a whole one's 500)."""
        return self._event("error", code="internal_error", message=message, param=None)

    def _event(self, type_: str, **fields: Any) -> Event:
        """The next event, its fields as they are now (the items they show are written on afterwards)."""
        event = {"type": type_, "sequence_number": self._sequence, **copy.deepcopy(fields)}
        self._sequence += 1
        return event

    def _where(self) -> dict:
        """The open item's place: ``output_index`` and ``item_id``."""
        return {"output_index": len(self.output) - 1, "item_id": self.output[-1]["id"]}

    def _text(self, kind: str, text: str | None) -> list[Event]:
        """A piece of reasoning or content text, in the open item of its kind (opened if another is open)."""
        if not text:
            return []
        events = []
        if not (self._open and self.output[-1]["type"] == kind):
            item = _reasoning_item(new_id("rs"), "") if kind == "reasoning" else _message_item(new_id("msg"), "")
            events = self._add(item)
            part = item["content"][0]  # added empty: the part is added by an event of its own
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        part = self.output[-1]["content"][0]
        part["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self._event(name, **self._where(), content_index=0, delta=text, **extra)]

    def _call(self, call: dict) -> list[Event]:
        """A piece of a tool call: its first (with its id and name) opens a function_call item."""
        function, events = call["function"], []
        if "name" in function:
            events = self._add(_call_item(new_id("fc"), call["id"], function["name"], ""))
        arguments = function.get("arguments") or ""
        if not arguments:
            return events
        self.output[-1]["arguments"] += arguments
        return events + [self._event("response.function_call_arguments.delta", **self._where(), delta=arguments)]

    def _add(self, item: Item) -> list[Event]:
        """Close the open item and open ``item`` (added with nothing written yet)."""
        events = self._close("completed")
        self.output.append(item)
        self._open = True
        added = item | ({"content": []} if "content" in item else {})  # a text item's part comes in its own event
        return events + [self._event("response.output_item.added", output_index=len(self.output) - 1, item=added)]

    def _close(self, status: str) -> list[Event]:
        """The open item's end events (it ends with ``status``); none when no item is open."""
        if not self._open:
            return []
        self._open = False
        item, where = self.output[-1], self._where()
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"])]  # fmt: skip
        else:
            part = item["content"][0]
            done = ("response.reasoning_text.done", {}) if item["type"] == "reasoning" else (
                "response.output_text.done", {"logprobs": []})  # fmt: skip
            events = [self._event(done[0], **where, content_index=0, text=part["text"], **done[1]),
                      self._event("response.content_part.done", **where, content_index=0, part=part)]  # fmt: skip
        item["status"] = status
        return events + [self._event("response.output_item.done", output_index=where["output_index"], item=item)]

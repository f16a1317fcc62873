"""Serving a response: its preparation as a chat completion, and its stream of events (stored once finished).

The handler (``app``) sends the prepared request to the engine thread as it sends a chat completion's,
and answers with :meth:`output.ResponseBuilder.whole` or :func:`response_stream`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from scheduler.core.params import SamplingParams
from scheduler.entrypoints.server.async_engine import Event
from scheduler.entrypoints.server.frontend import Frontend, Prompts
from scheduler.entrypoints.server.responses.conversation import chat_request, input_messages, output_messages, renamed
from scheduler.entrypoints.server.responses.output import ResponseBuilder, ResponseStream, sse_event
from scheduler.entrypoints.server.responses.protocol import ResponsesRequest
from scheduler.entrypoints.server.responses.store import ResponseStore, StoredResponse
from scheduler.entrypoints.server.sampling import FieldError
from scheduler.entrypoints.server.serving import wants_chunk


async def prepare_response(front: Frontend, store: ResponseStore, body: ResponsesRequest
                           ) -> tuple[ResponseBuilder, Prompts, list[SamplingParams], list[dict]]:  # fmt: skip
    """A response's builder, prompts and parameters (its chat completion's), and the conversation to store with it
    (the previous response's, then this input); a chat field's refusal named as the response's field."""
    previous = store.get(body.previous_response_id, "previous_response_id") if body.previous_response_id else None
    history = previous.conversation + output_messages(previous.body["output"]) if previous else []
    chat = chat_request(body, history)
    encode = lambda: [(front.chat_prompt(chat), None)]  # noqa: E731
    try:
        limit = ("max_output_tokens", chat.max_completion_tokens)
        ctx, prompts, params = await front.prepare(chat, "chat", encode, 1, limit, None)
    except FieldError as e:
        raise renamed(e) from None
    return ResponseBuilder(body, chat, ctx, front.llm.tokenizer), prompts, params, history + input_messages(body)


async def response_stream(builder: ResponseBuilder, first: Event, events: AsyncIterator[Event], store: ResponseStore,
                          conversation: list[dict]) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events of a streamed response (stored once finished); closing it aborts the request."""
    stream, results = ResponseStream(builder), [None]
    async with contextlib.aclosing(events):
        for event in stream.start():
            yield sse_event(event)
        ev = first
        while ev is not None:
            if ev.error is not None:  # the engine failed mid-stream: tell the client, end the stream
                yield sse_event(stream.error(str(ev.error)))
                return
            results[ev.key] = ev.result or results[ev.key]
            for d in ev.deltas:
                if wants_chunk(d, False) and (chunk := builder.ctx.chunk(ev.key, d, False)) is not None:
                    for event in stream.feed(chunk):
                        yield sse_event(event)
            ev = await anext(events, None)
    last, response = stream.finish(results)
    if builder.request.store:  # before the last events: a client that leaves once it has them finds it stored
        store.put(StoredResponse(response, conversation))
    for event in last:
        yield sse_event(event)

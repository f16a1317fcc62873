"""The OpenAI-compatible FastAPI app: completions, chat completions, responses, models, health, metrics, utilities.

A handler validates the body (``protocol``); the :class:`Frontend` refuses what the server
cannot honour, tokenizes off the event loop and builds the engine's parameters; the engine
thread's events (``async_engine``) become OpenAI bodies (``serving``), whole or streamed. Every
error is an OpenAI error body (``errors``); bad input never gives a 500, and the server keeps
serving after every error. A response (``/v1/responses``, ``responses``) is served as the chat completion of
its conversation; finished ones are kept in a bounded in-memory store for GET, DELETE and
``previous_response_id``. vLLM's utility endpoints (``/tokenize``, ``/detokenize``, ``/version``,
``/ping``, and with ``enable_dev_endpoints`` ``/reset_prefix_cache``) are in ``utility_routes``. With
``convert="embed"`` (``--convert embed``) the same engine also serves ``POST /v1/embeddings`` (``embeddings``).

LoRA adapters (``ServerConfig.lora_modules``, loaded at start-up: a bad one stops the server from starting) are
models of their own: a request whose ``model`` names one runs through it, and ``/v1/models`` lists each with the
base model as its ``parent``. With ``allow_runtime_lora_updating``, ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's) add and remove them while serving (``lora_routes``).

Only the ``/v1`` routes require the API key when one is configured; ``/health``, ``/metrics`` and
the utility endpoints stay open, as vLLM's API-key check guards the paths under ``/v1`` alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from paged_kv.errors import describe
from scheduler.core.params import SamplingParams
from scheduler.entrypoints.llm import LLM
from scheduler.entrypoints.output_processor import TextRequestOutput
from scheduler.entrypoints.server.async_engine import AsyncEngine, Event
from scheduler.entrypoints.server.config import ServerConfig
from scheduler.entrypoints.server.embeddings import EmbeddingRequest, embeddings_response, prepare_embeddings
from scheduler.entrypoints.server.errors import BodyLimit, add_error_handlers
from scheduler.entrypoints.server.frontend import Frontend, authorize
from scheduler.entrypoints.server.lora_routes import add_lora_routes, load_lora_modules
from scheduler.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, error_body
from scheduler.entrypoints.server.responses.protocol import ResponsesRequest
from scheduler.entrypoints.server.responses.serving import prepare_response, response_stream
from scheduler.entrypoints.server.responses.store import ResponseStore, StoredResponse
from scheduler.entrypoints.server.sampling import FieldError
from scheduler.entrypoints.server.serving import ResponseContext, sse, wants_chunk
from scheduler.entrypoints.server.utility_routes import add_utility_routes


def build_app(llm: LLM, config: ServerConfig | None = None) -> FastAPI:
    """The app serving ``llm``'s model from one engine thread, as ``config`` says (default: ServerConfig())."""
    config = config or ServerConfig()
    names = config.served_model_names or (llm.model_name,)
    load_lora_modules(llm, config)
    engine = AsyncEngine(llm.engine, llm.tokenizer, max_in_flight=config.max_in_flight, model_name=names[0])
    front = Frontend(llm, engine, config, names)
    store = ResponseStore(config.responses_store_size)  # finished responses, per process

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        """Run the engine thread while the app serves."""
        engine.start()
        yield
        engine.stop()
        front.tokenizer_pool.shutdown(cancel_futures=True)

    app = FastAPI(title="paged-kv", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.state.engine, app.state.llm, app.state.frontend, app.state.responses = engine, llm, front, store
    add_error_handlers(app, config.max_request_bytes)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize(config.api_keys))])

    @app.get("/health")
    async def health() -> Response:
        """200 while the server is up."""
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @v1.get("/models")
    async def models() -> dict:
        """The served model, under each of its names, then its LoRA adapters."""
        return {"object": "list", "data": [front.card(name) for name in (*front.names, *front.loras)]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        """The served model under one of its names; 404 for any other."""
        return front.card(front.model_name(model_id))

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI completions, whole or streamed."""
        prompts = body.prompts()
        encode = lambda: [llm.encode(p, add_special_tokens=body.add_special_tokens) for p in prompts]  # noqa: E731
        limit = ("max_tokens", max(body.max_tokens, 1))  # max_tokens=0 (echo alone): one token, not shown
        prepared = await front.prepare(body, "completion", encode, len(prompts), limit, body.logprobs)
        return await _respond(request, engine, body, *prepared)

    @v1.post("/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        """OpenAI chat completions, whole or streamed."""
        encode = lambda: [(front.chat_prompt(body), None)]  # noqa: E731
        limit = ("max_completion_tokens", body.max_completion_tokens)
        limit = limit if limit[1] is not None else ("max_tokens", body.max_tokens)
        prepared = await front.prepare(body, "chat", encode, 1, limit, body.top_logprobs if body.logprobs else None)
        return await _respond(request, engine, body, *prepared)

    @v1.post("/responses")
    async def responses(body: ResponsesRequest, request: Request):
        """OpenAI responses, whole or streamed, served as the chat completion of the same conversation."""
        builder, prompts, params, conversation = await prepare_response(front, store, body)
        events = engine.generate(prompts, params, priority=builder.chat.priority, lora_request=builder.ctx.lora)
        first = await _next(events)
        if body.stream:
            stream = response_stream(builder, first, events, store, conversation)
            return StreamingResponse(stream, media_type="text/event-stream")
        results = await _unless_disconnected(request, _results(first, events, 1))
        if results is None:
            return Response(status_code=499)
        response = builder.whole(results)
        if body.store:
            store.put(StoredResponse(response, conversation))
        return response

    @v1.get("/responses/{response_id}")
    async def get_response(response_id: str, stream: bool = False) -> dict:
        """A stored response; 404 naming ``response_id`` for any other (``stream=true``, a background response's
        events again, is a 400: no response runs in the background here)."""
        if stream:
            raise FieldError("stream", describe("stream", True, "false: no response runs in the background here"))
        return store.get(response_id).body

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        """Forget a stored response; 404 naming ``response_id`` for any other."""
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    if config.convert == "embed":

        @v1.post("/embeddings")
        async def embeddings(body: EmbeddingRequest, request: Request):
            """OpenAI embeddings of every input, in input order (``--convert embed``)."""
            rid, model, prompts, params = await prepare_embeddings(front, body)
            events = engine.generate(prompts, [params] * len(prompts), priority=body.priority)
            first = await _next(events)  # admission errors (400, 503) surface here
            results = await _unless_disconnected(request, _results(first, events, len(prompts)))
            if results is None:
                return Response(status_code=499)
            return embeddings_response(rid, model, results, body.encoding_format)

    if config.allow_runtime_lora_updating:
        add_lora_routes(v1, front, engine)
    app.include_router(v1)
    add_utility_routes(app, front, engine)
    return app


async def _respond(request: Request, engine: AsyncEngine, body: SamplingFields, ctx: ResponseContext,
                   prompts: list[tuple[list[int], str | None]], params: list[SamplingParams]):  # fmt: skip
    events = engine.generate(prompts, params, priority=body.priority, lora_request=ctx.lora)
    first = await _next(events)  # admission errors (400, 503) surface here, before any byte is sent
    if body.stream:  # starlette cancels the stream when the client goes away
        return StreamingResponse(_stream(ctx, body, first, events, prompts), media_type="text/event-stream")
    results = await _unless_disconnected(request, _results(first, events, len(prompts)))
    return ctx.response(results) if results is not None else Response(status_code=499)


async def _results(first: Event, events: AsyncIterator[Event], num_prompts: int) -> list[TextRequestOutput]:
    """Every prompt's result; closing (or cancelling) this aborts the requests left."""
    results: list[TextRequestOutput | None] = [None] * num_prompts
    async with contextlib.aclosing(events):
        ev = first
        while ev is not None:
            _collect(ev, results)
            ev = await anext(events, None)
    return results


async def _unless_disconnected(request: Request, work: Awaitable):
    """The result of ``work``, or None (``work`` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next(events: AsyncIterator[Event]) -> Event:
    """The first event; raises the engine's rejection of the request if that is what it is."""
    ev = await anext(events)
    if ev.error is not None:
        await events.aclose()
        raise ev.error
    return ev


def _collect(ev: Event, results: list[TextRequestOutput | None]) -> None:
    if ev.error is not None:
        raise ev.error
    if ev.result is not None:
        results[ev.key] = ev.result


async def _stream(ctx: ResponseContext, body: SamplingFields, first: Event, events: AsyncIterator[Event],
                  prompts: list[tuple[list[int], str | None]]) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events of a streamed response; closing it (client gone) aborts the requests left."""
    usage = body.include_usage
    results: list[TextRequestOutput | None] = [None] * len(prompts)
    echoed: set[tuple[int, int]] = set()  # (prompt, sample) whose echo chunk went out
    async with contextlib.aclosing(events):
        if ctx.kind == "chat":
            for i in range(len(prompts) * ctx.n):
                yield sse(ctx.role_chunk(i, usage))
        ev = first
        while ev is not None:
            if ev.error is not None:  # the engine failed mid-stream: tell the client, end the stream
                yield sse(error_body(str(ev.error), "internal_error", code=500))  # as the whole response's 500
                break
            results[ev.key] = ev.result or results[ev.key]
            for d in map(ctx.shown, ev.deltas):
                if ctx.echo and (ev.key, d.index) not in echoed:  # a choice's first chunk: the prompt
                    echoed.add((ev.key, d.index))
                    yield sse(ctx.echo_chunk(ev.key, d.index, prompts[ev.key], ev.prompt_logprobs, usage))
                ctx.tally(ev.key, d)
                if wants_chunk(d, ctx.logprobs is not None) and (chunk := ctx.chunk(ev.key, d, usage)) is not None:
                    yield sse(chunk)
            ev = await anext(events, None)
        else:
            if usage:
                yield sse(ctx.usage_chunk(results))
    yield sse("[DONE]")

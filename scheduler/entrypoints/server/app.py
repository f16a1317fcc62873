"""The OpenAI-compatible FastAPI app: completions, chat completions, models, health, metrics.

Every error is an OpenAI error body: 400 for bad JSON, bad values and
requests the engine can never serve, 404 for an unknown model or route, 503
with Retry-After when the server holds ``max_in_flight`` requests. Bad input
never gives a 500, and the server keeps serving after every error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_kv.errors import InvalidArgumentError, PagedKVError, describe
from scheduler.core.params import SamplingParams
from scheduler.entrypoints.llm import LLM
from scheduler.entrypoints.output_processor import TextRequestOutput
from scheduler.entrypoints.server.async_engine import AsyncEngine, Event, Overloaded
from scheduler.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, error_body
from scheduler.entrypoints.server.serving import ResponseContext, sse, wants_chunk

RETRY_AFTER_S = 1


class ModelNotFound(InvalidArgumentError):
    """The request names a model this server does not serve (answered with 404)."""


def build_app(llm: LLM, *, max_in_flight: int = 256, model_names: tuple[str, ...] = ()) -> FastAPI:
    """The app serving ``llm``'s model from one engine thread, named ``model_names[0]`` (default: its own name)."""
    names = (*model_names, llm.model_name)
    engine = AsyncEngine(llm.engine, llm.tokenizer, max_in_flight=max_in_flight, model_name=names[0])

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        """Run the engine thread while the app serves."""
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="paged-kv", lifespan=lifespan)
    app.state.engine, app.state.llm = engine, llm
    _add_error_handlers(app)

    def check_model(name: str) -> None:
        if name not in names:
            raise ModelNotFound(describe("model", name, f"one of the served names {list(names)}"))

    @app.get("/health")
    async def health() -> Response:
        """200 while the server is up."""
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        """The served model."""
        card = {"id": names[0], "object": "model", "created": int(time.time()), "owned_by": "paged-kv",
                "max_model_len": llm.engine.model.config.max_position_embeddings}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI completions, whole or streamed."""
        check_model(body.model)
        prompts = [llm.encode(p) for p in body.prompts()]
        ctx = ResponseContext("completion", body.model, body.n, llm.tokenizer, body.logprobs)
        params = [_params(engine, body, len(ids), body.max_tokens, body.logprobs or 0) for ids, _ in prompts]
        return await _respond(request, engine, ctx, body, prompts, params)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        """OpenAI chat completions, whole or streamed."""
        check_model(body.model)
        ids = llm.chat_prompt(body.message_dicts())
        top = body.top_logprobs or 0
        ctx = ResponseContext("chat", body.model, body.n, llm.tokenizer, top if body.logprobs else None)
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = [_params(engine, body, len(ids), max_tokens, top)]
        return await _respond(request, engine, ctx, body, [(ids, None)], params)

    return app


def _params(engine: AsyncEngine, body: SamplingFields, prompt_len: int, max_tokens: int | None,
            logprobs: int) -> SamplingParams:  # fmt: skip
    """The engine's sampling parameters of one prompt; max_tokens defaults to what still fits."""
    if max_tokens is None:
        max_tokens = engine.max_new_tokens(prompt_len, body.n)
        if max_tokens < 1:
            expected = "a prompt that leaves room to answer"
            raise InvalidArgumentError(describe("prompt", f"{prompt_len} tokens", expected))
    return SamplingParams(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
        seed=body.seed, n=body.n, stop=tuple(body.stop or ()), stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos, logprobs=logprobs, cache_salt=body.cache_salt,
    )  # fmt: skip


async def _respond(request: Request, engine: AsyncEngine, ctx: ResponseContext, body: SamplingFields,
                   prompts: list[tuple[list[int], str | None]], params: list[SamplingParams]):  # fmt: skip
    events = engine.generate(prompts, params)
    first = await _next(events)  # admission errors (400, 503) surface here, before any byte is sent
    if body.stream:  # starlette cancels the stream when the client goes away
        return StreamingResponse(_stream(ctx, body, first, events, len(prompts)), media_type="text/event-stream")
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
                  num_prompts: int) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events of a streamed response; closing it (client gone) aborts the requests left."""
    usage = body.include_usage
    results: list[TextRequestOutput | None] = [None] * num_prompts
    async with contextlib.aclosing(events):
        if ctx.kind == "chat":
            for i in range(num_prompts * ctx.n):
                yield sse(ctx.role_chunk(i, usage))
        ev = first
        while ev is not None:
            if ev.error is not None:  # the engine failed mid-stream: tell the client, end the stream
                yield sse(error_body(str(ev.error), "internal_error"))
                break
            results[ev.key] = ev.result or results[ev.key]
            for d in ev.deltas:
                if wants_chunk(d, ctx.logprobs is not None):
                    yield sse(ctx.chunk(ev.key, d, usage))
            ev = await anext(events, None)
        else:
            if usage:
                yield sse(ctx.usage_chunk(results))
    yield sse("[DONE]")


# -- errors -------------------------------------------------------------------
def _error(status: int, message: str, type_: str, param: str | None = None, headers: dict | None = None):
    return JSONResponse(error_body(message, type_, param, status), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError):
        """Bad JSON or a field of the wrong type or range: 400."""
        errors = exc.errors()
        first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        return _error(400, f"{'.'.join(loc) or 'body'}: {first['msg']}", "invalid_request_error", ".".join(loc) or None)

    @app.exception_handler(PagedKVError)
    async def bad_value(_: Request, exc: PagedKVError):
        """A value the engine rejects (or a request it can never serve): 400."""
        message = str(exc)
        param = message.split("=", 1)[0] if "=" in message else None
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(ModelNotFound)
    async def no_model(_: Request, exc: ModelNotFound):
        """An unknown model: 404."""
        return _error(404, str(exc), "invalid_request_error", "model")

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded):
        """Too many requests in flight: 503 with Retry-After."""
        return _error(503, f"server overloaded: {exc}; retry later", "server_overloaded",
                      headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        """Unknown routes and methods, in OpenAI's error body."""
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception):
        """A server bug (never bad input): 500 in OpenAI's error body."""
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")

"""vLLM's utility endpoints beside the OpenAI API: tokenize, detokenize, version, ping, reset_prefix_cache.

``POST /tokenize`` takes vLLM's completion form (``prompt``) or chat form (``messages``, rendered
exactly as ``/v1/chat/completions`` renders them) and ``POST /detokenize`` token ids; both run the
tokenizer in the frontend's one-thread pool, off the event loop. ``GET|POST /ping`` is ``/health``
(vLLM's, for SageMaker); ``GET /version`` is paged-kv's package version. ``POST
/reset_prefix_cache`` is served only with ``ServerConfig.enable_dev_endpoints`` (vLLM's dev mode; 404
otherwise) and runs on the engine thread between two steps. None of them sits under ``/v1``, so none
requires the API key (vLLM's rule).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Body, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from scheduler.entrypoints.server.async_engine import AsyncEngine
from scheduler.entrypoints.server.frontend import Frontend
from scheduler.entrypoints.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

log = logging.getLogger("paged_kv.server")
PACKAGE = "paged-kv"
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def package_version() -> str:
    """paged-kv's installed version ("unknown" when it runs from a tree that is not installed)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def add_utility_routes(app: FastAPI, front: Frontend, engine: AsyncEngine) -> None:
    """Add the utility endpoints (``/reset_prefix_cache`` only with ``enable_dev_endpoints``) to ``app``."""

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """``/health`` under vLLM's (SageMaker's) name: 200 while the server is up."""
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        """paged-kv's version, as vLLM answers its own."""
        return {"version": package_version()}

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any] = Body()) -> dict:
        """A prompt's or a conversation's token ids (and their strings if asked), counted against max_model_len."""
        request = parse_body(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body)
        front.model_name(request.model)
        ids, strs = await _in_pool(front, lambda: _tokenize(front, request))
        return {"count": len(ids), "max_model_len": front.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: dict[str, Any] = Body()) -> dict:
        """The text of token ids; 400 naming ``tokens`` for an id out of the vocabulary."""
        request = parse_body(DetokenizeRequest, body)
        front.model_name(request.model)
        front.check_in_vocab("tokens", request.tokens)
        return {"prompt": await _in_pool(front, lambda: front.llm.tokenizer.decode(request.tokens))}

    if front.config.enable_dev_endpoints:

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            """Forget every cached block no running request holds (pinned prefixes stay); vLLM's dev endpoint."""
            forgotten = await engine.reset_prefix_cache()
            log.info("prefix cache reset: %d cached device blocks forgotten", forgotten)
            return Response(status_code=200)


def parse_body(model: type[M], body: dict[str, Any], rename: dict[str, str] | None = None) -> M:
    """``body`` as ``model``; a bad field is a 400 naming it (under ``rename``'s name for it, if any), as for the
    bodies FastAPI validates."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *_renamed(err["loc"], rename or {}))} for err in e.errors()]
        raise RequestValidationError(errors) from None


def _renamed(loc: tuple, rename: dict[str, str]) -> tuple:
    """An error's location with its top-level field renamed."""
    return (rename.get(loc[0], loc[0]), *loc[1:]) if loc else loc


async def _in_pool(front: Frontend, work: Callable[[], T]) -> T:
    """``work`` run in the frontend's tokenizer thread, off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(front.tokenizer_pool, work)


def _tokenize(front: Frontend, request: TokenizeCompletionRequest | TokenizeChatRequest
              ) -> tuple[list[int], list[str] | None]:  # fmt: skip
    """The request's token ids (a conversation as chat completions render it) and their strings if asked."""
    llm = front.llm
    if isinstance(request, TokenizeChatRequest):
        ids = front.chat_prompt(request)
    else:
        ids, _ = llm.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    strs = llm.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return ids, strs

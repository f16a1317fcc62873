"""Every error the server answers, in OpenAI's error body, and the exceptions that map to a status.

400: bad JSON, a field of the wrong type or range, an unknown field, a field the server does
not honour, a request the engine can never serve (``param`` names the field); 401: a missing
or wrong API key; 404: an unknown model, stored response or route; 413: a body over ``max_request_bytes``; 503
with Retry-After: the server holds ``max_in_flight`` requests. Bad input never gives a 500.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from paged_kv.errors import InvalidArgumentError, PagedKVError
from scheduler.entrypoints.server.async_engine import Overloaded, RequestFailed
from scheduler.entrypoints.server.protocol import error_body

RETRY_AFTER_S = 1
UNKNOWN_FIELD = "unknown field: not part of OpenAI's or vLLM's API for this endpoint"


class ModelNotFound(InvalidArgumentError):
    """The request names a model this server does not serve (answered with 404)."""


class NotFound(InvalidArgumentError):
    """The request names something else this server does not hold, e.g. a stored response (404 naming ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Unauthorized(InvalidArgumentError):
    """The request lacks the API key the server requires (answered with 401)."""


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 in OpenAI's error body before it is parsed.

    Starlette's limit (FastAPI's ``max_body_size``) answers a Content-Length past it in plain
    text, which OpenAI's clients cannot read. A declared length past the limit is answered at
    once, unread; a body streamed past it fails its read with a 413 the handlers answer.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await _too_large(self.max_bytes)(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise StarletteHTTPException(413)
            return message

        await self.app(scope, limited, send)

def _too_large(max_bytes: int) -> JSONResponse:
    message = f"request body too large: at most {max_bytes} bytes (--max-request-bytes)"
    return _error(413, message, "invalid_request_error")


def _error(status: int, message: str, type_: str, param: str | None = None, headers: dict | None = None):
    return JSONResponse(error_body(message, type_, param, status), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first validation error as a message and the top-level field it concerns."""
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "msg": "invalid request", "loc": ()}
    if first["type"] == "json_invalid":
        return f"invalid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    loc = [str(x) for x in first.get("loc", ())[1:]]  # after "body"
    message = UNKNOWN_FIELD if first["type"] == "extra_forbidden" else first["msg"]
    return f"{'.'.join(loc) or 'body'}: {message}", (loc[0] if loc else None)


def add_error_handlers(app: FastAPI, max_request_bytes: int) -> None:
    """Answer every error of ``app`` in OpenAI's error body."""

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError):
        """Bad JSON, or a field unknown, of the wrong type or range, or not supported: 400 naming it."""
        message, param = _validation_message(exc)
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(PagedKVError)
    async def bad_value(_: Request, exc: PagedKVError):
        """A value the server or the engine rejects (or a request it can never serve): 400."""
        message = str(exc)
        param = getattr(exc, "param", None) or (message.split("=", 1)[0] if "=" in message else None)
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(ModelNotFound)
    async def no_model(_: Request, exc: ModelNotFound):
        """An unknown model: 404."""
        return _error(404, str(exc), "invalid_request_error", "model")

    @app.exception_handler(NotFound)
    async def not_found(_: Request, exc: NotFound):
        """An unknown stored response (or other object): 404 naming the field that named it."""
        return _error(404, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(Unauthorized)
    async def unauthorized(_: Request, exc: Unauthorized):
        """No or a wrong API key: 401."""
        return _error(401, str(exc), "invalid_request_error", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded):
        """Too many requests in flight: 503 with Retry-After."""
        return _error(503, f"server overloaded: {exc}; retry later", "server_overloaded",
                      headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        """Unknown routes and methods, and bodies over the size limit, in OpenAI's error body."""
        if exc.status_code == 413:
            return _too_large(max_request_bytes)
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(RequestFailed)
    async def request_failed(_: Request, exc: RequestFailed):
        """A request the engine failed (it logged why): 500, answered like any error. A handler of its own, as
        Starlette re-raises what reaches the ``Exception`` one below to the server, which then drops the
        connection (a keep-alive client's next request on it met a reset)."""
        return _error(500, str(exc), "internal_error")

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception):
        """A server bug (never bad input): 500 in OpenAI's error body."""
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")

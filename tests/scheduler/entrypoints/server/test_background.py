"""Serving an app in a background thread: the port is held from the moment it is chosen."""

from __future__ import annotations

import socket

import httpx
import pytest

from scheduler.entrypoints.server import background
from scheduler.entrypoints.server.background import serve_in_thread


async def ok_app(scope, receive, send) -> None:
    """The smallest ASGI app uvicorn runs with lifespan on: every request gets 200 "ok"."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_port_another_process_takes_after_it_was_chosen_cannot_stop_the_server(monkeypatch):
    # a released port is anyone's: another pytest worker (or any process) may bind it before uvicorn does;
    # here a squatter takes the port free_port hands out, the worst case of that race
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    monkeypatch.setattr(background, "free_port", lambda host="127.0.0.1": squatter.getsockname()[1])
    try:
        with serve_in_thread(ok_app) as url:
            assert httpx.get(url, timeout=10).text == "ok"
            assert int(url.rsplit(":", 1)[1]) != squatter.getsockname()[1]
    finally:
        squatter.close()


def test_a_port_in_use_raises_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
            with serve_in_thread(ok_app, port=port):
                pass


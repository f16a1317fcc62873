"""The OpenAI-compatible HTTP server: FastAPI app, async engine loop, Prometheus metrics."""

from scheduler.entrypoints.server.app import build_app
from scheduler.entrypoints.server.async_engine import AsyncEngine
from scheduler.entrypoints.server.config import ServerConfig

__all__ = ["AsyncEngine", "ServerConfig", "build_app"]

"""Fixtures of the server tests: an offline LLM and a real uvicorn server on 127.0.0.1, both over the tiny model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from scheduler.core.config import CacheConfig, EngineConfig, SchedulerConfig
from scheduler.entrypoints.llm import LLM

ENGINE = EngineConfig(
    cache=CacheConfig(block_size=4, num_gpu_blocks=512), scheduler=SchedulerConfig(max_num_seqs=64), device="cpu"
)


@dataclass
class Served:
    """A running server: its base URL, app and LLM (the engine the worker thread steps)."""

    url: str
    app: object
    llm: LLM

    @property
    def engine(self):
        """The app's async engine."""
        return self.app.state.engine


@pytest.fixture(scope="module")
def offline(tiny_model_dir) -> LLM:
    """The reference: the same model and engine settings, run offline."""
    return LLM(tiny_model_dir, engine_config=ENGINE)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """A uvicorn server on a free port of 127.0.0.1, stopped when the module's tests are done."""
    from scheduler.entrypoints.server.app import build_app
    from scheduler.entrypoints.server.background import serve_in_thread
    from scheduler.entrypoints.server.config import ServerConfig

    llm = LLM(tiny_model_dir, engine_config=ENGINE)
    app = build_app(llm, ServerConfig(max_in_flight=64))
    with serve_in_thread(app) as url:
        yield Served(url, app, llm)


@pytest.fixture
def client(served):
    """The official OpenAI client pointed at the server (no retries: every status is what the server said)."""
    import openai

    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c

"""Fixtures of the server tests: an offline LLM and a real uvicorn server on 127.0.0.1, both over the tiny model."""

from __future__ import annotations

import pytest
from server_helpers import CHUNKED, ENGINE, serving

from scheduler.entrypoints.llm import LLM


@pytest.fixture(scope="module")
def offline(tiny_model_dir) -> LLM:
    """The reference: the same model and engine settings, run offline."""
    return LLM(tiny_model_dir, engine_config=ENGINE)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """A uvicorn server on a free port of 127.0.0.1, stopped when the module's tests are done."""
    from scheduler.entrypoints.server.config import ServerConfig

    with serving(tiny_model_dir, ServerConfig(max_in_flight=64)) as s:
        yield s


@pytest.fixture(scope="module")
def served_chunked(tiny_model_dir):
    """A server whose steps hold 32 tokens: prompts longer than that are prefilled in chunks."""
    from scheduler.entrypoints.server.config import ServerConfig

    with serving(tiny_model_dir, ServerConfig(max_in_flight=64), engine=CHUNKED) as s:
        yield s


@pytest.fixture
def client(served):
    """The official OpenAI client pointed at the server (no retries: every status is what the server said)."""
    import openai

    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def captured(served, monkeypatch) -> list:
    """Every (prompts, params) the app hands to the engine thread while the test runs."""
    calls, generate = [], served.engine.generate

    def spy(prompts, params, **kw):
        calls.append((prompts, params))
        return generate(prompts, params, **kw)

    monkeypatch.setattr(served.engine, "generate", spy)
    return calls


@pytest.fixture
def bos(served, monkeypatch) -> int:
    """The served tokenizer puts a BOS before a text when asked for its special tokens (the tiny one adds none)."""
    from tokenizers.processors import TemplateProcessing

    tok = served.llm.tokenizer
    bos_id = tok.bos_token_id
    processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos_id)])
    monkeypatch.setattr(tok._tokenizer, "post_processor", processor)
    return bos_id

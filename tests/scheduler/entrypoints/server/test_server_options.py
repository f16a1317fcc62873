"""The server's options under vLLM's names: API keys, served model names, max logprobs, request logging."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from server_helpers import CHAT, ENGINE, refused, serving

from paged_kv.errors import InvalidArgumentError, PagedKVError
from scheduler.entrypoints.llm import LLM
from scheduler.entrypoints.server.app import build_app
from scheduler.entrypoints.server.config import ServerConfig

OPTIONS = ServerConfig(served_model_names=("alpha", "beta"), api_keys=("key-1", "key-2"), max_logprobs=3,
                       log_requests=False)  # fmt: skip


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    """A server with two names, two API keys, at most 3 logprobs and no request log."""
    with serving(tiny_model_dir, OPTIONS) as s:
        yield s


def _client(served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer key-3"}, {"Authorization": "key-1"},
                                     {"Authorization": "Basic key-1"}])  # fmt: skip
def test_every_v1_route_needs_a_key_and_health_and_metrics_do_not(guarded, headers):
    for method, path in [("GET", "models"), ("GET", "models/alpha"), ("POST", "completions"),
                         ("POST", "chat/completions"), ("POST", "responses"), ("GET", "responses/resp_1"),
                         ("DELETE", "responses/resp_1")]:  # fmt: skip
        r = httpx.request(method, f"{guarded.url}/v1/{path}", json={"prompt": "hi"}, headers=headers)
        refused(r, None, status=401)
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200


def test_either_key_opens_the_api_to_the_official_client(guarded):
    for key in OPTIONS.api_keys:
        with _client(guarded, key) as c:
            assert c.completions.create(model="beta", prompt="hi", max_tokens=2).choices[0].finish_reason
    with _client(guarded, "wrong") as c, pytest.raises(openai.AuthenticationError):
        c.models.list()


def test_the_served_names_are_listed_and_answer_and_no_other(guarded):
    with _client(guarded, "key-1") as c:
        assert [m.id for m in c.models.list().data] == ["alpha", "beta"]
        assert c.models.retrieve("beta").id == "beta"
        assert c.chat.completions.create(model="beta", messages=CHAT, max_tokens=2).model == "beta"
        with pytest.raises(openai.NotFoundError) as info:
            c.completions.create(model=guarded.llm.model_name, prompt="hi", max_tokens=2)
        assert info.value.body["param"] == "model"
    body = {"prompt": "hi", "max_tokens": 2}  # no model: the first name, as vLLM
    r = guarded.post("completions", body, headers={"Authorization": "Bearer key-2"})
    assert r.json()["model"] == "alpha"


@pytest.mark.parametrize(("path", "field", "extra"), [("completions", "logprobs", {"prompt": "hi"}),
                                                      ("chat/completions", "top_logprobs",
                                                       {"messages": CHAT, "logprobs": True})])  # fmt: skip
def test_logprobs_are_bounded_by_max_logprobs(guarded, path, field, extra):
    auth = {"Authorization": "Bearer key-1"}
    body = {"model": "alpha", "max_tokens": 2, **extra}
    assert guarded.post(path, {**body, field: 3}, headers=auth).status_code == 200
    error = refused(guarded.post(path, {**body, field: 4}, headers=auth), field)
    assert "max_logprobs=3" in error["message"]


def test_requests_are_logged_unless_disabled(served, guarded, caplog):
    caplog.set_level(logging.INFO, logger="paged_kv.server")
    r = served.post("completions", {"model": served.model, "prompt": "hi", "max_tokens": 2, "user": "u-1"})
    assert [rec.getMessage() for rec in caplog.records if r.json()["id"] in rec.getMessage()]
    caplog.clear()
    r = guarded.post("completions", {"prompt": "hi", "max_tokens": 2}, headers={"Authorization": "Bearer key-1"})
    assert r.status_code == 200 and not [rec for rec in caplog.records if rec.name == "paged_kv.server"]


@pytest.mark.parametrize(("field", "value"), [("served_model_names", ("",)), ("api_keys", ["k"]),
                                              ("max_logprobs", 65), ("max_in_flight", 0), ("max_model_len", 0),
                                              ("max_request_bytes", 0), ("log_requests", 1),
                                              ("responses_store_size", -1),
                                              ("enable_dev_endpoints", "yes"),
                                              ("trust_request_chat_template", 1),
                                              ("exclude_tools_when_tool_choice_none", "no"),
                                              ("reasoning_parser", "granite")])  # fmt: skip
def test_bad_options_are_refused_naming_them(field, value):
    with pytest.raises(PagedKVError, match=field):
        ServerConfig(**{field: value})


def test_a_max_model_len_past_the_model_context_is_refused(tiny_model_dir):
    llm = LLM(tiny_model_dir, engine_config=ENGINE)
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        build_app(llm, ServerConfig(max_model_len=llm.engine.model.config.max_position_embeddings + 1))

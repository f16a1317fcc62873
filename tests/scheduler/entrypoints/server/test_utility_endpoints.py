"""vLLM's utility endpoints: /tokenize, /detokenize, /version, /ping, and /reset_prefix_cache (dev mode only)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import threading

import httpx
import pytest
from server_helpers import CHAT, refused, serving, wait_idle

from scheduler.entrypoints.server.config import ServerConfig

TEXT = "hello world, the quick brown fox"


def post(served, path: str, body: object, **kw) -> httpx.Response:
    """A raw JSON POST to ``/<path>`` (not under /v1)."""
    return httpx.post(f"{served.url}/{path}", json=body, timeout=60, **kw)


@pytest.mark.parametrize("special", [True, False])
def test_tokenize_a_prompt_gives_the_tokenizers_ids_and_strings(served, bos, special):
    tok = served.llm.tokenizer
    expected = tok.encode(TEXT, add_special_tokens=special)
    assert (expected[0] == bos) == special
    r = post(served, "tokenize", {"model": served.model, "prompt": TEXT, "add_special_tokens": special,
                                  "return_token_strs": True})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(expected), "max_model_len": served.app.state.frontend.max_model_len,
                        "tokens": expected, "token_strs": tok.convert_ids_to_tokens(expected)}  # fmt: skip


def test_tokenize_adds_special_tokens_by_default_and_no_strings_unless_asked(served, bos):
    body = post(served, "tokenize", {"prompt": TEXT}).json()
    assert body["tokens"] == served.llm.tokenizer.encode(TEXT, add_special_tokens=True) and body["tokens"][0] == bos
    assert body["token_strs"] is None and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == httpx.get(f"{served.url}/v1/models").json()["data"][0]["max_model_len"]


def test_tokenize_a_conversation_gives_exactly_the_prompt_a_chat_completion_runs(served, captured):
    body = post(served, "tokenize", {"model": served.model, "messages": CHAT, "return_token_strs": True}).json()
    chat = served.post("chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
    [([(ids, _)], _)] = captured
    assert body["tokens"] == ids and body["count"] == chat["usage"]["prompt_tokens"] == len(ids)
    assert body["token_strs"] == served.llm.tokenizer.convert_ids_to_tokens(ids)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": 3}, "prompt"), ({"prompt": TEXT, "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"prompt": TEXT, "nope": 1}, "nope"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": CHAT, "add_generation_prompt": "no"}, "add_generation_prompt"),  # a bool, as chat completions say
    ({"messages": CHAT, "prompt": TEXT}, "prompt"), ({}, "prompt"), ([TEXT], None),
])  # fmt: skip
def test_tokenize_refuses_a_bad_body_naming_the_field(served, body, param):
    refused(post(served, "tokenize", body), param)


def test_tokenize_and_detokenize_refuse_an_unknown_model_with_404(served):
    refused(post(served, "tokenize", {"model": "nope", "prompt": TEXT}), "model", 404)
    refused(post(served, "tokenize", {"model": "nope", "messages": CHAT}), "model", 404)
    refused(post(served, "detokenize", {"model": "nope", "tokens": [1]}), "model", 404)


def test_detokenize_round_trips_tokenize(served):
    ids = post(served, "tokenize", {"prompt": TEXT}).json()["tokens"]
    r = post(served, "detokenize", {"model": served.model, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": TEXT}


@pytest.mark.parametrize("bad", [[1, 10**6], [-1], ["a"]])
def test_detokenize_refuses_ids_outside_the_vocabulary_naming_tokens(served, bad):
    error = refused(post(served, "detokenize", {"tokens": bad}), "tokens")
    if bad == [1, 10**6]:
        vocab = served.llm.engine.model.config.vocab_size
        assert "1000000" in error["message"] and f"[0, {vocab})" in error["message"]


def test_version_is_the_installed_package_version(served):
    r = httpx.get(f"{served.url}/version")
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("paged-kv")}


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_is_health(served, method):
    r = httpx.request(method, f"{served.url}/ping")
    assert r.status_code == 200 == httpx.get(f"{served.url}/health").status_code


def test_utility_endpoints_need_no_api_key_and_v1_does(tiny_model_dir):
    with serving(tiny_model_dir, ServerConfig(api_keys=("k",))) as s:
        assert post(s, "tokenize", {"prompt": TEXT}).status_code == 200
        assert post(s, "detokenize", {"tokens": [1]}).status_code == 200
        assert httpx.get(f"{s.url}/version").status_code == httpx.get(f"{s.url}/ping").status_code == 200
        assert httpx.get(f"{s.url}/v1/models").status_code == 401


def test_reset_prefix_cache_is_not_served_without_dev_endpoints(served):
    refused(post(served, "reset_prefix_cache", None), None, 404)


# -- /reset_prefix_cache (--enable-dev-endpoints) ---------------------------------------------------
LONG = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 3}]


def dev_server(tiny_model_dir, system: str | None = None):
    """A server with the dev endpoints, ``system`` pinned as --pin-prompt pins it."""
    return serving(tiny_model_dir, ServerConfig(enable_dev_endpoints=True), system=system)


def cached(served, messages=LONG) -> tuple[int, str]:
    """A greedy chat completion's cached prompt tokens and its text."""
    body = served.post("chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0}).json()
    return body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["message"]["content"]


def test_a_reset_forgets_the_prefix_cache(tiny_model_dir):
    with dev_server(tiny_model_dir) as s:
        first, text = cached(s)
        again, same = cached(s)
        assert first == 0 and again > 0 and same == text
        r = post(s, "reset_prefix_cache", None)
        assert r.status_code == 200
        assert cached(s) == (0, text)
        assert cached(s) == (again, text)  # cached again from the request after the reset
        wait_idle(s)
        s.llm.engine.block_manager.check()


def hold_until_reset_queued(s, monkeypatch) -> list[bool]:
    """Hold the engine step after the first text until a reset is queued (then the reset is applied between that
    step and the next); the list gets, for each reset, whether a request was running then."""
    queued, running, released = threading.Event(), [], [0]
    reset, engine_reset, step = s.engine.reset_prefix_cache, s.llm.engine.reset_prefix_cache, s.engine.processor.step

    async def queue_reset() -> int:
        task = asyncio.ensure_future(reset())
        await asyncio.sleep(0)  # one turn of the loop: the task has queued its command
        queued.set()
        return await task

    def reset_engine() -> int:
        running.append(s.llm.engine.has_unfinished_requests())
        return engine_reset()

    def held():
        if released[0] and not queued.is_set():
            queued.wait(30)
        changed = step()
        released[0] += sum(bool(d.text) for _, deltas, _ in changed for d in deltas)
        return changed

    monkeypatch.setattr(s.engine, "reset_prefix_cache", queue_reset)
    monkeypatch.setattr(s.llm.engine, "reset_prefix_cache", reset_engine)
    monkeypatch.setattr(s.engine.processor, "step", held)
    return running


def test_a_reset_while_a_request_runs_leaves_it_as_a_lone_run_and_leaks_no_block(tiny_model_dir, monkeypatch):
    with dev_server(tiny_model_dir) as s:
        body = {"prompt": TEXT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        alone = s.post("completions", body).json()["choices"][0]["text"]  # and its prompt is cached
        running = hold_until_reset_queued(s, monkeypatch)
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data: "))
            events = [next(lines)]  # the request's first text: it runs
            assert post(s, "reset_prefix_cache", None).status_code == 200
            events += list(lines)
        assert running == [True] and events[-1] == "data: [DONE]"
        assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == alone
        wait_idle(s)
        bm = s.llm.engine.block_manager
        assert bm.stats().num_used == 0
        bm.check()


def test_a_pinned_system_prompt_survives_a_reset(tiny_model_dir):
    system = "the quick brown fox jumps over the lazy dog " * 2
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "hello there"}]
    with dev_server(tiny_model_dir, system) as s:
        held = dict(s.llm.engine.pins.held)
        assert held and post(s, "reset_prefix_cache", None).status_code == 200
        assert s.llm.engine.pins.held == held
        hit, _ = cached(s, chat)
        assert hit >= next(iter(held.values()))


def test_a_failing_reset_is_a_500_and_the_server_keeps_serving(tiny_model_dir, monkeypatch):
    with dev_server(tiny_model_dir) as s:

        def broken() -> int:
            raise RuntimeError("reset bug")

        monkeypatch.setattr(s.llm.engine, "reset_prefix_cache", broken)
        refused(post(s, "reset_prefix_cache", None), None, 500)
        assert cached(s)[0] == 0 and cached(s)[0] > 0

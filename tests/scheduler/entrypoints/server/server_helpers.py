"""Helpers of the server tests: the engine settings, a served app on a real uvicorn server, raw requests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from scheduler.core.config import CacheConfig, EngineConfig, SchedulerConfig
from scheduler.entrypoints.llm import LLM

ENGINE = EngineConfig(
    cache=CacheConfig(block_size=4, num_gpu_blocks=512), scheduler=SchedulerConfig(max_num_seqs=64), device="cpu"
)
CHUNKED = EngineConfig(
    cache=CacheConfig(block_size=4, num_gpu_blocks=512),
    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32), device="cpu",
)  # fmt: skip
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


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

    @property
    def model(self) -> str:
        """The first name the model is served under."""
        return self.app.state.frontend.names[0]

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        """A raw JSON POST to ``/v1/<path>``."""
        return httpx.post(f"{self.url}/v1/{path}", json=body, timeout=60, **kw)


@contextlib.contextmanager
def serving(model_dir, config=None, engine: EngineConfig = ENGINE, *, system: str | None = None) -> Iterator[Served]:
    """A uvicorn server on a free port of 127.0.0.1 serving a fresh LLM over ``model_dir`` as ``config`` says
    (``system``: a system prompt pinned first, as ``--pin-prompt`` pins it)."""
    from scheduler.entrypoints.pinned_prompt import pin_system_prompt
    from scheduler.entrypoints.server.app import build_app
    from scheduler.entrypoints.server.background import serve_in_thread

    llm = LLM(model_dir, engine_config=engine)
    if system is not None:
        pin_system_prompt(llm, system)
    app = build_app(llm, config)
    with serve_in_thread(app) as url:
        yield Served(url, app, llm)


def wait_idle(served: Served, timeout: float = 20.0) -> None:
    """Until the engine thread holds no request and the block manager no sequence."""
    deadline = time.monotonic() + timeout
    engine = served.llm.engine
    while engine.has_unfinished_requests() or engine.block_manager.seq_ids():
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)


def wait_aborted(served: Served, count: int, timeout: float = 20.0) -> None:
    """Until the engine thread has recorded ``count`` aborts: it counts one (after its metrics) only once the
    engine has let the request go, so an idle engine alone does not mean the abort is counted yet."""
    deadline = time.monotonic() + timeout
    while served.engine.num_aborted < count:
        assert time.monotonic() < deadline, f"{served.engine.num_aborted} aborts recorded, {count} awaited"
        time.sleep(0.01)


def hold_steps(served: Served, monkeypatch, *, after_texts: int = 1, timeout: float = 30.0) -> None:
    """Hold the engine step after the one that released the ``after_texts``-th piece of text (a stream's chunk)
    until no request is in flight; once, the steps after it run freely.

    A long request then takes no step between its client leaving and the server letting go of it (its handler
    queues the abort as it lets go), however fast or slow the machine: it is aborted, never run out. Past
    ``timeout`` the step runs anyway (the test then fails on what it checks, not by hanging).
    """
    processor, step, released, held_once = served.engine.processor, served.engine.processor.step, [0], [False]

    def held():
        if released[0] >= after_texts and not held_once[0]:
            held_once[0] = True
            deadline = time.monotonic() + timeout
            while served.engine.num_in_flight and time.monotonic() < deadline:
                time.sleep(0.005)
        changed = step()
        released[0] += sum(bool(d.text) for _, deltas, _ in changed for d in deltas)
        return changed

    monkeypatch.setattr(processor, "step", held)


def scrape(served: Served) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, its labels sorted) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(served.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def refused(r: httpx.Response, param: str | None, status: int = 400) -> dict:
    """Assert an OpenAI error body with this status naming ``param``; return the error."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["code"] == status
    assert error["param"] == param, error
    return error


def sse_events(text: str) -> list[dict]:
    """The JSON events of a server-sent-events body, up to ``[DONE]``."""
    import json

    data = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", text[-200:]
    return [json.loads(d) for d in data[:-1]]


def force_thinking(served: Served, monkeypatch, thought: str, parser: str = "deepseek_r1") -> None:
    """Make every sample start by writing the parser's start tag (``<think>``, mistral's ``[THINK]``) + ``thought``
    and then its end tag (the tokens the server waits for), as a reasoning model would: the tiny random model never
    does. What follows is the model's own, under the request's grammar, which the real engine starts after the tag."""
    from structured_helpers import force_tokens, opening

    from scheduler.entrypoints.server.reasoning.output import PARSERS

    start = served.llm.tokenizer.encode(PARSERS[parser].start + thought, add_special_tokens=False)
    script = start + list(served.app.state.frontend.reasoning_ends[parser])
    force_tokens(served.llm.engine, monkeypatch, opening(script))

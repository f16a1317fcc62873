"""One request's failure never hurts another: the others get 200 and their offline text, the faulty one an error.

Faults are planted in one request's sampling and detokenization while good requests run beside it in
the same batches; a failure of the model step itself fails every request in flight and the server
serves on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from fault_helpers import FAULT_SALT, FaultyTokenizer, plant_sampling_fault
from prometheus_client.parser import text_string_to_metric_families

from scheduler.core.params import SamplingParams

GOOD = [
    ("hello world", dict(max_tokens=16)),
    ("the quick brown fox", dict(max_tokens=12, n=2, temperature=1.0, seed=5)),
    ("numbers: 1 2 3", dict(max_tokens=14, temperature=0.7, seed=9, stream=True)),
]
FAULTY = "a library opens at nine"


def _body(served, prompt: str, fields: dict, **extra) -> dict:
    return {"model": served.llm.model_name, "prompt": prompt, "temperature": 0, "ignore_eos": True, **fields, **extra}


async def _send(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, object]:
    """(status, JSON body) of a whole response, or (status, [event data]) of a stream."""
    if not body.get("stream"):
        r = await client.post(url, json=body)
        return r.status_code, r.json()
    async with client.stream("POST", url, json=body) as r:
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        return r.status_code, [e if e == "[DONE]" else json.loads(e) for e in events]


def _run(served, bodies: list[dict]) -> list[tuple[int, object]]:
    """Send every body at once (they share the engine's batches); their answers in order."""

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(_send(client, served.url + "/v1/completions", b) for b in bodies))

    return asyncio.run(run())


def _texts(status_and_body) -> list[str]:
    status, body = status_and_body
    assert status == 200, body
    if isinstance(body, dict):
        return [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    chunks = [e for e in body[:-1] if e["choices"]]
    assert "error" not in str(body)
    return ["".join(c["choices"][0]["text"] for c in chunks)]


@pytest.fixture(scope="module")
def reference(offline) -> list[list[str]]:
    """The good requests' texts, run offline."""
    params = lambda f: SamplingParams(**{k: v for k, v in f.items() if k != "stream"}, ignore_eos=True)  # noqa: E731
    return [[s.text for s in offline.generate(p, params(f))[0].outputs] for p, f in GOOD]


def _wait_idle(served, timeout=20.0) -> None:
    """Until the engine holds no request and no block, and /metrics saw it; the pool's invariants hold."""
    engine, deadline = served.llm.engine, time.monotonic() + timeout
    while engine.has_unfinished_requests() or engine.block_manager.seq_ids() or served.engine.processor.requests:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)
    engine.block_manager.check()
    assert engine.block_manager.stats().num_used == 0


def _errors(served) -> float:
    text = httpx.get(served.url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "error")  # fmt: skip


def _assert_failed(answer, phase: str) -> None:
    """A whole response: a 500 naming the failure; a stream: an error event naming it, then [DONE]."""
    status, body = answer
    if isinstance(body, dict):
        assert status == 500 and body["error"]["type"] == "internal_error", body
        assert f"request failed: {phase} failed: " in body["error"]["message"]
    else:
        assert status == 200 and body[-1] == "[DONE]" and body[-2]["error"]["type"] == "internal_error"
        assert body[-2]["error"]["code"] == 500 and set(body[-2]["error"]) == {"message", "type", "param", "code"}
        assert f"request failed: {phase} failed: " in body[-2]["error"]["message"]


def test_a_sampling_fault_fails_its_requests_alone(served, reference, monkeypatch):
    plant_sampling_fault(monkeypatch, after=3)  # mid-decode, beside the good requests
    errors = _errors(served)
    bad = [_body(served, FAULTY, dict(max_tokens=10), cache_salt=FAULT_SALT),
           _body(served, FAULTY + "!", dict(max_tokens=10, n=2, stream=True), cache_salt=FAULT_SALT)]  # fmt: skip
    answers = _run(served, [_body(served, p, f) for p, f in GOOD] + bad)
    assert [_texts(a) for a in answers[: len(GOOD)]] == reference
    for answer in answers[len(GOOD) :]:
        _assert_failed(answer, "sampling")
    _wait_idle(served)
    assert _errors(served) == errors + 3  # one per sample of the failed requests


def test_a_detokenization_fault_fails_its_request_alone(served, reference):
    processor = served.engine.processor
    tokenizer, processor.tokenizer = processor.tokenizer, FaultyTokenizer(processor.tokenizer,
                                                                           served.llm.encode(FAULTY)[0])  # fmt: skip
    try:
        answers = _run(served, [_body(served, p, f) for p, f in GOOD] + [_body(served, FAULTY, dict(max_tokens=8))])
    finally:
        processor.tokenizer = tokenizer
    assert [_texts(a) for a in answers[: len(GOOD)]] == reference
    _assert_failed(answers[-1], "detokenization")
    _wait_idle(served)


def test_a_top_k_the_sampler_cannot_hold_never_fails_another_request(served, reference):
    huge = _body(served, FAULTY, dict(max_tokens=8, temperature=1.0, top_k=10**20))
    answers = _run(served, [_body(served, p, f) for p, f in GOOD] + [huge])
    assert [_texts(a) for a in answers[: len(GOOD)]] == reference
    status, body = answers[-1]
    assert status == 400 or (status == 500 and "sampling failed" in body["error"]["message"]), body
    _wait_idle(served)


def test_a_model_step_failure_fails_every_request_in_flight_and_the_server_serves_on(served, reference, caplog):
    runner, fired, live = served.llm.engine.runner, [], served.llm.engine.scheduler.requests
    run = runner.run

    def failing(out):
        # until every request is in flight (they arrive over HTTP, the last maybe long after the first on a loaded
        # machine) the model waits: none can run out before the last has come (the engine takes it in next)
        deadline = time.monotonic() + 30
        while not fired and served.engine.num_in_flight < len(GOOD):
            assert time.monotonic() < deadline, "the requests never all arrived"
            time.sleep(0.005)
        # once every request is in and has its first token out (its stream has begun): not at a fixed step
        if len(live) == len(GOOD) and all(g.seqs[0].num_outputs for g in live.values()) and not fired:
            fired.append(1)
            raise RuntimeError("planted forward fault")
        return run(out)

    runner.run = failing
    # none can end before the fault: it fires a few steps after the last arrived, and each takes 400 tokens
    long = [_body(served, p, f | {"max_tokens": 400}) for p, f in GOOD]
    try:
        with caplog.at_level(logging.ERROR):
            answers = _run(served, long)
    finally:
        runner.run = run
    assert fired
    for status, body in answers:
        message = body["error"]["message"] if isinstance(body, dict) else body[-2]["error"]["message"]
        assert "engine step failed, every request aborted: RuntimeError: planted forward fault" in message
    assert "engine step failed (RuntimeError: planted forward fault); aborting all 3 live requests" in caplog.text
    _wait_idle(served)
    assert [_texts(a) for a in _run(served, [_body(served, p, f) for p, f in GOOD])] == reference


def _post_keep_alive(sock, host: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` to /v1/completions on an open HTTP/1.1 connection; (status, JSON body) of the answer."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()  # fmt: skip
    sock.sendall(head + data)
    reader = sock.makefile("rb")
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline().strip()) != b"":
        name, _, value = line.decode().partition(":")
        headers[name.lower()] = value.strip()
    return status, json.loads(reader.read(int(headers["content-length"])))


def test_a_request_failure_keeps_the_connection_alive(served, monkeypatch):
    """A request that fails on the engine is an answered 500, not a server error: the client's keep-alive connection
    stays open for its next request (uvicorn closed it after an exception reached it, and a client reusing the
    connection, as the openai client's pool does, got a reset)."""
    plant_sampling_fault(monkeypatch)
    url, faulty = urlsplit(served.url), _body(served, FAULTY, dict(max_tokens=4), cache_salt=FAULT_SALT)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        status, body = _post_keep_alive(sock, url.netloc, faulty)
        assert status == 500 and "request failed: sampling failed" in body["error"]["message"], body
        status, body = _post_keep_alive(sock, url.netloc, _body(served, "hello world", dict(max_tokens=4)))
        assert status == 200 and body["choices"][0]["text"], body
    _wait_idle(served)

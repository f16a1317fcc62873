"""End to end: SmolLM2 through the server equals SmolLM2 offline; the ``paged-kv serve`` command serves."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from scheduler.core.config import CacheConfig, EngineConfig
from scheduler.core.params import SamplingParams
from scheduler.entrypoints.llm import LLM
from scheduler.entrypoints.server.app import build_app
from scheduler.entrypoints.server.background import serve_in_thread
from scheduler.model.loader import DEFAULT_MODEL_NAME, LoadedModel

QUESTIONS = ["What is the capital of France?", "Why is the sky blue?"]
MAX_TOKENS = 16


@pytest.mark.slow
def test_smollm2_greedy_chat_through_the_server_equals_offline(smollm2):
    config = EngineConfig(cache=CacheConfig(num_gpu_blocks=64))
    llm = LLM(LoadedModel(*smollm2, DEFAULT_MODEL_NAME), engine_config=config)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    offline = [o.outputs[0].text for o in llm.chat(chats, SamplingParams(max_tokens=MAX_TOKENS))]
    assert all(offline)
    with serve_in_thread(build_app(llm)) as url, openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as c:
        for chat, ref in zip(chats, offline):
            r = c.chat.completions.create(model=llm.model_name, messages=chat, max_tokens=MAX_TOKENS,
                                          temperature=0)  # fmt: skip
            assert r.choices[0].message.content == ref
        stream = c.chat.completions.create(model=llm.model_name, messages=chats[0], max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)  # fmt: skip
        assert "".join(ch.choices[0].delta.content or "" for ch in stream) == offline[0]


@pytest.mark.slow
def test_the_serve_command_starts_answers_and_stops(tiny_model_dir):
    # port 0: the server binds a free port itself and logs it (a port chosen here and bound by the child seconds
    # later could be taken meanwhile, e.g. by the other pytest worker)
    cmd = [sys.executable, "-m", "scheduler.entrypoints.cli", "serve", "--model", str(tiny_model_dir),
           "--port", "0", "--kv-blocks", "64", "--block-size", "4", "--served-model-name", "tiny", "tiny-2",
           "--api-key", "secret", "--kv-cache-dtype", "int8", "--max-model-len", "128",
           "--disable-log-requests"]  # fmt: skip
    root = Path(__file__).resolve().parents[4]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = _served_url(proc)
        port = int(url.rsplit(":", 1)[1])
        _wait_healthy(f"http://127.0.0.1:{port}/health", proc)  # open without the key
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="secret", max_retries=0) as c:
            assert [(m.id, m.max_model_len) for m in c.models.list().data] == [("tiny", 128), ("tiny-2", 128)]
            r = c.completions.create(model="tiny-2", prompt="hello", max_tokens=5, temperature=0)
            assert r.usage.completion_tokens >= 1 and r.model == "tiny-2"
            with pytest.raises(openai.BadRequestError):
                c.completions.create(model="tiny", prompt="hello", max_tokens=128)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) is not None


def _served_url(proc: subprocess.Popen, timeout: float = 90.0) -> str:
    """The URL uvicorn logs once it listens ("Uvicorn running on http://host:port"); its stderr drained on."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.decode(errors="replace")) for line in proc.stderr],
                     daemon=True).start()  # fmt: skip
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=0.2))
        except queue.Empty:
            assert proc.poll() is None, "".join(seen)
            continue
        found = re.search(r"Uvicorn running on (http://\S+)", seen[-1])
        if found:
            return found.group(1)
    raise AssertionError("the server never said where it listens:\n" + "".join(seen))


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError("the server did not come up")

"""The OpenAI-compatible server under load against the offline engine on the same workload, same run.

A mixed chat workload on SmolLM2-135M-Instruct (``scheduler.entrypoints.workload``: short questions, half
behind one long shared system prompt, greedy answers stopping at EOS or a per-request limit in
[max_tokens / 4, max_tokens]) arrives as a seeded Poisson process at ``--request-rate``
requests/s (``inf``: all at once). The same arrival times drive both runs:

- offline: the token-level ``LLMEngine`` in this process, each request added at the first step
  boundary after its arrival; latencies from its scheduled arrival to the engine's timestamps;
- server: ``paged-kv``'s FastAPI app on uvicorn (127.0.0.1, a background thread), an asyncio
  load generator with the official ``AsyncOpenAI`` client streaming chat completions; times
  taken by the client from the scheduled arrival to the first content chunk and to the last.

Each run gets a fresh engine with the same settings (so neither profits from the other's
prefix cache); the modes alternate ``--repeat`` times and the fastest run of each is reported.
Reported: request throughput, generated tokens/s, TTFT and TPOT p50/p99, and the server /
offline ratio of each. Client, server and engine share one Python process (and
its GIL), so the overhead is an upper bound of what a separate client process would see.

    .venv/bin/python benchmarks/bench_serve.py [--num-requests 16] [--max-tokens 32] [--request-rate 4] [--repeat 2]
    .venv/bin/python -m pytest benchmarks/bench_serve.py --benchmark-only -s
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from scheduler.core.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from scheduler.core.params import SamplingParams  # noqa: E402
from scheduler.engine.llm_engine import LLMEngine  # noqa: E402
from scheduler.entrypoints.llm import LLM  # noqa: E402
from scheduler.entrypoints.server.app import build_app  # noqa: E402
from scheduler.entrypoints.server.background import serve_in_thread  # noqa: E402
from scheduler.entrypoints.server.config import ServerConfig  # noqa: E402
from scheduler.entrypoints.workload import ChatRequest, chat_workload  # noqa: E402
from scheduler.model.loader import (  # noqa: E402
    DEFAULT_MODEL_NAME,
    LoadedModel,
    load_smollm2,  # noqa: E402
)

CONFIG = EngineConfig(
    cache=CacheConfig(block_size=16, num_gpu_blocks=256),
    scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
    device="cpu",
)

WARM_UP_IDS = [1, 2, 3, 4]  # one short request before each timed run: first-call costs stay out of the figures


@dataclass(frozen=True)
class Timing:
    """One request: seconds from its arrival to its first token and to its end, and its output tokens."""

    ttft: float
    e2e: float
    tokens: int

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request arrives (Poisson process; all at 0 for rate inf)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
    return out


def run_offline(engine: LLMEngine, requests: list[ChatRequest], offsets: list[float]) -> tuple[float, list[Timing]]:
    """Wall seconds and per-request timings of the engine serving the requests as they arrive (after a warm-up)."""
    engine.generate([WARM_UP_IDS], SamplingParams(max_tokens=2), use_tqdm=False)
    pending, done = list(zip(offsets, requests)), []
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, r = pending.pop(0)
            engine.add_request(r.request_id, r.prompt_token_ids, r.params)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        done += engine.step()
    wall = time.perf_counter() - start
    # latencies from the scheduled arrival: a request arriving mid-step waits for that step, as at the server
    arrived = {r.request_id: start + offset for offset, r in zip(offsets, requests)}
    return wall, [Timing(o.first_token_time - arrived[o.request_id], o.finish_time - arrived[o.request_id],
                         len(o.outputs[0].token_ids)) for o in done]  # fmt: skip


async def _one_request(client, model: str, r: ChatRequest, delay: float) -> Timing:
    sent = time.perf_counter() + delay  # latencies from the scheduled arrival, as offline (client lag included)
    await asyncio.sleep(delay)
    first, tokens = None, 0
    stream = await client.chat.completions.create(
        model=model, messages=r.messages, max_tokens=r.params.max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return Timing((first or end) - sent, end - sent, tokens)


async def _load(url: str, model: str, requests: list[ChatRequest], offsets: list[float]) -> list[Timing]:
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                           http_client=httpx.AsyncClient(limits=limits, timeout=600)) as client:  # fmt: skip
        return await asyncio.gather(*(_one_request(client, model, r, d) for r, d in zip(requests, offsets)))


def run_server(llm: LLM, requests: list[ChatRequest], offsets: list[float]) -> tuple[float, list[Timing]]:
    """Wall seconds and per-request timings of the server under the load generator (after one warm-up request)."""
    with serve_in_thread(build_app(llm, ServerConfig(max_in_flight=len(requests), log_requests=False))) as url:
        warm = {"model": llm.model_name, "prompt": WARM_UP_IDS, "max_tokens": 2, "temperature": 0}
        httpx.post(url + "/v1/completions", json=warm, timeout=600).raise_for_status()
        start = time.perf_counter()
        timings = asyncio.run(_load(url, llm.model_name, requests, offsets))
        return time.perf_counter() - start, timings


def figures(wall: float, timings: list[Timing]) -> dict[str, float]:
    """Throughput and latency percentiles of a run."""
    ttft = [t.ttft for t in timings]
    tpot = [t.tpot for t in timings if t.tpot is not None]
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else 0.0  # noqa: E731
    return {
        "req_per_s": len(timings) / wall, "tok_per_s": sum(t.tokens for t in timings) / wall,
        "tokens": sum(t.tokens for t in timings), "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99), "wall_s": wall,
    }  # fmt: skip


def compare(num_requests: int = 16, max_tokens: int = 32, request_rate: float = 4.0, seed: int = 0,
            repeat: int = 2) -> dict:  # fmt: skip
    """Run the workload offline and through the server, alternating ``repeat`` times; the fastest run of each."""
    torch.set_num_threads(1)
    hf, tokenizer = load_smollm2()
    requests = chat_workload(tokenizer, num_requests, max_tokens, seed=seed)
    offsets = arrivals(num_requests, request_rate, seed)
    runs: dict[str, list[dict]] = {"offline": [], "server": []}
    for _ in range(repeat):  # alternating, so a burst of load on a shared machine hits both modes alike
        runs["offline"].append(figures(*run_offline(LLMEngine.from_hf(hf, CONFIG), requests, offsets)))
        llm = LLM(LoadedModel(hf, tokenizer, DEFAULT_MODEL_NAME), engine_config=CONFIG)
        runs["server"].append(figures(*run_server(llm, requests, offsets)))
    best = {mode: min(rs, key=lambda f: f["wall_s"]) for mode, rs in runs.items()}
    walls = {mode: [round(f["wall_s"], 1) for f in rs] for mode, rs in runs.items()}
    return {**best, "walls": walls, "num_requests": num_requests, "max_tokens": max_tokens,
            "request_rate": request_rate}  # fmt: skip


def report(f: dict) -> str:
    """A markdown table of both runs and their ratio."""
    off, srv = f["offline"], f["server"]
    rows = [("requests/s", "req_per_s"), ("generated tokens/s", "tok_per_s"), ("TTFT p50 ms", "ttft_p50_ms"),
            ("TTFT p99 ms", "ttft_p99_ms"), ("TPOT p50 ms", "tpot_p50_ms"), ("TPOT p99 ms", "tpot_p99_ms")]  # fmt: skip
    lines = [
        f"{f['num_requests']} chat requests at {f['request_rate']} req/s, answers <= {f['max_tokens']} tokens; "
        f"generated tokens: offline {off['tokens']}, server {srv['tokens']}; walls of the runs (s): "
        f"offline {f['walls']['offline']}, server {f['walls']['server']}; fastest of each reported",
        f"machine: {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, 1 thread",
        "", "| measurement | offline engine | server (HTTP, streaming) | server / offline |", "|---|---:|---:|---:|",
    ]  # fmt: skip
    for label, key in rows:
        ratio = srv[key] / off[key] if off[key] else float("nan")
        lines.append(f"| {label} | {off[key]:.2f} | {srv[key]:.2f} | {ratio:.2f}x |")
    return "\n".join(lines)


def test_server_vs_offline_engine(benchmark):
    """pytest-benchmark entry: one round of the whole comparison, figures printed."""
    result = benchmark.pedantic(compare, rounds=1, iterations=1)
    print("\n" + report(result))
    benchmark.extra_info.update({f"{k}_{m}": v for k in ("offline", "server") for m, v in result[k].items()})


def main() -> None:
    """Command-line entry."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=4.0, help="requests/s (inf: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=2, help="runs of each mode, alternating; the fastest is reported")
    a = p.parse_args()
    print(report(compare(a.num_requests, a.max_tokens, a.request_rate, a.seed, a.repeat)))


if __name__ == "__main__":
    main()

"""Prometheus metrics of the server, named like vLLM's under a ``paged_kv:`` prefix.

Gauges and engine counters are read at scrape time from a snapshot the
engine thread publishes after every step (the scrape never touches the
engine); latency histograms are observed when a request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from scheduler.engine.llm_engine import LLMEngine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's queues, pool and cache figures after a step."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0
    preemptions: int = 0
    cow_copies: int = 0

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineSnapshot:
        """Read the figures (call from the engine's own thread)."""
        s, stats = engine.scheduler, engine.block_manager.stats()
        return cls(
            running=len(s.running), waiting=len(s.waiting), swapped=len(s.swapped), kv_usage=stats.usage,
            prefix_hit_rate=stats.hit_rate, preemptions=sum(s.num_preemptions.values()),
            cow_copies=stats.num_cow_copies,
        )  # fmt: skip


class ServerMetrics:
    """The server's registry: engine gauges and counters, token counters and latency histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.snapshot = EngineSnapshot()
        self.registry.register(self)
        r = self.registry
        self.ttft = Histogram("paged_kv:time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram("paged_kv:time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("paged_kv:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("paged_kv:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("paged_kv:generation_tokens", "Generated tokens.", registry=r)
        self.requests = Counter("paged_kv:request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)  # fmt: skip

    def record_finished(self, *, reason: str, prompt_tokens: int, output_tokens: int, arrival: float,
                        first_token: float | None, finish: float) -> None:  # fmt: skip
        """Count a finished request and observe its latencies (seconds, perf_counter clock)."""
        self.requests.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.e2e.observe(finish - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if output_tokens > 1:
                self.tpot.observe((finish - first_token) / (output_tokens - 1))

    def collect(self):
        """The engine gauges and counters of the latest snapshot (prometheus_client collector protocol)."""
        s = self.snapshot
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", s.running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.waiting),
            ("num_requests_swapped", "Requests swapped out to the CPU pool.", s.swapped),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s.kv_usage),
            ("prefix_cache_hit_rate", "Prefix-cache hit rate over queried prompt tokens.", s.prefix_hit_rate),
        ):
            yield GaugeMetricFamily(f"paged_kv:{name}", doc, value=value)
        yield CounterMetricFamily("paged_kv:num_preemptions", "Preemptions (recompute and swap).", value=s.preemptions)
        yield CounterMetricFamily("paged_kv:cow_copies", "Copy-on-write block copies.", value=s.cow_copies)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

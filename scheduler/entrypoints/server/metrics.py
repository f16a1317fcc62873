"""Prometheus metrics of the server under vLLM's names, labels and meanings (vLLM's Grafana dashboard reads them).

Every ``vllm:`` metric carries vLLM's labels ``model_name`` (the served name) and ``engine``
("0"). Gauges and cumulative engine counters are read at scrape time from a snapshot the engine
thread publishes (the scrape never touches the engine); token counters and histograms are
observed by the engine thread as requests progress. A request is one prompt with its ``n``
samples; what each metric counts is listed in ``docs/metrics.md``. Metrics vLLM lacks keep the
``paged_kv:`` prefix.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from scheduler.engine.kv_events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE
from scheduler.engine.llm_engine import LLMEngine
from scheduler.engine.metrics import RequestTimes
from scheduler.engine.spec_decode import SpecDecodeStats
from scheduler.engine.tiered_cache import TierStats
from scheduler.entrypoints.server.tier_metrics import tier_families

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")
COMPLETED = ("stop", "length")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(highest: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``highest`` (token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > highest:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(frozen=True)
class LoRAInfo:
    """vLLM's ``vllm:lora_requests_info`` labels: max_loras, the adapters of waiting and of running requests."""

    max_lora: int
    waiting: str  # adapter names, comma-separated, sorted
    running: str
    at: float  # when it was read (the gauge's value: vLLM's)

    @classmethod
    def of(cls, engine: LLMEngine) -> LoRAInfo | None:
        """Read the scheduler's queues (engine thread); None when LoRA is off."""
        config = engine.config.lora_config
        if config is None:
            return None
        s = engine.scheduler
        names = lambda groups: ",".join(sorted({g.lora.name for g in groups if g.lora is not None}))  # noqa: E731
        return cls(config.max_loras, names([*s.waiting, *s.swapped]), names(s.running), time.time())


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's queues, pools and cumulative cache figures after a step."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_usage: float = 0.0
    cpu_usage: float = 0.0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, once per admission
    prefix_hits: int = 0
    preemptions: int = 0
    cow_copies: int = 0
    tiers: TierStats | None = None  # the lower tiers' figures (None: no host tier)
    spec: SpecDecodeStats | None = None  # speculative decoding's counters (None: off)
    lora: LoRAInfo | None = None  # the adapters of the running and waiting requests (None: LoRA off)

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineSnapshot:
        """Read the figures (call from the engine's own thread)."""
        s, stats = engine.scheduler, engine.block_manager.stats()
        cpu_blocks = engine.block_manager.config.num_cpu_blocks
        return cls(
            running=len(s.running), waiting=len(s.waiting), swapped=len(s.swapped), kv_usage=stats.usage,
            cpu_usage=stats.num_cpu_used / cpu_blocks if cpu_blocks else 0.0, prefix_queries=stats.num_queried_tokens,
            prefix_hits=stats.num_hit_tokens, preemptions=sum(s.num_preemptions.values()),
            cow_copies=stats.num_cow_copies, tiers=engine.tiers.stats(stats) if engine.tiers is not None else None,
            spec=engine.spec.stats.copy() if engine.spec is not None else None, lora=LoRAInfo.of(engine),
        )  # fmt: skip

    @property
    def hits_by_medium(self) -> dict[str, int]:
        """Prefix-cache hit tokens by the tier that held them: GPU (the device pool), CPU (host), STORAGE (disk)."""
        t = self.tiers
        lower = (t.host_hit_tokens, t.disk_hit_tokens) if t is not None else (0, 0)
        return {MEDIUM_GPU: self.prefix_hits - sum(lower), MEDIUM_CPU: lower[0], MEDIUM_STORAGE: lower[1]}


@dataclass(frozen=True, kw_only=True)
class FinishedRequest:
    """A request at its end as the metrics count it: its samples' finish reasons and tokens, its times."""

    reasons: tuple[str, ...]  # one per sample (n)
    prompt_tokens: int
    generation_tokens: tuple[int, ...]  # one per sample
    max_tokens: int
    e2e: float  # the server's arrival to its last output
    times: RequestTimes | None  # the engine's phases (None: no token was produced)

    @property
    def completed(self) -> bool:
        """Whether every sample ended by a stop condition or its length (not aborted, not failed)."""
        return all(r in COMPLETED for r in self.reasons)


class ServerMetrics:
    """The server's registry: engine gauges and counters from a snapshot, token counters, histograms."""

    def __init__(self, model_name: str = "paged-kv", max_model_len: int = 8192) -> None:
        self.registry = r = CollectorRegistry()
        self.labels = (model_name, "0")
        self.snapshot = EngineSnapshot()
        r.register(self)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(*self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*self.labels)

        tokens = buckets_1_2_5(max_model_len)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests whose prefill completed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens, every sample counted.")
        success = Counter("vllm:request_success", "Finished samples by finish reason.", (*LABELS, "finished_reason"),
                          registry=r)  # fmt: skip
        self.success = {reason: success.labels(*self.labels, reason) for reason in FINISH_REASONS}
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step.", ITERATION_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Inter-token latency (one per output token "
                              "after a sample's first).", TPOT_BUCKETS)  # fmt: skip
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduled.",
                               REQUEST_BUCKETS)  # fmt: skip
        self.prefill = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                                 REQUEST_BUCKETS)  # fmt: skip
        self.decode = histogram("vllm:request_decode_time_seconds", "First token to last.", REQUEST_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "First scheduled to last token.",
                                   REQUEST_BUCKETS)  # fmt: skip
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.request_generation = histogram("vllm:request_generation_tokens", "Generated tokens per sample.", tokens)
        most = "Most tokens generated by a sample of the request."
        self.request_max_generation = histogram("vllm:request_max_num_generation_tokens", most, tokens)
        self.request_n = histogram("vllm:request_params_n", "The n request parameter.", N_BUCKETS)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens request parameter.",
                                            tokens)  # fmt: skip

    # -- observed by the engine thread --------------------------------------------
    def record_step(self, num_batched_tokens: int) -> None:
        """One engine step that ran ``num_batched_tokens`` tokens through the model."""
        self.iteration_tokens.observe(num_batched_tokens)

    def record_first_token(self, prompt_tokens: int, ttft: float) -> None:
        """A request's prefill completed: its prompt counted, its time to first token observed."""
        self.prompt_tokens.inc(prompt_tokens)
        self.ttft.observe(ttft)

    def record_tokens(self, num_tokens: int, interval: float | None) -> None:
        """New tokens of one sample; ``interval`` since its previous ones (None for its first)."""
        self.generation_tokens.inc(num_tokens)
        if interval is not None:
            self.tpot.observe(interval)
            self.itl.observe(interval)

    def record_finished(self, req: FinishedRequest) -> None:
        """Count a request's samples by finish reason; a completed one is observed in the request histograms."""
        for reason in req.reasons:
            self.success[reason if reason in self.success else "abort"].inc()
        if not (req.completed and req.times is not None):
            return
        self.e2e.observe(req.e2e)
        t = req.times
        for histogram, value in (
            (self.queue, t.queue), (self.prefill, t.prefill), (self.decode, t.decode), (self.inference, t.inference),
            (self.request_prompt, req.prompt_tokens), (self.request_max_generation, max(req.generation_tokens)),
            (self.request_n, len(req.reasons)), (self.request_max_tokens, req.max_tokens),
        ):  # fmt: skip
            histogram.observe(value)
        for n in req.generation_tokens:
            self.request_generation.observe(n)

    # -- read at scrape time ---------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        """The engine gauges and counters of the latest snapshot (prometheus_client collector protocol)."""
        s = self.snapshot
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", s.running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.waiting),
            ("vllm:num_requests_swapped", "Requests swapped out to the CPU pool.", s.swapped),
            ("vllm:kv_cache_usage_perc", "KV-cache usage: fraction of GPU blocks in use (1 = full).", s.kv_usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's older name of kv_cache_usage_perc).", s.kv_usage),
            ("vllm:cpu_cache_usage_perc", "Fraction of CPU swap blocks in use.", s.cpu_usage),
        ):
            yield self._family(GaugeMetricFamily, name, doc, value)
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (the device's).",
             s.hits_by_medium[MEDIUM_GPU]),
            ("vllm:num_preemptions", "Preemptions (recompute and swap).", s.preemptions),
        ):
            yield self._family(CounterMetricFamily, name, doc, value)
        yield CounterMetricFamily("paged_kv:cow_copies", "Copy-on-write block copies.", value=s.cow_copies)
        rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
        yield GaugeMetricFamily("paged_kv:prefix_cache_hit_rate", "Prompt tokens found cached in any tier / "
                                "prefix_cache_queries.", value=rate)  # fmt: skip
        if s.tiers is not None:
            yield from tier_families(s.tiers, s.hits_by_medium, s.prefix_queries, self.labels)
        if s.spec is not None:
            yield from self._spec_families(s.spec)
        if s.lora is not None:
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=("max_lora", "waiting_lora_adapters", "running_lora_adapters"))  # fmt: skip
            info.add_metric((str(s.lora.max_lora), s.lora.waiting, s.lora.running), s.lora.at)
            yield info

    def _spec_families(self, spec: SpecDecodeStats) -> Iterator[Metric]:
        """vLLM's spec-decode counters: drafts, draft tokens, accepted tokens, accepted tokens by position."""
        for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Sequences that ran drafts, once per step.", spec.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens run.", spec.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
        ):
            yield self._family(CounterMetricFamily, name, doc, value)
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position.", labels=(*LABELS, "position"))  # fmt: skip
        for position, value in enumerate(spec.accepted_per_pos):
            family.add_metric((*self.labels, str(position)), value)
        yield family

    def _family(self, kind: type, name: str, doc: str, value: float) -> Metric:
        family = kind(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

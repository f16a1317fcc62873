"""Run metrics of the engine: throughput, latency percentiles, KV usage over time, cache figures."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from paged_kv.stats import BlockManagerStats
from scheduler.core.scheduler_output import SchedulerOutput
from scheduler.core.sequence import SequenceGroup

_SPARK = " ▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class StepRecord:
    """One engine step: when it ended, how long it took, what it ran, how full the pool was."""

    end_time: float
    duration: float
    num_prompt_tokens: int  # prompt tokens computed (prefix-cache hits excluded)
    num_generated_tokens: int  # tokens kept (appended to their sequences)
    num_seqs: int
    kv_usage: float  # fraction of GPU blocks referenced after the step
    num_batched_tokens: int  # tokens run through the model: prefill chunks and decode tokens


@dataclass(frozen=True)
class RequestTimes:
    """A request's phases in seconds, from the engine's timestamps (vLLM's intervals: first scheduling counts)."""

    queue: float  # arrival -> first scheduled
    prefill: float  # first scheduled -> first token
    decode: float  # first token -> end (its last token, or the stop string / abort after it)
    inference: float  # first scheduled -> end

    @classmethod
    def of(cls, group: SequenceGroup) -> RequestTimes | None:
        """The phases of a finished request; None if it never produced a token."""
        scheduled, first, end = group.first_scheduled_time, group.first_token_time, group.finish_time
        if scheduled is None or first is None or end is None:
            return None
        return cls(scheduled - group.arrival_time, first - scheduled, end - first, end - scheduled)


@dataclass
class EngineMetrics:
    """Accumulates step records and per-request latencies over a run."""

    steps: list[StepRecord] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)  # seconds, per request
    tpot: list[float] = field(default_factory=list)  # seconds per output token after the first, per sample
    num_prompt_tokens: int = 0  # prompt lengths of finished requests
    start_time: float | None = None

    def record_step(self, start: float, out: SchedulerOutput, generated: int, usage: float) -> None:
        """Add one step: its output ``out``, ``generated`` tokens kept, the pool's usage after it."""
        end = time.perf_counter()
        self.start_time = start if self.start_time is None else self.start_time
        record = StepRecord(end, end - start, out.num_prompt_tokens, generated, len(out.scheduled), usage,
                            out.num_batched_tokens)  # fmt: skip
        self.steps.append(record)

    def record_finished(self, group: SequenceGroup) -> None:
        """Add a finished request's time to first token and per-token times."""
        self.num_prompt_tokens += len(group.prompt_token_ids)
        if group.first_token_time is not None:
            self.ttft.append(group.first_token_time - group.arrival_time)
        for seq in group.seqs:
            if seq.num_outputs > 1 and group.first_token_time is not None and seq.finish_time is not None:
                self.tpot.append((seq.finish_time - group.first_token_time) / (seq.num_outputs - 1))

    def summary(self, stats: BlockManagerStats, preemptions: dict[str, int]) -> MetricsSummary:
        """Figures of the run so far, with the block manager's cache figures."""
        elapsed = (self.steps[-1].end_time - self.start_time) if self.steps else 0.0
        generated = sum(s.num_generated_tokens for s in self.steps)
        usage = [s.kv_usage for s in self.steps]
        return MetricsSummary(
            elapsed=elapsed, num_steps=len(self.steps), prompt_tokens=self.num_prompt_tokens,
            computed_prompt_tokens=sum(s.num_prompt_tokens for s in self.steps), generated_tokens=generated,
            ttft_p50=_pct(self.ttft, 50), ttft_p99=_pct(self.ttft, 99),
            tpot_p50=_pct(self.tpot, 50), tpot_p99=_pct(self.tpot, 99),
            kv_usage_mean=float(np.mean(usage)) if usage else 0.0, kv_usage_peak=max(usage, default=0.0),
            kv_usage_curve=sparkline(usage), prefix_hit_rate=stats.hit_rate,
            preemptions=dict(preemptions), cow_copies=stats.num_cow_copies,
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class MetricsSummary:
    """The printed figures of a run."""

    elapsed: float
    num_steps: int
    prompt_tokens: int
    computed_prompt_tokens: int
    generated_tokens: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    kv_usage_mean: float
    kv_usage_peak: float
    kv_usage_curve: str
    prefix_hit_rate: float
    preemptions: dict[str, int]
    cow_copies: int

    def rate(self, tokens: int) -> float:
        """Tokens per second of wall time over the run."""
        return tokens / self.elapsed if self.elapsed > 0 else 0.0

    def format(self) -> str:
        """A human-readable block of lines."""
        return "\n".join([
            f"steps: {self.num_steps} in {self.elapsed:.1f} s",
            f"throughput: prompt {self.rate(self.prompt_tokens):.1f} tok/s "
            f"({self.computed_prompt_tokens} of {self.prompt_tokens} prompt tokens computed), "
            f"generated {self.rate(self.generated_tokens):.1f} tok/s ({self.generated_tokens} tokens)",
            f"TTFT p50 {self.ttft_p50 * 1e3:.0f} ms, p99 {self.ttft_p99 * 1e3:.0f} ms; "
            f"TPOT p50 {self.tpot_p50 * 1e3:.0f} ms, p99 {self.tpot_p99 * 1e3:.0f} ms",
            f"KV usage: mean {self.kv_usage_mean:.0%}, peak {self.kv_usage_peak:.0%}  [{self.kv_usage_curve}]",
            f"prefix-cache hit rate: {self.prefix_hit_rate:.1%}",
            f"preemptions: {self.preemptions.get('recompute', 0)} recompute, {self.preemptions.get('swap', 0)} swap; "
            f"copy-on-write copies: {self.cow_copies}",
        ])  # fmt: skip


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def sparkline(values: list[float], width: int = 48) -> str:
    """Fractions in [0, 1] drawn as block characters, averaged into at most ``width`` buckets."""
    if not values:
        return ""
    buckets = np.array_split(np.asarray(values, dtype=float), min(width, len(values)))
    return "".join(_SPARK[min(len(_SPARK) - 1, round(float(b.mean()) * (len(_SPARK) - 1)))] for b in buckets)

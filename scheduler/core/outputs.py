"""What the engine returns for a request: its samples, why they stopped, and its timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.core.sequence import SequenceGroup


@dataclass(frozen=True, kw_only=True)
class CompletionOutput:
    """One sample of a request."""

    index: int
    token_ids: list[int]  # a stop token / EOS that ended the sample is its last token
    finish_reason: str | None  # "stop", "length", "abort", "error", or None while running
    cumulative_logprob: float
    logprobs: list[float]  # log-probability of each output token under the model
    top_logprobs: list[dict[int, float]]  # per output token, when SamplingParams.logprobs > 0
    # per output token, its rank in the vocabulary under the model (1: the most likely; vLLM's Logprob.rank);
    # None for a token a selection hook chose
    ranks: list[int | None] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """A request's prompt, its samples (ordered by index) and its timestamps (perf_counter seconds)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    error: str | None = None  # why the request failed alone (its samples' finish reason is "error"), else None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at admission
    # with SamplingParams.prompt_logprobs: per prompt token {token: logprob, top ones...} (None for the first)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # beside prompt_logprobs: each prompt token's rank (None: the first)

    @classmethod
    def from_group(cls, group: SequenceGroup, *, outputs: list[CompletionOutput] | None = None,
                   error: str | None = None) -> RequestOutput:  # fmt: skip
        """Snapshot a sequence group: one output per sample, a sample not forked yet with no token (or ``outputs``:
        what a beam search made of its sequences), with ``error`` if it failed."""
        if outputs is None:
            outputs = _samples(group)
        return cls(
            request_id=group.request_id, prompt_token_ids=group.prompt_token_ids, outputs=outputs,
            finished=group.is_finished(), arrival_time=group.arrival_time, first_token_time=group.first_token_time,
            finish_time=group.finish_time, num_preemptions=group.num_preemptions,
            num_cached_tokens=group.num_cached_tokens,
            prompt_logprobs=None if group.prompt_logprobs is None else list(group.prompt_logprobs),
            prompt_ranks=None if group.prompt_ranks is None else list(group.prompt_ranks), error=error,
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class EmbeddingOutput:
    """The pooled vector of an embedding request (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """Its length (after any ``dimensions`` truncation)."""
        return len(self.embedding)


@dataclass(frozen=True, kw_only=True)
class EmbeddingRequestOutput:
    """An embedding request's result (vLLM's ``EmbeddingRequestOutput``): its prompt and ``outputs.embedding``
    (an empty vector until it finished, or when it failed or was aborted)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool
    arrival_time: float
    finish_time: float | None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at admission
    error: str | None = None  # why it failed alone, else None

    @classmethod
    def from_group(cls, group: SequenceGroup, *, error: str | None = None) -> EmbeddingRequestOutput:
        """Snapshot an embedding request's group."""
        return cls(
            request_id=group.request_id, prompt_token_ids=group.prompt_token_ids,
            outputs=EmbeddingOutput(embedding=list(group.embedding or [])), finished=group.is_finished(),
            arrival_time=group.arrival_time, finish_time=group.finish_time, num_cached_tokens=group.num_cached_tokens,
            error=error,
        )  # fmt: skip


def _samples(group: SequenceGroup) -> list[CompletionOutput]:
    """One output per sample of a group, in index order; a sample not forked yet has no token."""
    outputs = [
        CompletionOutput(
            index=s.index, token_ids=s.output_token_ids, finish_reason=s.finish_reason,
            cumulative_logprob=s.cumulative_logprob, logprobs=list(s.logprobs), top_logprobs=list(s.top_logprobs),
            ranks=list(s.ranks),
        )  # fmt: skip
        for s in group.seqs
    ]
    outputs += [CompletionOutput(index=i, token_ids=[], finish_reason=None, cumulative_logprob=0.0, logprobs=[],
                                 top_logprobs=[]) for i in group.unforked]  # fmt: skip
    outputs.sort(key=lambda c: c.index)
    return outputs

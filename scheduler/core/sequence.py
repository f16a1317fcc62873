"""Sequences and sequence groups: the token state the scheduler moves between queues.

A :class:`Sequence` is one stream of tokens (prompt + output). Its first
``num_computed`` tokens have KV in the cache (or get it in the step just
scheduled): the block manager holds exactly those tokens' slots, and only the
scheduler changes the count. A :class:`SequenceGroup` is one request: its
prompt and every sample (``n`` parallel samples, or beams) forked from it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from paged_kv.block_hash import BlockHashes
from paged_kv.errors import SequenceStateError, describe
from scheduler.core.lora_request import LoRAKey, request_salt
from scheduler.core.params import SamplingParams
from scheduler.core.pooling_params import PoolingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued, in the running batch, in the CPU pool, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class TokenMatcher(Protocol):
    """A grammar's state over a sequence's output tokens (xgrammar's ``GrammarMatcher`` is one)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False, state unchanged, if the grammar does not allow it."""

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and has accepted its stop token."""

    def fork(self) -> TokenMatcher:
        """An independent copy of the state."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""


class Sequence:
    """One token stream with the KV bookkeeping of its cached prefix."""

    def __init__(
        self, seq_id: int, index: int, prompt_token_ids: list[int], block_hashes: BlockHashes | None = None
    ) -> None:
        self.seq_id = seq_id  # the block manager's id for this sequence
        self.index = index  # sample index inside its group
        self.prompt_len = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt followed by outputs
        # the chained hashes of its full blocks, computed once each and kept across preemption; the block
        # manager extends them as the sequence grows (None: prefix caching is off)
        self.block_hashes = block_hashes
        self.num_computed = 0  # leading tokens whose KV is in the cache (written by the scheduler only)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.finish_time: float | None = None
        self.logprobs: list[float] = []  # log-probability of each output token
        self.top_logprobs: list[dict[int, float]] = []  # per output token, when asked for
        self.ranks: list[int | None] = []  # rank of each output token in the vocabulary (None: a selection hook's)
        self.generator: torch.Generator | None = None
        # structured outputs: the grammar's state, set by the engine when the sequence first samples. It has
        # accepted exactly the output tokens after the grammar's start (append_token advances it, fork copies it),
        # so preemption keeps it; speculative decoding only advances it tentatively (grammar_walk rolls it back).
        self.matcher: TokenMatcher | None = None
        # structured outputs that start after a marker (StructuredOutputsParams.start_after): the marker its
        # output has still to write before the grammar holds (None: nothing to wait for). Invariant: while set,
        # the matcher (if any) has accepted nothing and the output does not contain it; append_token clears it once
        # the output ends with it, and feeds the matcher from the next token on.
        self.grammar_after: tuple[int, ...] | None = None

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated so far."""
        return self.token_ids[self.prompt_len :]

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.token_ids)

    @property
    def num_outputs(self) -> int:
        """Output tokens generated so far."""
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def cumulative_logprob(self) -> float:
        """Sum of the output tokens' log-probabilities."""
        return sum(self.logprobs)

    @property
    def is_finished(self) -> bool:
        """Whether a stop condition ended the sequence."""
        return self.status is SequenceStatus.FINISHED

    def append_token(
        self, token_id: int, logprob: float, top: dict[int, float] | None = None, rank: int | None = None
    ) -> None:
        """Record a sampled token (its KV is computed by the next step); a grammar, if any, must allow it."""
        if self.matcher is not None and self.grammar_holds and not self.matcher.accept_token(token_id):
            raise SequenceStateError(describe("token_id", token_id, "a token the sequence's grammar allows"))
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.ranks.append(rank)
        if top is not None:
            self.top_logprobs.append(top)
        if self.grammar_after is not None and self._ends_marker(self.token_ids, self.num_outputs):
            self.grammar_after = None  # the grammar holds from the next token

    def _ends_marker(self, token_ids: Seq[int], num_outputs: int) -> bool:
        """Whether ``token_ids`` (with ``num_outputs`` outputs) end with the marker the grammar waits for."""
        marker = self.grammar_after
        return num_outputs >= len(marker) and tuple(token_ids[-len(marker) :]) == marker

    def grammar_walk(self, drafts: Seq[int], visit: Callable[[int, TokenMatcher], None] | None = None) -> int:
        """How many leading ``drafts`` the grammar allows after the tokens so far (all of them without a matcher).

        The matcher is advanced over them tentatively: ``visit(j, matcher)``, at each position ``j`` up to the
        first refused draft where the grammar holds (its marker written, by the tokens so far or by the drafts up
        to ``j``), sees the matcher after the first ``j`` drafts; not after a draft that ended the grammar (its stop
        token: the sample ends there, nothing after it is kept). It is rolled back afterwards: state unchanged.
        """
        if self.matcher is None:
            return len(drafts)
        holds, advanced = self.grammar_holds, 0
        try:
            for j in range(len(drafts) + 1):
                if holds and visit is not None and not self.matcher.is_terminated():
                    visit(j, self.matcher)
                if j == len(drafts):
                    break
                if holds:  # a refused draft leaves the matcher as it was
                    if self.matcher.is_terminated() or not self.matcher.accept_token(drafts[j]):
                        return j
                    advanced += 1
                else:  # the draft that ends the marker is not fed: the grammar holds from the next one
                    tail = [*self.token_ids[-len(self.grammar_after) :], *drafts[: j + 1]]
                    holds = self._ends_marker(tail, self.num_outputs + j + 1)
            return len(drafts)
        finally:
            if advanced:
                self.matcher.rollback(advanced)

    @property
    def grammar_holds(self) -> bool:
        """Whether the sequence's grammar, if it has one, constrains its next token (not waiting for a marker)."""
        return self.grammar_after is None

    def fork(self, seq_id: int, index: int) -> Sequence:
        """A copy of this sequence's tokens and cache bookkeeping under a new id (generator not shared)."""
        hashes = self.block_hashes.copy() if self.block_hashes is not None else None  # hashes nothing again
        child = Sequence(seq_id, index, self.token_ids[: self.prompt_len], hashes)
        child.token_ids = list(self.token_ids)
        child.num_computed = self.num_computed
        child.status = self.status
        child.logprobs = list(self.logprobs)
        child.top_logprobs = list(self.top_logprobs)
        child.ranks = list(self.ranks)
        child.matcher = self.matcher.fork() if self.matcher is not None else None
        child.grammar_after = self.grammar_after
        return child

    def finish(self, reason: str, now: float) -> None:
        """Mark the sequence done (its blocks are the scheduler's to free)."""
        self.status, self.finish_reason, self.finish_time = SequenceStatus.FINISHED, reason, now

    def __repr__(self) -> str:
        state = f"tokens={self.num_tokens}, computed={self.num_computed}, {self.status.value}"
        return f"Sequence(id={self.seq_id}, {state})"


@dataclass(eq=False)
class SequenceGroup:
    """One request: its sampling parameters, its sequences and its timestamps."""

    request_id: str
    seqs: list[Sequence]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at admission (None: not yet)
    priority: int = 0  # vLLM's request priority (lower: more important): orders the eviction of its blocks,
    # and its scheduling under scheduling_policy="priority"
    max_seqs: int = 1  # sequences the group may run at once (n samples, beam width)
    # indices of the samples forked from the first sequence when it first samples (1..n-1 at admission, then
    # none). Invariant: these and the indices of ``seqs`` are 0..num_samples-1, each once
    unforked: list[int] = field(default_factory=list)
    # after a recompute preemption: sequences holding no blocks until the first active one has computed the
    # ``fork_at`` tokens they all start with; then they are forked from it there (the shared prefix runs once)
    parked: list[Sequence] = field(default_factory=list)
    fork_at: int = 0
    # its tokens (all sequences) when it last preempted itself for recompute with no other running group
    # holding blocks: preempted so again with no token since, its restart repeats, so it never fits
    restarted_alone_at: int | None = None
    # with params.prompt_logprobs: entry i scores prompt token i (entry 0 is None: the first token has no
    # context); written by the engine after each step that computed prompt positions, in order
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # beside it, entry for entry: prompt token i's rank in the vocabulary (None for the first)
    prompt_ranks: list[int | None] | None = None
    # speculative decoding: its decode sequences may run drafts (set at admission by the engine when it drafts and
    # the request's parameters are served exactly by verification; see scheduler.engine.spec_decode)
    speculative: bool = False
    # the LoRA adapter every sequence of the request runs through (forks and restarts keep it); None: the base model
    lora: LoRAKey | None = None
    # an embedding request (scheduler.core.pooling_params): its prompt runs as a prefill, never samples, and ends
    # with the step that computes its last token; ``pool_all``: every prompt token is pooled (MEAN), so it reads no
    # prefix cache (a cached token's hidden state is never computed)
    pooling: PoolingParams | None = None
    pool_all: bool = False
    # the engine's pooling state on the device (MEAN: the sum so far of the computed prompt tokens' hidden states),
    # then the pooled vector on the host once the last prompt token ran
    pooled: torch.Tensor | None = None  # [hidden] float32
    embedding: list[float] | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs, self.prompt_ranks = [None], [None]

    @property
    def cache_salt(self) -> str | bytes | None:
        """The root of its block hashes: the request's cache salt, under its adapter's key when it has one."""
        return request_salt(self.params.cache_salt, self.lora)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The request's prompt."""
        seq = self.seqs[0]
        return seq.token_ids[: seq.prompt_len]

    @property
    def num_tokens(self) -> int:
        """Tokens of all its sequences, finished ones included: only grows."""
        return sum(s.num_tokens for s in self.seqs)

    @property
    def num_samples(self) -> int:
        """Samples of the request: its sequences and the samples not forked yet."""
        return len(self.seqs) + len(self.unforked)

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether admission may take prefix-cache hits: not while prompt log-probabilities are still owed, nor
        for an embedding request that pools every prompt token."""
        if self.pool_all:
            return False
        return self.prompt_logprobs is None or len(self.prompt_logprobs) >= self.seqs[0].prompt_len

    def unfinished(self) -> list[Sequence]:
        """Sequences that still generate."""
        return [s for s in self.seqs if not s.is_finished]

    def active(self) -> list[Sequence]:
        """Unfinished sequences that are scheduled (hold blocks once admitted): all but the parked ones."""
        return [s for s in self.seqs if not s.is_finished and s not in self.parked]

    def is_finished(self) -> bool:
        """Whether every sequence has stopped."""
        return all(s.is_finished for s in self.seqs)

    def num_seqs_reserved(self) -> int:
        """Sequence slots the group holds in the batch, counting samples not forked yet."""
        num_finished = sum(s.is_finished for s in self.seqs)
        return max(self.max_seqs - num_finished, len(self.seqs) - num_finished)

    def set_status(self, status: SequenceStatus) -> None:
        """Move every active sequence to ``status``."""
        for s in self.active():
            s.status = status

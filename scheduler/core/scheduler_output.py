"""A step as the scheduler planned it (:class:`SchedulerOutput`) and the tokens then chosen (:class:`SampledToken`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_kv.block_manager import CopyOp, TableEntry
from paged_kv.host_tier import TierOps
from scheduler.core.sequence import Sequence, SequenceGroup


@dataclass(frozen=True, eq=False)
class ScheduledSeq:
    """``num_tokens`` new tokens of ``seq`` at positions ``[start, start + num_tokens)``."""

    seq: Sequence
    group: SequenceGroup
    start: int  # tokens already in the cache before this step
    num_tokens: int
    forks: tuple[Sequence, ...] = ()  # samples forked from ``seq`` this step: they sample from its logits too
    # positions (among the new ones) whose logits score the next prompt token (SamplingParams.prompt_logprobs)
    prompt_positions: range = range(0)
    # speculative decoding: draft tokens run after the new ones (positions [start + num_tokens, ...)), in lookahead
    # slots the block manager does not count; verified after the step (never part of ``seq.token_ids`` until kept)
    drafts: tuple[int, ...] = ()

    @property
    def reaches_end(self) -> bool:
        """Whether the step reaches the sequence's last token."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def samples(self) -> bool:
        """Whether the step reaches the sequence's last token and its logits are sampled (an embedding request's
        never are)."""
        return self.reaches_end and self.group.pooling is None

    @property
    def pool_offsets(self) -> range:
        """Offsets among the step's new tokens whose final hidden states are pooled: every one when the request
        pools every token, else the last one in the step that reaches the prompt's end; none for generation."""
        if self.group.pooling is None:
            return range(0)
        if self.group.pool_all:
            return range(self.num_tokens)
        return range(self.num_tokens - 1, self.num_tokens) if self.reaches_end else range(0)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens among the step's new tokens (prefix-cache hits excluded)."""
        return max(0, min(self.start + self.num_tokens, self.seq.prompt_len) - self.start)


@dataclass(frozen=True, eq=False)
class SampledToken:
    """A token chosen for ``seq`` after a step, with its log-probability (and the top ones, when asked for)."""

    group: SequenceGroup
    seq: Sequence
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None = None
    rank: int | None = None  # its rank in the vocabulary (1: the most likely); None when a selection hook chose it


@dataclass(eq=False)
class SchedulerOutput:
    """One step's work, in the order the model runner must apply it; built up as the scheduler fills its budgets."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[CopyOp] = field(default_factory=list)  # (gpu, cpu): copy first, before the GPU blocks are reused
    swap_in: list[CopyOp] = field(default_factory=list)  # (cpu, gpu)
    copies: list[CopyOp] = field(default_factory=list)  # copy-on-write (src, dst) in the GPU pool, in order made
    preempted: list[SequenceGroup] = field(default_factory=list)
    # the block manager's journal since the last step, in order: (seq_id, index, block) entries set, and
    # (seq_id, RELEASED, RELEASED) for a table gone; the runner's block tables apply it and read nothing else
    table_changes: list[TableEntry] = field(default_factory=list)
    num_batched_tokens: int = 0  # new tokens the step runs through the model
    tier_ops: TierOps = field(default_factory=TierOps)  # host-tier stores, fills and loads (paged_kv.host_tier)
    refused: list[tuple[SequenceGroup, str]] = field(default_factory=list)  # aborted: can never fit (and why)
    num_draft_tokens: int = 0  # speculative drafts among num_batched_tokens (each has a logits row after the others)

    def add(self, item: ScheduledSeq) -> None:
        """Schedule ``item`` (its new tokens and drafts counted against the step's token budget)."""
        self.scheduled.append(item)
        self.num_batched_tokens += item.num_tokens + len(item.drafts)
        self.num_draft_tokens += len(item.drafts)

    @property
    def draft_rows(self) -> dict[Sequence, range]:
        """Each drafting sequence's verification rows: after the sampled and the prompt rows, in schedule order
        (row ``j`` verifies draft ``j``; its sampled row is the bonus row)."""
        rows, at = {}, self.num_sample_rows + sum(len(s.prompt_positions) for s in self.scheduled)
        for s in self.scheduled:
            if s.drafts:
                rows[s.seq] = range(at, at + len(s.drafts))
                at += len(s.drafts)
        return rows

    @property
    def samples(self) -> list[tuple[SequenceGroup, Sequence, int]]:
        """Every sequence sampled after the step with its logits row (one row per scheduled sequence that samples)."""
        out = []
        for row, s in enumerate(s for s in self.scheduled if s.samples):
            out += [(s.group, seq, row) for seq in (s.seq, *s.forks)]
        return out

    @property
    def num_sample_rows(self) -> int:
        """Logits rows sampled: the first rows of the step's logits, one per scheduled sequence that samples."""
        return sum(s.samples for s in self.scheduled)

    @property
    def prompt_rows(self) -> list[tuple[SequenceGroup, Sequence, int]]:
        """(group, sequence, position) of every prompt-logprob row, in the order they follow the sampled rows."""
        return [(s.group, s.seq, pos) for s in self.scheduled for pos in s.prompt_positions]

    @property
    def pooled(self) -> list[ScheduledSeq]:
        """The scheduled embedding requests with rows to pool, in schedule order (their pooled rows' order)."""
        return [s for s in self.scheduled if s.pool_offsets]

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens the step computes (prefix-cache hits excluded)."""
        return sum(s.num_prompt_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Whether the step has nothing to run and no block to move."""
        return not (self.scheduled or self.swap_out or self.swap_in or self.copies or self.tier_ops)

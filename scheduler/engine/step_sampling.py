"""The sampling of a step's rows: the sampled requests' tokens and the prompt rows' logprobs, in one transfer.

A step's logits are ``[R + P, vocab]``: ``R = out.num_sample_rows`` rows indexed by ``out.samples``
(a forked sample draws from its parent's row), then ``P`` prompt positions (``out.prompt_rows``),
scored into their groups' ``prompt_logprobs``. Invariants:

- a draw that raises leaves no trace: seeded generators are restored, no prompt logprob is kept;
  so a failed batch can be drawn again by halves of its requests (:func:`~scheduler.engine.faults.isolate`)
  and the others get exactly the tokens of the full batch;
- a constrained sample's row is masked by its grammar before it is sampled;
- a seeded sequence's generator is created at its first sample, from ``(seed, sample index)`` only.

Beam searches' rows are not drawn here (:mod:`scheduler.engine.beam_requests` selects them). In a step with
drafts, :meth:`StepSampling.drawing`'s results come back in the same transfer as the verification's
(:meth:`~scheduler.engine.spec_decode.SpecDecode.sample_and_verify`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from scheduler.core.scheduler_output import SampledToken, SchedulerOutput
from scheduler.core.sequence import Sequence, SequenceGroup
from scheduler.engine.faults import isolate, restoring
from scheduler.runner.host_fetch import Fetch, fetch
from scheduler.runner.sampler import PromptRows, Sampler, SampleResult, SampleRow

if TYPE_CHECKING:
    from scheduler.engine.structured_outputs import StructuredOutputs

Selector = Callable[[SchedulerOutput, torch.Tensor], list[SampledToken]]  # (step, logits [R, vocab]) -> tokens
SampleEntry = tuple[SequenceGroup, Sequence, int]  # an entry of out.samples: (group, seq, logits row)
PromptEntry = tuple[int, SequenceGroup, Sequence, int]  # (index among the step's prompt rows, group, seq, position)


class StepSampling:
    """Draws a step's tokens with the engine's sampler, constrained rows masked by their grammars."""

    def __init__(self, sampler: Sampler, device: torch.device) -> None:
        self.sampler = sampler  # keeps penalty counts per sequence
        self.device = device
        self.structured: StructuredOutputs | None = None  # set by LLMEngine.enable_structured_outputs

    def sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[SampledToken]:
        """Sample every sequence that reached its last token and score the step's prompt rows, in one transfer."""
        return self.draw(out.samples, indexed(out.prompt_rows), logits, out)

    def sample_each(self, out: SchedulerOutput, logits: torch.Tensor, samples: list[SampleEntry],
                    failed: dict[SequenceGroup, BaseException]) -> list[SampledToken]:  # fmt: skip
        """:meth:`draw` these rows of ``out.samples`` and every prompt row; if it raises, the requests whose rows
        fail (found by halving the batch, sampled rows and prompt rows apart) go into ``failed`` and the others
        keep what they would have had."""
        prompts = indexed(out.prompt_rows)
        try:
            return self.draw(samples, prompts, logits, out)
        except Exception:  # some request's rows fail: find whose below
            pass
        sampled = isolate(samples, lambda part: self.draw(part, [], logits, out), lambda s: s[0], failed)
        isolate(prompts, lambda part: self.draw([], part, logits, out), lambda p: p[1], failed)
        return sampled

    def select(self, select: Selector, out: SchedulerOutput, logits: torch.Tensor) -> list[SampledToken]:
        """A selection hook's tokens; prompt rows, if any, are scored by the sampler (one more transfer)."""
        chosen = select(out, logits[: out.num_sample_rows])
        self.draw([], indexed(out.prompt_rows), logits, out)
        return chosen

    def draw(self, samples: list[SampleEntry], prompts: list[PromptEntry], logits: torch.Tensor,
             out: SchedulerOutput) -> list[SampledToken]:  # fmt: skip
        """Sample these entries of ``out.samples`` and score these prompt rows (any subsets) in one transfer.

        If it raises, nothing is recorded: seeded generators are restored, no prompt logprob is kept.
        """
        if not (samples or prompts):
            return []
        with restoring(self.generators(samples)):
            (tokens,) = fetch(self.drawing(samples, prompts, logits, out))
        return tokens

    def drawing(self, samples: list[SampleEntry], prompts: list[PromptEntry], logits: torch.Tensor,
                out: SchedulerOutput) -> Fetch[list[SampledToken]]:  # fmt: skip
        """:meth:`draw`'s device work: its tokens, still to fetch; reading them records the prompt rows' logprobs."""
        num_rows = out.num_sample_rows
        picked = rows_of(logits, [row for _, _, row in samples], 0, num_rows)
        if self.structured is not None and samples:  # mask what each constrained sample's grammar forbids
            self.structured.mask(samples, picked)
        prompt_logits = rows_of(logits, [num_rows + i for i, *_ in prompts], num_rows, logits.shape[0])
        sample_rows = [SampleRow(g.params, self.generator(g, s), s) for g, s, _ in samples]
        targets = PromptRows([seq.token_ids[pos + 1] for _, _, seq, pos in prompts],
                             [g.params.prompt_logprobs for _, g, _, _ in prompts])  # fmt: skip

        def tokens(result: SampleResult) -> list[SampledToken]:
            for (_, group, _, _), scored, rank in zip(prompts, result.prompt_logprobs, result.prompt_ranks):
                group.prompt_logprobs.append(scored)  # in position order: a group's rows come in order
                group.prompt_ranks.append(rank)
            chosen = zip(result.token_ids, result.logprobs, result.top_logprobs, result.ranks)
            return [SampledToken(g, s, *c) for (g, s, _), c in zip(samples, chosen)]

        return self.sampler.prepare(picked, sample_rows, prompt_logits, targets).then(tokens)

    def generators(self, entries: list[tuple]) -> list[torch.Generator | None]:
        """The generators of the ``(group, seq, ...)`` entries, created first (so a failed draw can restore them)."""
        return [self.generator(group, seq) for group, seq, *_ in entries]

    def generator(self, group: SequenceGroup, seq: Sequence) -> torch.Generator | None:
        """The sequence's own generator when the request is seeded (created at its first sample).

        Any int64 seed maps to a torch seed one to one (two's complement: -1 -> 2**64 - 1); sample i > 0
        of a request derives its own from (seed, i).
        """
        seed = group.params.seed
        if seed is not None and seq.generator is None:
            derived = seed % (1 << 64) if seq.index == 0 else hash((seed, seq.index)) & ((1 << 63) - 1)
            seq.generator = torch.Generator(device=self.device).manual_seed(derived)
        return seq.generator


def indexed(prompt_rows: list[tuple[SequenceGroup, Sequence, int]]) -> list[PromptEntry]:
    """The step's prompt rows with their index (their logits row is ``num_sample_rows + index``)."""
    return [(i, *row) for i, row in enumerate(prompt_rows)]


def rows_of(logits: torch.Tensor, rows: list[int], start: int, end: int) -> torch.Tensor:
    """Rows ``rows`` of ``logits``: a view when they are all of ``[start, end)`` in order, else one gather."""
    if rows == list(range(start, end)):
        return logits[start:end]
    return logits[torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)]

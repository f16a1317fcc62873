"""Speculative decoding with n-gram drafts (vLLM's ``--speculative-config '{"method": "ngram", ...}'``).

The scheduler asks the :class:`~scheduler.engine.ngram_proposer.NgramProposer` for up to ``k`` drafts per decode
sequence of a request this module serves (:meth:`SpecDecode.serves`) and runs them in the same step as the
sequence's last token: a query of ``1 + k`` tokens over its paged KV, the drafts in lookahead slots. The runner
returns a row of logits per draft after the step's other rows; :meth:`SpecDecode.verify` keeps the accepted drafts
and one more token (:mod:`scheduler.runner.rejection_sampler`), which then go through the scheduler's per-token
path (stop tokens, ``max_tokens``, ...) like sampled ones; the KV of rejected drafts is dropped by the scheduler
in the same step's bookkeeping (``Scheduler._keep_accepted``).

Served exactly, per request, and otherwise decoded one token per step (no error): no beam search (nor a caller's own
forks), no ``prompt_logprobs``. Structured outputs draft: the scheduler trims the drafts at the first one the grammar
refuses, and each draft row is masked with the grammar after the drafts before it
(:meth:`~scheduler.engine.structured_outputs.StructuredOutputs.mask_drafts`), so greedy tokens are exactly those
without drafts and each random one has the distribution it has without drafts (the rejection sampler's guarantee, on
the masked rows; the samples themselves differ, as for any seeded request with drafts). Logits controls (penalties,
``logit_bias``, ``bad_words``, ``allowed_token_ids``, ``min_tokens``) are applied to each draft row as the one-token
path applies them at that position, the drafts before it counted as outputs (:mod:`scheduler.runner.rejection_sampler`);
the sampler's penalty counts count the kept tokens. A selection hook's step (``LLMEngine.step(select)``) runs no drafts.

A step with drafts reads its results back in one device->host transfer (:meth:`SpecDecode.sample_and_verify`): the
other rows' tokens and prompt logprobs (:meth:`~scheduler.engine.step_sampling.StepSampling.drawing`) and the
verdicts (:func:`~scheduler.runner.rejection_sampler.verifying`) go to the host together
(:func:`~scheduler.runner.host_fetch.fetch`). Only when that raises are they drawn again apart, to find the failing
requests.

Differences from vLLM (README, "Speculative decoding"): only the n-gram method; drafts are also capped at
``max_tokens``, never take a running decode sequence's token of the step budget and never cause a preemption; the
lookahead blocks are freed after each verification; steps with drafts run eagerly (no CUDA graph); which sampling
parameters draft is this module's own list (``min_tokens`` included, from the first output on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scheduler.core.params import SamplingParams
from scheduler.core.scheduler_output import SampledToken, SchedulerOutput
from scheduler.core.sequence import Sequence, SequenceGroup
from scheduler.core.speculative_config import SpeculativeConfig
from scheduler.engine.faults import isolate, restoring
from scheduler.engine.ngram_proposer import NgramProposer
from scheduler.engine.step_sampling import SampleEntry, StepSampling, indexed
from scheduler.runner.host_fetch import Fetch, fetch
from scheduler.runner.rejection_sampler import DraftRows, Verified, verifying

# (group, seq, bonus row, draft rows): a drafting sequence of the step
DraftEntry = tuple[SequenceGroup, Sequence, int, range]
Failed = dict[SequenceGroup, BaseException]  # the requests whose rows failed, with why


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: sequences that ran drafts, drafts, accepted drafts, accepted by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafts run (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def copy(self) -> SpecDecodeStats:
        """An independent copy (a snapshot another thread reads)."""
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))  # fmt: skip

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's verification: ``num_drafts`` run, the first ``num_accepted`` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


class SpecDecode:
    """The engine's speculative decoding: which requests draft, the proposer, the verification, the counters."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        k = config.num_speculative_tokens
        self.proposer = NgramProposer(k=k, min_n=config.min_n, max_n=config.max_n)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * k)

    @staticmethod
    def serves(params: SamplingParams, *, fork_samples: bool = True) -> bool:
        """Whether verification gives a request exactly its tokens: none of beam search (or a caller's own forks),
        prompt log-probabilities (logits controls and grammars are applied per draft row)."""
        return fork_samples and params.prompt_logprobs is None

    def split(self, out: SchedulerOutput, rows: list[SampleEntry]) -> tuple[list[SampleEntry], list[DraftEntry]]:
        """The sampled rows apart from the drafting sequences' (whose bonus rows are verified with their drafts)."""
        draft_rows = out.draft_rows
        plain = [r for r in rows if r[1] not in draft_rows]
        drafting = [(g, s, row, draft_rows[s]) for g, s, row in rows if s in draft_rows]
        return plain, drafting

    def sample_and_verify(self, out: SchedulerOutput, logits: torch.Tensor, rows: list[SampleEntry],
                          entries: list[DraftEntry], sampling: StepSampling, sampling_failed: Failed,
                          verify_failed: Failed) -> list[SampledToken]:  # fmt: skip
        """The tokens of ``rows`` and the step's prompt rows (:meth:`StepSampling.sample_each`), then the drafting
        sequences' kept ones (:meth:`verify`), all in one device->host transfer. If that raises, they are drawn
        again apart and a failing request goes into ``sampling_failed`` or ``verify_failed`` (found by halving)."""
        prompts, drafts = indexed(out.prompt_rows), _drafts_of(out)
        try:
            with restoring(sampling.generators(rows) + sampling.generators(entries)):
                drawn = [sampling.drawing(rows, prompts, logits, out)] if rows or prompts else []
                verified = self._verifying(entries, drafts, logits, sampling)  # after the draws: as apart
                return [t for tokens in fetch(*drawn, verified) for t in tokens]
        except Exception:  # some request's rows fail: find whose below
            pass
        sampled = sampling.sample_each(out, logits, rows, sampling_failed)
        return sampled + self.verify(out, logits, entries, sampling, verify_failed)

    def verify(self, out: SchedulerOutput, logits: torch.Tensor, entries: list[DraftEntry], sampling: StepSampling,
               failed: Failed) -> list[SampledToken]:  # fmt: skip
        """The tokens each drafting sequence keeps (its accepted drafts, then one more), in one transfer; a request
        whose verification raises goes into ``failed`` (found by halving, as sampling's)."""
        drafts = _drafts_of(out)
        return isolate(entries, lambda part: self._verify(part, drafts, logits, sampling), lambda e: e[0], failed)

    def _verify(self, entries: list[DraftEntry], drafts: dict[Sequence, tuple[int, ...]], logits: torch.Tensor,
                sampling: StepSampling) -> list[SampledToken]:  # fmt: skip
        """Verify these entries (any subset of the step's) in one transfer; nothing recorded if it raises."""
        with restoring(sampling.generators(entries)):  # a draw that raises leaves the generators as they were
            (tokens,) = fetch(self._verifying(entries, drafts, logits, sampling))
        return tokens

    def _verifying(self, entries: list[DraftEntry], drafts: dict[Sequence, tuple[int, ...]], logits: torch.Tensor,
                   sampling: StepSampling) -> Fetch[list[SampledToken]]:  # fmt: skip
        """:meth:`_verify`'s device work: the kept tokens, still to fetch; reading them records the counters."""
        rows = [r for _, _, bonus, draft_rows in entries for r in (*draft_rows, bonus)]
        seqs = [DraftRows(g.params, sampling.generator(g, s), drafts[s], s) for g, s, _, _ in entries]
        picked = logits[torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)]  # a copy
        if sampling.structured is not None:  # row j of a constrained sequence: its grammar after its first j drafts
            sampling.structured.mask_drafts([(g, s, drafts[s]) for g, s, _, _ in entries], picked)
        sampler = sampling.sampler  # its penalty counts, kept across steps, count the emitted tokens too

        def tokens(verdicts: list[Verified]) -> list[SampledToken]:
            kept = []
            for (group, seq, _, _), v, s in zip(entries, verdicts, seqs):
                self.stats.record(len(s.drafts), v.num_accepted)
                chosen = zip(v.token_ids, v.logprobs, v.top_logprobs, v.ranks)
                kept += [SampledToken(group, seq, *c) for c in chosen]
            return kept

        return verifying(picked, seqs, sampler.counts, sampler.eos_token_ids).then(tokens)


def _drafts_of(out: SchedulerOutput) -> dict[Sequence, tuple[int, ...]]:
    """The drafts of the step's drafting sequences."""
    return {s.seq: s.drafts for s in out.scheduled if s.drafts}

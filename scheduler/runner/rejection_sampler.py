"""Verification of draft tokens (speculative decoding): the target model's rows decide which drafts are kept.

A sequence with ``k`` drafts ``d_1..d_k`` has ``k + 1`` rows of logits: row ``j < k`` is the target's
distribution ``p_j`` for the token after its ``j`` first drafts, row ``k`` the one after all of them.

- Greedy rows (temperature 0): ``d_j`` is accepted while it is ``argmax p_j``; the first mismatch emits the argmax
  instead, and when every draft is accepted the argmax of row ``k`` is the bonus token. The tokens are exactly
  those of decoding one token per step.
- Random rows: the drafts come from a deterministic proposer (a one-hot draft distribution), so the standard
  rejection rule is: accept ``d_j`` with probability ``p_j(d_j)``; at the first rejection emit a token drawn from
  ``p_j`` with ``d_j`` removed (renormalized); when all are accepted, the bonus token is drawn from ``p_k``. Each
  emitted token is then distributed exactly as ``p_j`` (``P(t) = p(d) [t = d] + (1 - p(d)) p(t) / (1 - p(d))``
  for ``t != d``). ``p_j`` is the fully processed distribution the sampler draws from (temperature, min-p,
  top-k, top-p: :func:`~scheduler.runner.sampler.processed_probs`).

Both read the logits after the request's logits controls (:mod:`scheduler.runner.logits_processors`), applied to
row ``j`` as the one-token path applies them at that position: with the sequence's history followed by ``d_1..d_j``
(the drafts before it count as outputs: for the penalties, the bad words' prefixes and ``min_tokens``). Row ``j``
only matters when ``d_1..d_j`` are all accepted, so it then is exactly the one-token path's row. The emitted
tokens are counted into the sequence's penalty slot on the device (those after the first rejection masked out).

Reported log-probabilities and ranks are the raw ones, as the sampler's. Everything is computed on the logits'
device and comes back in one transfer: :func:`verifying` returns the device results, which the engine fetches
together with the step's sampled rows (:mod:`scheduler.runner.host_fetch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.core.params import SamplingParams
from scheduler.runner.host_fetch import Fetch, fetch
from scheduler.runner.logits_processors import (
    Controls,
    PenaltyCounts,
    TokenHistory,
    empty_histories,
    plan_controls,
    upload,
    uses_penalties,
)
from scheduler.runner.sampler import exponential_noise, logprob_parts, processed_probs


@dataclass(frozen=True)
class DraftRows:
    """One sequence to verify: its parameters, generator (None: the global one), drafts (its rows: one per
    draft, then the bonus row) and its tokens so far (None: none, a row with no sequence behind it)."""

    params: SamplingParams
    generator: torch.Generator | None
    drafts: tuple[int, ...]
    history: TokenHistory | None = None


@dataclass(frozen=True)
class Verified:
    """A sequence's verdict: the drafts accepted, then the tokens emitted (the accepted drafts and one more)."""

    num_accepted: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]
    ranks: list[int]


def verify(logits: torch.Tensor, seqs: list[DraftRows], counts: PenaltyCounts | None = None,
           eos_token_ids: frozenset[int] = frozenset()) -> list[Verified]:  # fmt: skip
    """The verdict of each sequence from ``logits [sum(k_i + 1), V]`` (each sequence's draft rows, then its bonus
    row, in order), after each row's logits controls; ``counts`` keeps the penalized sequences' counts (the
    sampler's, updated with the emitted tokens; None: counted from the histories once)."""
    (verdicts,) = fetch(verifying(logits, seqs, counts, eos_token_ids))
    return verdicts


def verifying(logits: torch.Tensor, seqs: list[DraftRows], counts: PenaltyCounts | None = None,
              eos_token_ids: frozenset[int] = frozenset()) -> Fetch[list[Verified]]:  # fmt: skip
    """:func:`verify`'s device work: the verdicts, still to fetch (with others, in the step's one transfer); reading
    them tells ``counts`` what its slots now count."""
    logits = logits.float()
    params = [s.params for s in seqs for _ in range(len(s.drafts) + 1)]
    targets = [t for s in seqs for t in (*s.drafts, -1)]  # -1: the bonus row has no draft
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    first_rows = [at for at, s in zip(_starts(seqs), seqs) for _ in range(len(s.drafts) + 1)]  # each row's first
    targets_t, rows_t, top_k, first_t = upload(
        logits.device, [targets, random_rows, [params[i].top_k for i in random_rows], first_rows], torch.int64
    )  # one host->device copy
    counts = counts if counts is not None else PenaltyCounts(logits.shape[-1], logits.device)
    controls = _plan(seqs, params, counts, eos_token_ids)
    processed = logits if controls is None else controls.apply(logits.clone(), counts)
    tokens = processed.argmax(dim=-1)  # [N]: greedy rows keep these
    accepted = tokens == targets_t  # [N]
    if random_rows:
        gens = [s.generator for s in seqs for _ in range(len(s.drafts) + 1)]
        picked, kept = reject(processed[rows_t], [params[i] for i in random_rows], top_k, targets_t[rows_t],
                              [gens[i] for i in random_rows])  # fmt: skip
        tokens[rows_t], accepted[rows_t] = picked, kept
    if controls is not None and controls.penalized is not None:
        emitted = _emitted(accepted, first_t)
        pen = controls.penalized
        counts.record_kept(controls.slots, controls.slots_t, tokens[pen], emitted[pen])
    k = min(max(p.logprobs for p in params), logits.shape[-1])
    parts = [*logprob_parts(logits, tokens, k), accepted]

    def read(host: list[float]) -> list[Verified]:
        verdicts = _verdicts(host, seqs, k)
        if controls is not None and controls.penalized is not None:
            counts.set_counted(_counted(controls.slots, seqs, verdicts))
        return verdicts

    return Fetch(parts, read)


def _plan(seqs: list[DraftRows], params: list[SamplingParams], counts: PenaltyCounts,
          eos_token_ids: frozenset[int]) -> Controls | None:  # fmt: skip
    """The rows' logits controls (None when no row uses any): row ``j`` of a sequence is its history followed by
    its first ``j`` drafts (pending: not in its penalty slot)."""
    stand_ins = iter(empty_histories(len(seqs)))
    histories = [s.history if s.history is not None else next(stand_ins) for s in seqs]
    rows = [h for h, s in zip(histories, seqs) for _ in range(len(s.drafts) + 1)]
    pending = [s.drafts[:j] for s in seqs for j in range(len(s.drafts) + 1)]
    return plan_controls(params, rows, counts, eos_token_ids, pending)


def _emitted(accepted: torch.Tensor, first_t: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the rows whose token is emitted, those up to each sequence's first rejection (or its bonus);
    ``first_t [N]``: each row's sequence's first row."""
    rejected = (~accepted).long()  # a bonus row counts as one: it ends its sequence
    before = rejected.cumsum(0) - rejected  # [N] rejections before each row
    return before == before[first_t]  # none since the sequence's first row


def _counted(slots: list[int], seqs: list[DraftRows], verdicts: list[Verified]) -> list[tuple[int, int]]:
    """(slot, outputs it now counts) of each penalized sequence: its outputs before the step and those emitted
    (its rows come in order in ``slots``, one entry per row)."""
    out, at = [], 0
    for s, v in zip(seqs, verdicts):
        if uses_penalties(s.params):
            before = len(s.history.token_ids) - s.history.prompt_len if s.history is not None else 0
            out.append((slots[at], before + len(v.token_ids)))
            at += len(s.drafts) + 1
    return out


def _starts(seqs: list[DraftRows]) -> list[int]:
    """Each sequence's first row."""
    out, at = [], 0
    for s in seqs:
        out.append(at)
        at += len(s.drafts) + 1
    return out


def reject(logits: torch.Tensor, params: list[SamplingParams], top_k: torch.Tensor, drafts: torch.Tensor,
           generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Random rows ``logits [R, V]`` with their draft ``drafts [R]`` (-1: none, a bonus row): the token each row
    emits if it is the first rejection (the draft when accepted) and whether its draft is accepted, ``[R]`` each."""
    probs = processed_probs(logits, params, top_k)  # [R, V]
    has = drafts >= 0
    d = drafts.clamp(min=0)[:, None]  # [R, 1]
    p_draft = probs.gather(1, d)  # [R, 1]
    accept = (uniform_noise(has, generators) < p_draft[:, 0]) & has
    residual = probs.scatter(1, d, p_draft * ~has[:, None])  # the draft removed (a bonus row keeps its p)
    recovered = (residual / exponential_noise(residual, generators)).argmax(dim=-1)  # the race renormalizes
    return torch.where(accept, d[:, 0], recovered), accept


def uniform_noise(like: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """U[0, 1) noise shaped like ``like [R]``; row i from ``gens[i]`` when set, else the global generator."""
    noise = torch.empty(like.shape, dtype=torch.float32, device=like.device)
    if any(g is None for g in gens):
        noise.uniform_()
    for i, g in enumerate(gens):
        if g is not None:
            noise[i : i + 1].uniform_(generator=g)
    return noise


def _verdicts(host: list[float], seqs: list[DraftRows], k: int) -> list[Verified]:
    """Per sequence: its rows up to the first rejection (or its bonus row), from the flat transfer."""
    n = sum(len(s.drafts) + 1 for s in seqs)
    tokens, lps, ranks = host[:n], host[n : 2 * n], host[2 * n : 3 * n]
    values, ids, accepted = host[3 * n : 3 * n + n * k], host[3 * n + n * k : 3 * n + 2 * n * k], host[-n:]
    out = []
    for s, at in zip(seqs, _starts(seqs)):
        m = next((j for j in range(len(s.drafts)) if not accepted[at + j]), len(s.drafts))  # drafts accepted
        rows = range(at, at + m + 1)
        top = [{int(ids[r * k + i]): values[r * k + i] for i in range(min(s.params.logprobs, k))} for r in rows]
        out.append(Verified(
            num_accepted=m, token_ids=[int(tokens[r]) for r in rows], logprobs=[lps[r] for r in rows],
            top_logprobs=top if s.params.logprobs else [None] * len(rows), ranks=[int(ranks[r]) for r in rows],
        ))  # fmt: skip
    return out

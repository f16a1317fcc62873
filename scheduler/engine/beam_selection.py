"""Beam-search selection inside the engine's step, with beams sharing their KV blocks copy-on-write.

Semantics are those of transformers' ``generate(num_beams=W, do_sample=False)``:
each step scores every (beam, token) continuation of a request by its float32
cumulative log-probability and keeps the top ``K = max(2, 1 + #eos) * W``. EOS
candidates among the first ``W`` become finished hypotheses scored
``logprob / len ** length_penalty``; the best ``W`` others are the next beams.
At ``max_tokens`` every candidate finishes. A request stops as transformers
stops it (``early_stopping`` False: no running beam can beat the worst of ``W``
hypotheses at its current length; True: ``W`` hypotheses; "never": at the best
reachable length when ``length_penalty > 0``).

Memory: a beam chosen ``c`` times forks ``c - 1`` children that share every
block of their parent (refcounts, no data copied); the next step's append gives
each of them a private copy of the shared last partial block only, and the
model runner applies those copies before writing. A beam chosen by no
candidate is freed at once, as is every beam of a request that stopped.

A :class:`BeamRequest` is one search's state; the engine's
:class:`~scheduler.engine.beam_requests.BeamRequests` feeds it its beams' logits each step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from paged_kv.errors import InvalidArgumentError, check_bool, check_int, describe
from scheduler.core.outputs import CompletionOutput
from scheduler.core.params import MAX_LOGPROBS, MAX_SAMPLES, SamplingParams
from scheduler.core.scheduler import Scheduler
from scheduler.core.scheduler_output import SampledToken
from scheduler.core.sequence import Sequence, SequenceGroup
from scheduler.engine.request_checks import check_within_context
from scheduler.model.llama import ModelConfig


@dataclass(frozen=True, kw_only=True)
class BeamSearchParams:
    """Width, length and stopping rules of one beam search (transformers' meaning for each), and its text options."""

    width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0  # > 0 favours longer hypotheses
    early_stopping: bool | str = False  # False, True or "never"
    stop_token_ids: tuple[int, ...] = ()  # end a hypothesis like EOS does
    ignore_eos: bool = False  # the engine's EOS ids do not end hypotheses
    include_stop_str_in_output: bool = False  # a hypothesis' text keeps its stop token's text (vLLM's)
    skip_special_tokens: bool = True  # special tokens left out of a hypothesis' text
    cache_salt: str | None = None  # prefix-cache isolation, as SamplingParams.cache_salt
    logprobs: int = 0  # top log-probabilities kept per output token (of the beam's distribution at that token)

    def __post_init__(self) -> None:
        check_int("width", self.width, low=1, high=MAX_SAMPLES)
        check_int("max_tokens", self.max_tokens, low=1)
        check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise InvalidArgumentError(describe("length_penalty", lp, "a finite number"))
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise InvalidArgumentError(describe("early_stopping", self.early_stopping, "True, False or 'never'"))
        check_bool("ignore_eos", self.ignore_eos)
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        check_bool("skip_special_tokens", self.skip_special_tokens)
        # SamplingParams checks the stop ids and the salt; the beams themselves never stop on them
        stop = SamplingParams(stop_token_ids=self.stop_token_ids, cache_salt=self.cache_salt).stop_token_ids
        object.__setattr__(self, "stop_token_ids", stop)

    def engine_params(self) -> SamplingParams:
        """What the engine sees: ``width`` sequences at most, none stopped by the engine itself."""
        return SamplingParams(max_tokens=self.max_tokens, n=self.width, ignore_eos=True, cache_salt=self.cache_salt)

    def text_params(self) -> SamplingParams:
        """What a text layer applies to the hypotheses: which token ended one, and how its text is made."""
        return SamplingParams(
            max_tokens=self.max_tokens, n=self.width, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            cache_salt=self.cache_salt,
        )  # fmt: skip


def candidates_per_beam(num_stops: int) -> int:
    """K / width: enough candidates that ``width`` are left once those ending in one of ``num_stops`` ids are set
    aside."""
    return max(2, 1 + num_stops)


def stop_ids(params: BeamSearchParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The tokens that end a hypothesis: its stop ids, and the engine's EOS unless ignored."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)


def check_beam_fits(prompt_len: int, params: BeamSearchParams, eos_token_ids: frozenset[int],
                    model: ModelConfig) -> None:  # fmt: skip
    """Refuse a search whose beams run past the model context, or whose K candidates or top log-probabilities
    exceed the vocabulary."""
    check_within_context(prompt_len, params.max_tokens, model)  # every beam runs to max_tokens
    if params.logprobs > model.vocab_size:
        raise InvalidArgumentError(describe("logprobs", params.logprobs, f"at most vocab_size={model.vocab_size}"))
    per_beam = candidates_per_beam(len(stop_ids(params, eos_token_ids)))
    if per_beam * params.width > model.vocab_size:
        raise InvalidArgumentError(describe("width", params.width, f"at most vocab_size / {per_beam}"))


@dataclass(frozen=True, kw_only=True)
class BeamHypothesis:
    """One finished beam: its output tokens and scores."""

    token_ids: list[int]  # an EOS / stop token that ended it is its last token
    logprobs: list[float]  # log-probability of each output token
    cumulative_logprob: float  # float32 running sum, as ranked
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" or "length"
    stop_reason: int | None = None  # the stop token (EOS or a stop id) that ended it, its last token; None at length
    text: str | None = None  # the output as text, its stop token left out: LLM.beam_search fills it (no tokenizer here)
    # per output token, with params.logprobs > 0: {token: logprob} of the top ones of its beam's distribution
    top_logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class BeamMemory:
    """KV blocks a search held, against every beam holding its own copy of its blocks."""

    block_size: int
    bytes_per_block: int
    peak_blocks: int  # most distinct GPU blocks held at once
    peak_blocks_unshared: int  # most blocks at once if no block were shared between beams
    block_steps: int  # blocks held, summed over steps
    block_steps_unshared: int

    @property
    def peak_bytes(self) -> int:
        """Bytes of the peak."""
        return self.peak_blocks * self.bytes_per_block

    @property
    def peak_bytes_unshared(self) -> int:
        """Bytes of the peak without sharing."""
        return self.peak_blocks_unshared * self.bytes_per_block

    @property
    def saving(self) -> float:
        """Fraction of the unshared peak that sharing saved."""
        return 1.0 - self.peak_blocks / self.peak_blocks_unshared if self.peak_blocks_unshared else 0.0

    @property
    def mean_saving(self) -> float:
        """Fraction of the unshared blocks, averaged over steps, that sharing saved."""
        return 1.0 - self.block_steps / self.block_steps_unshared if self.block_steps_unshared else 0.0


class Meter:
    """Peak and summed block counts, shared and unshared."""

    def __init__(self) -> None:
        self.peak = self.peak_unshared = self.steps = self.steps_unshared = 0

    def record(self, shared: int, unshared: int) -> None:
        """Add one step's counts."""
        self.peak, self.peak_unshared = max(self.peak, shared), max(self.peak_unshared, unshared)
        self.steps, self.steps_unshared = self.steps + shared, self.steps_unshared + unshared

    def freeze(self, block_size: int, bytes_per_block: int) -> BeamMemory:
        """The figures so far."""
        return BeamMemory(
            block_size=block_size, bytes_per_block=bytes_per_block, peak_blocks=self.peak,
            peak_blocks_unshared=self.peak_unshared, block_steps=self.steps, block_steps_unshared=self.steps_unshared,
        )  # fmt: skip


@dataclass(frozen=True)
class Candidates:
    """The top-K continuations of a request's beams, best first (host values)."""

    parents: list[int]  # index of the beam each extends
    tokens: list[int]
    scores: torch.Tensor  # [K] float32 cumulative log-probabilities, on the CPU
    logprobs: list[float]  # log-probability of each candidate's token alone
    # per candidate, when asked for: {token: logprob} of the top ones of its parent beam's distribution
    top_logprobs: list[dict[int, float] | None]


def top_candidates(logits: torch.Tensor, scores: torch.Tensor, k: int, num_top: int = 0) -> Candidates:
    """The ``k`` best (beam, token) pairs of ``logits [B, V]`` given beam scores ``[B]`` (and, ``num_top > 0``,
    the top ``num_top`` log-probabilities of each one's parent beam).

    The scoring runs on the logits' device (``scores`` are moved there); the ``k`` winners
    come back to the host in one copy.
    """
    return top_candidates_batch([(logits, scores, k)], [num_top])[0]


def top_candidates_batch(requests: Seq[tuple[torch.Tensor, torch.Tensor, int]],
                         num_top: Seq[int] | None = None) -> list[Candidates]:  # fmt: skip
    """``top_candidates`` of several requests' ``(logits, scores, k)`` (each with ``num_top[i]`` top
    log-probabilities per candidate; None: none), with one host->device copy of every request's scores and one
    device->host copy of every request's winners and their top log-probabilities."""
    if not requests:
        return []
    num_top = list(num_top or [0] * len(requests))
    width = min(max(num_top), requests[0][0].shape[-1])  # T: top entries computed per candidate, 0 if none asked
    winners = []
    for (logits, _, k), scores in zip(requests, _upload([s for _, s, _ in requests], requests[0][0].device)):
        winners.append(_winners(logits, scores, k, width))  # [3 + 2T, K]
    host = torch.cat(winners, dim=1).cpu()  # [3 + 2T, sum of K]: the one transfer
    out, start = [], 0
    for (logits, _, k), want in zip(requests, num_top):
        vocab, part = logits.shape[-1], host[:, start : start + k]
        ids = part[0].long().tolist()
        tops = _tops(part[3 : 3 + width], part[3 + width :], want) if want else [None] * k
        out.append(Candidates([i // vocab for i in ids], [i % vocab for i in ids], part[1].float(), part[2].tolist(),
                              tops))  # fmt: skip
        start += k
    return out


def _winners(logits: torch.Tensor, scores: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """On the logits' device, ``[3 + 2 * width, k]`` float64 rows: the ``k`` winners' flat indices, cumulative and
    own log-probabilities, then the ids and the values of the top ``width`` of each one's parent beam."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V] float32
    totals = logprobs + scores.to(logprobs.device)[:, None]  # [B, V] (a no-op move: same device)
    top, flat = totals.flatten().topk(k)  # [K], [K]
    # float64 holds the flat indices (< 2**53), the token ids and the float32 values exactly
    rows = [flat.double()[None], top.double()[None], logprobs.flatten()[flat].double()[None]]  # [1, K] each
    if width:
        values, ids = logprobs.topk(width, dim=-1)  # [B, T], [B, T]
        parents = flat // logits.shape[-1]  # [K]
        rows += [ids[parents].double().T, values[parents].double().T]  # [T, K] each
    return torch.cat(rows)


def _tops(ids: torch.Tensor, values: torch.Tensor, want: int) -> list[dict[int, float]]:
    """Per candidate (a column of ``ids [T, K]`` / ``values [T, K]``, host tensors), its first ``want`` top
    entries as ``{token: logprob}``."""
    ids, values = ids[:want].long().T.tolist(), values[:want].T.tolist()
    return [dict(zip(i, v)) for i, v in zip(ids, values)]


def _upload(scores: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The requests' float32 beam scores on ``device`` in one copy: from pinned memory, asynchronous, on CUDA (a
    plain copy from pageable memory waits for the device to finish its queued work)."""
    host = torch.cat([s.detach().reshape(-1).float().cpu() for s in scores])  # the scores live on the host
    if device.type == "cuda":
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split([s.numel() for s in scores]))


def candidates_of(requests: list[BeamRequest]) -> list[tuple[BeamRequest, Candidates]]:
    """Each request with its top candidates from its beams' logits, in one device->host copy; nothing changes if
    it raises (each request's logits are dropped only after)."""
    if not requests:
        return []
    num_top = [r.params.logprobs for r in requests]
    found = top_candidates_batch([(r.logits(), r.scores, r.num_candidates) for r in requests],
                                 num_top if any(num_top) else None)  # fmt: skip
    for r in requests:
        r.ready.clear()
    return list(zip(requests, found))


class BeamRequest:
    """A beam search in the engine: its live beams in rank order, their scores, its hypotheses, its KV meter if any.

    Invariant: ``scores[i]`` is the float32 cumulative log-probability of ``beams[i]``.
    """

    def __init__(
        self, group: SequenceGroup, params: BeamSearchParams, eos: frozenset[int], *, measure: bool = False
    ) -> None:
        """``measure``: keep a meter of the KV blocks its beams hold, read every step (else ``meter`` is None)."""
        self.group, self.params, self.eos = group, params, eos
        self.beams: list[Sequence] = list(group.seqs)
        self.scores = torch.zeros(1)  # [B] float32, on the CPU
        self.finished: list[BeamHypothesis] = []  # best first, at most width
        self.ready: dict[int, torch.Tensor] = {}  # seq_id -> logits [V] of a beam computed to its end
        self.done = False  # the engine has returned it (finished, aborted or failed)
        self.error: str | None = None  # why it failed, if it did
        self.num_steps = 0
        self.meter = Meter() if measure else None
        # with a meter: one shared with other requests (BeamSearch.generate's), or None
        self.total: Meter | None = None

    @property
    def num_candidates(self) -> int:
        """K: enough that ``width`` candidates are left once EOS ones are set aside."""
        return candidates_per_beam(len(self.eos)) * self.params.width

    def all_ready(self) -> bool:
        """Whether every live beam has the logits of its last token."""
        return all(s.seq_id in self.ready and s.num_uncomputed == 0 for s in self.beams)

    def logits(self) -> torch.Tensor:
        """The live beams' logits ``[B, V]``, in rank order (every beam ready)."""
        return torch.stack([self.ready[s.seq_id] for s in self.beams])

    def outputs(self) -> list[CompletionOutput]:
        """The hypotheses best first, then (a search not done) its live beams best first; ``width`` at most,
        each indexed by its rank. Cut short (aborted or failed), every one ends with its live beams' reason: no
        hypothesis is final before the search ends."""
        cut = next((s.finish_reason for s in self.beams if s.is_finished), None)  # live beams end only if cut short
        hyps = [(h.token_ids, h.logprobs, h.top_logprobs, h.cumulative_logprob, cut or h.finish_reason)
                for h in self.finished]  # fmt: skip
        live = [(s.output_token_ids, s.logprobs, s.top_logprobs, s.cumulative_logprob, s.finish_reason)
                for s in self.beams]  # fmt: skip
        return [
            CompletionOutput(index=i, token_ids=list(ids), finish_reason=reason, cumulative_logprob=cum,
                             logprobs=list(lps), top_logprobs=list(tops), ranks=[None] * len(ids))  # fmt: skip
            for i, (ids, lps, tops, cum, reason) in enumerate((hyps + live)[: self.params.width])
        ]

    # -- one selection round ------------------------------------------------
    def advance(self, cands: Candidates, scheduler: Scheduler) -> list[SampledToken]:
        """Pick the next beams and hypotheses from the candidates (their tokens); stop the search when it is done."""
        p = self.params
        self.num_steps += 1
        length = self.beams[0].num_outputs + 1  # output tokens of every candidate
        ends = [length >= p.max_tokens or t in self.eos for t in cands.tokens]
        self._add_hypotheses(cands, ends, length)  # a full set with early_stopping=True has stopped already
        keep = [r for r, end in enumerate(ends) if not end][: p.width]
        scores = cands.scores[keep]  # [W] float32, best first
        if _should_stop(self, scores, length):
            self.finish(scheduler)
            return []
        tokens = self._continue(cands, keep, scheduler)
        self.scores = scores
        return tokens

    def _add_hypotheses(self, cands: Candidates, ends: list[bool], length: int) -> None:
        """Candidates among the first ``width`` that end join the hypotheses; the best ``width`` stay."""
        p = self.params
        penalized = (cands.scores / _length_norm(length, p.length_penalty)).tolist()  # float32, as transformers
        new = []
        for r in range(min(p.width, len(ends))):
            if ends[r]:
                parent, token, top = self.beams[cands.parents[r]], cands.tokens[r], cands.top_logprobs[r]
                new.append(BeamHypothesis(
                    token_ids=parent.output_token_ids + [token], logprobs=parent.logprobs + [cands.logprobs[r]],
                    cumulative_logprob=float(cands.scores[r]), score=penalized[r],
                    finish_reason="stop" if token in self.eos else "length",
                    stop_reason=token if token in self.eos else None,
                    top_logprobs=parent.top_logprobs + ([top] if top is not None else []),
                ))  # fmt: skip
        self.finished = sorted(self.finished + new, key=lambda h: -h.score)[: p.width]

    def _continue(self, cands: Candidates, keep: list[int], scheduler: Scheduler) -> list[SampledToken]:
        """Make the kept candidates the live beams: prune unchosen beams, fork the others; return their tokens."""
        children: dict[int, list[int]] = {}
        for r in keep:
            children.setdefault(cands.parents[r], []).append(r)
        for i, beam in enumerate(self.beams):
            if i not in children:
                scheduler.finish(beam, "pruned")  # its blocks are free from now
        chosen = {}
        for i, ranks in children.items():
            parent = self.beams[i]
            seqs = [parent] + [scheduler.fork(self.group, parent) for _ in ranks[1:]]  # forked before parent grows
            chosen.update(zip(ranks, seqs))
        self.beams = [chosen[r] for r in keep]
        return [SampledToken(self.group, chosen[r], cands.tokens[r], cands.logprobs[r], cands.top_logprobs[r])
                for r in keep]  # fmt: skip

    def finish(self, scheduler: Scheduler) -> None:
        """End the search: free every live beam now (the group is retired with the step)."""
        for beam in self.beams:
            scheduler.finish(beam, "pruned")
        self.beams, self.scores = [], torch.zeros(0)


def _length_norm(length: int, length_penalty: float) -> float:
    """``length ** length_penalty``, infinite past the largest float (a huge penalty ranks, never raises)."""
    try:
        return float(length) ** length_penalty
    except OverflowError:
        return math.inf


def _should_stop(req: BeamRequest, running: torch.Tensor, length: int) -> bool:
    """transformers' stopping rule, given the next beams' scores ``[<=W]`` (best first)."""
    p = req.params
    if running.numel() == 0:
        return True  # max_tokens reached: every candidate became a hypothesis
    if len(req.finished) < p.width:
        return False
    if p.early_stopping is True:
        return True
    best_length = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else length
    best_possible = running[0] / _length_norm(best_length, p.length_penalty)  # float32
    return not bool(best_possible > req.finished[-1].score)

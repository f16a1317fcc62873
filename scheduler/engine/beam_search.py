"""Beam search on the serving engine, with beams sharing their KV blocks copy-on-write.

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

Every live beam of every request runs in the same engine step: the search drives the
engine's own :meth:`~scheduler.engine.llm_engine.LLMEngine.step` with a selection hook in place
of sampling (it forks, prunes and picks every beam's token), so scheduling, preemption,
stop bookkeeping and metrics are the engine's.

Where vLLM's ``LLM.beam_search`` differs (deliberately: transformers is the oracle here). vLLM
scores ``cum_logprob / len ** length_penalty`` with ``len`` the prompt plus output tokens less a
final EOS, keeps every EOS candidate of every beam's top ``2W`` as finished, never stops early
and returns the best ``W`` of finished and running beams; here ``len`` counts output tokens
(EOS included), only EOS candidates among the best ``W`` finish, and ``early_stopping`` applies.
vLLM's ``beam_width`` is ``width`` here; there is no ``temperature`` (scores are the model's
log-probabilities, as vLLM's raw logprobs); ``stop_token_ids`` end hypotheses as EOS does (vLLM
knows only the tokenizer's EOS); a hypothesis holds its output tokens and per-token
log-probabilities (vLLM: prompt + output tokens, top-``2W`` dicts), its text (from
:meth:`~scheduler.entrypoints.llm.LLM.beam_search`) is the output's, its stop token left out;
and ``prompt + max_tokens`` past the model context is refused up front.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from paged_kv.errors import (
    InvalidArgumentError,
    SequenceStateError,
    UnknownSequenceError,
    check_bool,
    check_int,
    check_type,
    describe,
)
from scheduler.core.params import MAX_SAMPLES, SamplingParams, per_prompt
from scheduler.core.scheduler_output import SampledToken, SchedulerOutput
from scheduler.core.sequence import Sequence, SequenceGroup
from scheduler.engine.llm_engine import LLMEngine
from scheduler.engine.request_checks import check_within_context


@dataclass(frozen=True, kw_only=True)
class BeamSearchParams:
    """Width, length and stopping rules of one beam search (transformers' meaning for each)."""

    width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0  # > 0 favours longer hypotheses
    early_stopping: bool | str = False  # False, True or "never"
    stop_token_ids: tuple[int, ...] = ()  # end a hypothesis like EOS does
    ignore_eos: bool = False  # the engine's EOS ids do not end hypotheses

    def __post_init__(self) -> None:
        check_int("width", self.width, low=1, high=MAX_SAMPLES)
        check_int("max_tokens", self.max_tokens, low=1)
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise InvalidArgumentError(describe("length_penalty", lp, "a finite number"))
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise InvalidArgumentError(describe("early_stopping", self.early_stopping, "True, False or 'never'"))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(describe("ignore_eos", self.ignore_eos, "a bool"))
        # SamplingParams checks the stop ids; the beams themselves never stop on them
        stop = SamplingParams(stop_token_ids=self.stop_token_ids).stop_token_ids
        object.__setattr__(self, "stop_token_ids", stop)

    def engine_params(self) -> SamplingParams:
        """What the engine sees: ``width`` sequences at most, none stopped by the engine itself."""
        return SamplingParams(max_tokens=self.max_tokens, n=self.width, ignore_eos=True)


@dataclass(frozen=True, kw_only=True)
class BeamHypothesis:
    """One finished beam: its output tokens and scores."""

    token_ids: list[int]  # an EOS / stop token that ended it is its last token
    logprobs: list[float]  # log-probability of each output token
    cumulative_logprob: float  # float32 running sum, as ranked
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" or "length"
    text: str | None = None  # the output as text, its stop token left out: LLM.beam_search fills it (no tokenizer here)


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


@dataclass(frozen=True, kw_only=True)
class BeamSearchOutput:
    """A request's prompt, its hypotheses best first, and the KV memory its beams held."""

    request_id: str
    prompt_token_ids: list[int]
    hypotheses: list[BeamHypothesis]  # up to ``width``, best score first
    num_steps: int  # selection rounds until the search stopped (one per model step of its beams)
    memory: BeamMemory


class _Meter:
    """Peak and summed block counts, shared and unshared."""

    def __init__(self) -> None:
        self.peak = self.peak_unshared = self.steps = self.steps_unshared = 0

    def record(self, shared: int, unshared: int) -> None:
        self.peak, self.peak_unshared = max(self.peak, shared), max(self.peak_unshared, unshared)
        self.steps, self.steps_unshared = self.steps + shared, self.steps_unshared + unshared

    def freeze(self, block_size: int, bytes_per_block: int) -> BeamMemory:
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


def top_candidates(logits: torch.Tensor, scores: torch.Tensor, k: int) -> Candidates:
    """The ``k`` best (beam, token) pairs of ``logits [B, V]`` given beam scores ``[B]``.

    The scoring runs on the logits' device (``scores`` are moved there); the ``k`` winners
    come back to the host in one copy.
    """
    return top_candidates_batch([(logits, scores, k)])[0]


def top_candidates_batch(requests: Seq[tuple[torch.Tensor, torch.Tensor, int]]) -> list[Candidates]:
    """``top_candidates`` of several requests' ``(logits, scores, k)``, with one device->host copy for all."""
    winners = []
    for logits, scores, k in requests:
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V] float32
        totals = logprobs + scores.to(logprobs.device, torch.float32)[:, None]  # [B, V]
        top, flat = totals.flatten().topk(k)  # [K], [K]
        # float64 holds the flat indices (< 2**53) and the float32 values exactly
        winners.append(torch.stack([flat.double(), top.double(), logprobs.flatten()[flat].double()]))  # [3, K]
    host = torch.cat(winners, dim=1).cpu()  # [3, sum of K]: the one transfer
    out, start = [], 0
    for logits, _, k in requests:
        vocab, part = logits.shape[-1], host[:, start : start + k]
        ids = part[0].long().tolist()
        out.append(Candidates([i // vocab for i in ids], [i % vocab for i in ids], part[1].float(), part[2].tolist()))
        start += k
    return out


class _Request:
    """A running beam search: its live beams in rank order, their scores, its hypotheses."""

    def __init__(self, group: SequenceGroup, params: BeamSearchParams, eos: frozenset[int]) -> None:
        self.group, self.params, self.eos = group, params, eos
        self.beams: list[Sequence] = list(group.seqs)
        self.scores = torch.zeros(1)  # [B] float32 cumulative logprob of each live beam, on the CPU
        self.finished: list[BeamHypothesis] = []  # best first, at most width
        self.ready: dict[int, torch.Tensor] = {}  # seq_id -> logits [V] of a beam computed to its end
        self.done = False
        self.num_steps = 0
        self.meter = _Meter()

    @property
    def num_candidates(self) -> int:
        """K: enough that ``width`` candidates are left once EOS ones are set aside."""
        return max(2, 1 + len(self.eos)) * self.params.width

    def all_ready(self) -> bool:
        """Whether every live beam has the logits of its last token."""
        return all(s.seq_id in self.ready and s.num_uncomputed == 0 for s in self.beams)


class BeamSearch:
    """Runs beam searches on an engine, every live beam of every request batched per step.

    The engine must be idle while ``generate`` runs: it drives the engine's
    schedule / run_model loop itself and chooses every token.
    """

    def __init__(self, engine: LLMEngine) -> None:
        check_type("engine", engine, LLMEngine, "an LLMEngine")
        self.engine = engine
        self.last_memory: BeamMemory | None = None  # all requests of the last generate() together
        self._ids = itertools.count()

    def generate(
        self, prompts: Seq[Seq[int]], params: BeamSearchParams | Seq[BeamSearchParams] | None = None,
        *, use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:  # fmt: skip
        """Beam-search every prompt (token id lists) to the end; outputs in prompt order."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Seq):
            raise InvalidArgumentError(describe("prompts", type(prompts).__name__, "a list of token id lists"))
        check_bool("use_tqdm", use_tqdm)
        requests = self._add_all(prompts, params)
        total = _Meter()
        select = lambda out, logits: self._select(requests, total, out, logits)  # noqa: E731
        try:
            with tqdm(total=len(requests), desc="beam search", unit="req", disable=not use_tqdm) as bar:
                while not all(r.done for r in requests):
                    before = sum(r.done for r in requests)
                    self.engine.step(select)
                    bar.update(sum(r.done for r in requests) - before)
        except BaseException:
            self._abort(requests)
            raise
        spec = self.engine.runner.gpu_cache.spec
        self.last_memory = total.freeze(spec.block_size, spec.bytes_per_block)
        return [self._output(r, spec.block_size, spec.bytes_per_block) for r in requests]

    def _abort(self, requests: list[_Request]) -> None:
        """Drop every request still in the engine (an error or interrupt stopped the search)."""
        for req in requests:
            try:
                self.engine.abort(req.group.request_id)
            except UnknownSequenceError:  # already finished and retired
                pass

    # -- admission ----------------------------------------------------------
    def _add_all(self, prompts: Seq[Seq[int]], params) -> list[_Request]:
        """Check every request, then queue them all (nothing is queued if one is bad)."""
        engine = self.engine
        if engine.has_unfinished_requests():
            raise SequenceStateError(describe("engine", "busy", "an engine with no unfinished request"))
        each = per_prompt(params, len(prompts), BeamSearchParams, "params")
        no_eos = frozenset()
        eos = [frozenset(p.stop_token_ids) | (no_eos if p.ignore_eos else engine.scheduler.eos_token_ids) for p in each]
        checked = []
        for prompt, p, stops in zip(prompts, each, eos):
            request_id = f"beam-search-{next(self._ids)}"
            checked.append((request_id, *engine.check_request(request_id, prompt, p.engine_params())))
            check_within_context(len(checked[-1][1]), p.max_tokens, engine.model.config)  # every beam runs to it
            k = max(2, 1 + len(stops)) * p.width
            if k > engine.model.config.vocab_size:
                raise InvalidArgumentError(describe("width", p.width, f"at most vocab_size / {k // p.width}"))
        requests = []
        for (request_id, prompt, sp), p, stops in zip(checked, each, eos):
            group = engine.add_request(request_id, prompt, sp, fork_samples=False)  # the search forks its beams
            requests.append(_Request(group, p, stops))
        return requests

    # -- the selection hook of one engine step ----------------------------------
    def _select(
        self, requests: list[_Request], total: _Meter, out: SchedulerOutput, logits: torch.Tensor
    ) -> list[SampledToken]:
        """Collect the step's beam logits; advance each request whose beams are all computed; return their tokens."""
        if out.is_empty and not out.preempted:
            raise SequenceStateError(describe("scheduler", "no progress", "a step that runs or moves something"))
        live = [r for r in requests if not r.done]
        self._measure(live, total)
        by_id = {r.group.request_id: r for r in live}
        for group, seq, row in out.samples:
            by_id[group.request_id].ready[seq.seq_id] = logits[row]
        ready = [r for r in live if r.all_ready()]  # after a chunked re-prefill some beams wait for the others
        tokens: list[SampledToken] = []
        for req, cands in zip(ready, self._candidates(ready)):
            tokens += self._advance(req, cands)
        return tokens

    def _measure(self, live: list[_Request], total: _Meter) -> None:
        """Record the GPU blocks each request's beams hold, shared and as if unshared."""
        bm, union, unshared = self.engine.block_manager, set(), 0
        for req in live:
            tables = [bm.block_table(s.seq_id) for s in req.beams if s.seq_id in bm and not bm.is_swapped(s.seq_id)]
            blocks = {b for t in tables for b in t}
            req.meter.record(len(blocks), sum(map(len, tables)))
            union |= blocks
            unshared += sum(map(len, tables))
        total.record(len(union), unshared)

    # -- selection ------------------------------------------------------------
    def _candidates(self, ready: list[_Request]) -> list[Candidates]:
        """Every ready request's top candidates from its beams' logits, in one device->host copy."""
        if not ready:
            return []
        batch = []
        for req in ready:
            logits = torch.stack([req.ready.pop(s.seq_id) for s in req.beams])  # [B, V]
            req.ready.clear()
            batch.append((logits, req.scores, req.num_candidates))
        return top_candidates_batch(batch)

    def _advance(self, req: _Request, cands: Candidates) -> list[SampledToken]:
        """Pick the request's next beams and hypotheses from its candidates (their tokens); stop it when it is done."""
        p = req.params
        req.num_steps += 1
        length = req.beams[0].num_outputs + 1  # output tokens of every candidate
        ends = [length >= p.max_tokens or t in req.eos for t in cands.tokens]
        self._add_hypotheses(req, cands, ends, length)  # a full set with early_stopping=True has stopped already
        keep = [r for r, end in enumerate(ends) if not end][: p.width]
        scores = cands.scores[keep]  # [W] float32, best first
        if _should_stop(req, scores, length):
            self._finish(req)
            return []
        req.scores = scores
        return self._continue(req, cands, keep)

    def _add_hypotheses(self, req: _Request, cands: Candidates, ends: list[bool], length: int) -> None:
        """Candidates among the first ``width`` that end join the hypotheses; the best ``width`` stay."""
        p = req.params
        penalized = (cands.scores / (length**p.length_penalty)).tolist()  # float32 division, as transformers
        new = []
        for r in range(min(p.width, len(ends))):
            if ends[r]:
                parent, token = req.beams[cands.parents[r]], cands.tokens[r]
                new.append(BeamHypothesis(
                    token_ids=parent.output_token_ids + [token], logprobs=parent.logprobs + [cands.logprobs[r]],
                    cumulative_logprob=float(cands.scores[r]), score=penalized[r],
                    finish_reason="stop" if token in req.eos else "length",
                ))  # fmt: skip
        req.finished = sorted(req.finished + new, key=lambda h: -h.score)[: p.width]

    def _continue(self, req: _Request, cands: Candidates, keep: list[int]) -> list[SampledToken]:
        """Make the kept candidates the live beams: prune unchosen beams, fork the others; return their tokens."""
        scheduler, children = self.engine.scheduler, {}
        for r in keep:
            children.setdefault(cands.parents[r], []).append(r)
        for i, beam in enumerate(req.beams):
            if i not in children:
                scheduler.finish(beam, "pruned")  # its blocks are free from now
        chosen = {}
        for i, ranks in children.items():
            parent = req.beams[i]
            seqs = [parent] + [scheduler.fork(req.group, parent) for _ in ranks[1:]]  # forked before parent grows
            chosen.update(zip(ranks, seqs))
        req.beams = [chosen[r] for r in keep]
        return [SampledToken(req.group, chosen[r], cands.tokens[r], cands.logprobs[r]) for r in keep]

    def _finish(self, req: _Request) -> None:
        """End a request: free every live beam now."""
        for beam in req.beams:
            self.engine.scheduler.finish(beam, "pruned")
        req.beams, req.done = [], True

    def _output(self, req: _Request, block_size: int, bytes_per_block: int) -> BeamSearchOutput:
        return BeamSearchOutput(
            request_id=req.group.request_id, prompt_token_ids=req.group.prompt_token_ids,
            hypotheses=list(req.finished), num_steps=req.num_steps,
            memory=req.meter.freeze(block_size, bytes_per_block),
        )  # fmt: skip


def _should_stop(req: _Request, running: torch.Tensor, length: int) -> bool:
    """transformers' stopping rule, given the next beams' scores ``[<=W]`` (best first)."""
    p = req.params
    if running.numel() == 0:
        return True  # max_tokens reached: every candidate became a hypothesis
    if len(req.finished) < p.width:
        return False
    if p.early_stopping is True:
        return True
    best_length = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else length
    best_possible = running[0] / (best_length**p.length_penalty)  # float32
    return not bool(best_possible > req.finished[-1].score)

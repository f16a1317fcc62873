"""Beam search on the serving engine: run searches to the end, beams sharing their KV blocks copy-on-write.

The search itself is the engine's (:meth:`~scheduler.engine.llm_engine.LLMEngine.add_beam_search`;
semantics, transformers', in :mod:`scheduler.engine.beam_selection`): every live beam of every
search runs in the engine's own steps, beside whatever sampled requests the engine holds, so
scheduling, preemption, stop bookkeeping and metrics are the engine's. :class:`BeamSearch` adds
searches and steps the engine until they are done; the server adds them one by one instead.

Where vLLM's ``LLM.beam_search`` differs (deliberately: transformers is the oracle here). vLLM
scores ``cum_logprob / len ** length_penalty`` with ``len`` the prompt plus output tokens less a
final EOS, keeps every EOS candidate of every beam's top ``2W`` as finished, never stops early
and returns the best ``W`` of finished and running beams; here ``len`` counts output tokens
(EOS included), only EOS candidates among the best ``W`` finish, and ``early_stopping`` applies.
vLLM's ``beam_width`` is ``width`` here; there is no ``temperature`` (scores are the model's
log-probabilities, as vLLM's raw logprobs); ``stop_token_ids`` end hypotheses as EOS does (vLLM
knows only the tokenizer's EOS); a hypothesis holds its output tokens and per-token
log-probabilities (vLLM: prompt + output tokens, top-``2W`` dicts), its text (from
:meth:`~scheduler.entrypoints.llm.LLM.beam_search`) is the output's, its stop token's text left out
unless ``include_stop_str_in_output``; its ``stop_reason`` is vLLM's (the stop token that ended it, EOS
included), but the server's choices report a sampled request's (None for EOS, where vLLM's server gives
the EOS id); an aborted search ends every output it returns with "abort" (vLLM's keeps "stop" on its
finished hypotheses and ranks the aborted beams among them); and ``prompt + max_tokens`` past the model
context is refused up front.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from tqdm.auto import tqdm

from paged_kv.errors import InvalidArgumentError, UnknownSequenceError, check_bool, check_type, describe
from scheduler.core.lora_request import LoRARequest, lora_per_prompt
from scheduler.core.params import per_prompt
from scheduler.engine.beam_selection import (
    BeamHypothesis,
    BeamMemory,
    BeamRequest,
    BeamSearchParams,
    Candidates,
    Meter,
    top_candidates,
    top_candidates_batch,
)
from scheduler.engine.llm_engine import LLMEngine

__all__ = [
    "BeamHypothesis", "BeamMemory", "BeamSearch", "BeamSearchOutput", "BeamSearchParams", "Candidates",
    "top_candidates", "top_candidates_batch",
]  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class BeamSearchOutput:
    """A request's prompt, its hypotheses best first, and the KV memory its beams held."""

    request_id: str
    prompt_token_ids: list[int]
    hypotheses: list[BeamHypothesis]  # up to ``width``, best score first
    num_steps: int  # selection rounds until the search stopped (one per model step of its beams)
    memory: BeamMemory
    error: str | None = None  # why the search failed alone (its hypotheses are those found before), else None


class BeamSearch:
    """Runs beam searches on an engine to the end, every live beam of every request batched per step."""

    def __init__(self, engine: LLMEngine) -> None:
        check_type("engine", engine, LLMEngine, "an LLMEngine")
        self.engine = engine
        self.last_memory: BeamMemory | None = None  # all requests of the last generate() together

    def generate(
        self, prompts: Seq[Seq[int]], params: BeamSearchParams | Seq[BeamSearchParams] | None = None,
        *, use_tqdm: bool = False, lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:  # fmt: skip
        """Beam-search every prompt (token id lists) to the end; outputs in prompt order (``lora_request``: the
        adapter of every prompt, or one per prompt).

        Requests already in the engine run in the same steps; those that finish meanwhile are
        returned by those steps, not here (as :meth:`LLMEngine.generate`).
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Seq):
            raise InvalidArgumentError(describe("prompts", type(prompts).__name__, "a list of token id lists"))
        check_bool("use_tqdm", use_tqdm)
        total = Meter()
        requests = self._add_all(prompts, params, total, lora_per_prompt(lora_request, len(prompts)))
        try:
            with tqdm(total=len(requests), desc="beam search", unit="req", disable=not use_tqdm) as bar:
                while not all(r.done for r in requests):
                    before = sum(r.done for r in requests)
                    self.engine.step()
                    bar.update(sum(r.done for r in requests) - before)
        except BaseException:
            self._abort(requests)
            raise
        spec = self.engine.runner.gpu_cache.spec
        self.last_memory = total.freeze(spec.block_size, spec.bytes_per_block)
        return [self._output(r, spec.block_size, spec.bytes_per_block) for r in requests]

    def _add_all(self, prompts: Seq[Seq[int]], params, total: Meter, loras: list) -> list[BeamRequest]:
        """Check every request, then queue them all (nothing is queued if one is bad), sharing ``total``."""
        engine = self.engine
        each = per_prompt(params, len(prompts), BeamSearchParams, "params")
        ids = [engine.new_request_id("beam-search") for _ in prompts]
        staged = engine.stage_loras(loras)  # nothing loaded until queued
        checked = [engine.check_beam_search(rid, prompt, p, lora=key)[0]
                   for rid, prompt, p, (key, _) in zip(ids, prompts, each, staged)]  # fmt: skip
        requests = []
        for rid, prompt, p, (_, read) in zip(ids, checked, each, staged):
            req = engine.add_beam_search(rid, prompt, p, measure=True, lora_request=read)
            req.total = total
            requests.append(req)
        return requests

    def _abort(self, requests: list[BeamRequest]) -> None:
        """Drop every request still in the engine (an error or interrupt stopped the search)."""
        for req in requests:
            try:
                self.engine.abort(req.group.request_id)
            except UnknownSequenceError:  # already finished and retired
                pass

    @staticmethod
    def _output(req: BeamRequest, block_size: int, bytes_per_block: int) -> BeamSearchOutput:
        return BeamSearchOutput(
            request_id=req.group.request_id, prompt_token_ids=req.group.prompt_token_ids,
            hypotheses=list(req.finished), num_steps=req.num_steps,
            memory=req.meter.freeze(block_size, bytes_per_block), error=req.error,
        )  # fmt: skip

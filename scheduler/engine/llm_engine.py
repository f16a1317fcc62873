"""LLMEngine: continuous batching of requests over a paged KV cache and a Llama-family model.

One step is four calls, each owned by one module (the third by two: sampling, beam selection)::

    out = scheduler.schedule()                          # core/scheduler.py: which tokens run, blocks recorded
    logits = runner.run(out)                            # runner/model_runner.py: inputs, block moves, forward
    sampled = _choose(out, logits)                      # engine/step_sampling.py, engine/beam_requests.py
    finished = scheduler.update_from_output(out, sampled)  # append, stop, free, retire

With ``EngineConfig.speculative_config`` (:mod:`scheduler.engine.spec_decode`) decode sequences of the requests it
serves run n-gram drafts, verified in step 3 (the verification's results and the sampled rows' come back in one
device->host transfer); the others decode as without it.

Beam searches (:meth:`add_beam_search`) are requests like the others: their rows of a step are
selected by :mod:`scheduler.engine.beam_requests` (fork, prune, hypotheses), the other rows are
sampled (:mod:`scheduler.engine.step_sampling`), and a finished search is returned by :meth:`step`
with its hypotheses as its outputs.

Embedding requests (:meth:`add_pooling_request`) run their prompt in the same steps with no logits row: the runner
returns their rows' final-norm hidden states beside the logits, :mod:`scheduler.engine.pooler` folds them into each
request's vector, and the step that computes the last prompt token returns it (:class:`EmbeddingRequestOutput`).

A request's own failure (its sampling, its token's bookkeeping) fails it alone; a failure of
the step itself aborts every live request (:mod:`scheduler.engine.faults`).

The engine is built by :mod:`scheduler.engine.engine_setup` (model placement, KV pool sizing,
runner, tiers) and admits a request only once :mod:`scheduler.engine.request_checks` passes it:
a refused request leaves the engine unchanged.

The scheduler and the block manager live here, in the driver; the runner gets the step's
decisions, builds device inputs on the host, and the only device->host transfer of a step is
the sampled tokens (and the beam searches' candidates: a second one in a step that has both).
On CUDA, decode steps replay captured graphs (:mod:`scheduler.runner.cuda_graphs`) unless
``EngineConfig.enforce_eager``.

With ``EngineConfig.tensor_parallel_size = N > 1`` the engine is rank 0 of a tensor-parallel
group (:mod:`scheduler.runner.tp_executor`): it keeps the scheduler, the block manager and the
sampler, holds its shard of the model and a pool of its KV heads, and the runner broadcasts
each step's payload to the workers before running its forward with them. Call
:meth:`shutdown` (or use the engine as a context manager) to stop the workers.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from paged_kv.errors import (
    InvalidArgumentError,
    UnknownSequenceError,
    check_bool,
    check_type,
    describe,
)
from scheduler.core.config import EngineConfig
from scheduler.core.lora_request import LoRAKey, LoRARequest, lora_per_prompt
from scheduler.core.outputs import EmbeddingRequestOutput, RequestOutput
from scheduler.core.params import SamplingParams, per_prompt
from scheduler.core.pooling_params import PoolerConfig, PoolingParams
from scheduler.core.scheduler import Scheduler
from scheduler.core.scheduler_output import SampledToken, SchedulerOutput
from scheduler.core.sequence import SequenceGroup
from scheduler.core.structured_params import StructuredOutputsParams
from scheduler.engine.beam_requests import BeamRequests
from scheduler.engine.beam_selection import BeamRequest, BeamSearchParams, check_beam_fits
from scheduler.engine.cache_events import CacheEvents
from scheduler.engine.engine_setup import (
    eos_id_set,
    kv_events,
    make_block_manager,
    make_loras,
    make_runner,
    make_structured_outputs,
    make_tiers,
    num_gpu_blocks,
    place_model,
    uses_graphs,
)
from scheduler.engine.faults import Failure
from scheduler.engine.lora_requests import LoRARequests
from scheduler.engine.metrics import EngineMetrics, MetricsSummary
from scheduler.engine.pinned_prefixes import PinnedPrefixes
from scheduler.engine.pooler import Pooler
from scheduler.engine.request_checks import (
    RequestChecks,
    check_prompt,
    check_sample_indices,
    check_structured_outputs,
)
from scheduler.engine.spec_decode import SpecDecode
from scheduler.engine.step_sampling import Selector, StepSampling
from scheduler.model.llama import LlamaModel
from scheduler.runner.lora_manager import ReadLoRA
from scheduler.runner.sampler import Sampler

if TYPE_CHECKING:
    from scheduler.engine.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)
_POOLING = SamplingParams(max_tokens=1)  # an embedding request's scheduler parameters: one sequence, never sampled


class LLMEngine:
    """Serves generation requests with continuous batching, prefix caching and preemption."""

    def __init__(self, model: LlamaModel, config: EngineConfig | None = None, *, eos_token_id=None) -> None:
        check_type("model", model, LlamaModel, "a LlamaModel")
        check_type("config", config, (EngineConfig, type(None)), "an EngineConfig or None")
        eos_ids = eos_id_set(eos_token_id)
        self.config = config = config or EngineConfig()
        model, self.device, self.executor = place_model(model, config)  # starts the TP workers, if any
        self.model = model
        loras = make_loras(model, config)  # slots on the device before the pool is sized (CUDA: counted in use)
        cc, events = config.cache, kv_events(config)
        spec = model.kv_cache_spec(cc.block_size, cc.dtype)
        graphs = uses_graphs(config, self.device)
        num_blocks = num_gpu_blocks(model, spec, config, self.device, graphs)
        self.block_manager = make_block_manager(spec, cc, num_blocks, track_events=events is not None)
        self.runner = make_runner(model, spec, num_blocks, config, self.device, self.executor, graphs)
        self.runner.loras = loras
        self.lora_requests = LoRARequests(self.runner)  # adapters staged before admission, kept once queued
        self.tiers = make_tiers(model, spec, cc, self.block_manager, self.runner)
        prefetch = self.tiers.prefetch if self.tiers is not None else None
        self.spec = SpecDecode(config.speculative_config) if config.speculative_config is not None else None
        self.scheduler = Scheduler(config.scheduler, self.block_manager, eos_ids, prefetch=prefetch,
                                   max_model_len=model.config.max_position_embeddings,
                                   proposer=self.spec.proposer if self.spec is not None else None,
                                   max_loras=config.lora_config.max_loras if config.lora_config else 0)  # fmt: skip
        self.pins = PinnedPrefixes(self.block_manager, self._warm_up)
        disk = self.tiers.disk if self.tiers is not None else None
        self.cache_events = None if events is None else CacheEvents(events, self.block_manager, disk)
        self.sampling = StepSampling(Sampler(model.config.vocab_size, self.device, eos_ids), self.device)  # step 3
        self.metrics = EngineMetrics()
        self.beams = BeamRequests(self.scheduler, self.block_manager)  # the live beam searches
        pooling = config.pooler_config if config.pooler_config is not None else PoolerConfig()  # None: the defaults
        self.pooler = Pooler(pooling)  # embedding requests' vectors
        self.checks = RequestChecks(self.scheduler.requests, model.config, config.scheduler, self.block_manager,
                                    self.pooler.config)  # a request's admission: refused, nothing changes
        self._auto_ids = itertools.count()

    @property
    def sampler(self) -> Sampler:
        """The sampler of the step's rows (it keeps penalty counts per sequence)."""
        return self.sampling.sampler

    @property
    def structured(self) -> StructuredOutputs | None:
        """The grammars of constrained requests (their bitmask each step); None until enable_structured_outputs."""
        return self.sampling.structured

    @structured.setter
    def structured(self, structured: StructuredOutputs | None) -> None:
        self.sampling.structured = structured

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module, config: EngineConfig | None = None) -> LLMEngine:
        """An engine over a transformers Llama-family model (Llama, Mistral, Qwen2, Qwen3), EOS from its configs."""
        from scheduler.model.weights import from_hf_model

        model = from_hf_model(hf_model)  # checks hf_model first
        gen = getattr(hf_model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = eos if eos is not None else getattr(hf_model.config, "eos_token_id", None)
        return cls(model, config, eos_token_id=eos)

    def enable_structured_outputs(self, tokenizer, *, cache_size: int = 64) -> None:
        """Serve ``SamplingParams.structured_outputs`` with xgrammar over ``tokenizer`` (the model's transformers
        tokenizer; ``LLM`` and the server give theirs), keeping ``cache_size`` compiled grammars."""
        self.structured = make_structured_outputs(tokenizer, self.model.config.vocab_size,
                                                  self.scheduler.eos_token_ids, self.device, cache_size)

    # -- requests ---------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: Seq[int], sampling_params: SamplingParams | None = None,
        *, fork_samples: bool = True, priority: int = 0, lora_request: LoRARequest | ReadLoRA | None = None,
    ) -> SequenceGroup:  # fmt: skip
        """Queue a request; raises (engine unchanged: no adapter loaded nor moved) on a bad id, prompt, parameters or
        adapter.

        ``fork_samples=False``: the caller forks the request's sequences itself (see :meth:`step`).
        ``priority`` (vLLM's: lower is more important) orders the eviction of its cached blocks, and its scheduling
        under ``scheduling_policy="priority"``. ``lora_request``: the LoRA adapter it runs through (read now unless
        loaded, or already read by ``LoRAManager.read``; kept once the request is queued).
        """
        check_bool("fork_samples", fork_samples)
        staged = self.lora_requests.stage(lora_request)
        lora = staged[0] if staged is not None else None
        prompt, params = self.check_request(request_id, prompt_token_ids, sampling_params, lora=lora)
        if not fork_samples and params.structured_outputs is not None:  # a caller's selection would skip the mask
            raise InvalidArgumentError(describe("fork_samples", False, "True with structured_outputs (no beam search)"))
        group = self.scheduler.add_request(request_id, prompt, params, fork_samples=fork_samples, priority=priority,
                                           lora=lora)  # fmt: skip
        self.lora_requests.keep(staged, group, self.cache_events)
        if self.spec is not None:  # drafts only where verification gives exactly the request's tokens
            group.speculative = self.spec.serves(params, fork_samples=fork_samples)
        return group

    def add_beam_search(
        self, request_id: str, prompt_token_ids: Seq[int], params: BeamSearchParams, *, priority: int = 0,
        measure: bool = False, lora_request: LoRARequest | ReadLoRA | None = None,
    ) -> BeamRequest:  # fmt: skip
        """Queue a beam search (transformers' semantics: :mod:`scheduler.engine.beam_selection`); raises, engine
        unchanged, on a bad one. It runs in the same steps as the sampled requests; :meth:`step` returns it once
        done, its outputs the hypotheses best first. The returned state holds its scores and, with ``measure``,
        its memory figures (its beams' block tables read each step). Every beam runs through ``lora_request``."""
        check_bool("measure", measure)
        staged = self.lora_requests.stage(lora_request)
        lora = staged[0] if staged is not None else None
        prompt, sampling = self.check_beam_search(request_id, prompt_token_ids, params, lora=lora)
        group = self.scheduler.add_request(request_id, prompt, sampling, fork_samples=False, priority=priority,
                                           lora=lora)  # fmt: skip
        self.lora_requests.keep(staged, group, self.cache_events)
        return self.beams.add(group, params, measure=measure)

    def add_pooling_request(
        self, request_id: str, prompt_token_ids: Seq[int], pooling_params: PoolingParams | None = None,
        *, priority: int = 0,
    ) -> SequenceGroup:  # fmt: skip
        """Queue an embedding request; raises (engine unchanged) on a bad id, prompt or parameters.

        Its prompt runs as a prefill (chunked, batched with the other requests' steps); no token is sampled and no
        logits are computed for it. The step that computes its last prompt token returns it (an
        :class:`EmbeddingRequestOutput`, its vector pooled as ``config.pooler_config`` says) and frees its blocks.
        """
        prompt, params = self.check_pooling_request(request_id, prompt_token_ids, pooling_params)
        return self.scheduler.add_request(request_id, prompt, _POOLING, priority=priority, pooling=params,
                                          pool_all=self.pooler.config.pools_every_token)  # fmt: skip

    def check_pooling_request(
        self, request_id: str, prompt_token_ids: Seq[int], pooling_params: PoolingParams | None
    ) -> tuple[list[int], PoolingParams]:  # fmt: skip
        """Validate an embedding request without queueing it; return the prompt and its resolved parameters."""
        return self.checks.pooling(request_id, prompt_token_ids, pooling_params)

    def check_beam_search(
        self, request_id: str, prompt_token_ids: Seq[int], params: BeamSearchParams, *, lora: LoRAKey | None = None
    ) -> tuple[list[int], SamplingParams]:  # fmt: skip
        """Validate a beam search without queueing it: a request's checks, every beam within the model context,
        ``K`` candidates within the vocabulary; return the prompt and the engine's parameters."""
        check_type("params", params, BeamSearchParams, "a BeamSearchParams")
        prompt, sampling = self.check_request(request_id, prompt_token_ids, params.engine_params(), lora=lora)
        check_beam_fits(len(prompt), params, self.scheduler.eos_token_ids, self.model.config)
        return prompt, sampling

    def pin_prefix(self, token_ids: Seq[int], *, cache_salt: str | None = None) -> str:
        """Keep a prompt's full blocks on the device, never evicted, until :meth:`unpin`; returns the pin's id.

        A prefix not cached yet is computed by a one-token request first (its output is not
        returned); the pin holds from the step that finishes it.
        """
        prompt = check_prompt(token_ids, self.model.config.vocab_size)
        return self.pins.pin(prompt, SamplingParams(cache_salt=cache_salt).cache_salt)  # the salt checked

    def _warm_up(self, request_id: str, prompt: list[int], cache_salt: str | None) -> None:
        """Queue the one-token request that computes a pinned prefix."""
        self.add_request(request_id, prompt, SamplingParams(max_tokens=1, cache_salt=cache_salt))

    def unpin(self, pin_id: str) -> None:
        """Release a pinned prefix: its blocks are cached and evictable again."""
        self.pins.unpin(pin_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block of the device and host tiers; the number of device blocks forgotten.

        Running requests keep their blocks (no new request shares them); pinned prefixes stay cached;
        the disk tier keeps its files. KV events publish ``AllBlocksCleared`` (then what stays) at once.
        """
        before = self.block_manager.gpu.num_cached
        self.block_manager.reset_prefix_cache(keep_pinned=True)
        self.pins.forget_warm_ups()
        if self.cache_events is not None:
            self.cache_events.after_step()
        return before - self.block_manager.gpu.num_cached

    def new_request_id(self, prefix: str) -> str:
        """``prefix-N``, an id no live request holds (N from the engine's own counter, never reused)."""
        if not (isinstance(prefix, str) and prefix):
            raise InvalidArgumentError(describe("prefix", prefix, "a non-empty str"))
        while (request_id := f"{prefix}-{next(self._auto_ids)}") in self.scheduler.requests:
            pass  # a caller chose this id for a request of its own
        return request_id

    def load_lora(self, lora_request: LoRARequest | ReadLoRA | None) -> LoRAKey | None:
        """The adapter of a request, loaded (None: the base model); typed errors when LoRA is off or it is bad."""
        return self.lora_requests.load(lora_request)

    def stage_loras(self, lora_request: Seq[LoRARequest | None]) -> list[tuple[LoRAKey | None, ReadLoRA | None]]:
        """Each request's adapter (one per request, None: the base model) staged, nothing loaded: its key (for
        :meth:`check_request`) and its weights read (for :meth:`add_request`), each adapter read once; (None, None)
        for the base model. Typed errors."""
        return self.lora_requests.stage_each(lora_request)

    def check_request(
        self, request_id: str, prompt_token_ids: Seq[int], sampling_params: SamplingParams | None,
        *, lora: LoRAKey | None = None,
    ) -> tuple[list[int], SamplingParams]:  # fmt: skip
        """Validate a request without queueing it; return the prompt as a list and the parameters (``lora``: the
        key :meth:`load_lora` gave its adapter)."""
        return self.checks.sampled(request_id, prompt_token_ids, sampling_params, lora, self.structured)

    def check_structured_outputs(self, structured_outputs: StructuredOutputsParams) -> None:
        """Compile (and cache) a request's grammar now: an invalid one, or no tokenizer, raises before queueing."""
        check_structured_outputs(structured_outputs, self.structured)

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request now and free its blocks (every live beam of a beam search); returns what it had."""
        return self._output(self.scheduler.abort(request_id))

    def fail(self, request_id: str, error: str) -> RequestOutput:
        """Abort a request that failed outside the engine (its text layer): unfinished samples end with "error",
        blocks freed; returns its output with ``error`` set."""
        group = self._live(request_id)
        if not (isinstance(error, str) and error):
            raise InvalidArgumentError(describe("error", error, "a non-empty str"))
        return self._failed(group, error)

    def _failed(self, group: SequenceGroup, error: str) -> RequestOutput:
        """Abort ``group`` (if still live) with reason "error"; its output with ``error``."""
        if group.request_id in self.scheduler.requests:
            self.scheduler.abort(group.request_id, reason="error")
        return self._output(group, error)

    def _output(self, group: SequenceGroup, error: str | None = None) -> RequestOutput | EmbeddingRequestOutput:
        """A request's output: a beam search's hypotheses (forgotten once finished), an embedding request's vector,
        else its samples."""
        if group.pooling is not None:
            return EmbeddingRequestOutput.from_group(group, error=error)
        if group in self.beams:
            return self.beams.output(group, error)
        return RequestOutput.from_group(group, error=error)

    def stop_samples(self, request_id: str, indices: Iterable[int], reason: str = "stop") -> None:
        """End some samples of a live request now and free their blocks (a text layer matched a stop string).

        ``indices`` are sample indices, in ``[0, n)``; a sample already finished stays as it ended. A sample
        not forked yet (the request has not sampled) ends with no token and is never forked. A beam search or an
        embedding request has no samples to stop: refused (InvalidArgumentError), the request left as it was.
        """
        group = self._live(request_id)
        if group in self.beams:
            raise InvalidArgumentError(describe("request_id", request_id, "a sampled request, not a beam search"))
        if group.pooling is not None:  # an embedding request has no samples to stop
            expected = "a sampled request, not an embedding request"
            raise InvalidArgumentError(describe("request_id", request_id, expected))
        chosen = check_sample_indices(indices, group.num_samples)
        if not (isinstance(reason, str) and reason):
            raise InvalidArgumentError(describe("reason", reason, "a non-empty str"))
        self.scheduler.stop_samples(group, chosen, reason)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or swapped out."""
        return self.scheduler.has_unfinished()

    # -- the loop ---------------------------------------------------------
    def step(self, select: Selector | None = None) -> list[RequestOutput]:
        """Run one continuous-batching step; return the requests that finished in it, or failed.

        ``select`` replaces sampling: given the step and its logits (``out.num_sample_rows`` rows,
        indexed by ``out.samples``) it returns the chosen tokens, and may fork and finish
        sequences through the scheduler first. It is refused while a beam search or a constrained
        request is live (it would choose their tokens).

        A request whose sampling, beam selection or token bookkeeping raises is aborted alone (blocks freed) and
        returned with ``error`` set and its unfinished samples' finish reason "error"; the others
        get the tokens they would have had without it. Anything else that raises (scheduling, the
        model step, a ``select`` hook) aborts every live request first, logs the cause and propagates.
        """
        self._check_select(select)
        start = time.perf_counter()
        failures: dict[SequenceGroup, Failure] = {}
        recorded = self.scheduler.num_recorded_tokens
        try:
            out = self._schedule(select)
            logits = self.runner.run(out)  # [R + P + D, vocab]: sampled rows, prompt positions scored, draft rows
            self.pooler.collect(out, self.runner.take_pooled())  # embedding requests: no logits, their rows pooled
            if select is None:
                sampled = self._choose(out, logits, failures)
            else:
                sampled = self.sampling.select(select, out, logits)
            finished = self._update_each(out, sampled, failures)
        except BaseException as e:
            self._abort_all(e)
            raise
        usage = self.block_manager.usage
        # the tokens kept (appended), not those a stop among accepted drafts dropped
        self.metrics.record_step(start, out, self.scheduler.num_recorded_tokens - recorded, usage)
        if self.cache_events is not None:
            self.cache_events.after_step()
        failed = [self._failed(g, f.describe()) for g, f in failures.items()]
        failed += [self._failed(g, why) for g, why in out.refused]
        return self.pins.settle([self._retire(group) for group in finished if group not in failures] + failed)

    def _schedule(self, select: Selector | None) -> SchedulerOutput:
        """The step's work; a selection hook's step runs no drafts (the hook chooses one token per row)."""
        if select is None or self.spec is None:
            return self.scheduler.schedule()
        return self.scheduler.schedule(drafts=False)

    def _choose(self, out: SchedulerOutput, logits: torch.Tensor,
                failures: dict[SequenceGroup, Failure]) -> list[SampledToken]:  # fmt: skip
        """Every token of the step: the beam searches select theirs (one transfer for all), the others' rows are
        sampled and the drafts verified (one more); a request whose selection, sampling or verification raises goes
        into ``failures``."""
        beam_rows, rows = self.beams.split(out.samples)
        drafting = []
        if out.num_draft_tokens:  # speculative decoding: the drafting sequences' rows are verified
            rows, drafting = self.spec.split(out, rows)
        self.beams.measure()
        sampling_errors: dict[SequenceGroup, BaseException] = {}
        beam_errors: dict[SequenceGroup, BaseException] = {}
        verify_errors: dict[SequenceGroup, BaseException] = {}
        if drafting:  # one device->host transfer for the sampled rows and the verification
            sampled = self.spec.sample_and_verify(out, logits, rows, drafting, self.sampling, sampling_errors,
                                                  verify_errors)  # fmt: skip
        else:
            sampled = self.sampling.sample_each(out, logits, rows, sampling_errors)
        self._note_failures(failures, "sampling", sampling_errors)
        self._note_failures(failures, "draft verification", verify_errors)
        sampled += self.beams.select(beam_rows, logits, beam_errors)
        self._note_failures(failures, "beam selection", beam_errors)
        return sampled

    def _update_each(self, out: SchedulerOutput, sampled: list[SampledToken],
                     failures: dict[SequenceGroup, Failure]) -> list[SequenceGroup]:  # fmt: skip
        """Record the tokens; a request whose bookkeeping raises goes into ``failures``."""
        errors: dict[SequenceGroup, Exception] = {}
        finished = self.scheduler.update_from_output(out, sampled, errors)
        self._note_failures(failures, "token bookkeeping", errors)
        return finished

    @staticmethod
    def _note_failures(failures: dict[SequenceGroup, Failure], phase: str,
                       errors: dict[SequenceGroup, BaseException]) -> None:  # fmt: skip
        for group, error in errors.items():
            failures[group] = failure = Failure(phase, error)
            logger.error("request %s failed and is aborted alone: %s", group.request_id, failure.describe(),
                         exc_info=error)  # fmt: skip

    def _abort_all(self, cause: BaseException) -> None:
        """After a failed step: abort every live request (reason "error"), logging the cause."""
        ids = list(self.scheduler.requests)
        logger.error("engine step failed (%s: %s); aborting all %d live requests", type(cause).__name__, cause,
                     len(ids), exc_info=cause)  # fmt: skip
        for request_id in ids:
            try:
                self.scheduler.abort(request_id, reason="error")
            except Exception:  # the request is gone from the scheduler; keep freeing the others
                logger.exception("freeing %s after the failed step failed", request_id)
        self.beams.clear(f"engine step failed: {type(cause).__name__}: {cause}")
        # the step registered blocks (device, host) whose K/V it may never have written: forget them all
        self.block_manager.reset_prefix_cache()
        try:
            self.pins.restore()  # and compute the pinned prefixes again
        except Exception:  # the step's own failure is the one to propagate
            logger.exception("pinning the prefixes again after the failed step failed")

    def _check_select(self, select: Selector | None) -> None:
        """A selection hook must be callable, and cannot run while a request is constrained (it skips the mask) or
        a beam search is live (it would choose the beams' tokens)."""
        if select is None:
            return
        if not callable(select):
            raise InvalidArgumentError(describe("select", select, "None or a callable (out, logits) -> tokens"))
        if self.beams:
            raise InvalidArgumentError(describe("select", select, "None while a beam search is live"))
        if any(g.params.structured_outputs is not None for g in self.scheduler.requests.values()):
            raise InvalidArgumentError(describe("select", select, "None while a request has structured_outputs"))

    def sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[SampledToken]:
        """Sample every sequence that reached its last token and score the step's prompt rows, in one transfer.

        Forked samples draw from their parent's row; the rows of ``logits`` past the sampled ones
        are prompt positions, scored into their groups' ``prompt_logprobs``.
        """
        return self.sampling.sample(out, logits)

    def _retire(self, group: SequenceGroup) -> RequestOutput:
        """Count a finished request in the metrics; return its output."""
        self.metrics.record_finished(group)
        return self._output(group)

    # -- blocking API -----------------------------------------------------
    def generate(
        self, prompts: Seq[Seq[int]], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *, use_tqdm: bool = True, lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:  # fmt: skip
        """Run prompts (token id lists) to completion; outputs in prompt order (``error`` set on one that failed).

        ``lora_request``: the adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Seq):
            raise InvalidArgumentError(describe("prompts", type(prompts).__name__, "a list of token id lists"))
        check_bool("use_tqdm", use_tqdm)
        params = per_prompt(sampling_params, len(prompts), SamplingParams, "sampling_params")
        loras = self.stage_loras(lora_per_prompt(lora_request, len(prompts)))
        ids = [self.new_request_id("generate") for _ in prompts]
        checked = [self.check_request(i, prompt, p, lora=key)
                   for i, prompt, p, (key, _) in zip(ids, prompts, params, loras)]  # all or none  # fmt: skip
        for request_id, (prompt, p), (_, read) in zip(ids, checked, loras):
            self.add_request(request_id, prompt, p, lora_request=read)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.has_unfinished_requests():
                for out in self.step():
                    done[out.request_id] = out
                    bar.update(1)
        return [done[i] for i in ids]

    def shutdown(self) -> None:
        """Write the cached blocks to the disk tier (if any), stop the tensor-parallel workers; idempotent."""
        if self.tiers is not None:
            self.tiers.close()
        if self.cache_events is not None:
            self.cache_events.shutdown()
            self.cache_events = None
        if self.executor is not None:
            self.executor.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def metrics_summary(self) -> MetricsSummary:
        """Throughput, latencies, KV usage and cache figures of the run so far."""
        return self.metrics.summary(self.block_manager.stats(), self.scheduler.num_preemptions)

    def request_output(self, request_id: str) -> RequestOutput:
        """A snapshot of an unfinished request's samples so far (streaming front ends read it after each step); a
        beam search's: its hypotheses so far, then its live beams."""
        return self._output(self._live(request_id))

    def _live(self, request_id: str) -> SequenceGroup:
        """The unfinished request ``request_id``, else UnknownSequenceError."""
        group = self.scheduler.requests.get(request_id) if isinstance(request_id, str) else None
        if group is None:
            raise UnknownSequenceError(describe("request_id", request_id, "the id of an unfinished request"))
        return group

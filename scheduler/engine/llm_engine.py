"""LLMEngine: continuous batching of requests over a paged KV cache and a Llama-family model.

The driver loop is ``schedule -> build inputs -> run -> sample -> append``. The
scheduler and block manager live here, in the driver; the model runner gets a
:class:`~scheduler.runner.step_input.StepInput` of device tensors built on the host, and
the only device->host transfer of a step is the sampled tokens. On CUDA, decode
steps replay captured graphs (:mod:`scheduler.runner.cuda_graphs`) unless
``EngineConfig.enforce_eager``.

With ``EngineConfig.tensor_parallel_size = N > 1`` the engine is rank 0 of a tensor-parallel
group (:mod:`scheduler.distributed`): it keeps the scheduler, the block manager and the
sampler, holds its shard of the model and a pool of its KV heads, and broadcasts each step's
payload to the workers before running its forward with them. Call :meth:`shutdown` (or use
the engine as a context manager) to stop the workers.

Beyond ``add_request`` / ``step`` / ``generate``, the engine exposes the
pieces a custom decoder (beam search) drives by itself: :meth:`schedule`,
:meth:`run_model` (logits of the sequences that reached their last token),
:meth:`fork` (a child sharing every block of its parent), :meth:`append_token`
and :meth:`finish_sequence` (frees the sequence's blocks at once).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch
from tqdm.auto import tqdm

from paged_kv.block_manager import BlockManager
from paged_kv.config import BlockManagerConfig
from paged_kv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    UnknownSequenceError,
    check_bool,
    check_type,
    describe,
)
from paged_kv.kv_cache import PagedKVCache
from paged_kv.tokens import as_id_list
from scheduler.core.config import EngineConfig
from scheduler.core.outputs import RequestOutput
from scheduler.core.params import SamplingParams
from scheduler.core.scheduler import Scheduler
from scheduler.core.scheduler_output import ScheduledSeq, SchedulerOutput
from scheduler.core.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler.distributed.parallel_state import TPShard
from scheduler.engine.metrics import EngineMetrics, MetricsSummary
from scheduler.engine.request_checks import check_prompt, check_request_fits
from scheduler.model.llama import LlamaModel
from scheduler.runner.cascade_plan import min_saved_tokens
from scheduler.runner.memory import plan_kv_memory
from scheduler.runner.model_runner import ModelRunner
from scheduler.runner.sampler import sample
from scheduler.runner.step_input import StepInputBuilder
from scheduler.runner.tp_executor import TPExecutor
from scheduler.runner.tp_worker import WorkerSetup

logger = logging.getLogger(__name__)


class LLMEngine:
    """Serves generation requests with continuous batching, prefix caching and preemption."""

    def __init__(self, model: LlamaModel, config: EngineConfig | None = None, *, eos_token_id=None) -> None:
        check_type("model", model, LlamaModel, "a LlamaModel")
        check_type("config", config, (EngineConfig, type(None)), "an EngineConfig or None")
        eos_ids = _as_id_set(eos_token_id)
        self.config = config = config or EngineConfig()
        self.device = config.resolved_device()
        self.executor: TPExecutor | None = None
        tp = config.tensor_parallel_size
        if tp > 1:
            LlamaModel(model.config, TPShard(0, tp))  # a typed error before any process starts
            self.executor, model = TPExecutor.launch(model, tp, self.device, config.distributed_timeout_s)
            self.device = model.embed.weight.device
        self.model = model.to(self.device).eval()
        cc, sc = config.cache, config.scheduler
        spec = model.kv_cache_spec(cc.block_size, cc.dtype)
        graphs = self.device.type == "cuda" and not config.enforce_eager and tp == 1
        num_blocks = self._num_gpu_blocks(spec, graphs)
        self.block_manager = BlockManager(BlockManagerConfig(
            num_blocks=num_blocks, block_size=cc.block_size, num_cpu_blocks=cc.num_cpu_blocks,
            watermark=cc.watermark, enable_prefix_caching=cc.enable_prefix_caching,
        ))  # fmt: skip
        cpu_cache = PagedKVCache(spec, cc.num_cpu_blocks, "cpu") if cc.num_cpu_blocks else None
        gpu_cache = PagedKVCache(spec, num_blocks, self.device)
        self.runner = ModelRunner(self.model, gpu_cache, cpu_cache, chunk_attention=cc.enable_chunk_attention)
        width = min(-(-model.config.max_position_embeddings // cc.block_size), num_blocks)
        per_token = spec.bytes_per_block // (spec.num_layers * spec.block_size)  # K+V bytes of a token in a layer
        floor = min_saved_tokens(per_token, self.device.type, cc.cascade_min_saved_bytes)
        self.inputs = StepInputBuilder(self.block_manager, self.device, width, cascade=cc.enable_cascade_attention,
                                       min_saved_tokens=floor)  # fmt: skip
        if self.executor is not None:
            self.executor.attach_caches(self.runner.gpu_cache, cpu_cache)
            chunk = cc.enable_chunk_attention
            self.executor.setup(WorkerSetup(num_blocks, cc.num_cpu_blocks, cc.block_size, cc.dtype, width, chunk))
        if graphs:
            captured = self.runner.capture_graphs(sc.max_num_seqs, width)
            logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s, %.2f GiB",
                        len(captured.sizes), captured.sizes[-1], captured.capture_seconds, captured.pool_bytes / 2**30)
        self.scheduler = Scheduler(sc, self.block_manager)
        self.eos_token_ids = eos_ids
        self.metrics = EngineMetrics()
        self._groups: dict[str, SequenceGroup] = {}
        self._auto_ids = itertools.count()

    def _num_gpu_blocks(self, spec, graphs: bool) -> int:
        """The pool size: from gpu_memory_utilization on CUDA, else num_gpu_blocks or the byte budget; logged."""
        cc, sc = self.config.cache, self.config.scheduler
        if cc.gpu_memory_utilization is not None and self.device.type == "cuda":
            plan = plan_kv_memory(
                self.model, spec, utilization=cc.gpu_memory_utilization, max_tokens=sc.max_num_batched_tokens,
                max_seqs=sc.max_num_seqs, graphs=graphs,
            )  # fmt: skip
            logger.info(plan.describe(spec))
            return plan.num_blocks
        num_blocks = cc.num_gpu_blocks or spec.num_blocks_for_bytes(cc.kv_cache_bytes)
        logger.info("KV pool %d blocks x %d tokens = %d tokens, %.3f GiB on %s", num_blocks, spec.block_size,
                    num_blocks * spec.block_size, num_blocks * spec.bytes_per_block / 2**30, self.device)  # fmt: skip
        return num_blocks

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module, config: EngineConfig | None = None) -> LLMEngine:
        """An engine over the weights of a transformers Llama model, EOS taken from its configs."""
        from scheduler.model.weights import from_hf_model

        model = from_hf_model(hf_model)  # checks hf_model first
        gen = getattr(hf_model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = eos if eos is not None else getattr(hf_model.config, "eos_token_id", None)
        return cls(model, config, eos_token_id=eos)

    # -- requests ---------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: Seq[int], sampling_params: SamplingParams | None = None
    ) -> None:
        """Queue a request; raises (engine unchanged) on a bad id, prompt or parameters."""
        prompt, params = self.check_request(request_id, prompt_token_ids, sampling_params)
        seq = Sequence(self.scheduler.new_seq_id(), 0, prompt)
        self.add_group(SequenceGroup(request_id, [seq], params, max_seqs=params.n))

    def check_request(
        self, request_id: str, prompt_token_ids: Seq[int], sampling_params: SamplingParams | None
    ) -> tuple[list[int], SamplingParams]:
        """Validate a request without queueing it; return the prompt as a list and the parameters."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(describe("request_id", request_id, "a non-empty str"))
        if request_id in self._groups:
            raise DuplicateSequenceError(describe("request_id", request_id, "an id not already in use"))
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(describe("sampling_params", type(params).__name__, "a SamplingParams"))
        prompt = check_prompt(prompt_token_ids, self.model.config.vocab_size)
        check_request_fits(len(prompt), params, self.model.config, self.config.scheduler, self.block_manager.config)
        return prompt, params

    def add_group(self, group: SequenceGroup) -> None:
        """Queue a prepared sequence group (custom decoders build their own)."""
        if group.request_id in self._groups:
            raise DuplicateSequenceError(describe("request_id", group.request_id, "an id not already in use"))
        self._groups[group.request_id] = group
        self.scheduler.add(group)

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request now and free its blocks; returns what it had generated."""
        group = self._groups.pop(request_id, None) if isinstance(request_id, str) else None
        if group is None:
            raise UnknownSequenceError(describe("request_id", request_id, "the id of an unfinished request"))
        self.scheduler.remove(group)
        for seq in group.seqs:
            self.inputs.release(seq.seq_id)
        now = time.perf_counter()
        for seq in group.unfinished():
            self._mark_finished(seq, "abort", now)
        group.finish_time = now
        return RequestOutput.from_group(group)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or swapped out."""
        return self.scheduler.has_unfinished()

    # -- the loop ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one continuous-batching step; return the requests that finished in it."""
        start = time.perf_counter()
        out = self.schedule()
        logits = self.run_model(out)
        generated = self._sample_and_append([s for s in out.scheduled if s.samples], logits)
        finished = self.collect_finished()
        prompt_tokens = sum(max(0, min(s.start + s.num_tokens, s.seq.prompt_len) - s.start) for s in out.scheduled)
        usage = self.block_manager.gpu.num_used / self.block_manager.gpu.num_blocks
        self.metrics.record_step(start, prompt_tokens, generated, len(out.scheduled), usage)
        return finished

    def schedule(self) -> SchedulerOutput:
        """Let the scheduler pick this step's tokens (records them with the block manager)."""
        return self.scheduler.schedule()

    def run_model(self, out: SchedulerOutput) -> torch.Tensor:
        """Run a scheduled step; return logits ``[R, vocab]``, one row per sequence with ``samples`` in order."""
        if self.executor is None:
            logits = self.runner.execute(self.inputs.build(out))
        else:
            payload = self.inputs.build_payload(out)
            self.executor.broadcast(payload)
            logits = self.executor.guard(lambda: self.runner.execute(self.inputs.materializer.materialize(payload)))
        now = time.perf_counter()
        for s in out.scheduled:
            s.seq.num_computed = s.start + s.num_tokens
            if s.group.first_scheduled_time is None:
                s.group.first_scheduled_time = now
        return logits

    def _sample_and_append(self, sampled: list[ScheduledSeq], logits: torch.Tensor) -> int:
        """Sample every sequence that reached its last token (forking the ``n`` samples at the first); count them."""
        seqs, rows = [], []
        for row, s in enumerate(sampled):
            family = [s.seq]
            if s.group.params.n > 1 and len(s.group.seqs) == 1 and s.seq.num_outputs == 0:
                family += [self.fork(s.group, s.seq) for _ in range(s.group.params.n - 1)]
            seqs += [(s.group, q) for q in family]
            rows += [row] * len(family)
        if not seqs:
            return 0
        params = [g.params for g, _ in seqs]
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows).to(logits.device, non_blocking=True)]
        result = sample(logits, params, [self._generator(g, q) for g, q in seqs])
        now = time.perf_counter()
        for i, (group, seq) in enumerate(seqs):
            self.append_token(group, seq, result.token_ids[i], result.logprobs[i], result.top_logprobs[i], now)
        return len(seqs)

    def _generator(self, group: SequenceGroup, seq: Sequence) -> torch.Generator | None:
        """The sequence's own generator when the request is seeded (created at its first sample)."""
        seed = group.params.seed
        if seed is not None and seq.generator is None:
            derived = seed if seq.index == 0 else hash((seed, seq.index)) & ((1 << 63) - 1)
            seq.generator = torch.Generator(device=self.device).manual_seed(derived)
        return seq.generator

    # -- pieces for custom decoders -----------------------------------------
    def fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        """A new sequence of ``group`` sharing every KV block of ``parent``."""
        return self.scheduler.fork(group, parent)

    def append_token(
        self, group: SequenceGroup, seq: Sequence, token_id: int, logprob: float,
        top: dict[int, float] | None = None, now: float | None = None,
    ) -> None:  # fmt: skip
        """Record a chosen token and finish the sequence if it hits a stop condition."""
        now = time.perf_counter() if now is None else now
        seq.append_token(token_id, logprob, top)
        group.first_token_time = group.first_token_time or now
        params = group.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            self.finish_sequence(seq, "stop", now)
        elif seq.num_outputs >= params.max_tokens:
            self.finish_sequence(seq, "length", now)

    def finish_sequence(self, seq: Sequence, reason: str, now: float | None = None) -> None:
        """Stop a sequence and free its blocks now (its group runs on while others are unfinished)."""
        self._mark_finished(seq, reason, time.perf_counter() if now is None else now)
        self.scheduler.free_seq(seq)
        self.inputs.release(seq.seq_id)

    def collect_finished(self) -> list[RequestOutput]:
        """Retire groups whose every sequence stopped; return their outputs."""
        outputs = []
        for group in self.scheduler.drop_finished():
            group.finish_time = max(s.finish_time or 0.0 for s in group.seqs)
            self._groups.pop(group.request_id, None)
            self.metrics.record_finished(group)
            outputs.append(RequestOutput.from_group(group))
        return outputs

    def _mark_finished(self, seq: Sequence, reason: str, now: float) -> None:
        seq.status, seq.finish_reason, seq.finish_time = SequenceStatus.FINISHED, reason, now

    # -- blocking API -----------------------------------------------------
    def generate(
        self, prompts: Seq[Seq[int]], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *, use_tqdm: bool = True,
    ) -> list[RequestOutput]:  # fmt: skip
        """Run prompts (token id lists) to completion; outputs in prompt order."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Seq):
            raise InvalidArgumentError(describe("prompts", type(prompts).__name__, "a list of token id lists"))
        check_bool("use_tqdm", use_tqdm)
        params = _per_prompt(sampling_params, len(prompts))
        ids = [f"generate-{next(self._auto_ids)}" for _ in prompts]
        checked = [self.check_request(i, prompt, p) for i, prompt, p in zip(ids, prompts, params)]  # all or none
        for request_id, (prompt, p) in zip(ids, checked):
            self.add_request(request_id, prompt, p)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.has_unfinished_requests():
                for out in self.step():
                    done[out.request_id] = out
                    bar.update(1)
        return [done[i] for i in ids]

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and destroy the process groups (a no-op with one rank); idempotent."""
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
        """A snapshot of an unfinished request's samples so far (streaming front ends read it after each step)."""
        group = self._groups.get(request_id) if isinstance(request_id, str) else None
        if group is None:
            raise UnknownSequenceError(describe("request_id", request_id, "the id of an unfinished request"))
        return RequestOutput.from_group(group)


def _per_prompt(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise InvalidArgumentError(describe("len(sampling_params)", len(params), f"{n} (one per prompt)"))
    return params


def _as_id_set(ids: int | Iterable[int] | None) -> frozenset[int]:
    """EOS ids as a set: None, one id or several (checked like token ids: no bools, no floats)."""
    if ids is None:
        return frozenset()
    if isinstance(ids, int) and not isinstance(ids, bool):
        ids = [ids]
    elif isinstance(ids, (set, frozenset)):
        ids = list(ids)
    return frozenset(as_id_list("eos_token_id", ids, "token ids", "a token id or a list of them"))

"""The model runner: a scheduled step in, the logits of its sampled rows out.

On the driver, :meth:`ModelRunner.run` turns the scheduler's decisions into a
:class:`~scheduler.runner.step_input.StepInput` of device tensors and (src, dst) block lists
(:mod:`scheduler.runner.step_input`; with tensor parallelism it first broadcasts the step's host
payload to the workers, which rebuild the same input). :meth:`ModelRunner.execute`, on every
rank, applies the block moves owed before the step's writes, in the order swap-out, swap-in,
copy-on-write, then runs the model once over the whole mixed prefill + decode batch
(replayed from a CUDA graph when it can) and returns the sampled rows' logits; the rows embedding requests pool
go through the final norm only and wait in :attr:`ModelRunner.pooled` for the engine
(:meth:`ModelRunner.take_pooled`; on rank 0 only: a tensor-parallel worker skips that norm, which runs no
collective). With LoRA (:mod:`scheduler.runner.lora_manager`) the driver first places the step's adapters
in their device slots; a step with an adapter runs eagerly (no CUDA graph holds the LoRA updates).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol, TypeVar

import torch

from paged_kv.block_manager import CopyOp
from paged_kv.kv_cache import PagedKVCache
from scheduler.core.scheduler_output import SchedulerOutput
from scheduler.model.llama import LlamaModel
from scheduler.runner.cuda_graphs import DecodeGraphs
from scheduler.runner.lora_manager import LoRAManager
from scheduler.runner.step_input import StepInput, StepInputBuilder
from scheduler.runner.tier_transfers import TierTransfers

T = TypeVar("T")


class StepGroup(Protocol):
    """The other ranks of a tensor-parallel group, as the driver's runner sees them (a TPExecutor)."""

    def broadcast(self, message: object) -> None:
        """Send every worker ``message``."""

    def guard(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (collectives with the workers), turning a worker's failure into a WorkerError."""


def order_free_batches(pairs: list[CopyOp]) -> list[list[CopyOp]]:
    """Split copies into batches that can each run in any order and, run in turn, equal the list run in order."""
    batches: list[list[CopyOp]] = []
    srcs: set[int] = set()
    dsts: set[int] = set()
    for src, dst in pairs:
        if not batches or src in dsts or dst in srcs or dst in dsts:
            batches.append([])
            srcs, dsts = set(), set()
        batches[-1].append((src, dst))
        srcs.add(src)
        dsts.add(dst)
    return batches


class ModelRunner:
    """Owns the model and its GPU (and CPU swap) KV pools; runs prepared steps."""

    def __init__(
        self, model: LlamaModel, gpu_cache: PagedKVCache, cpu_cache: PagedKVCache | None = None, *,
        dense_prefill: bool = True, inputs: StepInputBuilder | None = None, group: StepGroup | None = None,
        pools: bool = True,
    ) -> None:  # fmt: skip
        model.enable_dense_prefill(dense_prefill)  # probes once, before any step (the hot path reads nothing)
        self.model = model
        self.gpu_cache = gpu_cache
        self.cpu_cache = cpu_cache
        self.inputs = inputs  # the driver's step builder (None on a worker: it receives payloads)
        self.group = group  # the other tensor-parallel ranks (None: one rank)
        self.graphs: DecodeGraphs | None = None
        self.tiers: TierTransfers | None = None  # the host tier's copies (one rank only)
        self.loras: LoRAManager | None = None  # the adapters served (one rank only); None: LoRA off
        self.pooled: torch.Tensor | None = None  # [P, hidden] float32: the last step's pooled rows (take_pooled)
        # False on a tensor-parallel worker: rank 0 alone reads the pooled rows, and their final norm runs no
        # collective (the hidden states are whole on every rank), so skipping it leaves the ranks' ops in step
        self.pools = pools

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """The driver's step: build ``out``'s inputs (sent to the workers first), execute; logits ``[R, vocab]``."""
        if self.tiers is not None:
            self.tiers.before_forward(out.tier_ops)
        if self.group is None:
            logits = self.execute(self.inputs.build(out, self.loras.step_slots(out) if self.loras else None))
            if self.tiers is not None:
                self.tiers.after_forward(out.tier_ops)
            return logits
        payload = self.inputs.build_payload(out, self.loras.step_slots(out) if self.loras else None)
        if self.loras is not None:  # the workers load the adapters placed this step into the same slots
            payload = replace(payload, lora_loads=self.loras.take_loads())
        self.group.broadcast(payload)
        return self.group.guard(lambda: self.execute(self.inputs.materializer.materialize(payload)))

    def capture_graphs(self, max_num_seqs: int, width: int) -> DecodeGraphs:
        """Capture decode graphs for batches up to ``max_num_seqs`` and block tables up to ``width`` (CUDA only)."""
        self.graphs = DecodeGraphs(self.model, self.gpu_cache, max_num_seqs, width)
        self.graphs.capture()
        return self.graphs

    def execute(self, step: StepInput) -> torch.Tensor:
        """Apply the step's block moves, run the model, return logits ``[R, vocab]`` float32."""
        self.move_blocks(step.swap_out, step.swap_in, step.copies)
        if step.num_tokens == 0:
            return torch.empty(0, self.model.config.vocab_size, device=self.gpu_cache.device)
        if step.lora is not None:
            return self._run_lora(step)
        if self.graphs is not None and self.graphs.can_run(step):
            return self.graphs.run(step)
        return self._forward(step)

    def _forward(self, step: StepInput) -> torch.Tensor:
        """The eager forward: logits of the step's logits rows; its pooled rows' final-norm hidden states kept in
        :attr:`pooled` (they go through no LM head) unless this runner does not pool (a tensor-parallel worker)."""
        if step.pool_indices is None:
            return self.model(step.input_ids, step.positions, self.gpu_cache, step.meta, step.logits_indices)
        x = self.model.hidden_states(step.input_ids, step.positions, self.gpu_cache, step.meta)  # [T, hidden]
        if self.pools:
            self.pooled = self.model.pool(x[step.pool_indices])  # [P, hidden]
        return self.model.compute_logits(x[step.logits_indices])

    def take_pooled(self) -> torch.Tensor | None:
        """The pooled rows of the last step (``[P, hidden]`` float32 on the device, in ``out.pooled`` order), once."""
        pooled, self.pooled = self.pooled, None
        return pooled

    def _run_lora(self, step: StepInput) -> torch.Tensor:
        """The forward of a step with adapters, eagerly, its token groups set for the projections meanwhile."""
        slots = self.model.lora_slots  # attached by attach_lora (the driver's LoRAManager, or a worker's setup)
        slots.batch = step.lora
        try:
            return self._forward(step)
        finally:
            slots.batch = None

    def move_blocks(self, swap_out: list[CopyOp], swap_in: list[CopyOp], copies: list[CopyOp]) -> None:
        """Run swaps and copy-on-write copies, in that order (each reads blocks before they are reused)."""
        if swap_out:
            self.cpu_cache.swap_from(self.gpu_cache, swap_out)
        if swap_in:
            self.gpu_cache.swap_from(self.cpu_cache, swap_in)
        for batch in order_free_batches(copies):
            self.gpu_cache.copy_blocks(batch)

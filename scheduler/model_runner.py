"""The model runner: a scheduled step packed into plain tensors, block moves, one forward.

:func:`pack_step` runs in the driver (it reads the block manager's tables) and
yields a :class:`StepInput` of plain tensors and copy lists, the only thing a
worker needs: a tensor-parallel runner would receive exactly this.
:class:`ModelRunner` applies the block moves owed before the step's writes,
in the order swap-out, swap-in, copy-on-write, then runs the model once over
the whole mixed prefill + decode batch and returns the last-token logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_kv.batch import BatchMetadata, build_batch_metadata
from paged_kv.block_manager import BlockManager, CopyOp
from paged_kv.kv_cache import PagedKVCache
from scheduler.model import LlamaModel
from scheduler.scheduler_output import SchedulerOutput


@dataclass(frozen=True, kw_only=True)
class StepInput:
    """Everything a worker needs for one step, as tensors and (src, dst) block lists."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: BatchMetadata  # block tables, seq lens, cu_seqlens_q, slot mapping
    logits_indices: torch.Tensor  # [R] int64 rows of the packed batch whose logits are sampled
    swap_out: list[CopyOp]
    swap_in: list[CopyOp]
    copies: list[CopyOp]

    @property
    def num_tokens(self) -> int:
        """Packed new tokens."""
        return self.input_ids.shape[0]


def pack_step(out: SchedulerOutput, bm: BlockManager, device: torch.device) -> StepInput:
    """Pack a scheduler step: token ids, positions, block tables, slot mapping, sampled rows."""
    items = out.scheduled
    ids = [t for s in items for t in s.seq.token_ids[s.start : s.start + s.num_tokens]]
    start_list, count_list = [s.start for s in items], [s.num_tokens for s in items]
    tables = [bm.block_table(s.seq.seq_id) for s in items]
    meta = build_batch_metadata(tables, start_list, count_list, bm.block_size, device)
    starts, counts = torch.tensor(start_list, dtype=torch.int64), torch.tensor(count_list, dtype=torch.int64)
    ends = torch.cumsum(counts, 0)  # [S]
    positions = torch.arange(len(ids), dtype=torch.int64) + torch.repeat_interleave(starts - ends + counts, counts)
    sampled = torch.tensor([s.samples for s in items], dtype=torch.bool)
    return StepInput(
        input_ids=torch.tensor(ids, dtype=torch.int64).to(device), positions=positions.to(device), meta=meta,
        logits_indices=(ends[sampled] - 1).to(device), swap_out=out.swap_out, swap_in=out.swap_in, copies=out.copies,
    )  # fmt: skip


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
    """Owns the model and its GPU (and CPU swap) KV pools; runs packed steps."""

    def __init__(self, model: LlamaModel, gpu_cache: PagedKVCache, cpu_cache: PagedKVCache | None = None) -> None:
        self.model = model
        self.gpu_cache = gpu_cache
        self.cpu_cache = cpu_cache

    def execute(self, step: StepInput) -> torch.Tensor:
        """Apply the step's block moves, run the model, return logits ``[R, vocab]`` float32."""
        self.move_blocks(step.swap_out, step.swap_in, step.copies)
        if step.num_tokens == 0:
            return torch.empty(0, self.model.config.vocab_size, device=self.gpu_cache.device)
        return self.model(step.input_ids, step.positions, self.gpu_cache, step.meta, step.logits_indices)

    def move_blocks(self, swap_out: list[CopyOp], swap_in: list[CopyOp], copies: list[CopyOp]) -> None:
        """Run swaps and copy-on-write copies, in that order (each reads blocks before they are reused)."""
        if swap_out:
            self.cpu_cache.swap_from(self.gpu_cache, swap_out)
        if swap_in:
            self.gpu_cache.swap_from(self.cpu_cache, swap_in)
        for batch in order_free_batches(copies):
            self.gpu_cache.copy_blocks(batch)

"""CUDA graphs of the model's decode forward for a ladder of batch sizes.

A decode step of a small model is hundreds of kernel launches of a few microseconds
each; replaying a captured graph launches them all at once. Graphs are captured for
batch sizes 1, 2, 4, 8 and multiples of 8 up to ``max_num_seqs``, largest first, into
one shared memory pool, over static input buffers; a step pads its batch up to the next
captured size. Padded rows have ``seq_len`` 0 (the decode kernel reads nothing for them)
and slot -1 (their K/V are not written); their rows are dropped. The graphs end at the
last decoder layer's hidden states: the LM head runs eagerly on the real rows only, so
no graph holds a ``[batch, vocab]`` logits buffer.

The captured forward reads no device value: its attention metadata holds host sizes
fixed at capture: ``decode_num_splits`` is chosen for the widest table the graphs accept,
and each split covers its share of the real length at run time.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kernels.metadata import AttentionMetadata
from kernels.splits import choose_num_splits
from paged_kv.kv_cache import PagedKVCache
from scheduler.model.llama import LlamaModel
from scheduler.runner.step_input import StepInput


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 8, up to the first that holds ``max_num_seqs``."""
    ladder = [1, 2, 4, *range(8, max_num_seqs + 8, 8)]
    return [s for i, s in enumerate(ladder) if i == 0 or ladder[i - 1] < max_num_seqs]


class DecodeGraphs:
    """Captured decode forwards over static buffers; :meth:`run` replays the smallest that fits a step."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache, max_num_seqs: int, width: int) -> None:
        self.model, self.cache, self.width = model, cache, width
        self.sizes = capture_sizes(max_num_seqs)
        n, device = self.sizes[-1], cache.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)  # [N]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [N]
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)  # [N, width]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # batch size -> hidden states [b, hidden]
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    def capture(self) -> None:
        """Capture every size (largest first, so smaller graphs reuse its memory); record time and memory."""
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.cache.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = self._meta(size)
            for _ in range(2):  # warm up: compile the kernels, settle the allocator
                self._forward(size, meta)
            torch.cuda.synchronize(self.cache.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size, meta)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.cache.device)
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved(self.cache.device) - before

    def can_run(self, step: StepInput) -> bool:
        """Whether a step is a plain decode step (no cascade plan, no prompt rows, no pooled rows: those run
        eagerly) within the captured sizes."""
        meta = step.meta
        return bool(self.graphs) and meta.is_decode and meta.cascade is None and 0 < meta.num_seqs <= self.sizes[-1] \
            and step.num_sampled == meta.num_seqs and not step.num_prompt_rows and step.pool_indices is None \
            and meta.block_tables.shape[1] <= self.width

    def run(self, step: StepInput) -> torch.Tensor:
        """Copy the step into the static buffers, replay the next captured size; return logits ``[S, vocab]``.

        Table columns past the step's own width keep stale ids: the kernel reads only the blocks
        covering ``[0, seq_len)``.
        """
        num = step.meta.num_seqs
        size = next(s for s in self.sizes if s >= num)
        self.input_ids[:num].copy_(step.input_ids)
        self.positions[:num].copy_(step.positions)
        self.slots[:num].copy_(step.meta.slot_mapping)
        self.seq_lens[:num].copy_(step.meta.seq_lens)
        self.block_tables[:num, : step.meta.block_tables.shape[1]].copy_(step.meta.block_tables)
        if size > num:
            self.slots[num:size].fill_(-1)
            self.seq_lens[num:size].zero_()
        self.graphs[size].replay()
        return self.model.compute_logits(self.outputs[size][:num])

    def _meta(self, size: int) -> AttentionMetadata:
        """Decode metadata over the first ``size`` static rows; host sizes are the widest the graph accepts."""
        bs = self.cache.block_size
        return AttentionMetadata(
            block_tables=self.block_tables[:size], seq_lens=self.seq_lens[:size],
            cu_seqlens_q=torch.arange(size + 1, dtype=torch.int32, device=self.cache.device),
            slot_mapping=self.slots[:size], host_seq_lens=np.full(size, self.width * bs, dtype=np.int64),
            host_query_lens=np.ones(size, dtype=np.int64), block_size=bs, num_blocks=self.cache.num_blocks,
            max_seq_len=self.width * bs, max_query_len=1,
            decode_num_splits=choose_num_splits(size, self.cache.spec.num_kv_heads, self.width * bs, self.cache.device),
        )  # fmt: skip

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.hidden_states(self.input_ids[:size], self.positions[:size], self.cache, meta)

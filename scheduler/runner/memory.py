"""Sizing the GPU KV pool from a share of the device's memory (vLLM's ``gpu_memory_utilization``).

The engine may use ``utilization x total`` bytes of the device. What is already taken when
the engine starts (the weights, the CUDA context, other processes) counts against it, and
so do the activations: a profiling forward at the step's largest token budget measures
their peak, and one at the largest decode batch estimates the CUDA graphs' private pool.
The KV pool gets the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.metadata import prepare_attention_metadata
from paged_kv.errors import OutOfBlocksError, describe
from paged_kv.kv_cache import KVCacheSpec, PagedKVCache
from scheduler.model.llama import LlamaModel

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Where a device's memory budget goes, in bytes, and the KV blocks that fit."""

    budget: int  # utilization x total
    in_use: int  # taken before the engine profiled (weights, context, other processes)
    activations: int  # peak of the profiling forward
    graphs: int  # estimated CUDA-graph pool (0 when eager)
    num_blocks: int

    def describe(self, spec: KVCacheSpec) -> str:
        """One line: the pool and where the rest of the budget went."""
        pool = self.num_blocks * spec.bytes_per_block
        return (f"KV pool {self.num_blocks} blocks x {spec.block_size} tokens = "
                f"{self.num_blocks * spec.block_size} tokens, {pool / GIB:.2f} GiB (budget {self.budget / GIB:.2f} "
                f"GiB: in use {self.in_use / GIB:.2f}, activations {self.activations / GIB:.2f}, "
                f"graphs {self.graphs / GIB:.2f})")  # fmt: skip


def plan_kv_memory(
    model: LlamaModel, spec: KVCacheSpec, *, utilization: float, max_tokens: int, max_seqs: int, graphs: bool
) -> MemoryPlan:
    """Profile the model on its CUDA device and size the KV pool within ``utilization`` of the memory."""
    device = model.embed.weight.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    activations = _peak_forward_bytes(model, spec, max_tokens, min(max_seqs, max_tokens))
    graph_bytes = _peak_forward_bytes(model, spec, max_seqs, max_seqs) if graphs else 0
    budget = int(utilization * total)
    in_use = total - free
    num_blocks = (budget - in_use - activations - graph_bytes) // spec.bytes_per_block
    if num_blocks < 1:
        raise OutOfBlocksError(describe(
            "gpu_memory_utilization", utilization,
            f"a share leaving room for KV blocks: {in_use / GIB:.2f} GiB in use and {activations / GIB:.2f} GiB of "
            f"activations of {budget / GIB:.2f} GiB",
        ))  # fmt: skip
    return MemoryPlan(budget=budget, in_use=in_use, activations=activations, graphs=graph_bytes, num_blocks=num_blocks)


def _peak_forward_bytes(model: LlamaModel, spec: KVCacheSpec, num_tokens: int, num_seqs: int) -> int:
    """Peak bytes a forward of ``num_tokens`` new tokens over ``num_seqs`` sequences allocates (beyond its cache)."""
    device = model.embed.weight.device
    lens = [num_tokens // num_seqs + (s < num_tokens % num_seqs) for s in range(num_seqs)]
    per_seq = [-(-n // spec.block_size) for n in lens]
    cache = PagedKVCache(spec, sum(per_seq), device)
    firsts = [sum(per_seq[:s]) for s in range(num_seqs)]
    tables = [list(range(f, f + n)) for f, n in zip(firsts, per_seq)]
    meta = prepare_attention_metadata(
        tables, [0] * num_seqs, lens, block_size=spec.block_size, num_blocks=cache.num_blocks, device=device
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    last = torch.cumsum(torch.tensor(lens, device=device), 0) - 1
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    logits = model(ids, positions, cache, meta, last)
    torch.log_softmax(logits, dim=-1)  # the sampler's largest temporary
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del cache, logits
    torch.cuda.empty_cache()
    return peak

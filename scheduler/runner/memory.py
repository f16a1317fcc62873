"""Sizing the GPU KV pool from a share of the device's memory (vLLM's ``gpu_memory_utilization``).

The share is a per-engine limit, as in vLLM: the engine may hold ``utilization x total`` bytes
of the device, and only its own memory counts against it. That is what its torch allocator
holds when it starts (the weights), the activations (a profiling forward at the step's largest
token budget measures their peak) and the CUDA graphs' private pool (one at the largest decode
batch estimates it). The KV pool gets the rest. Two engines at 0.45 each share one GPU. Memory
that other processes hold does not shrink the pool, but the pool must fit in the memory free
now; where it does not, sizing fails with a typed error rather than running out mid-serve. The
CUDA context and library workspaces are outside the share, as in vLLM.
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
    in_use: int  # this process's torch memory before profiling (the weights)
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
    activations = _peak_forward_bytes(model, spec, max_tokens, min(max_seqs, max_tokens))
    graph_bytes = _peak_forward_bytes(model, spec, max_seqs, max_seqs) if graphs else 0
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_reserved(device)
    return size_pool(
        utilization=utilization, total=total, free=free, in_use=own, activations=activations, graphs=graph_bytes,
        bytes_per_block=spec.bytes_per_block,
    )  # fmt: skip


def size_pool(
    *, utilization: float, total: int, free: int, in_use: int, activations: int, graphs: int, bytes_per_block: int
) -> MemoryPlan:
    """The KV blocks that fit in ``utilization x total`` less this engine's own use, and in the ``free`` bytes.

    ``in_use`` is this engine's memory already taken (it is not in ``free``); the activations and the
    graph pool are yet to be taken from ``free``. Raises :class:`OutOfBlocksError` when not one
    block fits in the share, or when the share's pool does not fit in the free memory.
    """
    budget = int(utilization * total)
    transient = activations + graphs
    num_blocks = (budget - in_use - transient) // bytes_per_block
    if num_blocks < 1:
        raise OutOfBlocksError(describe(
            "gpu_memory_utilization", utilization,
            f"a share leaving room for KV blocks: this engine holds {in_use / GIB:.2f} GiB and needs "
            f"{transient / GIB:.2f} GiB of activations and graphs of its {budget / GIB:.2f} GiB",
        ))  # fmt: skip
    if num_blocks * bytes_per_block + transient > free:
        raise OutOfBlocksError(describe(
            "gpu_memory_utilization", utilization,
            f"a share whose KV pool fits in the free memory: {num_blocks * bytes_per_block / GIB:.2f} GiB of KV "
            f"blocks and {transient / GIB:.2f} GiB of activations and graphs, {free / GIB:.2f} GiB free of "
            f"{total / GIB:.2f} GiB (other processes hold the rest); lower it",
        ))  # fmt: skip
    return MemoryPlan(budget=budget, in_use=in_use, activations=activations, graphs=graphs, num_blocks=num_blocks)


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

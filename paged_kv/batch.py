"""Per-batch metadata tensors the kernels read: block tables, sequence lengths, slot mappings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_kv.errors import InvalidArgumentError, describe


@dataclass(frozen=True, kw_only=True)
class BatchMetadata:
    """Kernel inputs for one step: one row per sequence, one slot per new token."""

    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0 (never read past seq_lens)
    seq_lens: torch.Tensor  # [S] int32, tokens in the cache after this step's writes
    cu_seqlens_q: torch.Tensor  # [S + 1] int32, offsets of each sequence's new tokens
    slot_mapping: torch.Tensor  # [T] int64, slot of every new token
    max_seq_len: int
    max_query_len: int


def build_batch_metadata(
    tables: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_size: int,
    device: str | torch.device = "cpu",
) -> BatchMetadata:
    """Build the tensors for sequences that hold ``num_computed`` tokens and add ``num_new``."""
    if not (len(tables) == len(num_computed) == len(num_new)):
        raise InvalidArgumentError(
            describe("len(tables), len(num_computed), len(num_new)",
                     (len(tables), len(num_computed), len(num_new)), "equal lengths")
        )
    computed = torch.tensor(list(num_computed), dtype=torch.int64)
    new = torch.tensor(list(num_new), dtype=torch.int64)
    seq_lens = computed + new
    table = block_table_tensor(tables)
    max_len = int(seq_lens.max()) if len(tables) else 0
    if table.shape[1] * block_size < max_len:
        raise InvalidArgumentError(describe("tables", "too short", "a block for every token"))
    slots = slot_mapping(table, computed, new, block_size)
    cu = torch.zeros(len(tables) + 1, dtype=torch.int32)
    torch.cumsum(new, 0, out=cu[1:])
    return BatchMetadata(
        block_tables=table.to(device), seq_lens=seq_lens.to(torch.int32).to(device),
        cu_seqlens_q=cu.to(device), slot_mapping=slots.to(device),
        max_seq_len=max_len, max_query_len=int(new.max()) if len(tables) else 0,
    )


def block_table_tensor(tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """Pad block tables into one ``[S, max_blocks]`` int32 tensor (padding 0)."""
    width = max((len(t) for t in tables), default=0)
    out = torch.zeros(len(tables), max(width, 1), dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.int32)
    return out


def slot_mapping(table: torch.Tensor, start: torch.Tensor, count: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of positions ``[start[s], start[s] + count[s])`` of every sequence, concatenated."""
    # seq_idx, pos: [T]
    seq_idx = torch.repeat_interleave(torch.arange(len(count)), count)
    offsets = torch.arange(int(count.sum())) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    pos = start[seq_idx] + offsets
    blocks = table.to(torch.int64)[seq_idx, pos // block_size]
    return blocks * block_size + pos % block_size

"""Per-batch metadata tensors the kernels read: block tables, sequence lengths, slot mappings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels._checks import INDEX_DTYPES, check_device, check_tensor
from paged_kv.config import MAX_BLOCK_SIZE
from paged_kv.errors import InvalidArgumentError, check_int, describe
from paged_kv.tokens import as_id_list


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
    table = block_table_tensor(tables)
    num_computed = as_id_list("num_computed", num_computed, "token counts")
    num_new = as_id_list("num_new", num_new, "token counts")
    check_int("block_size", block_size, low=1, high=MAX_BLOCK_SIZE)
    device = check_device("device", device)
    if not (len(tables) == len(num_computed) == len(num_new)):
        raise InvalidArgumentError(
            describe("len(tables), len(num_computed), len(num_new)",
                     (len(tables), len(num_computed), len(num_new)), "equal lengths")
        )
    computed = torch.tensor(num_computed, dtype=torch.int64)
    new = torch.tensor(num_new, dtype=torch.int64)
    seq_lens = computed + new
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
    if isinstance(tables, (str, bytes, torch.Tensor)) or not isinstance(tables, Sequence):
        raise InvalidArgumentError(describe("tables", type(tables).__name__, "a sequence of block tables"))
    rows = [as_id_list(f"tables[{i}]", t, "block ids") for i, t in enumerate(tables)]
    width = max((len(t) for t in rows), default=0)
    out = torch.zeros(len(rows), max(width, 1), dtype=torch.int32)
    for i, t in enumerate(rows):
        out[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return out


def slot_mapping(table: torch.Tensor, start: torch.Tensor, count: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of positions ``[start[s], start[s] + count[s])`` of every sequence, concatenated."""
    check_tensor("table", table, ndim=2, dtypes=INDEX_DTYPES)
    for name, t in (("start", start), ("count", count)):
        check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES)
        if t.shape[0] != table.shape[0] or (t.numel() and int(t.min()) < 0):
            raise InvalidArgumentError(describe(name, t.tolist(), f"{table.shape[0]} non-negative counts"))
    check_int("block_size", block_size, low=1, high=MAX_BLOCK_SIZE)
    ends = start.long() + count.long()  # [S]
    if ends.numel() and int(ends.max()) > table.shape[1] * block_size:
        raise InvalidArgumentError(describe("table", "too short", "a block for every position"))
    # seq_idx, pos: [T]
    seq_idx = torch.repeat_interleave(torch.arange(len(count)), count)
    offsets = torch.arange(int(count.sum())) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    pos = start[seq_idx] + offsets
    blocks = table.to(torch.int64)[seq_idx, pos // block_size]
    return blocks * block_size + pos % block_size

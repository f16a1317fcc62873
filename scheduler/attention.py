"""How one step's KV writes and attention are dispatched to the prepared (sync-free) kernels.

A decode step with a cascade plan (shared-prefix groups, see :mod:`scheduler.cascade_plan`)
goes to cascade decode. Otherwise, on the GPU a decode step goes to the decode kernel and any other step to the prefill
kernel in one call (its Triton grid skips the short sequences' empty tiles). The kernels'
CPU torch path pads every sequence's queries to the longest one, so on the CPU a mixed
step is split: the decode rows (one query each) take the decode kernel and only the
sequences with several new tokens take the prefill kernel. The split is computed once
per step, on the host from the metadata's host lengths, and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata, offsets
from kernels.cascade_attention import cascade_decode_attention_prepared
from kernels.decode_attention import paged_decode_attention_prepared
from kernels.prefill_attention import paged_prefill_attention_prepared
from kernels.cache_write import write_kv_prepared
from paged_kv.kv_cache import LayerKV


@dataclass(frozen=True)
class _Part:
    """A subset of the step's sequences and the packed query rows they own."""

    rows: torch.Tensor | None  # [T_part] int64 rows of the packed batch; None: every row
    meta: AttentionMetadata


class AttentionPlan:
    """The step's sequences as one part, or split into a decode part and a prefill part (CPU)."""

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.parts = [_Part(None, meta)]
        q_lens = meta.host_query_lens
        if meta.device.type == "cuda" or meta.max_query_len <= 1 or not (q_lens == 1).any():
            return
        self.parts = [_subset(meta, q_lens == 1), _subset(meta, q_lens != 1)]

    def write(self, kv: LayerKV, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter the step's new K/V ``[T, Hkv, D]`` into one layer's pages."""
        write_kv_prepared(k, v, kv.k, kv.v, self.meta, k_scale=kv.k_scale, v_scale=kv.v_scale)

    def attend(self, q: torch.Tensor, kv: LayerKV, scale: float) -> torch.Tensor:
        """Attention of the step's queries q ``[T, Hq, D]`` over one layer's paged K/V -> ``[T, Hq, D]``."""
        if len(self.parts) == 1:
            return _run(q, kv, self.meta, scale)
        out = torch.empty_like(q)
        for part in self.parts:
            out[part.rows] = _run(q[part.rows], kv, part.meta, scale)
        return out


def _subset(meta: AttentionMetadata, keep: np.ndarray) -> _Part:
    """The sequences where ``keep`` holds, with their query rows (index tensors built on the host)."""
    q_lens, seq_lens = meta.host_query_lens[keep], meta.host_seq_lens[keep]
    starts = offsets(meta.host_query_lens)[:-1][keep]  # first packed row of each kept sequence
    cu = offsets(q_lens)
    rows = np.repeat(starts - cu[:-1], q_lens) + np.arange(cu[-1])  # [T_part]
    seqs = torch.from_numpy(np.flatnonzero(keep)).to(meta.device)
    row_index = torch.from_numpy(rows).to(meta.device)
    sub = replace(
        meta, block_tables=meta.block_tables.index_select(0, seqs), seq_lens=meta.seq_lens.index_select(0, seqs),
        cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)).to(meta.device), slot_mapping=meta.slot_mapping.index_select(0, row_index),
        host_seq_lens=seq_lens, host_query_lens=q_lens, max_seq_len=int(seq_lens.max()),
        max_query_len=int(q_lens.max()), cascade=None,
    )  # fmt: skip
    return _Part(row_index, sub)


def _run(q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale, "scale": scale}
    if meta.cascade is not None:
        return cascade_decode_attention_prepared(q, kv.k, kv.v, meta.cascade, **scales)
    if meta.is_decode:
        return paged_decode_attention_prepared(q, kv.k, kv.v, meta, **scales)
    return paged_prefill_attention_prepared(q, kv.k, kv.v, meta, **scales)

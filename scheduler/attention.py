"""How one step's attention is dispatched to the paged kernels.

On the GPU a mixed prefill + decode batch goes to the prefill kernel in one
call (its Triton grid skips the short sequences' empty tiles). The kernels'
CPU torch path pads every sequence's queries to the longest one, so on the CPU
the decode rows (one query each) take the decode kernel and only the
sequences with several new tokens take the prefill kernel. The split is
computed once per step and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from paged_kv.batch import BatchMetadata
from paged_kv.kv_cache import LayerKV


@dataclass(frozen=True)
class _Part:
    """A subset of the batch's sequences and the packed query rows they own."""

    rows: torch.Tensor  # [T_part] int64 rows of the packed batch
    block_tables: torch.Tensor  # [S_part, max_blocks] int32
    seq_lens: torch.Tensor  # [S_part] int32
    cu_seqlens_q: torch.Tensor | None  # [S_part + 1] int32, None for a decode part


class AttentionPlan:
    """The step's sequences split into a decode part and a prefill part (or one whole part)."""

    def __init__(self, meta: BatchMetadata, num_tokens: int) -> None:
        self.meta = meta
        self.parts: list[_Part] | None = None  # None: one call over the whole batch
        if meta.block_tables.is_cuda or meta.max_query_len <= 1:
            return
        q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]  # [S]
        decode = q_lens == 1
        if not bool(decode.any()):
            return
        rows = torch.arange(num_tokens, device=q_lens.device)
        seq_of_row = torch.repeat_interleave(torch.arange(len(q_lens), device=q_lens.device), q_lens.long())
        self.parts = [
            self._part(meta, decode, rows, seq_of_row, None),
            self._part(meta, ~decode, rows, seq_of_row, q_lens),
        ]

    @staticmethod
    def _part(meta: BatchMetadata, seqs: torch.Tensor, rows, seq_of_row, q_lens) -> _Part:
        cu = None
        if q_lens is not None:
            cu = torch.zeros(int(seqs.sum()) + 1, dtype=torch.int32, device=seqs.device)
            torch.cumsum(q_lens[seqs], 0, out=cu[1:])
        return _Part(rows[seqs[seq_of_row]], meta.block_tables[seqs], meta.seq_lens[seqs], cu)

    def attend(self, q: torch.Tensor, kv: LayerKV, scale: float) -> torch.Tensor:
        """Attention of the step's queries q ``[T, Hq, D]`` over one layer's paged K/V -> ``[T, Hq, D]``."""
        meta = self.meta
        if self.parts is None:
            cu = None if meta.max_query_len == 1 else meta.cu_seqlens_q
            whole = _Part(None, meta.block_tables, meta.seq_lens, cu)
            return _run(q, kv, whole, scale)
        out = torch.empty_like(q)
        for part in self.parts:
            out[part.rows] = _run(q[part.rows], kv, part, scale)
        return out


def _run(q: torch.Tensor, kv: LayerKV, part: _Part, scale: float) -> torch.Tensor:
    args = (kv.k, kv.v, part.block_tables, part.seq_lens)
    scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale}
    if part.cu_seqlens_q is None:
        return paged_decode_attention(q, *args, scale=scale, **scales)
    return paged_prefill_attention(q, *args, part.cu_seqlens_q, scale=scale, **scales)

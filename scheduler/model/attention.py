"""How one step's KV writes and attention are dispatched to the prepared (sync-free) kernels.

A decode step with a cascade plan (shared-prefix groups, see :mod:`scheduler.runner.cascade_plan`)
goes to cascade decode. Otherwise each sequence gets a route, from host lengths only:

- ``chunk``: a sequence with no cached prefix (a fresh prompt or its first chunk), when the
  device has a fast dense kernel (``chunk_backend``, probed at start-up): its queries attend
  the step's own contiguous K/V (:mod:`kernels.chunk_attention`, FlashAttention varlen on
  CUDA), no block table read. Its K/V are still written to the pages for later steps.
- ``paged``: the rest. On the GPU one call: the decode kernel when every one decodes, else
  the paged prefill kernel (its Triton grid skips the short sequences' empty tiles). The
  kernels' CPU torch path pads every sequence's queries to the longest one, so on the CPU
  the decode rows (one query each, route ``decode``) take the decode kernel apart.

A step whose sequences share one route runs as one part; otherwise each route is a part with
the packed rows it owns. The routes are computed once per step and reused by every layer, and
so are the kernels' host checks: each paged call is bound on the step's first layer
(``kernels.*.bind_*``) and the other layers run it with an O(1) shape comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kernels.cache_write import bind_write_kv
from kernels.cascade_attention import bind_cascade_decode_attention
from kernels.checks import BoundCall
from kernels.chunk_attention import dense_chunk_attention_prepared
from kernels.decode_attention import bind_decode_attention
from kernels.metadata import AttentionMetadata, ChunkMetadata, offsets
from kernels.prefill_attention import bind_prefill_attention
from paged_kv.kv_cache import LayerKV

CHUNK, DECODE, PAGED = 0, 1, 2  # routes


@dataclass(frozen=True)
class _Part:
    """A subset of the step's sequences and the packed query rows they own."""

    rows: torch.Tensor | None  # [T_part] int64 rows of the packed batch; None: every row
    meta: AttentionMetadata
    chunk: ChunkMetadata | None = None  # set: the part attends its own K/V through the chunk backend


class AttentionPlan:
    """The step's sequences as one part, or split by route (see the module docstring)."""

    def __init__(self, meta: AttentionMetadata, chunk_backend: str | None = None) -> None:
        self.meta, self.chunk_backend = meta, chunk_backend
        self._bound: dict[tuple, BoundCall] = {}  # (part, scale) -> its call, checked on the first layer
        routes = step_routes(meta, chunk_backend is not None)
        kinds = np.unique(routes)
        if len(kinds) <= 1:
            self.parts = [_part(None, meta, int(kinds[0]) if len(kinds) else PAGED)]
        else:
            self.parts = [_subset(meta, routes == kind, int(kind)) for kind in kinds]

    def write(self, kv: LayerKV, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter the step's new K/V ``[T, Hkv, D]`` into one layer's pages."""
        if ("write",) not in self._bound:
            self._bound[("write",)] = bind_write_kv(k, v, kv.k, kv.v, self.meta, k_scale=kv.k_scale, v_scale=kv.v_scale)
        self._bound[("write",)](k, v, *kv)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, scale: float) -> torch.Tensor:
        """Attention of the step's queries q ``[T, Hq, D]`` over one layer -> ``[T, Hq, D]``.

        k, v ``[T, Hkv, D]`` are the step's new K/V (already written by :meth:`write`).
        """
        if len(self.parts) == 1:
            return self._run(0, q, k, v, kv, scale)
        out = torch.empty_like(q)
        for i, part in enumerate(self.parts):
            out[part.rows] = self._run(i, q[part.rows], k[part.rows], v[part.rows], kv, scale)
        return out

    def _run(self, index: int, q, k, v, kv: LayerKV, scale: float) -> torch.Tensor:
        part = self.parts[index]
        if part.chunk is not None:  # its checks are of this layer's own K/V
            return dense_chunk_attention_prepared(q, k, v, part.chunk, scale=scale, backend=self.chunk_backend)[0]
        if (index, scale) not in self._bound:
            self._bound[(index, scale)] = _bind(part.meta, q, kv, scale)
        return self._bound[(index, scale)](q, *kv)


def _bind(meta: AttentionMetadata, q: torch.Tensor, kv: LayerKV, scale: float) -> BoundCall:
    """A part's paged attention call, checked on this layer for every layer of the step."""
    options = {"scale": scale, "k_scale": kv.k_scale, "v_scale": kv.v_scale}
    if meta.cascade is not None:
        return bind_cascade_decode_attention(q, kv.k, kv.v, meta.cascade, **options)
    bind = bind_decode_attention if meta.is_decode else bind_prefill_attention
    return bind(q, kv.k, kv.v, meta, **options)


def step_routes(meta: AttentionMetadata, chunk: bool) -> np.ndarray:
    """The route of every sequence ``[S]`` (CHUNK, DECODE or PAGED), from host lengths."""
    q_lens = meta.host_query_lens
    routes = np.full(len(q_lens), PAGED, dtype=np.int64)
    if meta.cascade is not None:
        return routes
    if meta.device.type != "cuda":
        routes[q_lens == 1] = DECODE
    if chunk and not meta.is_decode:  # a decode step keeps one graph-capturable decode call
        routes[meta.host_seq_lens == q_lens] = CHUNK  # no cached prefix
    return routes


def _part(rows: torch.Tensor | None, meta: AttentionMetadata, route: int) -> _Part:
    """A part of ``route``; a chunk part carries its offsets (the device copy is the metadata's)."""
    if route != CHUNK:
        return _Part(rows, meta)
    cu = offsets(meta.host_query_lens)
    chunk = ChunkMetadata(cu_seqlens=meta.cu_seqlens_q, host_cu_seqlens=cu, max_len=meta.max_query_len)
    return _Part(rows, meta, chunk)


def _subset(meta: AttentionMetadata, keep: np.ndarray, route: int) -> _Part:
    """The sequences where ``keep`` holds, with their query rows (index tensors built on the host)."""
    q_lens, seq_lens = meta.host_query_lens[keep], meta.host_seq_lens[keep]
    starts = offsets(meta.host_query_lens)[:-1][keep]  # first packed row of each kept sequence
    cu = offsets(q_lens)
    rows = np.repeat(starts - cu[:-1], q_lens) + np.arange(cu[-1])  # [T_part]
    seqs = torch.from_numpy(np.flatnonzero(keep)).to(meta.device)
    row_index = torch.from_numpy(rows).to(meta.device)
    sub = replace(
        meta,
        block_tables=meta.block_tables.index_select(0, seqs),
        seq_lens=meta.seq_lens.index_select(0, seqs),
        cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)).to(meta.device),
        slot_mapping=meta.slot_mapping.index_select(0, row_index),
        host_seq_lens=seq_lens,
        host_query_lens=q_lens,
        max_seq_len=int(seq_lens.max()),
        max_query_len=int(q_lens.max()),
        cascade=None,
    )
    return _part(row_index, sub, route)

"""Cascade decode: sequences that share a prefix attend its blocks once per group, then their own suffix.

Beams and parallel samples fork from one prompt and share its blocks copy-on-write. Plain
decode reads those blocks once per sequence; cascade decode reads them once per group with
:mod:`kernels.prefix_attention` (every member's query in one tile), attends each sequence's
remaining blocks with the decode kernel, and merges the two states by their lse
(:func:`~kernels.merge_states.merge_attention_states`). Sequences outside any group keep
their whole length in the suffix part (an empty prefix merges as weight 0).

This module composes those kernels; its metadata (:class:`~kernels.metadata.CascadeMetadata`)
is made on the host (:func:`~kernels.metadata.cascade_host_arrays`, then
:func:`~kernels.metadata.build_cascade_metadata` on the uploaded arrays), so the prepared
path reads no device value.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.checks import Backend, BoundCall, check_cache, check_options, check_tables
from kernels.decode_attention import bind_decode_attention
from kernels.merge_states import merge_attention_states
from kernels.metadata import CascadeMetadata, check_metadata, prepare_cascade_metadata
from kernels.prefix_attention import bind_prefix_attention
from paged_kv.errors import InvalidArgumentError, check_bool, describe
from paged_kv.tensor_checks import INDEX_DTYPES, check_tensor


def bind_cascade_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cascade: CascadeMetadata, *,
    scale: float | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    soft_cap: float | None = None, return_lse: bool = False, backend: Backend = "auto",
) -> BoundCall:  # fmt: skip
    """The checks of :func:`cascade_decode_attention_prepared` done once: a BoundCall run per layer."""
    check_bool("return_lse", return_lse)
    check_cache(q, k_cache, v_cache, k_scale, v_scale)
    check_metadata(cascade, CascadeMetadata, device=q.device, name="cascade")
    if q.shape[0] != cascade.num_seqs:
        raise InvalidArgumentError(describe("q.shape[0]", q.shape[0], f"the cascade's {cascade.num_seqs} sequences"))
    opts = dict(scale=scale, k_scale=k_scale, v_scale=v_scale, soft_cap=soft_cap, backend=backend)
    suffix = bind_decode_attention(q, k_cache, v_cache, cascade.suffix, return_lse=True, **opts)
    rows, in_order = cascade.q_rows, cascade.rows_in_order
    prefix = None
    if cascade.prefix.num_groups:
        grouped = q if in_order else q.index_select(0, rows)  # [Tg, Hq, D]
        prefix = bind_prefix_attention(grouped, k_cache, v_cache, cascade.prefix, **opts)

    def run(q, k_cache, v_cache, k_scale=None, v_scale=None):
        caches = (k_cache, v_cache, k_scale, v_scale)
        out, lse = suffix.run(q, *caches)
        if prefix is not None:
            p_out, p_lse = prefix.run(q if in_order else q.index_select(0, rows), *caches)
            if in_order:
                out, lse = merge_attention_states(p_out, p_lse, out, lse, backend=backend)
            else:
                s_out, s_lse = out.index_select(0, rows), lse.index_select(0, rows)
                m_out, m_lse = merge_attention_states(p_out, p_lse, s_out, s_lse, backend=backend)
                out, lse = out.index_copy(0, rows, m_out), lse.index_copy(0, rows, m_lse)
        return (out, lse) if return_lse else out

    return BoundCall(run, q, k_cache, v_cache, k_scale, v_scale)


def cascade_decode_attention_prepared(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cascade: CascadeMetadata, *,
    scale: float | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    soft_cap: float | None = None, return_lse: bool = False, backend: Backend = "auto",
):  # fmt: skip
    """Cascade decode over prepared :class:`CascadeMetadata`: q ``[S, Hq, D]`` -> out (and lse ``[S, Hq]``).

    Equals :func:`~kernels.decode_attention.paged_decode_attention` on the same batch (up to
    rounding); host checks only, no device value read.
    """
    bound = bind_cascade_decode_attention(
        q, k_cache, v_cache, cascade, scale=scale, k_scale=k_scale, v_scale=v_scale, soft_cap=soft_cap,
        return_lse=return_lse, backend=backend,
    )  # fmt: skip
    return bound.run(q, k_cache, v_cache, k_scale, v_scale)


def cascade_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_groups: torch.Tensor,
    prefix_lens: torch.Tensor,
    *,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    soft_cap: float | None = None,
    return_lse: bool = False,
    backend: Backend = "auto",
):
    """Decode attention with shared prefixes read once per group: q ``[S, Hq, D]`` -> out (and lse ``[S, Hq]``).

    Sequence s belongs to group ``seq_groups[s]`` (or none: -1) whose members all hold the same
    first ``prefix_lens[g] // block_size`` block ids; otherwise as
    :func:`~kernels.decode_attention.paged_decode_attention` (no sliding window). One host sync.
    ``backend="torch"`` runs every part on its torch reference.
    """
    check_bool("return_lse", return_lse)  # before the host sync
    geo = check_cache(q, k_cache, v_cache, k_scale, v_scale)
    check_options(geo.head_dim, scale, None, soft_cap)
    check_tables(block_tables, seq_lens, q.shape[0], q.device)
    check_tensor("seq_groups", seq_groups, ndim=1, dtypes=INDEX_DTYPES, device=q.device)
    check_tensor("prefix_lens", prefix_lens, ndim=1, dtypes=INDEX_DTYPES, device=q.device)
    if seq_groups.shape[0] != q.shape[0]:
        raise InvalidArgumentError(describe("seq_groups.shape", tuple(seq_groups.shape), f"({q.shape[0]},)"))
    num_seqs, width = block_tables.shape
    host = torch.cat([block_tables.flatten().long(), seq_lens.long(), seq_groups.long(), prefix_lens.long()]).tolist()
    tables = np.array(host[: num_seqs * width], dtype=np.int64).reshape(num_seqs, width)
    rest = np.array(host[num_seqs * width :], dtype=np.int64)
    lens, groups, plens = rest[:num_seqs], rest[num_seqs : 2 * num_seqs], rest[2 * num_seqs :]
    cascade = prepare_cascade_metadata(
        tables, lens, groups, plens, block_size=geo.block_size, num_blocks=geo.num_blocks, device=q.device
    )
    opts = dict(scale=scale, k_scale=k_scale, v_scale=v_scale, soft_cap=soft_cap, backend=backend)
    return cascade_decode_attention_prepared(q, k_cache, v_cache, cascade, return_lse=return_lse, **opts)

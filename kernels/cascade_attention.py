"""Cascade decode: sequences that share a prefix attend its blocks once per group, then their own suffix.

Beams and parallel samples fork from one prompt and share its blocks copy-on-write. Plain
decode reads those blocks once per sequence; cascade decode reads them once per group with
:mod:`kernels.prefix_attention` (every member's query in one tile), attends each sequence's
remaining blocks with the decode kernel, and merges the two states by their lse
(:func:`~kernels.merge_states.merge_attention_states`). Sequences outside any group keep
their whole length in the suffix part (an empty prefix merges as weight 0).

Group g shares ``prefix_lens[g]`` tokens, whole blocks, strictly fewer than each member's
length (the block holding the token being written is never shared), and every member's table
holds the same block ids there. Its suffix table starts at its first unshared block.
:class:`CascadeMetadata` is made on the host (:func:`cascade_host_arrays`, then
:func:`build_cascade_metadata` on the uploaded arrays), so the prepared path reads no device value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels._checks import Backend
from kernels.attention_checks import check_cache, check_options, check_tables
from kernels.attention_metadata import AttentionMetadata, offsets, prepare_attention_metadata
from kernels.decode_attention import paged_decode_attention_prepared
from kernels.merge_states import merge_attention_states
from kernels.prefix_attention import PrefixMetadata, check_prefix_metadata, paged_prefix_attention_prepared
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, check_bool, check_int, describe
from paged_kv.tensor_checks import INDEX_DTYPES, check_host_ints, check_tensor


@dataclass(frozen=True, eq=False)
class CascadeArrays:
    """A cascade decode batch on the host: what :func:`build_cascade_metadata` turns into device metadata."""

    q_rows: np.ndarray  # [Tg] int64 decode rows of the grouped sequences, group after group
    cu_seqlens_q: np.ndarray  # [G + 1] int64 offsets of each group's rows in q_rows
    leaders: np.ndarray  # [G] int64 a member of each group (its table holds the prefix)
    prefix_lens: np.ndarray  # [G] int64 shared tokens, whole blocks
    first_suffix_block: np.ndarray  # [S] int64 table column where each sequence's suffix starts
    suffix_lens: np.ndarray  # [S] int64 tokens after the shared prefix (>= 1)
    block_size: int

    def parts(self) -> list[np.ndarray]:
        """The arrays to upload, in the order :func:`build_cascade_metadata` takes them."""
        return [self.q_rows, self.cu_seqlens_q, self.leaders, self.prefix_lens, self.first_suffix_block,
                self.suffix_lens]  # fmt: skip

    @property
    def rows_in_order(self) -> bool:
        """Whether every sequence is grouped and the groups list them in batch order (no gather needed)."""
        return len(self.q_rows) == len(self.suffix_lens) and bool((self.q_rows == np.arange(len(self.q_rows))).all())


@dataclass(frozen=True, kw_only=True, eq=False)
class CascadeMetadata:
    """One cascade decode step on the device: the groups' prefix part, every sequence's suffix part."""

    prefix: PrefixMetadata  # groups over the packed rows q[q_rows]
    suffix: AttentionMetadata  # decode metadata of the suffixes (tables from the first unshared block)
    q_rows: torch.Tensor  # [Tg] int64 decode rows of the grouped sequences, group after group
    rows_in_order: bool  # q_rows is arange(S): no gather, no scatter
    host: CascadeArrays

    @property
    def num_seqs(self) -> int:
        """Sequences S of the decode batch."""
        return self.suffix.num_seqs


def cascade_host_arrays(
    tables: np.ndarray, seq_lens: np.ndarray, seq_groups: np.ndarray, prefix_lens: np.ndarray, block_size: int
) -> CascadeArrays:
    """Validate a grouping of a decode batch on the host and lay it out as :class:`CascadeArrays`.

    tables ``[S, W]`` (host block ids), seq_lens ``[S]``, seq_groups ``[S]`` (the group of each
    sequence in ``[0, G)``, or -1), prefix_lens ``[G]``: multiples of block_size, shorter than each
    member, whose blocks every member's row holds. Raises (nothing built) otherwise.
    """
    tables, lens = check_host_ints("tables", tables, 2), check_host_ints("seq_lens", seq_lens, 1)
    groups, plens = check_host_ints("seq_groups", seq_groups, 1), check_host_ints("prefix_lens", prefix_lens, 1)
    num_seqs, num_groups = len(lens), len(plens)
    if tables.ndim != 2 or tables.shape[0] != num_seqs or groups.shape != (num_seqs,) or plens.ndim != 1:
        got = (tables.shape, lens.shape, groups.shape, plens.shape)
        names = "tables, seq_lens, seq_groups, prefix_lens shapes"
        raise InvalidArgumentError(describe(names, got, "[S, W], [S], [S], [G]"))
    if ((groups < -1) | (groups >= num_groups)).any():
        raise OutOfRangeError(describe("seq_groups", groups.tolist(), f"group ids in [-1, {num_groups})"))
    sizes = np.bincount(groups[groups >= 0], minlength=num_groups)
    if num_groups and sizes.min() < 1:
        expected = f"at least one member in each of {num_groups} groups"
        raise InvalidArgumentError(describe("seq_groups", groups.tolist(), expected))
    if ((plens < block_size) | (plens % block_size != 0)).any():
        raise OutOfRangeError(describe("prefix_lens", plens.tolist(), f"positive multiples of block_size {block_size}"))
    member_plen = np.where(groups >= 0, plens[np.maximum(groups, 0)] if num_groups else 0, 0)  # [S]
    if (member_plen >= lens).any():
        bad = int(np.flatnonzero(member_plen >= lens)[0])
        expected = f"< seq_lens[{bad}]={lens[bad]}"
        raise OutOfRangeError(describe(f"prefix_lens[{groups[bad]}]", int(member_plen[bad]), expected))
    q_rows = np.flatnonzero(groups >= 0)
    q_rows = q_rows[np.argsort(groups[q_rows], kind="stable")]  # [Tg] members, group after group
    cu = offsets(sizes)
    leaders = q_rows[cu[:-1]]
    _check_shared_blocks(tables, groups, plens // block_size, leaders)
    return CascadeArrays(
        q_rows=q_rows, cu_seqlens_q=cu, leaders=leaders, prefix_lens=plens,
        first_suffix_block=member_plen // block_size, suffix_lens=lens - member_plen, block_size=block_size,
    )  # fmt: skip


def _check_shared_blocks(tables: np.ndarray, groups: np.ndarray, prefix_blocks: np.ndarray, leaders: np.ndarray):
    """Every member's row holds its leader's block ids over the group's prefix blocks."""
    if (prefix_blocks > tables.shape[1]).any():
        raise OutOfRangeError(describe("prefix_lens", prefix_blocks.tolist(), f"<= {tables.shape[1]} table columns"))
    members = np.flatnonzero(groups >= 0)
    cols = np.arange(tables.shape[1])[None, :]
    inside = cols < prefix_blocks[groups[members]][:, None]  # [M, W]
    differs = (tables[members] != tables[leaders[groups[members]]]) & inside
    if differs.any():
        seq = int(members[np.flatnonzero(differs.any(1))[0]])
        raise InvalidArgumentError(describe(f"tables[{seq}]", "other prefix block ids", "its group's shared blocks"))


def build_cascade_metadata(
    arrays: CascadeArrays, uploaded: list[torch.Tensor], meta: AttentionMetadata
) -> CascadeMetadata:
    """Device metadata of a cascade step from its arrays, uploaded (in ``arrays.parts()`` order) next to ``meta``.

    The prefix and suffix tables are gathered on the device from the decode step's tables, so
    nothing is read back and only the small index arrays travel.
    """
    q_rows, cu, leaders, plens, first, slens = uploaded
    tables = meta.block_tables  # [S, W]
    prefix_width = max(1, int(arrays.prefix_lens.max(initial=0)) // arrays.block_size)
    used = -(-(arrays.first_suffix_block * arrays.block_size + arrays.suffix_lens) // arrays.block_size)
    suffix_width = max(1, int((used - arrays.first_suffix_block).max(initial=0)))
    cols = first[:, None] + torch.arange(suffix_width, device=tables.device)[None, :]  # [S, Ws]
    suffix_tables = tables.gather(1, cols.clamp_(max=tables.shape[1] - 1))  # columns past a suffix are padding
    prefix = PrefixMetadata(
        block_tables=tables.index_select(0, leaders)[:, :prefix_width], prefix_lens=plens.to(torch.int32),
        cu_seqlens_q=cu.to(torch.int32), host_prefix_lens=arrays.prefix_lens,
        host_query_counts=np.diff(arrays.cu_seqlens_q), block_size=meta.block_size, num_blocks=meta.num_blocks,
    )  # fmt: skip
    suffix = AttentionMetadata(
        block_tables=suffix_tables, seq_lens=slens.to(torch.int32), cu_seqlens_q=meta.cu_seqlens_q,
        slot_mapping=meta.slot_mapping, host_seq_lens=arrays.suffix_lens, host_query_lens=meta.host_query_lens,
        block_size=meta.block_size, num_blocks=meta.num_blocks, max_seq_len=int(arrays.suffix_lens.max(initial=0)),
        max_query_len=meta.max_query_len,
    )  # fmt: skip
    return CascadeMetadata(prefix=prefix, suffix=suffix, q_rows=q_rows, rows_in_order=arrays.rows_in_order, host=arrays)


def prepare_cascade_metadata(
    tables: np.ndarray,
    seq_lens: np.ndarray,
    seq_groups: np.ndarray,
    prefix_lens: np.ndarray,
    *,
    block_size: int,
    num_blocks: int,
    device: str | torch.device = "cpu",
) -> CascadeMetadata:
    """Validate a grouped decode batch given as host arrays and build its :class:`CascadeMetadata` (no read back).

    tables ``[S, W]`` block ids covering each sequence's seq_lens tokens; see :func:`cascade_host_arrays`.
    """
    check_int("block_size", block_size, low=1)
    check_int("num_blocks", num_blocks, low=1)
    tables, lens = check_host_ints("tables", tables, 2), check_host_ints("seq_lens", seq_lens, 1)
    if lens.shape != (tables.shape[0],):
        raise InvalidArgumentError(describe("tables, seq_lens shapes", (tables.shape, lens.shape), "[S, W], [S]"))
    capacity = tables.shape[1] * block_size
    if len(lens) and not 1 <= lens.min() <= lens.max() <= capacity:
        bad = lens.min() if lens.min() < 1 else lens.max()
        raise OutOfRangeError(describe("seq_lens", int(bad), f"lengths in [1, {capacity}] (columns * block_size)"))
    meta = prepare_attention_metadata(
        tables.tolist(), (lens - 1).tolist(), [1] * len(lens), block_size=block_size, num_blocks=num_blocks,
        device=device,
    )  # fmt: skip
    arrays = cascade_host_arrays(tables, lens, seq_groups, prefix_lens, block_size)
    parts = arrays.parts()
    flat = torch.from_numpy(np.concatenate(parts)).to(meta.device)
    return build_cascade_metadata(arrays, list(flat.split([len(p) for p in parts])), meta)


def cascade_decode_attention_prepared(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cascade: CascadeMetadata,
    *,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    soft_cap: float | None = None,
    return_lse: bool = False,
    backend: Backend = "auto",
):
    """Cascade decode over prepared :class:`CascadeMetadata`: q ``[S, Hq, D]`` -> out (and lse ``[S, Hq]``).

    Equals :func:`~kernels.decode_attention.paged_decode_attention` on the same batch (up to
    rounding); host checks only, no device value read.
    """
    check_bool("return_lse", return_lse)
    if not isinstance(cascade, CascadeMetadata):
        raise InvalidArgumentError(describe("cascade", type(cascade).__name__, "a CascadeMetadata"))
    geo = check_cache(q, k_cache, v_cache, k_scale, v_scale)
    if q.shape[0] != cascade.num_seqs:
        raise InvalidArgumentError(describe("q.shape[0]", q.shape[0], f"the cascade's {cascade.num_seqs} sequences"))
    opts = dict(scale=scale, k_scale=k_scale, v_scale=v_scale, soft_cap=soft_cap, backend=backend)
    out, lse = paged_decode_attention_prepared(q, k_cache, v_cache, cascade.suffix, return_lse=True, **opts)
    if cascade.prefix.num_groups:
        grouped = q if cascade.rows_in_order else q.index_select(0, cascade.q_rows)  # [Tg, Hq, D]
        check_prefix_metadata(cascade.prefix, geo, grouped)
        p_out, p_lse = paged_prefix_attention_prepared(grouped, k_cache, v_cache, cascade.prefix, **opts)
        if cascade.rows_in_order:
            out, lse = merge_attention_states(p_out, p_lse, out, lse, backend=backend)
        else:
            rows = cascade.q_rows
            s_out, s_lse = out.index_select(0, rows), lse.index_select(0, rows)
            m_out, m_lse = merge_attention_states(p_out, p_lse, s_out, s_lse, backend=backend)
            out, lse = out.index_copy(0, rows, m_out), lse.index_copy(0, rows, m_lse)
    return (out, lse) if return_lse else out


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


def cascade_decode_attention_reference(
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
):
    """Torch reference of :func:`cascade_decode_attention`: same contract, every part on the torch path."""
    return cascade_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, seq_groups, prefix_lens, scale=scale, k_scale=k_scale,
        v_scale=v_scale, soft_cap=soft_cap, return_lse=return_lse, backend="torch",
    )  # fmt: skip

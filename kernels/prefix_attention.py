"""Shared-prefix attention: packed query rows of G groups, each over its group's paged prefix, no causal mask.

Group g owns query rows ``[cu_seqlens_q[g], cu_seqlens_q[g + 1])`` of q ``[T, Hq, D]`` and every
one of them sees positions ``[0, prefix_lens[g])`` of table g. This is the shared half of cascade
decode (:mod:`kernels.cascade_attention`): beams or parallel samples that fork from one prompt
share its blocks, so the prefix is read once per group instead of once per sequence.

The Triton kernel's tile rows are (query, head-of-the-GQA-group) pairs: one program holds
Q_TILE queries x GROUP heads of one KV head, so each K/V tile it loads serves all of them.
Grid (group x query tile, kv head, split): the prefix is split flash-decoding style when the
groups are too few to fill the GPU, and the split-merge kernel (:mod:`kernels.splits`) combines them. The
torch reference gathers each group's prefix densely and runs the shared dense core.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.attention_torch import dense_attention, gather_kv
from kernels.attention_triton import attend_kv_range, cache_arguments, dot_dtype, dot_precision, logit_coefficients
from kernels.checks import (
    Backend,
    BoundCall,
    CacheGeometry,
    block_id_bounds,
    check_block_ids,
    check_cache,
    check_options,
    launches_triton,
)
from kernels.metadata import PrefixMetadata, check_metadata, offsets
from kernels.splits import MAX_SPLITS, choose_num_splits, merge_splits, split_outputs, split_tile
from kernels.tile_configs import tile_key, tuned_values
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, check_int, describe
from paged_kv.tensor_checks import INDEX_DTYPES, check_shape, check_tensor

MAX_TILE_ROWS = 64  # (query, head) rows of one program: bounds registers like the decode tile


@triton.jit
def _prefix_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, plen_ptr, cu_ptr, out_ptr, lse_ptr,
    sq_t, sq_h, sq_d,
    sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d,
    sks_b, sks_t, sks_h, svs_b, svs_t, svs_h,
    sbt_g, sbt_b, so_t, so_h, so_p, so_d, sl_t, sl_h, sl_p,
    qk_a, qk_b,
    GROUP: tl.constexpr, Q_TILE: tl.constexpr, NUM_QTILES: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DTYPE: tl.constexpr, QUANTIZED: tl.constexpr, SOFT_CAP: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (group * NUM_QTILES, kv_head, split): Q_TILE queries x GROUP heads over one split of the prefix."""
    grp = tl.program_id(0) // NUM_QTILES
    qtile = tl.program_id(0) % NUM_QTILES
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_lo = tl.load(cu_ptr + grp).to(tl.int32) + qtile * Q_TILE  # first query row of this tile
    q_hi = tl.load(cu_ptr + grp + 1).to(tl.int32)
    prefix_len = tl.load(plen_ptr + grp).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(prefix_len, NUM_SPLITS), BLOCK_N) * BLOCK_N  # tile-aligned
    start = split * per_split
    stop = tl.minimum(start + per_split, prefix_len)
    stop = tl.where(q_lo < q_hi, stop, start)  # a tile past the group's queries reads nothing

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    rows = q_lo + offs_m // GROUP  # [BLOCK_M] query row of each tile row
    heads = kvh * GROUP + offs_m % GROUP  # [BLOCK_M] its query head
    m_mask = (offs_m < Q_TILE * GROUP) & (rows < q_hi)  # rows past the tile or the group are padding
    q_offs = rows[:, None] * sq_t + heads[:, None] * sq_h + offs_d[None, :] * sq_d
    q = tl.load(q_ptr + q_offs, mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DTYPE)  # [BLOCK_M, D_PAD]

    # out: [BLOCK_M, D_PAD] float32, lse: [BLOCK_M]; prefix positions have no window (kv_lo 0, WINDOW False)
    out, lse = attend_kv_range(
        q, bt_ptr + grp * sbt_g, kvh, 0, start, stop, qk_a, qk_b, offs_d, d_mask,
        k_ptr, v_ptr, ks_ptr, vs_ptr,
        sbt_b, sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d, sks_b, sks_t, sks_h, svs_b, svs_t, svs_h,
        BLOCK_SIZE, BLOCK_N, DTYPE, QUANTIZED, SOFT_CAP, False, PRECISION,
    )  # fmt: skip
    o_offs = rows[:, None] * so_t + heads[:, None] * so_h + split * so_p + offs_d[None, :] * so_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + rows * sl_t + heads * sl_h + split * sl_p, lse, mask=m_mask)


# ----------------------------------------------------------------------------- host side


def prefix_tile(group: int, max_queries: int) -> tuple[int, int]:
    """(BLOCK_M, Q_TILE): tile rows (>= 16, power of 2, <= MAX_TILE_ROWS or one GROUP), queries per tile."""
    block_m = max(16, min(MAX_TILE_ROWS, triton.next_power_of_2(group * max(1, max_queries))))
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, block_m // group


def prefix_tile_key(d_pad: int, cache_bytes: int, dtype: tl.dtype) -> str:
    """The tile table key of a prefix (cascade) launch (see :mod:`kernels.tile_configs`)."""
    return tile_key("prefix", f"d{d_pad}", f"c{cache_bytes}", dtype)


def prefix_launch(d_pad: int, cache_bytes: int, dtype: tl.dtype, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the prefix kernel: the tuned entry, else the built-in split tile."""
    block_n, num_warps, num_stages = split_tile(d_pad, cache_bytes, dtype)
    defaults = {"BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}
    tile = tuned_values(prefix_tile_key(d_pad, cache_bytes, dtype), device, defaults)
    return tile["BLOCK_N"], tile["num_warps"], tile["num_stages"]


def _prefix_triton(q, k_cache, v_cache, meta: PrefixMetadata, geo: CacheGeometry, opts, k_scale, v_scale, splits):
    """Launch the prefix kernel (and the split merge when splits > 1); returns (out, lse)."""
    num_rows, num_q_heads, head_dim = q.shape
    scale, _, soft_cap = opts
    group = num_q_heads // geo.num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    widest = int(meta.host_query_counts.max(initial=0))
    block_m, q_tile = prefix_tile(group, widest)
    num_qtiles = max(1, -(-widest // q_tile))
    out, lse, part, part_lse = split_outputs(q, splits)  # [T, Hq, D], [T, Hq], [T, Hq, splits, D], [T, Hq, splits]
    qk_a, qk_b = logit_coefficients(scale, soft_cap)
    dtype = dot_dtype(q, k_cache)
    block_n, num_warps, num_stages = prefix_launch(d_pad, k_cache.element_size(), dtype, q.device)
    cache_pointers, cache_strides = cache_arguments(k_cache, v_cache, k_scale, v_scale)
    tables = meta.block_tables
    _prefix_kernel[(meta.num_groups * num_qtiles, geo.num_kv_heads, splits)](
        q, *cache_pointers, tables, meta.prefix_lens, meta.cu_seqlens_q, part, part_lse,
        *q.stride(), *cache_strides, *tables.stride(), *part.stride(), *part_lse.stride(), qk_a, qk_b,
        GROUP=group, Q_TILE=q_tile, NUM_QTILES=num_qtiles, BLOCK_M=block_m, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=geo.block_size, BLOCK_N=block_n, NUM_SPLITS=splits, DTYPE=dtype, QUANTIZED=geo.quantized,
        SOFT_CAP=soft_cap is not None, PRECISION=dot_precision(q, k_cache), num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return merge_splits(out, lse, part, part_lse, d_pad)


def _prefix_torch(q, k_cache, v_cache, meta: PrefixMetadata, opts, k_scale, v_scale):
    """Dense torch path: queries padded per group ``[G, M, Hq, D]`` over gathered prefixes; returns (out, lse)."""
    scale, _, soft_cap = opts
    counts, plens = meta.host_query_counts, meta.host_prefix_lens
    num_groups, width = len(counts), int(counts.max(initial=0))
    length = int(plens.max(initial=0))
    if length == 0:  # no group has a prefix: every row attends to nothing
        return torch.zeros_like(q), torch.full(q.shape[:2], float("-inf"), device=q.device)
    starts = offsets(counts)[:-1]
    j = np.arange(width)[None, :]
    padded = starts[:, None] + np.minimum(j, np.maximum(counts[:, None] - 1, 0))  # [G, M] rows, repeated past the end
    padded = np.minimum(padded, len(q) - 1)  # a group without rows (at the end: start == T) borrows a real row
    packed = (np.repeat(np.arange(num_groups), counts) * width + np.arange(len(q)) - np.repeat(starts, counts))
    idx = torch.from_numpy(np.concatenate([padded.ravel(), packed])).to(q.device)
    pad_idx, pack_idx = idx.split([padded.size, len(packed)])
    lens = meta.prefix_lens
    zeros = torch.zeros(num_groups, dtype=torch.int64, device=q.device)
    k = gather_kv(k_cache, k_scale, meta.block_tables, lens, zeros, length, "k")  # [Hkv, G, L, D]
    v = gather_kv(v_cache, v_scale, meta.block_tables, lens, zeros, length, "v")
    qg = q.index_select(0, pad_idx).view(num_groups, width, *q.shape[1:]).float()  # [G, M, Hq, D]
    q_pos = (lens.long() - 1)[:, None].expand(num_groups, width)  # non-causal: each row sees the whole prefix
    out, lse = dense_attention(qg, k, v, q_pos, lens, scale=scale, sliding_window=None, soft_cap=soft_cap)
    out = out.flatten(0, 1).index_select(0, pack_idx)  # [T, Hq, D]
    lse = lse.flatten(0, 1).index_select(0, pack_idx)  # [T, Hq]
    if (plens == 0).any():  # an empty prefix gathered a stale slot: its rows are 0 with lse -inf
        empty = torch.from_numpy(np.repeat(plens == 0, counts)).to(q.device)[:, None]
        out = torch.where(empty[..., None], 0.0, out)
        lse = torch.where(empty, float("-inf"), lse)
    return out.to(q.dtype), lse


def _bind(q, k_cache, v_cache, k_scale, v_scale, meta: PrefixMetadata, geo, opts, num_splits, backend) -> BoundCall:
    """The launch of a checked prefix call, bound to everything but its layer's q and caches (host values only)."""
    run_triton = launches_triton(backend, q, k_cache, v_cache, meta.block_tables, meta.prefix_lens)
    if run_triton and q.shape[0]:
        widest = int(meta.host_query_counts.max())
        tiles = meta.num_groups * -(-widest // prefix_tile(q.shape[1] // geo.num_kv_heads, widest)[1])
        longest = int(meta.host_prefix_lens.max())
        num_splits = num_splits or choose_num_splits(tiles, geo.num_kv_heads, longest, q.device)

    def run(q, k_cache, v_cache, k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[0] == 0:
            return torch.empty_like(q), torch.empty(0, q.shape[1], device=q.device, dtype=torch.float32)
        if run_triton:
            return _prefix_triton(q, k_cache, v_cache, meta, geo, opts, k_scale, v_scale, num_splits)
        return _prefix_torch(q, k_cache, v_cache, meta, opts, k_scale, v_scale)

    return BoundCall(run, q, k_cache, v_cache, k_scale, v_scale)


def _validate(q, k_cache, v_cache, block_tables, prefix_lens, cu_seqlens_q, k_scale, v_scale, scale, cap, splits):
    """Every check of the prefix contract with one host sync; returns (geometry, options, metadata)."""
    geo = check_cache(q, k_cache, v_cache, k_scale, v_scale)
    opts = check_options(geo.head_dim, scale, None, cap)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=q.device)
    num_groups = check_tensor("prefix_lens", prefix_lens, ndim=1, dtypes=INDEX_DTYPES, device=q.device).shape[0]
    if block_tables.shape[0] != num_groups:
        raise InvalidArgumentError(describe("block_tables.shape[0]", block_tables.shape[0], f"{num_groups} groups"))
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES, device=q.device)
    check_shape("cu_seqlens_q", cu_seqlens_q, (num_groups + 1,))
    if splits is not None:
        check_int("num_splits", splits, low=1, high=MAX_SPLITS)
    zeros = torch.zeros_like(prefix_lens, dtype=torch.int64)
    bounds = block_id_bounds(block_tables, prefix_lens.long(), zeros, geo.block_size)
    host = torch.cat([cu_seqlens_q.long(), prefix_lens.long(), torch.stack(bounds)]).tolist()
    cu, plens, (lo_blk, hi_blk) = host[: num_groups + 1], host[num_groups + 1 : -2], host[-2:]
    if cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise OutOfRangeError(describe("cu_seqlens_q", cu, f"non-decreasing offsets from 0 to {q.shape[0]}"))
    capacity = block_tables.shape[1] * geo.block_size
    bad = [n for n in plens if not 0 <= n <= capacity]
    if bad:
        raise OutOfRangeError(describe("prefix_lens", bad[0], f"lengths in [0, {capacity}] (max_blocks * block_size)"))
    check_block_ids(lo_blk, hi_blk, geo.num_blocks)
    meta = PrefixMetadata(
        block_tables=block_tables, prefix_lens=prefix_lens, cu_seqlens_q=cu_seqlens_q,
        host_prefix_lens=np.array(plens, dtype=np.int64), host_query_counts=np.diff(np.array(cu, dtype=np.int64)),
        block_size=geo.block_size, num_blocks=geo.num_blocks,
    )  # fmt: skip
    return geo, opts, meta


def paged_prefix_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of packed query groups over paged prefixes: q ``[T, Hq, D]`` -> (out, lse ``[T, Hq]``).

    Rows ``[cu_seqlens_q[g], cu_seqlens_q[g + 1])`` see positions ``[0, prefix_lens[g])`` of
    ``block_tables[g]``. out has q's dtype; lse is the float32 natural-log logsumexp of the
    (soft-capped) logits, -inf (and out 0) for a group with an empty prefix. Query head h uses KV
    head ``h // (Hq // Hkv)``; logits are ``scale * q.k`` (default 1/sqrt(D)). One host sync.
    ``backend="torch"`` is the torch reference (the dense path).
    """
    geo, opts, meta = _validate(
        q, k_cache, v_cache, block_tables, prefix_lens, cu_seqlens_q, k_scale, v_scale, scale, soft_cap, num_splits
    )
    args = (q, k_cache, v_cache, k_scale, v_scale)
    return _bind(*args, meta, geo, opts, num_splits, backend).run(*args)


def bind_prefix_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PrefixMetadata, *, scale: float | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, soft_cap: float | None = None,
    num_splits: int | None = None, backend: Backend = "auto",
) -> BoundCall:  # fmt: skip
    """The checks of :func:`paged_prefix_attention_prepared` done once: a BoundCall run per layer."""
    geo = check_cache(q, k_cache, v_cache, k_scale, v_scale)
    opts = check_options(geo.head_dim, scale, None, soft_cap)
    check_metadata(meta, PrefixMetadata, device=q.device, num_blocks=geo.num_blocks, block_size=geo.block_size)
    if meta.num_rows != q.shape[0]:
        raise InvalidArgumentError(describe("q.shape[0]", q.shape[0], f"the metadata's {meta.num_rows} query rows"))
    if num_splits is not None:
        check_int("num_splits", num_splits, low=1, high=MAX_SPLITS)
    return _bind(q, k_cache, v_cache, k_scale, v_scale, meta, geo, opts, num_splits, backend)


def paged_prefix_attention_prepared(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PrefixMetadata, *, scale: float | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, soft_cap: float | None = None,
    num_splits: int | None = None, backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`paged_prefix_attention` over host-validated :class:`PrefixMetadata`: host checks only, no device read."""
    bound = bind_prefix_attention(
        q, k_cache, v_cache, meta, scale=scale, k_scale=k_scale, v_scale=v_scale, soft_cap=soft_cap,
        num_splits=num_splits, backend=backend,
    )  # fmt: skip
    return bound.run(q, k_cache, v_cache, k_scale, v_scale)

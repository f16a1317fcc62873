"""Paged decode attention: one query token per sequence, K/V read through block tables.

Layout (per layer): K and V caches ``[num_blocks, block_size, num_kv_heads, head_dim]``;
quantized caches (int8 / fp8) carry float32 scales ``[num_blocks, block_size,
num_kv_heads]`` and dequantize as ``stored.float() * scale``. Block tables
``[num_seqs, max_blocks]`` map logical block i of sequence s to a physical block;
entries past what ``seq_lens`` needs are padding and are never read.

The Triton path is flash-decoding: grid (sequence, kv head, split); each program
handles all query heads of one KV head (so each K/V byte is read once), walks its
share of the KV range with an online softmax and writes a partial output + lse;
a second small kernel merges the splits (:mod:`kernels.splits`). Splits hold a fixed, tile-aligned
number of tokens chosen from the batch's total tokens (:func:`~kernels.splits.choose_split_tokens`), so a long
sequence of a ragged batch gets many splits and a short one few: the split programs
past a sequence's end exit at once with lse -inf, which the merge weighs 0. A split
count fixed in advance (``num_splits``, CUDA-graph capture) instead divides each
sequence's range into that many equal parts at run time. The torch reference has the same contract
and is the CPU engine's path. The host checks (:mod:`kernels.checks`), the Triton tile steps and
the dense torch core (``kernels.attention_*``) are shared with the other attention kernels.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.attention_torch import DecodeLayout, decode_attention, decode_layout, token_slots
from kernels.attention_triton import attend_kv_range, cache_arguments, dot_dtype, dot_precision, logit_coefficients
from kernels.checks import (
    Backend,
    BoundCall,
    block_id_bounds,
    check_block_ids,
    check_cache,
    check_options,
    check_tables,
    launches_triton,
    window_start,
)
from kernels.metadata import AttentionMetadata, check_metadata
from kernels.splits import MAX_SPLITS, WAVES, choose_split_tokens, merge_splits, split_outputs, split_tile
from kernels.tile_configs import tile_key, tuned_values
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, check_bool, check_int, describe

TORCH_CHUNK_BYTES = 16 * 2**20  # dense K per sequence group of the torch path


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, lse_ptr,
    sq_s, sq_h, sq_d,
    sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d,
    sks_b, sks_t, sks_h, svs_b, svs_t, svs_h,
    sbt_s, sbt_b, so_s, so_h, so_p, so_d, sl_s, sl_h, sl_p,
    qk_a, qk_b, window, split_tokens, num_splits,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
    QUANTIZED: tl.constexpr, SOFT_CAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (seq, kv_head, split): partial attention of the GROUP query heads of one KV head.

    Split j covers ``[first + j * per_split, first + (j + 1) * per_split)`` of ``[first, seq_len)``:
    per_split = split_tokens (a multiple of BLOCK_N), or with split_tokens 0 the tile-aligned
    share of ``seq_len - first`` over num_splits. A split past the end does no work (lse -inf).
    """
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    kv_lo = 0
    if WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
    first = (kv_lo // BLOCK_N) * BLOCK_N
    per_split = split_tokens
    if split_tokens == 0:
        per_split = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N  # tile-aligned
    start = first + split * per_split
    stop = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # query heads of this KV head; rows >= GROUP are padding
    q_offs = seq * sq_s + heads[:, None] * sq_h + offs_d[None, :] * sq_d
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(DTYPE)  # [G_PAD, D_PAD]

    # out: [G_PAD, D_PAD] float32, lse: [G_PAD]; positions below kv_lo are masked (WINDOW)
    out, lse = attend_kv_range(
        q, bt_ptr + seq * sbt_s, kvh, kv_lo, start, stop, qk_a, qk_b, offs_d, d_mask,
        k_ptr, v_ptr, ks_ptr, vs_ptr,
        sbt_b, sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d, sks_b, sks_t, sks_h, svs_b, svs_t, svs_h,
        BLOCK_SIZE, BLOCK_N, DTYPE, QUANTIZED, SOFT_CAP, WINDOW, PRECISION,
    )  # fmt: skip
    o_offs = seq * so_s + heads[:, None] * so_h + split * so_p + offs_d[None, :] * so_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + seq * sl_s + heads * sl_h + split * sl_p, lse, mask=g_mask)


# ----------------------------------------------------------------------------- host side


def decode_tile(
    d_pad: int, cache_bytes: int, dtype: tl.dtype, device: torch.device | None = None
) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel per head size, cache element size and dot dtype.

    A tuned entry for ``device`` (:mod:`kernels.tile_configs`) wins over the built-in
    :func:`~kernels.splits.split_tile`.
    """
    tile = _decode_launch(d_pad, cache_bytes, dtype, device)
    return tile["BLOCK_N"], tile["num_warps"], tile["num_stages"]


def decode_waves(d_pad: int, cache_bytes: int, dtype: tl.dtype, device: torch.device | None = None) -> int:
    """Split programs per SM the automatic split size aims for: the tuned value, else WAVES."""
    return _decode_launch(d_pad, cache_bytes, dtype, device)["waves"]


def _decode_launch(d_pad: int, cache_bytes: int, dtype: tl.dtype, device: torch.device | None) -> dict[str, int]:
    """BLOCK_N, num_warps, num_stages and waves of one decode launch: the heuristic under the tuned entry."""
    block_n, num_warps, num_stages = split_tile(d_pad, cache_bytes, dtype)
    defaults = {"BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages, "waves": WAVES}
    return tuned_values(decode_tile_key(d_pad, cache_bytes, dtype), device, defaults)


def decode_tile_key(d_pad: int, cache_bytes: int, dtype: tl.dtype) -> str:
    """The tile table key of a decode launch (see :mod:`kernels.tile_configs`)."""
    return tile_key("decode", f"d{d_pad}", f"c{cache_bytes}", dtype)


def _split_geometry(num_splits, total_tokens, max_len, window, num_kv_heads, block_n, device, waves) -> tuple[int, int]:
    """(split_tokens, num_splits) of a launch: a fixed count gives (0, count), else fixed tokens per split."""
    if num_splits is not None:
        return 0, num_splits
    cols = max_len if window is None else min(max_len, window + block_n - 1)  # longest range a sequence walks
    tokens = choose_split_tokens(total_tokens, cols, num_kv_heads, block_n, device, waves)
    return tokens, -(-cols // tokens)


def _decode_triton(q, k_cache, v_cache, block_tables, seq_lens, geo, opts, k_scale, v_scale, splits, sizes):
    """Launch the split kernel (and the merge kernel for several splits); returns (out, lse).

    ``splits`` is a fixed split count or None (tokens per split from ``sizes`` = (total attended
    tokens, max_len), host ints).
    """
    num_seqs, num_q_heads, head_dim = q.shape
    scale, window, soft_cap = opts
    group = num_q_heads // geo.num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    dtype = dot_dtype(q, k_cache)
    tile = _decode_launch(d_pad, k_cache.element_size(), dtype, q.device)  # one table lookup per launch
    block_n, num_warps, num_stages, waves = tile["BLOCK_N"], tile["num_warps"], tile["num_stages"], tile["waves"]
    split_tokens, num_splits = _split_geometry(splits, *sizes, window, geo.num_kv_heads, block_n, q.device, waves)
    out, lse, part, part_lse = split_outputs(q, num_splits)
    qk_a, qk_b = logit_coefficients(scale, soft_cap)
    cache_pointers, cache_strides = cache_arguments(k_cache, v_cache, k_scale, v_scale)
    _decode_split_kernel[(num_seqs, geo.num_kv_heads, num_splits)](
        q, *cache_pointers, block_tables, seq_lens, part, part_lse,
        *q.stride(), *cache_strides, *block_tables.stride(), *part.stride(), *part_lse.stride(),
        qk_a, qk_b, window or 0, split_tokens, num_splits,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=geo.block_size, BLOCK_N=block_n, DTYPE=dtype,
        QUANTIZED=geo.quantized, SOFT_CAP=soft_cap is not None, WINDOW=window is not None,
        PRECISION=dot_precision(q, k_cache), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return merge_splits(out, lse, part, part_lse, d_pad)


def _decode_torch(q, k_cache, v_cache, block_tables, seq_lens, opts, k_scale, v_scale, lens, need_lse):
    """Batched torch path over groups of sequences whose dense K fits in TORCH_CHUNK_BYTES; returns (out, lse).

    ``lens`` is the batch's (min_len, max_len) as host ints: this path reads no device value, so a
    caller that knows them (the engine's prepared path) runs it without a device sync. Sequences
    are independent, so groups need no merging; bounded groups keep the gathered buffers small.
    """
    per_seq = _columns(lens[1], opts[1]) * k_cache.shape[2] * k_cache.shape[3] * 4  # float32 bytes of dense K
    step = max(1, TORCH_CHUNK_BYTES // per_seq)
    args = (opts, k_scale, v_scale, lens, need_lse)
    if step >= q.shape[0]:
        return _decode_torch_group(q, k_cache, v_cache, block_tables, seq_lens, *args)
    parts = [
        _decode_torch_group(
            q[i : i + step], k_cache, v_cache, block_tables[i : i + step], seq_lens[i : i + step], *args
        )
        for i in range(0, q.shape[0], step)
    ]
    return torch.cat([o for o, _ in parts]), None if not need_lse else torch.cat([lse for _, lse in parts])


def _columns(max_len: int, window: int | None) -> int:
    """Keys the torch path lays out per sequence: its last ``window`` positions at most."""
    return max_len if window is None else min(max_len, window)


def _decode_torch_group(q, k_cache, v_cache, block_tables, seq_lens, opts, k_scale, v_scale, lens, need_lse):
    """Attend positions ``[kv_start, kv_start + L)`` of each sequence, masked past its length; returns (out, lse)."""
    scale, window, soft_cap = opts
    group = q.shape[1] // k_cache.shape[2]
    layout = _decode_layout(block_tables, seq_lens, window, lens, k_cache.shape[1], k_cache.shape[2], group)
    out, lse = decode_attention(
        q, k_cache, v_cache, k_scale, v_scale, layout, scale=scale, soft_cap=soft_cap, need_lse=need_lse
    )
    return out.to(q.dtype), lse


def _decode_layout(block_tables, seq_lens, window, lens, block_size, num_kv_heads, group) -> DecodeLayout:
    """The batch's :class:`DecodeLayout`: columns ``[kv_start, kv_start + L)``, masked where a sequence is shorter."""
    length = _columns(lens[1], window)
    kv_start = window_start(seq_lens, window)
    slots, inside = token_slots(block_tables, seq_lens, kv_start, length, block_size, from_start=True)
    all_visible = _columns(lens[0], window) == length  # every sequence sees all L columns
    return decode_layout(slots, None if all_visible else inside, num_kv_heads, group)


def _validate_decode(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, scale, window, cap, splits):
    """Every check of the decode contract, with one host sync; returns (geometry, options, (min_len, max_len, total)).

    total: the KV positions the batch attends (sum of window-limited lengths), which sizes the splits.
    """
    geo = check_cache(q, k_cache, v_cache, k_scale, v_scale)
    opts = check_options(geo.head_dim, scale, window, cap)
    check_tables(block_tables, seq_lens, q.shape[0], q.device)
    if splits is not None:
        check_int("num_splits", splits, low=1, high=MAX_SPLITS)
    if q.shape[0] == 0:
        return geo, opts, (0, 0, 0)
    kv_start = window_start(seq_lens, opts[1])
    bounds = block_id_bounds(block_tables, seq_lens, kv_start, geo.block_size)
    total = (seq_lens.long() - kv_start).sum()
    stats = torch.stack([seq_lens.min().long(), seq_lens.max().long(), total, *bounds]).tolist()
    lo_len, hi_len, total, lo_blk, hi_blk = stats
    capacity = block_tables.shape[1] * geo.block_size
    if lo_len < 1 or hi_len > capacity:
        bad = lo_len if lo_len < 1 else hi_len
        raise OutOfRangeError(describe("seq_lens", bad, f"lengths in [1, {capacity}] (max_blocks * block_size)"))
    check_block_ids(lo_blk, hi_blk, geo.num_blocks)
    return geo, opts, (lo_len, hi_len, total)


def _bind(q, k_cache, v_cache, k_scale, v_scale, tables, lens, geo, opts, splits, sizes, need_lse, run_triton):
    """The launch of a checked decode call, bound to everything but its layer's q and caches.

    ``sizes`` are the host ints the chosen path takes, (total attended tokens, max_len) for Triton
    and (min_len, max_len) for torch: nothing is read back when it runs.
    """

    def run(q, k_cache, v_cache, k_scale=None, v_scale=None):
        if q.shape[0] == 0:
            out, lse = torch.empty_like(q), torch.empty(0, q.shape[1], device=q.device, dtype=torch.float32)
        elif run_triton:
            out, lse = _decode_triton(q, k_cache, v_cache, tables, lens, geo, opts, k_scale, v_scale, splits, sizes)
        else:
            out, lse = _decode_torch(q, k_cache, v_cache, tables, lens, opts, k_scale, v_scale, sizes, need_lse)
        return (out, lse) if need_lse else out

    return BoundCall(run, q, k_cache, v_cache, k_scale, v_scale)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    backend: Backend = "auto",
):
    """Attention of one query token per sequence over its paged KV: q ``[S, Hq, D]`` -> out ``[S, Hq, D]`` (q's dtype).

    Query head h uses KV head ``h // (Hq // Hkv)``; the query sits at position seq_len - 1 and sees
    positions ``[seq_len - sliding_window, seq_len)`` (all when None). Logits are ``scale * q.k``
    (default 1/sqrt(D)), soft-capped to ``soft_cap * tanh(logit / soft_cap)`` when given. With
    ``return_lse`` also returns the float32 natural-log logsumexp ``[S, Hq]`` of the (capped) logits.
    ``num_splits`` fixes flash-decoding's KV split count, each sequence's range divided in that many
    equal parts (None: splits of a fixed token count chosen from the batch's total tokens and the SMs).
    ``backend="torch"`` is the torch reference (the batched CPU path).
    """
    check_bool("return_lse", return_lse)
    geo, opts, (lo, hi, total) = _validate_decode(
        q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, scale, sliding_window, soft_cap, num_splits
    )
    args = (q, k_cache, v_cache, k_scale, v_scale)
    run_triton = launches_triton(backend, q, k_cache, v_cache, block_tables, seq_lens)
    sizes = (total, hi) if run_triton else (lo, hi)
    return _bind(*args, block_tables, seq_lens, geo, opts, num_splits, sizes, return_lse, run_triton).run(*args)


def bind_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
    scale: float | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None, soft_cap: float | None = None, num_splits: int | None = None,
    return_lse: bool = False, backend: Backend = "auto",
) -> BoundCall:  # fmt: skip
    """The checks of :func:`paged_decode_attention_prepared` done once: a BoundCall run per layer."""
    check_bool("return_lse", return_lse)
    geo = check_cache(q, k_cache, v_cache, k_scale, v_scale)
    opts = check_options(geo.head_dim, scale, sliding_window, soft_cap)
    check_metadata(meta, AttentionMetadata, device=q.device, num_blocks=geo.num_blocks, block_size=geo.block_size)
    if not meta.is_decode:
        raise InvalidArgumentError(describe("meta.max_query_len", meta.max_query_len, "1 (a decode step)"))
    if q.shape[0] != meta.num_seqs:
        raise InvalidArgumentError(describe("q.shape[0]", q.shape[0], f"meta.num_seqs={meta.num_seqs}"))
    if num_splits is not None:
        check_int("num_splits", num_splits, low=1, high=MAX_SPLITS)
    splits = num_splits if num_splits is not None else meta.decode_num_splits
    run_triton = launches_triton(backend, q, k_cache, v_cache, meta.block_tables, meta.seq_lens)
    args = (q, k_cache, v_cache, k_scale, v_scale, meta.block_tables, meta.seq_lens, geo, opts, splits)
    return _bind(*args, _host_sizes(meta, opts[1], run_triton), return_lse, run_triton)


def paged_decode_attention_prepared(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
    scale: float | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None, soft_cap: float | None = None, num_splits: int | None = None,
    return_lse: bool = False, backend: Backend = "auto",
):  # fmt: skip
    """:func:`paged_decode_attention` over a prepared step: host checks only, no device value read.

    q ``[S, Hq, D]`` -> out ``[S, Hq, D]`` (and lse ``[S, Hq]`` with ``return_lse``); block ids and
    lengths were validated when ``meta`` was prepared. The split geometry comes from host values:
    ``num_splits``, else the count fixed in ``meta.decode_num_splits`` (CUDA-graph capture), else
    its host lengths.
    """
    bound = bind_decode_attention(
        q, k_cache, v_cache, meta, scale=scale, k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, num_splits=num_splits, return_lse=return_lse, backend=backend,
    )  # fmt: skip
    return bound.run(q, k_cache, v_cache, k_scale, v_scale)


def _host_sizes(meta: AttentionMetadata, window: int | None, triton: bool) -> tuple[int, int]:
    """The sizes a decode path takes from host lengths: Triton (attended KV positions, max_len), torch (min, max)."""
    if not triton:
        return meta.min_seq_len, meta.max_seq_len
    lens = meta.host_seq_lens if window is None else np.minimum(meta.host_seq_lens, window)
    return int(lens.sum()), meta.max_seq_len

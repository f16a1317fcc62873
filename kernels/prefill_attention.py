"""Paged prefill / extend attention over packed variable-length queries.

q is packed ``[total_q, Hq, D]`` with ``cu_seqlens_q [num_seqs + 1]``; query j of sequence s
sits at absolute position ``seq_lens[s] - q_len_s + j`` (its KV, like the cached prefix's,
is already in the cache). Attention is causal within the new tokens and full over the
cached prefix, optionally limited to a sliding window. Decode is the case q_len = 1.

The Triton kernel is tiled over (query tile, kv head, sequence): one program packs
``BLOCK_M // GROUP`` query tokens times the GROUP query heads of one KV head into the
rows of its tile, so the K/V it reads through the block table serve every head of the group.
It walks its KV range in two phases: the tiles wholly at or below the tile's first query
position, which every row sees (no mask is built), then the diagonal tiles, masked causally.
Host checks (:mod:`kernels.checks`), Triton tile steps and the dense torch core (``kernels.attention_*``)
are shared with decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_torch import dense_attention, gather_kv
from kernels.attention_triton import (
    cache_arguments,
    dot_dtype,
    dot_precision,
    finish_softmax,
    kv_tile,
    logit_coefficients,
    paged_qk,
    scaled_logits,
    softmax_step,
)
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
from kernels.tile_configs import tile_key, tuned_values
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, check_bool, describe
from paged_kv.tensor_checks import INDEX_DTYPES, check_tensor

MAX_LOGITS = 1 << 25  # float32 elements of one reference logits chunk (128 MiB)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, cu_ptr, out_ptr, lse_ptr,
    sq_t, sq_h, sq_d,
    sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d,
    sks_b, sks_t, sks_h, svs_b, svs_t, svs_h,
    sbt_s, sbt_b, so_t, so_h, so_d, sl_t, sl_h,
    qk_a, qk_b, window,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
    QUANTIZED: tl.constexpr, SOFT_CAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (query tile, kv head, seq): rows are (token, head-in-group) pairs, TOKENS tokens per tile."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_ptr + seq + 1) - q_start).to(tl.int32)
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    ctx = seq_len - q_len  # cached prefix length
    tok0 = tile * TOKENS

    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    tok = tok0 + rows // GROUP  # [BLOCK_M] token index within the sequence
    heads = kvh * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < q_len)
    q_pos = ctx + tok  # absolute positions of the rows' queries
    q_offs = (q_start + tok.to(tl.int64))[:, None] * sq_t + heads[:, None] * sq_h + offs_d[None, :] * sq_d
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_mask[None, :], other=0.0).to(DTYPE)

    kv_lo = 0
    if WINDOW:
        kv_lo = tl.maximum(ctx + tok0 - window + 1, 0)
    kv_hi = ctx + tl.minimum(tok0 + TOKENS, q_len)  # one past the tile's last query position
    kv_hi = tl.where(tok0 < q_len, kv_hi, kv_lo)  # tiles past q_len do no work
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    first = (kv_lo // BLOCK_N) * BLOCK_N
    full_end = first
    if not WINDOW:  # tiles wholly at or below the tile's first query position need no mask
        full_end = tl.minimum(((ctx + tok0 + 1) // BLOCK_N) * BLOCK_N, kv_hi)
    for phase in tl.static_range(2):  # 0: unmasked full tiles [first, full_end); 1: the masked rest
        lo = full_end
        hi = kv_hi
        if phase == 0:
            lo = first
            hi = full_end
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n  # [BLOCK_N]
            if phase == 0:
                valid = offs_n < BLOCK_N  # every position is visible to every row
            else:
                valid = (pos >= kv_lo) & (pos < kv_hi)
            s, blk, slot, vs = paged_qk(
                q, bt_ptr + seq * sbt_s, pos, valid, kvh, offs_d, d_mask, k_ptr, ks_ptr, vs_ptr,
                sbt_b, sk_b, sk_t, sk_h, sk_d,
                sks_b, sks_t, sks_h, svs_b, svs_t, svs_h, BLOCK_SIZE, DTYPE, QUANTIZED, PRECISION,
            )  # [BLOCK_M, BLOCK_N]
            s = scaled_logits(s, qk_a, qk_b, SOFT_CAP)
            if phase == 1:
                allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
                if WINDOW:
                    allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
                s = tl.where(allowed, s, float("-inf"))
            v = kv_tile(v_ptr, blk, slot, kvh, offs_d, valid, d_mask, sv_b, sv_t, sv_h, sv_d, DTYPE)
            m_i, l_i, acc = softmax_step(s, v, vs, m_i, l_i, acc, QUANTIZED, PRECISION)

    out, lse = finish_softmax(m_i, l_i, acc)
    row_t = q_start + tok.to(tl.int64)
    o_offs = row_t[:, None] * so_t + heads[:, None] * so_h + offs_d[None, :] * so_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
    tl.store(lse_ptr + row_t * sl_t + heads * sl_h, lse, mask=row_ok)


def prefill_tile(
    d_pad: int, group: int, dtype: tl.dtype, precision: str, device: torch.device | None = None
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel; BLOCK_M holds one token's GROUP heads.

    A tuned entry for ``device`` (:mod:`kernels.tile_configs`) wins over the heuristic, chosen so
    sm80/sm90 builds do not spill registers: 16-bit dots (``dtype``, :func:`dot_dtype`) take the
    flash-attention tile 128 x 64 over 8 warps; float32 operands hold twice the registers (and
    'ieee' dots run on FMA units), so they get smaller query tiles.
    """
    if dtype != tl.float32:
        block_m, block_n, num_warps, num_stages = (128, 64, 8, 3) if d_pad <= 128 else (64, 32, 8, 2)
    elif precision == "ieee":  # float32 operands: a pipelined stage of code tiles would spill
        block_m, block_n, num_warps, num_stages = (16, 16, 8, 1) if d_pad <= 128 else (16, 16, 4, 1)
    else:  # tf32 (d 128): 64 x 64 and 64 x 32 over 8 warps, 32 x 64 over 4 or 8 spill with some Triton in 3.6-3.9
        block_m, block_n, num_warps, num_stages = (32, 32, 4, 1) if d_pad <= 128 else (32, 32, 8, 1)
    defaults = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}
    t = tuned_values(prefill_tile_key(d_pad, group, dtype), device, defaults)
    return max(t["BLOCK_M"], triton.next_power_of_2(group)), t["BLOCK_N"], t["num_warps"], t["num_stages"]


def prefill_tile_key(d_pad: int, group: int, dtype: tl.dtype) -> str:
    """The tile table key of a prefill launch (see :mod:`kernels.tile_configs`)."""
    return tile_key("prefill", f"d{d_pad}", f"g{group}", dtype)


def _prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens, geo, opts, k_scale, v_scale, max_q):
    """Launch the prefill kernel; returns (out ``[T, Hq, D]``, lse ``[T, Hq]``)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    scale, window, soft_cap = opts
    group = num_q_heads // geo.num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    precision, dtype = dot_precision(q, k_cache), dot_dtype(q, k_cache)
    block_m, block_n, num_warps, num_stages = prefill_tile(d_pad, group, dtype, precision, q.device)
    tokens = block_m // group
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], num_q_heads, device=q.device, dtype=torch.float32)
    qk_a, qk_b = logit_coefficients(scale, soft_cap)
    grid = (triton.cdiv(max_q, tokens), geo.num_kv_heads, seq_lens.shape[0])
    cache_pointers, cache_strides = cache_arguments(k_cache, v_cache, k_scale, v_scale)
    _prefill_kernel[grid](
        q, *cache_pointers, block_tables, seq_lens, cu_seqlens, out, lse,
        *q.stride(), *cache_strides, *block_tables.stride(), *out.stride(), *lse.stride(),
        qk_a, qk_b, window or 0,
        GROUP=group, TOKENS=tokens, BLOCK_M=block_m, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=geo.block_size, BLOCK_N=block_n, DTYPE=dtype,
        QUANTIZED=geo.quantized, SOFT_CAP=soft_cap is not None, WINDOW=window is not None,
        PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out, lse


def _prefill_torch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens, opts, k_scale, v_scale, sizes, need_lse):
    """Batched torch path: pad queries to ``[S, max_q]``, gather dense K/V, attend in query chunks.

    Chunk c..c+n only needs keys below max_ctx + c + n (causal), so it attends that prefix of the
    gathered K/V: a view whose (Hkv, S) batch still collapses for bmm, no copy. ``sizes`` are host
    ints and no device value is read here (packed rows are found by index, not by boolean mask).
    """
    scale, window, soft_cap = opts
    max_q, max_len, max_ctx = sizes
    q_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [S]
    steps = torch.arange(max_q, device=q.device)
    valid_q = steps[None, :] < q_lens[:, None]  # [S, max_q]
    q_pad = q[torch.where(valid_q, cu_seqlens[:-1, None].long() + steps, 0)].float()  # [S, max_q, Hq, D]
    q_pos = seq_lens.long()[:, None] - q_lens[:, None] + steps[None, :]  # [S, max_q]
    kv_start = window_start(seq_lens, window, q_lens)
    k = gather_kv(k_cache, k_scale, block_tables, seq_lens, kv_start, max_len, "k")  # [Hkv, S, L, D]
    v = gather_kv(v_cache, v_scale, block_tables, seq_lens, kv_start, max_len, "v")
    chunk = max(1, MAX_LOGITS // max(1, q.shape[1] * max_len * seq_lens.shape[0]))
    outs, lses = [], []
    for c in range(0, max_q, chunk):
        keys = min(k.shape[2], max_ctx + c + chunk)
        out, lse = dense_attention(
            q_pad[:, c : c + chunk], k[:, :, :keys], v[:, :, :keys], q_pos[:, c : c + chunk], seq_lens,
            scale=scale, sliding_window=window, soft_cap=soft_cap, need_lse=need_lse,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)
    seq_of_row, step_of_row = _packed_rows(cu_seqlens, q_lens, q.shape[0])
    out = torch.cat(outs, 1)[seq_of_row, step_of_row].to(q.dtype)  # [T, Hq, D]
    return out, torch.cat(lses, 1)[seq_of_row, step_of_row] if need_lse else None  # lse: [T, Hq]


def _packed_rows(cu_seqlens, q_lens, total_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, step) ``[T]`` of each packed query row; ``total_q`` (host) sizes the result without a sync."""
    seqs = torch.arange(q_lens.shape[0], device=q_lens.device)
    seq_of_row = torch.repeat_interleave(seqs, q_lens, output_size=total_q)  # [T]
    return seq_of_row, torch.arange(total_q, device=q_lens.device) - cu_seqlens[seq_of_row].long()


def _check_cu_seqlens(cu_seqlens, device: torch.device) -> int:
    """Validate the dtype and rank of cu_seqlens_q; return num_seqs."""
    check_tensor("cu_seqlens_q", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if cu_seqlens.shape[0] < 1:
        raise InvalidArgumentError(describe("cu_seqlens_q.shape", tuple(cu_seqlens.shape), "at least 1 entry"))
    return cu_seqlens.shape[0] - 1


def _check_values(stats: list[int], total_q: int, capacity: int, num_blocks: int) -> None:
    """Check the synced values: cu_seqlens monotone from 0 to total_q, q_len <= seq_len <= capacity, block ids."""
    cu_first, cu_last, min_q_len, min_ctx, max_len, _, _, lo_blk, hi_blk = stats
    if cu_first != 0 or cu_last != total_q or min_q_len < 0:
        got = f"first={cu_first}, last={cu_last}, min step={min_q_len}"
        raise InvalidArgumentError(describe("cu_seqlens_q", got, f"non-decreasing from 0 to total_q={total_q}"))
    if min_ctx < 0:
        raise OutOfRangeError(describe("seq_lens - q_lens", min_ctx, "values >= 0 (seq_lens include new tokens)"))
    if max_len > capacity:
        raise OutOfRangeError(describe("seq_lens", max_len, f"lengths <= {capacity} (max_blocks * block_size)"))
    check_block_ids(lo_blk, hi_blk, num_blocks)


def _validate_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens, k_scale, v_scale, options):
    """Every check of the prefill contract, with one host sync; returns (geometry, options, sizes).

    sizes = (max_q, max_len, max_ctx): longest new-token run, longest sequence, longest cached prefix.
    """
    geo = check_cache(q, k_cache, v_cache, k_scale, v_scale)
    opts = check_options(geo.head_dim, *options)
    num_seqs = _check_cu_seqlens(cu_seqlens, q.device)
    check_tables(block_tables, seq_lens, num_seqs, q.device)
    if num_seqs == 0:
        if q.shape[0] != 0:
            raise InvalidArgumentError(describe("q.shape[0]", q.shape[0], "0 for an empty batch"))
        return geo, opts, (0, 0, 0)
    q_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ctx = seq_lens.long() - q_lens
    bounds = block_id_bounds(block_tables, seq_lens, window_start(seq_lens, opts[1], q_lens), geo.block_size)
    ends = [cu_seqlens[0].long(), cu_seqlens[-1].long(), q_lens.min(), ctx.min(), seq_lens.max().long()]
    ends += [q_lens.max(), ctx.max()]
    stats = torch.stack([*ends, *bounds]).tolist()
    _check_values(stats, q.shape[0], block_tables.shape[1] * geo.block_size, geo.num_blocks)
    return geo, opts, (stats[5], stats[4], stats[6])  # (max_q, max_len, max_ctx)


def _bind(q, k_cache, v_cache, k_scale, v_scale, tables, lens, cu, geo, opts, sizes, need_lse, backend) -> BoundCall:
    """The launch of a checked prefill call, bound to everything but its layer's q and caches.

    ``sizes`` are host ints (max_q, max_len, max_ctx): nothing is read back when it runs.
    """
    run_triton = launches_triton(backend, q, k_cache, v_cache, tables, lens, cu)

    def run(q, k_cache, v_cache, k_scale=None, v_scale=None):
        args = (q, k_cache, v_cache, tables, lens, cu)
        if q.shape[0] == 0:
            out, lse = torch.empty_like(q), torch.empty(0, q.shape[1], device=q.device, dtype=torch.float32)
        elif run_triton:
            out, lse = _prefill_triton(*args, geo, opts, k_scale, v_scale, sizes[0])
        else:
            out, lse = _prefill_torch(*args, opts, k_scale, v_scale, sizes, need_lse)
        return (out, lse) if need_lse else out

    return BoundCall(run, q, k_cache, v_cache, k_scale, v_scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    return_lse: bool = False,
    backend: Backend = "auto",
):
    """Causal attention of packed new tokens over their paged KV: q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` (q's dtype).

    Query j of sequence s (rows ``cu_seqlens_q[s] + j``) sits at position ``p = seq_lens[s] - q_len_s + j``
    and sees positions ``(p - sliding_window, p]`` (``[0, p]`` when None); scale, soft_cap and GQA as in
    :func:`kernels.decode_attention.paged_decode_attention`. With ``return_lse`` also returns the
    float32 natural-log logsumexp ``[T, Hq]``. ``backend="torch"`` is the torch reference.
    """
    check_bool("return_lse", return_lse)
    options = (scale, sliding_window, soft_cap)
    geo, opts, sizes = _validate_prefill(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, k_scale, v_scale, options
    )
    args = (q, k_cache, v_cache, k_scale, v_scale)
    return _bind(*args, block_tables, seq_lens, cu_seqlens_q, geo, opts, sizes, return_lse, backend).run(*args)


def bind_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
    scale: float | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None, soft_cap: float | None = None, backend: Backend = "auto",
) -> BoundCall:  # fmt: skip
    """The checks of :func:`paged_prefill_attention_prepared` done once: a BoundCall run per layer."""
    geo = check_cache(q, k_cache, v_cache, k_scale, v_scale)
    opts = check_options(geo.head_dim, scale, sliding_window, soft_cap)
    check_metadata(meta, AttentionMetadata, device=q.device, num_blocks=geo.num_blocks, block_size=geo.block_size)
    if q.shape[0] != meta.num_tokens:
        raise InvalidArgumentError(describe("q.shape[0]", q.shape[0], f"meta.num_tokens={meta.num_tokens}"))
    sizes = (meta.max_query_len, meta.max_seq_len, meta.max_context_len)
    tensors = (meta.block_tables, meta.seq_lens, meta.cu_seqlens_q)
    return _bind(q, k_cache, v_cache, k_scale, v_scale, *tensors, geo, opts, sizes, False, backend)


def paged_prefill_attention_prepared(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
    scale: float | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None, soft_cap: float | None = None, backend: Backend = "auto",
) -> torch.Tensor:  # fmt: skip
    """:func:`paged_prefill_attention` over a prepared step: host checks only, no device value read.

    q ``[T, Hq, D]`` (the step's new tokens, packed as ``meta.cu_seqlens_q``) -> out ``[T, Hq, D]``.
    """
    bound = bind_prefill_attention(
        q, k_cache, v_cache, meta, scale=scale, k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, backend=backend,
    )  # fmt: skip
    return bound.run(q, k_cache, v_cache, k_scale, v_scale)

"""Paged decode attention: one query token per sequence, K/V read through block tables.

Layout (per layer): K and V caches ``[num_blocks, block_size, num_kv_heads, head_dim]``;
quantized caches (int8 / fp8) carry float32 scales ``[num_blocks, block_size,
num_kv_heads]`` and dequantize as ``stored.float() * scale``. Block tables
``[num_seqs, max_blocks]`` map logical block i of sequence s to a physical block;
entries past what ``seq_lens`` needs are padding and are never read.

The Triton path is flash-decoding: grid (sequence, kv head, split); each program
handles all query heads of one KV head (so each K/V byte is read once), walks its
share of the KV range with an online softmax and writes a partial output + lse;
a second small kernel merges the splits. The torch reference has the same contract
and is the CPU engine's path. Validation and the dense reference core defined here
are shared with :mod:`kernels.prefill_attention`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._checks import CACHE_DTYPES, FLOAT_DTYPES, QUANT_DTYPES, Backend, check_shape, check_tensor, use_triton
from kernels.quant import as_storage
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, check_int, describe

LOG2E = 1.4426950408889634
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256
MAX_SPLITS = 128
MIN_TOKENS_PER_SPLIT = 256


@dataclass(frozen=True)
class CacheGeometry:
    """Sizes of a validated paged KV cache ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    quantized: bool


# ----------------------------------------------------------------------------- validation


def check_cache(q, k_cache, v_cache, k_scale, v_scale) -> CacheGeometry:
    """Validate q ``[N, Hq, D]``, the K/V caches and their scales; return the cache geometry."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES, device=q.device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=q.device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if num_blocks < 1 or block_size < 1 or num_kv_heads < 1 or not 1 <= head_dim <= MAX_HEAD_DIM:
        raise InvalidArgumentError(
            describe("k_cache.shape", tuple(k_cache.shape), f"non-empty, head_dim <= {MAX_HEAD_DIM}")
        )
    if q.shape[2] != head_dim:
        raise InvalidArgumentError(describe("q.shape[2]", q.shape[2], f"head_dim {head_dim} of the cache"))
    if q.shape[1] % num_kv_heads != 0 or q.shape[1] == 0:
        raise InvalidArgumentError(describe("q.shape[1]", q.shape[1], f"a positive multiple of {num_kv_heads}"))
    quantized = k_cache.dtype in QUANT_DTYPES
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not quantized:
            if scale is not None:
                raise InvalidArgumentError(describe(name, "a tensor", f"None for a {k_cache.dtype} cache"))
            continue
        check_tensor(name, scale, ndim=3, dtypes=(torch.float32,), device=q.device)
        check_shape(name, scale, (num_blocks, block_size, num_kv_heads))
    return CacheGeometry(
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        quantized=quantized,
    )


def _check_real(name: str, value: object, *, positive: bool) -> float:
    """Return ``value`` as a finite float (> 0 when ``positive``) or raise InvalidArgumentError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(describe(name, value, "a finite real number"))
    if positive and value <= 0:
        raise InvalidArgumentError(describe(name, value, "a number > 0"))
    return float(value)


def check_options(head_dim: int, scale, sliding_window, soft_cap) -> tuple[float, int | None, float | None]:
    """Validate the attention options; resolve ``scale=None`` to ``1/sqrt(head_dim)``."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _check_real("scale", scale, positive=False)
    if sliding_window is not None:
        sliding_window = check_int("sliding_window", sliding_window, low=1)
    if soft_cap is not None:
        soft_cap = _check_real("soft_cap", soft_cap, positive=True)
    return scale, sliding_window, soft_cap


def check_tables(block_tables, seq_lens, num_seqs: int, device: torch.device) -> None:
    """Validate the dtypes and shapes of block_tables ``[num_seqs, max_blocks]`` and seq_lens ``[num_seqs]``."""
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    if block_tables.shape[0] != num_seqs:
        raise InvalidArgumentError(describe("block_tables.shape[0]", block_tables.shape[0], f"num_seqs={num_seqs}"))


def check_triton_device(t: torch.Tensor) -> None:
    """Triton needs CUDA tensors, or the interpreter (TRITON_INTERPRET=1) for CPU tensors."""
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidArgumentError(describe("backend", "triton", "CUDA tensors (or TRITON_INTERPRET=1 on CPU)"))


def block_id_bounds(block_tables, seq_lens, kv_start, block_size: int) -> list[torch.Tensor]:
    """Device scalars [min, max] of the block ids covering positions [kv_start, seq_len) (no sync).

    With no block in use the pair is (int64 max, -1), which every range check accepts.
    """
    big = torch.iinfo(torch.int64).max
    if block_tables.numel() == 0:
        return [torch.tensor(big, device=block_tables.device), torch.tensor(-1, device=block_tables.device)]
    logical = torch.arange(block_tables.shape[1], device=block_tables.device)  # [max_blocks]
    first = (kv_start // block_size)[:, None]
    last = ((seq_lens - 1).div(block_size, rounding_mode="floor"))[:, None]
    used = (logical[None, :] >= first) & (logical[None, :] <= last)  # [S, max_blocks]
    ids = block_tables.long()
    return [torch.where(used, ids, big).min(), torch.where(used, ids, -1).max()]


def check_block_ids(lo: int, hi: int, num_blocks: int) -> None:
    """Raise OutOfRangeError unless every block id in use lies in ``[0, num_blocks)``."""
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise OutOfRangeError(describe("block_tables", bad, f"block ids in [0, {num_blocks}) where used"))


def window_start(seq_lens: torch.Tensor, sliding_window: int | None, q_lens: torch.Tensor | None = None):
    """First KV position any query of each sequence attends to: ``[S]`` int64."""
    lens = seq_lens.long()
    if sliding_window is None:
        return torch.zeros_like(lens)
    first_q = lens - 1 if q_lens is None else lens - q_lens.long()
    return (first_q - sliding_window + 1).clamp(min=0)


# ----------------------------------------------------------------------------- torch reference core


def gather_kv(cache, scale, block_tables, seq_lens, kv_start, max_len: int) -> torch.Tensor:
    """Dense float32 ``[Hkv, S, L, D]`` (L = max_len rounded up to whole blocks) of the cache through block tables.

    Table entries covering no position of ``[kv_start, seq_len)`` are never read, and positions
    outside that range are 0: stale slots may hold NaN, and 0 * NaN is NaN.
    """
    num_seqs, block_size = block_tables.shape[0], cache.shape[1]
    num_logical = -(-max_len // block_size)
    pos = torch.arange(num_logical * block_size, device=cache.device)  # [L]
    valid = (pos[None, :] >= kv_start[:, None]) & (pos[None, :] < seq_lens[:, None].long())  # [S, L]
    in_use = valid.view(num_seqs, num_logical, block_size).any(-1)  # [S, num_logical]
    ids = torch.where(in_use, block_tables[:, :num_logical].long(), 0)  # padding entries never read
    # One row gather straight into head-major [Hkv, S, L, D]: its (Hkv, S) batch collapses for bmm.
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    heads = torch.arange(num_kv_heads, device=ids.device)[:, None]
    slots = (ids[:, :, None] * block_size + torch.arange(block_size, device=ids.device)).flatten()  # [S*L]
    rows = (slots[None] * num_kv_heads + heads).flatten()  # [Hkv*S*L] rows of the [N*bs*Hkv, D] cache
    x = as_storage(cache).reshape(-1, head_dim).index_select(0, rows).view(cache.dtype)  # [Hkv*S*L, D]
    x = x.to(torch.float32)  # a fresh tensor either way: safe to modify in place
    if scale is not None:
        x.mul_(scale.reshape(-1).index_select(0, rows)[:, None])
    bad = (~valid).flatten().nonzero().squeeze(1)  # [n_bad] invalid (s, l) of each head
    x.index_fill_(0, (heads * valid.numel() + bad[None]).flatten(), 0.0)
    return x.view(num_kv_heads, num_seqs, -1, head_dim)


def _visible(q_pos, seq_lens, length: int, sliding_window: int | None) -> torch.Tensor:
    """Mask ``[S, M, L]``: key l is visible to query m when l <= pos, l < seq_len and inside the window."""
    kpos = torch.arange(length, device=q_pos.device)[None, None, :]
    visible = (kpos <= q_pos[:, :, None]) & (kpos < seq_lens[:, None, None].long())
    if sliding_window is not None:
        visible &= kpos > q_pos[:, :, None] - sliding_window
    return visible


def dense_attention(q, k, v, q_pos, seq_lens, *, scale, sliding_window, soft_cap, need_lse=True):
    """Masked float32 softmax attention: q ``[S, M, Hq, D]`` at positions q_pos ``[S, M]``, k/v ``[Hkv, S, L, D]``.

    Returns (out ``[S, M, Hq, D]``, lse ``[S, M, Hq]`` or None when not ``need_lse``), float32. Without
    soft cap and lse it runs torch SDPA with the mask; otherwise explicit matmuls, where rows with no
    visible key give 0 and -inf. K and V must be finite (gather_kv zeroes stale positions).
    """
    num_seqs, m, num_q_heads, head_dim = q.shape
    num_kv_heads, length = k.shape[0], k.shape[2]
    group = num_q_heads // num_kv_heads
    visible = _visible(q_pos, seq_lens, length, sliding_window)  # [S, M, L]
    if soft_cap is None and not need_lse:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible[:, None], scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        return out.transpose(1, 2), None  # [S, M, Hq, D]
    qh = q.reshape(num_seqs, m, num_kv_heads, group, head_dim).permute(2, 0, 3, 1, 4)  # [Hkv, S, G, M, D]
    qh = qh.reshape(num_kv_heads, num_seqs, group * m, head_dim)
    logits = torch.matmul(qh, k.transpose(-1, -2)).mul_(scale)  # [Hkv, S, G*M, L]
    if soft_cap is not None:
        logits.div_(soft_cap).tanh_().mul_(soft_cap)
    logits = logits.view(num_kv_heads, num_seqs, group, m, length)
    logits.masked_fill_(~visible[None, :, None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [Hkv, S, G, M]
    probs = logits.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_()
    out = torch.matmul(probs.view(num_kv_heads, num_seqs, group * m, length), v)  # [Hkv, S, G*M, D]
    out = out.view(num_kv_heads, num_seqs, group, m, head_dim).permute(1, 3, 0, 2, 4)  # [S, M, Hkv, G, D]
    lse = lse.permute(1, 3, 0, 2).reshape(num_seqs, m, num_q_heads)
    return out.reshape(num_seqs, m, num_q_heads, head_dim), lse


# ----------------------------------------------------------------------------- Triton building blocks


@triton.jit
def _tanh(x):
    """tanh through exp2 (no libdevice): 1 - 2 / (exp(2x) + 1); saturates cleanly at +-1."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _scaled_logits(s, qk_a, qk_b, SOFT_CAP: tl.constexpr):
    """Raw q.k products -> logits in log2 units: s*a, or tanh(s*a)*b with a soft cap."""
    if SOFT_CAP:
        s = _tanh(s * qk_a) * qk_b
    else:
        s = s * qk_a
    return s


@triton.jit
def _e4m3_bits_to_f32(codes):
    """float8_e4m3fn codes read as uint8 -> float32 by moving bits into a float16 (exact, any GPU arch).

    The fp16 with sign | exponent-mantissa << 7 equals the e4m3 value / 256, subnormals included;
    the NaN codes (0x7F, 0xFF) decode as +-480.
    """
    bits = codes.to(tl.int32)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * 256.0


@triton.jit
def _kv_tile(ptr, blk, slot, head, offs_d, valid, d_mask, stride_b, stride_t, stride_h, stride_d):
    """Load ``[BLOCK_N, D_PAD]`` K or V rows of one head as float32; masked rows read as 0."""
    offs = blk[:, None] * stride_b + slot[:, None] * stride_t + head * stride_h + offs_d[None, :] * stride_d
    x = tl.load(ptr + offs, mask=valid[:, None] & d_mask[None, :], other=0.0)
    if ptr.dtype.element_ty == tl.uint8:  # a float8_e4m3fn cache, passed as bytes (see kernel_cache)
        x = _e4m3_bits_to_f32(x)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def _kv_scale(ptr, blk, slot, head, valid, stride_b, stride_t, stride_h):
    """Load the float32 per-(token, head) scales ``[BLOCK_N]`` of a quantized tile."""
    return tl.load(ptr + blk * stride_b + slot * stride_t + head * stride_h, mask=valid, other=0.0)


@triton.jit
def _softmax_step(s, v, v_scale, m_i, l_i, acc, QUANTIZED: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax update with logits s ``[M, N]`` (log2 units, -inf masked) and V ``[N, D]``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all-masked row stays at p = 0
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANTIZED:
        p = p * v_scale[None, :]  # sum_n p_n * (v_n * scale_n): scale applied on P, codes stay exact
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _finish(m_i, l_i, acc):
    """Normalized output and natural-log lse of an online softmax; empty rows give 0 and -inf."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, lse_ptr,
    sq_s, sq_h, sq_d,
    sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d,
    sks_b, sks_t, sks_h, svs_b, svs_t, svs_h,
    sbt_s, sbt_b, so_s, so_h, so_p, so_d, sl_s, sl_h, sl_p,
    qk_a, qk_b, window,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    QUANTIZED: tl.constexpr, SOFT_CAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (seq, kv_head, split): partial attention of the GROUP query heads of one KV head."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    kv_lo = 0
    if WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
    first = (kv_lo // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N  # tile-aligned
    start = first + split * per_split
    stop = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # query heads of this KV head; rows >= GROUP are padding
    q_offs = seq * sq_s + heads[:, None] * sq_h + offs_d[None, :] * sq_d
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # [G_PAD, D_PAD]

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    vs = tl.zeros([BLOCK_N], tl.float32)
    for tile in range(start, stop, BLOCK_N):
        pos = tile + offs_n  # [BLOCK_N] absolute KV positions
        valid = (pos >= kv_lo) & (pos < stop)
        blk = tl.load(bt_ptr + seq * sbt_s + (pos // BLOCK_SIZE) * sbt_b, mask=valid, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k = _kv_tile(k_ptr, blk, slot, kvh, offs_d, valid, d_mask, sk_b, sk_t, sk_h, sk_d)  # [BLOCK_N, D_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [G_PAD, BLOCK_N]
        if QUANTIZED:
            s = s * _kv_scale(ks_ptr, blk, slot, kvh, valid, sks_b, sks_t, sks_h)[None, :]
            vs = _kv_scale(vs_ptr, blk, slot, kvh, valid, svs_b, svs_t, svs_h)
        s = tl.where(valid[None, :], _scaled_logits(s, qk_a, qk_b, SOFT_CAP), float("-inf"))
        v = _kv_tile(v_ptr, blk, slot, kvh, offs_d, valid, d_mask, sv_b, sv_t, sv_h, sv_d)
        m_i, l_i, acc = _softmax_step(s, v, vs, m_i, l_i, acc, QUANTIZED, PRECISION)

    out, lse = _finish(m_i, l_i, acc)
    o_offs = seq * so_s + heads[:, None] * so_h + split * so_p + offs_d[None, :] * so_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + seq * sl_s + heads * sl_h + split * sl_p, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr, plse_ptr, out_ptr, lse_ptr,
    sp_s, sp_h, sp_p, sp_d, spl_s, spl_h, spl_p, so_s, so_h, so_d, sl_s, sl_h,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    """Grid (seq, q_head): combine NUM_SPLITS partial outputs by their lse weights."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    p_mask = offs_p < NUM_SPLITS
    lse = tl.load(plse_ptr + seq * spl_s + head * spl_h + offs_p * spl_p, mask=p_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2((lse - m_use) * 1.4426950408889634)  # [S_PAD]; empty splits weigh 0
    total = tl.sum(w, 0)
    offs = seq * sp_s + head * sp_h + offs_p[:, None] * sp_p + offs_d[None, :] * sp_d
    part = tl.load(part_ptr + offs, mask=p_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)  # [D_PAD]
    out_ptrs = out_ptr + seq * so_s + head * so_h + offs_d * so_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
    merged = tl.where(total > 0, m_use + tl.log2(tl.where(total > 0, total, 1.0)) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + seq * sl_s + head * sl_h, merged)


# ----------------------------------------------------------------------------- host side


def logit_coefficients(scale: float, soft_cap: float | None) -> tuple[float, float]:
    """Kernel constants (a, b): logits2 = s*a, or tanh(s*a)*b with a soft cap (log2 units)."""
    if soft_cap is None:
        return scale * LOG2E, 0.0
    return scale / soft_cap, soft_cap * LOG2E


def dot_precision(q: torch.Tensor, cache: torch.Tensor) -> str:
    """'ieee' when float32 data enters tl.dot; otherwise tf32 holds fp16/bf16/int8/fp8 values exactly."""
    return "ieee" if torch.float32 in (q.dtype, cache.dtype) else "tf32"


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Flash-decoding split count: fill about two waves of SMs, keeping >= MIN_TOKENS_PER_SPLIT per split."""
    by_len = max(1, max_len // MIN_TOKENS_PER_SPLIT)
    if device.type != "cuda":
        return min(2, by_len)  # interpreter: few programs are cheapest
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-2 * sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, by_len, 32))


def decode_tile(d_pad: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the decode kernel: no register spills on sm80/sm90 for any cache dtype."""
    return (64, 8) if d_pad <= 128 else (32, 8)


def kernel_cache(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels take it: float8_e4m3fn as uint8 bytes (Triton has no e4m3 type before sm89)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    """Strides of ``t``, or n zeros when the tensor is absent."""
    return tuple(t.stride()) if t is not None else (0,) * n


def _decode_triton(q, k_cache, v_cache, block_tables, seq_lens, geo, opts, k_scale, v_scale, num_splits):
    """Launch the split kernel (and the merge kernel when num_splits > 1); returns (out, lse)."""
    num_seqs, num_q_heads, head_dim = q.shape
    scale, window, soft_cap = opts
    group = num_q_heads // geo.num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty_like(q)  # [S, Hq, D]
    lse = torch.empty(num_seqs, num_q_heads, device=q.device, dtype=torch.float32)
    if num_splits == 1:
        part, part_lse = out.unsqueeze(2), lse.unsqueeze(2)  # [S, Hq, 1, D], [S, Hq, 1]
    else:
        part = torch.empty(num_seqs, num_q_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(num_seqs, num_q_heads, num_splits, device=q.device, dtype=torch.float32)
    qk_a, qk_b = logit_coefficients(scale, soft_cap)
    block_n, num_warps = decode_tile(d_pad)
    _decode_split_kernel[(num_seqs, geo.num_kv_heads, num_splits)](
        q, kernel_cache(k_cache), kernel_cache(v_cache), k_scale if geo.quantized else k_cache,
        v_scale if geo.quantized else v_cache, block_tables, seq_lens, part, part_lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *_strides(k_scale, 3), *_strides(v_scale, 3),
        *block_tables.stride(), *part.stride(), *part_lse.stride(),
        qk_a, qk_b, window or 0,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=geo.block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        QUANTIZED=geo.quantized, SOFT_CAP=soft_cap is not None, WINDOW=window is not None,
        PRECISION=dot_precision(q, k_cache), num_warps=num_warps,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_q_heads)](
            part, part_lse, out, lse, *part.stride(), *part_lse.stride(), *out.stride(), *lse.stride(),
            NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, D_PAD=d_pad,
        )  # fmt: skip
    return out, lse


def _decode_torch(q, k_cache, v_cache, block_tables, seq_lens, opts, k_scale, v_scale, max_len, need_lse):
    """Batched torch path: gather to a padded dense cache, masked softmax by matmuls; returns (out, lse)."""
    scale, window, soft_cap = opts
    kv_start = window_start(seq_lens, window)
    k = gather_kv(k_cache, k_scale, block_tables, seq_lens, kv_start, max_len)  # [Hkv, S, L, D]
    v = gather_kv(v_cache, v_scale, block_tables, seq_lens, kv_start, max_len)
    q_pos = (seq_lens.long() - 1)[:, None]  # [S, 1]
    out, lse = dense_attention(
        q.float()[:, None], k, v, q_pos, seq_lens, scale=scale, sliding_window=window, soft_cap=soft_cap,
        need_lse=need_lse,
    )  # fmt: skip
    return out[:, 0].to(q.dtype), None if lse is None else lse[:, 0]


def _validate_decode(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, scale, window, cap, splits):
    """Every check of the decode contract, with one host sync; returns (geometry, options, max_len)."""
    geo = check_cache(q, k_cache, v_cache, k_scale, v_scale)
    opts = check_options(geo.head_dim, scale, window, cap)
    check_tables(block_tables, seq_lens, q.shape[0], q.device)
    if splits is not None:
        check_int("num_splits", splits, low=1, high=MAX_SPLITS)
    if q.shape[0] == 0:
        return geo, opts, 0
    kv_start = window_start(seq_lens, opts[1])
    bounds = block_id_bounds(block_tables, seq_lens, kv_start, geo.block_size)
    lo_len, hi_len, lo_blk, hi_blk = torch.stack([seq_lens.min().long(), seq_lens.max().long(), *bounds]).tolist()
    capacity = block_tables.shape[1] * geo.block_size
    if lo_len < 1 or hi_len > capacity:
        bad = lo_len if lo_len < 1 else hi_len
        raise OutOfRangeError(describe("seq_lens", bad, f"lengths in [1, {capacity}] (max_blocks * block_size)"))
    check_block_ids(lo_blk, hi_blk, geo.num_blocks)
    return geo, opts, hi_len


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
    ``num_splits`` sets flash-decoding's KV split count (None: chosen from batch, heads and SMs).
    """
    geo, opts, max_len = _validate_decode(
        q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, scale, sliding_window, soft_cap, num_splits
    )
    run_triton = use_triton(backend, q, k_cache, v_cache, block_tables, seq_lens)
    if q.shape[0] == 0:
        out, lse = torch.empty_like(q), torch.empty(0, q.shape[1], device=q.device, dtype=torch.float32)
    elif run_triton:
        check_triton_device(q)
        splits = num_splits or choose_num_splits(q.shape[0], geo.num_kv_heads, max_len, q.device)
        out, lse = _decode_triton(q, k_cache, v_cache, block_tables, seq_lens, geo, opts, k_scale, v_scale, splits)
    else:
        out, lse = _decode_torch(
            q, k_cache, v_cache, block_tables, seq_lens, opts, k_scale, v_scale, max_len, return_lse
        )
    return (out, lse) if return_lse else out


def paged_decode_attention_reference(
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
):
    """Torch reference of :func:`paged_decode_attention`: same contract, always the batched torch path."""
    return paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale=scale, k_scale=k_scale, v_scale=v_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, num_splits=num_splits, return_lse=return_lse,
        backend="torch",
    )  # fmt: skip

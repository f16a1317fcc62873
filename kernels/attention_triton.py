"""Triton building blocks of the paged attention kernels (decode and prefill) and their launch constants.

Every kernel walks its KV range in tiles of BLOCK_N positions: load a K tile through the
block table, take q.k, scale it to log2-unit logits, mask, load the V tile and take one
online-softmax step; ``finish_softmax`` normalizes at the end. ``attend_kv_range`` is that
whole loop for the kernels whose rows all see one range (decode splits, shared prefixes); the
causal prefill kernel runs the same steps with its own masks. Quantized caches apply the K
scales to the logits and the V scales to the probabilities, so the codes enter ``tl.dot``
unchanged. The host helpers compute the constants the wrappers pass to the launches.

Dot operands: q, K and V enter ``tl.dot`` in the kernel's DOT dtype (:func:`dot_dtype`): q's
16-bit dtype when the cache holds the same dtype or 1-byte codes (int8, e4m3 and e5m2 values are
exact in fp16 and bf16), so the dots run at the 16-bit tensor-core rate with float32
accumulation; P is rounded to that dtype before P.V, as flash-attention does. float32 data
(or a 16-bit q over a cache of the other 16-bit dtype) keeps float32 operands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    """tanh through exp2 (no libdevice): 1 - 2 / (exp(2x) + 1); saturates cleanly at +-1."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def scaled_logits(s, qk_a, qk_b, SOFT_CAP: tl.constexpr):
    """Raw q.k products -> logits in log2 units: s*a, or tanh(s*a)*b with a soft cap."""
    if SOFT_CAP:
        s = _tanh(s * qk_a) * qk_b
    else:
        s = s * qk_a
    return s


@triton.jit
def _e4m3_bits_to_f16(codes):
    """float8_e4m3fn codes read as uint8 -> float16 by moving bits (exact, any GPU arch).

    The fp16 with sign | exponent-mantissa << 7 equals the e4m3 value / 256, subnormals included,
    so times 256 it is the value (at most 448: exact in fp16); the NaN codes (0x7F, 0xFF) decode as +-480.
    """
    bits = codes.to(tl.int32)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    return half * 256.0


@triton.jit
def kv_tile(ptr, blk, slot, head, offs_d, valid, d_mask, stride_b, stride_t, stride_h, stride_d, DTYPE: tl.constexpr):
    """Load ``[BLOCK_N, D_PAD]`` K or V rows of one head, converted whole to DTYPE; masked rows read as 0.

    DTYPE (:func:`dot_dtype`) holds every cache value exactly: 16-bit values in their own dtype or
    float32, 1-byte codes in fp16/bf16/float32.
    """
    offs = blk[:, None] * stride_b + slot[:, None] * stride_t + head * stride_h + offs_d[None, :] * stride_d
    x = tl.load(ptr + offs, mask=valid[:, None] & d_mask[None, :], other=0.0)
    if ptr.dtype.element_ty == tl.uint8:  # a float8_e4m3fn cache, passed as bytes (see cache_arguments)
        x = _e4m3_bits_to_f16(x)
    return x.to(DTYPE)


@triton.jit
def kv_scale(ptr, blk, slot, head, valid, stride_b, stride_t, stride_h):
    """Load the float32 per-(token, head) scales ``[BLOCK_N]`` of a quantized tile."""
    return tl.load(ptr + blk * stride_b + slot * stride_t + head * stride_h, mask=valid, other=0.0)


@triton.jit
def paged_qk(
    q, bt_row, pos, valid, head, offs_d, d_mask, k_ptr, ks_ptr, vs_ptr,
    sbt_b, sk_b, sk_t, sk_h, sk_d, sks_b, sks_t, sks_h, svs_b, svs_t, svs_h,
    BLOCK_SIZE: tl.constexpr, DTYPE: tl.constexpr, QUANTIZED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Raw logits q.k ``[M, BLOCK_N]`` of the KV positions ``pos`` read through one block-table row.

    Returns (logits, block ids, slots, V scales): a quantized cache's K scales are applied to the
    logits and its V scales loaded for :func:`softmax_step` (zeros for a float cache).
    """
    blk = tl.load(bt_row + (pos // BLOCK_SIZE) * sbt_b, mask=valid, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    k = kv_tile(k_ptr, blk, slot, head, offs_d, valid, d_mask, sk_b, sk_t, sk_h, sk_d, DTYPE)  # [BLOCK_N, D_PAD]
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    vs = tl.zeros_like(slot).to(tl.float32)
    if QUANTIZED:
        s = s * kv_scale(ks_ptr, blk, slot, head, valid, sks_b, sks_t, sks_h)[None, :]
        vs = kv_scale(vs_ptr, blk, slot, head, valid, svs_b, svs_t, svs_h)
    return s, blk, slot, vs


@triton.jit
def softmax_step(s, v, v_scale, m_i, l_i, acc, QUANTIZED: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax update with logits s ``[M, N]`` (log2 units, -inf masked) and V ``[N, D]``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all-masked row stays at p = 0
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANTIZED:
        p = p * v_scale[None, :]  # sum_n p_n * (v_n * scale_n): scale applied on P, codes stay exact
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # P rounded to V's dtype
    return m_new, l_i, acc


@triton.jit
def finish_softmax(m_i, l_i, acc):
    """Normalized output and natural-log lse of an online softmax; empty rows give 0 and -inf."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def attend_kv_range(
    q, bt_row, head, kv_lo, start, stop, qk_a, qk_b, offs_d, d_mask, k_ptr, v_ptr, ks_ptr, vs_ptr,
    sbt_b, sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d, sks_b, sks_t, sks_h, svs_b, svs_t, svs_h,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, QUANTIZED: tl.constexpr,
    SOFT_CAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Attention of every row of q ``[M, D_PAD]`` over the KV positions ``[start, stop)`` of one block-table row.

    ``start`` is tile-aligned; with WINDOW, positions below ``kv_lo`` are masked too. Every row sees
    the same positions (no causal mask). Returns (out ``[M, D_PAD]`` float32, natural-log lse ``[M]``);
    an empty range gives 0 and -inf.
    """
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([q.shape[0]], float("-inf"), tl.float32)
    l_i = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros(q.shape, tl.float32)
    for tile in range(start, stop, BLOCK_N):
        pos = tile + offs_n  # [BLOCK_N] KV positions
        valid = pos < stop
        if WINDOW:
            valid = (pos >= kv_lo) & valid
        s, blk, slot, vs = paged_qk(
            q, bt_row, pos, valid, head, offs_d, d_mask, k_ptr, ks_ptr, vs_ptr,
            sbt_b, sk_b, sk_t, sk_h, sk_d,
            sks_b, sks_t, sks_h, svs_b, svs_t, svs_h, BLOCK_SIZE, DTYPE, QUANTIZED, PRECISION,
        )  # [M, BLOCK_N]
        s = tl.where(valid[None, :], scaled_logits(s, qk_a, qk_b, SOFT_CAP), float("-inf"))
        v = kv_tile(v_ptr, blk, slot, head, offs_d, valid, d_mask, sv_b, sv_t, sv_h, sv_d, DTYPE)
        m_i, l_i, acc = softmax_step(s, v, vs, m_i, l_i, acc, QUANTIZED, PRECISION)
    return finish_softmax(m_i, l_i, acc)


def logit_coefficients(scale: float, soft_cap: float | None) -> tuple[float, float]:
    """Kernel constants (a, b): logits2 = s*a, or tanh(s*a)*b with a soft cap (log2 units)."""
    if soft_cap is None:
        return scale * LOG2E, 0.0
    return scale / soft_cap, soft_cap * LOG2E


def dot_precision(q: torch.Tensor, cache: torch.Tensor) -> str:
    """'ieee' when float32 data enters tl.dot; otherwise tf32 holds fp16/bf16/int8/fp8 values exactly."""
    return "ieee" if torch.float32 in (q.dtype, cache.dtype) else "tf32"


def dot_dtype(q: torch.Tensor, cache: torch.Tensor) -> tl.dtype:
    """The dtype q, K, V and P enter ``tl.dot`` in: q's 16-bit dtype where every cache value is exact in it.

    That is a cache of q's own dtype or of 1-byte codes; float32 data, or 16-bit q over a cache of
    the other 16-bit dtype, keeps float32 ('ieee' / exact 'tf32'). Off CUDA the Triton path is the
    interpreter, whose bf16 ``tl.dot`` is wrong: bf16 runs in float32 there (fp16 stays fp16).
    """
    if q.dtype not in _DOT_16BIT or (cache.dtype != q.dtype and cache.element_size() != 1):
        return tl.float32
    if q.dtype == torch.bfloat16 and q.device.type != "cuda":
        return tl.float32
    return _DOT_16BIT[q.dtype]


_DOT_16BIT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def cache_arguments(k_cache, v_cache, k_scale, v_scale) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """(pointers, strides) of k_cache, v_cache, k_scale, v_scale as the kernels take them.

    float8_e4m3fn caches go in as uint8 bytes (Triton has no e4m3 type before sm89). A float
    cache has no scales: its cache tensors stand in as pointers the kernel never reads, with zero strides.
    """
    pointers = (
        _kernel_cache(k_cache), _kernel_cache(v_cache),
        k_cache if k_scale is None else k_scale, v_cache if v_scale is None else v_scale,
    )  # fmt: skip
    strides = (*k_cache.stride(), *v_cache.stride(), *_strides_or_zeros(k_scale, 3), *_strides_or_zeros(v_scale, 3))
    return pointers, strides


def _kernel_cache(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels take it: float8_e4m3fn as uint8 bytes."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def _strides_or_zeros(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    """Strides of ``t``, or n zeros when the tensor is absent."""
    return tuple(t.stride()) if t is not None else (0,) * n

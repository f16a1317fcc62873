"""Triton building blocks of the paged attention kernels (decode and prefill) and their launch constants.

Both kernels walk their KV range in tiles of BLOCK_N positions: load a K tile through the
block table, take q.k, scale it to log2-unit logits, mask, load the V tile and take one
online-softmax step; ``finish_softmax`` normalizes at the end. Quantized caches apply the K
scales to the logits and the V scales to the probabilities, so the codes enter ``tl.dot``
unchanged. The host helpers compute the constants the wrappers pass to the launches.
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
def _e4m3_bits_to_f32(codes):
    """float8_e4m3fn codes read as uint8 -> float32 by moving bits into a float16 (exact, any GPU arch).

    The fp16 with sign | exponent-mantissa << 7 equals the e4m3 value / 256, subnormals included;
    the NaN codes (0x7F, 0xFF) decode as +-480.
    """
    bits = codes.to(tl.int32)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * 256.0


@triton.jit
def kv_tile(ptr, blk, slot, head, offs_d, valid, d_mask, stride_b, stride_t, stride_h, stride_d):
    """Load ``[BLOCK_N, D_PAD]`` K or V rows of one head as float32; masked rows read as 0."""
    offs = blk[:, None] * stride_b + slot[:, None] * stride_t + head * stride_h + offs_d[None, :] * stride_d
    x = tl.load(ptr + offs, mask=valid[:, None] & d_mask[None, :], other=0.0)
    if ptr.dtype.element_ty == tl.uint8:  # a float8_e4m3fn cache, passed as bytes (see cache_arguments)
        x = _e4m3_bits_to_f32(x)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def kv_scale(ptr, blk, slot, head, valid, stride_b, stride_t, stride_h):
    """Load the float32 per-(token, head) scales ``[BLOCK_N]`` of a quantized tile."""
    return tl.load(ptr + blk * stride_b + slot * stride_t + head * stride_h, mask=valid, other=0.0)


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
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def finish_softmax(m_i, l_i, acc):
    """Normalized output and natural-log lse of an online softmax; empty rows give 0 and -inf."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


def logit_coefficients(scale: float, soft_cap: float | None) -> tuple[float, float]:
    """Kernel constants (a, b): logits2 = s*a, or tanh(s*a)*b with a soft cap (log2 units)."""
    if soft_cap is None:
        return scale * LOG2E, 0.0
    return scale / soft_cap, soft_cap * LOG2E


def dot_precision(q: torch.Tensor, cache: torch.Tensor) -> str:
    """'ieee' when float32 data enters tl.dot; otherwise tf32 holds fp16/bf16/int8/fp8 values exactly."""
    return "ieee" if torch.float32 in (q.dtype, cache.dtype) else "tf32"


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

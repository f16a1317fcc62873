"""Scatter new K/V vectors into the paged cache, quantizing them for int8/fp8 caches.

Layout: ``k_cache``/``v_cache`` [num_blocks, block_size, num_kv_heads, head_dim],
contiguous; token ``i`` goes to flat slot ``slot_mapping[i] = block * block_size +
offset``. A negative slot skips the token (padding). Non-negative slots must be
distinct: two tokens racing for one slot would leave an unspecified winner, so
duplicates are rejected before anything is written.

Quantized caches (int8, float8_e4m3fn, float8_e5m2) take float32 scale tensors
[num_blocks, block_size, num_kv_heads]; the codes and scales follow
:mod:`kernels.quant` exactly (the kernel is bit-identical to the torch reference).
The fp8 codes are built with integer bit operations instead of Triton's fp8
cast, so the kernel also runs on GPUs without native fp8 and in the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import (
    Backend,
    BoundCall,
    check_cache_pair,
    check_scales,
    check_triton_device,
    use_triton,
)
from kernels.metadata import AttentionMetadata, check_metadata
from kernels.quant import as_storage, is_quantized, quant_max, quantize_per_token_head
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, describe
from paged_kv.tensor_checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_contiguous,
    check_same_device,
    check_shape,
    check_tensor,
)

_TILE_ELEMS = 4096  # max elements of one program's [BLOCK_H, BLOCK_D] tile
_FP8_FORMAT = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}  # (mantissa bits, bias)
_MODE_FLOAT, _MODE_INT8, _MODE_FP8, _MODE_BF16 = 0, 1, 2, 3


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the cache slots (negative slot = skip).

    ``backend="torch"`` is the torch reference: one vectorized index_put_ over the valid slots.
    """
    _validate(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    _bind(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, backend).run(
        key, value, k_cache, v_cache, k_scale, v_scale
    )


def bind_write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, backend: Backend = "auto",
) -> BoundCall:  # fmt: skip
    """The checks of :func:`write_kv_prepared` done once: a BoundCall run per layer."""
    check_metadata(meta, AttentionMetadata)  # the slots come from it
    _check_inputs(key, value, meta.slot_mapping)
    _check_caches(k_cache, v_cache, key.shape[1], key.shape[2])
    _check_scales(k_scale, v_scale, k_cache)
    check_metadata(meta, AttentionMetadata, device=key.device, num_blocks=k_cache.shape[0], block_size=k_cache.shape[1])
    check_same_device({"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache})
    return _bind(key, value, k_cache, v_cache, k_scale, v_scale, meta.slot_mapping, backend)


def write_kv_prepared(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, backend: Backend = "auto",
) -> None:  # fmt: skip
    """:func:`write_kv` into a prepared step's ``slot_mapping``: host checks only, no device value read.

    The slots were validated (in range, distinct) when ``meta`` was prepared.
    """
    bound = bind_write_kv(key, value, k_cache, v_cache, meta, k_scale=k_scale, v_scale=v_scale, backend=backend)
    bound.run(key, value, k_cache, v_cache, k_scale, v_scale)


def _bind(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, backend) -> BoundCall:
    """The write of checked inputs into ``slot_mapping``, bound to everything but its layer's tensors."""
    triton_path = use_triton(backend, key, value, k_cache, v_cache, slot_mapping)
    if triton_path:
        check_triton_device(key)

    def run(key, value, k_cache, v_cache, k_scale=None, v_scale=None) -> None:
        if key.shape[0] == 0:
            return
        write = _write_triton if triton_path else _write_torch
        write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    return BoundCall(run, key, value, k_cache, v_cache, k_scale, v_scale)


# ---------------------------------------------------------------- validation


def _validate(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """Every check of write_kv; raises before anything is written."""
    num_tokens, num_heads, head_dim = _check_inputs(key, value, slot_mapping)
    _check_caches(k_cache, v_cache, num_heads, head_dim)
    _check_scales(k_scale, v_scale, k_cache)
    named = {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    if k_scale is not None:
        named |= {"k_scale": k_scale, "v_scale": v_scale}
    check_same_device(named)
    check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[1])


def _check_inputs(key, value, slot_mapping) -> tuple[int, int, int]:
    """key/value: same [T, H, D] float tensors; slot_mapping: [T] int32/int64."""
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES)
    check_shape("value", value, tuple(key.shape))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES)
    check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    if key.shape[1] == 0 or key.shape[2] == 0:
        raise InvalidArgumentError(describe("key.shape", tuple(key.shape), "num_kv_heads >= 1 and head_dim >= 1"))
    return tuple(key.shape)


def _check_caches(k_cache, v_cache, num_heads: int, head_dim: int) -> None:
    """Caches: contiguous [NB, BS, H, D] of one cache dtype, matching key's heads and head_dim."""
    check_cache_pair(k_cache, v_cache)
    if tuple(k_cache.shape[2:]) != (num_heads, head_dim):
        raise InvalidArgumentError(
            describe("k_cache.shape", tuple(k_cache.shape), f"[num_blocks, block_size, {num_heads}, {head_dim}]")
        )
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)


def _check_scales(k_scale, v_scale, k_cache) -> None:
    """Scales: float32 [NB, BS, H] on the cache's device, contiguous, for quantized caches; forbidden otherwise."""
    if check_scales(k_scale, v_scale, k_cache, k_cache.device):
        check_contiguous("k_scale", k_scale)
        check_contiguous("v_scale", v_scale)


def check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Slots must be < num_slots and distinct where non-negative (one host sync)."""
    if slot_mapping.numel() == 0:
        return
    ordered = torch.sort(slot_mapping.to(torch.int64)).values  # [T]
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)  # [T-1]
    highest, num_repeated = torch.stack([ordered[-1], repeated.sum()]).tolist()
    if highest >= num_slots:
        raise OutOfRangeError(describe("slot_mapping", highest, f"slots < {num_slots} (negative = skip)"))
    if num_repeated:
        first = int(ordered[1:][repeated][0])
        raise InvalidArgumentError(describe("slot_mapping", first, "distinct non-negative slots"))


# ---------------------------------------------------------------- torch path


def _write_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """Reference: quantize (if needed) and index_put_ the valid tokens."""
    valid = slot_mapping >= 0  # [T]
    slots = slot_mapping[valid].to(torch.int64)  # [V]
    _scatter(key[valid], k_cache, k_scale, slots)
    _scatter(value[valid], v_cache, v_scale, slots)


def _scatter(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor) -> None:
    """x: [V, H, D] -> cache rows ``slots`` of the flat [NB*BS, H, D] view (scale rows too)."""
    num_heads, head_dim = cache.shape[2:]
    if scale is None:
        codes = x.to(cache.dtype)
    else:
        codes, scales = quantize_per_token_head(x, cache.dtype)  # [V, H, D], [V, H]
        scale.view(-1, num_heads).index_put_((slots,), scales)
    # index_put_, not index_copy_: torch's CPU index_copy_ is ~400x slower for 16-bit dtypes
    as_storage(cache).view(-1, num_heads, head_dim).index_put_((slots,), as_storage(codes))


# ---------------------------------------------------------------- triton path


def _write_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """Launch one program per (token, head group)."""
    num_tokens, num_heads, head_dim = key.shape
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, _TILE_ELEMS // block_d))
    mode, qmax, mant, bias = _quant_params(k_cache.dtype)
    k_out, v_out = as_storage(k_cache), as_storage(v_cache)
    k_scale = k_out if k_scale is None else k_scale  # unused placeholder in float mode
    v_scale = v_out if v_scale is None else v_scale
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _write_kv_kernel[grid](
        key, value, k_out, v_out, k_scale, v_scale, slot_mapping,
        *key.stride(), *value.stride(),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        MODE=mode, QMAX=qmax, FP8_MANT=mant, FP8_BIAS=bias,
    )  # fmt: skip


def _quant_params(dtype: torch.dtype) -> tuple[int, float, int, int]:
    """(MODE, QMAX, FP8_MANT, FP8_BIAS) constexprs for a cache dtype."""
    if dtype == torch.bfloat16:
        return _MODE_BF16, 1.0, 0, 0
    if not is_quantized(dtype):
        return _MODE_FLOAT, 1.0, 0, 0
    if dtype == torch.int8:
        return _MODE_INT8, quant_max(dtype), 0, 0
    mant, bias = _FP8_FORMAT[dtype]
    return _MODE_FP8, quant_max(dtype), mant, bias


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    key_stride_t, key_stride_h, key_stride_d, value_stride_t, value_stride_h, value_stride_d,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    MODE: tl.constexpr, QMAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)  # < 0: skip (every access masked off)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    head_limit = tl.where(slot >= 0, NUM_HEADS, 0)  # 0 masks the whole token off
    head_mask = heads < head_limit  # [BLOCK_H]
    mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    cache_offs = slot * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    scale_offs = slot * NUM_HEADS + heads
    key_ptrs = key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :] * key_stride_d
    value_ptrs = value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :] * value_stride_d
    _write_tile(key_ptrs, k_cache_ptr + cache_offs, k_scale_ptr + scale_offs, mask, head_mask,
                BLOCK_H, BLOCK_D, MODE, QMAX, FP8_MANT, FP8_BIAS)  # fmt: skip
    _write_tile(value_ptrs, v_cache_ptr + cache_offs, v_scale_ptr + scale_offs, mask, head_mask,
                BLOCK_H, BLOCK_D, MODE, QMAX, FP8_MANT, FP8_BIAS)  # fmt: skip


@triton.jit
def _write_tile(
    src_ptrs, dst_ptrs, scale_ptrs, mask, head_mask,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    MODE: tl.constexpr, QMAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
):  # fmt: skip
    x = tl.load(src_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    if MODE == 0:
        tl.store(dst_ptrs, x.to(dst_ptrs.dtype.element_ty), mask=mask)
    elif MODE == 3:
        tl.store(dst_ptrs, _bf16_bits(x).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        absmax = tl.max(tl.abs(x), axis=1)  # [BLOCK_H]
        scale = tl.math.div_rn(absmax, QMAX)  # IEEE division, like torch
        divisor = tl.where(scale == 0.0, 1.0, scale)  # all-zero vector: codes 0, scale 0
        y = tl.math.div_rn(x, tl.broadcast_to(divisor[:, None], (BLOCK_H, BLOCK_D)))
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)  # saturate: |y| <= QMAX
        if MODE == 1:
            codes = _int8_codes(y).to(tl.int8)
        else:
            codes = _fp8_codes(y, FP8_MANT, FP8_BIAS).to(tl.uint8)
        tl.store(dst_ptrs, codes, mask=mask)
        tl.store(scale_ptrs, scale, mask=head_mask)


@triton.jit
def _round_half_even(v):
    """int32 round-half-to-even of fp32 ``v`` in [0, 2**22): adding 2**23 leaves rint(v) in the low bits."""
    return (v + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000


@triton.jit
def _bf16_bits(x):
    """int32 bfloat16 bit patterns of fp32 ``x``, round to nearest even (the interpreter's cast truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    rounded = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16  # carry may bump the exponent (up to inf)
    rounded = tl.where(x == x, rounded, 0x7FC0)  # NaN stays NaN (its magnitude would overflow int32)
    return rounded | ((bits >> 16) & 0x8000)


@triton.jit
def _int8_codes(y):
    """int32 codes of fp32 ``y`` in [-127, 127], rounded half to even."""
    r = _round_half_even(tl.abs(y))
    return tl.where(y < 0, -r, r)


@triton.jit
def _fp8_codes(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """int32 fp8 bit patterns (round to nearest even) of finite fp32 ``y`` within the format's range."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    drop = 23 - MANT  # fp32 mantissa bits cut off
    # normal: round the fp32 magnitude bits (carry may bump the exponent), then re-bias
    rounded = (mag + ((1 << (drop - 1)) - 1) + ((mag >> drop) & 1)) >> drop
    normal = rounded - ((127 - BIAS) << MANT)
    # subnormal: count units of the smallest subnormal 2**(1 - BIAS - MANT)
    subnormal = _round_half_even(tl.abs(y) * (2.0 ** (BIAS - 1 + MANT)))
    is_subnormal = mag < ((128 - BIAS) << 23)  # below the smallest normal 2**(1 - BIAS)
    return tl.where(is_subnormal, subnormal, normal) | sign

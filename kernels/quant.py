"""The KV-cache quantization contract, in torch: per-(token, head) absmax scales.

Quantized caches (int8, float8_e4m3fn, float8_e5m2) store one float32 scale per
(token, head) next to the codes of its ``head_dim`` vector:

* ``scale = absmax(x) / QMAX`` with QMAX = 127 (int8), 448 (e4m3fn), 57344 (e5m2);
  computed in float32 with IEEE division.
* ``y = x / scale`` (IEEE division; an all-zero vector divides by 1.0 instead).
* int8 codes: ``round_half_to_even(y)`` clamped to [-127, 127].
  fp8 codes: ``y`` clamped to [-QMAX, QMAX], then cast with round-to-nearest-even.
* dequantized value: ``codes.to(float32) * scale``.

An all-zero vector stores scale 0.0 (the formula's own value) and codes 0, so it
dequantizes to exact zeros. Non-finite inputs give unspecified codes and a
non-finite scale. The Triton write kernel reproduces this bit for bit.
"""

from __future__ import annotations

import torch

from paged_kv.errors import InvalidArgumentError, describe
from paged_kv.tensor_checks import CACHE_DTYPES, check_dtype, check_tensor

FLOAT_OUTPUTS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what dequantize returns
DEQUANT_INPUTS = CACHE_DTYPES + (torch.float64,)  # codes of any cache dtype (float ones pass through)

INT8_MAX = 127.0
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
FP8_E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)  # 57344.0

_QMAX: dict[torch.dtype, float] = {
    torch.int8: INT8_MAX,
    torch.float8_e4m3fn: FP8_E4M3_MAX,
    torch.float8_e5m2: FP8_E5M2_MAX,
}


def is_quantized(dtype: torch.dtype) -> bool:
    """True for the quantized cache dtypes (int8, float8_e4m3fn, float8_e5m2)."""
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(describe("dtype", dtype, "a torch.dtype"))
    return dtype in _QMAX


def quant_max(dtype: torch.dtype) -> float:
    """Largest code magnitude of a quantized cache dtype (127, 448 or 57344)."""
    if dtype not in _QMAX:
        raise InvalidArgumentError(describe("dtype", dtype, f"one of {tuple(_QMAX)}"))
    return _QMAX[dtype]


def compute_scales(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-vector float32 scales ``absmax / QMAX`` over the last dim: [..., D] -> [...]."""
    absmax = x.to(torch.float32).abs().amax(dim=-1)
    return absmax / quant_max(dtype)


def quantize_per_token_head(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., D] (e.g. [T, H, D]) to ``dtype``: returns (codes [..., D], scales [...] float32)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise InvalidArgumentError(describe("x", getattr(x, "dtype", type(x).__name__), "a float tensor"))
    qmax = quant_max(dtype)
    scales = compute_scales(x, dtype)  # [...]
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
    y = x.to(torch.float32) / divisor.unsqueeze(-1)  # [..., D]
    y = y.clamp(-qmax, qmax)
    if dtype == torch.int8:
        return torch.round(y).to(torch.int8), scales  # torch.round is half-to-even
    return y.to(dtype), scales


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor | None, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize ``codes`` [..., D] with ``scales`` [...]: ``codes.float() * scale``, cast to ``out_dtype``.

    Float (unquantized) codes pass through with ``scales=None``, so one call
    serves every cache dtype.
    """
    check_tensor("codes", codes, dtypes=DEQUANT_INPUTS)
    check_dtype("out_dtype", out_dtype, FLOAT_OUTPUTS)
    if not is_quantized(codes.dtype):
        if scales is not None:
            raise InvalidArgumentError(describe("scales", "a tensor", f"None for {codes.dtype} codes"))
        return codes.to(out_dtype)
    if scales is None:
        raise InvalidArgumentError(describe("scales.shape", None, f"{tuple(codes.shape[:-1])}"))
    check_tensor("scales", scales, dtypes=(torch.float32,), device=codes.device)
    if tuple(scales.shape) != tuple(codes.shape[:-1]):
        raise InvalidArgumentError(describe("scales.shape", tuple(scales.shape), f"{tuple(codes.shape[:-1])}"))
    values = codes.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)  # [..., D]
    return values.to(out_dtype)


def as_storage(t: torch.Tensor) -> torch.Tensor:
    """View fp8 tensors as uint8 (same bytes): torch's CPU index_copy_/index_select lack fp8 kernels."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t

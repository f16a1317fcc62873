"""Tests of the per-(token, head) quantization contract in kernels/quant.py."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.quant import (
    FP8_E4M3_MAX,
    FP8_E5M2_MAX,
    INT8_MAX,
    as_storage,
    dequantize,
    is_quantized,
    quant_max,
    quantize_per_token_head,
)
from paged_kv.errors import InvalidArgumentError, PagedKVError

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
FP8_FORMAT = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}  # (mantissa bits, exponent bias)


def _sample(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x: [T, H, D] with magnitudes spread over many binades per token."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 3, 40, generator=gen)
    spread = torch.logspace(-4, 4, 6)[:, None, None]  # [T, 1, 1]
    return (x * spread).to(dtype)


def test_constants_and_predicates() -> None:
    assert (INT8_MAX, FP8_E4M3_MAX, FP8_E5M2_MAX) == (127.0, 448.0, 57344.0)
    assert [quant_max(d) for d in QUANT_DTYPES] == [127.0, 448.0, 57344.0]
    assert all(is_quantized(d) for d in QUANT_DTYPES)
    assert not any(is_quantized(d) for d in (torch.float32, torch.float16, torch.bfloat16, torch.uint8))
    with pytest.raises(InvalidArgumentError, match="dtype"):
        quant_max(torch.float16)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int8_error_within_half_a_step(in_dtype: torch.dtype) -> None:
    x = _sample(1, in_dtype)
    codes, scales = quantize_per_token_head(x, torch.int8)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (6, 3)
    xf = x.float()
    assert torch.equal(scales, xf.abs().amax(-1) / 127)
    err = (dequantize(codes, scales) - xf).abs()  # [T, H, D]
    assert torch.all(err <= scales.unsqueeze(-1) * (0.5 + 1e-5))
    assert codes.abs().max() == 127  # the absmax element hits the end of the range


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_error_within_half_an_ulp(dtype: torch.dtype) -> None:
    mant, bias = FP8_FORMAT[dtype]
    x = _sample(2)
    codes, scales = quantize_per_token_head(x, dtype)
    assert codes.dtype == dtype and torch.equal(scales, x.abs().amax(-1) / quant_max(dtype))
    y = x / scales.unsqueeze(-1)  # the scaled values the codes round
    exponent = torch.floor(torch.log2(y.abs().clamp_min(1e-30))).clamp_min(1 - bias)
    half_ulp = torch.exp2(exponent - mant) / 2
    assert torch.all((codes.float() - y).abs() <= half_ulp * (1 + 1e-6))


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_zero_vectors_dequantize_to_exact_zeros(dtype: torch.dtype) -> None:
    x = _sample(3)
    x[0, 1] = 0.0
    x[2, 0] = -0.0
    codes, scales = quantize_per_token_head(x, dtype)
    assert scales[0, 1] == 0 and scales[2, 0] == 0
    assert torch.all(codes[0, 1].float() == 0) and torch.all(codes[2, 0].float() == 0)
    out = dequantize(codes, scales)
    assert torch.all(out[0, 1] == 0) and torch.all(out[2, 0] == 0)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_codes_saturate_for_huge_inputs(dtype: torch.dtype) -> None:
    x = torch.tensor([[[3e38, -3e38, 1.0, 0.0]]])  # absmax / QMAX stays finite
    codes, scales = quantize_per_token_head(x, dtype)
    values = codes.float()
    assert torch.isfinite(values).all() and values.abs().max() <= quant_max(dtype)
    assert torch.allclose(dequantize(codes, scales)[0, 0, :2], x[0, 0, :2], rtol=1e-2)


def test_int8_rounds_half_to_even() -> None:
    # absmax 127 gives scale 1: codes are the rounded inputs themselves
    x = torch.tensor([[[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 3.4999]]])
    codes, scales = quantize_per_token_head(x, torch.int8)
    assert scales.item() == 1.0
    assert codes.flatten().tolist() == [127, 0, 2, 2, 0, -2, -2, 126, 3]


def test_dequantize_out_dtype_and_float_passthrough() -> None:
    x = _sample(4)
    codes, scales = quantize_per_token_head(x, torch.float8_e4m3fn)
    half = dequantize(codes, scales, torch.float16)
    assert half.dtype == torch.float16
    assert torch.equal(half, (codes.float() * scales.unsqueeze(-1)).half())
    assert torch.equal(dequantize(x.bfloat16(), None), x.bfloat16().float())


def test_dequantize_rejects_bad_scales() -> None:
    x = _sample(5)
    codes, scales = quantize_per_token_head(x, torch.int8)
    with pytest.raises(InvalidArgumentError, match="scales.shape"):
        dequantize(codes, None)
    with pytest.raises(InvalidArgumentError, match="scales.shape"):
        dequantize(codes, scales[:, :2])
    with pytest.raises(InvalidArgumentError, match="scales"):
        dequantize(x, scales)


def test_quantize_rejects_bad_inputs() -> None:
    with pytest.raises(InvalidArgumentError):
        quantize_per_token_head(torch.ones(2, 3, 4), torch.float16)
    with pytest.raises(PagedKVError):
        quantize_per_token_head(torch.ones(2, 3, 4, dtype=torch.int32), torch.int8)
    with pytest.raises(PagedKVError):
        quantize_per_token_head([1.0, 2.0], torch.int8)


def test_as_storage_views_fp8_bytes() -> None:
    t = torch.tensor([1.0, -2.0, 448.0]).to(torch.float8_e4m3fn)
    raw = as_storage(t)
    assert raw.dtype == torch.uint8 and raw.data_ptr() == t.data_ptr()
    assert raw.tolist() == [0x38, 0xC0, 0x7E]
    f = torch.ones(3)
    assert as_storage(f) is f
    assert math.isclose(float(t[2]), 448.0)

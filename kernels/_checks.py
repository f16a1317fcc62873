"""Kernel dispatch and cache-layout checks shared by the kernel host wrappers.

Every wrapper validates shapes, dtypes, devices and index ranges before it launches
anything (an out-of-range block id in a kernel reads wild memory): the generic tensor
checks live in :mod:`paged_kv.tensor_checks`; the K/V cache pair and scale checks and
the Triton/torch backend choice live here.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from paged_kv.errors import InvalidArgumentError, describe
from paged_kv.tensor_checks import CACHE_DTYPES, QUANT_DTYPES, check_shape, check_tensor

Backend = Literal["auto", "triton", "torch"]


def use_triton(backend: Backend, *tensors: torch.Tensor) -> bool:
    """Pick the Triton path: 'auto' means CUDA tensors run Triton, CPU tensors run torch."""
    if backend not in ("auto", "triton", "torch"):
        raise InvalidArgumentError(describe("backend", backend, "'auto', 'triton' or 'torch'"))
    if backend == "auto":
        return all(t.is_cuda for t in tensors)
    return backend == "triton"


def check_cache_pair(k_cache: object, v_cache: object, device: torch.device | None = None) -> None:
    """Check K/V caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` of one cache dtype and one shape."""
    check_tensor("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES, device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))


def check_scales(k_scale: object, v_scale: object, k_cache: torch.Tensor, device: torch.device | None = None) -> bool:
    """Check the scales: float32 ``[num_blocks, block_size, num_kv_heads]`` for a quantized cache, else None.

    Returns whether the cache is quantized.
    """
    quantized = k_cache.dtype in QUANT_DTYPES
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not quantized:
            if scale is not None:
                raise InvalidArgumentError(describe(name, "a tensor", f"None for a {k_cache.dtype} cache"))
            continue
        if scale is None:
            raise InvalidArgumentError(describe(name, None, f"a float32 scale tensor for a {k_cache.dtype} cache"))
        check_tensor(name, scale, ndim=3, dtypes=(torch.float32,), device=device)
        check_shape(name, scale, tuple(k_cache.shape[:3]))
    return quantized


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Triton needs CUDA tensors, or the interpreter (TRITON_INTERPRET=1) for CPU tensors."""
    if all(t.is_cuda for t in tensors) or os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise InvalidArgumentError(describe("backend", "triton", "CUDA tensors (or TRITON_INTERPRET=1 on CPU)"))

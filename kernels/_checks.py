"""Input checks shared by the kernel host wrappers.

Every wrapper validates shapes, dtypes, devices and index ranges here before it
launches anything: an out-of-range block id in a kernel reads wild memory.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Literal

import numpy as np
import torch

from paged_kv.errors import InvalidArgumentError, OutOfRangeError, describe

Backend = Literal["auto", "triton", "torch"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = FLOAT_DTYPES + QUANT_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)


def use_triton(backend: Backend, *tensors: torch.Tensor) -> bool:
    """Pick the Triton path: 'auto' means CUDA tensors run Triton, CPU tensors run torch."""
    if backend not in ("auto", "triton", "torch"):
        raise InvalidArgumentError(describe("backend", backend, "'auto', 'triton' or 'torch'"))
    if backend == "auto":
        return all(t.is_cuda for t in tensors)
    return backend == "triton"


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor of the given rank, dtype family and device."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(describe(name, type(t).__name__, "a torch.Tensor"))
    if ndim is not None and t.dim() != ndim:
        raise InvalidArgumentError(describe(f"{name}.shape", tuple(t.shape), f"{ndim} dimensions"))
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise InvalidArgumentError(describe(f"{name}.dtype", t.dtype, f"one of {dtypes}"))
    if device is not None and t.device != device:
        raise InvalidArgumentError(describe(f"{name}.device", t.device, f"{device}"))
    return t


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Check an exact shape."""
    if tuple(t.shape) != tuple(expected):
        raise InvalidArgumentError(describe(f"{name}.shape", tuple(t.shape), f"{tuple(expected)}"))


def check_range(name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Check every element of an integer tensor lies in ``[low, high)`` (one host sync)."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi >= high:
        bad = lo if lo < low else hi
        raise OutOfRangeError(describe(name, bad, f"values in [{low}, {high})"))


def check_contiguous(name: str, t: torch.Tensor) -> None:
    """Check that a tensor is contiguous (kernels address it by flat offsets)."""
    if not t.is_contiguous():
        raise InvalidArgumentError(describe(f"{name}.stride", t.stride(), "a contiguous tensor"))


def check_same_device(named: dict[str, torch.Tensor]) -> torch.device:
    """Check that every tensor lives on one device; return it."""
    items = list(named.items())
    device = items[0][1].device
    for name, t in items[1:]:
        if t.device != device:
            raise InvalidArgumentError(describe(f"{name}.device", t.device, f"{device} like {items[0][0]}"))
    return device


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


def check_device(name: str, device: object) -> torch.device:
    """``device`` (a str or torch.device) as a torch.device that tensors can be made on, else InvalidArgumentError."""
    if not isinstance(device, (str, torch.device)):
        raise InvalidArgumentError(describe(name, device, "a device string or torch.device"))
    resolved, problem = _probe_device(device)
    if problem is not None:
        raise InvalidArgumentError(describe(name, device, problem))
    return resolved


@functools.lru_cache(maxsize=64)
def _probe_device(device: str | torch.device) -> tuple[torch.device | None, str | None]:
    """(the device, None) if a tensor can be made there, else (None, what was expected); remembered per device."""
    try:
        resolved = torch.device(device)
        torch.empty(0, device=resolved)  # unknown types, absent backends, out-of-range indices all fail here
    except (RuntimeError, AssertionError, TypeError, ValueError) as exc:
        return None, f"an available device ({str(exc).splitlines()[0][:100]})"
    if resolved.type == "meta":  # meta tensors hold no data: nothing could be read back
        return None, "a device that holds data (not 'meta')"
    return resolved, None


def check_dtype(name: str, dtype: object, allowed: Iterable[torch.dtype]) -> torch.dtype:
    """Return ``dtype`` if it is one of ``allowed``, else raise InvalidArgumentError naming it."""
    allowed = tuple(allowed)
    if not isinstance(dtype, torch.dtype) or dtype not in allowed:
        raise InvalidArgumentError(describe(name, dtype, f"one of {allowed}"))
    return dtype


def check_host_ints(name: str, value: object, ndim: int) -> np.ndarray:
    """``value`` (a numpy array or nested list of ints, host values) as an int64 array of rank ``ndim``."""
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, (np.ndarray, list, tuple)):
        raise InvalidArgumentError(describe(name, type(value).__name__, "a numpy array or list of ints (host values)"))
    try:
        arr = np.asarray(value)
    except ValueError as exc:  # ragged nesting
        raise InvalidArgumentError(describe(name, "a ragged list", f"a rectangular {ndim}-d array")) from exc
    if arr.size and (arr.dtype == np.bool_ or arr.dtype.kind not in "iu"):
        raise InvalidArgumentError(describe(f"{name}.dtype", arr.dtype, "integers"))
    if arr.ndim != ndim:
        raise InvalidArgumentError(describe(f"{name}.shape", arr.shape, f"{ndim} dimensions"))
    return arr.astype(np.int64)

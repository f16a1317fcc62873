"""Tensor argument checks shared by every layer: storage, kernels and the engine.

Each check raises a typed error from :mod:`paged_kv.errors` naming the argument, the
value and what was expected. This module sits below both :mod:`paged_kv.kv_cache` and
the kernels, beside the errors: it imports nothing of the project but the errors. Host
index arrays (numpy, lists of ints) are checked here too (``check_host_ints``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from paged_kv.errors import InvalidArgumentError, OutOfRangeError, PagedKVError, describe

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = FLOAT_DTYPES + QUANT_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)


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


def check_shape(
    name: str, t: torch.Tensor, expected: Sequence[int | None], *, error: type[PagedKVError] = InvalidArgumentError
) -> None:
    """Check a shape: exact, or with None matching any size (shown as ``*``); ``error`` is the class raised."""
    got = tuple(t.shape)
    if got == tuple(expected):
        return
    if None not in expected:
        raise error(describe(f"{name}.shape", got, f"{tuple(expected)}"))
    if len(got) != len(expected) or any(w is not None and g != w for g, w in zip(got, expected)):
        pattern = ", ".join("*" if w is None else str(w) for w in expected)
        raise error(describe(f"{name}.shape", list(got), f"shape [{pattern}]"))


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


def _holds_bool(value: object) -> bool:
    """Whether a (nested) list holds a bool, which numpy would silently take as 0 or 1."""
    if isinstance(value, np.ndarray):
        return False  # its dtype says it
    return any(_holds_bool(v) if isinstance(v, (list, tuple)) else isinstance(v, (bool, np.bool_)) for v in value)


def check_host_ints(name: str, value: object, ndim: int) -> np.ndarray:
    """``value`` (a numpy array or nested list of ints, host values) as an int64 array of rank ``ndim``."""
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, (np.ndarray, list, tuple)):
        raise InvalidArgumentError(describe(name, type(value).__name__, "a numpy array or list of ints (host values)"))
    try:
        arr = np.asarray(value)
    except ValueError as exc:  # ragged nesting
        raise InvalidArgumentError(describe(name, "a ragged list", f"a rectangular {ndim}-d array")) from exc
    if arr.size and (arr.dtype == np.bool_ or arr.dtype.kind not in "iu" or _holds_bool(value)):
        raise InvalidArgumentError(describe(f"{name}.dtype", arr.dtype, "integers (no bools)"))
    if arr.ndim != ndim:
        raise InvalidArgumentError(describe(f"{name}.shape", arr.shape, f"{ndim} dimensions"))
    return arr.astype(np.int64)

"""Argument checking and input conversion shared by the compatibility facades.

Every helper raises a subclass of :class:`paged_kv.errors.PagedKVError` whose
message names the argument, the value given and what was expected. Helpers
that a facade may want to raise its own error class from take ``error=``; the
class given must derive from ``PagedKVError`` (and usually from the matching
project error, e.g. ``InvalidArgumentError`` for shapes).

Inputs documented as ``&[f32]`` / ``ArrayD<f64>`` accept a (nested) sequence of
numbers, a NumPy array or a torch tensor; booleans, complex numbers, strings
and ragged nesting are rejected.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from paged_kv.compat.pool import KVPool, PagedSeq
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, PagedKVError, check_int, describe
from paged_kv.tensor_checks import check_device, check_shape

ErrorType = type[PagedKVError]
Shape = Sequence[int | None]  # None matches any size (tensor_checks.check_shape)

_NUMPY_NUMERIC = "fiu"  # float, signed int, unsigned int


def as_tensor(
    name: str,
    x: object,
    *,
    dtype: torch.dtype = torch.float32,
    shape: Shape | None = None,
    device: str | torch.device | None = None,
    error: ErrorType = InvalidArgumentError,
) -> torch.Tensor:
    """Convert ``x`` (numbers, NumPy array or torch tensor) to a detached ``dtype`` tensor of ``shape``."""
    t = _to_torch(name, x, error)
    if shape is not None:
        check_shape(name, t, shape, error=error)
    return t.detach().to(device=device or t.device, dtype=dtype)


def as_vector(
    name: str,
    x: object,
    length: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    error: ErrorType = InvalidArgumentError,
) -> torch.Tensor:
    """Convert ``x`` to a 1-D ``dtype`` tensor of exactly ``length`` elements."""
    return as_tensor(name, x, dtype=dtype, shape=(length,), device=device, error=error)


def _to_torch(name: str, x: object, error: ErrorType) -> torch.Tensor:
    """Any accepted input as a torch tensor of a real numeric dtype (no copy when possible)."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool or x.is_complex():
            raise error(describe(name, x.dtype, "a real-valued tensor"))
        return x
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as exc:  # ragged nesting, unconvertible objects
        raise error(describe(name, type(x).__name__, f"numbers, a NumPy array or a torch tensor ({exc})")) from None
    if arr.dtype.kind not in _NUMPY_NUMERIC:
        raise error(describe(name, f"{type(x).__name__} of {arr.dtype}", "real numbers"))
    # torch cannot wrap every NumPy int width / byte order: ints and odd floats become float64.
    # Copying also keeps the caller's (possibly read-only) array out of the cache.
    native = arr.dtype.kind == "f" and arr.dtype.isnative and arr.dtype != np.float16
    return torch.from_numpy(np.array(arr, dtype=arr.dtype if native else np.float64, order="C", copy=True))


def check_finite(name: str, t: torch.Tensor, *, error: ErrorType = InvalidArgumentError) -> None:
    """Raise unless every element of ``t`` is finite (no NaN, no infinity)."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = t[~torch.isfinite(t)].flatten()[0].item()
        raise error(describe(name, f"an element {bad}", "finite values only"))


def check_index(
    name: str,
    value: object,
    size: int,
    *,
    error: ErrorType = OutOfRangeError,
    type_error: ErrorType = InvalidArgumentError,
) -> int:
    """Return ``value`` if it is an int in ``[0, size)``; raise ``error`` if out of range, ``type_error`` if no int."""
    try:
        return check_int(name, value, low=0, high=size - 1)
    except OutOfRangeError:
        raise error(describe(name, value, f"an integer in [0, {size})")) from None
    except InvalidArgumentError as exc:  # not an integer at all
        raise type_error(str(exc)) from None


def check_between(name: str, value: object, low: int, high: int) -> int:
    """Return ``value`` as an int in ``[low, high]``, else raise InvalidArgumentError (even when out of range)."""
    v = check_int(name, value, low=low)
    if v > high:
        raise InvalidArgumentError(describe(name, value, f"an integer in [{low}, {high}]"))
    return v


def to_numpy(t: torch.Tensor, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """A fresh, writable NumPy array of ``dtype`` holding ``t`` (moved to the CPU)."""
    return t.detach().to("cpu").numpy().astype(dtype, copy=True)


def readonly(arr: np.ndarray) -> np.ndarray:
    """Mark ``arr`` read-only and return it (for views in a documented layout)."""
    arr.flags.writeable = False
    return arr


def make_pool(
    pool: KVPool | None,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int | None = None,
    device: str | torch.device | None = None,
) -> KVPool:
    """A private growable pool of this geometry, or ``pool`` after checking it matches."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        check_int(name, value, low=1)
    if pool is None:
        return KVPool(
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
            block_size=16 if block_size is None else block_size, device=device or "cpu",
        )
    if not isinstance(pool, KVPool):
        raise InvalidArgumentError(describe("pool", type(pool).__name__, "a KVPool or None"))
    pool.compatible(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    if block_size is not None:
        pool.compatible(block_size=block_size)
    if device is not None and not _same_device(check_device("device", device), pool.storage.device):
        raise InvalidArgumentError(describe("device", str(device), f"{pool.storage.device} to match the pool"))
    return pool


def _same_device(want: torch.device, have: torch.device) -> bool:
    """Whether ``want`` names ``have`` ("cuda" matches "cuda:0" when that is the pool's)."""
    return want.type == have.type and (want.index is None or want.index == have.index)


def zero_pages(pool: KVPool, blocks: Sequence[int]) -> None:
    """Zero every slot of ``blocks`` in every layer (K, V and scales) of ``pool``.

    Pages come back from the pool holding whatever their last owner wrote; a
    facade that can expose slots it never wrote zeroes them first, so caches
    sharing a pool never see each other's data. Only call it on pages no other
    sequence references (freshly taken ones).
    """
    if blocks:
        index = torch.as_tensor(list(blocks), dtype=torch.int64, device=pool.storage.device)
        for t in pool.storage.tensors():  # each [num_blocks, block_size, ...]
            bits = t.view(torch.uint8) if t.element_size() == 1 else t  # fp8 has no index_fill on CPU
            bits.index_fill_(0, index, 0)  # all-zero bits: 0 for every dtype


def extend_zeroed(seq: PagedSeq, n: int) -> int:
    """``seq.extend(n)``, zeroing the pages it takes; returns the first new position."""
    held = seq.num_pages
    start = seq.extend(n)
    zero_pages(seq.pool, seq.block_table()[held:])
    return start

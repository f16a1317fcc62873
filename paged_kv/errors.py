"""The one exception hierarchy of paged-kv.

Every error raised on bad input derives from :class:`PagedKVError`. The concrete
classes also derive from the matching built-in (``ValueError``, ``IndexError``,
``KeyError``, ``MemoryError``) so callers that catch built-ins keep working.
A call that raises leaves every object it touched exactly as it was.
"""

from __future__ import annotations

import math
import numbers
import operator


class PagedKVError(Exception):
    """Base class of every error paged-kv raises on bad input or exhausted resources."""


class InvalidArgumentError(PagedKVError, ValueError):
    """An argument has a wrong value, type, shape or dtype."""


class OutOfRangeError(PagedKVError, IndexError):
    """An index (layer, position, block id, slot) lies outside its valid range."""


class UnknownSequenceError(PagedKVError, KeyError):
    """A sequence id is not known to the block manager."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateSequenceError(PagedKVError, ValueError):
    """A sequence id is already in use."""


class SequenceStateError(PagedKVError, ValueError):
    """The operation does not fit the sequence's state (e.g. appending to a swapped-out sequence)."""


class OutOfBlocksError(PagedKVError, MemoryError):
    """Not enough free blocks for the request; nothing was allocated."""


class ClosedError(PagedKVError, ValueError):
    """The object was closed and takes no more work (like I/O on a closed file)."""


class WorkerError(PagedKVError, RuntimeError):
    """A tensor-parallel worker died, hung past the timeout or failed; the engine cannot go on."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank  # the failed worker's rank, None when the collective could not tell


class PublisherClosedError(PagedKVError, RuntimeError):
    """An event publisher was asked to publish after its shutdown."""


def describe(name: str, value: object, expected: str) -> str:
    """Format the standard message: argument name, the value given, what was expected."""
    return f"{name}={value!r}: expected {expected}"


def check_int(name: str, value: object, *, low: int = 0, high: int | None = None) -> int:
    """Return ``value`` if it is an int in ``[low, high]``, else raise a typed error naming it."""
    if isinstance(value, bool):
        raise InvalidArgumentError(describe(name, value, "an integer"))
    if not isinstance(value, int):
        try:
            value = operator.index(value)  # numpy / torch integer scalars
        except TypeError:
            raise InvalidArgumentError(describe(name, value, "an integer")) from None
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        err = OutOfRangeError if high is not None else InvalidArgumentError
        raise err(describe(name, value, f"an integer {bound}"))
    return value


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool (``0``/``1`` and other truthy objects are rejected), else raise."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(describe(name, value, "a bool"))
    return value


def check_real(
    name: str, value: object, *, low: float = -math.inf, high: float = math.inf,
    open_low: bool = False, open_high: bool = False,
) -> float:
    """Return ``value`` as a finite float in the interval, else raise (bools, NaN and infinities are rejected)."""
    bounded = math.isfinite(low) or math.isfinite(high)
    interval = f" in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}" if bounded else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy float scalars are Real
        raise InvalidArgumentError(describe(name, value, f"a finite number{interval}"))
    x = float(value)
    inside = (low < x if open_low else low <= x) and (x < high if open_high else x <= high)
    if not (math.isfinite(x) and inside):
        raise InvalidArgumentError(describe(name, value, f"a finite number{interval}"))
    return x


def check_type(name: str, value: object, cls: type | tuple[type, ...], expected: str) -> None:
    """Raise InvalidArgumentError unless ``value`` is an instance of ``cls`` (described as ``expected``)."""
    if not isinstance(value, cls):
        raise InvalidArgumentError(describe(name, type(value).__name__, expected))

"""Token specs (a list of token ids, or a count of anonymous tokens) and id lists: the one place ids are validated."""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from collections.abc import Sequence

from paged_kv.errors import InvalidArgumentError, describe

Tokens = Sequence[int] | int
MAX_TOKENS_PER_CALL = 1 << 24
_SIGN_BYTE = 7 if sys.byteorder == "little" else 0  # the byte of an int64 that holds its sign bit
_LOW_BYTE = 7 - _SIGN_BYTE  # the byte of an int64 that holds its lowest 8 bits
_NONE = object()  # "no bad id found" (None itself may be the bad id)
_MAX_PACKED = 1 << 16  # longer lists take the slow path rather than a huge argument tuple


def as_token_list(name: str, token_ids: Tokens) -> list[int] | None:
    """Validate a token spec; return the ids as a list, or None for an anonymous count."""
    if isinstance(token_ids, int) and not isinstance(token_ids, bool):
        if not 0 <= token_ids <= MAX_TOKENS_PER_CALL:
            raise InvalidArgumentError(describe(name, token_ids, f"a count in [0, {MAX_TOKENS_PER_CALL}]"))
        return None
    return as_id_list(name, token_ids, "token ids", "a sequence of token ids or a count")


def as_id_list(name: str, ids: object, noun: str = "ids", expected: str | None = None) -> list[int]:
    """Validate a sequence of non-negative int64 ids (bools, floats, negatives rejected); return it as a list.

    Accepts lists, tuples, numpy arrays and torch tensors; ``noun`` names the ids in messages
    and ``expected`` describes what a non-sequence should have been.
    """
    if hasattr(ids, "tolist"):  # numpy arrays, torch tensors
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidArgumentError(describe(name, type(ids).__name__, expected or f"a sequence of {noun}"))
    items = list(ids)
    if len(items) > MAX_TOKENS_PER_CALL:
        raise InvalidArgumentError(describe(f"len({name})", len(items), f"at most {MAX_TOKENS_PER_CALL}"))
    if _valid_int64_array(items) is not None:
        return items
    bad = next((t for t in items if not _is_int64(t)), _NONE)  # name the first bad id
    if bad is not _NONE:
        raise InvalidArgumentError(describe(name, bad, f"{noun} as int64 integers"))
    if items and min(items) < 0:
        raise InvalidArgumentError(describe(name, min(items), f"non-negative {noun}"))
    return items


def as_token_array(name: str, token_ids: Tokens) -> array | None:
    """Validate a token spec exactly as ``as_token_list`` does; return the ids as ``array('q')``, or None."""
    if type(token_ids) is list or type(token_ids) is tuple:
        ids = _valid_int64_array(token_ids)
        if ids is not None:
            return ids
    tokens = as_token_list(name, token_ids)  # the slow path names what is wrong
    return None if tokens is None else array("q", tokens)


def _valid_int64_array(tokens: list[int] | tuple[int, ...]) -> array | None:
    """The ids as int64 if every one is valid and there are few enough, else None."""
    if len(tokens) > min(MAX_TOKENS_PER_CALL, _MAX_PACKED):
        return None
    try:
        data = struct.pack(f"{len(tokens)}q", *tokens)  # native int64, as array('q'), but ~3x faster
    except (struct.error, TypeError, OverflowError):
        return None
    if not data[_SIGN_BYTE::8].isascii() or _has_bool(tokens, data):  # a negative id, or a bool
        return None
    ids = array("q")
    ids.frombytes(data)
    return ids


def _has_bool(tokens: list[int] | tuple[int, ...], data: bytes) -> bool:
    """Whether a token is a bool: only ids whose low byte is 0 or 1 can be, so only those are looked at."""
    lows = data[_LOW_BYTE::8]  # [T] the low byte of every packed id
    for byte in (0, 1):
        i = lows.find(byte)
        while i >= 0:
            if type(tokens[i]) is bool:
                return True
            i = lows.find(byte, i + 1)
    return False


def _is_int64(t: object) -> bool:
    """Whether ``t`` is an integer (never a bool) that fits in int64."""
    if isinstance(t, bool):
        return False
    try:
        return -(1 << 63) <= operator.index(t) < (1 << 63)
    except TypeError:
        return False

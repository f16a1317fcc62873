"""Token specs: a list of token ids, or a count of anonymous tokens."""

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
_MAX_PACKED = 1 << 16  # longer lists take the slow path rather than a huge argument tuple


def as_token_list(name: str, token_ids: Tokens) -> list[int] | None:
    """Validate a token spec; return the ids as a list, or None for an anonymous count."""
    if isinstance(token_ids, int) and not isinstance(token_ids, bool):
        if not 0 <= token_ids <= MAX_TOKENS_PER_CALL:
            raise InvalidArgumentError(describe(name, token_ids, f"a count in [0, {MAX_TOKENS_PER_CALL}]"))
        return None
    if hasattr(token_ids, "tolist"):  # numpy arrays, torch tensors
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise InvalidArgumentError(describe(name, type(token_ids).__name__, "a sequence of token ids or a count"))
    tokens = list(token_ids)
    if len(tokens) > MAX_TOKENS_PER_CALL:
        raise InvalidArgumentError(describe(f"len({name})", len(tokens), f"at most {MAX_TOKENS_PER_CALL}"))
    try:
        array("q", tokens)
    except (TypeError, OverflowError):
        bad = next((t for t in tokens if not _is_int64(t)), None)
        raise InvalidArgumentError(describe(name, bad, "token ids as int64 integers")) from None
    if tokens and min(tokens) < 0:
        raise InvalidArgumentError(describe(name, min(tokens), "non-negative token ids"))
    return tokens


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
    if not data[_SIGN_BYTE::8].isascii():  # a sign bit is set: a negative id
        return None
    ids = array("q")
    ids.frombytes(data)
    return ids


def _is_int64(t: object) -> bool:
    try:
        return -(1 << 63) <= operator.index(t) < (1 << 63)
    except TypeError:
        return False

"""Helpers of the tool-calling reader tests: calls written as a model may write them, and piecewise reading."""

from __future__ import annotations

import json

from hypothesis import strategies as st

SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner,
                      max_size=3), max_leaves=8)  # fmt: skip
# (name, arguments): names with quotes, backslashes, control and non-ASCII characters; arguments often {}
CALLS = st.tuples(st.text(min_size=1, max_size=8), st.dictionaries(st.text(max_size=6), VALUES, max_size=3))
# how a JSON text is written: ASCII-only (\u escapes) or not, and the whitespace around its tokens
STYLES = st.tuples(st.booleans(), st.sampled_from(["", " ", "\n", " \t\r\n"]))


def write(value: object, style: tuple[bool, str]) -> str:
    """``value`` as JSON text in ``style`` (ASCII-only or not, this whitespace after each separator)."""
    ascii_only, space = style
    return json.dumps(value, ensure_ascii=ascii_only, separators=("," + space, ":" + space))


def read_split(reader, text: str, cuts: list[int]) -> list:
    """Everything ``reader`` returns for ``text`` split at ``cuts`` (taken modulo its length + 1), then its end."""
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [p for a, b in zip(bounds, bounds[1:]) for p in reader.feed(text[a:b])] + reader.finish()

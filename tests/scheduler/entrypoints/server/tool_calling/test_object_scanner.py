"""The scanner of a JSON object's top-level members: keys, raw value text, value ends, whatever the split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.entrypoints.server.tool_calling.object_scanner import ObjectScanner

TEXT = ' {"na\\"me": "we]a\\"th{er" , "args" :{"a": [1, {"b": "}"}]} , "n": -1.5e3 , "t":true,"z":null}tail'


def scan(text: str, cuts: list[int]) -> tuple[list[tuple[str, str]], int, str]:
    """The events of ``text`` fed split at ``cuts`` (text pieces of one value joined), the characters the object
    used, and the scanner's state."""
    scanner, events, used = ObjectScanner(), [], 0
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for a, b in zip(bounds, bounds[1:]):
        made, n = scanner.feed(text[a:b])
        events += made
        used += n
    merged: list[tuple[str, str]] = []
    for kind, piece in events:
        if merged and kind == merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + piece)
        else:
            merged.append((kind, piece))
    return merged, used, scanner.state


def test_keys_come_decoded_and_values_as_written_each_ended():
    events, used, state = scan(TEXT, [])
    assert events == [("key", 'na"me'), ("text", '"we]a\\"th{er"'), ("end", ""),
                      ("key", "args"), ("text", '{"a": [1, {"b": "}"}]}'), ("end", ""),
                      ("key", "n"), ("text", "-1.5e3"), ("end", ""), ("key", "t"), ("text", "true"), ("end", ""),
                      ("key", "z"), ("text", "null"), ("end", "")]  # fmt: skip
    assert (used, state) == (len(TEXT) - len("tail"), "done")


def test_a_string_or_object_value_ends_at_its_closing_character_a_scalar_at_what_follows():
    scanner = ObjectScanner()
    assert scanner.feed('{"a": {"b": 1}')[0][-1] == ("end", "")
    assert scanner.feed(', "c": 12')[0] == [("key", "c"), ("text", "12")]  # 12 may go on: 123
    assert scanner.feed(" ")[0] == [("end", "")]


@pytest.mark.parametrize("text", ['x{"a": 1}', '{"a" 1}', '{"a": ,}', "{1: 2}", '{"a": 1 "b"', '{"\\x": 1}'])
def test_a_broken_top_level_stops_the_reading(text):
    _, used, state = scan(text, [])
    assert state == "bad" and used < len(text)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, len(TEXT)), max_size=10))
def test_any_split_makes_the_same_events(cuts):
    assert scan(TEXT, cuts) == scan(TEXT, [])

"""The hermes tool-call reader on plain strings: calls, content around them, malformed blocks, and piecewise reading."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.entrypoints.server.hermes_parser import HermesReader, parse_hermes

WEATHER = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TIME = '<tool_call>{"name": "time", "arguments": {"zone": "\u00e9t\u00e9"}}</tool_call>'


def calls(text: str) -> list[tuple[str, dict]]:
    """The (name, decoded arguments) of each call read from ``text``."""
    return [(c.name, json.loads(c.arguments)) for c in parse_hermes(text)[1]]


def test_a_well_formed_call_has_no_content():
    content, [call] = parse_hermes(WEATHER)
    assert content is None and call.index == 0
    assert (call.name, json.loads(call.arguments)) == ("weather", {"city": "Paris", "days": 2})


def test_several_calls_are_numbered_in_order_and_keep_non_ascii_text():
    content, read = parse_hermes(WEATHER + "\n" + TIME)
    assert content is None and [c.index for c in read] == [0, 1]
    assert calls(WEATHER + "\n" + TIME) == [("weather", {"city": "Paris", "days": 2}), ("time", {"zone": "été"})]
    assert "été" in read[1].arguments  # not escaped: as the model wrote it


def test_text_before_and_after_the_calls_is_the_content():
    content, read = parse_hermes("Let me look.\n" + WEATHER + " Done.")
    assert content == "Let me look.\n Done." and len(read) == 1


@pytest.mark.parametrize("block", [
    '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>',  # malformed JSON
    '<tool_call>["weather"]</tool_call>',  # not an object
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "weather", "arguments": "city=Paris"}</tool_call>',  # arguments not an object
])  # fmt: skip
def test_a_block_that_is_not_a_call_stays_in_the_content_as_written(block):
    content, read = parse_hermes("a " + block + WEATHER)
    assert content == "a " + block and [c.name for c in read] == ["weather"]


def test_text_without_a_tag_is_all_content_and_whitespace_alone_is_none():
    assert parse_hermes("no tools <tool here") == ("no tools <tool here", [])
    assert parse_hermes(" \n" + WEATHER + "\n") == (None, parse_hermes(WEATHER)[1])


def test_a_block_left_open_at_the_end_is_read_as_closed():
    assert calls(WEATHER[: -len("</tool_call>")]) == [("weather", {"city": "Paris", "days": 2})]
    assert parse_hermes("x <tool_call>{") == ("x <tool_call>{", [])


def test_piecewise_reading_holds_back_a_partial_tag_and_sends_each_call_once_closed():
    reader = HermesReader()
    assert reader.feed("Hi <tool") == ["Hi "]
    assert reader.feed('_call>{"name": "time", ') == []
    [call] = reader.feed('"arguments": {}}</tool_call> ok')[:1]
    assert (call.index, call.name, call.arguments) == (0, "time", "{}")
    assert reader.finish() == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 200), max_size=8))
def test_any_split_reads_as_the_whole_text(cuts):
    text = "Sure: " + WEATHER + " and <tool_call>{bad}</tool_call> <tool_" + TIME + " <tool_c"
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    reader = HermesReader()
    pieces = [p for a, b in zip(bounds, bounds[1:]) for p in reader.feed(text[a:b])] + reader.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    assert (content or None, [p for p in pieces if not isinstance(p, str)]) == parse_hermes(text)

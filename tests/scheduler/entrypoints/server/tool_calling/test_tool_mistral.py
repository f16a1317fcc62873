"""The mistral tool-call reader on plain strings: calls after [TOOL_CALLS], content, malformed arrays, piecewise."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_helpers import CALLS, STYLES, read_split, write

from scheduler.entrypoints.server.tool_calling.mistral import MistralReader, parse_mistral
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, joined

WEATHER = '{"name": "weather", "arguments": {"city": "Paris", "days": 2}}'
TIME = '{"arguments": {"zone": "\u00e9t\u00e9", "q": "a\\"]\\n"}, "name": "time"}'


def calls(text: str) -> list[tuple[str, dict]]:
    """The (name, decoded arguments) of each call read from ``text``."""
    return [(c.name, json.loads(c.arguments)) for c in parse_mistral(text)[1]]


def test_an_array_of_calls_after_the_tag_has_no_content():
    content, read = parse_mistral(f"[TOOL_CALLS] [{WEATHER}, {TIME}]")
    assert content is None and [c.index for c in read] == [0, 1]
    assert calls(f"[TOOL_CALLS][{WEATHER},{TIME}]") == [("weather", {"city": "Paris", "days": 2}),
                                                        ("time", {"zone": "été", "q": 'a"]\n'})]  # fmt: skip
    assert read[0].arguments == '{"city": "Paris", "days": 2}'  # led by its name: as written
    assert read[1].arguments == '{"zone": "été", "q": "a\\"]\\n"}'  # not led: re-serialized, non-ASCII kept


def test_text_before_the_tag_and_after_the_array_is_the_content():
    [call] = parse_mistral(f"[TOOL_CALLS][{WEATHER}]")[1]
    assert parse_mistral(f"Let me look. [TOOL_CALLS][{WEATHER}] Done.") == ("Let me look.  Done.", [call])


@pytest.mark.parametrize("text", ["no tools [TOOL here", "[TOOL_CALLS]", "a [TOOL_CALLS] {}", "[TOOL_CALLS][]",
                                  '[TOOL_CALLS][{"name": "", "arguments": {}}]', '[TOOL_CALLS][["weather"]]',
                                  '[TOOL_CALLS][{"arguments": {}}', " "])  # fmt: skip
def test_text_with_no_calls_is_all_content_as_written(text):
    assert parse_mistral(text) == (text if text.strip() else None, [])


def test_reading_calls_stops_at_an_element_that_is_no_call():
    text = f'[TOOL_CALLS][{WEATHER}, {{"name": "x", "arguments": 3}}, {TIME}]'
    content, read = parse_mistral(text)
    assert [c.name for c in read] == ["weather"] and content == text[text.index(', {"name": "x"') :]


def test_a_call_streams_its_name_first_then_its_arguments_and_a_cut_off_one_is_kept_as_far_as_written():
    reader = MistralReader()
    assert reader.feed("Hi [TOOL_") == ["Hi "]
    assert reader.feed('CALLS][{"name": "weather", "arguments": {"ci') == [CallPiece(0, "weather", '{"ci')]
    assert reader.feed('ty": 1') + reader.finish() == [CallPiece(0, None, 'ty": 1')]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 300), max_size=10))
def test_any_split_reads_as_the_whole_text(cuts):
    text = f"Sure [TOOL_C [TOOL_CALLS] [ {WEATHER} ,\n{TIME},{WEATHER[:-1]}, oops}}] tail"
    pieces = read_split(MistralReader(), text, cuts)
    content = "".join(p for p in pieces if isinstance(p, str))
    assert (content or None, joined(pieces)) == parse_mistral(text)
    assert [c.name for c in joined(pieces)] == ["weather", "time", "weather"] and content == "Sure [TOOL_C oops}] tail"


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(CALLS, STYLES), min_size=1, max_size=3), st.text(max_size=4),
       st.lists(st.integers(0, 10**4), max_size=12))  # fmt: skip
def test_written_calls_read_back_whole_and_in_any_split(written, before, cuts):
    """Names needing escapes, \\u escapes, non-ASCII text, {} arguments and any whitespace, split anywhere."""
    objects = [f"{{{write('name', s)}:{s[1]}{write(n, s)},{write('arguments', s)}:{write(a, s)}}}"
               for (n, a), s in written]  # fmt: skip
    text = before.replace("[", "") + "[TOOL_CALLS][" + ", ".join(objects) + "]"
    content, whole = parse_mistral(text)
    assert content == (before.replace("[", "") or None if before.replace("[", "").strip() else None)
    assert [(c.name, json.loads(c.arguments)) for c in whole] == [c for c, _ in written]
    pieces = read_split(MistralReader(), text, cuts)
    assert ("".join(p for p in pieces if isinstance(p, str)) or None, joined(pieces)) == (content, whole)

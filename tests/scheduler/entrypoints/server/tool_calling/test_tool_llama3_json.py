"""The llama3_json tool-call reader on plain strings: calls, content, malformed objects, and piecewise reading."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_helpers import CALLS, STYLES, read_split, write

from scheduler.entrypoints.server.tool_calling.llama3_json import Llama3JsonReader, parse_llama3_json
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, joined

WEATHER = '{"name": "weather", "parameters": {"city": "Paris", "days": 2}}'
TIME = '{"name": "time", "arguments": {"zone": "\u00e9t\u00e9", "q": "a\\"}\\n"}}'


def calls(text: str) -> list[tuple[str, dict]]:
    """The (name, decoded arguments) of each call read from ``text``."""
    return [(c.name, json.loads(c.arguments)) for c in parse_llama3_json(text)[1]]


@pytest.mark.parametrize("lead", ["", "<|python_tag|>", "\n ", " <|python_tag|> "])
def test_a_call_with_or_without_the_python_tag_has_no_content(lead):
    content, [call] = parse_llama3_json(lead + WEATHER)
    assert content is None and call.index == 0
    assert (call.name, json.loads(call.arguments)) == ("weather", {"city": "Paris", "days": 2})


def test_calls_separated_by_semicolons_are_numbered_in_order_and_keep_escapes_and_non_ascii_text():
    content, read = parse_llama3_json(WEATHER + "; " + TIME + " ;\n" + WEATHER)
    assert content is None and [c.index for c in read] == [0, 1, 2]
    assert calls(WEATHER + ";" + TIME) == [("weather", {"city": "Paris", "days": 2}),
                                           ("time", {"zone": "été", "q": 'a"}\n'})]  # fmt: skip
    assert read[1].arguments == '{"zone": "été", "q": "a\\"}\\n"}'  # as the model wrote it


@pytest.mark.parametrize("text", ["The weather is fine.", 'Sure: {"name": "f", "parameters": {}}', "", "  \n",
                                  "<|python_tag|>brave_search.call(query='x')", "<|python"])  # fmt: skip
def test_text_that_does_not_start_with_the_tag_or_a_brace_is_all_content(text):
    assert parse_llama3_json(text) == (text if text.strip() else None, [])


@pytest.mark.parametrize("text", [
    '{"answer": 42} is the answer',  # not a call
    '{"name": "", "parameters": {}}',  # no name
    '{"name": "f", "parameters": "x=1"}',  # arguments not an object
    '{"name": f, "parameters": {}}',  # malformed JSON
    '{"name": "f"',  # cut off before its arguments
])  # fmt: skip
def test_an_object_that_is_not_a_call_is_content_as_written(text):
    assert parse_llama3_json(text) == (text, [])


def test_reading_calls_stops_at_what_is_neither_a_separator_nor_a_call_and_the_rest_is_content():
    assert parse_llama3_json(WEATHER + " Done.") == (" Done.", parse_llama3_json(WEATHER)[1])
    assert parse_llama3_json(WEATHER + '; {"x": 1}; ' + TIME) == ('; {"x": 1}; ' + TIME, parse_llama3_json(WEATHER)[1])
    assert parse_llama3_json(WEATHER + "; ") == (None, parse_llama3_json(WEATHER)[1])  # a trailing separator


def test_an_object_not_led_by_its_name_is_a_call_once_closed_with_its_arguments_re_serialized():
    text = '{"parameters": {"a":1}, "name": "f"}'
    assert parse_llama3_json(text) == (None, [CallPiece(0, "f", '{"a": 1}')])
    assert parse_llama3_json('{"name": "f", "parameters": {"a": 1}, "arguments": {"b": 2}}')[1] == [
        CallPiece(0, "f", '{"a": 1}')]  # led by "parameters": those stream  # fmt: skip


def test_a_call_streams_its_name_first_then_its_arguments_as_written():
    reader = Llama3JsonReader()
    assert reader.feed("<|python") == []
    assert reader.feed('_tag|>{"name": "time", ') == []
    assert reader.feed('"parameters": {"zone": "a') == [CallPiece(0, "time", '{"zone": "a')]
    assert reader.feed('"}}; {"name"') == [CallPiece(0, None, '"}')]
    assert reader.feed(': "g", "parameters": {}}') + reader.finish() == [CallPiece(1, "g", "{}")]


def test_a_streamed_call_is_kept_when_its_object_breaks_and_the_text_from_the_break_is_content():
    assert parse_llama3_json('{"name": "f", "parameters": {"x": 1}, oops} x') == (
        "oops} x", [CallPiece(0, "f", '{"x": 1}')])  # fmt: skip


def test_a_streamed_calls_arguments_are_its_text_as_written_json_or_not():
    """Whole or streamed alike (a stream cannot take back what it sent); vLLM's whole answer would be content."""
    assert parse_llama3_json('{"name": "f", "parameters": {"x": }}') == (None, [CallPiece(0, "f", '{"x": }')])


def test_a_call_cut_off_by_the_end_of_the_text_is_a_call_as_far_as_it_was_written():
    assert parse_llama3_json('{"name": "f", "parameters": {"x": 1') == (None, [CallPiece(0, "f", '{"x": 1')])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 400), max_size=10))
def test_any_split_reads_as_the_whole_text(cuts):
    text = " <|python_tag|>" + WEATHER + " ;" + TIME + ';{"parameters": {"s": "\\"}"}, "name": "g"}; ' + WEATHER[:-1] \
        + ', oops} and {"x": 1}'
    pieces = read_split(Llama3JsonReader(), text, cuts)
    content = "".join(p for p in pieces if isinstance(p, str))
    assert (content or None, joined(pieces)) == parse_llama3_json(text)
    assert [c.name for c in joined(pieces)] == ["weather", "time", "g", "weather"] and content == 'oops} and {"x": 1}'


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(CALLS, STYLES, st.sampled_from(["parameters", "arguments"])), min_size=1, max_size=3),
       st.booleans(), st.lists(st.integers(0, 10**4), max_size=12))  # fmt: skip
def test_written_calls_read_back_whole_and_in_any_split(written, tagged, cuts):
    """Names needing escapes, \\u escapes, non-ASCII text, {} arguments and any whitespace, split anywhere."""
    objects = [f"{{{write('name', s)}:{s[1]}{write(n, s)},{write(key, s)}:{write(a, s)}}}"
               for (n, a), s, key in written]  # fmt: skip
    text = ("<|python_tag|>" if tagged else "") + "; ".join(objects)
    content, whole = parse_llama3_json(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in whole] == [c for c, _, _ in written]
    pieces = read_split(Llama3JsonReader(), text, cuts)
    assert ("".join(p for p in pieces if isinstance(p, str)) or None, joined(pieces)) == (content, whole)

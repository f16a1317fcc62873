"""The hermes tool-call reader on plain strings: calls, content around them, malformed blocks, and piecewise reading."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_helpers import CALLS, STYLES, read_split, write

from scheduler.entrypoints.server.tool_calling.hermes import HermesReader, parse_hermes
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, joined

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


def feed(text: str, cuts: list[int]) -> list:
    """Everything a reader returns for ``text`` split at ``cuts``, then its end."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    reader = HermesReader()
    return [p for a, b in zip(bounds, bounds[1:]) for p in reader.feed(text[a:b])] + reader.finish()


def test_piecewise_reading_holds_back_a_partial_tag_and_streams_a_call_name_first():
    reader = HermesReader()
    assert reader.feed("Hi <tool") == ["Hi "]
    assert reader.feed('_call>{"name": "time", ') == []
    assert reader.feed('"arguments": {"zone": "a\\"}') == [CallPiece(0, "time", '{"zone": "a\\"}')]
    assert reader.feed('"}}</tool_c') == [CallPiece(0, None, '"}')]  # the object's own brace is no argument
    assert reader.feed("all> ok") + reader.finish() == [" ok"]


def test_a_call_streamed_piece_by_piece_joins_into_the_whole_texts_call():
    text = '<tool_call>\n{"name": "weather", "arguments": {"q": "{\\"}]", "n": [1, {"x": {}}]}}\n</tool_call>'
    pieces = feed(text, list(range(len(text))))
    assert pieces[0] == CallPiece(0, "weather", "{") and len(pieces) > 10
    assert all(p.name is None for p in pieces[1:])
    assert joined(pieces) == parse_hermes(text)[1] == [CallPiece(0, "weather", text[text.index("{\"q"):-14])]


@pytest.mark.parametrize("body", [
    '{"arguments": {"a": 1}, "name": "f"}',  # arguments first
    '{"name": "f", "id": 3, "arguments": {"a": 1}}',  # another key between
])  # fmt: skip
def test_a_block_not_led_by_name_then_arguments_goes_out_whole_at_its_end(body):
    reader = HermesReader()
    assert reader.feed("<tool_call>" + body) == []
    assert joined(reader.feed("</tool_call>") + reader.finish()) == [CallPiece(0, "f", '{"a": 1}')]


def test_a_block_malformed_after_its_call_began_keeps_the_call_and_drops_the_rest():
    """What a stream sends (as vLLM's: the rest of the block is no delta): never content and a call for one block's
    text. Read whole, the same text is content, as any closed block that is not a call is."""
    text = 'a <tool_call>{"name": "f", "arguments": {"x": 1}, oops}</tool_call> b'
    streamed = feed(text, [text.index('{"x"') + 1])
    assert streamed == ["a ", CallPiece(0, "f", "{"), CallPiece(0, None, '"x": 1}'), " b"]
    assert parse_hermes(text) == (text, [])


def test_a_call_cut_off_by_the_end_of_the_text_is_a_call_as_far_as_it_was_written_whole_or_streamed():
    text = 'a <tool_call>{"name": "f", "arguments": {"x": 1'
    assert parse_hermes(text) == ("a ", [CallPiece(0, "f", '{"x": 1')])
    assert feed(text, [text.index('{"x"') + 1]) == ["a ", CallPiece(0, "f", "{"), CallPiece(0, None, '"x": 1')]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=8))
def test_any_split_reads_as_the_whole_text(cuts):
    text = ("Sure: " + WEATHER + " and <tool_call>{bad}</tool_call> <tool_" + TIME + " <tool_c"
            + '<tool_call>{"arguments": {"s": "\\"}"}, "name": "g"}</tool_call><tool_call>{"name": "h", "arguments": '
            + '{"t": [{"u": "</tool"}]}}</tool_call> <tool_call>{"name": "i", "arguments": "x"}</tool_call>'
            )  # fmt: skip
    pieces = feed(text, cuts)
    content = "".join(p for p in pieces if isinstance(p, str))
    assert (content or None, joined(pieces)) == parse_hermes(text)
    assert [c.name for c in joined(pieces)] == ["weather", "time", "g", "h"]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(CALLS, STYLES), min_size=1, max_size=3), st.text(max_size=4),
       st.lists(st.integers(0, 10**4), max_size=12))  # fmt: skip
def test_written_calls_read_back_whole_and_in_any_split(written, before, cuts):
    """Names needing escapes, \\u escapes, non-ASCII text, {} arguments and any whitespace, split anywhere: each call
    reads back as written (arguments decoding to what was written), and a stream joins into the whole reading."""
    text = before.replace("<", "") + "".join(
        f"<tool_call>{s[1]}{{{write('name', s)}:{s[1]}{write(n, s)},{write('arguments', s)}:{write(a, s)}}}</tool_call>"
        for (n, a), s in written
    )  # fmt: skip
    content, whole = parse_hermes(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole] == [call for call, _ in written]
    pieces = read_split(HermesReader(), text, cuts)
    assert ("".join(p for p in pieces if isinstance(p, str)) or None, joined(pieces)) == (content, whole)


TAGGED = '<tool_call>{"name": "echo", "arguments": {"text": "use </tool_call> here", "</tool_call>": 1}}</tool_call>'


def test_an_end_tag_inside_a_json_string_of_an_open_block_is_text_of_the_string():
    """vLLM's regex ends the block at the first ``</tool_call>`` wherever it is (its JSON then fails: all content)."""
    content, [call] = parse_hermes("a " + TAGGED + " b")
    assert content == "a  b"
    assert (call.name, json.loads(call.arguments)) == ("echo", {"text": "use </tool_call> here", "</tool_call>": 1})
    pieces = feed("a " + TAGGED + " b", list(range(len(TAGGED) + 4)))  # one character at a time
    assert ("".join(p for p in pieces if isinstance(p, str)), joined(pieces)) == ("a  b", [call])
    assert len(joined(pieces)) == 1 and sum(isinstance(p, CallPiece) for p in pieces) > 10  # streamed as written


def test_an_end_tag_outside_strings_ends_an_open_block_and_one_after_the_object_ends_it_wherever():
    broken = '<tool_call>{"name": "f", "arguments": {"a": </tool_call> tail'
    assert parse_hermes(broken) == (broken, [])  # the JSON is broken: the block is content as written
    after = '<tool_call>{"name": "f", "arguments": {}} "</tool_call> x"'
    assert parse_hermes(after) == (after, [])  # the object had ended: the tag counts; trailing text: no call


def test_a_complete_object_not_followed_directly_by_the_end_tag_is_no_call():
    """The body is the object and whitespace or it is no call (as vLLM's json.loads of the body decides)."""
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}} and more</tool_call> ok'
    assert parse_hermes(text) == (text, [])
    spaced = '<tool_call> {"name": "f", "arguments": {}}\n </tool_call>'
    assert parse_hermes(spaced) == (None, [CallPiece(0, "f", "{}")])


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(["</tool_call>", "<tool_call>", "</tool_", "\\\"", "x", "é", "}", "{"]), max_size=6),
       st.lists(st.integers(0, 10**4), max_size=12))  # fmt: skip
def test_tags_in_argument_strings_read_back_whole_and_in_any_split(parts, cuts):
    value = "".join(parts)
    text = "hi " + f"<tool_call>{json.dumps({'name': 'echo', 'arguments': {'t': value, value: [value]}})}</tool_call>"
    content, whole = parse_hermes(text)
    assert content == "hi " and [(c.name, json.loads(c.arguments)) for c in whole] == [("echo", {"t": value,
                                                                                               value: [value]})]
    pieces = read_split(HermesReader(), text, cuts)
    assert ("".join(p for p in pieces if isinstance(p, str)) or None, joined(pieces)) == (content, whole)

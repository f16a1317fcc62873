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
NESTED = '{"q": "a\\"]\\n[TOOL_CALLS]", "where": {"city": "Zürich", "at": [1, {"x": null}]}}'
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


SPLIT = [  # (text, its calls' names, its content): the array format, then the name[ARGS] one
    (f"Sure [TOOL_C [TOOL_CALLS] [ {WEATHER} ,\n{TIME},{WEATHER[:-1]}, oops}}] tail", ["weather", "time", "weather"],
     "Sure [TOOL_C oops}] tail"),
    (f'Sure [TOOL_C [TOOL_CALLS] a[ARGS]{NESTED} [TOOL_CALLS]b_1[ARGS]{{}}[TOOL_CALLS]c[ARGS]{{"k" oops}} tail',
     ["a", "b_1", "c"], "Sure [TOOL_C oops} tail"),
]


@pytest.mark.parametrize(("text", "names", "said"), SPLIT)
@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 300), max_size=10))
def test_any_split_reads_as_the_whole_text(text, names, said, cuts):
    pieces = read_split(MistralReader(), text, cuts)
    content = "".join(p for p in pieces if isinstance(p, str))
    assert (content or None, joined(pieces)) == parse_mistral(text)
    assert [c.name for c in joined(pieces)] == names and content == said


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


# The [TOOL_CALLS]name[ARGS]{...} format of Mistral's tokenizers v11+ (Mistral Small 3.2, Devstral, Magistral).


def test_a_named_call_after_the_tag_has_its_arguments_as_written():
    assert parse_mistral('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}') == (
        None, [CallPiece(0, "get_weather", '{"city": "Paris"}')])  # fmt: skip
    content, [call] = parse_mistral(f"[TOOL_CALLS]find.place-2[ARGS] {NESTED}")
    assert content is None and (call.name, call.arguments) == ("find.place-2", NESTED)
    assert json.loads(call.arguments)["where"]["city"] == "Zürich"  # escapes and non-ASCII kept as written


def test_several_tags_in_a_row_are_several_calls_and_text_around_them_is_content():
    text = f'Let me check. [TOOL_CALLS]a[ARGS]{{"x": 1}}\n[TOOL_CALLS]b[ARGS]{NESTED}[TOOL_CALLS]c[ARGS]{{}} Done.'
    content, read = parse_mistral(text)
    assert content == "Let me check.  Done."
    assert [(c.index, c.name, c.arguments) for c in read] == [(0, "a", '{"x": 1}'), (1, "b", NESTED), (2, "c", "{}")]


@pytest.mark.parametrize("text", ["[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]get_weather{}",
                                  "[TOOL_CALLS]get_weather[ARG]{}", "[TOOL_CALLS]get_weather", "x [TOOL_CALLS] ",
                                  '[TOOL_CALLS]"get"[ARGS]{}', "[TOOL_CALLS]f[ARGS]5",
                                  "[TOOL_CALLS]f[ARGS]"])  # fmt: skip
def test_a_malformed_name_missing_args_tag_or_object_is_content_as_written(text):
    assert parse_mistral(text) == (text, [])


def test_reading_named_calls_stops_at_a_malformed_one_whose_tag_on_is_content():
    text = '[TOOL_CALLS]a[ARGS]{"x": 1} [TOOL_CALLS]b c[ARGS]{} [TOOL_CALLS]d[ARGS]{}'
    content, read = parse_mistral(text)
    assert [c.name for c in read] == ["a"] and content == " [TOOL_CALLS]b c[ARGS]{} [TOOL_CALLS]d[ARGS]{}"
    assert parse_mistral('[TOOL_CALLS]a[ARGS]{"x": 1} then') == (" then", [CallPiece(0, "a", '{"x": 1}')])


def test_a_named_call_streams_its_name_first_then_its_arguments():
    reader = MistralReader()
    assert reader.feed("Hi [TOOL_CALLS]get_wea") == ["Hi "]
    assert reader.feed("ther[AR") == []
    assert reader.feed('GS]{"ci') == [CallPiece(0, "get_weather", '{"ci')]
    assert reader.feed('ty": "Paris"}[TOOL_') == [CallPiece(0, None, 'ty": "Paris"}')]
    assert reader.feed("CALLS]now[ARGS]{") == [CallPiece(1, "now", "{")]
    assert reader.feed('"z": 1') + reader.finish() == [CallPiece(1, None, '"z": 1')]  # cut off: as far as written


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,8}", fullmatch=True), CALLS, STYLES),
                min_size=1, max_size=3), st.text(max_size=4), st.lists(st.integers(0, 10**4), max_size=12))  # fmt: skip
def test_written_named_calls_read_back_whole_and_in_any_split(written, before, cuts):
    """Arguments with \\u escapes, non-ASCII text, {} and any whitespace, after names, split anywhere."""
    before = before.replace("[", "")
    text = before + "".join(f"[TOOL_CALLS]{name}[ARGS]{write(a, s)}" for name, (_, a), s in written)
    content, whole = parse_mistral(text)
    assert content == (before if before.strip() else None)
    assert [(c.name, json.loads(c.arguments)) for c in whole] == [(name, a) for name, (_, a), _ in written]
    pieces = read_split(MistralReader(), text, cuts)
    assert ("".join(p for p in pieces if isinstance(p, str)) or None, joined(pieces)) == (content, whole)

"""The readers of a named function's and of "required"'s output, whole and piece by piece."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from tool_helpers import CALLS, STYLES, read_split, write

from scheduler.entrypoints.server.tool_calling.readers import CallPiece, NamedReader, RequiredReader, joined

REQUIRED = ('[{"name": "weather", "parameters": {"city": "Pa]ri}s\\"{"}}, '
            '{"name": "time", "parameters": {"zone": [1, {"a": 2}]}}]')  # fmt: skip


def read(reader, text: str, step: int) -> list:
    """Everything ``reader`` returns for ``text`` fed ``step`` characters at a time, then its end."""
    return [p for i in range(0, len(text), step) for p in reader.feed(text[i : i + step])] + reader.finish()


def test_required_calls_stream_their_name_then_their_parameters_as_written_whatever_the_split():
    for step in (1, 3, len(REQUIRED)):
        pieces = read(RequiredReader(), REQUIRED, step)
        assert joined(pieces) == [CallPiece(0, "weather", '{"city": "Pa]ri}s\\"{"}'),
                                  CallPiece(1, "time", '{"zone": [1, {"a": 2}]}')]  # fmt: skip
        assert [p.index for p in pieces] == sorted(p.index for p in pieces)
        assert [p.name for p in pieces if p.name] == ["weather", "time"]  # each call's first piece names it
    pieces = read(RequiredReader(), REQUIRED, 1)
    assert pieces[0] == CallPiece(0, "weather", "")  # named as soon as the name's string closes
    assert sum(p.index == 0 for p in pieces) == len('{"city": "Pa]ri}s\\"{"}') + 1  # a piece per character


def test_the_parameters_text_excludes_the_space_and_brace_around_it():
    text = '[ {"name" : "w" ,\n "parameters" : { } \n} , {"name": "t", "parameters": {"x": "a b"}}]'
    assert joined(read(RequiredReader(), text, 2)) == [CallPiece(0, "w", "{ }"), CallPiece(1, "t", '{"x": "a b"}')]


def test_parameters_before_the_name_are_held_until_the_name_is_known():
    reader = RequiredReader()
    assert reader.feed('[{"parameters": {"a": 1}, ') == []
    assert reader.feed('"name": "f"') == [CallPiece(0, "f", '{"a": 1}')]
    assert reader.feed("}]") + reader.finish() == []


def test_a_required_element_cut_off_is_a_call_as_far_as_it_was_written_once_named():
    cut = REQUIRED.index("ri}s") + 4
    assert joined(read(RequiredReader(), REQUIRED[:cut], 4)) == [CallPiece(0, "weather", '{"city": "Pa]ri}s')]
    assert read(RequiredReader(), '[{"name": "weat', 2) == []  # not yet named: no call
    assert read(RequiredReader(), '[{"name": 3, "parameters": {}}]', 2) == []  # not a name


def test_a_named_call_streams_its_text_as_arguments_naming_the_function_first():
    pieces = read(NamedReader("weather"), '{"city": "Paris"}', 5)
    assert pieces[0] == CallPiece(0, "weather", '{"cit') and all(p.name is None for p in pieces[1:])
    assert "".join(p.arguments for p in pieces) == '{"city": "Paris"}'
    assert read(NamedReader("weather"), "", 1) == [CallPiece(0, "weather", "")]  # always one call


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, len(REQUIRED)), max_size=10), st.sampled_from(["required", "named"]))
def test_any_split_reads_as_the_whole_text(cuts, kind):
    def reader():
        return RequiredReader() if kind == "required" else NamedReader("weather")

    bounds = sorted({min(c, len(REQUIRED)) for c in cuts} | {0, len(REQUIRED)})
    fed = reader()
    pieces = [p for a, b in zip(bounds, bounds[1:]) for p in fed.feed(REQUIRED[a:b])] + fed.finish()
    assert joined(pieces) == joined(read(reader(), REQUIRED, len(REQUIRED)))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(CALLS, min_size=1, max_size=3), STYLES, st.lists(st.integers(0, 10**4), max_size=12))
def test_written_required_calls_read_back_whole_and_in_any_split(calls, style, cuts):
    """"required"'s array with names needing escapes, \\u escapes, {} parameters and any whitespace, split anywhere:
    each call reads back as written, and a stream joins into the whole reading."""
    text = write([{"name": n, "parameters": a} for n, a in calls], style)
    whole = joined(read(RequiredReader(), text, len(text)))
    assert [(c.name, json.loads(c.arguments)) for c in whole] == calls
    assert joined(read_split(RequiredReader(), text, cuts)) == whole

"""The readers of a named function's and of "required"'s output, whole and piece by piece."""

from __future__ import annotations

import json

from scheduler.entrypoints.server.tool_streams import CallPiece, NamedReader, RequiredReader

REQUIRED = ('[{"name": "weather", "parameters": {"city": "Pa]ri}s\\"{"}}, '
            '{"name": "time", "parameters": {"zone": [1, {"a": 2}]}}]')  # fmt: skip


def read(reader, text: str, step: int) -> list:
    """Everything ``reader`` returns for ``text`` fed ``step`` characters at a time, then its end."""
    return [p for i in range(0, len(text), step) for p in reader.feed(text[i : i + step])] + reader.finish()


def test_required_calls_go_out_whole_as_each_object_closes_whatever_the_split():
    expected = [CallPiece(0, "weather", json.dumps({"city": 'Pa]ri}s"{'})),
                CallPiece(1, "time", json.dumps({"zone": [1, {"a": 2}]}))]  # fmt: skip
    for step in (1, 3, len(REQUIRED)):
        assert read(RequiredReader(), REQUIRED, step) == expected


def test_a_required_element_cut_off_is_no_call():
    assert read(RequiredReader(), REQUIRED[:-10], 4) == read(RequiredReader(), REQUIRED[:60], 4)[:1]
    assert read(RequiredReader(), '[{"name": "x"}]', 2) == []  # no parameters: not a call


def test_a_named_call_streams_its_text_as_arguments_naming_the_function_first():
    pieces = read(NamedReader("weather"), '{"city": "Paris"}', 5)
    assert pieces[0] == CallPiece(0, "weather", '{"cit') and all(p.name is None for p in pieces[1:])
    assert "".join(p.arguments for p in pieces) == '{"city": "Paris"}'
    assert read(NamedReader("weather"), "", 1) == [CallPiece(0, "weather", "")]  # always one call

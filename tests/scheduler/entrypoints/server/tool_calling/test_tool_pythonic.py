"""The pythonic tool-call reader on plain strings: calls, literal arguments as JSON, content, and piecewise reading."""

from __future__ import annotations

import json
import keyword

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_helpers import SCALARS, read_split

from scheduler.entrypoints.server.tool_calling.pythonic import parse_pythonic, pythonic_reader
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, joined

WEATHER = '[get_weather(city="Paris", unit="celsius"), other()]'


def calls(text: str) -> list[tuple[str, dict]]:
    """The (name, decoded arguments) of each call read from ``text``."""
    return [(c.name, json.loads(c.arguments)) for c in parse_pythonic(text)[1]]


def test_a_list_of_calls_has_no_content_and_its_calls_are_numbered_in_order():
    content, read = parse_pythonic(WEATHER)
    assert content is None and [c.index for c in read] == [0, 1]
    assert calls(WEATHER) == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("other", {})]


def test_python_literals_become_json_arguments():
    text = ("[f(s='it\\'s \u00e9t\u00e9', n=-1.5, b=True, z=None, t=(1, 2), l=[{'k': [None]}], d={1: 'x'}, "
            'e="a)]\\"\\n")]')  # fmt: skip
    [call] = parse_pythonic(text)[1]
    assert json.loads(call.arguments) == {"s": "it's été", "n": -1.5, "b": True, "z": None, "t": [1, 2],
                                          "l": [{"k": [None]}], "d": {"1": "x"}, "e": 'a)]"\n'}  # fmt: skip
    assert "été" in call.arguments  # not escaped


@pytest.mark.parametrize("text", ["The weather is fine.", "Sure: [f(a=1)]", "", " \n", "[1, 2]", "[]", "[f(a=1"])
def test_text_that_is_no_list_of_calls_is_all_content(text):
    assert parse_pythonic(text) == (text if text.strip() else None, [])


@pytest.mark.parametrize("item", ["g(1)", "g(**kw)", "g(a=x)", "g(a={1, 2})", "g(a=1e999)", "g(a=b'x')", "m.g(a=1)",
                                  "g(a=1, a=2)", "g(a=1]", "g (a=1)"])  # fmt: skip
def test_reading_calls_stops_at_an_item_that_is_no_call_and_the_rest_is_content(item):
    text = f"[f(a=1), {item}, h()]"
    assert parse_pythonic(text) == (text[len("[f(a=1)") :], [CallPiece(0, "f", '{"a": 1}')])
    assert parse_pythonic(f"[{item}]") == (f"[{item}]", [])  # the first item: the list's "[" is content too


def test_text_after_the_list_is_content_and_an_unclosed_list_keeps_its_calls():
    assert parse_pythonic(" " + WEATHER + " Done.") == (" Done.", parse_pythonic(WEATHER)[1])
    assert parse_pythonic("[f(a=1), g(b=2") == (", g(b=2", [CallPiece(0, "f", '{"a": 1}')])  # g was cut off
    assert parse_pythonic("[f(a=1),") == (None, [CallPiece(0, "f", '{"a": 1}')])


def test_each_call_goes_out_whole_once_its_closing_parenthesis_is_read():
    reader = pythonic_reader()
    assert reader.feed("[get_weather(city=") == []
    assert reader.feed('"Paris)"') == []
    assert reader.feed("), oth") == [CallPiece(0, "get_weather", '{"city": "Paris)"}')]
    assert reader.feed("er()") == [CallPiece(1, "other", "{}")]
    assert reader.feed("] ok") + reader.finish() == [" ok"]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 200), max_size=10))
def test_any_split_reads_as_the_whole_text(cuts):
    text = ' [f(a="]),\\"", b=[1, (2, 3)]), g(), h(c={"k": \'v\'})] and [x(y=1)]'
    pieces = read_split(pythonic_reader(), text, cuts)
    content = "".join(p for p in pieces if isinstance(p, str))
    assert (content or None, joined(pieces)) == parse_pythonic(text)
    assert [c.name for c in joined(pieces)] == ["f", "g", "h"] and content == " and [x(y=1)]"


NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True).filter(lambda n: not keyword.iskeyword(n))
LITERALS = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner,
                        max_size=3), max_leaves=8)  # fmt: skip


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(NAMES, st.dictionaries(NAMES, LITERALS, max_size=3)), min_size=1, max_size=3),
       st.sampled_from(["", " ", "\n"]), st.lists(st.integers(0, 10**4), max_size=12))  # fmt: skip
def test_written_calls_read_back_whole_and_in_any_split(written, space, cuts):
    """Strings with quotes, backslashes, brackets, control and non-ASCII characters (``repr`` writes them), any
    numbers, nested lists and dicts: each call reads back as written, and a stream joins into the whole reading."""
    text = "[" + f",{space}".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in written) + "]"
    content, whole = parse_pythonic(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in whole] == written
    pieces = read_split(pythonic_reader(), text, cuts)
    assert ("".join(p for p in pieces if isinstance(p, str)) or None, joined(pieces)) == (content, whole)

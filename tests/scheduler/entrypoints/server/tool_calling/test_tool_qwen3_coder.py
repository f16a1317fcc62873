"""The qwen3_coder tool-call reader on plain strings: XML calls, values typed by the tools' schemas, content,
malformed blocks, piecewise."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_helpers import VALUES, read_split

from scheduler.entrypoints.server.tool_calling.protocol import Tool
from scheduler.entrypoints.server.tool_calling.qwen3_coder import parse_qwen3_coder, qwen3_coder_reader, typed
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, joined

PROPERTIES = {"city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
              "metric": {"type": "boolean"}, "where": {"type": "object"}, "tags": {"type": "array"},
              "note": {"type": ["null", "string"]}, "limit": {"anyOf": [{"type": "null"}, {"type": "integer"}]},
              "any": {}}  # fmt: skip
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": PROPERTIES}}}), Tool.model_validate({"type": "function", "function": {
    "name": "time"}})]  # fmt: skip


def call(name: str, *parameters: tuple[str, str]) -> str:
    """A call as Qwen3-Coder's template writes it: each value on its own lines."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def arguments(text: str) -> list[tuple[str, dict]]:
    """The (name, decoded arguments) of each call read from ``text`` with TOOLS."""
    return [(c.name, json.loads(c.arguments)) for c in parse_qwen3_coder(text, TOOLS)[1]]


def test_one_call_has_its_parameters_as_a_json_object_in_the_order_written():
    text = call("weather", ("city", "Paris"), ("days", "3"))
    assert parse_qwen3_coder(text, TOOLS) == (None, [CallPiece(0, "weather", '{"city": "Paris", "days": 3}')])
    assert parse_qwen3_coder(call("time"), TOOLS) == (None, [CallPiece(0, "time", "{}")])


def test_several_calls_are_read_in_order_and_the_text_around_them_is_content():
    text = f"Let me check. {call('weather', ('city', 'Paris'))}\n{call('time')} Done."
    content, read = parse_qwen3_coder(text, TOOLS)
    assert content == "Let me check. \n Done."
    assert [(c.index, c.name, c.arguments) for c in read] == [(0, "weather", '{"city": "Paris"}'), (1, "time", "{}")]


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("city", "3", "3"), ("days", " 3 ", 3), ("days", "3.5", "3.5"), ("days", "true", "true"), ("temp", "3.0", 3.0),
    ("temp", "-2e3", -2000.0), ("temp", "NaN", "NaN"), ("metric", "true", True), ("metric", "False", False),
    ("metric", "yes", "yes"), ("where", '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
    ("where", "{'a': True}", {"a": True}), ("where", "[1]", "[1]"), ("tags", '["x", 2]', ["x", 2]),
    ("tags", "{1, 2}", "{1, 2}"), ("days", "null", None), ("note", "null", "null"), ("limit", "7", 7),
    ("limit", "None", None), ("any", "5", "5"), ("extra", "[1]", "[1]"),
])  # fmt: skip
def test_a_value_is_typed_by_its_keys_schema_and_kept_as_text_when_it_is_no_value_of_that_type(key, value, expected):
    assert arguments(call("weather", (key, value))) == [("weather", {key: expected})]


def test_a_function_not_among_the_tools_has_its_values_as_text():
    assert arguments(call("other", ("days", "3"))) == [("other", {"days": "3"})]
    assert arguments(call("weather", ("days", "3"))) == [("weather", {"days": 3})]


def test_typed_reads_json_then_python_literals_and_never_a_non_json_value():
    assert typed("[1, 2]", "array") == [1, 2] and typed("(1, 2)", "array") == "(1, 2)"
    assert typed("1e999", "number") == "1e999" and typed("b'x'", "string") == "b'x'"
    assert typed("True", "boolean") is True and typed("1", "boolean") == "1" and typed("True", "integer") == "True"


def test_values_keep_their_text_but_one_newline_at_each_end_and_strings_are_escaped():
    value = '\n  "Zürich"\\n <b>\t\n\n'  # call() writes a newline before and after it
    [(name, got)] = arguments(call("weather", ("city", value), ("note", "")))
    assert got == {"city": value, "note": ""}
    text = "<tool_call><function=weather><parameter=city>Paris</parameter></function></tool_call>"
    assert arguments(text) == [("weather", {"city": "Paris"})]  # no newlines at all


def test_a_key_given_twice_keeps_its_first_value():
    assert arguments(call("weather", ("days", "1"), ("city", "a"), ("days", "2"), ("city", "b"))) == [
        ("weather", {"days": 1, "city": "a"})]  # fmt: skip


@pytest.mark.parametrize("text", ["<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
                                  "<tool_call>\n<function=>\n</function>\n</tool_call>",
                                  "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
                                  "a <tool_call>\n<function=f", "<tool_call>", "<tool_ca", "<function=f>\n</function>",
                                  " "])  # fmt: skip
def test_a_block_that_is_no_call_is_content_as_written(text):
    assert parse_qwen3_coder(text, TOOLS) == (text if text.strip() else None, [])


def test_a_bad_block_does_not_stop_a_later_call():
    text = f"<tool_call>oops</tool_call> then {call('time')}"
    assert parse_qwen3_coder(text, TOOLS) == ("<tool_call>oops</tool_call> then ", [CallPiece(0, "time", "{}")])


def test_a_named_call_closes_at_anything_out_of_place_and_the_text_from_there_is_read_as_outside_a_block():
    text = "<tool_call>\n<function=weather>\n<parameter=days>\n2\n</parameter>\noops</function>\n</tool_call> x"
    assert parse_qwen3_coder(text, TOOLS) == ("oops</function>\n</tool_call> x", [
        CallPiece(0, "weather", '{"days": 2}')])  # fmt: skip
    text = "<tool_call>\n<function=weather>\n<parameter=bad key>\n2\n</parameter>\n</function>\n</tool_call>"
    assert parse_qwen3_coder(text, TOOLS) == (text[text.index("<parameter=") :], [CallPiece(0, "weather", "{}")])
    text = "<tool_call>\n<function=time>\n</tool_call>after"  # </tool_call> closes the function too
    assert parse_qwen3_coder(text, TOOLS) == ("after", [CallPiece(0, "time", "{}")])


def test_a_call_cut_off_is_closed_with_what_was_written():
    assert arguments("<tool_call>\n<function=weather>\n<parameter=city>\nPar") == [("weather", {"city": "Par"})]
    assert arguments("<tool_call>\n<function=weather>\n<parameter=days>\n12\n</param") == [
        ("weather", {"days": "12\n</param"})]  # the text written, a partial tag included: no integer  # fmt: skip
    assert arguments("<tool_call>\n<function=weather>\n<parameter=da") == [("weather", {})]


def test_a_call_streams_its_name_first_then_strings_as_written_and_other_values_whole():
    reader = qwen3_coder_reader(TOOLS)
    assert reader.feed("Hi <tool_") == ["Hi "]
    assert reader.feed("call>\n<function=weather>") == [CallPiece(0, "weather", "{")]
    assert reader.feed('\n<parameter=city>\nPa"') == [CallPiece(0, None, '"city": "'), CallPiece(0, None, 'Pa\\"')]
    assert reader.feed("ris\n") == [CallPiece(0, None, "ris")]  # the last newline waits: it may be the value's end
    assert reader.feed("</parameter>\n<parameter=days>\n1") == [CallPiece(0, None, '"')]
    assert reader.feed("2\n</parameter>") == [CallPiece(0, None, ', "days": 12')]
    assert reader.feed("\n</function>\n</tool_call>") == [CallPiece(0, None, "}")]
    assert reader.finish() == []


FIRST = call("weather", ("city", "a</b>\\n"), ("where", '{"k": [1]}'))
SECOND = call("time", ("q", "</parameter"))
SPLIT = [  # (text, its calls' names, its content)
    (f"Sure <tool_c {FIRST} mid <tool_call>\n<function=x y> {SECOND}\n"
     "<tool_call><function=weather><parameter=days>4</parameter>junk",
     ["weather", "time", "weather"], "Sure <tool_c  mid <tool_call>\n<function=x y> \njunk"),
]


@pytest.mark.parametrize(("text", "names", "said"), SPLIT)
@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 400), max_size=12))
def test_any_split_reads_as_the_whole_text(text, names, said, cuts):
    pieces = read_split(qwen3_coder_reader(TOOLS), text, cuts)
    content = "".join(p for p in pieces if isinstance(p, str))
    assert (content or None, joined(pieces)) == parse_qwen3_coder(text, TOOLS)
    assert [c.name for c in joined(pieces)] == names and content == said


KEYS = st.text(st.characters(blacklist_characters="<>{}\"' \t\n\r"), min_size=1, max_size=6)
JSON_TYPES = [(bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
              (dict, "object"), (type(None), "null")]  # fmt: skip


def tool_for(name: str, parameters: dict) -> Tool:
    """A tool whose schema gives each parameter the JSON type of its value."""
    types = {k: next(t for cls, t in JSON_TYPES if isinstance(v, cls)) for k, v in parameters.items()}
    properties = {k: {"type": t} for k, t in types.items()}
    return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties}}})  # fmt: skip


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.dictionaries(KEYS, VALUES.filter(lambda v: "</parameter>" not in json.dumps(v)), max_size=3),
                min_size=1, max_size=3), st.text(max_size=4), st.lists(st.integers(0, 10**4), max_size=12))  # fmt: skip
def test_written_calls_read_back_whole_and_in_any_split(written, before, cuts):
    """Values of every JSON type, typed by their schemas (strings as written: quotes, backslashes, newlines and
    non-ASCII), keys with any character a name may have, split anywhere."""
    tools = [tool_for(f"f{i}", parameters) for i, parameters in enumerate(written)]
    before = before.replace("<", "")
    text = before + "".join(call(f"f{i}", *((k, v if isinstance(v, str) else json.dumps(v)) for k, v in p.items()))
                            for i, p in enumerate(written))  # fmt: skip
    content, whole = parse_qwen3_coder(text, tools)
    assert content == (before if before.strip() else None)
    assert [json.loads(c.arguments) for c in whole] == written
    assert [c.arguments for c in whole] == [json.dumps(p, ensure_ascii=False) for p in written]
    pieces = read_split(qwen3_coder_reader(tools), text, cuts)
    assert ("".join(p for p in pieces if isinstance(p, str)) or None, joined(pieces)) == (content, whole)

"""The deepseek_v3 and deepseek_v31 tool-call readers on plain strings: calls in DeepSeek's tags, content, malformed
calls, piecewise."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_helpers import STYLES, VALUES, read_split, write

from scheduler.entrypoints.server.tool_calling.deepseek import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    V3_STEPS,
    V31_STEPS,
    DeepSeekReader,
    parse_deepseek,
)
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, joined

NESTED = '{"q": "a\\"}\\n<｜tool▁call▁end｜>", "where": {"city": "Zürich", "at": [1, {"x": null}]}}'
NAMES = st.text("abcXYZ019_-.", min_size=1, max_size=8)  # the characters a name may have


def v3(name: str, arguments: str, fence: str = "\n") -> str:
    """A DeepSeek-V3 call (``fence``: the whitespace around the fenced arguments)."""
    return f"{CALL_BEGIN}function{SEP}{name}{fence}```json{fence}{arguments}{fence}```{CALL_END}"


def v31(name: str, arguments: str) -> str:
    """A DeepSeek-V3.1 call."""
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


FORMATS = {"v3": (V3_STEPS, v3), "v31": (V31_STEPS, v31)}


def block(*calls: str) -> str:
    """Calls in the block of calls."""
    return CALLS_BEGIN + "".join(calls) + CALLS_END


@pytest.mark.parametrize("version", FORMATS)
def test_one_call_has_its_name_and_its_arguments_as_written_and_no_content(version):
    steps, call = FORMATS[version]
    assert parse_deepseek(block(call("get_weather", '{"city": "Paris"}')), steps) == (
        None, [CallPiece(0, "get_weather", '{"city": "Paris"}')])  # fmt: skip
    content, [read] = parse_deepseek(block(call("find.place-2", NESTED)), steps)
    assert content is None and (read.name, read.arguments) == ("find.place-2", NESTED)
    assert json.loads(read.arguments)["where"]["city"] == "Zürich"  # escapes, a tag in a string, non-ASCII kept


@pytest.mark.parametrize("version", FORMATS)
def test_several_calls_are_read_in_order_and_the_text_around_the_block_is_content(version):
    steps, call = FORMATS[version]
    calls = call("a", '{"x": 1}') + "\n " + call("b", NESTED) + call("c", "{}") + "\n"
    text = f"Let me check. {CALLS_BEGIN}{calls}{CALLS_END} Done."
    content, read = parse_deepseek(text, steps)
    assert content == "Let me check.  Done."
    assert [(c.index, c.name, c.arguments) for c in read] == [(0, "a", '{"x": 1}'), (1, "b", NESTED), (2, "c", "{}")]


def test_v3_accepts_any_whitespace_around_the_fence_and_a_multi_line_object():
    text = block(v3("f", '{\n  "k": [1,\n 2]\n}', fence=" \n\t"))
    assert parse_deepseek(text, V3_STEPS) == (None, [CallPiece(0, "f", '{\n  "k": [1,\n 2]\n}')])


def test_each_version_reads_the_others_format_as_content():
    v3_text, v31_text = block(v3("f", "{}")), block(v31("f", "{}"))
    assert parse_deepseek(v3_text, V31_STEPS) == (v3_text, [])  # "function" is V3.1's name, then no object
    assert parse_deepseek(v31_text, V3_STEPS) == (v31_text, [])  # no name after the separator


@pytest.mark.parametrize("version", FORMATS)
@pytest.mark.parametrize("bad", [("get weather", "{}"), ("", "{}"), ('"f"', "{}"), ("f", "[1]"), ("f", '"x"'),
                                 ("f", "5")])  # fmt: skip
def test_a_call_with_a_bad_name_or_no_object_is_content_as_written_with_the_tags_before_it(version, bad):
    steps, call = FORMATS[version]
    text = "Hi " + block(call(*bad))
    assert parse_deepseek(text, steps) == (text, [])
    text = block(call("a", "{}"), "\n" + call(*bad))
    assert parse_deepseek(text, steps) == ("\n" + call(*bad) + CALLS_END, [CallPiece(0, "a", "{}")])


def test_a_streamed_call_that_breaks_after_its_object_is_kept_and_the_text_from_the_break_is_content():
    text = f"{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{\"x\": 1}} oops{CALL_END}{CALLS_END}"
    assert parse_deepseek(text, V31_STEPS) == (f"oops{CALL_END}{CALLS_END}", [CallPiece(0, "f", '{"x": 1}')])
    text = f"{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{\"x\" 1}}{CALL_END}"  # the object breaks at "1": kept as written
    assert parse_deepseek(text, V31_STEPS) == (f"1}}{CALL_END}", [CallPiece(0, "f", '{"x" ')])


@pytest.mark.parametrize("text", [v31("f", "{}"), "Hi <｜tool▁calls", f"Hi {CALLS_BEGIN} \n", block(),
                                  f"Hi {CALLS_BEGIN}<｜tool", f"{CALLS_BEGIN}{CALL_BEGIN}f{SEP}"])  # fmt: skip
def test_text_without_a_call_is_content_as_written(text):
    assert parse_deepseek(text, V31_STEPS) == (text, [])  # (the first has no <｜tool▁calls▁begin｜>)


def test_a_partial_tag_after_the_last_call_is_dropped():
    assert parse_deepseek(block(v31("f", "{}"))[:-3], V31_STEPS) == (None, [CallPiece(0, "f", "{}")])


def test_a_call_streams_its_name_with_its_objects_brace_then_its_arguments_and_a_cut_off_one_is_kept():
    reader = DeepSeekReader(steps=V3_STEPS)
    assert reader.feed("Hi <｜tool▁") == ["Hi "]
    assert reader.feed(f"calls▁begin｜>{CALL_BEGIN}function{SEP}weather\n```json\n") == []
    assert reader.feed('{"ci') == [CallPiece(0, "weather", '{"ci')]
    assert reader.feed('ty": 1') + reader.finish() == [CallPiece(0, None, 'ty": 1')]


BROKEN = v3("c", '{"k" oops}')
SPLIT = [  # (text, its format, its calls' names, its content)
    (f"Sure <｜tool {CALLS_BEGIN} {v3('a', NESTED)}\n{v3('b_1', '{}')}{BROKEN} tail", V3_STEPS,
     ["a", "b_1", "c"], "Sure <｜tool oops}\n```<｜tool▁call▁end｜> tail"),
    (f"Sure <｜tool {CALLS_BEGIN}{v31('a', NESTED)} {v31('b', '{}')}{CALLS_END} tail {v31('c', '{}')}", V31_STEPS,
     ["a", "b"], f"Sure <｜tool  tail {v31('c', '{}')}"),
]


@pytest.mark.parametrize(("text", "steps", "names", "said"), SPLIT)
@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 400), max_size=10))
def test_any_split_reads_as_the_whole_text(text, steps, names, said, cuts):
    pieces = read_split(DeepSeekReader(steps=steps), text, cuts)
    content = "".join(p for p in pieces if isinstance(p, str))
    assert (content or None, joined(pieces)) == parse_deepseek(text, steps)
    assert [c.name for c in joined(pieces)] == names and content == said


@pytest.mark.parametrize("version", FORMATS)
@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.tuples(NAMES, st.dictionaries(st.text(max_size=6), VALUES, max_size=3), STYLES), min_size=1,
                max_size=3), st.text(max_size=4), st.lists(st.integers(0, 10**4), max_size=12))  # fmt: skip
def test_written_calls_read_back_whole_and_in_any_split(version, written, before, cuts):
    """Keys needing escapes, \\u escapes, non-ASCII text, {} arguments and any whitespace, split anywhere."""
    steps, call = FORMATS[version]
    before = before.replace("<", "")
    text = before + block(*(call(name, write(arguments, style)) for name, arguments, style in written))
    content, whole = parse_deepseek(text, steps)
    assert content == (before if before.strip() else None)
    assert [(c.name, json.loads(c.arguments)) for c in whole] == [(n, a) for n, a, _ in written]
    pieces = read_split(DeepSeekReader(steps=steps), text, cuts)
    assert ("".join(p for p in pieces if isinstance(p, str)) or None, joined(pieces)) == (content, whole)

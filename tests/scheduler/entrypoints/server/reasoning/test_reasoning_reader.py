"""The reasoning reader on plain strings: both parsers' rules, tags split across pieces, whole equal to pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.core.structured_params import StructuredOutputsParams
from scheduler.entrypoints.server.config import REASONING_PARSERS
from scheduler.entrypoints.server.reasoning.output import PARSERS, ReasoningOutput
from scheduler.entrypoints.server.reasoning.reader import ParserRules, ReasoningReader, split

EXPLICIT = ParserRules(implicit_start=False)  # qwen3 with enable_thinking false


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize(("text", "expected"), [
    ("<think>plan</think>answer", ("plan", "answer")),
    ("plan</think>answer", ("plan", "answer")),  # the start tag was in the prompt
    ("\n <think>plan</think>\nanswer", ("plan", "\nanswer")),  # whitespace before the start tag is dropped
    ("<think>plan", ("plan", "")),  # no end tag: cut off while thinking
    ("plan only", ("plan only", "")),
    ("<think></think>answer", (None, "answer")),  # empty thinking
    ("plan</think>", ("plan", "")),  # nothing after the thinking
    ("a</think>b</think>c<think>d", ("a", "b</think>c<think>d")),  # later tags are content
    ("a<think>b</think>c", ("a<think>b", "c")),  # a start tag after text is reasoning text
    ("", (None, "")),
])
def test_the_think_tag_parsers_read_thinking_from_the_first_token(parser, text, expected):
    assert split(PARSERS[parser], text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("<think>plan</think>answer", ("plan", "answer")),
    ("answer", (None, "answer")),
    ("answer</think>more", (None, "answer</think>more")),  # no start tag: all content
    ("  <thi", (None, "  <thi")),  # a start never finished is content
    ("<think>plan", ("plan", "")),
])
def test_without_implicit_start_only_the_start_tag_opens_thinking(text, expected):
    assert split(EXPLICIT, text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("[THINK]plan[/THINK]answer", ("plan", "answer")),
    ("\n[THINK]plan[/THINK]\nanswer", ("plan", "\nanswer")),  # whitespace before the start tag is dropped
    ("plan[/THINK]answer", (None, "plan[/THINK]answer")),  # no start tag: no thinking (vLLM: content)
    ("answer", (None, "answer")),
    ("[THINK]plan", ("plan", "")),  # cut off while thinking
    ("[THINK][/THINK]answer", (None, "answer")),
    ("[THINK]a[/THINK]b[/THINK]c[THINK]d", ("a", "b[/THINK]c[THINK]d")),  # later tags are content
    ("<think>plan</think>answer", (None, "<think>plan</think>answer")),  # the other parsers' tags are text
    ("[THINK]a</think>b", ("a</think>b", "")),
    ("[THIN", (None, "[THIN")),  # a start never finished is content
])
def test_mistral_reads_think_tags_and_an_output_without_the_start_tag_as_content(text, expected):
    assert split(PARSERS["mistral"], text) == expected


def test_mistral_s_tags_are_special_tokens_and_its_grammar_starts_after_the_end_tag():
    rules = PARSERS["mistral"]
    assert (rules.start, rules.end, rules.keeps_special_tokens, rules.grammar_after_end) == (
        "[THINK]", "[/THINK]", True, True)  # fmt: skip
    assert not PARSERS["deepseek_r1"].keeps_special_tokens and not PARSERS["qwen3"].keeps_special_tokens
    spec = StructuredOutputsParams(regex="a")
    assert ReasoningOutput(rules).constrain(spec, (7, 8)).start_after == (7, 8)


def test_a_mistral_tag_split_across_pieces_is_held_until_decided():
    reader = ReasoningReader(PARSERS["mistral"])
    assert reader.feed(" [TH") == []
    assert reader.feed("INK]plan[/TH") == [("reasoning", "plan")]
    assert reader.feed("INK]ans") == [("content", "ans")]
    assert reader.finish() == []


def test_a_tag_split_across_pieces_is_held_until_decided():
    reader = ReasoningReader(ParserRules())
    assert reader.feed("<th") == []
    assert reader.feed("ink>plan</") == [("reasoning", "plan")]
    assert reader.feed("thi") == []
    assert reader.feed("nk>ans") == [("content", "ans")]
    assert reader.feed("wer</think>") == [("content", "wer</think>")]
    assert reader.finish() == []


def test_a_held_prefix_that_is_no_tag_goes_out_with_the_next_piece_or_at_the_end():
    reader = ReasoningReader(ParserRules())
    assert reader.feed("x </th") == [("reasoning", "x ")]
    assert reader.feed("ere") == [("reasoning", "</there")]
    assert reader.feed("<") == []
    assert reader.finish() == [("reasoning", "<")]


def test_the_flag_s_choices_are_the_parsers():
    assert tuple(PARSERS) == REASONING_PARSERS


TEXTS = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "th", "ink>", " ", "\n", "a", "é", "x>"]),
                 max_size=12).map("".join)  # fmt: skip


@settings(max_examples=300, deadline=None, derandomize=True)
@given(TEXTS, st.lists(st.integers(0, 40), max_size=6), st.booleans())
def test_any_split_reads_as_the_whole_text(text, cuts, implicit):
    rules = ParserRules(implicit_start=implicit)
    reader = ReasoningReader(rules)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    pieces = [p for a, b in zip(bounds, bounds[1:]) for p in reader.feed(text[a:b])] + reader.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    assert split(rules, text) == (reasoning or None, "".join(t for kind, t in pieces if kind == "content"))
    assert all(t for _, t in pieces)  # no empty piece
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # reasoning pieces, then content pieces


def test_output_fields_whole_and_streamed_and_without_reasoning():
    out = ReasoningOutput(ParserRules())
    both = {"reasoning": "plan", "reasoning_content": "plan"}
    assert out.message("plan</think>ok") == (both, "ok")
    assert out.delta(0, "plan</th", False) == (both, "")
    assert out.delta(0, "ink>ok", True) == ({}, "ok")
    hidden = ReasoningOutput(ParserRules(), include=False)
    assert hidden.message("plan</think>ok") == ({"reasoning": None, "reasoning_content": None}, "ok")
    assert hidden.delta(0, "plan</think>ok", True) == ({}, "ok")


MISTRAL_TEXTS = st.lists(st.sampled_from(["[THINK]", "[/THINK]", "[", "[/", "TH", "INK]", " ", "a", "é"]),
                         max_size=12).map("".join)  # fmt: skip


@settings(max_examples=200, deadline=None, derandomize=True)
@given(MISTRAL_TEXTS, st.lists(st.integers(0, 60), max_size=6))
def test_mistral_reads_any_split_as_the_whole_text(text, cuts):
    reader = ReasoningReader(PARSERS["mistral"])
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    pieces = [p for a, b in zip(bounds, bounds[1:]) for p in reader.feed(text[a:b])] + reader.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    assert split(PARSERS["mistral"], text) == (reasoning or None, "".join(t for kind, t in pieces if kind == "content"))


ENDED, OWN = (None, "plan</e>answer"), "own"  # all content; the parser's own reading of the output
PROMPTS = [  # (prompt, the <think> parsers' reading of "plan</e>answer", mistral's); <s>, </e>: the parser's tags
    ("user: hi\n<s>\n\n</e>\n\n", ENDED, ENDED),  # a template with thinking off closed it: all content
    ("<s>old</e>answer\nuser: hi\n", ENDED, ENDED),  # ended long before the last turn: still ended
    ("user: hi\n<s>\n", ("plan", "answer"), OWN),  # an open start tag: thinking (mistral: its own rule)
    ("<s>a</e>b\n<s>\n", ("plan", "answer"), OWN),  # the last tag decides
    ("user: hi\n", OWN, OWN),  # no tag
    ("user: </e>\n", ENDED, OWN),  # an end tag without a start tag: mistral's needs its [THINK]
]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3", "mistral"])
@pytest.mark.parametrize(("prompt", "think", "mistral"), PROMPTS)
def test_the_prompts_last_tag_decides_where_the_output_starts(parser, prompt, think, mistral):
    """As vLLM's is_reasoning_end of the prompt: the <think> parsers read its last tag; mistral's thinking ended
    only where its last [THINK] was closed, and an open one leaves the output's opening to decide."""
    rules = PARSERS[parser]
    tags = lambda s: s and s.replace("<s>", rules.start).replace("</e>", rules.end)  # noqa: E731
    text, expected = tags("plan</e>answer"), mistral if parser == "mistral" else think
    want = split(rules, text) if expected == OWN else tuple(tags(x) for x in expected)
    assert split(rules.after(tags(prompt)), text) == want
    reader = ReasoningReader(rules.after(tags(prompt)))  # piece by piece, the same
    pieces = [p for ch in text for p in reader.feed(ch)] + reader.finish()
    assert "".join(t for k, t in pieces if k == "content") == want[1]


def test_a_prompt_that_ended_the_thinking_starts_the_grammar_at_the_first_token():
    spec, end = StructuredOutputsParams(regex="a+"), (7, 8)
    for parser in PARSERS:
        reading = ReasoningOutput(PARSERS[parser])
        assert reading.after_prompt("x", spec, end).start_after == end  # no tag: after the thinking
        ended = ReasoningOutput(PARSERS[parser])
        tags = PARSERS[parser].start + "a" + PARSERS[parser].end
        assert ended.after_prompt(tags + "\n\n", spec, end).start_after is None
        assert ended.message("b" + PARSERS[parser].end)[0]["reasoning"] is None
    off = ReasoningOutput(EXPLICIT)  # thinking off, but the prompt opened it: held after the end tag
    assert off.after_prompt("<think>\n", spec, end).start_after == end and off.message("b")[0]["reasoning"] == "b"

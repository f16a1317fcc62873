"""A sample's text, piece by piece, as reasoning and content: the reader behind ``--reasoning-parser``.

A reasoning model writes its thinking between a start tag and an end tag (``<think>``, ``</think>``; Magistral's
``[THINK]``, ``[/THINK]``), then its answer. The reader, as vLLM's parsers (``deepseek_r1``, ``qwen3``, ``mistral``):

- a start tag that opens the output (after any whitespace) is dropped, and what follows is reasoning;
- an output that does not open with it is reasoning too when the parser's ``implicit_start`` says the
  model may begin inside its thinking (the chat template wrote the start tag into the prompt), else content;
- the first end tag ends the reasoning: it is dropped and everything after it, later tags included, is content;
- no end tag: the reasoning runs to the end of the text (the sample was cut off in it).

The prompt comes first (``ParserRules.after``, as vLLM's ``is_reasoning_end`` reads the prompt's tokens): a
prompt whose thinking ended (its last tag is the end tag: a template with thinking off wrote
``<think>\n\n</think>\n\n``) makes the whole output content, a ``</think>`` in it included; one whose last tag
is an open start tag (a template that prefills ``<think>\n``) makes an output without the start tag reasoning.
Mistral's rule is vLLM's: the thinking ended only where the prompt's last ``[THINK]`` was closed, and an open
one leaves the output's opening to decide.

Fed piece by piece (``feed``, then ``finish``), it returns the same reasoning and content as fed the
whole text at once: a piece that may be the start of a tag is held back until the next piece decides.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scheduler.entrypoints.server.tags import ready_and_held

START, END = "<think>", "</think>"
Piece = tuple[str, str]  # ("reasoning" or "content", its text)


@dataclass(frozen=True)
class ParserRules:
    """A reasoning parser's tags, and whether its model may begin inside its thinking without the start tag."""

    start: str = START
    end: str = END
    implicit_start: bool = True
    thinking_switch: bool = False  # chat_template_kwargs enable_thinking false turns implicit_start off (qwen3)
    grammar_after_end: bool = True  # a request's grammar starts after the end tag (else from the first token)
    keeps_special_tokens: bool = False  # the tags are special tokens: the text must keep them (skip_special_tokens off)
    paired_in_prompt: bool = False  # the prompt's end tag counts only after its start tag; an open one is not read
    in_answer: bool = False  # the prompt ended the thinking: the whole output is content

    def after(self, prompt: str) -> ParserRules:
        """These rules for an output that follows ``prompt`` (its text): read from the answer when the prompt's
        thinking ended, as reasoning when its last tag is an open start tag, else unchanged."""
        start, end = prompt.rfind(self.start), prompt.rfind(self.end)
        if end > start and (start >= 0 or not self.paired_in_prompt):
            return replace(self, in_answer=True, grammar_after_end=False)
        if start > end and not self.paired_in_prompt:
            return replace(self, implicit_start=True, grammar_after_end=True)
        return self


@dataclass
class ReasoningReader:
    """Reasoning and content from a text fed piece by piece."""

    rules: ParserRules
    _state: str = "open"  # open (the start tag may still come), reasoning, content
    _buffer: str = ""  # text not yet decided: the opening, or what may be the start of the end tag

    def __post_init__(self) -> None:
        if self.rules.in_answer:
            self._state = "content"

    def feed(self, text: str) -> list[Piece]:
        """The reasoning and content pieces that ``text`` completes."""
        self._buffer += text
        out: list[Piece] = []
        if self._state == "open":
            self._open()
        if self._state == "reasoning":
            self._reasoning(out)
        if self._state == "content" and self._buffer:
            out.append(("content", self._buffer))
            self._buffer = ""
        return out

    def finish(self) -> list[Piece]:
        """What the text's end decides: held text goes out as the part it is in (an opening never closed:
        reasoning when the model may begin inside its thinking, else content)."""
        if self._state == "open":
            self._state = "reasoning" if self.rules.implicit_start else "content"
        kind, self._buffer, held = self._state, "", self._buffer
        return [(kind, held)] if held else []

    def _open(self) -> None:
        """Decide the opening once the buffer shows whether it begins with the start tag."""
        lead = self._buffer.lstrip()
        start = self.rules.start
        if lead.startswith(start):
            self._buffer, self._state = lead[len(start) :], "reasoning"
        elif not start.startswith(lead):  # cannot be the start tag any more ("" waits: whitespace so far)
            self._state = "reasoning" if self.rules.implicit_start else "content"

    def _reasoning(self, out: list[Piece]) -> None:
        """Send the reasoning up to the end tag (then switch to content), holding back a possible tag start."""
        end = self._buffer.find(self.rules.end)
        if end >= 0:
            self._emit(out, self._buffer[:end])
            self._buffer, self._state = self._buffer[end + len(self.rules.end) :], "content"
            return
        ready, self._buffer = ready_and_held(self._buffer, self.rules.end)
        self._emit(out, ready)

    @staticmethod
    def _emit(out: list[Piece], text: str) -> None:
        if text:
            out.append(("reasoning", text))


def split(rules: ParserRules, text: str) -> tuple[str | None, str]:
    """A whole text's reasoning (None: the output had none) and content."""
    reader = ReasoningReader(rules)
    pieces = reader.feed(text) + reader.finish()
    reasoning = [t for kind, t in pieces if kind == "reasoning"]
    return ("".join(reasoning) if reasoning else None), "".join(t for kind, t in pieces if kind == "content")

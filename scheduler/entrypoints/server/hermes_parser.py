"""Hermes-style tool calls in a model's text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The reader of ``tool_choice: "auto"`` with ``--tool-call-parser hermes``. Each tagged block whose
JSON is an object with a non-empty string ``name`` and an object ``arguments`` is a tool call (its
arguments re-serialized as JSON text); the text outside those blocks is the content, and so is a
block that is not such a call, kept as written. A last block left open when the text ends is
read as if it were closed. Content that is only whitespace is no content (None).

Read piece by piece (:class:`HermesReader`, as a stream is), a call goes out whole once its block
closes, and content goes out as soon as it cannot be the start of a tag; :func:`parse_hermes` reads
a whole text with the same reader, so both give the same content and calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from scheduler.entrypoints.server.tool_streams import CallPiece, call_of

START, END = "<tool_call>", "</tool_call>"


@dataclass
class HermesReader:
    """Content and whole tool calls from a text fed piece by piece."""

    _buffer: str = ""  # text not yet decided: an open block's body, or what may be the start of a tag
    _in_block: bool = False
    _spaces: str = ""  # whitespace-only content held until real content (or nothing) follows
    _said: bool = False  # some content went out: all further content goes out as it comes
    _calls: int = 0

    def feed(self, text: str) -> list[str | CallPiece]:
        """The content and calls that ``text`` completes."""
        self._buffer += text
        out: list[str | CallPiece] = []
        while True:
            if self._in_block:
                end = self._buffer.find(END)
                if end < 0:
                    return out
                body, self._buffer, self._in_block = self._buffer[:end], self._buffer[end + len(END) :], False
                out += self._block(body, START + body + END)
                continue
            start = self._buffer.find(START)
            if start < 0:
                cut = len(self._buffer) - _tag_start(self._buffer)
                out += self._content(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                return out
            out += self._content(self._buffer[:start])
            self._buffer, self._in_block = self._buffer[start + len(START) :], True

    def finish(self) -> list[str | CallPiece]:
        """What the end of the text decides: an open block read as closed, a partial tag as content."""
        rest, self._buffer = self._buffer, ""
        return self._block(rest, START + rest) if self._in_block else self._content(rest)

    def _block(self, body: str, raw: str) -> list[str | CallPiece]:
        """A block's call, or its raw text as content when it is not one."""
        try:
            call = call_of(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            return self._content(raw)
        self._calls += 1
        return [CallPiece(self._calls - 1, call.name, call.arguments)]

    def _content(self, text: str) -> list[str | CallPiece]:
        """Content that goes out now: none while all of it so far is whitespace."""
        if self._said:
            return [text] if text else []
        self._spaces += text
        if not self._spaces.strip():
            return []
        self._said, text, self._spaces = True, self._spaces, ""
        return [text]


def _tag_start(text: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``START`` (held back: a tag may follow)."""
    for n in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


def parse_hermes(text: str) -> tuple[str | None, list[CallPiece]]:
    """A whole text's content (None: none) and tool calls."""
    reader = HermesReader()
    pieces = reader.feed(text) + reader.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return (content or None), [p for p in pieces if isinstance(p, CallPiece)]

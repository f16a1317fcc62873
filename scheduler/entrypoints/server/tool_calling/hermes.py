"""Hermes-style tool calls in a model's text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The reader of ``tool_choice: "auto"`` with ``--tool-call-parser hermes``. Each tagged block whose
JSON is an object with a non-empty string ``name`` and an object ``arguments`` is a tool call; the
text outside those blocks is the content, and so is a block that is not such a call, kept as
written. A last block left open when the text ends is read as if it were closed (one streamed as
below is a call as far as it was written). Content that is only whitespace is no content (None).

Read piece by piece (:class:`HermesReader`, as a stream is), content goes out as soon as it cannot
be the start of a tag. A block that opens with ``{"name": <string>, "arguments": {`` (the order
hermes-format models write) is streamed: its name once its arguments begin, then the arguments' raw
text as it is written (up to the object's end; the call's ``arguments`` are that text). Any other
block goes out whole at its closing tag (its arguments re-serialized). :func:`parse_hermes` reads a
whole text with the same reader, so both give the same content and calls, but for a streamed block
whose closing tag shows it is no call after all (say ``{"name": "f", "arguments": {}, oops}``): the
stream has sent its call, which keeps what was sent, and the rest of the block is dropped (never
content and a call for one block's text; vLLM's stream drops it too), where the whole text reads the
block as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from scheduler.entrypoints.server.tags import ready_and_held
from scheduler.entrypoints.server.tool_calling.object_scanner import ObjectScanner
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, call_of, joined, name_of

START, END = "<tool_call>", "</tool_call>"
LEAD = ("name", "arguments")  # the keys a block streamed as it is written opens with, in this order


@dataclass
class HermesReader:
    """Content and tool calls from a text fed piece by piece."""

    _buffer: str = ""  # text not yet decided: an open block's unread body, or what may be the start of a tag
    _block: _Block | None = None  # the open block
    _spaces: str = ""  # whitespace-only content held until real content (or nothing) follows
    _said: bool = False  # some content went out: all further content goes out as it comes
    _calls: int = 0

    def feed(self, text: str) -> list[str | CallPiece]:
        """The content and call pieces that ``text`` completes."""
        self._buffer += text
        out: list[str | CallPiece] = []
        while True:
            if self._block is not None:
                if not self._body(out):
                    return out
                continue
            start = self._buffer.find(START)
            if start < 0:
                ready, self._buffer = ready_and_held(self._buffer, START)
                out += self._content(ready)
                return out
            out += self._content(self._buffer[:start])
            self._buffer, self._block = self._buffer[start + len(START) :], _Block()

    def _body(self, out: list[str | CallPiece]) -> bool:
        """Read the open block's body in the buffer into ``out``: whether the block closed."""
        end = self._buffer.find(END)
        if end < 0:  # stream what cannot be the start of the closing tag
            ready, self._buffer = ready_and_held(self._buffer, END)
            out += self._stream(ready)
            return False
        body, self._buffer = self._buffer[:end], self._buffer[end + len(END) :]
        out += self._close(body, END)
        return True

    def finish(self) -> list[str | CallPiece]:
        """What the end of the text decides: an open block read as closed, a partial tag as content."""
        rest, self._buffer = self._buffer, ""
        return self._close(rest, "") if self._block is not None else self._content(rest)

    def _stream(self, body: str) -> list[str | CallPiece]:
        """More of the open block's body: its call's pieces once it leads as one (its name, then its arguments)."""
        block = self._block
        arguments = block.read(body)
        if not block.leads:
            return []
        if block.index is None:
            block.index, self._calls = self._calls, self._calls + 1
            return [CallPiece(block.index, block.name, arguments)]
        return [CallPiece(block.index, None, arguments)] if arguments else []

    def _close(self, body: str, end: str) -> list[str | CallPiece]:
        """The block's end: the rest of a streamed call (kept, even if the block is no call after all), or the
        block's call, or its raw text as content when it is not one."""
        block = self._block
        if block.index is not None:
            out, self._block = self._stream(body), None
            return out
        self._block = None
        block.read(body)
        call = block.call()
        if call is None:
            return self._content(START + block.body + end)
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


@dataclass
class _Block:
    """A ``<tool_call>`` block's body as it arrives; it leads as a call once it opens with ``{"name": <a non-empty
    string>, "arguments": {`` (the order hermes-format models write)."""

    body: str = ""
    scanner: ObjectScanner = field(default_factory=ObjectScanner)
    members: int = 0  # the members whose key was read
    name_text: str = ""  # the name's raw text (a JSON string)
    name: str = ""  # the name, once its text ends
    arguments: str = ""  # the arguments' raw text so far, while it leads
    leads: bool | None = None  # None: not known yet
    index: int | None = None  # its call's index, once its pieces go out

    def read(self, text: str) -> str:
        """Read more of the body: the arguments text it adds while the block leads."""
        self.body += text
        events, _ = self.scanner.feed(text)
        added = "".join(self._event(kind, piece) for kind, piece in events)
        if self.scanner.state == "bad" and not self.leads:
            self.leads = False
        self.arguments += added
        return added

    def call(self) -> CallPiece | None:
        """The whole block's call (index 0), if its body is one: the arguments as written when it leads."""
        try:
            call = call_of(json.loads(self.body), "arguments")
        except ValueError:
            return None
        return call if call is None or not self.leads else CallPiece(0, self.name, self.arguments)

    def _event(self, kind: str, piece: str) -> str:
        """Follow one scanner event: the arguments text it adds while the block leads."""
        if kind == "key":
            self.members += 1
            if self.members <= len(LEAD) and piece != LEAD[self.members - 1]:
                self.leads = False
            return ""
        if self.leads is False or self.members > len(LEAD):
            return ""
        if self.members == 1:  # the name's text
            self.name_text += piece
            if kind == "end" and not self._named():
                self.leads = False
            return ""
        if kind == "text":  # the arguments' text: the block leads once it is an object
            self.leads = self.leads or piece.startswith("{")
            return piece if self.leads else ""
        return ""

    def _named(self) -> bool:
        """Decode the name once its text ends: whether it is a non-empty string."""
        self.name = name_of(self.name_text)
        return bool(self.name)


def parse_hermes(text: str) -> tuple[str | None, list[CallPiece]]:
    """A whole text's content (None: none) and tool calls."""
    reader = HermesReader()
    pieces = reader.feed(text) + reader.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return (content or None), joined(pieces)

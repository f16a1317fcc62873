"""Hermes-style tool calls in a model's text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The reader of ``tool_choice: "auto"`` with ``--tool-call-parser hermes``. Each tagged block whose
JSON is an object with a non-empty string ``name`` and an object ``arguments`` is a tool call; the
text outside those blocks is the content, and so is a block that is not such a call, kept as
written (a block's body is its object and whitespace, or it is no call: ``{...} and more`` is not
one). A ``</tool_call>`` inside a JSON string of the block's object while that object is open is text
of the string, not the block's end (vLLM's regex ends the block there, and its JSON then fails);
once the object has ended or broken, the next end tag ends the block wherever it is (an unclosed
string therefore runs to the end of the text). A last block left open when the text ends is read as
if it were closed (one streamed as below is a call as far as it was written). Content that is only
whitespace is no content (None).

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

from dataclasses import dataclass, field

from scheduler.entrypoints.server.tags import ready_and_held
from scheduler.entrypoints.server.tool_calling.call_object import CallObject
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, Content, read_whole

START, END = "<tool_call>", "</tool_call>"


@dataclass
class HermesReader:
    """Content and tool calls from a text fed piece by piece."""

    _buffer: str = ""  # text not yet decided: an open block's unread body, or what may be the start of a tag
    _block: _Block | None = None  # the open block
    _content: Content = field(default_factory=Content)
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
                out += self._content.take(ready)
                return out
            out += self._content.take(self._buffer[:start])
            self._buffer, self._block = self._buffer[start + len(START) :], _Block()

    def _body(self, out: list[str | CallPiece]) -> bool:
        """Read the open block's body in the buffer into ``out``: whether the block closed. An end tag closes it
        unless it lies in a JSON string of the block's object while that object is open."""
        block = self._block
        while (end := self._buffer.find(END)) >= 0:
            block.read(self._buffer[:end])
            self._buffer = self._buffer[end + len(END) :]
            if not block.obj.scanner.in_string:  # (never, once the object is finished)
                out += self._close(END)
                return True
            block.read(END)  # text of a string: the block goes on
        ready, self._buffer = ready_and_held(self._buffer, END)  # what cannot be the start of an end tag
        block.read(ready)
        out += self._stream()
        return False

    def finish(self) -> list[str | CallPiece]:
        """What the end of the text decides: an open block read as closed, a partial tag as content."""
        rest, self._buffer = self._buffer, ""
        if self._block is None:
            return self._content.take(rest)
        self._block.read(rest)
        return self._close("")

    def _stream(self) -> list[str | CallPiece]:
        """The open block's call pieces not yet sent, once it leads as a call (its name, then its arguments)."""
        pieces = self._block.obj.stream(self._calls)
        self._calls += any(p.name is not None for p in pieces)
        return pieces

    def _close(self, end: str) -> list[str | CallPiece]:
        """The block's end: the rest of a streamed call (kept, even if the block is no call after all), or the
        block's call, or its raw text as content when it is not one."""
        block = self._block
        if block.obj.index is not None:
            out, self._block = self._stream(), None
            return out
        self._block = None
        call = block.call()
        if call is None:
            return self._content.take(START + block.raw + end)
        self._calls += 1
        return [CallPiece(self._calls - 1, call.name, call.arguments)]


@dataclass
class _Block:
    """A ``<tool_call>`` block's body as it arrives: its JSON object, then any text after it."""

    raw: str = ""  # the body read so far
    obj: CallObject = field(default_factory=CallObject)

    def read(self, text: str) -> None:
        """Read more of the body."""
        self.raw += text
        self.obj.read(text)

    def call(self) -> CallPiece | None:
        """The whole block's call (index 0), if its body is one object that is a call, with only whitespace after it
        (one not followed directly by the end tag, say ``{...} and more``, is no call)."""
        return self.obj.call() if not self.raw[len(self.obj.body) :].strip() else None


def parse_hermes(text: str) -> tuple[str | None, list[CallPiece]]:
    """A whole text's content (None: none) and tool calls."""
    return read_whole(HermesReader(), text)

"""Tool calls written one after another, read as they arrive (llama3_json's and mistral's JSON objects, pythonic's
Python calls).

The items are separated by a separator (``;``, ``,``, a tag such as mistral's ``[TOOL_CALLS]``, or nothing
for items that carry their own tags, as DeepSeek's; whitespace around it), and the sequence may be opened
by a bracket and closed by a bracket or a tag (a list's ``[`` and ``]``, DeepSeek's ``<｜tool▁calls▁end｜>``). An item
(:class:`Item`) that streams (a :class:`CallObject` that leads) is a call from the moment its first piece
goes out, kept even if its text then breaks; any other is a call if, once closed, it reads as one. Reading
calls stops at the first thing that is neither: from there on the text is content, with the text held since
the last call (a tag, a separator) in front of it, and the item's own text for an item that is no call.
Fed the whole text at once or piece by piece, the reading is the same: nothing depends on where the
text is split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.entrypoints.server.tool_calling.object_scanner import SPACE
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, Content


class Item(Protocol):
    """One item of a sequence, read as it arrives."""

    body: str  # its text read so far
    index: int | None  # its call's index, once its first piece went out (streamed)

    @property
    def finished(self) -> bool:
        """It closed or broke: nothing more is read."""

    @property
    def broken(self) -> bool:
        """Its text broke off before it closed."""

    def read(self, text: str) -> int:
        """Read more: how many characters of ``text`` are its own (all until it finishes)."""

    def stream(self, index: int) -> list[CallPiece]:
        """Its call's pieces not yet given out, if it streams (the first names it, as call ``index``)."""

    def call(self) -> CallPiece | None:
        """Its whole call (index 0) once it closed, if it is one."""


@dataclass
class CallSequence:
    """Items separated by ``separator`` (after ``opener`` and then ``closer``, if any), and content after them."""

    content: Content  # the reader's content (shared with the text it read before the sequence)
    item: Callable[[], Item]  # a new item
    starts: Callable[[str], bool]  # whether a character starts an item
    separator: str  # "" for items that begin with their own tag
    opener: str | None = None  # one character
    closer: str | None = None  # a character or a tag
    held: str = ""  # text since the last call: content if no call follows (a tag, a separator, whitespace)
    _state: str = "open"  # open (before the opener), expect (an item), item (in one), after (one), content
    _buffer: str = ""
    _current: Item | None = None
    _calls: int = 0

    def feed(self, text: str) -> list[str | CallPiece]:
        """The content and call pieces that ``text`` completes."""
        self._buffer += text
        out: list[str | CallPiece] = []
        while (self._buffer or self._state == "open") and getattr(self, "_" + self._state)(out):
            pass
        return out

    def finish(self) -> list[str | CallPiece]:
        """The end: an open item's call as far as streamed (else its text is content), held text that is more than
        separators as content."""
        self.feed("")  # (settles an opening without an opener)
        if self._state == "item" and self._current.index is None:
            return self._content_from(self._current.body)
        rest, self.held = self.held, ""
        return self.content.take(rest) if rest.strip(SPACE + self.separator + (self.closer or "")) else []

    def _open(self, out: list[str | CallPiece]) -> bool:
        """Before the sequence: whitespace, then the opener if there is one (anything else: the rest is content)."""
        if self.opener is None:
            self._state = "expect"
        elif not self._skip_space():
            return False
        elif self._buffer[0] == self.opener:
            self.held, self._buffer, self._state = self.held + self.opener, self._buffer[1:], "expect"
        else:
            out += self._content_from("")
        return True

    def _expect(self, out: list[str | CallPiece]) -> bool:
        """Before an item: whitespace, then its first character (anything else: the rest is content)."""
        if not self._skip_space():
            return False
        if self.starts(self._buffer[0]):
            self._state, self._current = "item", self.item()
        else:
            out += self._content_from("")
        return True

    def _item(self, out: list[str | CallPiece]) -> bool:
        """In an item: its streamed pieces; once it closes or breaks, its call, or the rest as content."""
        obj = self._current
        self._buffer = self._buffer[obj.read(self._buffer) :]
        out += self._named(obj.stream(self._calls))
        if not obj.finished:
            return False
        call = obj.call() if obj.index is None else None
        if call is not None:
            out += self._named([CallPiece(self._calls, call.name, call.arguments)])
        if obj.index is None and call is None:  # no call: its text is content, and all after it
            out += self._content_from(obj.body)
        elif obj.broken:  # a streamed call whose text broke: the rest is content
            out += self._content_from("")
        else:
            self._state = "after"
        return True

    def _after(self, out: list[str | CallPiece]) -> bool:
        """After an item: whitespace, then the closer (content after it) or the separator (another item)."""
        if not self._skip_space():
            return False
        closer, sep = self.closer or "", self.separator
        if any(t.startswith(self._buffer) and len(self._buffer) < len(t) for t in (closer, sep)):  # a tag's start
            return False
        if closer and self._buffer.startswith(closer):
            self.held, self._buffer, self._state = "", self._buffer[len(closer) :], "content"
        elif self._buffer.startswith(sep):
            self.held, self._buffer, self._state = self.held + sep, self._buffer[len(sep) :], "expect"
        else:
            out += self._content_from("")
        return True

    def _content(self, out: list[str | CallPiece]) -> bool:
        """The rest of the text: content as it comes."""
        out += self.content.take(self._buffer)
        self._buffer = ""
        return False

    def _skip_space(self) -> bool:
        """Move leading whitespace of the buffer to the held text: whether something else follows."""
        text = self._buffer.lstrip(SPACE)
        self.held += self._buffer[: len(self._buffer) - len(text)]
        self._buffer = text
        return bool(text)

    def _named(self, pieces: list[CallPiece]) -> list[CallPiece]:
        """Count the calls ``pieces`` begin (the held text before a call is dropped: it was a separator)."""
        if any(p.name is not None for p in pieces):
            self._calls, self.held = self._calls + 1, ""
        return pieces

    def _content_from(self, text: str) -> list[str | CallPiece]:
        """From here on the text is content: the held text, ``text``, and the rest."""
        rest, self.held, self._state = self.held + text + self._buffer, "", "content"
        self._buffer = ""
        return self.content.take(rest)


@dataclass
class LeadIn:
    """A reader whose text is content, or undecided, until its calls begin; a CallSequence reads the rest."""

    _buffer: str = ""  # text not yet decided
    _calls: CallSequence | None = None  # the calls, once they began
    _content: Content = field(default_factory=Content)

    def feed(self, text: str) -> list[str | CallPiece]:
        """The content and call pieces that ``text`` completes."""
        if self._calls is not None:
            return self._calls.feed(text)
        self._buffer += text
        return self._lead()

    def finish(self) -> list[str | CallPiece]:
        """What the end of the text decides: undecided text is content."""
        if self._calls is not None:
            return self._calls.finish()
        rest, self._buffer = self._buffer, ""
        return self._content.take(rest)

    def _lead(self) -> list[str | CallPiece]:
        """Read the buffer until the calls begin (``_begin``): the content that goes out now."""
        raise NotImplementedError

    def _begin(self, calls: CallSequence, rest: str) -> list[str | CallPiece]:
        """The calls begin: ``calls`` reads ``rest`` and all that follows."""
        self._calls, self._buffer = calls, ""
        return calls.feed(rest)

"""A sample's text, piece by piece, as content and tool calls: the named function's and "required"'s readers.

A reader takes a sample's text in the pieces it is generated in (``feed``) and then its end
(``finish``), and returns what they make: content text (``str``) and :class:`CallPiece` s, a call's
name first, then its arguments' text as it is written. Fed the whole text at once, a reader returns
the same content and calls (:func:`joined`) as fed piece by piece: the non-streamed message and the
streamed deltas come from one reading.

"required"'s output is held to an array of ``{"name", "parameters"}`` objects, in that order
(xgrammar keeps a schema's property order); a call is named as soon as its name's string closes,
and its arguments are the ``parameters`` value's raw text, streamed as it is written (parameters
written before the name would be held until the name is known).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from scheduler.entrypoints.server.tool_calling.object_scanner import Event, ObjectScanner


@dataclass(frozen=True)
class CallPiece:
    """A piece of tool call ``index``: its first piece carries the function's ``name``, the others None;
    the call's ``arguments`` are its pieces' arguments joined (JSON text, unless the sample was cut off in it)."""

    index: int
    name: str | None
    arguments: str


def name_of(text: str) -> str:
    """The function name a call's raw name text (a JSON string) decodes to; "" unless a non-empty string."""
    try:
        name = json.loads(text)
    except ValueError:
        return ""
    return name if isinstance(name, str) else ""


def call_of(obj: object, keys: tuple[str, ...]) -> CallPiece | None:
    """A whole call from a decoded ``{"name": str, <one of keys>: object}`` (index 0; the first of ``keys`` present
    holds the arguments), else None."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]):
        return None
    arguments = next((obj[k] for k in keys if k in obj), None)
    if not isinstance(arguments, dict):
        return None
    return CallPiece(0, obj["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass
class Content:
    """An "auto" reader's content as it goes out: none while all of it so far is whitespace (whitespace alone is no
    content), then each piece as it comes."""

    _spaces: str = ""  # whitespace-only content held until real content (or nothing) follows
    _said: bool = False  # some content went out: all further content goes out as it comes

    def take(self, text: str) -> list[str | CallPiece]:
        """The content that goes out now for ``text``."""
        if self._said:
            return [text] if text else []
        self._spaces += text
        if not self._spaces.strip():
            return []
        self._said, text, self._spaces = True, self._spaces, ""
        return [text]


@dataclass
class NamedReader:
    """A named function's call: the whole text is its arguments (constrained by its parameters' schema)."""

    name: str
    _started: bool = False

    def feed(self, text: str) -> list[str | CallPiece]:
        """The text as the next piece of the arguments (the first piece, the first text, names the function; no
        text yet, e.g. while a reasoning model thinks: no piece)."""
        if not text:
            return []
        return [self._piece(text)]

    def finish(self) -> list[str | CallPiece]:
        """The call with empty arguments if no text came (so there is always exactly one call)."""
        return [] if self._started else [self._piece("")]

    def _piece(self, text: str) -> CallPiece:
        """The next piece of the call: its first names the function."""
        piece = CallPiece(0, None if self._started else self.name, text)
        self._started = True
        return piece


@dataclass
class RequiredReader:
    """"required"'s JSON array of ``{"name", "parameters"}`` objects: each call's name once its string closes, then
    its parameters' raw text as it is written (the text before the name, if any, held until the name is known)."""

    _state: str = "open"  # open (before the array), items (between its elements), done (after it)
    _element: _Element | None = None  # the element being read
    _calls: int = 0

    def feed(self, text: str) -> list[str | CallPiece]:
        """The call pieces ``text`` makes."""
        out: list[str | CallPiece] = []
        while text:
            if self._element is None:
                text = self._between(text)
                continue
            events, used = self._element.scanner.feed(text)
            pieces = self._element.read(events, self._calls)
            self._calls += sum(p.name is not None for p in pieces)
            out += pieces
            if self._element.scanner.finished:
                self._element = None
            text = text[used:]
        return out

    def finish(self) -> list[str | CallPiece]:
        """Nothing more: an element cut off (the sample ran out of tokens) is a call as far as it was written, if
        its name was."""
        return []

    def _between(self, text: str) -> str:
        """Skip the array's text outside its elements; the rest of ``text`` from the next element's ``{``."""
        for i, ch in enumerate(text):
            if self._state == "items" and ch == "{":
                self._element = _Element()
                return text[i:]
            if (self._state, ch) in (("open", "["), ("items", "]")):
                self._state = "items" if ch == "[" else "done"
        return ""


@dataclass
class _Element:
    """One element of "required"'s array: a call from its name's end, its parameters' text held until then."""

    scanner: ObjectScanner = field(default_factory=ObjectScanner)
    key: str | None = None  # the member being read
    name: str = ""  # the name's raw text (a JSON string)
    held: str = ""  # the parameters' text read before the name
    index: int | None = None  # the call's index, once named

    def read(self, events: list[Event], index: int) -> list[CallPiece]:
        """The pieces of the call (``index`` once named) that ``events`` make."""
        out: list[CallPiece] = []
        for kind, text in events:
            if kind == "key":
                self.key = text
            elif self.key == "name" and self.index is None:
                self.name += text
                out += self._named(index) if kind == "end" else []
            elif self.key == "parameters" and kind == "text":
                if self.index is None:
                    self.held += text
                else:
                    out.append(CallPiece(self.index, None, text))
        return out

    def _named(self, index: int) -> list[CallPiece]:
        """The call's first piece once its name is a non-empty string: the name and the parameters' text so far."""
        name = name_of(self.name)
        if not name:
            return []
        self.index, held, self.held = index, self.held, ""
        return [CallPiece(index, name, held)]


def read_whole(reader, text: str) -> tuple[str | None, list[CallPiece]]:
    """A whole text's content (None: none) and tool calls, as a fresh ``reader`` reads it."""
    pieces = reader.feed(text) + reader.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return (content or None), joined(pieces)


def joined(pieces: list[str | CallPiece]) -> list[CallPiece]:
    """The call pieces among ``pieces``, those of one call joined into one (in order of their first)."""
    calls: dict[int, CallPiece] = {}
    for p in pieces:
        if isinstance(p, CallPiece):
            first = calls.get(p.index, p)
            calls[p.index] = p if first is p else CallPiece(p.index, first.name, first.arguments + p.arguments)
    return list(calls.values())

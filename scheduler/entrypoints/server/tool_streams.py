"""A sample's text, piece by piece, as content and tool calls: the named function's and "required"'s readers.

A reader takes a sample's text in the pieces it is generated in (``feed``) and then its end
(``finish``), and returns what they make: content text (``str``) and :class:`CallPiece` s. Fed the
whole text at once, a reader returns the same content and calls as fed piece by piece: the
non-streamed message and the streamed deltas come from one reading.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CallPiece:
    """A piece of tool call ``index``: its first piece carries the function's ``name``, the others None;
    the call's ``arguments`` are its pieces' arguments joined (JSON text)."""

    index: int
    name: str | None
    arguments: str


def call_of(obj: object, arguments_key: str) -> CallPiece | None:
    """A whole call from a decoded ``{"name": str, <arguments_key>: object}`` (index 0), else None."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]):
        return None
    arguments = obj.get(arguments_key)
    if not isinstance(arguments, dict):
        return None
    return CallPiece(0, obj["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass
class NamedReader:
    """A named function's call: the whole text is its arguments (constrained by its parameters' schema)."""

    name: str
    _started: bool = False

    def feed(self, text: str) -> list[str | CallPiece]:
        """The text as the next piece of the arguments (the first piece names the function)."""
        if not text and self._started:
            return []
        piece = CallPiece(0, None if self._started else self.name, text)
        self._started = True
        return [piece]

    def finish(self) -> list[str | CallPiece]:
        """The call with empty arguments if no text came (so there is always exactly one call)."""
        return self.feed("") if not self._started else []


@dataclass
class RequiredReader:
    """"required"'s JSON array of ``{"name", "parameters"}`` objects: each call whole once its object closes."""

    _text: list[str] = field(default_factory=list)  # the current element's characters
    _depth: int = 0  # brackets open, the array's included
    _in_string: bool = False
    _escaped: bool = False
    _calls: int = 0

    def feed(self, text: str) -> list[str | CallPiece]:
        """The calls whose objects close in ``text``."""
        out: list[str | CallPiece] = []
        for ch in text:
            if self._depth >= 2 or (self._depth == 1 and ch == "{"):
                self._text.append(ch)
            self._step(ch)
            if self._depth == 1 and self._text:
                out += self._element("".join(self._text))
                self._text.clear()
        return out

    def finish(self) -> list[str | CallPiece]:
        """Nothing more: an element cut off (the sample ran out of tokens) is no call."""
        return []

    def _step(self, ch: str) -> None:
        if self._in_string:  # a bracket in a string is text; an escaped quote does not close it
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "[{":
            self._depth += 1
        elif ch in "]}":
            self._depth -= 1

    def _element(self, text: str) -> list[str | CallPiece]:
        try:
            call = call_of(json.loads(text), "parameters")
        except ValueError:
            return []
        if call is None:
            return []
        self._calls += 1
        return [CallPiece(self._calls - 1, call.name, call.arguments)]

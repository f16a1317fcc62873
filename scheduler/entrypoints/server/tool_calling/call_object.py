"""A tool call written as a JSON object, ``{"name": <string>, <an arguments key>: {...}}``, read as it arrives
(a ``call_sequence.Item``).

Hermes blocks, llama3_json's objects and mistral's array elements are such objects. One that opens
with ``{"name": <a non-empty string>, <an arguments key>: {`` (the order those models write) *leads*:
its call can be streamed, its name once its arguments begin, then the arguments' raw text as written
(up to the arguments object's end). Any other object is decided whole once it is read
(:meth:`CallObject.call`, its arguments re-serialized).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.entrypoints.server.tool_calling.object_scanner import ObjectScanner
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, call_of, name_of


@dataclass
class CallObject:
    """One call object's text as it arrives: its lead, name and arguments' raw text, and its whole call."""

    keys: tuple[str, ...] = ("arguments",)  # the keys its arguments may be under, the preferred first
    body: str = ""  # the object's text read so far (leading whitespace included)
    scanner: ObjectScanner = field(default_factory=ObjectScanner)
    members: int = 0  # the members whose key was read
    key: str = ""  # the arguments' key, once the second member is one of ``keys``
    name_text: str = ""  # the name's raw text (a JSON string)
    name: str = ""  # the name, once its text ends
    arguments: str = ""  # the arguments' raw text so far, while it leads
    leads: bool | None = None  # None: not known yet
    index: int | None = None  # its call's index, once its first piece went out
    sent: int = 0  # how much of ``arguments`` went out

    @property
    def finished(self) -> bool:
        """The object closed or broke: nothing more is read."""
        return self.scanner.finished

    @property
    def broken(self) -> bool:
        """The object's top level broke off before it closed."""
        return self.scanner.state == "bad"

    def read(self, text: str) -> int:
        """Read more of the object: how many characters of ``text`` are its own (all until it finishes)."""
        events, used = self.scanner.feed(text)
        self.body += text[:used]
        self.arguments += "".join(self._event(kind, piece) for kind, piece in events)
        if self.scanner.state == "bad" and not self.leads:
            self.leads = False
        return used

    def stream(self, index: int) -> list[CallPiece]:
        """Its call's pieces not yet given out, once it leads: the first names it (as call ``index``), the others
        carry its arguments' text as it is written."""
        return streamed(self, index) if self.leads else []

    def call(self) -> CallPiece | None:
        """The whole object's call (index 0) once it closed, if it is one: the arguments as written when it leads."""
        if self.scanner.state != "done":
            return None
        try:
            call = call_of(json.loads(self.body), (self.key,) if self.leads else self.keys)
        except ValueError:
            return None
        return call if call is None or not self.leads else CallPiece(0, self.name, self.arguments)

    def _event(self, kind: str, piece: str) -> str:
        """Follow one scanner event: the arguments text it adds while the object leads."""
        if kind == "key":
            self.members += 1
            if self.members == 2 and piece in self.keys:
                self.key = piece
            elif self.members <= 2 and not (self.members == 1 and piece == "name"):
                self.leads = False
            return ""
        if self.leads is False or self.members > 2:
            return ""
        if self.members == 1:  # the name's text
            self.name_text += piece
            if kind == "end" and not self._named():
                self.leads = False
            return ""
        if kind == "text":  # the arguments' text: the object leads once they are an object
            self.leads = self.leads or piece.startswith("{")
            return piece if self.leads else ""
        return ""

    def _named(self) -> bool:
        """Decode the name once its text ends: whether it is a non-empty string."""
        self.name = name_of(self.name_text)
        return bool(self.name)


class Streaming(Protocol):
    """A call item that streams: its name, its arguments' text so far, how much of it went out, its index."""

    name: str
    arguments: str
    sent: int
    index: int | None


def streamed(item: Streaming, index: int) -> list[CallPiece]:
    """A streaming item's pieces not yet given out (its ``arguments`` past ``sent``): the first names it (as call
    ``index``, which it keeps), the others carry only arguments text (none when nothing new was written)."""
    arguments, item.sent = item.arguments[item.sent :], len(item.arguments)
    if item.index is None:
        item.index = index
        return [CallPiece(index, item.name, arguments)]
    return [CallPiece(item.index, None, arguments)] if arguments else []


def json_items(keys: tuple[str, ...]) -> dict[str, object]:
    """A CallSequence's ``item`` and ``starts`` for JSON call objects whose arguments are under one of ``keys``."""
    return {"item": lambda: CallObject(keys), "starts": lambda ch: ch == "{"}

"""A JSON object's top-level members read as they are written: each key once its string closes, then its value's
raw text piece by piece, then the value's end.

The readers of tool calls stream a call's name and arguments with it. It checks only the object's
top level (``{``, keys, ``:``, ``,``, ``}``); a value's text is passed through as written, its
nesting and strings followed (a bracket or an escaped quote in a string is text) so that its end is
found. Anything else at the top level stops the reading (``bad``; the character that broke it is not
the object's); whether the text is JSON is for the caller to decide.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

SPACE = " \t\n\r"
Event = tuple[str, str]  # ("key", the decoded key) | ("text", a piece of the value's raw text) | ("end", "")


@dataclass
class ObjectScanner:
    """Events of one JSON object's members from its text fed piece by piece (the text starts at or before its ``{``)."""

    state: str = "open"  # open, before (a key), key, colon, value, in_value, after (a value), done, bad
    _key: list[str] = field(default_factory=list)  # the key's raw characters, quotes included
    _value: list[str] = field(default_factory=list)  # value characters not yet given out
    _first: str = ""  # the value's first character
    _depth: int = 0  # brackets open in the value
    _in_string: bool = False
    _escaped: bool = False

    @property
    def finished(self) -> bool:
        """The object closed (done) or its top level broke (bad): nothing more is read."""
        return self.state in ("done", "bad")

    @property
    def in_string(self) -> bool:
        """Whether the text read so far ends inside a JSON string (a key or a value's string, at any depth)."""
        return self.state == "key" or (self.state == "in_value" and self._in_string)

    def feed(self, text: str) -> tuple[list[Event], int]:
        """The events ``text`` makes, and how many of its characters are the object's (all until it finishes; the
        character that breaks it is not)."""
        events: list[Event] = []
        for i, ch in enumerate(text):
            if self.finished:
                return events, i
            getattr(self, "_on_" + self.state)(ch, events)
            if self.state == "bad":
                self._flush(events)
                return events, i
        self._flush(events)
        return events, len(text)

    def _on_open(self, ch: str, events: list[Event]) -> None:
        self.state = "before" if ch == "{" else _space(ch, "open")

    def _on_before(self, ch: str, events: list[Event]) -> None:
        """Before a key: its opening quote, or the object's end."""
        if ch == '"':
            self._key, self.state = [ch], "key"
        else:
            self.state = "done" if ch == "}" else _space(ch, "before")

    def _on_key(self, ch: str, events: list[Event]) -> None:
        self._key.append(ch)
        if self._string_char(ch):
            return
        try:
            events.append(("key", json.loads("".join(self._key))))
        except ValueError:  # a bad escape
            self.state = "bad"
            return
        self.state = "colon"

    def _on_colon(self, ch: str, events: list[Event]) -> None:
        self.state = "value" if ch == ":" else _space(ch, "colon")

    def _on_value(self, ch: str, events: list[Event]) -> None:
        """Before a value: its first character starts it."""
        if ch in ",}":
            self.state = "bad"
        elif ch not in SPACE:
            self._first, self._depth, self.state = ch, 0, "in_value"
            self._on_in_value(ch, events)

    def _on_in_value(self, ch: str, events: list[Event]) -> None:
        if self._first not in '"[{' and ch in SPACE + ",}":  # a scalar ends at what follows it
            self._end_value(events)
            self._on_after(ch, events)
            return
        self._value.append(ch)
        if self._in_string:
            self._in_string = self._string_char(ch)
        elif ch == '"':
            self._in_string = True
        elif ch in "[{":
            self._depth += 1
        elif ch in "]}":
            self._depth -= 1
        if self._first in '"[{' and self._depth == 0 and not self._in_string:
            self._end_value(events)  # a string, array or object ends at its own closing character

    def _on_after(self, ch: str, events: list[Event]) -> None:
        """After a value: a comma (another member) or the object's end."""
        if ch == ",":
            self.state = "before"
        else:
            self.state = "done" if ch == "}" else _space(ch, "after")

    def _string_char(self, ch: str) -> bool:
        """Whether a string is still open after ``ch`` (a character inside it)."""
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            return False
        return True

    def _end_value(self, events: list[Event]) -> None:
        self._flush(events)
        events.append(("end", ""))
        self.state = "after"

    def _flush(self, events: list[Event]) -> None:
        """Give out the value characters read so far."""
        if self._value:
            events.append(("text", "".join(self._value)))
            self._value.clear()


def _space(ch: str, state: str) -> str:
    """``state`` again for whitespace, else bad."""
    return state if ch in SPACE else "bad"

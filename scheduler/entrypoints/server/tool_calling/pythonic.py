"""Pythonic tool calls: ``[get_weather(city="Paris", unit="celsius"), other()]`` (``--tool-call-parser pythonic``).

The reader of ``tool_choice: "auto"`` with ``--tool-call-parser pythonic`` (Llama 3.2 and Llama 4's
format, and the models trained on it, such as ToolACE). The text is read as calls only if it starts
(after whitespace) with ``[``, as vLLM's; any other text is all content. Then come Python calls
separated by ``,``: each ``name(keyword=literal, ...)`` is a call whose ``arguments`` are its keyword
arguments as a JSON object (the literals as Python's ``ast.literal_eval`` reads them: strings,
numbers, ``True``/``False``/``None``, lists, tuples and dicts; non-string dict keys become strings, as
JSON writes them). A call goes out whole, name and arguments in one piece, once its closing
parenthesis is read (``ast`` reads it then): a stream sends each call as soon as it is complete, and
a call cut off by the end of the text is no call (its text is content). Reading calls stops at the
list's ``]`` (the text after it is content) and at the first item that is no such call: a
positional argument, ``**kwargs``, a value that is not a literal or has no JSON form (a set, bytes,
a complex number, an infinite float), a dotted name: from there on the text is content (the list's
``[`` included when it is the first). Strings are followed with their quotes and escapes so that a
bracket inside one is text; triple-quoted strings are not followed (an item holding one may read as
no call). Content that is only whitespace is none. Whole or piece by piece, the reading is the same.

Differences from vLLM: vLLM's whole answer is calls only if the whole text is a list of calls (else
all content, text around the list included) and reads only constants, lists and dicts (no negative
numbers, tuples or sets); it ignores positional arguments. Its stream sends a call's arguments as
they are written, re-serializing the partial call at each token; ours sends each call whole.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass

from scheduler.entrypoints.server.tool_calling.call_sequence import CallSequence
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, Content, read_whole


@dataclass
class PythonCall:
    """One ``name(...)`` item of the list, read to its closing parenthesis (a ``call_sequence.Item``)."""

    body: str = ""  # the item's text read so far
    index: int | None = None  # never set: a Python call is not streamed
    _state: str = "name"  # name (before its "("), arguments (inside the parentheses), done, bad
    _depth: int = 0  # brackets open
    _quote: str = ""  # the open string's quote; "" outside strings
    _escaped: bool = False  # the string's last character was a backslash

    @property
    def finished(self) -> bool:
        """The call's parentheses closed, or its text broke."""
        return self._state in ("done", "bad")

    @property
    def broken(self) -> bool:
        """Its text broke before its parentheses closed."""
        return self._state == "bad"

    def read(self, text: str) -> int:
        """Read more of the item: how many characters of ``text`` are its own (the one that breaks it is not)."""
        for i, ch in enumerate(text):
            if self.finished:
                return i
            self._state = self._next(ch)
            if self._state == "bad":
                return i
            self.body += ch
        return len(text)

    def stream(self, index: int) -> list[CallPiece]:
        """Nothing: the call goes out whole once closed."""
        return []

    def call(self) -> CallPiece | None:
        """The call (index 0), once closed, if it is ``name(keyword=literal, ...)`` with JSON-able literals."""
        if self._state != "done":
            return None
        try:
            node = ast.parse(self.body, mode="eval").body
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                return None
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
            if len(arguments) != len(node.keywords):  # a **mapping
                return None
            return CallPiece(0, node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None

    def _next(self, ch: str) -> str:
        """The state after ``ch``, following its name, strings and brackets."""
        if self._state == "name":
            if ch == "(":
                self._depth = 1
                return "arguments"
            return "name" if ("a" + ch).isidentifier() else "bad"
        if self._quote:
            self._escaped, closes = (False, False) if self._escaped else (ch == "\\", ch == self._quote)
            self._quote = "" if closes else self._quote
        elif ch in "'\"":
            self._quote = ch
        elif ch in "([{":
            self._depth += 1
        elif ch in ")]}":
            self._depth -= 1
            if self._depth == 0:  # the call's own ")" ends it; any other closing bracket breaks it
                return "done" if ch == ")" else "bad"
        return "arguments"


def pythonic_reader() -> CallSequence:
    """A reader of content and tool calls from a text fed piece by piece: ``[``, calls separated by ``,``, ``]``."""
    return CallSequence(Content(), PythonCall, str.isidentifier, ",", opener="[", closer="]")


def parse_pythonic(text: str) -> tuple[str | None, list[CallPiece]]:
    """A whole text's content (None: none) and tool calls."""
    return read_whole(pythonic_reader(), text)

"""Llama 3.1/3.2/3.3 JSON tool calls: ``<|python_tag|>{"name": ..., "parameters": {...}}; {...}`` (``llama3_json``).

The reader of ``tool_choice: "auto"`` with ``--tool-call-parser llama3_json``. The text is read as
calls only if it starts (after whitespace) with ``<|python_tag|>`` or ``{``, as vLLM's; any other
text is all content. Then come JSON objects separated by ``;`` (whitespace around it): each one that
has a non-empty string ``name`` and an object ``parameters`` (or ``arguments``, as vLLM also accepts;
``arguments`` first when both are given) is a call. An object that opens with ``{"name": <string>,
"parameters": {`` (or ``"arguments"``) is streamed: its name once its arguments begin, then their raw
text as written (the call's ``arguments``); any other object is held until it closes, and its
arguments re-serialized. Reading calls stops at the first thing that is neither a separator nor a
call: from there on the text is content, the object's own text (or the python tag) included. A
streamed call is a call from its first piece on, its arguments the text as written (JSON or not); one
whose object breaks after its arguments is kept, and the text from the break is content. A streamed
call cut off by the end of the text is a call as far as it was written. Content that is only
whitespace is none. Whole or piece by piece, the reading is the same.

Differences from vLLM: vLLM's whole answer searches the text anywhere for ``{...}`` objects joined by
``;`` (two levels of nesting at most), drops the text around them, and makes the whole text content if
any of them is no call; its stream requires the text to start exactly with the tag or ``{`` (we allow
whitespace first, and read the same whole and streamed). Its arguments are always re-serialized.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.entrypoints.server.tool_calling.call_object import json_items
from scheduler.entrypoints.server.tool_calling.call_sequence import CallSequence, LeadIn
from scheduler.entrypoints.server.tool_calling.object_scanner import SPACE
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, read_whole

PYTHON_TAG = "<|python_tag|>"
KEYS = ("arguments", "parameters")  # the keys a call's arguments may be under, the preferred first (vLLM's)


@dataclass
class Llama3JsonReader(LeadIn):
    """Content and tool calls from a text fed piece by piece."""

    _plain: bool = False  # the text is all content

    def _lead(self) -> list[str | CallPiece]:
        """Wait while the text's start (after whitespace) may be the python tag; then its calls, or all content."""
        if self._plain:
            text, self._buffer = self._buffer, ""
            return self._content.take(text)
        head = self._buffer.lstrip(SPACE)
        if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
            return []
        if not (head.startswith(PYTHON_TAG) or head.startswith("{")):
            self._plain = True
            return self._lead()
        tagged = len(self._buffer) - len(head) + (len(PYTHON_TAG) if head.startswith(PYTHON_TAG) else 0)
        calls = CallSequence(self._content, **json_items(KEYS), separator=";", held=self._buffer[:tagged])
        return self._begin(calls, self._buffer[tagged:])


def parse_llama3_json(text: str) -> tuple[str | None, list[CallPiece]]:
    """A whole text's content (None: none) and tool calls."""
    return read_whole(Llama3JsonReader(), text)

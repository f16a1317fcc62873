"""Mistral tool calls (``--tool-call-parser mistral``), in both of Mistral's formats: the JSON array
``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B v0.3) and ``[TOOL_CALLS]name[ARGS]{...}``
(tokenizers v11+: Mistral Small 3.2, Devstral, Magistral; one call per tag, several calls several tags).

The reader of ``tool_choice: "auto"``. The text before the first ``[TOOL_CALLS]`` is content; what follows the
tag (after whitespace) decides the format: ``[`` the array, anything else the ``name[ARGS]`` format.

The array: its elements with a non-empty string ``name`` and an object ``arguments`` are calls. An element
that opens with ``{"name": <string>, "arguments": {`` is streamed: its name once its arguments begin, then
their raw text as written (the call's ``arguments``); any other element is held until it closes, and its
arguments re-serialized. Reading calls stops at the first element that is no call (the text from there,
the tag and ``[`` included when it is the first, is content) and at the array's ``]`` (the text after it
is content).

``name[ARGS]{...}``: a name (letters, digits, ``_``, ``-``, ``.``; not empty) right after the tag, then
``[ARGS]``, then a JSON object (whitespace before it allowed), streamed as soon as its ``{`` is read: the
name, then the object's raw text as written. After the object, whitespace and another ``[TOOL_CALLS]`` start
the next call; anything else is content from there. A name that is empty or has another character, a
missing ``[ARGS]``, arguments that are no object: the text from that call's tag on is content.

A streamed call cut off by the end of the text is a call as far as it was written. ``[TOOL_CALLS]`` and
``[ARGS]`` are special tokens of Mistral's tokenizers: the text keeps special tokens (``skip_special_tokens``
off, as vLLM's parser asks with a Hugging Face tokenizer).

Differences from vLLM: vLLM picks the format from the tokenizer (``[ARGS]`` in its vocabulary: v11+), ours
from the text after the tag. For the array, vLLM's whole answer takes the text before the first tag as
content and drops the text after the array, and on any element that is no call makes the text after the
tag (the tag dropped) all content; its stream reads the text after the last tag. vLLM re-serializes the
arguments, and its ids are 9 alphanumeric characters (Mistral's rule; ours are ``chatcmpl-tool-<hex>``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.entrypoints.server.tags import ready_and_held
from scheduler.entrypoints.server.tool_calling.call_object import json_items, streamed
from scheduler.entrypoints.server.tool_calling.call_sequence import CallSequence, LeadIn
from scheduler.entrypoints.server.tool_calling.object_scanner import SPACE, ObjectScanner
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, Content, read_whole

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass
class ArgsCall:
    """One ``name[ARGS]{...}`` call as it arrives (a ``call_sequence.Item``): it streams once its object opens."""

    body: str = ""  # the call's text read so far
    name: str = ""
    tag: str = ""  # the part of ``[ARGS]`` read so far (all of it: the arguments follow)
    scanner: ObjectScanner = field(default_factory=ObjectScanner)
    arguments: str = ""  # the object's raw text so far (leading whitespace dropped)
    index: int | None = None
    sent: int = 0  # how much of ``arguments`` went out
    _bad: bool = False

    @property
    def finished(self) -> bool:
        """It closed or broke: nothing more is read."""
        return self._bad or self.scanner.finished

    @property
    def broken(self) -> bool:
        """Its text broke off before its object closed."""
        return self._bad or self.scanner.state == "bad"

    def read(self, text: str) -> int:
        """Read more: how many characters of ``text`` are its own (all until it finishes)."""
        used = 0
        while used < len(text) and not self.finished and self.tag != ARGS:
            self._head(text[used])
            used += 1
        self.body += text[:used]
        if self.tag != ARGS or self.finished:
            return used
        _, taken = self.scanner.feed(text[used:])
        self.body += text[used : used + taken]
        self.arguments = (self.arguments + text[used : used + taken]).lstrip(SPACE)
        return used + taken

    def stream(self, index: int) -> list[CallPiece]:
        """Its pieces not yet given out once its object opened: the first names it (as call ``index``)."""
        return streamed(self, index) if self.arguments else []

    def call(self) -> CallPiece | None:
        """Never a whole call of its own: a call streams from its ``{`` (this one did not: it is no call)."""
        return None

    def _head(self, ch: str) -> None:
        """Read one character of the name or of the ``[ARGS]`` tag after it (anything else breaks the call)."""
        if self.tag or ch == "[":
            self.tag += ch
            self._bad = not ARGS.startswith(self.tag) or (self.tag == ARGS and not self.name)
        elif ch in NAME_CHARS:
            self.name += ch
        else:
            self._bad = True


def args_calls(content: Content) -> CallSequence:
    """The ``name[ARGS]{...}`` calls after a first ``[TOOL_CALLS]``, separated by further tags."""
    return CallSequence(content, item=ArgsCall, starts=lambda ch: ch in NAME_CHARS, separator=TOOL_CALLS,
                        held=TOOL_CALLS)  # fmt: skip


@dataclass
class MistralReader(LeadIn):
    """Content and tool calls from a text fed piece by piece."""

    def _lead(self) -> list[str | CallPiece]:
        """Content up to the tag (what may be its start waits); then the calls."""
        start = self._buffer.find(TOOL_CALLS)
        if start < 0:
            ready, self._buffer = ready_and_held(self._buffer, TOOL_CALLS)
            return self._content.take(ready)
        rest = self._buffer[start + len(TOOL_CALLS) :]
        if not rest.lstrip(SPACE):  # the format shows in the first character after the tag
            return []
        out = self._content.take(self._buffer[:start])
        if rest.lstrip(SPACE)[0] != "[":
            return out + self._begin(args_calls(self._content), rest)
        calls = CallSequence(self._content, **json_items(("arguments",)), separator=",", opener="[", closer="]",
                             held=TOOL_CALLS)  # fmt: skip
        return out + self._begin(calls, rest)


def parse_mistral(text: str) -> tuple[str | None, list[CallPiece]]:
    """A whole text's content (None: none) and tool calls."""
    return read_whole(MistralReader(), text)

"""Mistral tool calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (``--tool-call-parser mistral``).

The reader of ``tool_choice: "auto"`` with ``--tool-call-parser mistral`` (Mistral 7B Instruct v0.3's
format, and the chat templates that write it). The text before ``[TOOL_CALLS]`` is content; after it
comes a JSON array whose elements with a non-empty string ``name`` and an object ``arguments`` are
calls. An element that opens with ``{"name": <string>, "arguments": {`` is streamed: its name once its
arguments begin, then their raw text as written (the call's ``arguments``); any other element is held
until it closes, and its arguments re-serialized. Reading calls stops at the first element that is no
call (the text from there, the tag and ``[`` included when it is the first, is content) and at the
array's ``]`` (the text after it is content). A streamed call cut off by the end of the text is a call
as far as it was written. ``[TOOL_CALLS]`` is a special token of Mistral's tokenizers: the text keeps
special tokens (``skip_special_tokens`` off, as vLLM's parser asks with a Hugging Face tokenizer).

Differences from vLLM: vLLM's whole answer takes the text before the first tag as content and drops the
text after the array, and on any element that is no call makes the text after the tag (the tag dropped)
all content; its stream reads the text after the last tag; it re-serializes the arguments, and its ids
are 9 alphanumeric characters (Mistral's rule; ours are ``chatcmpl-tool-<hex>``). Only the JSON array
format is read: the ``[TOOL_CALLS]name[ARGS]{...}`` format of newer Mistral tokenizers is not.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.entrypoints.server.tags import ready_and_held
from scheduler.entrypoints.server.tool_calling.call_object import json_items
from scheduler.entrypoints.server.tool_calling.call_sequence import CallSequence, LeadIn
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, read_whole

TOOL_CALLS = "[TOOL_CALLS]"


@dataclass
class MistralReader(LeadIn):
    """Content and tool calls from a text fed piece by piece."""

    def _lead(self) -> list[str | CallPiece]:
        """Content up to the tag (what may be its start waits); then the calls."""
        start = self._buffer.find(TOOL_CALLS)
        if start < 0:
            ready, self._buffer = ready_and_held(self._buffer, TOOL_CALLS)
            return self._content.take(ready)
        out = self._content.take(self._buffer[:start])
        calls = CallSequence(self._content, **json_items(("arguments",)), separator=",", opener="[", closer="]",
                             held=TOOL_CALLS)  # fmt: skip
        return out + self._begin(calls, self._buffer[start + len(TOOL_CALLS) :])


def parse_mistral(text: str) -> tuple[str | None, list[CallPiece]]:
    """A whole text's content (None: none) and tool calls."""
    return read_whole(MistralReader(), text)

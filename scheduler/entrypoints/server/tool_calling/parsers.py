"""``--tool-call-parser``'s parsers: each name's reader of "auto" tool calls, and whether its text keeps special
tokens (``skip_special_tokens`` off, as vLLM's parser of that name asks: a tag of its format may be one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler.entrypoints.server.tool_calling.call_sequence import CallSequence
from scheduler.entrypoints.server.tool_calling.hermes import HermesReader
from scheduler.entrypoints.server.tool_calling.llama3_json import Llama3JsonReader
from scheduler.entrypoints.server.tool_calling.mistral import MistralReader
from scheduler.entrypoints.server.tool_calling.pythonic import pythonic_reader

AutoReader = HermesReader | Llama3JsonReader | MistralReader | CallSequence  # "auto"'s reader of one sample's text


@dataclass(frozen=True)
class Parser:
    """A tool-call parser: a fresh reader of one sample's text, and whether that text keeps special tokens."""

    reader: Callable[[], AutoReader]
    keeps_special_tokens: bool


PARSERS = {  # config.TOOL_CALL_PARSERS names them
    "hermes": Parser(HermesReader, keeps_special_tokens=True),  # <tool_call> may be a special token
    "llama3_json": Parser(Llama3JsonReader, keeps_special_tokens=False),  # read with or without <|python_tag|>
    "pythonic": Parser(pythonic_reader, keeps_special_tokens=False),
    "mistral": Parser(MistralReader, keeps_special_tokens=True),  # [TOOL_CALLS] is a special token
}

"""``--tool-call-parser``'s parsers: each name's reader of "auto" tool calls, and whether its text keeps special
tokens (``skip_special_tokens`` off, as vLLM's parser of that name asks: a tag of its format may be one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler.entrypoints.server.tool_calling.call_sequence import CallSequence
from scheduler.entrypoints.server.tool_calling.deepseek import DeepSeekReader, deepseek_v3_reader, deepseek_v31_reader
from scheduler.entrypoints.server.tool_calling.hermes import HermesReader
from scheduler.entrypoints.server.tool_calling.llama3_json import Llama3JsonReader
from scheduler.entrypoints.server.tool_calling.mistral import MistralReader
from scheduler.entrypoints.server.tool_calling.protocol import Tool
from scheduler.entrypoints.server.tool_calling.pythonic import pythonic_reader
from scheduler.entrypoints.server.tool_calling.qwen3_coder import Qwen3CoderReader, qwen3_coder_reader

# "auto"'s reader of one sample's text
AutoReader = HermesReader | Llama3JsonReader | MistralReader | CallSequence | Qwen3CoderReader | DeepSeekReader


@dataclass(frozen=True)
class Parser:
    """A tool-call parser: a fresh reader of one sample's text, and whether that text keeps special tokens."""

    new: Callable[..., AutoReader]  # a fresh reader: of the request's tools when ``typed``, else of nothing
    keeps_special_tokens: bool
    typed: bool = False  # its reader types the calls' values by the tools' schemas

    def reader(self, tools: list[Tool]) -> AutoReader:
        """A fresh reader of one sample's text of a request with ``tools``."""
        return self.new(tools) if self.typed else self.new()


PARSERS = {  # config.TOOL_CALL_PARSERS names them
    "hermes": Parser(HermesReader, keeps_special_tokens=True),  # <tool_call> may be a special token
    "llama3_json": Parser(Llama3JsonReader, keeps_special_tokens=False),  # read with or without <|python_tag|>
    "pythonic": Parser(pythonic_reader, keeps_special_tokens=False),
    "mistral": Parser(MistralReader, keeps_special_tokens=True),  # [TOOL_CALLS] is a special token
    "qwen3_coder": Parser(qwen3_coder_reader, keeps_special_tokens=True, typed=True),  # as hermes: <tool_call>
    "deepseek_v3": Parser(deepseek_v3_reader, keeps_special_tokens=True),  # its tags are special tokens
    "deepseek_v31": Parser(deepseek_v31_reader, keeps_special_tokens=True),
}

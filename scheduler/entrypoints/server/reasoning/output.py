"""A chat request's reasoning, as vLLM serves it with ``--reasoning-parser``: checks, messages and deltas.

With a parser, a chat message carries the reasoning as ``reasoning`` and ``reasoning_content`` (vLLM's
current name and its older one, the same text; null when the sample wrote none) and the rest as ``content``
(null when empty); streamed, a delta carries the reasoning pieces as they are read (both names), then the
content pieces. ``include_reasoning: false`` drops the reasoning (null in a message, no such deltas); the
content is the same. Tool calls ("auto") are read from the content alone. Reasoning tokens count in
``completion_tokens``, as vLLM's.

The parsers (``reader.ParserRules``): ``deepseek_r1`` and ``qwen3`` both read ``<think>...</think>``, a
missing start tag as reasoning from the first token (their chat templates write it into the prompt); a
qwen3 request with ``chat_template_kwargs.enable_thinking: false`` reads an output without the start tag
as content (vLLM: the template wrote the whole thinking block into the prompt).

A named or "required" tool choice and a ``response_format`` schema are refused with a parser (a 400 naming
the field): their grammar would hold the output from its first token, leaving no room for thinking (vLLM
starts it after the end tag). ``structured_outputs`` is served: its grammar holds the whole output,
reasoning and tags included.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from paged_kv.errors import describe
from scheduler.entrypoints.server.protocol import ChatCompletionRequest
from scheduler.entrypoints.server.reasoning.reader import ParserRules, ReasoningReader, split
from scheduler.entrypoints.server.sampling import FieldError

PARSERS = {"deepseek_r1": ParserRules(), "qwen3": ParserRules(thinking_switch=True)}  # --reasoning-parser's
FIELDS = ("reasoning", "reasoning_content")  # vLLM's current name and its older one, both sent
NO_ROOM = "with --reasoning-parser (its grammar would leave no room for thinking: vLLM's starts after </think>)"


def check_reasoning(body: ChatCompletionRequest) -> None:
    """Refuse (FieldError naming the field) what a reasoning parser cannot serve: a named or "required" tool
    choice, a ``response_format`` other than text (already checked: a mapping with a known ``type``)."""
    choice = body.chosen_tool
    if choice not in ("none", "auto"):
        shown = choice if isinstance(choice, str) else f"function {choice.function.name!r}"
        raise FieldError("tool_choice", describe("tool_choice", shown, f'"none" or "auto" {NO_ROOM}'))
    if body.response_format is not None and body.response_format.get("type") != "text":
        raise FieldError("response_format", describe("response_format", body.response_format, f"text {NO_ROOM}"))


@dataclass
class ReasoningOutput:
    """How a request's samples split into reasoning and content, whole or streamed (one reader per choice)."""

    rules: ParserRules
    include: bool = True  # include_reasoning: false drops the reasoning from every body
    readers: dict[int, ReasoningReader] = field(default_factory=dict)  # per streamed choice

    def message(self, text: str) -> tuple[dict, str]:
        """A whole sample's reasoning fields and its content text."""
        reasoning, content = split(self.rules, text)
        return dict.fromkeys(FIELDS, reasoning if self.include else None), content

    def delta(self, choice: int, text: str, finished: bool) -> tuple[dict, str]:
        """A streamed choice's reasoning fields for its next text (and its end, when ``finished``) and its content."""
        reader = self.readers.setdefault(choice, ReasoningReader(self.rules))
        pieces = reader.feed(text) + (reader.finish() if finished else [])
        reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
        fields = dict.fromkeys(FIELDS, reasoning) if reasoning and self.include else {}
        return fields, "".join(t for kind, t in pieces if kind == "content")


def reasoning_output(body: ChatCompletionRequest, parser: str | None) -> ReasoningOutput | None:
    """The request's ReasoningOutput under ``parser`` (None: no parser, no reasoning split out); its checks first."""
    if parser is None:
        return None
    check_reasoning(body)
    rules = PARSERS[parser]
    if rules.thinking_switch and body.chat_template_kwargs.get("enable_thinking", True) is False:
        rules = replace(rules, implicit_start=False)
    return ReasoningOutput(rules, body.include_reasoning)

"""A chat request's reasoning, as vLLM serves it with ``--reasoning-parser``: its constraint's start, messages, deltas.

With a parser, a chat message carries the reasoning as ``reasoning`` and ``reasoning_content`` (vLLM's
current name and its older one, the same text; null when the sample wrote none) and the rest as ``content``
(null when empty); streamed, a delta carries the reasoning pieces as they are read (both names), then the
content pieces. ``include_reasoning: false`` drops the reasoning (null in a message, no such deltas); the
content is the same. Tool calls ("auto") are read from the content alone. Reasoning tokens count in
``completion_tokens``, as vLLM's.

The parsers (``reader.ParserRules``): ``deepseek_r1`` and ``qwen3`` both read ``<think>...</think>``, a
missing start tag as reasoning from the first token (their chat templates write it into the prompt); a
qwen3 request with ``chat_template_kwargs.enable_thinking: false`` reads an output without the start tag
as content (vLLM: the template wrote the whole thinking block into the prompt). ``mistral`` (Magistral) reads
``[THINK]...[/THINK]``, special tokens of its tokenizer (the text keeps them: ``skip_special_tokens`` off, as
for the hermes and mistral tool parsers), and an output that does not open with ``[THINK]`` as content, as
vLLM's MistralReasoningParser. Differences from vLLM there: vLLM also takes a ``[THINK]`` after some text
(that text is content) and drops a ``[/THINK]`` without a ``[THINK]``; ours reads the start tag only where
the output opens (after whitespace) and keeps any other tag in the content as written.

The rendered prompt comes first, as vLLM checks the prompt's token ids (``is_reasoning_end``) before reading
the output (``ReasoningOutput.after_prompt``, after the chat is encoded): a prompt whose last tag is the end
tag (a template with thinking off wrote ``<think>\n\n</think>\n\n``) makes the whole output content and
its grammar hold from the first token; one whose last tag is an open ``<think>`` (a template that prefills
it) makes an untagged output reasoning, even for qwen3 with thinking off (vLLM's qwen3 parser then reads an
output without ``</think>`` as content). mistral's prompt ended only where its last ``[THINK]`` was closed,
and an open one changes nothing, as vLLM's. The tags are found in the prompt's text (vLLM: as special tokens).

A request's output constraint (a named or "required" tool choice's, a ``response_format`` schema,
``structured_outputs``) starts after the thinking, as vLLM's grammar starts after its parser's end tag: the
engine leaves the output free until it writes the end tag's tokens (the model's tokenizer's, tokenized once
at start-up: ``end_tag_ids``), then holds the rest to the grammar (``StructuredOutputsParams.start_after``).
An output that starts in its answer (qwen3 with thinking off, a prompt that ended the thinking) is held from
its first token; without such a prompt, mistral's grammar waits for ``[/THINK]`` (as vLLM's: an answer
without thinking is not held). The content, read after the thinking, is then the grammar's text: a tool
call's arguments, a response's JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from scheduler.core.structured_params import StructuredOutputsParams
from scheduler.entrypoints.server.protocol import ChatCompletionRequest
from scheduler.entrypoints.server.reasoning.reader import ParserRules, ReasoningReader, split

PARSERS = {  # --reasoning-parser's (config.REASONING_PARSERS names them)
    "deepseek_r1": ParserRules(),
    "qwen3": ParserRules(thinking_switch=True),
    # Magistral: [THINK] and [/THINK] are special tokens; no start tag, no thinking (as vLLM's MistralReasoningParser)
    "mistral": ParserRules(start="[THINK]", end="[/THINK]", implicit_start=False, keeps_special_tokens=True,
                           paired_in_prompt=True),
}
FIELDS = ("reasoning", "reasoning_content")  # vLLM's current name and its older one, both sent


def end_tag_ids(tokenizer, parser: str) -> tuple[int, ...]:
    """The tokens of ``parser``'s end tag as the model's tokenizer writes it alone (one special token in the
    reasoning models' vocabularies; several in SmolLM2's, where another split of the same text would not count)."""
    return tuple(tokenizer.encode(PARSERS[parser].end, add_special_tokens=False))


@dataclass
class ReasoningOutput:
    """How a request's samples split into reasoning and content, whole or streamed (one reader per choice)."""

    rules: ParserRules
    include: bool = True  # include_reasoning: false drops the reasoning from every body
    readers: dict[int, ReasoningReader] = field(default_factory=dict)  # per streamed choice

    def constrain(self, spec: StructuredOutputsParams, end_ids: tuple[int, ...]) -> StructuredOutputsParams:
        """``spec`` starting after the thinking's end tag ``end_ids`` (as vLLM's grammar); from the first token when
        the output starts in its answer (qwen3 with thinking off: the template closed the thinking in the prompt)."""
        return replace(spec, start_after=end_ids) if self.rules.grammar_after_end else spec

    def after_prompt(self, prompt: str, spec: StructuredOutputsParams | None,
                     end_ids: tuple[int, ...]) -> StructuredOutputsParams | None:
        """Read the samples as the rendered ``prompt`` (its text) leaves them (``ParserRules.after``); ``spec``
        (the request's constraint, if any) starting where the output's thinking then ends."""
        self.rules = self.rules.after(prompt)
        return None if spec is None else self.constrain(replace(spec, start_after=None), end_ids)

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
    """The request's ReasoningOutput under ``parser`` (None: no parser, no reasoning split out)."""
    if parser is None:
        return None
    rules = PARSERS[parser]
    kwargs = body.chat_options()["chat_template_kwargs"]  # as the template saw them (reasoning_effort's included)
    if rules.thinking_switch and kwargs.get("enable_thinking", True) is False:
        rules = replace(rules, implicit_start=False, grammar_after_end=False)
    return ReasoningOutput(rules, body.include_reasoning)

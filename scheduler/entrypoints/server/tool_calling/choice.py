"""Tool calling on chat completions, as vLLM serves it: the request's checks, its output constraint, its answers.

``tool_choice`` (unset: "auto" with ``tools``, else "none"):

- "none": the tools are only rendered into the prompt; the answer is text.
- a named function: the output is held (xgrammar) to that function's ``parameters`` schema; the
  message has one call of it whose ``arguments`` are the whole text, and ``content`` "" (vLLM's).
- "required": the output is held to a JSON array (at least one item; exactly one with
  ``parallel_tool_calls: false``) of ``{"name": <a tool's name>, "parameters": <its schema>}``
  objects; each becomes a call (its arguments the ``parameters`` value's text as written), ``content`` "".
- "auto": only with ``--enable-auto-tool-choice`` and ``--tool-call-parser`` (else a 400, as
  vLLM); the output is free and the parser (``parsers.PARSERS``: hermes, llama3_json, pythonic,
  mistral, qwen3_coder, deepseek_v3, deepseek_v31) reads calls and content out of it (qwen3_coder
  types its calls' values by the request's tools); special tokens are kept in the text where a tag
  of that parser's format may be one (hermes, mistral, qwen3_coder, deepseek_v3, deepseek_v31).

``finish_reason`` is "tool_calls" when an "auto" or "required" sample made a call and stopped, else the
sample's own: "stop" for a named call, "length" for one cut off (OpenAI's; vLLM says "tool_calls" for an
"auto" call cut off, and streamed for a "required" one too). Streamed, a call's
first delta has its index, id, type and name, the next ones its arguments' text as it is generated
(a named call's from the first token; a "required" call's once its name's string closes; an "auto"
call as its parser streams it: see each parser's module); the finish reason is the whole response's. Each call's id is
``chatcmpl-tool-<random hex>``. Under ``--reasoning-parser`` a named or "required" call's constraint starts after
the thinking (``reasoning.output``) and its calls are read from the text after it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from paged_kv.errors import describe
from scheduler.core.structured_params import StructuredOutputsParams
from scheduler.entrypoints.server.protocol import ChatCompletionRequest
from scheduler.entrypoints.server.sampling import FieldError
from scheduler.entrypoints.server.tool_calling.parsers import PARSERS, AutoReader
from scheduler.entrypoints.server.tool_calling.protocol import NamedToolChoice, Tool
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, NamedReader, RequiredReader, joined

AUTO_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
Reader = NamedReader | RequiredReader | AutoReader  # a sample's reader: a named call's, "required"'s, "auto"'s


def check_tools(body: ChatCompletionRequest, auto_enabled: bool, constraints: dict[str, object]) -> None:
    """Refuse (FieldError naming the field) a tool choice this request or server cannot honour."""
    choice = body.chosen_tool
    if choice == "none":
        return
    shown = choice if isinstance(choice, str) else f"function {choice.function.name!r}"
    expected = _expected_choice(body, auto_enabled)
    if expected is not None:
        raise FieldError("tool_choice", describe("tool_choice", shown, expected))
    if choice != "auto" and constraints:
        name = "structured_outputs" if body.structured_outputs is not None else "response_format"
        expected = f"null or a text format when tool_choice is {shown} (the call's schema is the constraint)"
        raise FieldError(name, describe(name, getattr(body, name), expected))


def _expected_choice(body: ChatCompletionRequest, auto_enabled: bool) -> str | None:
    """What ``tool_choice`` must be instead, when this request's tools or fields or the server's options refuse it."""
    choice, names = body.chosen_tool, [t.function.name for t in body.tools or []]
    if not names:
        return '"none" or unset when no tools are given'
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        return f"a function of tools: one of {names}"
    if choice == "auto" and not auto_enabled:
        return f'"none", "required" or a named function: {AUTO_FLAGS}'
    if body.use_beam_search:
        return '"none" with use_beam_search (the beams are not read for tool calls)'
    return None


def tool_constraint(body: ChatCompletionRequest) -> dict[str, object]:
    """SamplingParams keywords of a named or "required" tool choice's constraint ({} for "none" and "auto")."""
    choice = body.chosen_tool
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in body.tools if t.function.name == choice.function.name)
        schema = tool.function.schema()
    elif choice == "required":
        schema = required_schema(body.tools, body.parallel_tool_calls)
    else:
        return {}
    return {"structured_outputs": StructuredOutputsParams(json=schema)}


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, object]:
    """"required"'s schema: an array of calls of the tools (one call unless ``parallel``), their ``$defs`` shared."""
    items, defs = [], {}
    for tool in tools:
        parameters = dict(tool.function.schema())
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                expected = "one schema per $defs name across the tools (they share one array schema)"
                raise FieldError("tools", describe("tools $defs name", name, expected))
        items.append(_call_schema(tool.function.name, parameters))
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    return schema | ({} if parallel else {"maxItems": 1}) | ({"$defs": defs} if defs else {})


def _call_schema(name: str, parameters: dict[str, object]) -> dict[str, object]:
    """One item of "required"'s array: ``{"name": name, "parameters": <its schema>}``, in that order."""
    properties = {"name": {"enum": [name]}, "parameters": parameters}
    return {"type": "object", "properties": properties, "required": ["name", "parameters"]}


def tool_call_id() -> str:
    """A new tool call's id (vLLM's form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolOutput:
    """How the samples of a request with a tool choice other than "none" become messages and deltas."""

    choice: str | NamedToolChoice  # "required", "auto" or a named function
    parser: str = "hermes"  # "auto"'s parser: a name of PARSERS
    tools: list[Tool] = field(default_factory=list)  # the request's (a parser may type the calls' values by them)
    readers: dict[int, Reader] = field(default_factory=dict)  # per streamed choice
    called: set[int] = field(default_factory=set)  # streamed choices that made a call

    def reader(self) -> Reader:
        """A fresh reader of one sample's text."""
        if isinstance(self.choice, NamedToolChoice):
            return NamedReader(self.choice.function.name)
        return RequiredReader() if self.choice == "required" else PARSERS[self.parser].reader(self.tools)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A whole sample's message and finish reason."""
        reader = self.reader()
        pieces = reader.feed(text) + reader.finish()
        calls = [_message_call(p) for p in joined(pieces)]
        content = "".join(p for p in pieces if isinstance(p, str))
        message = {"role": "assistant", "content": (content or None) if self.choice == "auto" else ""}
        message |= {"tool_calls": calls} if calls else {}
        return message, self._finish(finish_reason, bool(calls))

    def delta(self, choice: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A streamed choice's delta for its next text (and its end, with ``finish_reason``) and finish reason."""
        reader = self.readers.setdefault(choice, self.reader())
        pieces = reader.feed(text) + (reader.finish() if finish_reason else [])
        content = "".join(p for p in pieces if isinstance(p, str))
        calls = [_delta_call(p) for p in joined(pieces)]
        if calls:
            self.called.add(choice)
        delta = ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})
        return delta, self._finish(finish_reason, choice in self.called)

    def _finish(self, finish_reason: str | None, called: bool) -> str | None:
        """"tool_calls" for an "auto" or "required" sample that made a call and stopped; else the sample's own."""
        chose = not isinstance(self.choice, NamedToolChoice)
        return "tool_calls" if finish_reason == "stop" and called and chose else finish_reason


def _message_call(p: CallPiece) -> dict:
    """A whole call as a message's ``tool_calls`` entry."""
    return {"id": tool_call_id(), "type": "function", "function": {"name": p.name, "arguments": p.arguments}}


def _delta_call(p: CallPiece) -> dict:
    """A call's piece as a streamed ``tool_calls`` entry: its first with id, type and name."""
    if p.name is None:
        return {"index": p.index, "function": {"arguments": p.arguments}}
    return {"index": p.index, **_message_call(p)}


def tool_output(body: ChatCompletionRequest, parser: str | None = None) -> ToolOutput | None:
    """The request's ToolOutput (None for "none": a plain answer); "auto" reads with ``parser`` (checked: set)."""
    choice = body.chosen_tool
    return None if choice == "none" else ToolOutput(choice, parser or "hermes", list(body.tools or []))


def keeps_special_tokens(body: ChatCompletionRequest, parser: str | None) -> bool:
    """Whether the request's text must keep special tokens: "auto" with a parser whose tags may be ones."""
    return body.chosen_tool == "auto" and parser is not None and PARSERS[parser].keeps_special_tokens

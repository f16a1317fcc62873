"""Qwen3-Coder's XML tool calls (``--tool-call-parser qwen3_coder``; also Qwen3-Next's and Qwen3.5's templates):
``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>``.

The reader of ``tool_choice: "auto"``. Text outside ``<tool_call>`` blocks is content. In a block,
after whitespace, ``<function=NAME>`` names the call (NAME: one or more characters, none of them
whitespace or ``<>{}"'``); then come parameters, whitespace around each, then ``</function>`` and
``</tool_call>`` (a ``</tool_call>`` right after the parameters closes the function too). A parameter's
value is its raw text up to the first ``</parameter>``, less one newline at each end; its key is read
as NAME is. The call's ``arguments`` are a JSON object of the parameters in the order written, each
value read by the type its key has in the request's tool schema (the ``type`` of its property, the
first that is not "null" of a list, an ``anyOf`` or a ``oneOf``):

- "string", no type, a key the schema does not have, a function not among the tools: the text itself;
- any other type: the text as JSON, else as a Python literal (``True``, ``None``, ``{'k': 1}``), if that
  is a value of the type or null (integer: an int, number: an int or a float, boolean, object, array);
  else the text itself (a string).

A key given twice keeps its first value. Streamed, a call goes out as soon as its ``<function=NAME>``
is read: its name and ``{``; then each parameter: a string's key as its tag is read and its text as it is
written (JSON-escaped), any other once its ``</parameter>`` is read; ``}`` once the call closes. The
pieces joined are the call's ``arguments``, ``json.dumps`` of the object (non-ASCII kept).

Malformed text: a block whose first thing is not ``<function=NAME>`` is no call (its text is content,
and reading goes on after the tag); in a named call, a bad parameter tag or anything else where a
parameter or a closing tag should be closes the call there and the text from there is read as if
outside a block. At the end of the text, a named call is closed with the parameters read (a parameter
cut off keeps the text written, a partial ``</parameter>`` included; a partial key is dropped); a
block not yet named and a partial tag are content. Content that is only whitespace is none. Whole or
piece by piece, the reading is the same. ``<tool_call>`` may be a special token: the text keeps
special tokens (as for hermes).

Differences from vLLM: vLLM also reads ``<function=...>`` outside a ``<tool_call>`` block, ends a
value at a ``</parameter>`` only where the next structural tag follows (ours ends it at the first one;
a value without ``</parameter>`` runs to the end of the text), turns a boolean that is neither "true"
nor "false" into false and ``3.0`` for a number into ``3`` (ours: the text, and ``3.0``), lets a later
value of a key replace an earlier one, streams a parameter only once its value is whole and takes
the text before the first block as content and drops what follows its last.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field

from scheduler.entrypoints.server.tags import ready_and_held
from scheduler.entrypoints.server.tool_calling.object_scanner import SPACE
from scheduler.entrypoints.server.tool_calling.protocol import Tool
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, Content, read_whole

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
NOT_NAME = frozenset(SPACE + "<>{}\"'")  # characters a function's or a parameter's name never has
TYPES = {"integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,), "array": (list,)}

Properties = dict[str, dict[str, object]]  # a function's parameters' schemas by key


def properties_of(tools: list[Tool]) -> dict[str, Properties]:
    """Each tool's parameters' schemas by key, by function name."""
    out: dict[str, Properties] = {}
    for tool in tools:
        properties = tool.function.schema().get("properties")
        out[tool.function.name] = properties if isinstance(properties, dict) else {}
    return out


def value_type(schema: object) -> str:
    """The JSON type a parameter's schema gives its value: the first not "null" ("string" when none is given)."""
    if not isinstance(schema, dict):
        return "string"
    given = schema.get("type")
    options = given if isinstance(given, list) else [given] if given is not None else []
    for union in ("anyOf", "oneOf"):
        options += [o.get("type") for o in schema.get(union, []) if isinstance(o, dict)] if not options else []
    named = [o for o in options if isinstance(o, str)]
    return next((o for o in named if o != "null"), "null" if named else "string")


def typed(text: str, kind: str) -> object:
    """A parameter's text as a value of JSON type ``kind``: the text itself for a string, else its JSON or Python
    literal value if that is one of ``kind`` or null (else the text)."""
    if kind == "string":
        return text
    for read in (json.loads, ast.literal_eval):
        try:
            value = read(text)
            json.dumps(value, allow_nan=False)  # (NaN, Infinity, a set, bytes: no JSON value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if value is None or (kind in TYPES and isinstance(value, TYPES[kind]) and
                             (kind == "boolean" or not isinstance(value, bool))):  # fmt: skip
            return value
    return text


@dataclass
class _Call:
    """A named call's arguments as its parameters are read: the JSON object's text, piece by piece."""

    index: int
    properties: Properties  # its function's parameters' schemas ({} for a function not among the tools)
    keys: set[str] = field(default_factory=set)  # the keys written so far
    key: str = ""  # the parameter being read
    kind: str = ""  # its value's type; "" while its value is dropped (its key was given before)
    raw: str = ""  # its value's text so far
    sent: int = 0  # how much of a string's value went out

    def open(self, key: str) -> str:
        """A parameter's tag was read: the arguments' text that goes out now (a string's key and opening quote)."""
        self.key, self.raw, self.sent = key, "", 0
        self.kind = "" if key in self.keys else value_type(self.properties.get(key))
        if not self.kind:
            return ""
        head = (", " if self.keys else "") + json.dumps(key, ensure_ascii=False) + ": "
        self.keys.add(key)
        return head + '"' if self.kind == "string" else ""

    def value(self, text: str) -> str:
        """More of the value's text: what goes out now (a string's text as JSON, the last newline held)."""
        self.raw += text
        if self.kind != "string":
            return ""
        shown = _trimmed(self.raw, end=False)
        shown = shown[: len(shown) - shown.endswith("\n")]
        out, self.sent = shown[self.sent :], len(shown)
        return json.dumps(out, ensure_ascii=False)[1:-1]

    def close(self) -> str:
        """The value's end: what goes out now (a string's rest and closing quote, any other whole)."""
        if self.kind == "string":
            rest = _trimmed(self.raw, end=True)[self.sent :]
            out = json.dumps(rest, ensure_ascii=False)[1:-1] + '"'
        elif self.kind:
            head = (", " if len(self.keys) > 1 else "") + json.dumps(self.key, ensure_ascii=False) + ": "
            out = head + json.dumps(typed(_trimmed(self.raw, end=True), self.kind), ensure_ascii=False)
        else:
            out = ""
        self.key, self.kind = "", ""
        return out


def _trimmed(raw: str, end: bool) -> str:
    """A value's text less one newline at its start (and at its end, once it is whole)."""
    text = raw[1:] if raw.startswith("\n") else raw
    return text[:-1] if end and text.endswith("\n") else text


@dataclass
class Qwen3CoderReader:
    """Content and tool calls from a text fed piece by piece (``tools``: the request's, whose schemas type the
    parameters' values)."""

    properties: dict[str, Properties] = field(default_factory=dict)  # properties_of the request's tools
    _state: str = "outside"  # outside, block, function (its name), body, key, value, closing (after </function>)
    _buffer: str = ""  # text not yet decided
    _held: str = ""  # a block's text not yet named: content if it is no call
    _name: str = ""  # the name (or key) being read
    _call: _Call | None = None
    _calls: int = 0
    _content: Content = field(default_factory=Content)

    def feed(self, text: str) -> list[str | CallPiece]:
        """The content and call pieces that ``text`` completes."""
        self._buffer += text
        out: list[str | CallPiece] = []
        while self._buffer and getattr(self, "_" + self._state)(out):
            pass
        return out

    def finish(self) -> list[str | CallPiece]:
        """What the end of the text decides: a named call closed, anything else left over as content."""
        if self._call is not None:
            rest = self._call.value(self._buffer) if self._state == "value" else ""
            self._buffer = ""
            return self._close_call([], rest + self._call.close())
        rest, self._held, self._name, self._buffer = self._held + self._name + self._buffer, "", "", ""
        return self._content.take(rest)

    def _outside(self, out: list[str | CallPiece]) -> bool:
        """Outside a block: content up to ``<tool_call>`` (what may be its start waits)."""
        start = self._buffer.find(START)
        if start < 0:
            ready, self._buffer = ready_and_held(self._buffer, START)
            out += self._content.take(ready)
            return False
        out += self._content.take(self._buffer[:start])
        self._held, self._buffer, self._state = START, self._buffer[start + len(START) :], "block"
        return True

    def _block(self, out: list[str | CallPiece]) -> bool:
        """A block's start: whitespace, then ``<function=`` (else the block is no call)."""
        tag = self._tag(FUNCTION)
        if tag is None:
            return False
        if tag:
            self._held += FUNCTION
            self._state, self._name = "function", ""
        else:
            out += self._no_call("")
        return True

    def _function(self, out: list[str | CallPiece]) -> bool:
        """The function's name up to ``>``: the call's first piece (else the block is no call)."""
        name, ok = self._read_name()
        if name is None:
            return False
        if not ok:
            out += self._no_call(name)
            return True
        self._call = _Call(self._calls, self.properties.get(name, {}))
        self._held, self._state, self._calls = "", "body", self._calls + 1
        out.append(CallPiece(self._call.index, name, "{"))
        return True

    def _body(self, out: list[str | CallPiece]) -> bool:
        """Between parameters: whitespace, then a parameter, ``</function>`` or ``</tool_call>`` (else the call
        closes and the rest is read as outside a block)."""
        for tag, state in ((PARAMETER, "key"), (FUNCTION_END, "closing"), (END, "outside")):
            found = self._tag(tag, keep=True)
            if found:
                self._buffer, self._state, self._name = self._buffer[len(tag) :], state, ""
                if state == "outside":
                    self._close_call(out, "")
                return True
            if found is None:  # (the text may still become this tag)
                return False
        self._close_call(out, "")
        self._state = "outside"
        return True

    def _key(self, out: list[str | CallPiece]) -> bool:
        """A parameter's key up to ``>`` (else the call closes, the tag's text read as outside a block)."""
        key, ok = self._read_name()
        if key is None:
            return False
        if not ok:
            self._buffer = PARAMETER + key + self._buffer
            self._close_call(out, "")
            self._state = "outside"
            return True
        self._piece(out, self._call.open(key))
        self._state = "value"
        return True

    def _value(self, out: list[str | CallPiece]) -> bool:
        """A parameter's value up to ``</parameter>`` (what may be its start waits)."""
        end = self._buffer.find(PARAMETER_END)
        if end < 0:
            ready, self._buffer = ready_and_held(self._buffer, PARAMETER_END)
            self._piece(out, self._call.value(ready))
            return False
        self._piece(out, self._call.value(self._buffer[:end]) + self._call.close())
        self._buffer, self._state = self._buffer[end + len(PARAMETER_END) :], "body"
        return True

    def _closing(self, out: list[str | CallPiece]) -> bool:
        """After ``</function>``: whitespace, then ``</tool_call>`` (else the rest is read as outside a block)."""
        tag = self._tag(END)
        if tag is None:
            return False
        self._close_call(out, "")
        self._state = "outside"
        return True

    def _tag(self, tag: str, keep: bool = False) -> bool | None:
        """Skip whitespace, then whether ``tag`` follows (consumed unless ``keep``); None: not known yet."""
        rest = self._buffer.lstrip(SPACE)
        if self._state == "block":
            self._held += self._buffer[: len(self._buffer) - len(rest)]
        self._buffer = rest
        if rest.startswith(tag):
            self._buffer = rest if keep else rest[len(tag) :]
            return True
        return None if tag.startswith(rest) else False

    def _read_name(self) -> tuple[str | None, bool]:
        """Read a name up to ``>``: (the name, whether it is one) once decided, (None, False) while not yet."""
        for i, ch in enumerate(self._buffer):
            if ch == ">" or ch in NOT_NAME:
                name, self._name = self._name + self._buffer[:i], ""
                self._buffer = self._buffer[i + (ch == ">" and bool(name)) :]
                return name, ch == ">" and bool(name)
        self._name, self._buffer = self._name + self._buffer, ""
        return None, False

    def _no_call(self, name: str) -> list[str | CallPiece]:
        """The block is no call: its text so far (``name``: the name read last) is content, and reading goes on
        outside a block."""
        held, self._held, self._state = self._held + name, "", "outside"
        return self._content.take(held)

    def _piece(self, out: list[str | CallPiece], arguments: str) -> None:
        """Add the open call's next arguments text, if any, to ``out``."""
        if arguments:
            out.append(CallPiece(self._call.index, None, arguments))

    def _close_call(self, out: list[str | CallPiece], arguments: str) -> list[str | CallPiece]:
        """Close the open call (after ``arguments``, its last text): its last piece added to ``out``."""
        self._piece(out, arguments + "}")
        self._call = None
        return out


def qwen3_coder_reader(tools: list[Tool]) -> Qwen3CoderReader:
    """A reader whose parameters' values are typed by ``tools``' schemas."""
    return Qwen3CoderReader(properties_of(tools))


def parse_qwen3_coder(text: str, tools: list[Tool] | None = None) -> tuple[str | None, list[CallPiece]]:
    """A whole text's content (None: none) and tool calls, values typed by ``tools``' schemas."""
    return read_whole(qwen3_coder_reader(tools or []), text)

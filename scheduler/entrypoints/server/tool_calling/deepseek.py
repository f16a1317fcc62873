"""DeepSeek tool calls (``--tool-call-parser deepseek_v3`` and ``deepseek_v31``): a block of calls between
``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each call between ``<｜tool▁call▁begin｜>`` and
``<｜tool▁call▁end｜>``.

- ``deepseek_v3`` (DeepSeek-V3, R1-0528): ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>`` (the word before the separator is the call's type: any word is read, it is not checked);
- ``deepseek_v31`` (DeepSeek-V3.1): ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.

The reader of ``tool_choice: "auto"``. The text before ``<｜tool▁calls▁begin｜>`` is content. After it
come calls, whitespace around each; a name (and a type) is one or more of letters, digits, ``_``,
``-``, ``.``; whitespace is allowed around the fence and the arguments, which are a JSON object. A call
streams as soon as its object's ``{`` is read: its name, then the object's raw text as written (the
call's ``arguments``, up to the object's end). ``<｜tool▁calls▁end｜>`` ends the calls: the text after it
is content. Reading calls stops at the first thing that is neither a call nor the end tag: a call that
broke before its ``{`` (a bad name, a missing separator or fence, arguments that are no object) is no
call, and the text from there, the tags held since the last call included (``<｜tool▁calls▁begin｜>``
for the first), is content; a streamed call whose text breaks after that (a missing end tag, an object
that is no JSON) is kept as far as it was written, and the text from the break is content. At the end
of the text, a streamed call cut off is a call as far as it was written; a call not yet streamed and a
partial tag are content, tags alone are dropped. Content that is only whitespace is none. Whole or
piece by piece, the reading is the same.

The tags are special tokens of DeepSeek's tokenizers: the text keeps special tokens (``skip_special_tokens``
off). Differences from vLLM: vLLM's whole answer takes the text before ``<｜tool▁calls▁begin｜>`` as
content and drops everything after it but the calls its regex finds (any name, any arguments text, not
checked as JSON; deepseek_v3's arguments on one line, fenced exactly by ``\\n```json\\n`` and
``\\n```\\n``); ours keeps the text after the calls as content, accepts whitespace and several lines,
and reads a call only with an object for arguments. Its stream drops text between the calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.entrypoints.server.tags import ready_and_held
from scheduler.entrypoints.server.tool_calling.call_object import streamed
from scheduler.entrypoints.server.tool_calling.call_sequence import LeadIn
from scheduler.entrypoints.server.tool_calling.mistral import NAME_CHARS
from scheduler.entrypoints.server.tool_calling.object_scanner import SPACE, ObjectScanner
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, Content, read_whole

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

# A call's text as steps: a literal tag, a word ("type" or "name": one or more NAME_CHARS), optional whitespace
# ("space"), or the arguments object ("json").
V3_STEPS = (CALL_BEGIN, "type", SEP, "name", "space", "```json", "space", "json", "space", "```", "space", CALL_END)
V31_STEPS = (CALL_BEGIN, "name", SEP, "space", "json", "space", CALL_END)
WORDS = ("type", "name")


@dataclass
class StepCall:
    """One call's text as it arrives, read step by step: it streams once its arguments' ``{`` is read."""

    steps: tuple[str, ...]
    body: str = ""  # the call's text read so far
    name: str = ""
    words: dict[str, str] = field(default_factory=dict)  # the words read so far, by step
    step: int = 0  # the step being read; len(steps): the call closed
    matched: int = 0  # how much of the current literal step was read
    scanner: ObjectScanner = field(default_factory=ObjectScanner)
    arguments: str = ""  # the object's raw text so far
    index: int | None = None  # its call's index, once its first piece went out
    sent: int = 0  # how much of ``arguments`` went out
    bad: bool = False  # its text broke: the character that broke it is not its own

    @property
    def finished(self) -> bool:
        """It closed or broke: nothing more is read."""
        return self.bad or self.step == len(self.steps)

    def read(self, text: str) -> int:
        """Read more: how many characters of ``text`` are its own (all until it finishes)."""
        used = 0
        while used < len(text) and not self.finished:
            used += self._json(text[used:]) if self.steps[self.step] == "json" else self._char(text[used])
        self.body += text[:used]
        return used

    def stream(self, index: int) -> list[CallPiece]:
        """Its pieces not yet given out once its object opened: the first names it (as call ``index``)."""
        return streamed(self, index) if self.arguments else []

    def _char(self, ch: str) -> int:
        """Read one character of a tag, a word or whitespace: 1 if it is the call's, else 0 (the step ended)."""
        kind = self.steps[self.step]
        if kind == "space" or kind in WORDS:
            ok = ch in (SPACE if kind == "space" else NAME_CHARS)
            if ok:
                self.words[kind] = self.words.get(kind, "") + ch
            else:
                self.bad = kind in WORDS and not self.words.get(kind)  # a word is never empty
                self.step += 1
                self.name = self.words.get("name", "")
            return int(ok)
        if ch != kind[self.matched]:
            self.bad = True
            return 0
        self.matched += 1
        if self.matched == len(kind):
            self.step, self.matched = self.step + 1, 0
        return 1

    def _json(self, text: str) -> int:
        """Read the arguments object: how many characters of ``text`` are its own."""
        _, used = self.scanner.feed(text)
        self.arguments += text[:used]
        self.bad = self.scanner.state == "bad" or not self.arguments.lstrip(SPACE).startswith("{")
        self.step += self.scanner.state == "done"
        return used


@dataclass
class StepCalls:
    """The calls after ``<｜tool▁calls▁begin｜>``, each read by a StepCall, then content after the end tag."""

    content: Content  # the reader's content
    steps: tuple[str, ...]
    held: str = ""  # text since the last call: content if reading calls stops before another call
    _state: str = "between"  # between (calls), in_call (in one), content (the rest)
    _buffer: str = ""
    _call: StepCall | None = None
    _calls: int = 0

    def feed(self, text: str) -> list[str | CallPiece]:
        """The content and call pieces that ``text`` completes."""
        self._buffer += text
        out: list[str | CallPiece] = []
        while self._buffer and getattr(self, "_" + self._state)(out):
            pass
        return out

    def finish(self) -> list[str | CallPiece]:
        """The end: a call not yet streamed and a partial tag are content; held tags alone are dropped."""
        if self._state == "in_call" and self._call.index is None:
            return self._content_from(self._call.body)
        return self._content_from("") if self._buffer else []

    def _between(self, out: list[str | CallPiece]) -> bool:
        """Between calls: whitespace, then a call's tag, the end tag (content after it), or content."""
        rest = self._buffer.lstrip(SPACE)
        self.held, self._buffer = self.held + self._buffer[: len(self._buffer) - len(rest)], rest
        if rest.startswith(CALL_BEGIN):
            self._state, self._call = "in_call", StepCall(self.steps)
        elif rest.startswith(CALLS_END):
            self.held, self._buffer, self._state = "", rest[len(CALLS_END) :], "content"
        elif CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest):  # (a tag's start: wait)
            return False
        else:
            out += self._content_from("")
        return True

    def _in_call(self, out: list[str | CallPiece]) -> bool:
        """In a call: its streamed pieces; once it closes, the next call, or once it breaks, content."""
        call = self._call
        self._buffer = self._buffer[call.read(self._buffer) :]
        pieces = call.stream(self._calls)
        if any(p.name is not None for p in pieces):
            self._calls, self.held = self._calls + 1, ""
        out += pieces
        if not call.finished:
            return False
        if call.index is None:  # broke before it streamed: no call
            out += self._content_from(call.body)
        elif call.bad:
            out += self._content_from("")
        else:
            self._state = "between"
        return True

    def _content(self, out: list[str | CallPiece]) -> bool:
        """The rest of the text: content as it comes."""
        out += self.content.take(self._buffer)
        self._buffer = ""
        return False

    def _content_from(self, text: str) -> list[str | CallPiece]:
        """From here on the text is content: the held text, ``text``, and the rest."""
        rest, self.held, self._buffer, self._state = self.held + text + self._buffer, "", "", "content"
        return self.content.take(rest)


@dataclass
class DeepSeekReader(LeadIn):
    """Content and tool calls from a text fed piece by piece (``steps``: the version's call format)."""

    steps: tuple[str, ...] = V31_STEPS

    def _lead(self) -> list[str | CallPiece]:
        """Content up to ``<｜tool▁calls▁begin｜>`` (what may be its start waits); then the calls."""
        start = self._buffer.find(CALLS_BEGIN)
        if start < 0:
            ready, self._buffer = ready_and_held(self._buffer, CALLS_BEGIN)
            return self._content.take(ready)
        out = self._content.take(self._buffer[:start])
        calls = StepCalls(self._content, self.steps, held=CALLS_BEGIN)
        return out + self._begin(calls, self._buffer[start + len(CALLS_BEGIN) :])


def deepseek_v3_reader() -> DeepSeekReader:
    """A reader of DeepSeek-V3's (and R1-0528's) calls: ``function<｜tool▁sep｜>NAME`` and a fenced object."""
    return DeepSeekReader(steps=V3_STEPS)


def deepseek_v31_reader() -> DeepSeekReader:
    """A reader of DeepSeek-V3.1's calls: ``NAME<｜tool▁sep｜>`` and an object."""
    return DeepSeekReader(steps=V31_STEPS)


def parse_deepseek(text: str, steps: tuple[str, ...]) -> tuple[str | None, list[CallPiece]]:
    """A whole text's content (None: none) and tool calls, in the format ``steps`` (V3_STEPS or V31_STEPS)."""
    return read_whole(DeepSeekReader(steps=steps), text)

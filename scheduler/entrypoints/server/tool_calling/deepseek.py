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
of the text, a streamed call cut off is a call as far as it was written, a call not yet streamed is
content, and so is a block with no call, as written; a partial tag after the last call is dropped.
Content that is only whitespace is none. Whole or piece by piece, the reading is the same.

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
from scheduler.entrypoints.server.tool_calling.call_sequence import CallSequence, LeadIn
from scheduler.entrypoints.server.tool_calling.mistral import NAME_CHARS
from scheduler.entrypoints.server.tool_calling.object_scanner import SPACE, ObjectScanner
from scheduler.entrypoints.server.tool_calling.readers import CallPiece, read_whole

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

# A call's text as steps: a literal tag, a word ("type" or "name": one or more NAME_CHARS), optional whitespace
# ("space"), or the arguments object ("json").
V3_STEPS = (CALL_BEGIN, "type", SEP, "name", "space", "```json", "space", "json", "space", "```", "space", CALL_END)
V31_STEPS = (CALL_BEGIN, "name", SEP, "space", "json", "space", CALL_END)
WORDS = ("type", "name")


@dataclass
class StepCall:
    """One call's text as it arrives, read step by step (a ``call_sequence.Item``): it streams once its arguments'
    ``{`` is read."""

    steps: tuple[str, ...]
    body: str = ""  # the call's text read so far
    name: str = ""
    words: dict[str, str] = field(default_factory=dict)  # the words read so far ("type", "name")
    step: int = 0  # the step being read; len(steps): the call closed
    matched: int = 0  # how much of the current literal step was read
    scanner: ObjectScanner = field(default_factory=ObjectScanner)
    arguments: str = ""  # the object's raw text so far
    index: int | None = None  # its call's index, once its first piece went out
    sent: int = 0  # how much of ``arguments`` went out
    broken: bool = False  # its text broke: the character that broke it is not its own

    @property
    def finished(self) -> bool:
        """It closed or broke: nothing more is read."""
        return self.broken or self.step == len(self.steps)

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

    def call(self) -> CallPiece | None:
        """Never a whole call of its own: a call streams from its ``{`` (this one did not: it is no call)."""
        return None

    def _char(self, ch: str) -> int:
        """Read one character of a tag, a word or whitespace: 1 if it is the call's, else 0 (the step ended)."""
        kind = self.steps[self.step]
        if kind == "space" or kind in WORDS:
            return self._run(kind, ch)
        if ch != kind[self.matched]:
            self.broken = True
            return 0
        self.matched += 1
        if self.matched == len(kind):
            self.step, self.matched = self.step + 1, 0
        return 1

    def _run(self, kind: str, ch: str) -> int:
        """One character of a word or of whitespace: 1 if it is the step's, else 0 (the step ended before it)."""
        if ch in (SPACE if kind == "space" else NAME_CHARS):
            if kind in WORDS:
                self.words[kind] = self.words.get(kind, "") + ch
            return 1
        self.broken = kind in WORDS and not self.words.get(kind)  # a word is never empty
        self.step += 1
        self.name = self.words.get("name", "")
        return 0

    def _json(self, text: str) -> int:
        """Read the arguments object: how many characters of ``text`` are its own."""
        _, used = self.scanner.feed(text)
        self.arguments += text[:used]
        self.broken = self.scanner.state == "bad" or not self.arguments.lstrip(SPACE).startswith("{")
        self.step += self.scanner.state == "done"
        return used


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
        calls = CallSequence(self._content, item=lambda: StepCall(self.steps), starts=lambda ch: ch == CALL_BEGIN[0],
                             separator="", closer=CALLS_END, held=CALLS_BEGIN)  # fmt: skip
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

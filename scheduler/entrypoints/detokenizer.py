"""Incremental detokenization and stop-string matching for streamed generation.

Decoding one token at a time is wrong for byte-level tokenizers: a multi-byte
UTF-8 character can be split across tokens, and some tokenizers decode a token
differently depending on its neighbours. :class:`IncrementalDetokenizer`
decodes a short window of recent tokens and emits only the text that the
newest tokens added, holding text back while it ends in an incomplete
character (U+FFFD). The concatenation of everything it emits, after
:meth:`~IncrementalDetokenizer.flush`, equals the full decode of the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"  # what a decoder emits for bytes that do not (yet) form a character
PROMPT_CONTEXT = 4  # prompt tokens decoded ahead of the output, so the first token decodes in context


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, correct across multi-byte and merged tokens.

    Invariant: ``ids[prefix:read]`` decodes to text already emitted that ends on
    a character boundary; tokens after ``read`` have not been emitted yet.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[len(prompt_token_ids) - PROMPT_CONTEXT :] if prompt_token_ids else [])
        self.prefix, self.read = 0, len(self.ids)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (empty while a character is still incomplete)."""
        self.ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD, as in a full decode)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        seen = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        if len(window) <= len(seen) or (window.endswith(REPLACEMENT) and not final):
            return ""
        delta = window[len(seen) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, start: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after ``start``: (its position, the string), or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, start - len(stop) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best


def holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that could still grow into a stop string (not released yet)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest

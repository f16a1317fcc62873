"""What a structured-output request holds its samples to: a JSON schema, a regex, a choice, a grammar, any object."""

from __future__ import annotations

import json as jsonlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from paged_kv.errors import InvalidArgumentError, check_bool, describe
from paged_kv.tokens import as_id_list

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """The language every sample of a request is constrained to (vLLM's ``StructuredOutputsParams``).

    Exactly one of: ``json``, a JSON schema (a dict or its JSON text, kept as compact JSON text in
    its key order so the params stay immutable and hashable); ``regex``, a pattern the whole output
    matches; ``choice``, strings the output is one of; ``grammar``, EBNF / GBNF as xgrammar reads
    it; ``json_object=True``, any JSON object. ``disable_any_whitespace`` allows no whitespace in
    JSON beyond xgrammar's separators (", " and ": "). The engine compiles the constraint at
    ``add_request`` (an invalid one raises there) and masks each step's logits with it; the sample
    ends ("stop") when the grammar is complete and the model picks EOS.

    ``start_after`` (token ids, e.g. a reasoning model's ``</think>``): the grammar holds only the
    output after the first place it writes these tokens, in a row; before, the sample is free (its
    logits are not masked) and may end (EOS, a stop, the length) with no grammar ever applied. A
    prompt that already ends with them starts the grammar at the first token (the thinking ended
    in the prompt). It belongs here, not on SamplingParams, because it says where this constraint
    begins and means nothing without one; it is not part of the grammar (:attr:`language` is the
    compiled grammar's key), so a schema compiles once wherever it starts. vLLM starts its grammar
    after its reasoning parser's end token, engine-wide; here it is per request, one token or several.
    """

    json: str | Mapping[str, object] | None = None  # stored as str
    regex: str | None = None
    choice: Sequence[str] | None = None  # stored as a tuple
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    start_after: Sequence[int] | None = None  # stored as a tuple

    def __post_init__(self) -> None:
        if self.start_after is not None:
            object.__setattr__(self, "start_after", _marker(self.start_after))
        check_bool("structured_outputs.json_object", self.json_object)
        check_bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidArgumentError(describe(f"structured_outputs.{name}", value, "a non-empty str"))
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidArgumentError(describe("structured_outputs", given, f"exactly one of {', '.join(KINDS)}"))

    @property
    def kind(self) -> str:
        """The constraint given: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def language(self) -> StructuredOutputsParams:
        """These params without ``start_after``: the constraint's language alone (the compiled grammar's key)."""
        return self if self.start_after is None else replace(self, start_after=None)

    def waits(self, prompt: Sequence[int]) -> tuple[int, ...] | None:
        """The marker a sample of ``prompt`` writes before its grammar holds: None when there is none or the
        prompt already ends with it (vLLM's check of the prompt: the reasoning ended there)."""
        marker = self.start_after
        if marker is None or tuple(prompt[-len(marker) :]) == marker:
            return None
        return marker


def _schema_text(schema: object) -> str:
    """A JSON schema object as compact JSON text (key order kept: it is the order properties are generated in)."""
    expected = "a JSON schema: a dict, or the JSON text of an object"
    if isinstance(schema, str):
        try:
            schema = jsonlib.loads(schema)
        except ValueError:
            raise InvalidArgumentError(describe("structured_outputs.json", schema, expected)) from None
    if not isinstance(schema, Mapping):
        raise InvalidArgumentError(describe("structured_outputs.json", schema, expected))
    try:
        return jsonlib.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        raise InvalidArgumentError(describe("structured_outputs.json", schema, expected)) from None


def _choices(choice: object) -> tuple[str, ...]:
    """The choices as a tuple of non-empty strings (at least one)."""
    if isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence) or not choice:
        raise InvalidArgumentError(describe("structured_outputs.choice", choice, "a non-empty list of str"))
    if not all(isinstance(c, str) and c for c in choice):
        raise InvalidArgumentError(describe("structured_outputs.choice", choice, "non-empty strings"))
    return tuple(choice)


def _marker(value: object) -> tuple[int, ...]:
    """``start_after`` as a tuple of token ids (at least one)."""
    expected = "a non-empty sequence of token ids"
    ids = as_id_list("structured_outputs.start_after", value, "token ids", expected)
    if not ids:
        raise InvalidArgumentError(describe("structured_outputs.start_after", ids, expected))
    return tuple(ids)

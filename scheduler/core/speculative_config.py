"""Configuration of speculative decoding: vLLM's ``--speculative-config`` for its n-gram (prompt-lookup) method."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from paged_kv.errors import InvalidArgumentError, check_int, describe

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 64  # drafts per sequence and step: a query of k + 1 tokens per sequence


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Draft tokens proposed by matching a sequence's last n-gram earlier in its own tokens, verified in one forward.

    Field names and defaults as vLLM's (``prompt_lookup_min`` defaults to ``prompt_lookup_max``, and both to 5
    when neither is given, as vLLM's ``SpeculativeConfig``).
    """

    method: str = "ngram"
    num_speculative_tokens: int  # k: drafts proposed per sequence and step
    prompt_lookup_max: int | None = None  # the longest n-gram matched (None: prompt_lookup_min, else 5)
    prompt_lookup_min: int | None = None  # the shortest n-gram matched (None: prompt_lookup_max, else 5)

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise InvalidArgumentError(describe("method", self.method, f"one of {METHODS}"))
        check_int("num_speculative_tokens", self.num_speculative_tokens, low=1, high=MAX_SPECULATIVE_TOKENS)
        if self.prompt_lookup_max is not None:
            check_int("prompt_lookup_max", self.prompt_lookup_max, low=1, high=1 << 10)
        if self.prompt_lookup_min is not None:
            check_int("prompt_lookup_min", self.prompt_lookup_min, low=1, high=1 << 10)
        if self.min_n > self.max_n:
            raise InvalidArgumentError(describe("prompt_lookup_min", self.min_n, f"<= prompt_lookup_max={self.max_n}"))

    @property
    def max_n(self) -> int:
        """The longest n-gram matched."""
        return next((v for v in (self.prompt_lookup_max, self.prompt_lookup_min) if v is not None), 5)

    @property
    def min_n(self) -> int:
        """The shortest n-gram matched."""
        return next((v for v in (self.prompt_lookup_min, self.prompt_lookup_max) if v is not None), 5)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config of a JSON object (vLLM's ``--speculative-config``); raises naming the bad field."""
        try:
            values = json.loads(text)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(describe("speculative_config", text, f"a JSON object ({e})")) from e
        if not isinstance(values, dict):
            raise InvalidArgumentError(describe("speculative_config", text, "a JSON object"))
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        """The config of its fields as a dict (vLLM's ``LLM(speculative_config=...)``); raises naming a bad field."""
        known = {f.name for f in fields(cls)}
        unknown = [key for key in values if key not in known]
        if unknown:
            raise InvalidArgumentError(describe(unknown[0], values[unknown[0]], f"one of the fields {sorted(known)}"))
        if "num_speculative_tokens" not in values:
            raise InvalidArgumentError(describe("num_speculative_tokens", None, "an int in [1, 64] (required)"))
        return cls(**values)

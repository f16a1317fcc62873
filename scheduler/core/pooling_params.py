"""Embedding requests: a request's :class:`PoolingParams` and the engine's :class:`PoolerConfig`.

A pooling request runs its prompt as a prefill (chunked like any prompt) and returns one vector: the final-norm
hidden state of its LAST token, or the MEAN over every prompt token, cut to ``dimensions`` (Matryoshka) and then
L2-normalized when ``normalize`` (vLLM's order). The engine's :class:`PoolerConfig` (vLLM's ``--pooler-config``)
chooses the pooling type, the normalize default and which ``dimensions`` a request may ask for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Literal

from paged_kv.errors import InvalidArgumentError, check_bool, check_int, describe

PoolingType = Literal["LAST", "MEAN"]
POOLING_TYPES = ("LAST", "MEAN")
MAX_DIMENSIONS = 1 << 20


@dataclass(frozen=True, kw_only=True)
class PoolingParams:
    """How one embedding request is pooled: ``dimensions`` (None: the model's hidden size) and ``normalize``
    (None: the engine's default)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None:
            check_int("dimensions", self.dimensions, low=1, high=MAX_DIMENSIONS)
        if self.normalize is not None:
            check_bool("normalize", self.normalize)


@dataclass(frozen=True, kw_only=True)
class PoolerConfig:
    """The engine's pooling: ``pooling_type`` ("LAST": the last prompt token, Qwen3-Embedding's; "MEAN": every
    prompt token), ``normalize`` (the default of requests that do not say), and Matryoshka truncation:
    ``is_matryoshka`` lets requests ask for ``dimensions``, restricted to ``matryoshka_dimensions`` when given."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidArgumentError(describe("pooling_type", self.pooling_type, f"one of {POOLING_TYPES}"))
        check_bool("normalize", self.normalize)
        check_bool("is_matryoshka", self.is_matryoshka)
        dims = self.matryoshka_dimensions
        if dims is None:
            return
        if not isinstance(dims, tuple) or not dims:
            raise InvalidArgumentError(describe("matryoshka_dimensions", dims, "None or a non-empty tuple of ints"))
        for d in dims:
            check_int("matryoshka_dimensions[i]", d, low=1, high=MAX_DIMENSIONS)
        if not self.is_matryoshka:
            raise InvalidArgumentError(describe("matryoshka_dimensions", dims, "None unless is_matryoshka"))

    @classmethod
    def from_json(cls, text: str) -> PoolerConfig:
        """The config of a JSON object of its fields (vLLM's ``--pooler-config``); raises naming a bad field."""
        if not isinstance(text, str):
            raise InvalidArgumentError(describe("text", text, "a JSON object of PoolerConfig's fields, as a str"))
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(describe("text", text, f"a JSON object ({e})")) from None
        if not isinstance(values, dict):
            raise InvalidArgumentError(describe("text", text, "a JSON object of PoolerConfig's fields"))
        known = {f.name for f in fields(cls)}
        unknown = [key for key in values if key not in known]
        if unknown:
            raise InvalidArgumentError(describe(unknown[0], values[unknown[0]], f"one of the fields {sorted(known)}"))
        dims = values.get("matryoshka_dimensions")
        if isinstance(dims, list):
            values["matryoshka_dimensions"] = tuple(dims)
        return cls(**values)

    @property
    def pools_every_token(self) -> bool:
        """Whether every prompt token's hidden state is pooled (MEAN), not the last one alone."""
        return self.pooling_type == "MEAN"

    def resolve(self, params: PoolingParams | None, hidden_size: int) -> PoolingParams:
        """A request's parameters with every field set (``dimensions`` checked against the model and this config);
        raises, naming the field, on dimensions it cannot serve."""
        check_int("hidden_size", hidden_size, low=1, high=MAX_DIMENSIONS)
        if params is None:
            params = PoolingParams()
        if not isinstance(params, PoolingParams):
            raise InvalidArgumentError(describe("pooling_params", type(params).__name__, "a PoolingParams or None"))
        normalize = self.normalize if params.normalize is None else params.normalize
        dims = params.dimensions
        if dims is not None and dims != hidden_size:
            self._check_dimensions(dims, hidden_size)
        return PoolingParams(dimensions=dims or hidden_size, normalize=normalize)

    def _check_dimensions(self, dims: int, hidden_size: int) -> None:
        """Refuse a truncation the model does not support (vLLM: only Matryoshka models, to a listed size)."""
        name = "pooling_params.dimensions"
        if not self.is_matryoshka:
            expected = f"None or {hidden_size}: the model is not Matryoshka (PoolerConfig.is_matryoshka)"
            raise InvalidArgumentError(describe(name, dims, expected))
        allowed = self.matryoshka_dimensions
        if allowed is not None and dims not in allowed:
            raise InvalidArgumentError(describe(name, dims, f"one of {sorted(allowed)}"))
        if dims > hidden_size:
            raise InvalidArgumentError(describe(name, dims, f"at most the hidden size {hidden_size}"))


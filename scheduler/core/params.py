"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from paged_kv.errors import InvalidArgumentError, check_bool, check_int, check_real, check_type, describe
from paged_kv.tokens import as_id_list
from scheduler.core.structured_params import StructuredOutputsParams

MAX_SAMPLES = 256
MAX_LOGPROBS = 64
P = TypeVar("P")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples its output: length, randomness, stop conditions, samples.

    ``temperature == 0`` is greedy decoding (top-k/top-p and the seed then do
    nothing). ``top_k == 0`` and ``top_p == 1.0`` disable those filters. With a
    ``seed`` every sample of the request draws from its own generator, so its
    tokens do not depend on what else is in the batch. ``n`` samples share the
    prompt's KV blocks (copy-on-write). A stop token, or EOS unless
    ``ignore_eos``, ends a sample and is kept as its last output token.
    ``logprobs`` asks for that many top log-probabilities per generated token.
    ``stop`` strings end a sample at their first occurrence in its text; they
    are matched by the text layers that own a tokenizer (``LLM``, the server),
    not by the token-level engine. ``cache_salt`` isolates the request's prefix
    cache: blocks are shared only between requests with the same salt.
    ``structured_outputs`` constrains every sample to a JSON schema, regex, choice or grammar
    (the engine needs a tokenizer for it: ``LLMEngine.enable_structured_outputs``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    stop: tuple[str, ...] = ()
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, low=1)
        check_real("temperature", self.temperature, low=0.0)
        check_int("top_k", self.top_k, low=0)
        check_real("top_p", self.top_p, low=0.0, high=1.0, open_low=True)
        if self.seed is not None:
            check_int("seed", self.seed, low=0, high=(1 << 63) - 1)
        check_int("n", self.n, low=1, high=MAX_SAMPLES)
        check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        check_bool("ignore_eos", self.ignore_eos)
        object.__setattr__(self, "stop_token_ids", _token_tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", _stop_tuple(self.stop))
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise InvalidArgumentError(describe("cache_salt", self.cache_salt, "a non-empty str or None"))
        structured = (StructuredOutputsParams, type(None))
        check_type("structured_outputs", self.structured_outputs, structured, "a StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax."""
        return self.temperature == 0.0


def _token_tuple(ids: object) -> tuple[int, ...]:
    """Stop ids as a tuple of ints: any iterable of non-negative int64 ids (no bools), e.g. a set."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise InvalidArgumentError(describe("stop_token_ids", ids, "a sequence of token ids"))
    return tuple(as_id_list("stop_token_ids", ids if hasattr(ids, "tolist") else list(ids), "token ids"))


def _stop_tuple(stop: object) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    if not hasattr(stop, "__iter__") or isinstance(stop, bytes):
        raise InvalidArgumentError(describe("stop", stop, "a str or a sequence of non-empty str"))
    stop = tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise InvalidArgumentError(describe("stop", stop, "non-empty strings"))
    return stop


def per_prompt(params: P | Sequence[P] | None, n: int, kind: type[P], name: str) -> list[P]:
    """The parameters of each of ``n`` prompts: one ``kind`` for all (None: the default one), or ``n`` of them."""
    if params is None or isinstance(params, kind):
        return [params or kind()] * n
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise InvalidArgumentError(describe(name, params, f"a {kind.__name__} or {n} of them (one per prompt)"))
    params = list(params)
    if len(params) != n or not all(isinstance(p, kind) for p in params):
        raise InvalidArgumentError(describe(name, params, f"a {kind.__name__} or {n} of them (one per prompt)"))
    return params

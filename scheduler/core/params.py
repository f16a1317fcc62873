"""Per-request sampling parameters, validated at construction (vLLM's names, meanings and bounds)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from paged_kv.errors import (
    InvalidArgumentError,
    OutOfRangeError,
    check_bool,
    check_int,
    check_real,
    check_type,
    describe,
)
from paged_kv.tokens import as_id_list
from scheduler.core.structured_params import StructuredOutputsParams

MAX_SAMPLES = 256
MAX_LOGPROBS = 64
MAX_TOP_K = (1 << 31) - 1  # int32: the sampler clamps top_k to the vocabulary
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)
# temperature and repetition_penalty are float32 on the device: a positive one must be a normal
# float32 (no division by zero or by a subnormal)
FLOAT32_TINY = 2.0**-126
FLOAT32_MAX = (2.0 - 2.0**-23) * 2.0**127
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # any int64 (OpenAI allows negative seeds)
P = TypeVar("P")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples its output: length, randomness, stop conditions, samples, logits controls.

    ``temperature == 0`` is greedy decoding (top-k/top-p/min-p and the seed then do
    nothing). ``top_k == 0`` (or -1, as in vLLM), ``top_p == 1.0`` and ``min_p == 0``
    disable those filters. With a ``seed`` (any int64) every sample of the request draws from
    its own generator, so its tokens do not depend on what else is in the batch. ``n``
    samples share the prompt's KV blocks (copy-on-write). A stop token, or EOS unless
    ``ignore_eos``, ends a sample and is kept as its last output token.
    ``logprobs`` asks for that many top log-probabilities per generated token, and
    ``prompt_logprobs`` (None: off) for the log-probability of every prompt token but the
    first with that many top ones (such a request never reads the prefix cache).
    ``stop`` strings end a sample at their first occurrence in its text (cut before it, or after it
    with ``include_stop_str_in_output``, which also keeps a stop token's text); they,
    ``skip_special_tokens`` (special tokens left out of the text) and
    ``bad_words`` are handled by the text layers that own a tokenizer (``LLM``, the server),
    which turn ``bad_words`` into ``bad_words_token_ids`` (each word with and without a
    leading space). ``cache_salt`` isolates the request's prefix cache: blocks are shared
    only between requests with the same salt.

    Logits controls, applied as vLLM applies them before temperature: ``allowed_token_ids``
    (only those ids may be sampled), ``bad_words_token_ids`` (a word's last id is blocked
    when the sample's output ends with the rest of it), ``min_tokens`` (EOS and the stop ids
    blocked until that many outputs; the text layers match no stop string in their text),
    ``logit_bias`` (token id -> added to its logit),
    ``repetition_penalty`` (> 1 discourages tokens of the prompt and output: a positive logit
    is divided by it, a negative one multiplied), ``frequency_penalty`` and
    ``presence_penalty`` (subtracted per occurrence / once for tokens of the output).
    ``structured_outputs`` constrains every sample to a JSON schema, regex, choice or grammar
    (the engine needs a tokenizer for it: ``LLMEngine.enable_structured_outputs``), from its first
    token or, with its ``start_after``, from after a marker (a reasoning model's end of thinking).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, low=1)
        check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        _check_temperature(self.temperature)
        if check_int("top_k", self.top_k, low=-1, high=MAX_TOP_K) == -1:
            object.__setattr__(self, "top_k", 0)  # vLLM's other spelling of "off"
        check_real("top_p", self.top_p, low=0.0, high=1.0, open_low=True)
        check_real("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            check_int("seed", self.seed, low=SEED_MIN, high=SEED_MAX)
        check_int("n", self.n, low=1, high=MAX_SAMPLES)
        check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        check_bool("ignore_eos", self.ignore_eos)
        check_real("presence_penalty", self.presence_penalty, low=-MAX_PENALTY, high=MAX_PENALTY)
        check_real("frequency_penalty", self.frequency_penalty, low=-MAX_PENALTY, high=MAX_PENALTY)
        check_real("repetition_penalty", self.repetition_penalty, low=FLOAT32_TINY, high=FLOAT32_MAX)
        object.__setattr__(self, "stop_token_ids", _id_tuple("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "stop", _str_tuple("stop", self.stop))
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        check_bool("skip_special_tokens", self.skip_special_tokens)
        object.__setattr__(self, "bad_words", _str_tuple("bad_words", self.bad_words))
        object.__setattr__(self, "bad_words_token_ids", _word_ids(self.bad_words_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _id_tuple("allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                raise InvalidArgumentError(describe("allowed_token_ids", allowed, "None or at least one token id"))
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise InvalidArgumentError(describe("cache_salt", self.cache_salt, "a non-empty str or None"))
        structured = (StructuredOutputsParams, type(None))
        check_type("structured_outputs", self.structured_outputs, structured, "a StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax."""
        return self.temperature == 0.0


def _check_temperature(value: object) -> None:
    """0 (greedy) or a normal float32 (dividing by it stays finite)."""
    t = check_real("temperature", value, low=0.0, high=FLOAT32_MAX)
    if 0.0 < t < FLOAT32_TINY:
        expected = f"0 or a finite number in [{FLOAT32_TINY}, {FLOAT32_MAX}]"
        raise OutOfRangeError(describe("temperature", value, expected))


def _id_tuple(name: str, ids: object) -> tuple[int, ...]:
    """Ids as a tuple of ints: any iterable of non-negative int64 ids (no bools), e.g. a set."""
    if isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__iter__"):
        raise InvalidArgumentError(describe(name, ids, "a sequence of token ids"))
    return tuple(as_id_list(name, ids if hasattr(ids, "tolist") else list(ids), "token ids"))


def _str_tuple(name: str, value: object) -> tuple[str, ...]:
    """One non-empty string or a sequence of them, as a tuple."""
    if isinstance(value, str):
        value = (value,)
    if not hasattr(value, "__iter__") or isinstance(value, (bytes, Mapping)):
        raise InvalidArgumentError(describe(name, value, "a str or a sequence of non-empty str"))
    value = tuple(value)
    if not all(isinstance(s, str) and s for s in value):
        raise InvalidArgumentError(describe(name, value, "non-empty strings"))
    return value


def _word_ids(words: object) -> tuple[tuple[int, ...], ...]:
    """Bad words as token id sequences: a sequence of non-empty sequences of token ids."""
    if isinstance(words, (str, bytes, Mapping)) or not hasattr(words, "__iter__"):
        raise InvalidArgumentError(describe("bad_words_token_ids", words, "a sequence of token id sequences"))
    out = tuple(_id_tuple("bad_words_token_ids", w) for w in words)
    if not all(out):
        raise InvalidArgumentError(describe("bad_words_token_ids", words, "non-empty token id sequences"))
    return out


def _logit_bias(bias: object) -> dict[int, float] | None:
    """A copy of ``{token id: bias}`` with int keys (decimal strings accepted, as JSON sends them)."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise InvalidArgumentError(describe("logit_bias", bias, "None or a {token id: bias} mapping"))
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdecimal() and key.isascii() else key
        check_int("logit_bias key", token, low=0, high=SEED_MAX)
        out[token] = check_real(f"logit_bias[{token}]", value, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
    return out


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

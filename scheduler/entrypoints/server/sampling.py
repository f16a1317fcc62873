"""From a validated request body to the engine's SamplingParams, refusing with a 400 what cannot be honoured.

The pass-through fields are vLLM's SamplingParams fields of the same name: each is honoured
when the engine's :class:`SamplingParams` has a field of that name (``dataclasses.fields``) and
refused otherwise, unless it is at its neutral value. So a field the engine gains (the
penalties, ``logit_bias``, ...) is honoured by the server with no edit here.

``use_beam_search`` (vLLM's) gives the engine a :class:`BeamSearchParams` instead: width ``n``,
``max_tokens``, ``length_penalty``, ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``cache_salt`` and the top
log-probabilities (completions' ``logprobs: k``, chat's ``logprobs`` with ``top_logprobs: k``, up
to ``--max-logprobs``: each token's chosen log-probability and the ``k`` most likely of its beam's
distribution, rendered as a sampled request's); ``temperature`` is ignored (the beams are ranked
by raw log-probabilities). A field that would not apply to the beams (sampling filters, penalties,
stop strings, constraints, an echo's prompt logprobs) is refused unless neutral (``BEAM_NEUTRAL``).
"""

from __future__ import annotations

import dataclasses

from paged_kv.errors import InvalidArgumentError, describe
from scheduler.core.params import SamplingParams
from scheduler.engine.beam_selection import BeamSearchParams, candidates_per_beam, stop_ids
from scheduler.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from scheduler.entrypoints.structured_request import structured_outputs_from_request

# name -> the values at which it asks for nothing (always accepted)
PASS_THROUGH: dict[str, tuple[object, ...]] = {
    "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "min_p": (0.0,),
    "min_tokens": (0,), "logit_bias": ({},), "allowed_token_ids": (), "bad_words": ([],),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
}  # fmt: skip
# name -> the values at which it asks for nothing a beam search could not honour (anything else: a 400)
BEAM_NEUTRAL: dict[str, tuple[object, ...]] = {
    "top_p": (1.0,), "top_k": (-1, 0), "min_p": (0.0,), "seed": (None,), "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "logit_bias": (None, {}), "stop": ([],),
    "min_tokens": (0,), "bad_words": ([],), "allowed_token_ids": (None,), "prompt_logprobs": (None,),
}  # fmt: skip
STRUCTURED_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag",
)  # fmt: skip


class FieldError(InvalidArgumentError):
    """A request field with a value this server refuses (a 400 whose ``param`` names the field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def sampling_param_names() -> frozenset[str]:
    """The fields of the engine's SamplingParams."""
    return frozenset(f.name for f in dataclasses.fields(SamplingParams))


def pass_through(body: SamplingFields, vocab_size: int) -> dict[str, object]:
    """SamplingParams keywords of the pass-through fields set away from neutral; FieldError if the engine lacks one."""
    names, kwargs = sampling_param_names(), {}
    for name, neutral in PASS_THROUGH.items():
        value = getattr(body, name)
        if value is None or value in neutral:
            continue
        if name not in names:
            raise FieldError(name, describe(name, value, f"{_neutral(neutral)}: this engine does not support {name}"))
        kwargs[name] = _engine_value(name, value, vocab_size)
    return kwargs


def _neutral(values: tuple[object, ...]) -> str:
    return "null" + "".join(f" or {v!r}" for v in values)


def _engine_value(name: str, value: object, vocab_size: int) -> object:
    """A pass-through value as SamplingParams takes it: token ids checked against the vocabulary, lists as tuples."""
    if name == "logit_bias":  # OpenAI's keys are token ids written as strings
        bias = {}
        for key, b in value.items():
            if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
                raise FieldError(name, describe(f"{name} key", key, f"a token id in [0, {vocab_size})"))
            bias[int(key)] = b
        return bias
    if name == "allowed_token_ids":
        if not value or max(value) >= vocab_size:
            raise FieldError(name, describe(name, value, f"a non-empty list of token ids in [0, {vocab_size})"))
    return tuple(value) if isinstance(value, list) else value


def structured_outputs(body: SamplingFields) -> dict[str, object]:
    """SamplingParams keywords of the request's output constraint, from ``response_format`` (OpenAI) or
    ``structured_outputs`` (vLLM) through :func:`structured_outputs_from_request`; vLLM's older
    ``guided_*`` fields and ``structural_tag`` are refused, naming them."""
    for name in STRUCTURED_FIELDS[2:]:
        value = getattr(body, name)
        if value is not None:
            expected = "null: use response_format or structured_outputs"
            raise FieldError(name, describe(name, value, expected))
    try:
        spec = structured_outputs_from_request(body.response_format, body.structured_outputs)
    except InvalidArgumentError as e:  # names a nested field: the 400's param is the request's field
        raise FieldError(str(e).split("=", 1)[0].split(".", 1)[0], str(e)) from None
    return {} if spec is None else {"structured_outputs": spec}


def check_request(body: SamplingFields, max_logprobs: int) -> None:
    """The checks that depend on the server's options or on several fields; FieldError naming the field."""
    if body.stream_options is not None and not body.stream:
        raise FieldError("stream_options", describe("stream_options", "set", "only with stream=true"))
    if isinstance(body, CompletionRequest) and body.max_tokens == 0 and not body.echo:
        raise FieldError("max_tokens", describe("max_tokens", 0, ">= 1 (0 only with echo=true)"))
    if body.best_of is not None and body.best_of < body.n:
        raise FieldError("best_of", describe("best_of", body.best_of, f">= n={body.n}"))
    if body.length_penalty != 1.0 and not body.use_beam_search:  # it ranks beam hypotheses, nothing else
        expected = "1.0 unless use_beam_search"
        raise FieldError("length_penalty", describe("length_penalty", body.length_penalty, expected))
    if body.truncate_prompt_tokens == 0:
        raise FieldError("truncate_prompt_tokens", describe("truncate_prompt_tokens", 0, "-1 or >= 1"))
    if body.stream and body.num_samples > body.n:
        raise FieldError("best_of", describe("best_of", body.best_of, f"n={body.n} when streaming"))
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
        raise FieldError("top_logprobs", describe("top_logprobs", body.top_logprobs, "0 unless logprobs=true"))
    if body.prompt_logprobs and body.stream:  # as vLLM (0 accepted): a field of the whole response
        raise FieldError("prompt_logprobs", describe("prompt_logprobs", body.prompt_logprobs, "unset with stream=true"))
    if body.prompt_logprobs is not None and body.prompt_logprobs > max_logprobs:
        expected = f"at most --max-logprobs={max_logprobs}"
        raise FieldError("prompt_logprobs", describe("prompt_logprobs", body.prompt_logprobs, expected))
    name = "logprobs" if isinstance(body, CompletionRequest) else "top_logprobs"
    k = getattr(body, name)
    if k is not None and k > max_logprobs:
        raise FieldError(name, describe(name, k, f"at most max_logprobs={max_logprobs} (--max-logprobs)"))


def check_beam_search(body: SamplingFields, constraints: dict[str, object]) -> None:
    """With ``use_beam_search``, refuse (FieldError naming it) every field that would not apply to the beams."""
    for name, neutral in BEAM_NEUTRAL.items():
        if getattr(body, name) not in neutral:
            _beam_refuses(name, getattr(body, name), " or ".join(map(repr, neutral)))
    if body.best_of not in (None, body.n):
        _beam_refuses("best_of", body.best_of, f"null or n={body.n} (n is the beam width)")
    if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
        _beam_refuses("logprobs", body.logprobs, "null with echo (the prompt is not scored)")
    if constraints:
        name = "structured_outputs" if body.structured_outputs is not None else "response_format"  # the one set
        _beam_refuses(name, getattr(body, name), "null or a text format")


def _beam_refuses(name: str, value: object, expected: str) -> None:
    raise FieldError(name, describe(name, value, f"{expected} with use_beam_search (it would not apply to the beams)"))


def beam_search_params(body: SamplingFields, *, max_tokens: int, logprobs: int, eos_token_ids: frozenset[int],
                       vocab_size: int) -> BeamSearchParams:  # fmt: skip
    """The engine's beam-search parameters of one prompt of ``body`` (width ``n``, ``logprobs`` top ones per token);
    FieldError naming ``n`` if its candidates per step exceed the vocabulary."""
    params = BeamSearchParams(
        width=body.n, max_tokens=max_tokens, length_penalty=body.length_penalty,
        stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output, skip_special_tokens=body.skip_special_tokens,
        cache_salt=body.cache_salt, logprobs=min(logprobs, vocab_size),  # as a sampled request: the vocabulary at most
    )  # fmt: skip
    per_beam = candidates_per_beam(len(stop_ids(params, eos_token_ids)))
    if per_beam * body.n > vocab_size:
        expected = f"at most {vocab_size // per_beam} with use_beam_search ({per_beam} * n candidates per step)"
        raise FieldError("n", describe("n", body.n, expected))
    return params


def sampling_params(body: SamplingFields, *, max_tokens: int, logprobs: int, vocab_size: int,
                    constraints: dict[str, object]) -> SamplingParams:  # fmt: skip
    """The engine's parameters of one prompt of ``body`` (``best_of`` samples when set)."""
    return SamplingParams(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k if 0 < body.top_k < vocab_size else 0,  # -1, 0 or the whole vocabulary: no filter
        seed=body.seed, n=body.num_samples, stop=tuple(body.stop), stop_token_ids=tuple(body.stop_token_ids),
        ignore_eos=body.ignore_eos, logprobs=logprobs, cache_salt=body.cache_salt,
        prompt_logprobs=_prompt_logprobs(body, logprobs), **pass_through(body, vocab_size), **constraints,
    )  # fmt: skip


def _prompt_logprobs(body: SamplingFields, logprobs: int) -> int | None:
    """The prompt's top log-probabilities to compute: ``prompt_logprobs``, and an echo's ``logprobs`` (vLLM)."""
    echo = isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None
    asked = [k for k in (body.prompt_logprobs, logprobs if echo else None) if k is not None]
    return max(asked) if asked else None

"""The OpenAI request bodies the server accepts (strict pydantic), and OpenAI's error body.

Every field OpenAI or vLLM defines for completions and chat completions is declared here, and
each is honoured or refused with a 400 that names it; any other field is refused as unknown.
Types are strict as in OpenAI (``true`` is not 1, ``"4"`` is not 4), and ``null`` means the
field's default. A field is one of:

- honoured: typed and bounded here, then turned into SamplingParams or used by the app;
- a sampling pass-through (``sampling.PASS_THROUGH``): a field of vLLM's SamplingParams (the
  penalties, ``logit_bias``, ...), honoured when the engine's SamplingParams has it, else refused;
- a structured-output field (``sampling.STRUCTURED_FIELDS``): given to ``sampling.structured_outputs``;
- ``Neutral``: a feature this server lacks, accepted only at the value that asks for nothing.

Tool calling (``tool_calling``): ``tools``, ``tool_choice`` and ``parallel_tool_calls``, and the
``tool`` role and an assistant's ``tool_calls`` in ``messages``, have their shapes here
(``tool_calling.protocol``: strict, OpenAI's function names, ``parameters`` a JSON schema, unique names);
the checks that need the server's options or several fields (a named function among ``tools``, "auto"
only with ``--enable-auto-tool-choice``, no beam search, no second constraint) are ``tool_calling.choice``'s.

``reasoning_effort`` (chat) is a variable of the chat template, as vLLM passes it: it wins over a
``chat_template_kwargs`` entry of the same name, and sets ``enable_thinking`` (false for "none") unless the
request's kwargs set it; a template that does not read them renders as without it.

With ``use_beam_search`` (vLLM's), ``n`` is the beam width and ``length_penalty`` ranks the
hypotheses; a field that would not apply to a beam search is refused unless neutral
(``sampling.BEAM_NEUTRAL``), and ``temperature`` is accepted and ignored (the beams are ranked
by the model's raw log-probabilities, as vLLM's V1 engine ranks them).
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from scheduler.core.params import MAX_SAMPLES
from scheduler.entrypoints.chat_rendering import ChatOptions
from scheduler.entrypoints.server.openai_model import OpenAIModel
from scheduler.entrypoints.server.tool_calling.protocol import MessageToolCall, ToolChoice, Tools

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Json = Any  # a JSON value; its shape is checked by whoever honours the field
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]  # OpenAI's efforts


def _only(accepted: tuple[object, ...], value: object) -> object:
    if not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted):
        shown = " or ".join(json.dumps(a) for a in (None, *accepted))
        message = "not supported by this server; accepted only as {shown}"
        raise PydanticCustomError("unsupported", message, {"shown": shown})
    return value


def Neutral(*accepted: object) -> object:  # noqa: N802 (a type, as pydantic's constrained types are)
    """A field this server does not implement, accepted only as null or one of ``accepted`` (else a 400 naming it)."""
    return Annotated[Json, AfterValidator(partial(_only, accepted))]


class StreamOptions(OpenAIModel):
    """Options of a streamed response."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: with include_usage, a running usage on every chunk
    include_obfuscation: Neutral(False) = None


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # vLLM: optional, the first served name
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] = []
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id: logged with the request
    # vLLM's SamplingParams fields, passed through where the engine's SamplingParams has them
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] = []
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) ends the text
    skip_special_tokens: bool = True  # special tokens left out of the text
    # vLLM's extensions the server honours
    top_k: int = Field(-1, ge=-1, le=INT64_MAX)  # -1 or 0: no top-k filter
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = []
    cache_salt: str | None = Field(None, min_length=1)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)  # keep that many (-1: max_model_len)
    truncation_side: Literal["left", "right"] = "left"  # which end truncation cuts
    request_id: str | None = Field(None, min_length=1, max_length=256)  # the response id's suffix
    return_tokens_as_token_ids: bool = False  # logprobs tokens as "token_id:<id>"
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)  # lower is more important: its cached blocks evicted last
    # structured outputs: sampling.structured_outputs decides
    response_format: Json = None
    structured_outputs: Json = None
    guided_json: Json = None
    guided_regex: Json = None
    guided_choice: Json = None
    guided_grammar: Json = None
    guided_decoding_backend: Json = None
    guided_whitespace_pattern: Json = None
    structural_tag: Json = None
    # vLLM's beam search: n beams, hypotheses ranked by cumulative logprob / len ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's features this server lacks
    spaces_between_special_tokens: Neutral(True) = None
    logprob_token_ids: Neutral() = None
    prompt_logprobs: int | None = Field(None, ge=0)  # vLLM: log-probabilities of the prompt tokens (not streamed)
    logits_processors: Neutral([]) = None
    return_token_ids: Neutral(False) = None
    return_token_offsets: Neutral(False) = None
    kv_transfer_params: Neutral({}) = None
    ec_transfer_params: Neutral({}) = None
    vllm_xargs: Neutral({}) = None
    repetition_detection: Neutral() = None
    thinking_token_budget: Neutral(-1) = None

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str]) -> list[str]:
        stops = [value] if isinstance(value, str) else value
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries a running usage (vLLM: ignored without include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def num_samples(self) -> int:
        """Samples the engine generates per prompt: ``best_of`` of which the ``n`` best are returned."""
        return self.best_of or self.n


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int = Field(16, ge=0)  # 0 only with echo: the prompt alone, scored (OpenAI's legacy, vLLM)
    logprobs: int | None = Field(None, ge=0)
    add_special_tokens: bool = True  # vLLM: the tokenizer's special tokens (BOS) around a text prompt
    echo: bool = False  # the prompt before each choice's text (and its tokens' logprobs first)
    suffix: Neutral("") = None
    prompt_embeds: Neutral() = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("prompt must be non-empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one string or token list, or a batch of them."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(OpenAIModel):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # given to the chat template
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's: the call it answers
    refusal: Neutral() = None
    function_call: Neutral() = None
    audio: Neutral() = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to an assistant message, not a {self.role} one")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    def as_dict(self) -> dict[str, object]:
        """The message as the chat template takes it (text parts joined, tool calls' arguments decoded)."""
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        message: dict[str, object] = {"role": self.role, "content": content or ""}
        if self.tool_calls is not None:
            message["tool_calls"] = [c.as_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message | ({"name": self.name} if self.name is not None else {})


class ChatRendering(OpenAIModel):
    """A conversation and how the chat template renders it (shared by chat completions and ``/tokenize``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: Tools | None = None  # given to the chat template (``tools=``), whatever the tool_choice
    # vLLM's rendering options (``chat_rendering.ChatOptions``; checked there, a bad one a 400 naming it)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's chat default: the template writes BOS itself
    chat_template: str | None = None  # only with --trust-request-chat-template (vLLM's)
    chat_template_kwargs: dict[str, Json] = Field(default_factory=dict)
    # vLLM's rendering options this server lacks: only their defaults are accepted
    documents: Neutral([]) = None
    mm_processor_kwargs: Neutral({}) = None

    def message_dicts(self) -> list[dict[str, object]]:
        """Messages as the chat template takes them."""
        return [m.as_dict() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, object]] | None:
        """The tools as the chat template takes them (as sent: unset keys left out)."""
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def chat_options(self) -> dict[str, object]:
        """The rendering options (``ChatOptions``' fields) as ``LLM.chat_prompt`` takes them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ChatOptions)}


class ChatCompletionRequest(SamplingFields, ChatRendering):
    """``POST /v1/chat/completions``."""

    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0)
    tool_choice: ToolChoice | None = None  # unset: "auto" with tools, else "none" (``chosen_tool``)
    parallel_tool_calls: bool = True  # false: "required" makes one call (named: always one; "auto" ignores it)
    prompt_cache_key: str | None = None  # a routing hint: every prompt is prefix-cached here
    safety_identifier: str | None = None  # an end-user id: logged with the request
    include_reasoning: bool = True  # vLLM's: false drops the reasoning --reasoning-parser splits out (``reasoning``)
    reasoning_effort: ReasoningEffort | None = None  # the chat template's ``reasoning_effort`` (``chat_options``)
    # OpenAI's features this server lacks
    audio: Neutral() = None
    function_call: Neutral("none") = None
    functions: Neutral([]) = None
    metadata: Neutral({}) = None
    modalities: Neutral(["text"]) = None
    moderation: Neutral() = None
    prediction: Neutral() = None
    prompt_cache_options: Neutral() = None
    prompt_cache_retention: Neutral("in_memory") = None
    service_tier: Neutral("auto", "default") = None
    store: Neutral(False) = None
    verbosity: Neutral() = None
    web_search_options: Neutral() = None
    # vLLM's chat features this server lacks
    echo: Neutral(False) = None
    max_repetition_pattern_size: Neutral(0) = None
    min_repetition_pattern_size: Neutral(0) = None
    repetition_min_count: Neutral(0) = None

    def chat_options(self) -> dict[str, object]:
        """The rendering options, ``reasoning_effort`` among the template's variables as vLLM passes it: over a
        ``chat_template_kwargs`` entry of that name when set, with ``enable_thinking`` (effort not "none") unless
        the request's kwargs set it."""
        options = super().chat_options()
        if self.reasoning_effort is not None:
            thinking = {"enable_thinking": self.reasoning_effort != "none"}
            options["chat_template_kwargs"] = thinking | self.chat_template_kwargs | {
                "reasoning_effort": self.reasoning_effort}
        return options

    @property
    def chosen_tool(self) -> ToolChoice:
        """``tool_choice``, or its default: "auto" when tools are given, else "none" (OpenAI's, vLLM's)."""
        return self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")


class TokenizeCompletionRequest(OpenAIModel):
    """``POST /tokenize`` of a text prompt (vLLM's)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's special tokens (BOS) around the prompt
    return_token_strs: bool = False  # the tokens' strings beside their ids


class TokenizeChatRequest(ChatRendering):
    """``POST /tokenize`` of a conversation, rendered as ``/v1/chat/completions`` renders it (vLLM's)."""

    model: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    """``POST /detokenize`` (vLLM's)."""

    model: str | None = None
    tokens: list[TokenId]


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}

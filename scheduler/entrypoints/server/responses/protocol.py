"""The body of ``POST /v1/responses`` (OpenAI's Responses API, strict pydantic, as the chat bodies are).

Every field OpenAI defines for creating a response is declared here: honoured, accepted and
ignored (``reasoning``'s summaries, ``stream_options.include_obfuscation``), or ``Neutral`` (a
feature this server lacks, accepted only at the value that asks for nothing; ``background`` among
them); any other field is refused as unknown, naming it. vLLM's sampling extensions of chat
(``SAMPLING_EXTENSIONS``) are declared with the chat's own definitions and passed on to it.

``input`` is a string (one user message) or a list of items: messages (role user, system,
developer or assistant; content a string or ``input_text`` / ``output_text`` parts), ``function_call``
and ``function_call_output`` items, and ``reasoning`` items (accepted, not rendered: a chat message
has no thinking). ``tools`` are Responses' flat function tools; any other tool type is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, create_model

from scheduler.entrypoints.server.openai_model import OpenAIModel
from scheduler.entrypoints.server.protocol import ChatCompletionRequest, Json, Neutral
from scheduler.entrypoints.server.tool_calling.protocol import FunctionDefinition

# vLLM's extensions (and the OpenAI sampling fields) a response takes with the chat's definitions and bounds
SAMPLING_EXTENSIONS = (
    "temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "stop", "stop_token_ids", "ignore_eos", "min_tokens", "bad_words", "logit_bias", "allowed_token_ids",
    "skip_special_tokens", "include_stop_str_in_output", "cache_salt", "priority", "request_id",
    "chat_template_kwargs", "structured_outputs",
)  # fmt: skip
Status = Literal["in_progress", "completed", "incomplete"]


class InputText(OpenAIModel):
    """A text part of an input message."""

    type: Literal["input_text"]
    text: str


class OutputText(OpenAIModel):
    """A text part of an earlier answer (an output message sent back as input); annotations and logprobs ignored."""

    type: Literal["output_text"]
    text: str
    annotations: list[Json] = []
    logprobs: list[Json] | None = None


TextPart = Annotated[InputText | OutputText, Field(discriminator="type")]


class MessageItem(OpenAIModel):
    """A message of the conversation (``type`` "message", or no ``type`` at all)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: Status | None = None
    phase: Neutral() = None

    def text(self) -> str:
        """The content's text (parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(OpenAIModel):
    """A call the model made earlier (an output ``function_call`` item sent back as input)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Status | None = None
    namespace: Neutral() = None
    caller: Neutral() = None


class FunctionCallOutputItem(OpenAIModel):
    """The result of a call, for the model to read (a chat ``tool`` message)."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: Status | None = None
    name: str | None = None  # the called function's (informative)
    namespace: Neutral() = None
    caller: Neutral() = None

    def text(self) -> str:
        """The output's text (parts joined)."""
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(OpenAIModel):
    """An earlier answer's thinking sent back as input: accepted, not rendered (a chat message carries none)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Json] = []
    content: list[Json] | None = None
    encrypted_content: Neutral() = None
    status: Status | None = None


def _item_type(value: object) -> str | None:
    """An input item's kind: its ``type``, "message" when it has none."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]  # fmt: skip


class FunctionTool(FunctionDefinition):
    """A Responses function tool: the chat's function definition, flat, with its ``type``."""

    type: Literal["function"]

    def chat_tool(self) -> dict[str, Any]:
        """The tool as a chat request's ``tools`` entry (as sent: unset keys left out)."""
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(OpenAIModel):
    """``tool_choice`` naming one of ``tools``."""

    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    """``text.format``: plain text, a JSON schema, or any JSON object."""

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # json_schema's
    schema_: dict[str, Json] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict[str, Any] | None:
        """The chat's ``response_format`` of this format (None for text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        spec = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}

    def echoed(self) -> dict[str, Any]:
        """The format as a response shows it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(OpenAIModel):
    """``text``: the output's format."""

    format: TextFormat = TextFormat(type="text")
    verbosity: Neutral("medium") = None


class ReasoningConfig(OpenAIModel):
    """``reasoning``: echoed; ``effort`` is the chat template's ``reasoning_effort`` (as chat's); summaries ignored."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(OpenAIModel):
    """``stream_options``: ``include_obfuscation`` is accepted and ignored (no obfuscation field is sent)."""

    include_obfuscation: bool = True


_fields = ChatCompletionRequest.model_fields
ResponsesSampling = create_model(
    "ResponsesSampling", __base__=OpenAIModel, __doc__="The chat's sampling fields a response takes.",
    **{name: (_fields[name].annotation, _fields[name]) for name in SAMPLING_EXTENSIONS},
)  # fmt: skip


class ResponsesRequest(ResponsesSampling):
    """``POST /v1/responses``."""

    model: str | None = None  # vLLM: optional, the first served name
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None  # a system message first (not carried over by previous_response_id)
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[FunctionTool] = []
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None  # unset: the chat's default
    parallel_tool_calls: bool = True
    text: TextConfig = TextConfig()
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    user: str | None = None  # an end-user id: logged with the request
    safety_identifier: str | None = None  # an end-user id: logged with the request
    prompt_cache_key: str | None = None  # a routing hint: every prompt is prefix-cached here
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16
    )  # OpenAI's bounds: 16 pairs, keys to 64 characters, values to 512
    store: bool = True  # keep the finished response (GET, DELETE, previous_response_id)
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    # OpenAI's features this server lacks
    background: Neutral(False) = None
    truncation: Neutral("disabled") = None
    top_logprobs: Neutral(0) = None
    include: Neutral([]) = None
    service_tier: Neutral("auto", "default") = None
    max_tool_calls: Neutral() = None
    conversation: Neutral() = None
    prompt: Neutral() = None
    prompt_cache_retention: Neutral("in_memory") = None
    prompt_cache_options: Neutral() = None
    context_management: Neutral() = None
    moderation: Neutral() = None
    image: Neutral() = None
    access_programs: Neutral() = None
    background_options: Neutral() = None

    def extensions(self) -> dict[str, Any]:
        """The sampling fields the request sets, as the chat request takes them."""
        return self.model_dump(include=set(SAMPLING_EXTENSIONS), exclude_unset=True)

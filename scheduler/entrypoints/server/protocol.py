"""The OpenAI request bodies the server accepts (pydantic), and OpenAI's error body.

Fields follow OpenAI's API; ``top_k``, ``ignore_eos``, ``cache_salt`` and
``stop_token_ids`` are extensions named as vLLM names them. Fields OpenAI has
but this server does not implement are accepted only at their neutral value.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scheduler.core.params import MAX_LOGPROBS, MAX_SAMPLES

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs


class StreamOptions(BaseModel):
    """Options of a streamed response."""

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int = Field(-1, ge=-1)  # -1 or 0: no top-k filter
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, min_length=1)
    stop_token_ids: list[int] | None = None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _neutral_penalty(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported; expected 0")
        return value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("prompt must be non-empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one string or token list, or a batch of them."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The message's text (parts joined)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def message_dicts(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}

"""The tool-calling parts of a chat request (OpenAI's shapes, strict): tools, tool_choice, and the tool calls of
an assistant message.

A function's ``name`` follows OpenAI's rule (1 to 64 of ``a-z A-Z 0-9 _ -``); its ``parameters``
is a JSON schema object (checked as one, so a bad schema is a 400 naming ``tools`` before any
grammar is built); two tools never share a name. An assistant message's tool call carries its
``arguments`` as JSON text, which the chat template gets decoded (as vLLM gives it, ``""`` as ``{}``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import AfterValidator, Field

from scheduler.entrypoints.server.openai_model import OpenAIModel

FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]  # OpenAI's rule


def _schema(value: dict[str, Any]) -> dict[str, Any]:
    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.SchemaError as e:
        raise ValueError(f"parameters must be a valid JSON schema ({e.message})") from None
    return value


class FunctionDefinition(OpenAIModel):
    """A function the model may call."""

    name: FunctionName
    description: str | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(_schema)] | None = None
    strict: bool | None = None  # accepted: a constrained call always follows the schema

    def schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (no ``parameters``: any object, as OpenAI reads an omitted one)."""
        return self.parameters if self.parameters is not None else {"type": "object"}


class Tool(OpenAIModel):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


def _unique(tools: list[Tool]) -> list[Tool]:
    names = [t.function.name for t in tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise ValueError(f"tool names must be unique: {duplicate!r} is given twice")
    return tools


Tools = Annotated[list[Tool], Field(min_length=1), AfterValidator(_unique)]  # ``tools``: one or more, names unique


class ChosenFunction(OpenAIModel):
    """The function a named ``tool_choice`` calls."""

    name: str


class NamedToolChoice(OpenAIModel):
    """``tool_choice`` naming one of ``tools``: the answer is a call of it."""

    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice  # ``tool_choice``


def _json_text(value: str) -> str:
    if value:
        try:
            json.loads(value)
        except ValueError:
            raise ValueError("arguments must be JSON text (the chat template gets them decoded)") from None
    return value


class CalledFunction(OpenAIModel):
    """The function an earlier assistant message called, and its arguments as JSON text."""

    name: str = Field(min_length=1)
    arguments: Annotated[str, AfterValidator(_json_text)]


class MessageToolCall(OpenAIModel):
    """A tool call of an earlier assistant message."""

    id: str
    type: Literal["function"]
    function: CalledFunction

    def as_dict(self) -> dict[str, object]:
        """The call as a chat template takes it: its arguments decoded (vLLM's: empty ones as ``{}``)."""
        arguments = json.loads(self.function.arguments) if self.function.arguments else {}
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}

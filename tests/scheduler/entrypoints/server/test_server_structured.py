"""Structured outputs through the server: response_format (OpenAI) and structured_outputs (vLLM), with the official client."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_helpers import CHAT, refused
from structured_helpers import CHOICES, SCHEMA

ENUM = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"],
        "additionalProperties": False}  # fmt: skip


def test_structured_outputs_constrain_every_choice(served, client):
    """vLLM's structured_outputs (json schema, choice) on completions and chat: every output is in the language."""
    spec = {"json": SCHEMA, "disable_any_whitespace": True}
    out = client.completions.create(model=served.model, prompt="a person:", max_tokens=96, n=2, temperature=1.0,
                                    seed=3, extra_body={"structured_outputs": spec})  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    chat = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=32,
                                          extra_body={"structured_outputs": {"choice": list(CHOICES)}})  # fmt: skip
    assert chat.choices[0].message.content in CHOICES


def test_response_format_json_schema_is_honoured(served, client):
    """OpenAI's response_format with a json_schema: the answer parses and validates."""
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": ENUM, "strict": True}}
    out = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=64, response_format=fmt)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), ENUM)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"guided_regex": "a+"}, "guided_regex"),
])  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_its_field(served, body, param):
    refused(served.post("chat/completions", {"model": served.model, "messages": CHAT, "max_tokens": 4, **body}),
            param)
    assert served.post("chat/completions", {"model": served.model, "messages": CHAT, "max_tokens": 2}).status_code == 200


def test_the_openai_client_raises_bad_request_for_an_invalid_schema(served, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=4, response_format=fmt)
    assert err.value.body["param"] == "response_format"

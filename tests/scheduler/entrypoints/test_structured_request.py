"""response_format (OpenAI) and structured_outputs (vLLM) request values as StructuredOutputsParams, or named errors."""

from __future__ import annotations

import json

import pytest

from paged_kv.errors import InvalidArgumentError
from scheduler import StructuredOutputsParams
from scheduler.entrypoints.structured_request import structured_outputs_from_request as convert

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("response_format, structured_outputs, expected", [
    (None, None, None),
    ({"type": "text"}, None, None),
    ({"type": "json_object"}, None, StructuredOutputsParams(json_object=True)),
    (JSON_SCHEMA, None, StructuredOutputsParams(json=SCHEMA)),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "description": "d", "strict": None}}, None,
     StructuredOutputsParams(json=SCHEMA)),
    (None, {"json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    (None, {"json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),
    (None, {"regex": "[a-z]+", "json": None, "choice": None, "structural_tag": None},
     StructuredOutputsParams(regex="[a-z]+")),
    (None, {"choice": ["yes", "no"], "disable_fallback": False}, StructuredOutputsParams(choice=("yes", "no"))),
    (None, {"grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
    (None, {"json_object": True, "disable_any_whitespace": True},
     StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
    ({"type": "text"}, {"regex": "a"}, StructuredOutputsParams(regex="a")),
])  # fmt: skip
def test_request_values_become_params(response_format, structured_outputs, expected):
    assert convert(response_format, structured_outputs) == expected


@pytest.mark.parametrize("response_format, structured_outputs, field", [
    ("json", None, "response_format="),
    ({"type": "xml"}, None, "response_format.type="),
    ({"type": "structural_tag", "structures": []}, None, "response_format.type="),
    ({}, None, "response_format.type="),
    ({"type": "json_object", "schema": SCHEMA}, None, "response_format.schema="),
    ({"type": "text", "json_schema": JSON_SCHEMA["json_schema"]}, None, "response_format.json_schema="),
    ({"type": "json_schema"}, None, "response_format.json_schema="),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, None, "response_format.json_schema.schema="),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, None, "response_format.json_schema.name="),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": "{}"}}, None,
     "response_format.json_schema.schema="),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": "yes"}}, None,
     "response_format.json_schema.strict="),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "format": 1}}, None,
     "response_format.json_schema.format="),
    (None, ["regex"], "structured_outputs="),
    (None, {}, "structured_outputs="),
    (None, {"regex": "a", "choice": ["a"]}, "structured_outputs="),
    (None, {"regex": "a", "backend": "outlines"}, "structured_outputs.backend="),
    (None, {"regex": "a", "whitespace_pattern": " *"}, "structured_outputs.whitespace_pattern="),
    (None, {"structural_tag": "{}"}, "structured_outputs.structural_tag="),
    (None, {"choice": "yes"}, "structured_outputs.choice="),
    (None, {"json": "{bad"}, "structured_outputs.json="),
    ({"type": "json_object"}, {"regex": "a"}, "response_format.type="),
])  # fmt: skip
def test_bad_request_values_raise_naming_the_field(response_format, structured_outputs, field):
    with pytest.raises(InvalidArgumentError, match=f"^{field.replace('.', '[.]')}"):
        convert(response_format, structured_outputs)

"""A request's ``response_format`` (OpenAI) and ``structured_outputs`` (vLLM) fields as one StructuredOutputsParams.

The HTTP layer passes both values as the client sent them (decoded JSON, None when absent) to
:func:`structured_outputs_from_request`, which returns the constraint (None: unconstrained) or raises
an ``InvalidArgumentError`` naming the field (the server's 400), for completions and chat alike:

- ``response_format``: ``{"type": "text"}`` (unconstrained), ``{"type": "json_object"}`` (any JSON
  object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "description": ...,
  "strict": ...}}``; ``strict`` is accepted and the output always follows the schema, as in vLLM.
- ``structured_outputs``: vLLM's object, exactly one of ``json``, ``regex``, ``choice``, ``grammar``
  (EBNF) and ``json_object``, plus ``disable_any_whitespace``. vLLM's other options are refused
  unless null or false, and so are keys vLLM does not define.

Both fields constraining one request is refused: which one should win is not defined.
"""

from __future__ import annotations

from collections.abc import Mapping

from paged_kv.errors import InvalidArgumentError, check_type, describe
from scheduler.core.structured_params import KINDS, StructuredOutputsParams

OPTIONS = ("disable_any_whitespace",)
# vLLM's structured_outputs keys this engine does not implement: accepted only at their neutral value
UNSUPPORTED = ("disable_fallback", "disable_additional_properties", "whitespace_pattern", "structural_tag")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = ("name", "schema", "description", "strict")


def structured_outputs_from_request(
    response_format: object = None, structured_outputs: object = None
) -> StructuredOutputsParams | None:
    """The constraint of a completion or chat request from its two fields (None when neither constrains it)."""
    from_format = _from_response_format(response_format)
    from_vllm = _from_structured_outputs(structured_outputs)
    if from_format is not None and from_vllm is not None:
        expected = "absent or 'text' when structured_outputs is given"
        raise InvalidArgumentError(describe("response_format.type", response_format["type"], expected))
    return from_format or from_vllm


def _from_response_format(value: object) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format``."""
    if value is None:
        return None
    check_type("response_format", value, Mapping, "an object with a 'type'")
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise InvalidArgumentError(describe("response_format.type", kind, f"one of {', '.join(RESPONSE_FORMATS)}"))
    _only(value, "response_format", ("type", "json_schema") if kind == "json_schema" else ("type",))
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    check_type("response_format.json_schema", spec, Mapping, "an object with 'name' and 'schema'")
    _only(spec, "response_format.json_schema", JSON_SCHEMA_KEYS)
    name, schema = spec.get("name"), spec.get("schema")
    if not (isinstance(name, str) and name):
        raise InvalidArgumentError(describe("response_format.json_schema.name", name, "a non-empty str"))
    check_type("response_format.json_schema.schema", schema, Mapping, "a JSON schema object")
    for key, cls in (("description", str), ("strict", bool)):
        check_type(f"response_format.json_schema.{key}", spec.get(key), (cls, type(None)), f"a {cls.__name__} or null")
    return StructuredOutputsParams(json=schema)


def _from_structured_outputs(value: object) -> StructuredOutputsParams | None:
    """vLLM's ``structured_outputs``."""
    if value is None:
        return None
    check_type("structured_outputs", value, Mapping, f"an object with one of {', '.join(KINDS)}")
    _only(value, "structured_outputs", KINDS + OPTIONS + UNSUPPORTED)
    for key in UNSUPPORTED:
        if value.get(key) not in (None, False):
            raise InvalidArgumentError(describe(f"structured_outputs.{key}", value[key], "null or false (unsupported)"))
    given = {k: v for k in KINDS + OPTIONS if (v := value.get(k)) is not None}
    return StructuredOutputsParams(**given)


def _only(value: Mapping, name: str, keys: tuple[str, ...]) -> None:
    """Refuse the first key of ``value`` not in ``keys`` (null ones aside), naming it."""
    extra = next((k for k, v in value.items() if k not in keys and v is not None), None)
    if extra is not None:
        expected = f"no such field (known: {', '.join(keys)})"
        raise InvalidArgumentError(describe(f"{name}.{extra}", value[extra], expected))

"""StructuredOutputsParams: exactly one constraint, each validated, immutable and hashable (the grammar cache's key)."""

from __future__ import annotations

import json

import pytest

from paged_kv.errors import InvalidArgumentError
from scheduler import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize("kw, kind", [
    (dict(json=SCHEMA), "json"), (dict(json=json.dumps(SCHEMA)), "json"), (dict(regex="a+"), "regex"),
    (dict(choice=["x", "y"]), "choice"), (dict(grammar='root ::= "a"'), "grammar"),
    (dict(json_object=True), "json_object"),
])  # fmt: skip
def test_one_constraint_and_its_kind(kw, kind):
    spec = StructuredOutputsParams(**kw)
    assert spec.kind == kind
    assert SamplingParams(structured_outputs=spec).structured_outputs is spec


def test_a_schema_is_kept_as_json_text_in_its_key_order():
    """A dict and its JSON text give equal, hashable params; property order (the generation order) is kept."""
    from_dict, from_text = StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json=json.dumps(SCHEMA))
    assert from_dict == from_text and hash(from_dict) == hash(from_text)
    assert json.loads(from_dict.json) == SCHEMA and list(json.loads(from_dict.json)["properties"]) == ["b", "a"]
    assert StructuredOutputsParams(choice=["x", "y"]).choice == ("x", "y")
    assert len({StructuredOutputsParams(regex="a"), StructuredOutputsParams(regex="a"), from_dict}) == 2


@pytest.mark.parametrize("kw, field", [
    (dict(), "structured_outputs="), (dict(json_object=False), "structured_outputs="),
    (dict(regex="a", choice=["a"]), "structured_outputs="),
    (dict(json=SCHEMA, json_object=True), "structured_outputs="),
    (dict(json="{not json"), "structured_outputs.json="), (dict(json="[1, 2]"), "structured_outputs.json="),
    (dict(json=3), "structured_outputs.json="), (dict(json={"a": float("nan")}), "structured_outputs.json="),
    (dict(json={"a": {1, 2}}), "structured_outputs.json="),
    (dict(regex=""), "structured_outputs.regex="), (dict(regex=3), "structured_outputs.regex="),
    (dict(grammar=b"root"), "structured_outputs.grammar="),
    (dict(choice="ab"), "structured_outputs.choice="), (dict(choice=[]), "structured_outputs.choice="),
    (dict(choice=["a", ""]), "structured_outputs.choice="), (dict(choice=["a", 3]), "structured_outputs.choice="),
    (dict(json_object=1), "structured_outputs.json_object="),
    (dict(regex="a", disable_any_whitespace="yes"), "structured_outputs.disable_any_whitespace="),
    *[(dict(regex="a", start_after=bad), "structured_outputs.start_after=")
      for bad in ([], 3, "ab", [1.5], [-1], [True], [[1]], {1, 2})],
])  # fmt: skip
def test_bad_constraints_raise_naming_the_field(kw, field):
    with pytest.raises(InvalidArgumentError, match=f"^{field}"):
        StructuredOutputsParams(**kw)


def test_sampling_params_take_only_structured_outputs_params():
    with pytest.raises(InvalidArgumentError, match="^structured_outputs="):
        SamplingParams(structured_outputs={"regex": "a"})


def test_start_after_is_kept_as_a_tuple_outside_the_language_and_waits_unless_the_prompt_ends_with_it():
    """The marker is part of the params (equality, hash) but not of their language, the compiled grammar's key; a
    sample waits for it unless its prompt already ends with it (the thinking ended there)."""
    spec = StructuredOutputsParams(regex="a+", start_after=[7, 8])
    assert spec.start_after == (7, 8) and spec != StructuredOutputsParams(regex="a+") and hash(spec)
    assert spec.language == StructuredOutputsParams(regex="a+") and spec.language.start_after is None
    assert spec.waits([1, 7, 8, 2]) == (7, 8) and spec.waits([8]) == (7, 8) and spec.waits([1, 7, 8]) is None
    assert StructuredOutputsParams(regex="a+").waits([1]) is None

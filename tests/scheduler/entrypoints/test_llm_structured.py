"""Structured outputs through the text-level LLM, which gives the engine its tokenizer: the tiny model and SmolLM2."""

from __future__ import annotations

import json

import jsonschema
import pytest
from structured_helpers import SPECS, check_output, force_tokens, opening

from scheduler.core.config import CacheConfig, EngineConfig
from scheduler.core.params import SamplingParams
from scheduler.core.structured_params import StructuredOutputsParams
from scheduler.entrypoints.llm import LLM
from scheduler.entrypoints.structured_request import structured_outputs_from_request
from scheduler.model.loader import LoadedModel

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
}
ASKS = [
    "Describe a fictional person as JSON with their name, age, city and hobbies.",
    "Give me a JSON record for a retired teacher living in Lyon.",
    "Invent a character for a novel and answer in JSON.",
]


def test_llm_constrains_generate_and_chat(tiny_model_dir):
    """LLM hands its tokenizer to the engine: text completions and chats come out in the constraint's language."""
    llm = LLM(tiny_model_dir, engine_config=EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=256),
                                                         device="cpu"))  # fmt: skip
    assert llm.engine.structured is not None
    for kind in ("json", "regex", "choice", "grammar"):
        params = SamplingParams(max_tokens=96, temperature=0.8, seed=3, structured_outputs=SPECS[kind])
        outs = llm.generate(["hello world", "the quick brown fox"], params)
        outs += llm.chat([{"role": "user", "content": "numbers: 1 2 3"}], params)
        for out in outs:
            assert out.outputs[0].finish_reason == "stop"
            check_output(SPECS[kind], out.outputs[0].text)


def test_llm_starts_a_constraint_after_the_thinking(tiny_model_dir, monkeypatch):
    """Offline, ``start_after=llm.encode("</think>")[0]`` leaves the thinking free and holds the answer after it
    (the tiny model is made to think: each sample's first tokens are forced; n = 2 seeded, each on its own)."""
    llm = LLM(tiny_model_dir, engine_config=EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=256),
                                                         device="cpu"))  # fmt: skip
    end, _ = llm.encode("</think>")
    script = llm.encode("<think>hmm")[0] + end
    force_tokens(llm.engine, monkeypatch, opening(script))
    spec = StructuredOutputsParams(regex=SPECS["regex"].regex, start_after=end)
    params = SamplingParams(max_tokens=64, n=2, temperature=1.0, seed=3, structured_outputs=spec)
    for out in llm.generate(["hello world"], params) + llm.chat([{"role": "user", "content": "hi"}], params):
        for sample in out.outputs:
            thinking, answer = sample.text.split("</think>")
            assert thinking == "<think>hmm" and sample.finish_reason == "stop"
            check_output(SPECS["regex"], answer)


@pytest.mark.slow
def test_smollm2_answers_follow_the_schema(smollm2):
    """SmolLM2 chats under a JSON schema (greedy and seeded, n = 2), json_object, a regex and a choice."""
    hf, tokenizer = smollm2
    llm = LLM(LoadedModel(hf, tokenizer, "SmolLM2"), engine_config=EngineConfig(device="cpu"))
    schema = structured_outputs_from_request({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    chats = [[{"role": "user", "content": ask}] for ask in ASKS]
    for sampling in (dict(temperature=0.0), dict(temperature=0.8, seed=11, n=2)):
        for out in llm.chat(chats, SamplingParams(max_tokens=160, structured_outputs=schema, **sampling)):
            for sample in out.outputs:
                assert sample.finish_reason == "stop", sample.text
                jsonschema.validate(json.loads(sample.text), PERSON)
    # any object: the small model nests and repeats on two of the asks until max_tokens (as it would unconstrained)
    any_object = structured_outputs_from_request(None, {"json_object": True, "disable_any_whitespace": True})
    (out,) = llm.chat(chats[2:], SamplingParams(max_tokens=160, structured_outputs=any_object))
    assert out.outputs[0].finish_reason == "stop" and isinstance(json.loads(out.outputs[0].text), dict)
    date = structured_outputs_from_request(None, {"regex": r"\d{4}-\d{2}-\d{2}"})
    mood = structured_outputs_from_request(None, {"choice": ["happy", "sad", "angry"]})
    ask = [{"role": "user", "content": "When did the Apollo 11 mission land on the Moon?"}]
    (out,) = llm.chat(ask, SamplingParams(max_tokens=20, structured_outputs=date))
    check_output(date, out.outputs[0].text)
    (out,) = llm.chat([{"role": "user", "content": "I won the lottery! How do I feel?"}],
                      SamplingParams(max_tokens=10, structured_outputs=mood))  # fmt: skip
    check_output(mood, out.outputs[0].text)

"""Helpers of the structured-output tests: a constraint of each kind, its check, a tiny engine with a tokenizer."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

import jsonschema
import torch
from sched_helpers import make_engine, tiny_llama
from text_helpers import tiny_tokenizer

from scheduler.core.structured_params import StructuredOutputsParams

# a schema with a finite language once whitespace is off: every output of the random model completes. Its
# strings are bounded by patterns: xgrammar 0.2.8 lets maxLength strings hold raw control characters, which
# JSON forbids (mlc-ai/xgrammar#800)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z0-9]{1,3}$"}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "colour"],
}
REGEX = r"[a-c]{2,4}-\d{1,3}"
CHOICES = ("red", "green", "blue", 'say "hi"')
GRAMMAR = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [0-9]{1,3}'
GRAMMAR_REGEX = r"\(\d{1,3}(\+\d{1,3}){0,3}\)"  # the grammar's language, for checking
SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
    "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
}
TEXTS = ["hello world", "the quick brown fox", "numbers: 1 2 3", "a library opens at nine", "stop here."]
TOKENIZER_VOCAB = 320  # tiny_tokenizer's ids
MODEL_VOCAB = 384  # the tiny model's rows: more than the tokenizer has, like a padded lm_head


def check_output(spec: StructuredOutputsParams, text: str) -> None:
    """Assert ``text`` is in ``spec``'s language."""
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), json.loads(spec.json))
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif spec.kind == "regex":
        assert re.fullmatch(spec.regex, text), text
    elif spec.kind == "choice":
        assert text in spec.choice, text
    else:
        assert re.fullmatch(GRAMMAR_REGEX, text), text


def structured_engine(vocab_size: int = MODEL_VOCAB, *, cache_size: int = 64, **engine_kw):
    """(engine, tokenizer): the tiny random Llama (EOS = the tokenizer's) with structured outputs enabled."""
    tokenizer = tiny_tokenizer()
    engine = make_engine(tiny_llama(vocab_size=vocab_size, eos_token_id=tokenizer.eos_token_id), **engine_kw)
    engine.enable_structured_outputs(tokenizer, cache_size=cache_size)
    return engine, tokenizer


def texts_of(outputs, tokenizer) -> list[list[str]]:
    """Each request's sample texts (special tokens, such as the closing EOS, left out)."""
    return [[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in o.outputs] for o in outputs]


class Forcing:
    """The engine's sampler, but a row whose sequence ``force`` names a token for (None: none) draws that token:
    a test's stand-in for a model that writes it (after any grammar mask: a forced row is one the grammar frees)."""

    def __init__(self, sampler, force: Callable[[object], int | None]) -> None:
        self.sampler, self.force = sampler, force

    def prepare(self, logits: torch.Tensor, rows, *rest):
        with torch.inference_mode():  # the model's logits are inference tensors
            for i, row in enumerate(rows):
                token = self.force(row.history)  # the row's sequence
                if token is not None:
                    logits[i] = -math.inf
                    logits[i, token] = 0.0
        return self.sampler.prepare(logits, rows, *rest)

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)


def force_tokens(engine, monkeypatch, force: Callable[[object], int | None]) -> None:
    """Make ``engine`` draw ``force(seq)`` for each sample whose ``force`` names a token (for this test; it replaces
    a ``force`` given before)."""
    sampler = engine.sampling.sampler
    sampler = sampler.sampler if isinstance(sampler, Forcing) else sampler
    monkeypatch.setattr(engine.sampling, "sampler", Forcing(sampler, force))


def scripted(scripts: dict[int, list[int]]) -> Callable[[object], int | None]:
    """A ``force`` that makes sample ``i`` write ``scripts[i]`` as its first output tokens (None: the model's
    own token, at a script's -1 entries and after it)."""

    def force(seq) -> int | None:
        script = scripts.get(seq.index, [])
        token = script[seq.num_outputs] if seq.num_outputs < len(script) else -1
        return None if token == -1 else token

    return force


def opening(script: list[int]) -> Callable[[object], int | None]:
    """A ``force`` that makes every sample write ``script`` as its first output tokens (then its own)."""
    return lambda seq: script[seq.num_outputs] if seq.num_outputs < len(script) else None

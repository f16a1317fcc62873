"""Structured outputs through xgrammar: each constraint compiled once, a token bitmask per step.

An engine given a tokenizer (:meth:`~scheduler.engine.llm_engine.LLMEngine.enable_structured_outputs`)
holds one :class:`StructuredOutputs`: xgrammar's ``TokenizerInfo`` over the model's vocabulary (the
model's rows; ids the tokenizer lacks are never allowed, ids beyond the rows never occur), one
``GrammarCompiler``, and an LRU of compiled grammars keyed by the request's frozen
:class:`~scheduler.core.structured_params.StructuredOutputsParams`.

A constrained sequence gets its own ``GrammarMatcher`` when it first samples (``Sequence.matcher``;
each of ``n`` samples its own). ``Sequence.append_token`` advances it, so it has accepted exactly the
sequence's output tokens, and keeps them across preemption (recompute and swap keep the sequence).

A constraint with ``start_after`` (a reasoning model's end of thinking) holds only after its marker:
until the sample's output ends with it (``Sequence.grammar_after``), its row is not masked and it has
no matcher; the sample may end meanwhile (EOS, as vLLM's, whose output is then all reasoning). From
the token after the marker a fresh matcher accepts every token, as vLLM's, which feeds its grammar
from the token after the end tag (not the tag itself); the tokens before it are never fed to it.
A prompt that ends with the marker starts the grammar at the first token (vLLM asks its reasoning
parser whether the prompt's tokens already end the reasoning).

A step that samples constrained rows: xgrammar fills their bitmasks on the host (one batched call),
one host->device copy, then xgrammar's kernel sets the logits those rows' grammars forbid to -inf,
in place, before sampling (Triton on CUDA; its torch path elsewhere: its Triton path needs CUDA even
under the interpreter). A step with no constrained row does nothing. Reported log-probabilities are
those of the masked distribution, as in vLLM, whose sampler sees the masked logits.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch
import xgrammar as xgr

from paged_kv.errors import InvalidArgumentError, describe
from scheduler.core.sequence import Sequence, SequenceGroup
from scheduler.core.structured_params import StructuredOutputsParams

_JSON_OBJECT = '{"type": "object"}'
_XGR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # "[time] file.cc:line: " before xgrammar's message
_WHAT = {"json": "a JSON schema", "json_object": "JSON", "regex": "a regex", "choice": "choices",
         "grammar": "an EBNF grammar"}  # fmt: skip


class StructuredOutputs:
    """An engine's xgrammar state: the tokenizer's info, one compiler, compiled grammars (LRU), the step's bitmask."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], device: torch.device, *,
                 cache_size: int = 64) -> None:  # fmt: skip
        """``vocab_size``: the model's logits width; ``stop_token_ids``: what ends a complete output (None: the
        tokenizer's EOS); ``cache_size``: compiled grammars kept."""
        stop = sorted(stop_token_ids) or None
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)  # the LRU below is the one cache
        self._compiled = functools.lru_cache(maxsize=cache_size)(self._compile)
        self.num_compiled = 0  # compilations so far (the cache's misses, invalid constraints included)
        self._filler = xgr.BatchGrammarMatcher()
        self._pin = device.type == "cuda"
        self._bitmask = self._allocate(0)  # host rows, grown to the largest step: [S, ceil(V / 32)] int32
        self._backend = "triton" if device.type == "cuda" else "torch_native"

    def grammar(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec`` (compiled on its first use, then cached); an invalid one raises."""
        try:
            return self._compiled(spec.language)  # wherever it starts, one language compiles once
        except (RuntimeError, ValueError) as e:
            message = _XGR_PREFIX.sub("", (str(e).strip() or type(e).__name__).splitlines()[0])
            value = str(getattr(spec, spec.kind))
            shown = value if len(value) <= 200 else value[:200] + "..."
            expected = f"{_WHAT[spec.kind]} xgrammar accepts ({message})"
            raise InvalidArgumentError(describe(f"structured_outputs.{spec.kind}", shown, expected)) from None

    def mask(self, samples: Seq[tuple[SequenceGroup, Sequence, int]], logits: torch.Tensor) -> None:
        """Mask, in place, the logits each constrained sample's grammar forbids now (``logits [S, V]``: a row each)."""
        rows = [i for i, (group, seq, _) in enumerate(samples)
                if group.params.structured_outputs is not None and seq.grammar_holds]  # a waiting row is free
        if not rows:
            return
        matchers = [self._matcher(*samples[i][:2]) for i in rows]
        if self._bitmask.shape[0] < len(samples):
            self._bitmask = self._allocate(len(samples))
        # the previous step's upload finished: its sampling read the sampled tokens back
        host = self._bitmask[: rows[-1] + 1]  # rows not in ``rows`` hold stale bits and are not read
        self._filler.batch_fill_next_token_bitmask(matchers, host, indices=rows)
        bitmask = host.to(logits.device, non_blocking=True)  # the one upload
        with torch.inference_mode():  # the model's logits are inference tensors
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows,
                                            backend=self._backend)  # fmt: skip

    def _matcher(self, group: SequenceGroup, seq: Sequence) -> xgr.GrammarMatcher:
        """The sequence's matcher, created at its first constrained sample (no output since its start to accept)."""
        if seq.matcher is None:
            seq.matcher = xgr.GrammarMatcher(self.grammar(group.params.structured_outputs))
        return seq.matcher

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile ``spec`` (no cache): JSON schemas and objects, regexes, choices (as a grammar), EBNF grammars."""
        self.num_compiled += 1
        any_whitespace = not spec.disable_any_whitespace
        if spec.kind in ("json", "json_object"):
            schema = spec.json if spec.kind == "json" else _JSON_OBJECT
            return self.compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
        if spec.kind == "regex":
            return self.compiler.compile_regex(spec.regex)
        if spec.kind == "choice":
            return self.compiler.compile_grammar(choice_grammar(spec.choice))
        return self.compiler.compile_grammar(spec.grammar)

    def _allocate(self, rows: int) -> torch.Tensor:
        """A host bitmask of ``rows`` rows (page-locked for the upload on CUDA)."""
        shape = xgr.get_bitmask_shape(rows, self.vocab_size)
        return torch.empty(shape, dtype=xgr.bitmask_dtype, pin_memory=self._pin)


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)

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
until the sample's output ends with it (``Sequence.grammar_after``), its row is not masked and its
matcher (made at its first sample all the same) is fed nothing; the sample may end meanwhile (EOS, as
vLLM's, whose output is then all reasoning). From the token after the marker the matcher accepts every
token, as vLLM's, which feeds its grammar from the token after the end tag (not the tag itself); the
tokens before it are never fed to it.
A prompt that ends with the marker starts the grammar at the first token (vLLM asks its reasoning
parser whether the prompt's tokens already end the reasoning).

A step that samples constrained rows: xgrammar fills their bitmasks on the host (one batched call),
one host->device copy, then xgrammar's kernel sets the logits those rows' grammars forbid to -inf,
in place, before sampling (Triton on CUDA; its torch path elsewhere: its Triton path needs CUDA even
under the interpreter). A step with no constrained row does nothing. Reported log-probabilities are
those of the masked distribution, as in vLLM, whose sampler sees the masked logits.

Speculative decoding (:mod:`scheduler.engine.spec_decode`): the scheduler keeps a constrained sequence's
drafts up to the first one its grammar refuses (``Sequence.grammar_walk``: accepted tentatively, then
rolled back). Verification masks draft row ``j`` with the grammar's state after the first ``j`` drafts
(:meth:`StructuredOutputs.mask_drafts`: the matcher advanced over them, each row filled on the way, then
rolled back), rows before the marker of ``start_after`` free and rows after a draft that ended the grammar
unmasked (the sample ends at that stop token). The kept tokens are then appended one by one as sampled ones
are, so the matcher has accepted exactly the output, as without drafts. vLLM fills the rows alike, but it
decides from the tokens before the step whether the reasoning has ended: in a step whose drafts write the end
tag it masks no row, where paged-kv masks the rows after the marker.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

import torch
import xgrammar as xgr

from paged_kv.errors import InvalidArgumentError, SequenceStateError, describe
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
        # host rows, grown to the largest step: [S, ceil(V / 32)] int32; one for the sampled rows, one for the draft
        # rows: a step uploads each once, both before its one device->host transfer (the sync that frees them)
        self._bitmasks = {"sampled": self._allocate(0), "drafts": self._allocate(0)}
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
        constrained = [i for i, (group, _, _) in enumerate(samples) if group.params.structured_outputs is not None]
        # a sample waiting for its marker gets its matcher too (unfed): kept drafts may write the marker and more
        matchers = {i: self._matcher(*samples[i][:2]) for i in constrained}
        rows = [i for i in constrained if samples[i][1].grammar_holds]  # a waiting row is free
        if rows:
            self._apply("sampled", logits, rows, lambda host: self._filler.batch_fill_next_token_bitmask(
                [matchers[i] for i in rows], host, indices=rows))  # fmt: skip

    def mask_drafts(self, seqs: Seq[tuple[SequenceGroup, Sequence, Seq[int]]], logits: torch.Tensor) -> None:
        """Mask, in place, the verification rows of drafting sequences (``logits [sum(k_i + 1), V]``: each one's
        draft rows, then its bonus row): row ``j`` of a constrained one with its grammar's state after its first
        ``j`` drafts (which the scheduler kept within what the grammar allows); its matcher is left as it was."""
        rows: list[int] = []

        def fill(host: torch.Tensor) -> None:
            at = 0
            for group, seq, drafts in seqs:
                if group.params.structured_outputs is not None:
                    self._matcher(group, seq)
                    _fill_draft_rows(host, rows, at, seq, drafts)
                at += len(drafts) + 1

        self._apply("drafts", logits, rows, fill)

    def _apply(self, buffer: str, logits: torch.Tensor, rows: list[int], fill: Callable[[torch.Tensor], None]) -> None:
        """``fill(host)`` the host bitmask rows (``buffer``'s, a row per row of ``logits``), upload them once and set
        the logits of the tokens they forbid to -inf in ``rows`` (read after ``fill``; none: nothing)."""
        if self._bitmasks[buffer].shape[0] < logits.shape[0]:
            self._bitmasks[buffer] = self._allocate(logits.shape[0])
        # the previous step's upload of this buffer finished: the step read its results back
        host = self._bitmasks[buffer][: logits.shape[0]]  # rows not in ``rows`` hold stale bits and are not read
        fill(host)
        if not rows:
            return
        bitmask = host[: rows[-1] + 1].to(logits.device, non_blocking=True)  # the one upload
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


def _fill_draft_rows(host: torch.Tensor, rows: list[int], at: int, seq: Sequence, drafts: Seq[int]) -> None:
    """Fill ``seq``'s verification rows from ``at``: row ``at + j``, where the grammar holds, from its state after
    the first ``j`` drafts (listed in ``rows``); a draft the grammar refuses raises (the scheduler trimmed them)."""

    def visit(j: int, matcher: xgr.GrammarMatcher) -> None:
        matcher.fill_next_token_bitmask(host, at + j)
        rows.append(at + j)

    if seq.grammar_walk(drafts, visit) < len(drafts):
        raise SequenceStateError(describe("drafts", list(drafts), "tokens the sequence's grammar allows"))


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)

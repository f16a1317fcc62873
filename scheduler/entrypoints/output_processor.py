"""From token-level engine outputs to text: per-sample deltas, stop strings, final text outputs.

Both front ends, the offline :class:`~scheduler.entrypoints.llm.LLM` and the HTTP server,
drive the engine through :class:`OutputProcessor`: after every engine step it
reads each live request's samples, detokenizes the new tokens, ends samples
at a stop string (aborting the request in the engine once every sample has
stopped, so its blocks are freed at once) and returns what each stream may
release. Text that could still turn into a stop string is held back, and the text is cut
before the stop string (after it with ``include_stop_str_in_output``: nothing is held back
then). A stop token (a stop token id, or EOS) stays the sample's last token but adds no text
(unless ``include_stop_str_in_output``), as in vLLM.

A request whose own failure the engine reports (``RequestOutput.error``), or whose
detokenization or stop-string check raises here, ends alone with ``error`` set (blocks freed);
a failed engine step propagates, and every request is dropped (the engine aborted them all).

An embedding request (:meth:`OutputProcessor.add_embedding`) has no text: its finished output (an
:class:`EmbeddingRequestOutput`) comes from :meth:`OutputProcessor.take_embedded`.

A beam search (:meth:`OutputProcessor.add_beam_search`) has no delta until it is done: its
beams are not final until then (as in vLLM). Its hypotheses then come as its samples, best
first, each with its whole text (a stop token's text left out unless ``include_stop_str_in_output``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from paged_kv.errors import InvalidArgumentError, UnknownSequenceError, describe
from scheduler.core.lora_request import LoRARequest
from scheduler.core.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from scheduler.core.params import SamplingParams
from scheduler.core.pooling_params import PoolingParams
from scheduler.engine.beam_selection import BeamSearchParams
from scheduler.engine.llm_engine import LLMEngine
from scheduler.entrypoints.detokenizer import IncrementalDetokenizer, find_stop, holdback
from scheduler.runner.lora_manager import ReadLoRA

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SampleDelta:
    """What one sample added since the last update: tokens, their log-probabilities, released text."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None  # set on the sample's last delta only
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None for EOS)
    ranks: list[int | None] = field(default_factory=list)  # as CompletionOutput.ranks


@dataclass(frozen=True, kw_only=True)
class TextCompletion:
    """One finished sample: its text (cut before a stop string), tokens and log-probabilities."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None for EOS)
    ranks: list[int | None] = field(default_factory=list)  # as CompletionOutput.ranks

    @property
    def cumulative_logprob(self) -> float:
        """Sum of the output tokens' log-probabilities."""
        return sum(self.logprobs)


@dataclass(frozen=True, kw_only=True)
class TextRequestOutput:
    """A finished request: its prompt, its samples in index order and its timestamps (perf_counter seconds)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[TextCompletion]
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    error: str | None = None  # why the request failed alone (its unfinished samples end with "error")
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at admission
    prompt_logprobs: list[dict[int, float] | None] | None = None  # as RequestOutput.prompt_logprobs
    prompt_ranks: list[int | None] | None = None  # as RequestOutput.prompt_ranks


def with_bad_word_ids(params: SamplingParams, tokenizer) -> SamplingParams:
    """``params`` with ``bad_words_token_ids`` filled in from its ``bad_words`` (as given when it has them).

    As vLLM: each word (leading spaces stripped) as it tokenizes alone, and with one leading
    space when that gives as many tokens with another first one (the word inside a text).
    """
    if not params.bad_words or params.bad_words_token_ids:
        return params
    ids: list[tuple[int, ...]] = []
    for word in params.bad_words:
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise InvalidArgumentError(describe("bad_words", word, "words that tokenize to at least one token"))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        ids += [tuple(bare)] + ([tuple(spaced)] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
    return replace(params, bad_words_token_ids=tuple(ids))


@dataclass
class _Sample:
    """Text state of one sample. Invariant: ``text[:sent]`` has been released and never changes."""

    detok: IncrementalDetokenizer
    text: str = ""
    sent: int = 0
    num_tokens: int = 0  # engine output tokens consumed
    stop_from: int = 0  # stop strings end past here: the text of the first min_tokens tokens cannot stop it
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class TextRequest:
    """One request's text-level state across engine steps."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer,
                 prompt: str | None = None, eos_token_ids: frozenset[int] = frozenset(), *,
                 beam: bool = False, per_token: bool = False) -> None:  # fmt: skip
        self.request_id = request_id
        self.beam = beam  # a beam search: only its final output is read
        # stop strings are looked for after each new token, not each snapshot (speculative decoding: a step adds
        # several tokens, and the output must be the one of a token per step; the tokens after a stop are dropped)
        self.per_token = per_token
        self.eos_token_ids = eos_token_ids
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.samples: dict[int, _Sample] = {}
        self.last: RequestOutput | None = None
        self.error: str | None = None

    @property
    def all_stopped(self) -> bool:
        """Whether every one of the ``n`` samples has finished (by the engine or a stop string)."""
        return len(self.samples) == self.params.n and all(s.finish_reason for s in self.samples.values())

    def update(self, out: RequestOutput) -> list[SampleDelta]:
        """Consume an engine snapshot; return a delta for every sample that produced tokens or finished."""
        self.last, self.error = out, out.error
        deltas = []
        for o in out.outputs:
            sample = self.samples.get(o.index)
            if sample is None:
                skip = self.params.skip_special_tokens
                detok = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids, skip_special_tokens=skip)
                sample = self.samples[o.index] = _Sample(detok)
            if sample.finish_reason is None and (len(o.token_ids) > sample.num_tokens or o.finish_reason):
                deltas.append(self._advance(o.index, sample, o))
        return deltas

    def _advance(self, index: int, s: _Sample, o: CompletionOutput) -> SampleDelta:
        new = slice(s.num_tokens, len(o.token_ids))
        if self.per_token and self.params.stop and new.stop - new.start > 1:
            return self._advance_each(index, s, o, new)
        return self._advance_span(index, s, o, new)

    def _advance_each(self, index: int, s: _Sample, o: CompletionOutput, new: slice) -> SampleDelta:
        """The new tokens one at a time: a stop string ends the sample at the token that completes it, and the
        tokens after it are dropped (as if they had come one per step)."""
        deltas = []
        for i in range(new.start, new.stop):
            deltas.append(self._advance_span(index, s, o, slice(i, i + 1)))
            if s.finish_reason:
                break
        last = deltas[-1]
        return SampleDelta(
            index=index, text="".join(d.text for d in deltas), token_ids=[t for d in deltas for t in d.token_ids],
            logprobs=[x for d in deltas for x in d.logprobs], top_logprobs=[x for d in deltas for x in d.top_logprobs],
            finish_reason=last.finish_reason, stop_reason=last.stop_reason, ranks=[x for d in deltas for x in d.ranks],
        )  # fmt: skip

    def _advance_span(self, index: int, s: _Sample, o: CompletionOutput, new: slice) -> SampleDelta:
        """Take the new tokens ``new`` of ``o`` (the engine's finish reason applies to its last token only)."""
        s.num_tokens = new.stop
        finish_reason = o.finish_reason if new.stop == len(o.token_ids) else None
        ids, lps, tops, ranks = o.token_ids[new], o.logprobs[new], o.top_logprobs[new], o.ranks[new]
        s.token_ids += ids
        s.logprobs += lps
        s.top_logprobs += tops
        s.ranks += ranks
        # the engine says "stop" only for a stop token or EOS, the sample's last token: it adds no text
        # unless the stop is to be kept in the output
        stop_token = ids[-1] if finish_reason == "stop" and ids else None
        keep_stop = self.params.include_stop_str_in_output
        start = len(s.text)
        text_ids = ids if stop_token is None or keep_stop else ids[:-1]
        early = max(0, self.params.min_tokens - (s.num_tokens - len(ids)))  # of the new ids, within min_tokens
        if early:
            s.text += s.detok.add(text_ids[:early])
            s.stop_from = len(s.text)
        s.text += s.detok.add(text_ids[early:]) + (s.detok.flush() if finish_reason else "")
        stops = self.params.stop
        hit = find_stop(s.text, max(start, s.stop_from), stops) if stops and len(s.text) > s.stop_from else None
        if hit is not None:
            end = hit[0] + (len(hit[1]) if keep_stop else 0)
            s.text, s.finish_reason, s.stop_reason = s.text[:end], "stop", hit[1]
        else:
            s.finish_reason, s.stop_reason = finish_reason, self._token_stop_reason(stop_token)
        held = 0 if s.finish_reason or keep_stop else holdback(s.text, stops)  # a kept stop is text either way
        release = len(s.text) - held
        text, s.sent = s.text[s.sent : release], max(s.sent, release)
        return SampleDelta(
            index=index, text=text, token_ids=ids, logprobs=lps, top_logprobs=tops,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason, ranks=ranks,
        )  # fmt: skip

    def fail(self, error: str) -> None:
        """End the request with ``error``: its unfinished samples finish with "error"."""
        self.error = error
        for s in self.samples.values():
            s.finish_reason = s.finish_reason or "error"

    def _token_stop_reason(self, token_id: int | None) -> int | None:
        """A stop token id's own id as the stop reason; None for EOS (unless ignored), as vLLM reports them."""
        eos = not self.params.ignore_eos and token_id in self.eos_token_ids
        return None if eos else token_id

    def result(self) -> TextRequestOutput:
        """The request's final text outputs."""
        last = self.last
        outputs = [
            TextCompletion(
                index=i, text=s.text, token_ids=s.token_ids, logprobs=s.logprobs, top_logprobs=s.top_logprobs,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason, ranks=s.ranks,
            )  # fmt: skip
            for i, s in sorted(self.samples.items())
        ]
        return TextRequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=outputs, arrival_time=last.arrival_time if last else 0.0,
            first_token_time=last.first_token_time if last else None, finish_time=last.finish_time if last else None,
            error=self.error,
            num_cached_tokens=last.num_cached_tokens if last else None,
            prompt_logprobs=last.prompt_logprobs if last else None,
            prompt_ranks=last.prompt_ranks if last else None,
        )  # fmt: skip


class OutputProcessor:
    """Drives an engine step by step and turns its outputs into text deltas for every live request."""

    def __init__(self, engine: LLMEngine, tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.requests: dict[str, TextRequest] = {}
        self.embedding_ids: set[str] = set()  # live embedding requests (no text: their output is a vector)
        self.embedded: list[EmbeddingRequestOutput] = []  # embedding requests finished since take_embedded

    def add_embedding(self, request_id: str, prompt_token_ids: Sequence[int], params: PoolingParams | None = None,
                      *, priority: int = 0) -> None:  # fmt: skip
        """Queue an embedding request in the engine (raises, nothing queued, on a bad one); its output comes from
        :meth:`take_embedded` after the step that finishes it."""
        self.engine.add_pooling_request(request_id, prompt_token_ids, params, priority=priority)
        self.embedding_ids.add(request_id)

    def take_embedded(self) -> list[EmbeddingRequestOutput]:
        """The embedding requests finished (or failed) since the last call."""
        done, self.embedded = self.embedded, []
        return done

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
            prompt: str | None = None, *, priority: int = 0,
            lora_request: LoRARequest | ReadLoRA | None = None) -> TextRequest:  # fmt: skip
        """Queue a request in the engine (raises, nothing queued, on a bad one) and track its text."""
        params = with_bad_word_ids(params, self.tokenizer)
        self.engine.add_request(request_id, prompt_token_ids, params, priority=priority, lora_request=lora_request)
        return self._track(request_id, prompt_token_ids, params, prompt)

    def add_beam_search(self, request_id: str, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                        prompt: str | None = None, *, priority: int = 0,
                        lora_request: LoRARequest | ReadLoRA | None = None) -> TextRequest:  # fmt: skip
        """Queue a beam search in the engine (raises, nothing queued, on a bad one); its hypotheses' text comes
        when it is done."""
        self.engine.add_beam_search(request_id, prompt_token_ids, params, priority=priority,
                                    lora_request=lora_request)  # fmt: skip
        return self._track(request_id, prompt_token_ids, params.text_params(), prompt, beam=True)

    def _track(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, prompt: str | None,
               *, beam: bool = False) -> TextRequest:  # fmt: skip
        eos = self.engine.scheduler.eos_token_ids
        req = self.requests[request_id] = TextRequest(request_id, list(prompt_token_ids), params, self.tokenizer,
                                                      prompt, eos, beam=beam,
                                                      per_token=self.engine.spec is not None)  # fmt: skip
        return req

    def abort(self, request_id: str) -> TextRequest | None:
        """Stop a live request and free its blocks; None if it is not live."""
        if request_id in self.embedding_ids:
            self.embedding_ids.discard(request_id)
            self.engine.abort(request_id)
            return None
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.update(self.engine.abort(request_id))
        return req

    def has_unfinished(self) -> bool:
        """Whether any request is still live."""
        return bool(self.requests or self.embedding_ids)

    def step(self) -> list[tuple[TextRequest, list[SampleDelta], bool]]:
        """One engine step; (request, its deltas, whether it is done) for every request that changed.

        A request whose text processing raises is failed alone: no deltas, done, ``error`` set.
        """
        try:
            finished = {o.request_id: o for o in self.engine.step()}
        except BaseException:  # the engine aborted every request
            self.requests.clear()
            self.embedding_ids.clear()
            raise
        for rid in self.embedding_ids & finished.keys():
            self.embedding_ids.discard(rid)
            self.embedded.append(finished[rid])
        changed = []
        for rid, req in list(self.requests.items()):
            if req.beam and rid not in finished:  # its beams are not final until it is done
                continue
            try:
                deltas, done = self._update(req, finished.get(rid) or self.engine.request_output(rid))
            except Exception as e:
                self._fail(req, e)
                deltas, done = [], True
            if deltas or done:
                changed.append((req, deltas, done))
        return changed

    def _update(self, req: TextRequest, out: RequestOutput) -> tuple[list[SampleDelta], bool]:
        """Detokenize one request's new tokens and apply its stop strings; (its deltas, whether it is done)."""
        deltas = req.update(out)
        done = out.finished or req.all_stopped
        if not done:
            self._finish_stopped_samples(req, deltas)
        if done:
            del self.requests[req.request_id]
            if not out.finished:  # every sample hit a stop string: free its blocks now
                req.last = self.engine.abort(req.request_id)
        return deltas, done

    def _fail(self, req: TextRequest, error: Exception) -> None:
        """Fail a request whose text processing raised: abort it in the engine ("error"), keep the error."""
        message = f"detokenization failed: {type(error).__name__}: {error}"
        logger.error("request %s failed and is aborted alone: %s", req.request_id, message, exc_info=error)
        self.requests.pop(req.request_id, None)
        try:
            req.last = self.engine.fail(req.request_id, message)
        except UnknownSequenceError:  # it finished in the engine this step: its blocks are already freed
            pass
        req.fail(message)

    def _finish_stopped_samples(self, req: TextRequest, deltas: list[SampleDelta]) -> None:
        """Free the blocks of samples a stop string just ended while their siblings run on (``n > 1``)."""
        stopped = {d.index for d in deltas if d.stop_reason is not None}
        if stopped:
            self.engine.stop_samples(req.request_id, stopped)

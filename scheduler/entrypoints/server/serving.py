"""OpenAI response bodies from text deltas and results: completions and chat, whole and streamed.

A request with ``P`` prompts and ``n`` samples each has ``P * n`` choices;
choice ``key * n + index`` is sample ``index`` of prompt ``key``. With ``best_of > n`` each
prompt's ``best_of`` samples are ranked by cumulative log-probability and the ``n`` best kept
(``usage`` counts the kept samples' tokens, as vLLM does).
A completion's ``echo`` puts the prompt before each choice's text (and, with ``logprobs``, its
tokens before the choice's, the first with no log-probability); streamed, in a first chunk of
each choice of its own. With ``max_tokens=0`` (``echo_only``) the engine generates one token that
no body shows: each choice is the prompt alone, finished by "length", with no completion tokens
(OpenAI's legacy way of scoring a prompt, as vLLM serves it). ``prompt_logprobs`` (vLLM; not
streamed) adds each prompt token's log-probabilities to a completion's choices, or to a chat
response, as vLLM lays them out: ``None`` for the first token, then ``{token id: {logprob, rank,
decoded_token}}``. A log-probability of -inf (a token a grammar rules out) is sent as
``LOGPROB_FLOOR``, as vLLM sends it: JSON has no infinity. A stream with ``include_usage`` ends with a usage
chunk; with vLLM's ``continuous_usage_stats`` each chunk before it carries its prompt's tokens and its choice's
tokens streamed so far. A chat with a tool choice other than "none" gets its messages, deltas and finish
reasons from its ``tool_calling.choice.ToolOutput`` (a delta it holds back entirely sends no chunk). Under
``--reasoning-parser`` a chat's ``reasoning.output.ReasoningOutput`` splits its thinking out first: the tool
calls, if any, are read from the content that follows.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TypeVar

from scheduler.entrypoints.detokenizer import REPLACEMENT
from scheduler.entrypoints.output_processor import SampleDelta, TextCompletion, TextRequestOutput
from scheduler.entrypoints.server.reasoning.output import ReasoningOutput
from scheduler.entrypoints.server.tool_calling.choice import ToolOutput
from scheduler.runner.lora_manager import ReadLoRA

Shown = TypeVar("Shown", TextCompletion, SampleDelta)  # a whole sample, or one step's delta of it
LOGPROB_FLOOR = -9999.0  # what JSON shows of a log-probability of -inf (or NaN), as vLLM's


@dataclass
class ResponseContext:
    """What every body of one response shares: id, creation time, model, kind and formatting options."""

    kind: str  # "completion" or "chat"
    model: str
    n: int
    tokenizer: object
    logprobs: int | None  # top log-probabilities per token; None: no logprobs block
    request_id: str | None = None  # the client's (vLLM's request_id), else a random one
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)
    echo: bool = False  # a completion's choices start with the prompt (streamed: a chunk of its own first)
    prompt_logprobs: int | None = None  # the prompt's top log-probabilities to show (vLLM; non-streamed)
    echo_only: bool = False  # a completion's max_tokens=0 with echo: the prompt alone, the generated token hidden
    # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries its prompt's tokens
    # (``prompt_tokens``, per prompt) and its choice's tokens streamed so far
    continuous_usage: bool = False
    prompt_tokens: list[int] = field(default_factory=list)
    tools: ToolOutput | None = None  # a chat's tool choice other than "none": its messages hold tool calls
    reasoning: ReasoningOutput | None = None  # a chat under --reasoning-parser: its thinking split out first
    lora: ReadLoRA | None = None  # the adapter the model names, its files read off the engine thread (None: base)
    id: str = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))
    # per choice: characters of the token texts already sent (a streamed text_offset continues from there)
    offsets: dict[int, int] = field(default_factory=dict)
    generated: dict[int, int] = field(default_factory=dict)  # per choice: tokens streamed so far

    def __post_init__(self) -> None:
        self.id = f"{'cmpl' if self.kind == 'completion' else 'chatcmpl'}-{self.request_id or uuid.uuid4().hex}"

    def head(self, *, chunk: bool) -> dict:
        """The fields before ``choices``."""
        chat = "chat.completion.chunk" if chunk else "chat.completion"
        obj = "text_completion" if self.kind == "completion" else chat
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def token_text(self, token_id: int) -> str:
        """A token's own text (or its id, with ``tokens_as_ids``)."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self.tokenizer.decode([token_id])

    def logprobs_block(self, choice: int, token_ids: list[int], logprobs: list[float],
                       tops: list[dict[int, float]]) -> dict | None:  # fmt: skip
        """The ``logprobs`` field of choice ``choice`` for these tokens (OpenAI's completion or chat layout)."""
        if self.logprobs is None:
            return None
        texts = [self.token_text(t) for t in token_ids]
        logprobs = [None if lp is None else _finite(lp) for lp in logprobs]  # an echo's first: None
        top = [_top(d, self.logprobs) for d in tops] + [[]] * (len(token_ids) - len(tops))
        if self.kind == "chat":
            entries = []
            for token, text, lp, tp in zip(token_ids, texts, logprobs, top):
                alternatives = [self._chat_logprob(t, self.token_text(t), v) for t, v in tp]
                entries.append({**self._chat_logprob(token, text, lp), "top_logprobs": alternatives})
            return {"content": entries}
        offsets = list(itertools.accumulate((len(s) for s in texts), initial=self.offsets.get(choice, 0)))
        self.offsets[choice] = offsets.pop()
        # OpenAI's completion top_logprobs hold the sampled token too (logprobs=0: it alone); an echoed
        # prompt's first token has none
        tops_by_text = [None if lp is None else {**{self.token_text(t): v for t, v in tp}, s: lp}
                        for tp, s, lp in zip(top, texts, logprobs)]  # fmt: skip
        return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops_by_text, "text_offset": offsets}

    def _chat_logprob(self, token_id: int, text: str, logprob: float) -> dict:
        """One chat logprobs entry; ``bytes`` are the token's own UTF-8 bytes (part of a character's, for a token
        that splits one), so a client can join them into the text, as OpenAI's."""
        raw = list(text.encode()) if self.tokens_as_ids else token_bytes(self.tokenizer, token_id, text)
        return {"token": text, "logprob": logprob, "bytes": raw}

    # -- whole responses ---------------------------------------------------
    def response(self, results: list[TextRequestOutput]) -> dict:
        """The non-streamed body of a finished request."""
        returned = [self._best(r) for r in results]
        choices = [self._choice(key * self.n + i, c, r)
                   for key, (r, kept) in enumerate(zip(results, returned)) for i, c in enumerate(kept)]  # fmt: skip
        body = {**self.head(chunk=False), "choices": choices,
                "usage": usage(results, returned, generated=not self.echo_only)}  # fmt: skip
        if self.kind == "chat" and self.prompt_logprobs is not None:  # vLLM: one prompt, on the response
            body["prompt_logprobs"] = self._prompt_logprobs(results[0])
        return body

    def _best(self, result: TextRequestOutput) -> list[TextCompletion]:
        """The ``n`` samples returned, in index order, or, of ``best_of > n``, the ``n`` most likely."""
        outputs = result.outputs
        if len(outputs) > self.n:
            outputs = sorted(outputs, key=lambda c: -c.cumulative_logprob)[: self.n]
        return outputs

    def _choice(self, index: int, c: TextCompletion, r: TextRequestOutput) -> dict:
        if self.echo_only:  # the prompt alone: its generated token is not shown
            c = _prompt_alone(c, "length")
        ids, lps, tops, text = c.token_ids, c.logprobs, c.top_logprobs, c.text
        if self.echo:  # the prompt's tokens first: the first has no log-probability
            p_text, p_lps, p_tops = self._echoed(r.prompt_token_ids, r.prompt, r.prompt_logprobs)
            ids, text, lps, tops = r.prompt_token_ids + ids, p_text + text, p_lps + lps, p_tops + tops
        body = {"index": index, "logprobs": self.logprobs_block(index, ids, lps, tops),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
        if self.kind == "chat":
            body["message"], body["finish_reason"] = self._message(text, c.finish_reason)
        else:
            body["text"] = text
            if self.prompt_logprobs is not None:
                body["prompt_logprobs"] = self._prompt_logprobs(r)
        return body

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A whole chat sample's message (its reasoning split out first, then its tool calls read) and finish."""
        fields = {}
        if self.reasoning is not None:
            fields, text = self.reasoning.message(text)
            text = text or None  # vLLM's: no content after the thinking is null
        if self.tools is not None:
            message, finish_reason = self.tools.message(text or "", finish_reason)
        else:
            message = {"role": "assistant", "content": text}
        return message | fields, finish_reason

    def _echoed(self, ids: list[int], text: str | None, scored: list[dict[int, float] | None] | None
                ) -> tuple[str, list[float | None], list[dict[int, float]]]:  # fmt: skip
        """An echoed prompt's text, its tokens' log-probabilities (the first: None) and their top ones."""
        scored = scored or [None] * len(ids)
        lps = [None if d is None else d[t] for d, t in zip(scored, ids)]
        return (text or self.tokenizer.decode(ids)), lps, [d or {} for d in scored]

    def _prompt_logprobs(self, r: TextRequestOutput) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token, None for the first, else its and the top ones' entries."""
        out: list[dict | None] = []
        for token, scored, rank in zip(r.prompt_token_ids, r.prompt_logprobs or [], r.prompt_ranks or []):
            if scored is None:
                out.append(None)
                continue
            # the first k scored are the true top k (a prompt token outside them is below them all)
            top = sorted(scored.items(), key=lambda kv: -kv[1])[: self.prompt_logprobs]
            entries = {t: (lp, i + 1) for i, (t, lp) in enumerate(top)}
            entries.setdefault(token, (scored[token], rank))  # as vLLM: a top one keeps its place as its rank
            out.append({str(t): {"logprob": _finite(lp), "rank": rank, "decoded_token": self.token_text(t)}
                        for t, (lp, rank) in entries.items()})  # fmt: skip
        return out

    # -- streamed responses ------------------------------------------------
    def shown(self, d: SampleDelta) -> SampleDelta:
        """A sample's delta as the client sees it: with ``echo_only``, no generated token, and "length" at its end."""
        return _prompt_alone(d, d.finish_reason and "length") if self.echo_only else d

    def chunk(self, key: int, d: SampleDelta, include_usage: bool) -> dict | None:
        """A streamed chunk carrying one sample's delta (None: a tool reader holds all of it back, nothing to say)."""
        index = key * self.n + d.index
        logprobs = self.logprobs_block(index, d.token_ids, d.logprobs, d.top_logprobs)
        choice = {"index": index, "logprobs": logprobs, "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
        if self.kind == "chat":
            choice["delta"], choice["finish_reason"] = self._delta(index, d)
            if not (choice["delta"] or choice["finish_reason"] or logprobs):
                return None
        else:
            choice["text"] = d.text
        return self._with_usage({**self.head(chunk=True), "choices": [choice]}, include_usage, key, index)

    def _delta(self, index: int, d: SampleDelta) -> tuple[dict, str | None]:
        """A streamed chat choice's delta (its reasoning pieces first, then its content or tool calls) and finish."""
        fields, text = {}, d.text
        if self.reasoning is not None:
            fields, text = self.reasoning.delta(index, text, d.finish_reason is not None)
        if self.tools is not None:
            delta, finish_reason = self.tools.delta(index, text, d.finish_reason)
        else:
            delta, finish_reason = ({"content": text} if text else {}), d.finish_reason
        return fields | delta, finish_reason

    def echo_chunk(self, key: int, index: int, prompt: tuple[list[int], str | None],
                   scored: list[dict[int, float] | None] | None, include_usage: bool) -> dict:  # fmt: skip
        """A streamed completion choice's first chunk with ``echo``: the prompt (and its tokens' log-probabilities)."""
        choice, ids = key * self.n + index, prompt[0]
        text, lps, tops = self._echoed(ids, prompt[1], scored)
        body = {"index": choice, "text": text, "logprobs": self.logprobs_block(choice, ids, lps, tops),
                "finish_reason": None, "stop_reason": None}  # fmt: skip
        return self._with_usage({**self.head(chunk=True), "choices": [body]}, include_usage, key, choice)

    def role_chunk(self, index: int, include_usage: bool) -> dict:
        """The first chunk of a streamed chat choice: the assistant role."""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._with_usage({**self.head(chunk=True), "choices": [choice]}, include_usage, index // self.n, index)

    def usage_chunk(self, results: list[TextRequestOutput]) -> dict:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        returned = [self._best(r) for r in results]
        return {**self.head(chunk=True), "choices": [], "usage": usage(results, returned, generated=not self.echo_only)}

    def tally(self, key: int, d: SampleDelta) -> None:
        """Count a streamed delta's tokens (shown or not) toward its choice's running usage."""
        index = key * self.n + d.index
        self.generated[index] = self.generated.get(index, 0) + len(d.token_ids)

    def _with_usage(self, body: dict, include_usage: bool, key: int, choice: int) -> dict:
        if include_usage:  # OpenAI sends null usage on every chunk but the last; vLLM's continuous stats, a running one
            body["usage"] = self._running_usage(key, choice) if self.continuous_usage else None
        return body

    def _running_usage(self, key: int, choice: int) -> dict:
        """vLLM's continuous usage of a chunk: prompt ``key``'s tokens and choice ``choice``'s tokens so far."""
        prompt, completion = self.prompt_tokens[key], self.generated.get(choice, 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def wants_chunk(d: SampleDelta, with_logprobs: bool) -> bool:
    """Whether a delta is worth a chunk: new text, a finish, or tokens whose log-probabilities were asked for."""
    return bool(d.text or d.finish_reason or (with_logprobs and d.token_ids))


def usage(results: list[TextRequestOutput], returned: list[list[TextCompletion]], *, generated: bool = True) -> dict:
    """OpenAI's usage block: prompt tokens once per prompt (and their prefix-cache hits), the tokens of the samples
    returned (``returned``, per result: with ``best_of > n`` the ``n`` kept, as vLLM counts them), none unless
    ``generated`` (an echo of the prompt alone)."""
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(c.token_ids) for kept in returned for c in kept) if generated else 0
    cached = sum(r.num_cached_tokens or 0 for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def sse(body: dict | str) -> str:
    """One server-sent event."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """The printable character a byte-level BPE (GPT-2's) writes for each byte, mapped back to the byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(shifted)}


def token_bytes(tokenizer, token_id: int, text: str | None = None) -> list[int]:
    """A token's UTF-8 bytes: its text's (``text``: its decode, when known), or, for a token that holds part of
    a character (its text has U+FFFD), the bytes it stands for, read off its vocabulary entry (byte-level BPE, or
    SentencePiece's ``<0xNN>``)."""
    text = tokenizer.decode([token_id]) if text is None else text
    if REPLACEMENT not in text or not hasattr(tokenizer, "convert_ids_to_tokens"):
        return list(text.encode())
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str) or not piece:
        return list(text.encode())
    if m := _BYTE_TOKEN.fullmatch(piece):
        return [int(m.group(1), 16)]
    alphabet = _byte_level_alphabet()
    if all(ch in alphabet for ch in piece):
        return [alphabet[ch] for ch in piece]
    return list(text.encode())


def _prompt_alone(sample: Shown, finish_reason: str | None) -> Shown:
    """``sample`` (a whole sample or its delta) showing no generated token, ended by ``finish_reason``: the echo
    of a prompt alone (``max_tokens=0``)."""
    return replace(sample, text="", token_ids=[], logprobs=[], top_logprobs=[], ranks=[],
                   finish_reason=finish_reason, stop_reason=None)  # fmt: skip


def _finite(logprob: float) -> float:
    """A log-probability JSON can carry: -inf (a token a grammar or the model rules out) or NaN as LOGPROB_FLOOR."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _top(top: dict[int, float], k: int) -> list[tuple[int, float]]:
    return [(t, _finite(v)) for t, v in sorted(top.items(), key=lambda kv: -kv[1])[:k]]

"""Token sampling over a batch of logits rows, in vLLM's order; prompt log-probabilities.

Order (vLLM's v1 sampler): the logits controls of :mod:`scheduler.runner.logits_processors`
on the raw logits (allowed ids, bad words, min_tokens, logit bias, then the repetition,
frequency and presence penalties); greedy rows take the argmax of the result; random rows
divide it by their temperature, then min-p, top-k and top-p filter it, and the exponential
race draws: ``argmax(p / E)`` with ``E ~ Exp(1)`` picks token i with probability ``p_i``.
Every step is vectorized over the batch; only the noise of seeded rows is drawn row by row,
from each row's own ``torch.Generator``, so a seeded sample's tokens do not depend on the
other rows. Reported log-probabilities (the sampled token's, the top ones, the prompt's) are
those of the model's raw distribution, before any control or temperature: vLLM's default
``logprobs_mode="raw_logprobs"``. So are the ranks of the sampled and the prompt tokens: as
vLLM's, a token's rank is the number of vocabulary tokens whose raw logit is at least its own
(1 for the most likely; a tie counts against it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from scheduler.core.params import SamplingParams
from scheduler.runner.host_fetch import Fetch, fetch
from scheduler.runner.logits_processors import (
    PenaltyCounts,
    TokenHistory,
    apply_min_p,
    empty_histories,
    plan_controls,
    upload,
)

_TINY = 1e-20  # keeps the exponential noise off zero


@dataclass(frozen=True)
class SampleRow:
    """One row to sample: its parameters, its generator (None: the global one) and its sequence's tokens."""

    params: SamplingParams
    generator: torch.Generator | None
    history: TokenHistory


@dataclass(frozen=True)
class PromptRows:
    """Logits rows of prompt positions: each scores the prompt token that follows its position."""

    targets: list[int]  # the next prompt token of each row
    num_top: list[int]  # top log-probabilities asked for, per row


@dataclass(frozen=True)
class SampleResult:
    """Chosen tokens, their log-probabilities, ranks and the top ones asked for; each prompt row's likewise."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # {next prompt token: lp, top...}
    ranks: list[int] = field(default_factory=list)  # each chosen token's rank in the vocabulary (1: the most likely)
    prompt_ranks: list[int] = field(default_factory=list)  # each prompt row's next prompt token's rank


class Sampler:
    """Samples a step's rows; keeps the per-sequence penalty counts on the device between steps."""

    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.counts = PenaltyCounts(vocab_size, torch.device(device))
        self.eos_token_ids = frozenset(eos_token_ids)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], prompt_logits: torch.Tensor | None = None,
        prompt: PromptRows | None = None,
    ) -> SampleResult:  # fmt: skip
        """Pick one token per row of ``logits [R, V]``; score ``prompt_logits [P, V]`` against ``prompt``.

        Everything runs on the logits' device; the chosen tokens, their log-probabilities and
        ranks, the top ones and the prompt rows' come back in one device->host transfer.
        """
        (result,) = fetch(self.prepare(logits, rows, prompt_logits, prompt))
        return result

    def prepare(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], prompt_logits: torch.Tensor | None = None,
        prompt: PromptRows | None = None,
    ) -> Fetch[SampleResult]:  # fmt: skip
        """:meth:`__call__`'s device work (the draws, the penalty counts): its result, still to fetch (with others,
        in the step's one transfer)."""
        logits = logits.float()  # a no-op for the model's float32 logits
        params = [r.params for r in rows]
        controls = plan_controls(params, [r.history for r in rows], self.counts, self.eos_token_ids)
        processed = logits if controls is None else controls.apply(logits.clone(), self.counts)
        tokens = processed.argmax(dim=-1)  # [R]; greedy rows keep these
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            picked = [rows[i] for i in random_rows]
            rows_t, top_k = upload(logits.device, [random_rows, [r.params.top_k for r in picked]], torch.int64)
            tokens[rows_t] = _sample_rows(processed[rows_t], picked, top_k)
        if controls is not None and controls.penalized is not None:
            self.counts.record(controls.slots, controls.slots_t, tokens[controls.penalized])
        vocab = logits.shape[-1]
        k = min(max((p.logprobs for p in params), default=0), vocab)
        parts = logprob_parts(logits, tokens, k)
        kp = 0
        if prompt is not None and prompt.targets:
            kp = min(max(prompt.num_top), vocab)
            (targets,) = upload(logits.device, [prompt.targets], torch.int64)
            parts += logprob_parts(prompt_logits.float(), targets, kp)[1:]
        return Fetch(parts, lambda host: _unpack(host, params, k, prompt, kp))


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
    histories: Sequence[TokenHistory] | None = None, *, eos_token_ids: frozenset[int] = frozenset(),
) -> SampleResult:  # fmt: skip
    """Pick one token per row of ``logits [R, V]`` once (penalty counts built from ``histories``, default empty)."""
    histories = histories if histories is not None else empty_histories(len(params))
    rows = [SampleRow(p, g, h) for p, g, h in zip(params, generators, histories)]
    return Sampler(logits.shape[-1], logits.device, eos_token_ids)(logits, rows)


def _sample_rows(logits: torch.Tensor, rows: list[SampleRow], top_k: torch.Tensor) -> torch.Tensor:
    """Random draws for rows with temperature > 0: processed logits [R, V] -> tokens [R] (``top_k [R]`` uploaded)."""
    probs = processed_probs(logits, [r.params for r in rows], top_k)  # [R, V]
    return (probs / exponential_noise(probs, [r.generator for r in rows])).argmax(dim=-1)


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams], top_k: torch.Tensor) -> torch.Tensor:
    """The distribution random rows draw from: logits [R, V] (controls applied) through temperature, min-p, top-k and
    top-p, softmaxed -> probabilities [R, V] (``top_k [R]`` uploaded)."""
    temperature, top_p, min_p = upload(
        logits.device, [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
        torch.float32,
    )  # fmt: skip
    # the row max moves to 0 first: no temperature can overflow a logit
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature[:, None]
    if any(p.min_p > 0.0 for p in params):
        scaled = apply_min_p(scaled, min_p)
    use = (any(p.top_k > 0 for p in params), any(p.top_p < 1.0 for p in params))
    return torch.softmax(apply_top_k_top_p(scaled, top_k, top_p, use=use), dim=-1)  # [R, V]


def exponential_noise(like: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise shaped like ``like``; row i from ``gens[i]`` when set, else the global generator."""
    noise = torch.empty_like(like)
    if any(g is None for g in gens):
        noise.exponential_()
    for i, g in enumerate(gens):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise.clamp_(min=_TINY)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *, use: tuple[bool, bool] | None = None
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k (0: all) and top-p nucleus (1.0: all).

    ``use`` says from the host whether any row filters by top-k / top-p; without it they are
    read from the tensors (a device read on a GPU).
    """
    use_k, use_p = use if use is not None else (bool((top_k > 0).any()), bool((top_p < 1.0).any()))
    if not (use_k or use_p):
        return logits
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True)  # [R, V]
    drop = torch.zeros_like(ordered, dtype=torch.bool)
    if use_k:  # every logit tied with the k-th stays, as in vLLM and transformers (no bias from the sort order)
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        drop |= ordered < ordered.gather(1, (k - 1)[:, None])
    if use_p:
        probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always has 0 before it
        drop |= (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    return torch.empty_like(logits).scatter_(-1, order, ordered.masked_fill(drop, float("-inf")))


def logprob_parts(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Device tensors to transfer: ``tokens [R]``, their raw log-probabilities [R] and ranks [R], the top-k values
    and ids."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1]
    picked = logits.gather(1, tokens[:, None])  # [R, 1]
    ranks = (logits >= picked).sum(dim=-1)  # [R]: the token itself and every one at least as likely (vLLM's rank)
    parts = [tokens, picked[:, 0] - lse[:, 0], ranks]
    if k:
        top_values, top_ids = logits.topk(k, dim=-1)  # [R, k], k <= V
        parts += [top_values - lse, top_ids]  # ids < 2**53 are exact as doubles
    return parts


def _unpack(
    host: list[float], params: list[SamplingParams], k: int, prompt: PromptRows | None, kp: int
) -> SampleResult:
    """The flat transfer back into per-row results: the sampled rows' parts, then the prompt rows'."""
    at = 0

    def take(n: int) -> list[float]:
        """The next ``n`` values of the transfer."""
        nonlocal at
        at += n
        return host[at - n : at]

    r = len(params)
    tokens, chosen, ranks, values, ids = take(r), take(r), take(r), take(r * k), take(r * k)
    top = [_top(ids, values, i, k, p.logprobs) if p.logprobs else None for i, p in enumerate(params)]
    sampled = SampleResult([int(t) for t in tokens], chosen, top, ranks=[int(x) for x in ranks])
    if prompt is None or not prompt.targets:
        return sampled
    n = len(prompt.targets)
    target_lp, target_ranks, p_values, p_ids = take(n), take(n), take(n * kp), take(n * kp)
    scored = [{t: target_lp[i], **_top(p_ids, p_values, i, kp, want)}
              for i, (t, want) in enumerate(zip(prompt.targets, prompt.num_top))]  # fmt: skip
    return replace(sampled, prompt_logprobs=scored, prompt_ranks=[int(x) for x in target_ranks])


def _top(ids: list[float], values: list[float], row: int, k: int, want: int) -> dict[int, float]:
    """``{token id: logprob}`` of the first ``want`` of row ``row``'s ``k`` top entries."""
    span = slice(row * k, row * k + want)
    return {int(t): v for t, v in zip(ids[span], values[span])}

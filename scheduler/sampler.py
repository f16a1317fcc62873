"""Token sampling over a batch of logits rows: greedy, temperature, top-k, top-p, per-row seeds.

Every step is vectorized over the batch; only the noise of seeded rows is drawn
row by row, from each row's own ``torch.Generator``, so a seeded sample's
tokens do not depend on the other rows. Sampling uses the exponential race:
``argmax(p / E)`` with ``E ~ Exp(1)`` picks token i with probability ``p_i``.
Reported log-probabilities are those of the model's raw distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scheduler.params import SamplingParams

_TINY = 1e-20  # keeps the exponential noise off zero


@dataclass(frozen=True)
class SampleResult:
    """Chosen tokens, their log-probabilities, and the top log-probabilities asked for."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> SampleResult:
    """Pick one token per row of ``logits [R, V]`` following each row's parameters."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    tokens = logits.argmax(dim=-1)  # [R]; greedy rows keep these
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        picked = [params[i] for i in random_rows], [generators[i] for i in random_rows]
        tokens[rows] = _sample_rows(logits[rows], *picked)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]  # [R]
    return SampleResult(tokens.tolist(), chosen.tolist(), _top_logprobs(logprobs, params))


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
) -> torch.Tensor:
    """Random draws for rows with temperature > 0: logits [R, V] -> tokens [R]."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], device=device, dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
    scaled = apply_top_k_top_p(logits.float() / temperature[:, None], top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    return (probs / exponential_noise(probs, gens)).argmax(dim=-1)


def exponential_noise(like: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise shaped like ``like``; row i from ``gens[i]`` when set, else the global generator."""
    noise = torch.empty_like(like)
    if any(g is None for g in gens):
        noise.exponential_()
    for i, g in enumerate(gens):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise.clamp_(min=_TINY)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k (0: all) and top-p nucleus (1.0: all)."""
    use_k, use_p = bool((top_k > 0).any()), bool((top_p < 1.0).any())
    if not (use_k or use_p):
        return logits
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = torch.zeros_like(ordered, dtype=torch.bool)
    if use_k:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        drop |= ranks >= k[:, None]
    if use_p:
        probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always has 0 before it
        drop |= (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    return torch.empty_like(logits).scatter_(-1, order, ordered.masked_fill(drop, float("-inf")))


def _top_logprobs(logprobs: torch.Tensor, params: Sequence[SamplingParams]) -> list[dict[int, float] | None]:
    k = max((p.logprobs for p in params), default=0)
    if k == 0:
        return [None] * len(params)
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # [R, k]
    values, ids = values.tolist(), ids.tolist()
    return [
        dict(zip(ids[i][: p.logprobs], values[i][: p.logprobs])) if p.logprobs else None
        for i, p in enumerate(params)
    ]

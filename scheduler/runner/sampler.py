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

from scheduler.core.params import SamplingParams

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
    """Pick one token per row of ``logits [R, V]`` following each row's parameters.

    Everything runs on the logits' device; the chosen tokens, their log-probabilities and the
    top log-probabilities asked for come back in one device->host transfer.
    """
    logits = logits.float()  # a no-op for the model's float32 logits
    tokens = logits.argmax(dim=-1)  # [R]; greedy rows keep these
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows).to(logits.device, non_blocking=True)
        picked = [params[i] for i in random_rows], [generators[i] for i in random_rows]
        tokens[rows] = _sample_rows(logits[rows], *picked)
    k = max((p.logprobs for p in params), default=0)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1]
    chosen = logits.gather(1, tokens[:, None]) - lse  # [R, 1]
    parts = [tokens[:, None].double(), chosen.double()]
    if k:
        top_values, top_ids = logits.topk(min(k, logits.shape[-1]), dim=-1)  # [R, k]
        parts += [(top_values - lse).double(), top_ids.double()]  # ids < 2**53 are exact
    host = torch.cat(parts, dim=1).tolist()  # the step's one device->host transfer
    return SampleResult(
        [int(r[0]) for r in host], [r[1] for r in host], _top_logprobs(host, params, k)
    )


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
) -> torch.Tensor:
    """Random draws for rows with temperature > 0: logits [R, V] -> tokens [R]."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32).to(device, non_blocking=True)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64).to(device, non_blocking=True)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device, non_blocking=True)
    use_k, use_p = any(p.top_k > 0 for p in params), any(p.top_p < 1.0 for p in params)
    scaled = apply_top_k_top_p(logits.float() / temperature[:, None], top_k, top_p, use=(use_k, use_p))
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


def _top_logprobs(host: list[list[float]], params: Sequence[SamplingParams], k: int) -> list[dict[int, float] | None]:
    """Per row, ``{token id: logprob}`` of its ``logprobs`` most likely tokens (None when not asked)."""
    out: list[dict[int, float] | None] = []
    for row, p in zip(host, params):
        values, ids = row[2 : 2 + k], row[2 + k : 2 + 2 * k]
        out.append({int(i): v for i, v in zip(ids[: p.logprobs], values[: p.logprobs])} if p.logprobs else None)
    return out

"""Faults planted in one request for the isolation tests: its sampling, its detokenization, its token bookkeeping."""

from __future__ import annotations

from collections.abc import Callable, Sequence

FAULT_SALT = "plant-a-sampling-fault"  # a request with this cache_salt fails in sampling (plant_sampling_fault)


def salted(params) -> bool:
    """Whether a request's parameters carry FAULT_SALT."""
    return params.cache_salt == FAULT_SALT


def plant_sampling_fault(monkeypatch, is_faulty: Callable[[object], bool] = salted, after: int = 0) -> None:
    """Make the engine's sampler raise for any batch that holds a faulty request, once it has sampled ``after`` times.

    The sampler's device work runs first, so a failed attempt has advanced the batch's seeded generators.
    """
    from scheduler.runner.sampler import Sampler

    real, seen = Sampler.prepare, [0]

    def sample(self, logits, rows, prompt_logits=None, prompt=None):
        result = real(self, logits, rows, prompt_logits, prompt)
        if any(is_faulty(r.params) for r in rows):
            if seen[0] >= after:
                raise RuntimeError("planted sampling fault")
            seen[0] += 1
        return result

    monkeypatch.setattr(Sampler, "prepare", sample)


def plant_bookkeeping_fault(monkeypatch, scheduler, is_faulty: Callable[[object], bool], after: int) -> None:
    """Make the stop check of a faulty request's token raise once it has ``after`` output tokens."""
    real = scheduler._stop_reason

    def stop_reason(params, seq, token_id):
        if is_faulty(params) and seq.num_outputs > after:
            raise KeyError("planted bookkeeping fault")
        return real(params, seq, token_id)

    monkeypatch.setattr(scheduler, "_stop_reason", stop_reason)


class FaultyTokenizer:
    """Wraps a tokenizer; decoding fails for the request whose prompt ends with ``prompt_ids``' last tokens.

    A detokenizer's first decode of a sample holds the last prompt tokens (its context), so the
    fault hits that request's first output token and no other request's (their prompts differ).
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int]) -> None:
        from scheduler.entrypoints.detokenizer import PROMPT_CONTEXT

        self.inner = tokenizer
        self.tail = list(prompt_ids[-PROMPT_CONTEXT:])

    def decode(self, ids, **kwargs) -> str:
        """The inner tokenizer's decode, or ValueError for the faulty request."""
        if list(ids[: len(self.tail)]) == self.tail:
            raise ValueError("planted detokenization fault")
        return self.inner.decode(ids, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

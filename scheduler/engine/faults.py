"""Fault isolation of an engine step: a request's own failure fails that request alone.

A step's phases fail in two ways (see :meth:`~scheduler.engine.llm_engine.LLMEngine.step`):

- **per request**: sampling and the bookkeeping of a sampled token (append, stop checks).
  A failing sampling batch is retried by halves of its requests (:func:`isolate`) on the
  logits already computed, until each failing request is alone; the others keep the tokens
  they would have drawn in the full batch (a seeded row's generator is restored after a
  failed attempt: :func:`restoring`). The failed requests are aborted ("error") and freed.
- **whole step**: scheduling, the step input, the block moves and the forward. Their state
  belongs to every scheduled sequence (``num_computed`` was advanced at schedule time and the
  KV was not written), so every live request is aborted and the exception propagates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Failure:
    """Why one request failed in a step: the phase ("sampling", "token bookkeeping") and the exception."""

    phase: str
    error: BaseException

    def describe(self) -> str:
        """One line naming the phase and the exception, for logs and error bodies."""
        return f"{self.phase} failed: {type(self.error).__name__}: {self.error}"


def isolate(items: list[T], run: Callable[[list[T]], list[R]], owner: Callable[[T], K],
            failed: dict[K, BaseException]) -> list[R]:  # fmt: skip
    """``run(items)``; if it raises, ``run`` again on halves of the owners' items, recursively.

    An owner whose items fail alone gets its exception in ``failed`` and its items are dropped;
    the results of the others come back in their order. ``run`` must leave no trace when it
    raises. ``k`` failing owners among ``n`` cost ``O(k log n)`` calls.
    """
    if not items:
        return []
    try:
        return run(items)
    except Exception as e:
        owners = list(dict.fromkeys(owner(item) for item in items))
        if len(owners) == 1:
            failed[owners[0]] = e
            return []
        first = set(owners[: len(owners) // 2])
        left = [item for item in items if owner(item) in first]
        right = [item for item in items if owner(item) not in first]
        return isolate(left, run, owner, failed) + isolate(right, run, owner, failed)


@contextlib.contextmanager
def restoring(generators: list[torch.Generator | None]) -> Iterator[None]:
    """Put the generators back in their state if the block raises (a failed draw consumes nothing)."""
    states = [(g, g.get_state()) for g in generators if g is not None]
    try:
        yield
    except BaseException:
        for g, state in states:
            g.set_state(state)
        raise

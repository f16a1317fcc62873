"""Pinned prefixes: prompts (a system prompt) whose device blocks are never evicted while pinned.

A prefix not cached yet is computed first by a one-token warm-up request queued like any
other; the pin takes hold in the step that finishes it (before any other request can evict
its blocks), and that request's output is never returned to the caller.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from paged_kv.block_manager import BlockManager
from paged_kv.errors import InvalidArgumentError, UnknownSequenceError, describe
from scheduler.core.outputs import RequestOutput

WARMUP_PREFIX = "paged-kv-pin-"  # request ids of warm-up requests


class PinnedPrefixes:
    """The engine's pins: held ones (in the block manager) and those waiting for their warm-up request."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self._waiting: dict[str, tuple[list[int], str | None]] = {}  # warm-up request id -> (prompt, salt)
        self._warm_ups: set[str] = set()  # warm-up requests not finished (a pin dropped while waiting included)
        self._ids = itertools.count()

    def pin(self, prompt: list[int], cache_salt: str | None, warm_up: Callable[[str], None]) -> str:
        """Pin ``prompt``'s full blocks now if cached, else after ``warm_up(request_id)`` computes them; its id."""
        if len(prompt) < self.bm.block_size:
            expected = f"at least one full block ({self.bm.block_size} tokens)"
            raise InvalidArgumentError(describe("token_ids", f"{len(prompt)} tokens", expected))
        pin_id = f"{WARMUP_PREFIX}{next(self._ids)}"
        full = len(prompt) // self.bm.block_size * self.bm.block_size
        if self.bm.pin(pin_id, prompt, cache_salt=cache_salt) < full:  # not all on the device: compute it first
            self.bm.unpin(pin_id)
            warm_up(pin_id)
            self._waiting[pin_id] = (prompt, cache_salt)
            self._warm_ups.add(pin_id)
        return pin_id

    def unpin(self, pin_id: str) -> None:
        """Release a pin (or drop one still waiting for its warm-up)."""
        if not isinstance(pin_id, str):
            raise InvalidArgumentError(describe("pin_id", pin_id, "a str that pin_prefix returned"))
        if self._waiting.pop(pin_id, None) is None:
            if pin_id not in self.bm.pinned:
                raise UnknownSequenceError(describe("pin_id", pin_id, "an id pin_prefix returned, not unpinned yet"))
            self.bm.unpin(pin_id)

    def settle(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Pin the prefixes whose warm-up finished among ``outputs``; return the others."""
        if not self._warm_ups:
            return outputs
        kept = []
        for out in outputs:
            if out.request_id not in self._warm_ups:
                kept.append(out)
                continue
            self._warm_ups.discard(out.request_id)
            waiting = self._waiting.pop(out.request_id, None)
            if waiting is not None and out.error is None:
                self.bm.pin(out.request_id, waiting[0], cache_salt=waiting[1])
        return kept

    @property
    def held(self) -> dict[str, int]:
        """Tokens held on the device by each pin in effect."""
        return self.bm.pinned

    def is_waiting(self, pin_id: str) -> bool:
        """Whether the pin waits for its warm-up request."""
        return pin_id in self._waiting

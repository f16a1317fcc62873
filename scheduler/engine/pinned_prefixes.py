"""Pinned prefixes: prompts (a system prompt) whose device blocks are never evicted while pinned.

A prefix not cached yet is computed first by a one-token warm-up request queued like any
other; the pin takes hold in the step that finishes it (before any other request can evict
its blocks), and that request's output is never returned to the caller; a warm-up that fails
after ``pin_prefix`` returned (refused once other pins hold the room it needs) drops its pin,
with a warning in the log. A failed step forgets every cached block
(:meth:`PinnedPrefixes.restore`): each pin then waits for a new warm-up.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from paged_kv.block_manager import BlockManager
from paged_kv.errors import InvalidArgumentError, UnknownSequenceError, describe
from scheduler.core.outputs import RequestOutput

log = logging.getLogger(__name__)
WARMUP_PREFIX = "paged-kv-pin-"  # request ids of warm-up requests
Prefix = tuple[list[int], str | None]  # a pinned prompt's token ids and cache salt
WarmUp = Callable[[str, list[int], str | None], None]


class PinnedPrefixes:
    """The engine's pins: held ones (in the block manager) and those waiting for their warm-up request."""

    def __init__(self, bm: BlockManager, warm_up: WarmUp) -> None:
        self.bm = bm
        self._warm_up = warm_up  # queues the one-token request computing a prefix: (request id, prompt, salt)
        self._prompts: dict[str, Prefix] = {}  # every pin not unpinned, held or waiting
        # warm-up requests not finished (their ids are their pins'); a pin waits while it is here and in _prompts
        self._warm_ups: set[str] = set()
        self._stale: set[str] = set()  # warm-ups whose blocks a prefix-cache reset forgot: run again when done
        self._ids = itertools.count()

    def pin(self, prompt: list[int], cache_salt: str | None) -> str:
        """Pin ``prompt``'s full blocks now if cached, else after a warm-up request computes them; its id."""
        if len(prompt) < self.bm.block_size:
            expected = f"at least one full block ({self.bm.block_size} tokens)"
            raise InvalidArgumentError(describe("token_ids", f"{len(prompt)} tokens", expected))
        pin_id = f"{WARMUP_PREFIX}{next(self._ids)}"
        self._prompts[pin_id] = (prompt, cache_salt)
        try:
            self._hold_or_warm_up(pin_id)
        except Exception:  # its warm-up refused: no pin (restore would warm it up again, and fail there)
            del self._prompts[pin_id]
            raise
        return pin_id

    def _hold_or_warm_up(self, pin_id: str) -> None:
        """Hold the pin's blocks if all are cached on the device, else queue its warm-up request."""
        prompt, salt = self._prompts[pin_id]
        full = len(prompt) // self.bm.block_size * self.bm.block_size
        if self.bm.pin(pin_id, prompt, cache_salt=salt) < full:  # not all on the device: compute it first
            self.bm.unpin(pin_id)
            self._warm_up(pin_id, prompt, salt)
            self._warm_ups.add(pin_id)

    def unpin(self, pin_id: str) -> None:
        """Release a pin (or drop one still waiting for its warm-up)."""
        if not isinstance(pin_id, str):
            raise InvalidArgumentError(describe("pin_id", pin_id, "a str that pin_prefix returned"))
        if pin_id not in self._prompts:
            raise UnknownSequenceError(describe("pin_id", pin_id, "an id pin_prefix returned, not unpinned yet"))
        del self._prompts[pin_id]
        if pin_id not in self._warm_ups:  # held (a waiting pin holds nothing yet)
            self.bm.unpin(pin_id)

    def restore(self) -> None:
        """After a failed step (every request aborted, the prefix cache reset): warm every pin up again.

        The reset forgot the pinned blocks' hashes, so a held pin would keep its blocks without a
        hit; an aborted warm-up would never settle. Each pin keeps its id.
        """
        self._warm_ups.clear()  # aborted with every other request: their outputs never come
        self._stale.clear()
        held = self.bm.pinned
        for pin_id in self._prompts:
            if pin_id in held:
                self.bm.unpin(pin_id)
            self._hold_or_warm_up(pin_id)

    def forget_warm_ups(self) -> None:
        """After a prefix-cache reset: the running warm-ups' blocks are forgotten, so each runs again when done."""
        self._stale |= self._warm_ups

    def settle(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Pin the prefixes whose warm-up finished among ``outputs``; return the others."""
        if not self._warm_ups:
            return outputs
        kept = []
        for out in outputs:
            if out.request_id not in self._warm_ups:
                kept.append(out)
                continue
            self._warmed_up(out.request_id, error=out.error)
        return kept

    def _warmed_up(self, pin_id: str, *, error: str | None) -> None:
        """A pin's warm-up finished: pin its prefix, warm it up again (a reset forgot its blocks) or drop it."""
        self._warm_ups.discard(pin_id)
        stale = pin_id in self._stale
        self._stale.discard(pin_id)
        if pin_id not in self._prompts:
            return  # unpinned while it waited
        if error is not None:  # its warm-up failed alone: the pin is dropped, and said so (pin_prefix has returned)
            del self._prompts[pin_id]
            log.warning("pin %s is dropped: its warm-up request failed (%s)", pin_id, error)
        elif stale:
            self._hold_or_warm_up(pin_id)
        else:
            prompt, salt = self._prompts[pin_id]
            self.bm.pin(pin_id, prompt, cache_salt=salt)

    @property
    def held(self) -> dict[str, int]:
        """Tokens held on the device by each pin in effect."""
        return self.bm.pinned

    def is_waiting(self, pin_id: str) -> bool:
        """Whether the pin waits for its warm-up request."""
        return pin_id in self._warm_ups and pin_id in self._prompts

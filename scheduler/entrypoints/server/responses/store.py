"""Finished responses kept for ``GET``/``DELETE /v1/responses/{id}`` and ``previous_response_id``: a bounded LRU.

The store lives in the server process's memory: it is per process (two servers never share it) and
lost at restart. It holds at most ``capacity`` responses; storing one more forgets the least recently
stored or read one. Only the event loop touches it (no lock).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from paged_kv.errors import check_int, describe
from scheduler.entrypoints.server.errors import NotFound


@dataclass(frozen=True)
class StoredResponse:
    """A finished response and the chat messages it answered (its own input after its predecessors', no
    instructions): what a continuation renders before the response's output."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]


@dataclass
class ResponseStore:
    """At most ``capacity`` finished responses by id, the least recently used forgotten first."""

    capacity: int
    _held: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        check_int("capacity", self.capacity, low=0)

    def __len__(self) -> int:
        return len(self._held)

    def put(self, stored: StoredResponse) -> None:
        """Keep a finished response (nothing with capacity 0), forgetting the least recently used past capacity."""
        if self.capacity == 0:
            return
        self._held[stored.body["id"]] = stored
        self._held.move_to_end(stored.body["id"])
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response ``response_id`` (now the most recently used); NotFound naming ``param`` if none."""
        stored = self._held.get(response_id)
        if stored is None:
            raise NotFound(param, describe(param, response_id, "the id of a response this server stores"))
        self._held.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        """Forget a stored response; NotFound naming ``response_id`` if none."""
        self.get(response_id)
        del self._held[response_id]

"""The store of finished responses: bounded, least recently used forgotten first, unknown ids a NotFound."""

from __future__ import annotations

import pytest

from paged_kv.errors import InvalidArgumentError
from scheduler.entrypoints.server.errors import NotFound
from scheduler.entrypoints.server.responses.store import ResponseStore, StoredResponse


def stored(response_id: str) -> StoredResponse:
    """A stored response with this id and a one-message conversation."""
    return StoredResponse({"id": response_id, "output": []}, [{"role": "user", "content": response_id}])


def test_past_its_capacity_the_least_recently_used_is_forgotten():
    store = ResponseStore(2)
    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("a").conversation[0]["content"] == "a"  # now "b" is the least recently used
    store.put(stored("c"))
    assert len(store) == 2 and store.get("a") and store.get("c")
    with pytest.raises(NotFound) as info:
        store.get("b")
    assert info.value.param == "response_id" and "'b'" in str(info.value)


def test_a_deleted_response_is_gone_and_an_unknown_one_names_the_field_that_asked():
    store = ResponseStore(4)
    store.put(stored("a"))
    store.delete("a")
    assert len(store) == 0
    with pytest.raises(NotFound):
        store.delete("a")
    with pytest.raises(NotFound) as info:
        store.get("a", "previous_response_id")
    assert info.value.param == "previous_response_id" and len(store) == 0


def test_capacity_zero_keeps_nothing_and_a_negative_one_is_refused():
    store = ResponseStore(0)
    store.put(stored("a"))
    assert len(store) == 0
    with pytest.raises(InvalidArgumentError, match="capacity"):
        ResponseStore(-1)

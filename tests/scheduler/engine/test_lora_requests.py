"""LoRARequests: a request's adapter staged (read once per adapter, nothing loaded) before admission, kept once
queued; refused with a typed error when LoRA is off. The runner's LoRAManager is a recording stand-in (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from paged_kv.block_hash import salt_root
from paged_kv.errors import InvalidArgumentError
from scheduler import LoRARequest
from scheduler.core.lora_request import LoRAKey
from scheduler.engine.lora_requests import LoRARequests

ONE, TWO = LoRARequest(name="one", path="/adapters/one"), LoRARequest(name="two", path="/adapters/two")


class Manager:
    """Stages an adapter as (its key, a weights token) and records what is staged and kept."""

    def __init__(self) -> None:
        self.staged: list[LoRARequest] = []
        self.kept: list[str] = []

    def stage(self, request: LoRARequest):
        self.staged.append(request)
        lora_id = 1 if request.name == "one" else 2
        return LoRAKey(name=request.name, lora_id=lora_id, fingerprint="f" * 64, path=request.path), f"w-{lora_id}"

    def keep(self, key: LoRAKey, adapter: str) -> None:
        self.kept.append(key.name)


class Events:
    """Records the roots named to the KV events."""

    def __init__(self) -> None:
        self.named: list[tuple] = []

    def name_root(self, root, name: str, lora_id: int) -> None:
        self.named.append((root, name, lora_id))


def _requests(loras=None) -> LoRARequests:
    return LoRARequests(SimpleNamespace(loras=loras))


def test_the_base_model_stages_nothing_and_a_lora_request_is_refused_while_lora_is_off():
    off = _requests()
    assert off.stage(None) is None and off.load(None) is None
    with pytest.raises(InvalidArgumentError, match=r"^lora_request=.*LoRA is off"):
        off.stage(ONE)
    with pytest.raises(InvalidArgumentError, match=r"^lora_request=.*LoRA is off"):
        off.stage_each([None, ONE])


def test_stage_each_reads_each_adapter_once_and_loads_nothing():
    manager = Manager()
    staged = _requests(manager).stage_each([ONE, None, TWO, ONE])
    assert manager.staged == [ONE, TWO] and manager.kept == []
    assert staged[1] == (None, None)
    assert [key.name for key, _ in (staged[0], staged[2], staged[3])] == ["one", "two", "one"]
    assert staged[0][1].request == ONE and staged[0][1].adapter == "w-1" and staged[3][1].adapter == "w-1"


@pytest.mark.parametrize("bad", ["one", ONE, [ONE, "two"]])
def test_stage_each_refuses_anything_but_a_list_of_lora_requests_or_none_before_reading(bad):
    manager = Manager()
    with pytest.raises(InvalidArgumentError, match=r"^lora_request="):
        _requests(manager).stage_each(bad)
    assert manager.staged == []


def test_load_keeps_the_adapter_and_keep_names_its_root_to_the_kv_events():
    manager, events = Manager(), Events()
    lora = _requests(manager)
    assert lora.load(TWO).name == "two" and manager.kept == ["two"]
    staged = lora.stage(ONE)
    group = SimpleNamespace(cache_salt=staged[0].cache_salt(None), lora=staged[0])
    lora.keep(staged, group, None)  # no KV events: kept only
    lora.keep(staged, group, events)
    lora.keep(None, group, events)  # the base model: nothing kept nor named
    assert manager.kept == ["two", "one", "one"]
    assert events.named == [(salt_root(group.cache_salt), "one", 1)]

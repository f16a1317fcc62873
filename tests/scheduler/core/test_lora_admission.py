"""Admission with LoRA adapters: a waiting group whose adapter has no slot is passed over in place, not blocking
the groups behind it, and is admitted once a slot frees (the adapters it waits behind drain: no starvation)."""

from __future__ import annotations

import pytest

from paged_kv import BlockManager, BlockManagerConfig
from scheduler import SamplingParams, SchedulerConfig
from scheduler.core.lora_request import LoRAKey
from scheduler.core.scheduler import Scheduler

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
A = LoRAKey(name="a", lora_id=1, fingerprint="fa", path="/a")
B = LoRAKey(name="b", lora_id=2, fingerprint="fb", path="/b")


def _scheduler(policy: str = "fcfs", max_loras: int = 1) -> Scheduler:
    bm = BlockManager(BlockManagerConfig(num_blocks=64, block_size=4), track_changes=True)
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, scheduling_policy=policy)
    return Scheduler(config, bm, max_loras=max_loras)


def _add(s: Scheduler, rid: str, lora: LoRAKey | None, priority: int = 0) -> None:
    s.add_request(rid, [1, 2, 3, 4, 5], PARAMS, lora=lora, priority=priority)


def _admitted(s: Scheduler) -> list[str]:
    """The waiting requests one step admits, in order (the running ones have no token to compute: nothing sampled)."""
    waiting = {g.request_id for g in s.waiting}
    return [rid for rid in dict.fromkeys(seq.group.request_id for seq in s.schedule().scheduled) if rid in waiting]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_group_without_a_slot_is_passed_over_in_place(policy):
    """max_loras=1, adapter a running: b's group waits in place while later groups through a and the base start."""
    s = _scheduler(policy)
    _add(s, "r0", A)
    assert _admitted(s) == ["r0"]
    for rid, lora in (("r1", B), ("r2", A), ("r3", None), ("r4", B)):
        _add(s, rid, lora)
    assert _admitted(s) == ["r2", "r3"]  # r1, r4 through b: passed over, not blocking r2 and r3
    assert [g.request_id for g in s.waiting] == ["r1", "r4"]  # in their places
    for rid in ("r0", "r2"):
        s.abort(rid)
    assert _admitted(s) == ["r1", "r4"]  # a drained: b's groups start, in arrival order


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_passed_group_is_not_starved_by_a_stream_through_a_running_adapter(policy):
    """Later groups ride along adapter a only while a runs a group older than the passed one: a drains, b starts."""
    s = _scheduler(policy)
    _add(s, "old", A)
    assert _admitted(s) == ["old"]
    _add(s, "wait_b", B)
    _add(s, "new1", A)
    assert _admitted(s) == ["new1"]  # "old" predates wait_b: new1 runs beside it
    s.abort("old")
    _add(s, "new2", A)
    assert _admitted(s) == []  # a runs only groups younger than wait_b now: new2 waits behind it
    s.abort("new1")
    assert _admitted(s) == ["wait_b"]  # a drained; new2 through a waits for b in turn
    assert [g.request_id for g in s.waiting] == ["new2"]


def test_priority_order_among_the_groups_that_run():
    """Under priority the passed group stays first; the base model passes it, a running adapter only beside a group
    more important than it."""
    s = _scheduler("priority")
    _add(s, "run_a", A, priority=5)
    assert _admitted(s) == ["run_a"]
    _add(s, "low", None, priority=9)
    _add(s, "top_b", B, priority=0)
    _add(s, "mid", A, priority=3)
    # top_b passed over; mid would ride adapter a, but a runs nothing ahead of top_b: mid waits, keeping a draining
    assert _admitted(s) == ["low"]
    assert [g.request_id for g in s.waiting] == ["top_b", "mid"]
    s.abort("run_a")
    assert _admitted(s) == ["top_b"]


def test_two_slots_a_new_adapter_still_starts_when_one_is_free():
    """max_loras=2: a group through a second adapter starts beside the first (nothing passed over)."""
    s = _scheduler(max_loras=2)
    _add(s, "r0", A)
    _add(s, "r1", B)
    _add(s, "r2", None)
    assert _admitted(s) == ["r0", "r1", "r2"]

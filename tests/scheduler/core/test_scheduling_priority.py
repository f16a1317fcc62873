"""The priority scheduling policy (vLLM's): queues in (priority, arrival) order, the least important preempted first."""

from __future__ import annotations

import itertools

import pytest
import torch
from sched_helpers import assert_all_freed, make_engine

from paged_kv.errors import InvalidArgumentError
from scheduler import SamplingParams, SchedulerConfig
from scheduler.engine.beam_search import BeamSearchParams


def _prompts(num: int, length: int, seed: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(num)]


def _drain(engine) -> dict[str, list[list[int]]]:
    """Step until done; every request's samples' tokens."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = [c.token_ids for c in out.outputs]
    return done


def _admission_order(engine) -> list[str]:
    """Record the requests' ids in the order of their first scheduled step (admission), in step order."""
    order, schedule = [], engine.scheduler.schedule

    def traced():
        out = schedule()
        order.extend(rid for rid in dict.fromkeys(s.group.request_id for s in out.scheduled) if rid not in order)
        return out

    engine.scheduler.schedule = traced
    return order


@pytest.mark.parametrize("bad", ["lifo", "PRIORITY", None, 1])
def test_config_refuses_an_unknown_policy(bad):
    with pytest.raises(InvalidArgumentError, match=r"scheduling_policy=.*expected one of \('fcfs', 'priority'\)"):
        SchedulerConfig(scheduling_policy=bad)


def test_config_default_is_fcfs():
    assert SchedulerConfig().scheduling_policy == "fcfs"
    assert SchedulerConfig(scheduling_policy="priority").scheduling_policy == "priority"


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_order(tiny_hf, policy):
    """One sequence at a time: after the first, priority admits by (priority, arrival), fcfs by arrival."""
    engine = make_engine(tiny_hf, max_num_seqs=1, scheduling_policy=policy)
    order = _admission_order(engine)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    priorities = {"a": 5, "b": 5, "c": 2, "d": 5, "e": 0, "f": 2}
    engine.add_request("a", [1, 2, 3], params, priority=5)
    engine.step()  # "a" runs alone; the rest arrive while it does
    for rid, prompt in zip("bcdef", _prompts(5, 6)):
        engine.add_request(rid, prompt, params, priority=priorities[rid])
    _drain(engine)
    expected = ["a", "e", "c", "f", "b", "d"] if policy == "priority" else list("abcdef")
    assert order == expected
    assert_all_freed(engine)


def test_priority_admits_a_late_important_request_first_and_keeps_arrival_order_among_equals(tiny_hf):
    engine = make_engine(tiny_hf, max_num_seqs=2, scheduling_policy="priority")
    order = _admission_order(engine)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for i, prompt in enumerate(_prompts(6, 5)):
        engine.add_request(f"low{i}", prompt, params, priority=1)
    engine.add_request("urgent", [7, 8, 9], params, priority=-3)
    _drain(engine)
    assert order == ["urgent", *(f"low{i}" for i in range(6))]


def test_beam_search_takes_its_priority_place(tiny_hf):
    engine = make_engine(tiny_hf, max_num_seqs=4, scheduling_policy="priority")
    order = _admission_order(engine)
    for i, prompt in enumerate(_prompts(3, 5)):
        engine.add_request(f"s{i}", prompt, SamplingParams(max_tokens=3, ignore_eos=True), priority=2)
    engine.add_beam_search("beam", [5, 6, 7, 8], BeamSearchParams(width=4, max_tokens=3, ignore_eos=True), priority=0)
    _drain(engine)
    assert order[0] == "beam"  # its 4 beams fill max_num_seqs: the others wait for it
    assert_all_freed(engine)


def _preemptions(engine) -> list[tuple[str, list[str]]]:
    """Record each preempted request's id with the ids still running after its step; under the priority policy,
    check every queue is in (priority, arrival) order after each step."""
    seen, scheduler = [], engine.scheduler
    schedule = scheduler.schedule

    def traced():
        out = schedule()
        seen.extend((g.request_id, [r.request_id for r in scheduler.running]) for g in out.preempted)
        if scheduler.config.scheduling_policy == "priority":
            for queue in (scheduler.waiting, scheduler.swapped, scheduler.running):
                keys = [(g.priority, g.arrival_time) for g in queue]
                assert keys == sorted(keys)
        return out

    scheduler.schedule = traced
    return seen


def _lone(tiny_hf, prompt, params) -> list[list[int]]:
    roomy = make_engine(tiny_hf, num_blocks=256)
    return [c.token_ids for c in roomy.generate([prompt], params, use_tqdm=False)[0].outputs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_victim(tiny_hf, mode, policy):
    """Two requests outgrow a 12-block pool: priority preempts the less important first arrival, fcfs the later."""
    engine = make_engine(tiny_hf, num_blocks=12, num_cpu_blocks=64, preemption_mode=mode, scheduling_policy=policy)
    seen = _preemptions(engine)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    prompts = _prompts(2, 16)  # 4 blocks each, 8 at the end: both start, one must go
    engine.add_request("lo", prompts[0], params, priority=1)
    engine.add_request("hi", prompts[1], params, priority=0)
    done = _drain(engine)
    victims = {rid for rid, _ in seen}
    assert victims == ({"lo"} if policy == "priority" else {"hi"})
    assert engine.scheduler.num_preemptions[mode] > 0
    assert done == {rid: _lone(tiny_hf, p, params) for rid, p in zip(("lo", "hi"), prompts)}
    assert_all_freed(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priority_never_preempts_a_request_while_a_less_important_one_runs(tiny_hf, mode):
    """Mixed priorities, seeded sampling, n=2 groups, a tight pool: each victim is the least important running
    request (largest (priority, arrival)), and every request's tokens equal its lone run's."""
    engine = make_engine(tiny_hf, num_blocks=30, num_cpu_blocks=128, preemption_mode=mode, scheduling_policy="priority",
                         max_num_batched_tokens=32, max_num_seqs=8)  # fmt: skip
    seen = _preemptions(engine)
    priorities = [3, 0, 2, 1, 3, 0, 1, 2]
    prompts = _prompts(8, 14, seed=5)
    params = [SamplingParams(max_tokens=18, temperature=0.9, top_k=50, seed=i, n=1 + i % 2, ignore_eos=True)
              for i in range(8)]  # fmt: skip
    groups = [engine.add_request(f"r{i}", p, params[i], priority=priorities[i]) for i, p in enumerate(prompts)]
    key = {g.request_id: (g.priority, g.arrival_time) for g in groups}
    done = _drain(engine)
    assert engine.scheduler.num_preemptions[mode] >= 2
    for victim, running in seen:
        assert all(key[r] < key[victim] for r in running), (victim, running)
    assert done == {f"r{i}": _lone(tiny_hf, p, params[i]) for i, p in enumerate(prompts)}
    assert_all_freed(engine)


def _starts(engine) -> dict[tuple[str, str], tuple[int, bool]]:
    """Record each queued group's first start: (("admit" or "swap_in", its id)) -> (its step's number, whether a group
    was still swapped out after that step)."""
    events, scheduler, steps = {}, engine.scheduler, itertools.count()
    schedule = scheduler.schedule

    def traced():
        waiting, swapped, step = list(scheduler.waiting), list(scheduler.swapped), next(steps)
        out = schedule()
        for kind, queue in (("admit", waiting), ("swap_in", swapped)):
            for g in queue:
                if g in scheduler.running:
                    events.setdefault((kind, g.request_id), (step, bool(scheduler.swapped)))
        return out

    scheduler.schedule = traced
    return events


@pytest.mark.parametrize(("priority", "first"), [(-1, True), (0, True), (1, False), (2, False)])
def test_priority_admits_a_more_important_request_before_a_swapped_one(tiny_hf, priority, first):
    """Swap mode: "lo" is swapped out for "mid"; a request more important than "lo" that arrives then starts before
    "lo" is swapped back in (the pool cannot hold both yet); one as important or less waits for "lo" as under fcfs."""
    engine = make_engine(tiny_hf, num_blocks=12, num_cpu_blocks=64, preemption_mode="swap",
                         scheduling_policy="priority")  # fmt: skip
    events = _starts(engine)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    prompts = _prompts(3, 16, seed=7)
    prompts[2] = prompts[2][:8]  # 2 blocks
    lo = engine.add_request("lo", prompts[0], params, priority=1)
    engine.add_request("mid", prompts[1], params, priority=0)
    done = {}
    while not engine.scheduler.swapped:  # both grow until "lo", the less important, is swapped out
        done.update((o.request_id, [c.token_ids for c in o.outputs]) for o in engine.step())
    engine.add_request("new", prompts[2], params, priority=priority)
    done.update(_drain(engine))
    swap_in, _ = events["swap_in", "lo"]
    admit, lo_still_out = events["admit", "new"]
    if first:  # and "lo", next in the merged order, stayed out that step: the pool could not hold both
        assert admit < swap_in and lo_still_out, events
    else:  # "lo" first, as under fcfs ("new" may follow in the same step)
        assert swap_in <= admit, events
    assert lo.num_preemptions >= 1
    assert done == {rid: _lone(tiny_hf, p, params) for rid, p in zip(("lo", "mid", "new"), prompts)}
    assert_all_freed(engine)


def _check_merged_order(engine) -> list[int]:
    """Check after each step that every queued group that started (admitted or swapped in) is more important than
    every queued group left out; count the groups admitted while a group stayed swapped out."""
    admitted_past_swapped, scheduler = [0], engine.scheduler
    schedule = scheduler.schedule

    def traced():
        waiting, swapped = list(scheduler.waiting), list(scheduler.swapped)
        out = schedule()
        started = [_key(g) for g in waiting + swapped if g in scheduler.running]
        left = [_key(g) for g in waiting + swapped if g in scheduler.waiting or g in scheduler.swapped]
        assert not (started and left) or max(started) < min(left), (started, left)
        if scheduler.swapped:
            admitted_past_swapped[0] += sum(g in scheduler.running for g in waiting)
        return out

    scheduler.schedule = traced
    return admitted_past_swapped


def _key(group) -> tuple[int, float]:
    return group.priority, group.arrival_time


@pytest.mark.parametrize("seed", [1, 4, 5])
def test_priority_swap_mode_mixed_workload_starts_queued_groups_in_merged_order(tiny_hf, seed):
    """Seeded arrivals over the run, four priorities, n=2 groups, swap mode, a tight pool: no queued group is left
    out while a less important one starts; every output equals its lone run; every block is freed."""
    engine = make_engine(tiny_hf, num_blocks=24, num_cpu_blocks=128, preemption_mode="swap",
                         scheduling_policy="priority", max_num_batched_tokens=32, max_num_seqs=6)  # fmt: skip
    admitted_past_swapped = _check_merged_order(engine)
    g = torch.Generator().manual_seed(seed)
    num = 10
    priorities = torch.randint(0, 4, (num,), generator=g).tolist()
    arrive_at = sorted(torch.randint(0, 30, (num,), generator=g).tolist())
    prompts = [torch.randint(0, 256, (int(length),), generator=g).tolist()
               for length in torch.randint(6, 18, (num,), generator=g)]  # fmt: skip
    params = [SamplingParams(max_tokens=14, temperature=0.9, top_k=50, seed=seed * 100 + i, n=1 + i % 3 // 2,
                             ignore_eos=True) for i in range(num)]  # fmt: skip
    done, step = {}, 0
    while len(done) < num:
        for i in (i for i in range(num) if arrive_at[i] == step):
            engine.add_request(f"r{i}", prompts[i], params[i], priority=priorities[i])
        done.update((o.request_id, [c.token_ids for c in o.outputs]) for o in engine.step() if o.finished)
        step += 1
    assert engine.scheduler.num_preemptions["swap"] >= 1
    assert admitted_past_swapped[0] >= 1  # the case this checks happened
    assert done == {f"r{i}": _lone(tiny_hf, p, params[i]) for i, p in enumerate(prompts)}
    assert_all_freed(engine)


def test_priority_refuses_a_waiting_request_ahead_of_a_swapped_one_that_can_never_start(tiny_hf):
    """Swap mode: "lo" is swapped out for "mid"; "big", more important, waits for room, then a pin takes 5 of the
    12 blocks and its 8 never fit: once nothing runs it fails alone (not a stall) and "lo" resumes."""
    engine = make_engine(tiny_hf, num_blocks=12, num_cpu_blocks=64, preemption_mode="swap",
                         scheduling_policy="priority")  # fmt: skip
    system = _prompts(1, 20, seed=3)[0]  # 5 full blocks
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    engine.add_request("mid", system + [1, 2, 3, 4], greedy, priority=0)  # its first 5 blocks are the system's
    short = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)  # 6 blocks at most: fits beside the pin
    engine.add_request("lo", [5, 6, 7, 8, 9, 10, 11, 12], short, priority=1)
    outs = {}
    for _ in range(40):
        if engine.scheduler.swapped:
            break
        outs |= {o.request_id: o for o in engine.step()}
    assert engine.scheduler.swapped, "lo was never swapped out"
    engine.add_request("big", list(range(100, 130)), SamplingParams(max_tokens=2), priority=-1)  # 8 blocks
    engine.pin_prefix(system)  # held by "mid": the pin holds at once
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        outs |= {o.request_id: o for o in engine.step()}
    assert not engine.has_unfinished_requests()
    big, lo, mid = outs["big"], outs["lo"], outs["mid"]
    assert big.outputs[0].finish_reason == "error" and "'big' can never be scheduled" in big.error
    assert lo.error is None and mid.error is None
    assert lo.outputs[0].token_ids == _lone(tiny_hf, [5, 6, 7, 8, 9, 10, 11, 12], short)[0]
    assert mid.outputs[0].token_ids == _lone(tiny_hf, system + [1, 2, 3, 4], greedy)[0]
    assert engine.block_manager.num_pinned_blocks == 5
    engine.block_manager.check()


def _step_until(engine, done, bound: int) -> int:
    """Step until ``done()`` or ``bound`` steps (a livelock fails the test instead of hanging it); steps taken."""
    for steps in range(bound):
        if done():
            return steps
        engine.step()
    raise AssertionError(f"not done after {bound} steps")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("beside", [False, True])
def test_swap_mode_refuses_a_request_a_later_pin_leaves_no_room_to_grow(tiny_hf, policy, beside):
    """Swap mode: a pin taken after "grow" was queued leaves it 7 of the 12 blocks and it needs 8. Once no other
    running request holds blocks (``beside``: "next" ran beside it and was swapped out for it) it fails alone with
    its reason within a few steps, instead of swapping itself out and back in forever; "next" is served."""
    engine = make_engine(tiny_hf, num_blocks=12, num_cpu_blocks=64, preemption_mode="swap", scheduling_policy=policy)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)  # 32 tokens: 8 blocks
    engine.add_request("grow", [5, 6, 7, 8, 9, 10, 11, 12], greedy)
    engine.pin_prefix(_prompts(1, 20, seed=3)[0])  # 5 blocks, computed by a warm-up request, then held
    short = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    grow = engine.scheduler.requests["grow"]
    if not beside:  # "next" arrives when the pool is full: it waits behind "grow", running alone
        _step_until(engine, lambda: grow.seqs[0].num_tokens >= 25, bound=40)
        assert not engine.scheduler.waiting and [g.request_id for g in engine.scheduler.running] == ["grow"]
    engine.add_request("next", [20, 21, 22, 23, 24, 25], short)
    seen = _preemptions(engine)
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        assert steps < 40, f"livelock: {engine.scheduler.num_preemptions}"
        outs |= {o.request_id: o for o in engine.step()}
        steps += 1
    failed = outs["grow"]
    assert failed.outputs[0].finish_reason == "error"
    assert "'grow' can never be scheduled" in failed.error and "less the 5 held by pinned prefixes" in failed.error
    assert outs["next"].error is None
    assert outs["next"].outputs[0].token_ids == _lone(tiny_hf, [20, 21, 22, 23, 24, 25], short)[0]
    assert {victim for victim, _ in seen} <= {"next"}  # "grow" never swapped itself out
    assert engine.scheduler.num_preemptions["swap"] == len(seen) <= 2 * beside
    assert engine.block_manager.num_pinned_blocks == 5
    assert engine.block_manager.gpu.num_used == 5  # every block freed but the pin's
    engine.block_manager.check()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_swap_mode_still_swaps_out_a_request_that_preempts_itself_while_others_hold_blocks(tiny_hf, policy):
    """A request that must preempt itself because others running hold the pool is swapped out (they will free it),
    not refused: every request ends with its lone run's tokens."""
    engine = make_engine(tiny_hf, num_blocks=30, num_cpu_blocks=128, preemption_mode="swap", scheduling_policy=policy,
                         max_num_batched_tokens=32, max_num_seqs=8)  # fmt: skip
    scheduler, selves, making_room = engine.scheduler, [], []
    make_room, preempt = scheduler._make_room, scheduler._preempt

    def traced_make_room(group, plan, step):
        making_room.append(group)
        try:
            return make_room(group, plan, step)
        finally:
            making_room.pop()

    def traced(group, step):
        if making_room and group is making_room[-1]:  # a self-preemption: count the others holding blocks
            selves.append(sum(1 for g in scheduler.running if g is not group and g.active()))
        preempt(group, step)

    scheduler._make_room = traced_make_room
    scheduler._preempt = traced
    prompts = _prompts(8, 14, seed=5)
    params = [SamplingParams(max_tokens=18, temperature=0.9, top_k=50, seed=i, n=1 + i % 2, ignore_eos=True)
              for i in range(8)]  # fmt: skip
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params[i], priority=[3, 0, 2, 1, 3, 0, 1, 2][i])
    done = _drain(engine)
    assert selves and all(selves)  # it preempted itself, others holding blocks
    assert scheduler.num_preemptions["swap"] >= len(selves) and scheduler.num_preemptions["recompute"] == 0
    assert done == {f"r{i}": _lone(tiny_hf, p, params[i]) for i, p in enumerate(prompts)}
    assert_all_freed(engine)

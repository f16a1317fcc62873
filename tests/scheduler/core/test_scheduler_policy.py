"""Scheduler policy through the engine: budgets, decode first, FCFS without starvation, preemption, cleanup."""

from __future__ import annotations

import pytest
import torch
from sched_helpers import assert_all_freed, make_engine

from scheduler import SamplingParams


def _prompts(num: int, seed: int = 3, low: int = 1, high: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (num,), generator=g).tolist()
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _trace(engine) -> list[list[tuple]]:
    """Record every step as (request_id, start, num_tokens, num_tokens_total, prompt_len) items, in order."""
    steps = []
    schedule = engine.scheduler.schedule

    def traced():
        out = schedule()
        items = [(s.group.request_id, s.start, s.num_tokens, s.seq.num_tokens, s.seq.prompt_len) for s in out.scheduled]
        steps.append(items)
        return out

    engine.scheduler.schedule = traced
    return steps


def _run(engine, prompts, params) -> dict[str, list[list[int]]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = [c.token_ids for c in out.outputs]
    return done


def test_token_and_sequence_budgets_hold_every_step(tiny_hf):
    engine = make_engine(tiny_hf, max_num_batched_tokens=16, max_num_seqs=4)
    steps = _trace(engine)
    done = _run(engine, _prompts(12), SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(done) == 12
    assert all(sum(n for _, _, n, _, _ in step) <= 16 and len(step) <= 4 for step in steps)
    assert max(sum(n for _, _, n, _, _ in step) for step in steps) == 16  # the budget is actually filled
    assert any(start + n < total for step in steps for _, start, n, total, _ in step)  # chunked prefill


def test_decode_runs_before_prefill_and_every_step(tiny_hf):
    engine = make_engine(tiny_hf, max_num_batched_tokens=20, max_num_seqs=6)
    steps = _trace(engine)
    _run(engine, _prompts(10, high=50), SamplingParams(max_tokens=8, ignore_eos=True))
    mixed = 0
    for step in steps:
        kinds = [start >= prompt_len for _, start, _, _, prompt_len in step]  # True: a decode token
        assert kinds == sorted(kinds, reverse=True), "a prefill chunk was scheduled before a decode"
        mixed += any(kinds) and not all(kinds)
    assert mixed > 0
    # once a request decodes it is in every step until it finishes (no preemption with this pool)
    for rid in {item[0] for step in steps for item in step}:
        seen = [i for i, step in enumerate(steps) if any(item[0] == rid and item[1] >= item[4] for item in step)]
        assert seen == list(range(seen[0], seen[0] + len(seen)))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_fcfs_no_starvation_under_pressure(tiny_hf, mode):
    """A pool far too small for the load: every request still finishes, admitted in arrival order."""
    engine = make_engine(tiny_hf, num_blocks=24, num_cpu_blocks=64, preemption_mode=mode,
                         max_num_batched_tokens=32, max_num_seqs=8)  # fmt: skip
    done = _run(engine, _prompts(16, high=40), SamplingParams(max_tokens=20, ignore_eos=True))
    assert sorted(done) == sorted(f"r{i}" for i in range(16))
    assert all(len(outs[0]) == 20 for outs in done.values())
    assert engine.scheduler.num_preemptions[mode] > 0
    assert engine.block_manager.stats().num_used == 0


def test_fcfs_admission_order(tiny_hf):
    engine = make_engine(tiny_hf, num_blocks=40, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = _prompts(10, high=30)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4, ignore_eos=True))
    groups = list(engine.scheduler.waiting)
    while engine.has_unfinished_requests():
        engine.step()
    first = [g.first_scheduled_time for g in groups]
    assert first == sorted(first)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_leaves_outputs_unchanged(tiny_hf, mode):
    """Seeded random sampling, n=2 groups included: a tiny pool gives the same tokens as a roomy one."""
    prompts = _prompts(8, seed=5, high=40)
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=i, n=1 + i % 2, ignore_eos=True)
              for i in range(8)]  # fmt: skip
    roomy = make_engine(tiny_hf, num_blocks=512, max_num_batched_tokens=32, max_num_seqs=8)
    tight = make_engine(tiny_hf, num_blocks=28, num_cpu_blocks=64, preemption_mode=mode,
                        max_num_batched_tokens=32, max_num_seqs=8)  # fmt: skip
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert tight.scheduler.num_preemptions[mode] >= 3
    assert roomy.scheduler.num_preemptions == {"recompute": 0, "swap": 0}


def test_abort_frees_blocks_of_running_waiting_and_swapped(tiny_hf):
    engine = make_engine(tiny_hf, num_blocks=24, num_cpu_blocks=64, preemption_mode="swap",
                         max_num_batched_tokens=32, max_num_seqs=8)  # fmt: skip
    for i, p in enumerate(_prompts(8, high=40)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, ignore_eos=True))
    while not engine.scheduler.swapped:
        engine.step()
    bm = engine.block_manager
    for queue in (engine.scheduler.running, engine.scheduler.swapped, engine.scheduler.waiting):
        group = queue[-1]
        ids = [s.seq_id for s in group.seqs]
        out = engine.abort(group.request_id)
        assert out.finished and all(c.finish_reason == "abort" for c in out.outputs)
        assert not any(i in bm for i in ids)
        bm.check()
    while engine.has_unfinished_requests():
        engine.step()
    assert bm.stats().num_used == 0 and bm.cpu.num_used == 0


def test_every_block_free_or_cached_after_all_requests(tiny_hf):
    engine = make_engine(tiny_hf, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=8)
    prompts = [list(range(30)) + p for p in _prompts(6, high=20)]  # a shared prefix leaves cached blocks
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=0), use_tqdm=False)
    assert all(len(o.outputs) == 2 for o in outs)
    stats = engine.block_manager.stats()
    assert stats.num_used == 0 and stats.num_sequences == 0
    assert stats.num_free == stats.num_blocks and stats.num_evictable == stats.num_cached > 0
    engine.block_manager.check()


def _schedule_trace(engine) -> list[tuple]:
    """Every step as (scheduled items, copies, swap_out, swap_in, preempted request ids), recorded in order."""
    steps = []
    schedule = engine.scheduler.schedule

    def traced():
        out = schedule()
        items = tuple((s.group.request_id, s.seq.seq_id, s.start, s.num_tokens) for s in out.scheduled)
        steps.append((items, tuple(out.copies), tuple(out.swap_out), tuple(out.swap_in),
                      tuple(g.request_id for g in out.preempted)))  # fmt: skip
        return out

    engine.scheduler.schedule = traced
    return steps


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_decode_groups_committed_at_once_make_the_same_steps_as_one_by_one(tiny_hf, mode, monkeypatch):
    """One ``append_all`` for the decode groups: same steps, copies, preemptions and tokens as per-group appends."""
    prompts = _prompts(10, seed=7, high=40)
    params = [SamplingParams(max_tokens=14, temperature=0.8, seed=i, n=1 + i % 2, ignore_eos=True) for i in range(10)]
    runs = []
    for batched in (True, False):
        engine = make_engine(tiny_hf, num_blocks=32, num_cpu_blocks=64, preemption_mode=mode,
                             max_num_batched_tokens=32, max_num_seqs=8)  # fmt: skip
        calls = []
        append_all = engine.block_manager.append_all
        engine.block_manager.append_all = lambda reqs, **kw: calls.append(len(reqs)) or append_all(reqs, **kw)
        if not batched:
            monkeypatch.setattr(engine.scheduler, "_commit_all", lambda groups, step: False)
        steps = _schedule_trace(engine)
        outs = [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params, use_tqdm=False)]
        runs.append((steps, outs, dict(engine.scheduler.num_preemptions)))
        assert bool(calls) == batched and (not batched or max(calls) > 1)
    assert runs[0] == runs[1]
    assert runs[0][2][mode] > 0  # the tight pool did preempt: the fall-back path ran too


def test_swap_preemption_moves_each_shared_block_of_a_group_once(tiny_hf):
    """n = 4 samples share their prompt's blocks: swapped out and in as a group, they move and hold each once."""
    prompts = _prompts(6, seed=11, low=20, high=40)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=0, n=4, ignore_eos=True)
    roomy = make_engine(tiny_hf, num_blocks=512, max_num_batched_tokens=64, max_num_seqs=16)
    tight = make_engine(tiny_hf, num_blocks=56, num_cpu_blocks=256, preemption_mode="swap",
                        max_num_batched_tokens=64, max_num_seqs=16)  # fmt: skip
    bm, held, moved = tight.block_manager, {}, []
    swap_out, swap_in = bm.swap_out, bm.swap_in
    distinct_held = lambda ids: len({b for i in ids for b in bm.block_table(i)})  # noqa: E731

    def out(ids):
        held[tuple(ids)] = distinct_held(ids)
        moved.append((held[tuple(ids)], sum(len(bm.block_table(i)) for i in ids)))
        copies = swap_out(ids)
        assert len(copies) == held[tuple(ids)]
        return copies

    def back(ids):
        copies = swap_in(ids)
        assert len(copies) == distinct_held(ids) == held[tuple(ids)]
        return copies

    bm.swap_out, bm.swap_in = out, back
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    assert [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)] == expected
    assert tight.scheduler.num_preemptions["swap"] >= 2
    assert any(distinct < entries for distinct, entries in moved)  # shared blocks were counted and moved once


def test_each_block_of_a_request_is_hashed_once(tiny_hf, prompts, monkeypatch):
    """A request's block hashes are computed once and kept on it: admission, chunked allocation, decode appends
    and a re-admission after recompute preemption hash no block twice."""
    import paged_kv.block_hash as block_hash

    engine = make_engine(tiny_hf, num_blocks=40, max_num_batched_tokens=16, max_num_seqs=4)  # chunked prefill
    calls, real = [], block_hash.sha256
    monkeypatch.setattr(block_hash, "sha256", lambda data=b"": calls.append(1) or real(data))
    block_hash._root_cached.cache_clear()
    params = SamplingParams(max_tokens=8, ignore_eos=True, cache_salt="hashed-once")
    chosen = [prompts[2], prompts[6], prompts[3]]  # 33, 64 and 63 tokens: more than the pool holds at once
    for i, p in enumerate(chosen):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions["recompute"] > 0
    computed_blocks = sum((len(p) + 8 - 1) // 4 for p in chosen)  # a sample's last token is never computed
    assert len(calls) == computed_blocks + 1  # every full block once, and the salt's root once


def _stop_run(engine, request_id: str, pick) -> dict[str, list[tuple]]:
    """Step to the end, calling ``stop_samples(request_id, [i])`` once, after the first step where
    ``pick(group, step)`` gives an index ``i``; (index, finish reason, output length) per sample of every request."""
    done, step, stopped = {}, 0, False
    while engine.has_unfinished_requests() and step < 300:
        step += 1
        for out in engine.step():
            done[out.request_id] = [(c.index, c.finish_reason, len(c.token_ids)) for c in out.outputs]
        group = engine.scheduler.requests.get(request_id)
        index = pick(group, step) if group is not None and not stopped else None
        if index is not None:
            engine.stop_samples(request_id, [index])
            stopped = True
    assert stopped and not engine.has_unfinished_requests(), "a request never finished"
    assert_all_freed(engine)
    return done


def test_a_request_whose_samples_all_stopped_is_never_chosen_for_preemption(tiny_hf):
    """All samples of "b" stopped between steps: the next step's preemption takes a group holding blocks (it
    used to preempt "b", holding none, and crash the step, aborting every request)."""
    engine = make_engine(tiny_hf, num_blocks=14, prefix=False, max_num_batched_tokens=24, max_num_seqs=4)
    prompts = _prompts(3, seed=5, low=16, high=17)
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("b", prompts[1][:1], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("c", (prompts[2] * 3)[:40], SamplingParams(max_tokens=4, ignore_eos=True))
    done = _stop_run(engine, "b", lambda group, step: 0 if step == 2 else None)
    assert done == {"a": [(0, "length", 12)], "b": [(0, "stop", 2)], "c": [(0, "length", 4)]}
    assert engine.scheduler.num_preemptions["recompute"] > 0

@pytest.mark.parametrize(("which", "queue"), [("parked", "waiting"), ("recomputing", "waiting"),
                                              ("recomputing", "running")])
def test_stopping_a_sample_of_a_group_waiting_for_recompute(tiny_hf, which, queue):
    """n = 2 samples preempted for recompute (one recomputes the shared prefix, the other is parked on it): a
    stopped sample stays stopped and its sibling runs to the end (a parked one used to come back and run on; the
    one recomputing left its sibling parked forever)."""
    engine = make_engine(tiny_hf, num_blocks=20, prefix=False, max_num_batched_tokens=8, max_num_seqs=8)
    prompts = _prompts(2, seed=1, low=20, high=21)
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=20, n=2, temperature=1.0, seed=1, ignore_eos=True))
    stopped = []

    def pick(group, step):
        if not group.parked or (group in engine.scheduler.waiting) != (queue == "waiting"):
            return None
        stopped.append((group.parked if which == "parked" else group.active())[0].index)
        return stopped[0]

    done = _stop_run(engine, "b", pick)
    other = 1 - stopped[0]
    assert done["b"][stopped[0]][1] == "stop" and done["b"][other] == (other, "length", 20)


def test_a_group_recomputed_without_chunked_prefill_fits_the_budget_of_one_sample(tiny_hf):
    """Without chunked prefill, an n=2 request of a one-token prompt (its samples share no whole block) preempted for
    recompute needs only one sample's tokens per step, as admitted: it is not refused as never fitting (found by
    tests/scheduler/engine/test_engine_properties.py), and every request gives its lone tokens."""
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=9),
              SamplingParams(max_tokens=7, n=2, temperature=1.0, seed=0)]  # fmt: skip
    config = dict(num_blocks=12, block_size=2, prefix=False, max_num_batched_tokens=9, max_num_seqs=3,
                  enable_chunked_prefill=False)  # fmt: skip
    engine = make_engine(tiny_hf, **config)
    outs = engine.generate([[0]] * 3, params, use_tqdm=False)
    assert engine.scheduler.num_preemptions["recompute"] > 0
    assert [o.error for o in outs] == [None] * 3
    lone = [make_engine(tiny_hf, block_size=2).generate([[0]], p, use_tqdm=False)[0] for p in params]
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in lone]
    assert_all_freed(engine)

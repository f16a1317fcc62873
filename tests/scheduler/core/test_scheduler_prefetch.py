"""The scheduler with a lower tier's reads in flight: passed over in place, waited for only when idle."""

from __future__ import annotations

from sched_helpers import assert_all_freed, make_engine

from scheduler import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class SlowReads:
    """A ``Prefetcher`` whose reads of the sequences in ``slow`` take ``polls`` non-waiting calls to land."""

    def __init__(self, slow: set[int], polls: int) -> None:
        self.left = dict.fromkeys(slow, polls)
        self.waited: list[int] = []
        self.forgotten: list[int] = []

    def prefetch(self, key, token_ids, hashes, cache_salt, *, wait=False) -> bool:
        if wait and self.left.get(key, 0) > 0:
            self.waited.append(key)
            self.left[key] = 0
        self.left[key] = max(0, self.left.get(key, 0) - 1)
        return self.left[key] == 0 and key not in self.forgotten

    def forget(self, key) -> None:
        self.forgotten.append(key)


def admissions(engine, prompts: list[list[int]]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Run the prompts (added in order): the step each request was first scheduled in, and its tokens."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    first, done, step = {}, {}, 0
    while engine.has_unfinished_requests():
        for group in engine.scheduler.running:
            first.setdefault(group.request_id, step)
        outs = engine.step()
        for group in engine.scheduler.running:
            first.setdefault(group.request_id, step)
        for out in outs:
            first.setdefault(out.request_id, step)
            done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return first, done


PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25]]


def test_a_request_whose_read_is_in_flight_keeps_its_place_while_later_ones_run(tiny_hf):
    _, base = admissions(make_engine(tiny_hf), PROMPTS)
    engine = make_engine(tiny_hf)
    seq_of_r0 = 0  # sequence ids count from 0 in arrival order
    engine.scheduler.prefetch = reads = SlowReads({seq_of_r0}, polls=3)
    first, done = admissions(engine, PROMPTS)
    assert first["r1"] == first["r2"] == 0 < first["r0"]  # passed over, not blocking those behind it
    assert done == base and reads.waited == []  # something else ran each step: nothing waited
    assert_all_freed(engine)


def test_with_nothing_else_to_run_the_scheduler_waits_for_the_first_read(tiny_hf):
    engine = make_engine(tiny_hf)
    engine.scheduler.prefetch = reads = SlowReads({0, 1}, polls=100)
    first, done = admissions(engine, PROMPTS[:2])
    assert reads.waited == [0, 1] and first == {"r0": 0, "r1": 4}  # r1 waited for only once r0 had finished
    assert len(done) == 2
    assert_all_freed(engine)


def test_an_aborted_request_forgets_its_read(tiny_hf):
    engine = make_engine(tiny_hf)
    engine.scheduler.prefetch = reads = SlowReads({1}, polls=100)
    engine.add_request("r0", PROMPTS[0], GREEDY)
    engine.add_request("r1", PROMPTS[1], GREEDY)
    engine.step()
    assert [g.request_id for g in engine.scheduler.waiting] == ["r1"]
    engine.abort("r1")
    assert reads.forgotten == [1]
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_freed(engine)

"""Property test of the whole engine: random interleavings of requests (greedy, seeded, n > 1, beam searches),
aborts, pins and unpins of prefixes the requests share, prefix-cache resets and steps under random small configs.

Every request that finishes gives what it gives alone on a fresh engine with a big pool (pins change no token);
a live or aborted request's tokens so far are a prefix of that; an aborted beam search ends every output
(hypotheses so far included, ``width`` at most) with "abort"; an aborted id never comes back; every
request ends; nothing leaks (once every pin is released, no block is referenced); every step keeps to its
budgets and the block manager's invariants hold after it; the engine refuses (at admission) exactly the
requests whose samples could never fit beside the pinned blocks they do not share.

A request fails later ("error") only when the scheduler refuses it (``SchedulerOutput.refused``) as one that
can never fit: pins taken after its arrival hold the rest of the pool. The rule (``Scheduler._make_room``,
``_alone``, ``_never_grows``, ``_refuse_head``): a running group that must preempt itself while no other running
group holds device blocks and whose tokens cannot shrink (swap mode, one active sequence, or a restart alone from
these very tokens already done), or the first waiting group when nothing runs and it cannot start. The test
checks what that rule implies whatever the group: as it is refused no other request holds a device block, and
its active sequences' tokens, each sequence in blocks of its own, take more blocks than the pins leave (less
the watermark for a waiting group). A refused request's samples so far are still a prefix of its lone ones.
"""

from __future__ import annotations

import pytest
from fuzz_helpers import CONTEXTS, Beam, Config, LoneResults, Request, beam_params, configs, operations, sampling
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sched_helpers import after_each_schedule, tiny_llama

from paged_kv.errors import InvalidArgumentError, UnknownSequenceError
from scheduler.engine.pinned_prefixes import WARMUP_PREFIX

MAX_STEPS = 2000  # a drain that takes longer is a livelock (the longest workload needs a few hundred)


@pytest.fixture(scope="module")
def models(tiny_hf) -> dict[int, object]:
    """The tiny Llama by context: its own, and a copy of its weights with a short one."""
    return {c: tiny_hf if c == tiny_hf.config.max_position_embeddings else tiny_llama(max_position_embeddings=c)
            for c in CONTEXTS}  # fmt: skip


@pytest.fixture(scope="module")
def lone(models) -> LoneResults:
    """The lone results, shared by every example of the module."""
    return LoneResults(models)


def never_fits(cfg: Config, prompt_len: int, max_tokens: int, n: int, beam: bool, pinned: int = 0) -> bool:
    """Whether a request can never run to its end on ``cfg``'s engine: a prompt past the context (a beam search's
    beams past it), or ``n`` samples, each as long as ``max_tokens`` and the context make it, that exceed the
    step budget without chunked prefill (a recompute computes all but the last token at once) or the pool
    (above its watermark, less the ``pinned`` blocks pins hold that it does not share, sharing nothing)."""
    if prompt_len > cfg.context or (beam and prompt_len + max_tokens > cfg.context):
        return True
    kv = prompt_len + min(max_tokens, max(cfg.context - prompt_len, 1)) - 1
    usable = cfg.num_blocks - int(cfg.watermark * cfg.num_blocks) - pinned
    too_long = not cfg.chunked and kv > cfg.budget
    return too_long or n > cfg.max_seqs or n * -(-kv // cfg.block_size) > usable


class Run:
    """One engine driven through a workload, checking the properties as it goes."""

    def __init__(self, cfg: Config, engine, lone: LoneResults) -> None:
        self.cfg, self.engine, self.lone = cfg, engine, lone
        self.live: dict[str, tuple] = {}  # id -> (Request, its params) or (Beam, None)
        self.ended: set[str] = set()
        self.ids = 0
        self.pins: list[str] = []  # pins not released
        self.dropped: set[str] = set()  # pins whose warm-up was refused: dropped by the engine (pinned_prefixes)
        self.refused: set[str] = set()  # ids the last step refused
        refuse = engine.scheduler._refuse

        def within_budgets(out):  # every step keeps to its token and sequence budgets
            assert out.num_batched_tokens <= cfg.budget and len(out.scheduled) <= cfg.max_seqs
            self.refused = {group.request_id for group, _ in out.refused}

        def never_fitting(group, step, what):  # the scheduler refuses only what can never fit
            self.check_refusal(group)
            if group.request_id.startswith(WARMUP_PREFIX):
                self.dropped.add(group.request_id)  # a warm-up's id is its pin's
            refuse(group, step, what)

        after_each_schedule(engine, within_budgets)
        engine.scheduler._refuse = never_fitting

    def add(self, req: Request | Beam) -> None:
        """Add a request or a beam search under a new id: refused (InvalidArgumentError) iff it can never fit."""
        rid, self.ids = f"r{self.ids}", self.ids + 1
        beam = isinstance(req, Beam)
        n = req.width if beam else req.n
        pinned = self.engine.block_manager.num_pinned_blocks_apart(list(req.prompt), cache_salt=req.salt)
        expect_refusal = never_fits(self.cfg, len(req.prompt), req.max_tokens, n, beam, pinned)
        params = None if beam else sampling(req) if expect_refusal else self.lone.params(self.cfg, req)
        try:
            if beam:
                self.engine.add_beam_search(rid, list(req.prompt), beam_params(req), priority=req.priority)
            else:
                self.engine.add_request(rid, list(req.prompt), params, priority=req.priority)
        except InvalidArgumentError:
            assert expect_refusal, f"{req} refused though it fits"
            return
        assert not expect_refusal, f"{req} admitted though it can never fit"
        self.live[rid] = (req, params)

    def check_refusal(self, group) -> None:
        """A group the scheduler is about to refuse can never fit: no other request holds a device block (the pool
        is as free as it gets), and its active sequences' tokens, each sequence in blocks of its own, take more
        blocks than the pins leave (above the watermark if it waits: a running group's appends may use it)."""
        bm, cfg, sched = self.engine.block_manager, self.cfg, self.engine.scheduler
        mine = {s.seq_id for s in group.seqs}
        others = [i for i in bm.seq_ids() if i not in mine and not bm.is_swapped(i)]
        assert not others, f"{group.request_id} refused while sequences {others} hold device blocks"
        blocks = sum(-(-s.num_tokens // cfg.block_size) for s in group.active())
        left = cfg.num_blocks - bm.num_pinned_blocks
        if group in sched.waiting:
            left -= int(cfg.watermark * cfg.num_blocks)
        assert blocks > left, f"{group.request_id} refused though its {blocks} blocks fit the {left} pins leave"

    def step(self) -> None:
        """One step: what it returns ended normally or was refused as never fitting, was live, and gives its lone
        result (a refused one a prefix of it); then the live checks."""
        for out in self.engine.step():
            assert out.request_id in self.live, f"{out.request_id} returned after it ended"
            req, params = self.live.pop(out.request_id)
            self.ended.add(out.request_id)
            assert out.finished
            if out.error is None:
                self.check_finished(out, req, params)
            else:
                assert out.request_id in self.refused, out.error
                self.check_cut_short(out, req, params, "error")
        self.check_live()

    def check_finished(self, out, req, params) -> None:
        """A finished request's samples (tokens, finish reasons) or hypotheses are those of its lone run."""
        if isinstance(req, Beam):
            ref = self.lone.beams(self.cfg, req)
            assert [c.token_ids for c in out.outputs] == [ids for ids, _ in ref]
            assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([lp for _, lp in ref], abs=1e-4)
            return
        ref = self.lone.samples(self.cfg, req.prompt, params)
        assert [(c.token_ids, c.finish_reason) for c in out.outputs] == ref

    def check_prefixes(self, out, req, params, ended_reason: str | None = None) -> None:
        """Each sample's tokens so far are a prefix of its lone tokens; unfinished ones end with ``ended_reason``."""
        ref = self.lone.samples(self.cfg, req.prompt, params)
        for c, (tokens, reason) in zip(out.outputs, ref, strict=True):
            assert c.token_ids == tokens[: len(c.token_ids)]
            assert c.finish_reason in (ended_reason, reason if c.token_ids == tokens else ended_reason)

    def check_cut_short(self, out, req, params, reason: str) -> None:
        """An aborted or refused request: its samples so far are a prefix of its lone ones, each unfinished one
        ending with ``reason``; a beam search's outputs (hypotheses so far, then live beams: ``width`` at most,
        ranked) all end with ``reason``, none past ``max_tokens`` (nothing else is certain: a hypothesis so far
        may be displaced later, a live beam end up in none)."""
        if isinstance(req, Request):
            self.check_prefixes(out, req, params, reason)
            return
        assert 1 <= len(out.outputs) <= req.width
        assert [c.index for c in out.outputs] == list(range(len(out.outputs)))
        assert all(c.finish_reason == reason and len(c.token_ids) <= req.max_tokens for c in out.outputs)

    def check_live(self) -> None:
        """The engine holds exactly the live ids (and pins' warm-ups); their samples so far agree with the lone
        runs."""
        assert {r for r in self.engine.scheduler.requests if not r.startswith(WARMUP_PREFIX)} == set(self.live)
        for rid, (req, params) in self.live.items():
            if isinstance(req, Request):
                self.check_prefixes(self.engine.request_output(rid), req, params)
        self.engine.block_manager.check()

    def abort(self, pick: int) -> None:
        """Abort an ended id (refused, nothing changes) if ``pick`` is odd and one exists, else a live one (what it
        had is a prefix of its lone result, its unfinished samples end with "abort")."""
        if pick % 2 and self.ended:
            rid = sorted(self.ended)[pick // 2 % len(self.ended)]
            before = self.engine.block_manager.stats()
            with pytest.raises(UnknownSequenceError):
                self.engine.abort(rid)
            assert self.engine.block_manager.stats() == before
            return
        if not self.live:
            return
        rid = sorted(self.live)[pick // 2 % len(self.live)]
        req, params = self.live.pop(rid)
        out = self.engine.abort(rid)
        self.ended.add(rid)
        self.check_cut_short(out, req, params, "abort")
        self.check_live()

    def pin(self, prompt: tuple[int, ...], salt: str | None) -> None:
        """Pin a prompt: refused (InvalidArgumentError) if shorter than a block, or if its warm-up request can
        never fit; nothing then held or queued."""
        bm = self.engine.block_manager
        held, queued = bm.pinned, set(self.engine.scheduler.requests)
        try:
            self.pins.append(self.engine.pin_prefix(list(prompt), cache_salt=salt))
        except InvalidArgumentError:
            pinned = bm.num_pinned_blocks_apart(list(prompt), cache_salt=salt)
            assert len(prompt) < self.cfg.block_size or never_fits(self.cfg, len(prompt), 1, 1, False, pinned)
            assert bm.pinned == held and set(self.engine.scheduler.requests) == queued
        self.check_live()

    def unpin(self, pick: int) -> None:
        """Release a pin not released yet (its blocks evictable again); a second release is refused, as is the
        release of a pin the engine dropped (its warm-up was refused as never fitting)."""
        if not self.pins:
            return
        pin_id = self.pins.pop(pick % len(self.pins))
        if pin_id in self.dropped:
            assert pin_id not in self.engine.block_manager.pinned and not self.engine.pins.is_waiting(pin_id)
        else:
            self.engine.unpin(pin_id)
        assert pin_id not in self.engine.block_manager.pinned
        with pytest.raises(UnknownSequenceError):
            self.engine.unpin(pin_id)
        self.check_live()

    def drain(self) -> None:
        """Step until the engine is idle; MAX_STEPS steps or more is a livelock."""
        for _ in range(MAX_STEPS):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        assert not self.engine.has_unfinished_requests(), f"livelock: {sorted(self.live)} never finish"
        assert not self.live

    def check_nothing_held(self) -> None:
        """Once every pin is released, every block is free (cached ones with no reference): on the device, in swap
        space, in the host tier."""
        bm = self.engine.block_manager
        assert bm.stats().num_used == bm.num_pinned_blocks  # only the pins hold blocks once idle
        while self.pins:
            self.unpin(0)
        assert not bm.pinned
        stats = bm.stats()
        assert stats.num_used == 0 and stats.num_sequences == 0 and stats.num_cpu_used == 0
        assert not any(bm.gpu.ref_counts) and not any(bm.cpu.ref_counts)
        assert bm.gpu.num_free == bm.gpu.num_blocks
        assert bm.host is None or not any(bm.host.pool.ref_counts)  # no host block pinned for a store or a load
        bm.check()


def greedy(prompt: tuple[int, ...], max_tokens: int) -> Request:
    """A plain greedy request (for the explicit examples)."""
    return Request(prompt, max_tokens, n=1, seed=None, stop_pick=None, salt=None, priority=0)


@settings(max_examples=200, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(cfg=configs(), ops=st.lists(operations, min_size=2, max_size=30))
@example(  # diverged samples recomputed without chunked prefill (test_scheduler_policy)
    cfg=Config(context=512, block_size=2, num_blocks=12, watermark=0.0, budget=9, max_seqs=3, chunked=False,
               prefix=False, mode="recompute", num_cpu_blocks=0, policy="fcfs", host_blocks=0, host_store="evict"),
    ops=[("add", [greedy((0,), 2), greedy((0,), 9), Request((0,), 7, n=2, seed=0, stop_pick=None, salt=None,
                                                              priority=0)])],
)
@example(  # a pin shorter than a block (refused); a pin's warm-up refused once another pin holds its room (dropped)
    cfg=Config(context=512, block_size=2, num_blocks=12, watermark=0.25, budget=11, max_seqs=2, chunked=False,
               prefix=True, mode="recompute", num_cpu_blocks=0, policy="fcfs", host_blocks=0, host_store="evict"),
    ops=[("pin", ((7,), None)), ("pin", ((7, 1, 9, 3, 5, 11, 2, 8), None)),
         ("pin", ((7, 1, 9, 3, 5, 11, 2, 8, 4, 6, 10), "s"))],
)
def test_random_workloads_give_lone_results_end_and_free_everything(lone, cfg, ops):
    """Random adds, beam searches, aborts and steps on a random small engine: see the module docstring."""
    run_workload(lone, cfg, ops)


def run_workload(lone: LoneResults, cfg: Config, ops: list[tuple]) -> Run:
    """Apply ``ops`` to a fresh engine of ``cfg``, drain it, and check that it holds nothing."""
    run = Run(cfg, cfg.engine(lone.models[cfg.context]), lone)
    for op, arg in ops:
        if op == "add":
            for req in arg:
                run.add(req)
        elif op == "abort":
            run.abort(arg)
        elif op == "pin":
            run.pin(*arg)
        elif op == "unpin":
            run.unpin(arg)
        elif op == "reset":
            run.engine.reset_prefix_cache()
            run.check_live()
        else:
            for _ in range(arg):
                run.step()
    run.drain()
    run.check_nothing_held()
    return run

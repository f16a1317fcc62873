"""Property test of the whole engine: random interleavings of requests (greedy, seeded, n > 1, beam searches),
aborts and steps under random small configs.

Every request that finishes gives what it gives alone on a fresh engine with a big pool; a live or
aborted request's tokens so far are a prefix of that; an aborted id never comes back; every
request ends; nothing leaks; every step keeps to its budgets and the block manager's invariants
hold after it; the engine refuses (at admission) exactly the requests whose samples could never
fit, and fails none ("error") later.
"""

from __future__ import annotations

import pytest
from fuzz_helpers import CONTEXTS, Beam, Config, LoneResults, Request, beam_params, configs, operations, sampling
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sched_helpers import tiny_llama

from paged_kv.errors import InvalidArgumentError, UnknownSequenceError

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


def never_fits(cfg: Config, prompt_len: int, max_tokens: int, n: int, beam: bool) -> bool:
    """Whether a request can never run to its end on ``cfg``'s engine: a prompt past the context (a beam search's
    beams past it), or ``n`` samples, each as long as ``max_tokens`` and the context make it, that exceed the
    step budget without chunked prefill (a recompute computes all but the last token at once) or the pool
    (above its watermark, sharing nothing)."""
    if prompt_len > cfg.context or (beam and prompt_len + max_tokens > cfg.context):
        return True
    kv = prompt_len + min(max_tokens, max(cfg.context - prompt_len, 1)) - 1
    usable = cfg.num_blocks - int(cfg.watermark * cfg.num_blocks)
    too_long = not cfg.chunked and kv > cfg.budget
    return too_long or n > cfg.max_seqs or n * -(-kv // cfg.block_size) > usable


class Run:
    """One engine driven through a workload, checking the properties as it goes."""

    def __init__(self, cfg: Config, engine, lone: LoneResults) -> None:
        self.cfg, self.engine, self.lone = cfg, engine, lone
        self.live: dict[str, tuple] = {}  # id -> (Request, its params) or (Beam, None)
        self.ended: set[str] = set()
        self.ids = 0
        schedule = engine.scheduler.schedule

        def within_budgets():  # every step keeps to its token and sequence budgets
            out = schedule()
            assert out.num_batched_tokens <= cfg.budget and len(out.scheduled) <= cfg.max_seqs
            return out

        engine.scheduler.schedule = within_budgets

    def add(self, req: Request | Beam) -> None:
        """Add a request or a beam search under a new id: refused (InvalidArgumentError) iff it can never fit."""
        rid, self.ids = f"r{self.ids}", self.ids + 1
        beam = isinstance(req, Beam)
        n = req.width if beam else req.n
        expect_refusal = never_fits(self.cfg, len(req.prompt), req.max_tokens, n, beam)
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

    def step(self) -> None:
        """One step: what it returns ended normally, was live, and gives its lone result; then the live checks."""
        for out in self.engine.step():
            assert out.request_id in self.live, f"{out.request_id} returned after it ended"
            req, params = self.live.pop(out.request_id)
            self.ended.add(out.request_id)
            assert out.finished and out.error is None, out.error
            self.check_finished(out, req, params)
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

    def check_live(self) -> None:
        """The engine holds exactly the live ids; their samples so far agree with the lone runs."""
        assert set(self.engine.scheduler.requests) == set(self.live)
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
        if isinstance(req, Request):  # a search's live beams are no hypotheses: nothing to compare
            self.check_prefixes(out, req, params, "abort")
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
        """Every block is free (cached ones with no reference): on the device, in swap space, in the host tier."""
        bm = self.engine.block_manager
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
        elif op == "reset":
            run.engine.reset_prefix_cache()
            run.check_live()
        else:
            for _ in range(arg):
                run.step()
    run.drain()
    run.check_nothing_held()
    return run

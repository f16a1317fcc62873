"""The scheduler: a request's life from admission to its last token, step by step.

:meth:`Scheduler.schedule` decides a step; :meth:`Scheduler.update_from_output` records the
tokens chosen after it (appends them, applies the stop conditions, frees what finished).
Each step it fills a token budget and a sequence budget in this order:
1. running groups: decode groups first, then groups still prefilling (chunked);
   when the pool cannot hold a group's new tokens it preempts the
   latest-admitted group not yet scheduled this step (or the group itself),
   requeued (waiting for recompute, swapped for swap) in arrival order;
   a group that must preempt itself while no other running group holds GPU blocks is refused instead when it
   can never fit, its reason in ``refused``: the pool is as free as it gets (prefixes pinned after it was
   queued hold the rest) and its tokens only grow. That is certain in swap mode (swapped out, it would be
   swapped back in as it is, forever) and, in recompute mode, for one active sequence (its restart needs the
   same blocks, chunked or not) or for a group that already restarted alone from the same tokens;
2. swapped groups, FCFS, if nothing was preempted this step;
3. waiting groups, FCFS with head-of-line blocking (no starvation), only when
   nothing was preempted and nothing is swapped out (under the priority policy: only
   the waiting groups ahead of the swapped head, see below), and only while the block
   manager can allocate above its watermark; prefix-cache hits are skipped (not taken by a
   request that still owes prompt log-probabilities: its prompt positions must run).
   A group whose cached blocks are still being read from a lower tier (``Prefetcher``)
   keeps its place and is passed over until the read lands, unless nothing else would run.
   A first waiting group that cannot start while nothing runs never will (prefixes pinned
   after it was queued hold its room): it is aborted alone, its reason in ``refused``.
   A group through a LoRA adapter (``SequenceGroup.lora``) is admitted or swapped in only while its adapter
   is among the running groups' or fewer than ``max_loras`` adapters run (a step never holds more adapters
   than the model has slots). A waiting group whose adapter does not fit keeps its place and is passed over
   (as vLLM's ``skipped_waiting_requests``): later groups through the base model are admitted in the same step,
   and later groups through a running adapter too while that adapter runs a group ahead of the first one passed
   over (in the policy's order), so each adapter's running groups drain and the passed group starts, no
   starvation; the passed group is tried first again every step. A swapped group whose adapter does not fit
   blocks the queues as one that does not fit.

With ``scheduling_policy="priority"`` (vLLM's) every queue is kept in (priority, arrival) order
instead of arrival order (lower priority first: more important), running included: running groups are
stepped in that order, so the group preempted for one that cannot grow is the running group with the
largest (priority, arrival) not yet scheduled this step, or the group itself when it is the largest;
swapped and waiting groups are resumed and admitted in that order, as one merged order over the two queues'
heads: a waiting group more important (smaller (priority, arrival)) than the swapped head is admitted before it
(no priority inversion behind less important swapped-out groups); on a tie the swapped group resumes first, so no
swapped group is passed by an equal or less important one. Head-of-line blocking holds in the merged order (but for
the groups passed over for their adapter or a pending read, above): when its first group cannot start, nothing
after it starts this step; when that first group is a waiting one that
cannot start while nothing runs, it is refused as above. A waiting group never preempts a running one (as in
vLLM v1).

Invariant: for every active sequence of a running group the block manager holds exactly
``seq.num_computed`` tokens. Scheduling ``(start, n)`` records ``n`` more tokens and
advances ``num_computed`` to ``start + n`` at once (the step writes their KV); only the
scheduler writes ``num_computed``. A group admitted with ``n > 1`` samples forks them from
its first sequence in the step that reaches its last prompt token: they share its blocks and
sample from its logits row. A group of several sequences preempted for recompute is
recomputed as a group: its first sequence alone up to the whole blocks they all start with (or,
sharing none, the tokens they all start with), then the others are forked from it there
(``SequenceGroup.parked``), so the shared prefix is computed and held once and no step computes
more than one sequence's tokens.

With a proposer (speculative decoding, ``scheduler.engine.spec_decode``), a decode sequence of a group with
``speculative`` set runs its last token and up to ``k`` drafts in one query: the drafts take lookahead slots
(``BlockManager.append(num_lookahead_slots=...)``), not counted in ``num_computed`` nor hashed, and the step's
token budget after one token for every running decode sequence still to plan; a constrained sequence's drafts stop
before the first one its grammar refuses (``Sequence.grammar_walk``). A plan whose drafts do not fit drops
them before anything is preempted. After verification (:meth:`Scheduler.update_from_output`) the accepted drafts
are recorded with the block manager (and hashed, so the prefix cache only ever holds kept tokens), ``num_computed``
counts them, and the blocks past them are freed (``truncate``): the invariant above holds again.

A step that fails after ``schedule`` leaves its sequences' ``num_computed`` advanced with no KV
written (or no token sampled): only an abort repairs that. The engine aborts the requests the
failure belongs to (every one, if the model step failed); the others append their tokens as
usual (``scheduler.engine.faults``).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Iterable
from typing import Protocol

from paged_kv.block_hash import BlockHashes
from paged_kv.block_manager import BlockManager, CopyOp
from paged_kv.config import PRIORITY_MAX, PRIORITY_MIN
from paged_kv.errors import DuplicateSequenceError, OutOfBlocksError, UnknownSequenceError, check_int, describe
from scheduler.core.config import SchedulerConfig
from scheduler.core.lora_request import LoRAKey
from scheduler.core.params import SamplingParams
from scheduler.core.pooling_params import PoolingParams
from scheduler.core.scheduler_output import SampledToken, ScheduledSeq, SchedulerOutput
from scheduler.core.sequence import Sequence, SequenceGroup, SequenceStatus


class Prefetcher(Protocol):
    """Brings waiting prompts' blocks from a lower tier into the host tier, in the background."""

    def prefetch(
        self, key: int, token_ids: list[int], hashes: BlockHashes | None, cache_salt: str | None, *, wait: bool = False
    ) -> bool:
        """Whether sequence ``key``'s blocks of the lower tier are in the host tier; ``wait``: block until they are."""
        ...

    def forget(self, key: int) -> None:
        """Drop sequence ``key``'s read, if any: it left the queue."""
        ...


class Proposer(Protocol):
    """Proposes draft tokens for a sequence's next positions (speculative decoding)."""

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to ``k`` drafts to follow ``token_ids`` (``[]``: none)."""
        ...


class Scheduler:
    """Decides, step by step, which tokens of which sequences run through the model.

    Its block manager must record table changes (``track_changes=True``): each output carries them.
    """

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: Iterable[int] = (), *,
        prefetch: Prefetcher | None = None, max_model_len: int | None = None, proposer: Proposer | None = None,
        max_loras: int = 0,
    ) -> None:  # fmt: skip
        """``max_model_len``: a sample that holds that many tokens stops with "length" (None: only at max_tokens).
        ``proposer``: drafts for the decode sequences of groups with ``speculative`` set (None: no drafts).
        ``max_loras``: LoRA adapters the running groups may use at once (a group through another one is passed over)."""
        self.config = config
        self.max_loras = max_loras
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.prefetch = prefetch  # brings a waiting prompt's blocks from a lower tier into the host tier
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, SequenceGroup] = {}  # every unfinished request
        self.waiting: deque[SequenceGroup] = deque()
        # admission order, or (priority, arrival) order under the priority policy: the tail is preempted first
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_recorded_tokens = 0  # tokens appended to sequences so far (not those dropped after a stop)
        self._ids = itertools.count()
        self.proposer = proposer
        self._drafting = False  # whether the step being planned runs drafts (a proposer, and the caller allows)
        self._drafts: dict[Sequence, list[int]] = {}  # the drafts of the step being planned (speculative decoding)
        self._decodes_left = 0  # running decode sequences not planned yet this step: drafts leave them a token each

    # -- requests ---------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, *, fork_samples: bool = True,
        priority: int = 0, lora: LoRAKey | None = None, pooling: PoolingParams | None = None, pool_all: bool = False,
    ) -> SequenceGroup:
        """Queue a request: one sequence, and ``params.n`` sequence slots reserved for it.

        ``pooling``: an embedding request (``params.n`` must be 1), ending once its prompt is computed;
        ``pool_all``: it pools every prompt token, so it reads no prefix cache.

        With ``fork_samples`` the other ``n - 1`` samples are forked from the first when it first
        samples; without, the caller forks its own sequences (a beam search of width ``n``).
        ``priority`` (vLLM's: lower is more important) orders the eviction of its cached blocks and, under the
        priority scheduling policy, its place in the queues and among the preemption victims.
        """
        check_int("priority", priority, low=PRIORITY_MIN, high=PRIORITY_MAX)
        if request_id in self.requests:
            raise DuplicateSequenceError(describe("request_id", request_id, "an id not already in use"))
        unforked = list(range(1, params.n)) if fork_samples else []
        group = SequenceGroup(request_id, [], params, max_seqs=params.n, unforked=unforked, priority=priority,
                              lora=lora, pooling=pooling, pool_all=pool_all)  # fmt: skip
        seq = Sequence(next(self._ids), 0, prompt, self._new_hashes(group.cache_salt))
        group.seqs.append(seq)
        if params.structured_outputs is not None:  # a grammar that starts after a marker waits for it
            seq.grammar_after = params.structured_outputs.waits(prompt)
        self.requests[request_id] = group
        group.set_status(SequenceStatus.WAITING)
        if self._by_priority:
            self._enqueue(self.waiting, group)
        else:
            self.waiting.append(group)  # arrival order: the newest goes last
        return group

    @property
    def _by_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"

    def _enqueue(self, queue: deque[SequenceGroup] | list[SequenceGroup], group: SequenceGroup) -> None:
        """Insert a group where the policy orders it: by arrival, or by (priority, arrival); after its equals."""
        if self._by_priority:
            bisect.insort_right(queue, group, key=_priority_key)  # queue sorted by the same key
        else:
            _insert_by_arrival(queue, group)

    def _new_hashes(self, cache_salt: str | bytes | None) -> BlockHashes | None:
        """A request's block hashes, kept with it and grown by the block manager (None: no prefix caching)."""
        return BlockHashes(self.bm.block_size, cache_salt=cache_salt) if self.bm.config.enable_prefix_caching else None

    def abort(self, request_id: str, now: float | None = None, reason: str = "abort") -> SequenceGroup:
        """Stop a request now: every unfinished sequence ends with ``reason`` and frees its blocks, and every
        sample not forked yet ends with ``reason`` and no token."""
        group = self.requests.pop(request_id, None) if isinstance(request_id, str) else None
        if group is None:
            raise UnknownSequenceError(describe("request_id", request_id, "the id of an unfinished request"))
        self._dequeue(group)
        now = time.perf_counter() if now is None else now
        for seq in group.unfinished():
            self.finish(seq, reason, now)
        self._end_unforked(group, group.unforked, reason, now)
        group.finish_time = now
        return group

    def _stop_unforked(self, group: SequenceGroup, indices: set[int], reason: str, now: float) -> None:
        """End the samples of ``indices`` not forked yet. If the first sequence is among ``indices`` while samples
        stay to fork, it has no token yet (samples fork before the first one is drawn): it goes on as the first
        of them, computing the prompt they share, and its own index ends instead."""
        root, kept = group.seqs[0], [i for i in group.unforked if i not in indices]
        if kept and root.index in indices:
            group.unforked[group.unforked.index(kept[0])] = root.index
            root.index = kept[0]
        self._end_unforked(group, [i for i in group.unforked if i in indices], reason, now)

    def _end_unforked(self, group: SequenceGroup, indices: list[int], reason: str, now: float) -> None:
        """End samples not forked yet: each becomes a finished sequence of the group with no token, never forked."""
        prompt = group.prompt_token_ids
        for index in indices:
            seq = Sequence(next(self._ids), index, prompt)  # holds no block
            seq.finish(reason, now)
            group.seqs.append(seq)
        group.unforked = [i for i in group.unforked if i not in indices]

    def has_unfinished(self) -> bool:
        """Whether any group is queued, running or swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def groups(self) -> list[SequenceGroup]:
        """Every live group, in queue order."""
        return [*self.running, *self.swapped, *self.waiting]

    def fork(self, group: SequenceGroup, parent: Sequence, index: int | None = None) -> Sequence:
        """Add to ``group`` a child sharing every block of ``parent`` (no KV copied), sample ``index`` (default: the
        next one)."""
        child = parent.fork(next(self._ids), len(group.seqs) if index is None else index)
        if parent.seq_id in self.bm:
            self.bm.fork(parent.seq_id, child.seq_id, hashes=child.block_hashes)
        group.seqs.append(child)
        return child

    def finish(self, seq: Sequence, reason: str, now: float | None = None) -> None:
        """End a sequence and free its blocks now (its group runs on while others are unfinished)."""
        seq.finish(reason, time.perf_counter() if now is None else now)
        self._free(seq)

    def stop_samples(self, group: SequenceGroup, indices: Iterable[int], reason: str) -> None:
        """End the samples ``indices`` of a live group now and free their blocks; its other samples run on.

        A finished sample stays as it ended. A sample not forked yet ends with no token, never forked. A
        stopped parked sequence is never forked back; if the sequence recomputing the shared prefix the
        parked ones wait for stops, they are recomputed without it, from the waiting queue.
        """
        now, indices = time.perf_counter(), set(indices)
        self._stop_unforked(group, indices, reason, now)
        for seq in group.unfinished():
            if seq.index in indices:
                self.finish(seq, reason, now)
        group.parked = [s for s in group.parked if not s.is_finished]
        if not group.parked:
            group.fork_at = 0
        if not group.parked or group.active():
            return
        self._park(group)  # every unfinished sequence holds no block now
        if group not in self.waiting:
            self._dequeue(group)
            self._enqueue(self.waiting, group)

    def _dequeue(self, group: SequenceGroup) -> None:
        """Take a group out of whichever queue holds it."""
        for queue in (self.running, self.swapped, self.waiting):
            if group in queue:
                queue.remove(group)

    def _free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, if it holds any."""
        if seq.seq_id in self.bm:
            self.bm.free(seq.seq_id)
        elif self.prefetch is not None:  # it may be waiting for a read
            self.prefetch.forget(seq.seq_id)

    # -- after a step -----------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: list[SampledToken], failed: dict[SequenceGroup, Exception] | None = None
    ) -> list[SequenceGroup]:
        """Append the tokens chosen after ``out``, end the samples they stop, retire finished groups; return those.

        With ``failed``, a token whose bookkeeping raises fails its request alone: the exception
        goes into ``failed``, the request's later tokens are skipped, and the caller aborts it.
        """
        now = time.perf_counter()
        record = self._record if not out.num_draft_tokens else self._record_verified
        for t in sampled:
            if failed is None:
                record(t, now)
            elif t.group not in failed:
                try:
                    record(t, now)
                except Exception as e:
                    failed[t.group] = e
        if out.num_draft_tokens:
            self._keep_accepted(out)
        self._finish_pooled(out, now)
        return self._retire_finished()

    def _finish_pooled(self, out: SchedulerOutput, now: float) -> None:
        """End the embedding requests whose last prompt token the step computed (their blocks freed, full ones
        cached); they sample nothing."""
        for s in out.scheduled:
            if s.group.pooling is not None and s.reaches_end and not s.seq.is_finished:
                self.finish(s.seq, "stop", now)

    def _record_verified(self, t: SampledToken, now: float) -> None:
        """:meth:`_record` in a step that verified drafts: a sequence gets several tokens, and those after the one
        that stopped it are dropped."""
        if not t.seq.is_finished:
            self._record(t, now)

    def _keep_accepted(self, out: SchedulerOutput) -> None:
        """After verification: the accepted drafts' KV (written by the step) is kept, the rejected drafts' dropped.

        A drafting sequence held ``start + num_tokens`` tokens plus lookahead slots; its recorded tokens are the
        accepted drafts, then one token with no KV yet. The block manager records the accepted drafts (so full
        blocks are hashed from kept tokens only) and frees the lookahead blocks past them.
        """
        for s in out.scheduled:
            seq = s.seq
            if not s.drafts or seq.is_finished or seq.seq_id not in self.bm:
                continue
            first = s.start + s.num_tokens
            if seq.num_tokens - 1 > first:
                self.bm.append(seq.seq_id, seq.token_ids[first : seq.num_tokens - 1])
                seq.num_computed = seq.num_tokens - 1
            self.bm.truncate(seq.seq_id, seq.num_computed)  # frees the blocks past the kept tokens

    def _record(self, t: SampledToken, now: float) -> None:
        """Append one sampled token and apply the stop conditions to its sequence."""
        t.seq.append_token(t.token_id, t.logprob, t.top_logprobs, t.rank)
        self.num_recorded_tokens += 1
        t.group.first_token_time = t.group.first_token_time or now
        reason = self._stop_reason(t.group.params, t.seq, t.token_id)
        if reason is not None:
            self.finish(t.seq, reason, now)

    def _stop_reason(self, params: SamplingParams, seq: Sequence, token_id: int) -> str | None:
        """"stop" for a stop token, EOS unless ignored, or a finished grammar; "length" at ``max_tokens`` or at
        ``max_model_len`` tokens (the last token is never computed: no position reaches max_model_len); else None."""
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return "stop"
        if seq.matcher is not None and seq.matcher.is_terminated():  # structured outputs: took its stop token
            return "stop"
        full = self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        return "length" if full or seq.num_outputs >= params.max_tokens else None

    def _retire_finished(self) -> list[SequenceGroup]:
        """Drop the running groups whose every sequence stopped; return them, finish times set."""
        done = [g for g in self.running if g.is_finished()]
        if done:
            self.running = [g for g in self.running if not g.is_finished()]
        for group in done:
            group.finish_time = max(s.finish_time or 0.0 for s in group.seqs)
            del self.requests[group.request_id]
        return done

    # -- one step ---------------------------------------------------------
    def schedule(self, *, drafts: bool = True) -> SchedulerOutput:
        """Pick this step's work and record it with the block manager (``drafts``: with the proposer's drafts, if
        there is a proposer)."""
        step = SchedulerOutput()
        self._drafting = drafts and self.proposer is not None
        if self._drafting:
            self._drafts.clear()
            self._decodes_left = sum(s.num_uncomputed == 1 for g in self.running for s in g.active())
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_queued(step)
        while not (step.scheduled or step.preempted or self.running) and self.has_unfinished():
            self._refuse_head(step)
            self._schedule_queued(step)
        step.table_changes = self.bm.take_table_changes()
        step.tier_ops = self.bm.take_tier_ops()
        return step

    def _refuse_head(self, step: SchedulerOutput) -> None:
        """Abort the first waiting group when nothing runs and it cannot start: it never will.

        The pool is as free as it gets (only cached and pinned blocks left), so the group was
        admitted against room that prefixes pinned since then hold. Any other stall is a bug.
        """
        if not self.waiting or not self._ahead_of_swapped(self.waiting[0]):
            queued = f"{len(self.waiting)} waiting, {len(self.swapped)} swapped"
            raise RuntimeError(f"scheduler stalled: {queued}, none runnable")
        group = self.waiting[0]
        self._refuse(group, step, f"its {group.seqs[0].num_tokens} tokens do not fit")

    def _refuse(self, group: SequenceGroup, step: SchedulerOutput, what: str) -> None:
        """Abort ``group`` alone (its blocks freed, reason "error"); why it can never run goes into ``refused``."""
        why = (f"request {group.request_id!r} can never be scheduled: {what} in the {self.bm.config.num_blocks} "
               f"KV blocks less the {self.bm.num_pinned_blocks} held by pinned prefixes")
        self.abort(group.request_id, reason="error")
        step.refused.append((group, why))

    def _tokens_left(self, step: SchedulerOutput) -> int:
        """The step's token budget not yet used."""
        return self.config.max_num_batched_tokens - step.num_batched_tokens

    def _schedule_running(self, step: SchedulerOutput) -> None:
        if self._by_priority:  # most important first: every group scheduled before one is more important than it
            order = list(self.running)
            groups = [] if self._commit_all(order, step) else order
        else:
            groups = self._fcfs_running_order(step)
        for group in groups:
            if group in step.preempted:
                continue
            plan = self._plan_running(group, self._tokens_left(step), len(step.scheduled))
            if plan and self._make_room(group, plan, step):
                self._commit(group, plan, step)

    def _fcfs_running_order(self, step: SchedulerOutput) -> list[SequenceGroup]:
        """Commit the decode groups at once if they all fit; the running groups left to step, in order."""
        decode = [g for g in self.running if _is_decode(g)]
        rest = [g for g in self.running if not _is_decode(g)]
        return rest if self._commit_all(decode, step) else decode + rest

    def _commit_all(self, groups: list[SequenceGroup], step: SchedulerOutput) -> bool:
        """Commit every group's plan with one ``append_all`` if the pool holds them all; else change nothing.

        Plans are made in turn against the budgets the earlier ones leave, and
        ``append_all`` takes exactly what the per-group commits would: when it
        fits, the per-group loop would have preempted nothing and made the same steps.
        """
        if self._drafting:  # drafts take lookahead slots: each group is committed on its own
            return False
        plans, left, num_seqs = [], self._tokens_left(step), len(step.scheduled)
        for group in groups:
            plan = self._plan_running(group, left, num_seqs)
            plans.append((group, plan))
            left, num_seqs = left - sum(n for _, n in plan), num_seqs + len(plan)
        requests = [(s.seq_id, s.token_ids[s.num_computed : s.num_computed + n]) for _, p in plans for s, n in p]
        try:
            step.copies += self.bm.append_all(requests)
        except OutOfBlocksError:
            return False
        for group, plan in plans:
            for seq, n in plan:
                self._scheduled(step, group, seq, seq.num_computed, n)
        return True

    def _plan_running(self, group: SequenceGroup, tokens_left: int, num_seqs: int) -> list[tuple[Sequence, int]]:
        """New-token counts for a running group's sequences within the budgets left (tokens, sequences)."""
        plan, left = [], tokens_left
        for seq in group.active():
            todo = _num_to_compute(group, seq)
            n = min(todo, left)
            if n <= 0 or num_seqs + len(plan) >= self.config.max_num_seqs:
                if left <= 0:
                    break
                continue
            if not self.config.enable_chunked_prefill and n < todo:
                break
            if self._drafting and todo == 1:
                self._decodes_left = max(0, self._decodes_left - 1)
                if group.speculative:  # after a token for each decode sequence still to plan
                    n += self._propose(group, seq, left - 1 - self._decodes_left)
            plan.append((seq, n))
            left -= n
        return plan

    def _propose(self, group: SequenceGroup, seq: Sequence, budget: int) -> int:
        """Draft tokens for a decode sequence within ``budget`` tokens (kept for the commit); how many.

        None while samples are still to fork or parked (they share its row), before the first output, nor past
        ``max_tokens`` or the model's context. A grammar's drafts stop before the first one it refuses (never
        accepted: not worth its compute), as vLLM's scheduler trims them.
        """
        params = group.params
        self._drafts.pop(seq, None)  # a plan made earlier in the step and not committed
        if group.unforked or group.parked or seq.num_outputs < 1:
            return 0
        if params.structured_outputs is not None and seq.matcher is None:  # no grammar state to check them with
            return 0
        k = min(budget, params.max_tokens - seq.num_outputs - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - seq.num_tokens - 1)  # no draft position reaches max_model_len - 1
        drafts = self.proposer.propose(seq.token_ids, k) if k > 0 else []
        drafts = drafts[: seq.grammar_walk(drafts)]
        if drafts:
            self._drafts[seq] = drafts
        return len(drafts)

    def _make_room(self, group: SequenceGroup, plan: list[tuple[Sequence, int]], step: SchedulerOutput) -> bool:
        """Preempt later groups until ``plan`` fits; preempt ``group`` itself if nothing else can go."""
        while not self._fits_without_drafts(plan):
            scheduled = {s.group for s in step.scheduled}
            pool = self.running
            if self._by_priority:  # only the groups after it are less important (the ones before may be unscheduled)
                pool = pool[pool.index(group) + 1 :]
            # a group whose every sample was stopped (stop_samples) holds nothing until it is retired: never a victim
            victims = (g for g in reversed(pool) if g is not group and g not in scheduled and g.active())
            victim = next(victims, None)
            if victim is None and self._alone(group):
                if self._never_grows(group):
                    self._refuse(group, step, f"its {max(s.num_tokens for s in group.active())} tokens cannot grow")
                    return False
                group.restarted_alone_at = group.num_tokens
            self._preempt(victim or group, step)
            if victim is None:
                return False
        return True

    def _alone(self, group: SequenceGroup) -> bool:
        """Whether no running group but ``group`` holds GPU blocks: the pool is as free as it gets for it (only
        cached and pinned blocks besides its own)."""
        return not any(g is not group and g.active() for g in self.running)

    def _never_grows(self, group: SequenceGroup) -> bool:
        """Whether ``group``, alone and whose plan does not fit, can never fit, its tokens only growing.

        Swapped out, it would be swapped back in as it is. Recomputed, one active sequence needs the same blocks
        again; several may be restarted packed tighter (forked at a longer common prefix, or, chunked, computed
        one after another), unless it already restarted alone from these very tokens: the restart repeats.
        """
        if self.config.preemption_mode == "swap" or len(group.active()) == 1:
            return True
        return group.restarted_alone_at == group.num_tokens

    def _fits_without_drafts(self, plan: list[tuple[Sequence, int]]) -> bool:
        """``_fits``; a plan with drafts that does not fit drops them (in place) and is asked again: drafts never
        preempt a group nor keep one from running."""
        if self._fits(plan):
            return True
        if not (self._drafting and any(seq in self._drafts for seq, _ in plan)):
            return False
        plan[:] = [(seq, n - len(self._drafts.pop(seq, ()))) for seq, n in plan]
        return self._fits(plan)

    def _fits(self, plan: list[tuple[Sequence, int]]) -> bool:
        """Whether the pool holds the blocks ``append`` will take for ``plan`` (new blocks and copy-on-write copies)."""
        return self.bm.can_append_all((seq.seq_id, n) for seq, n in plan)

    def _commit(self, group: SequenceGroup, plan: list[tuple[Sequence, int]], step: SchedulerOutput) -> None:
        """Record ``plan`` with the block manager; a sequence's drafts (``n`` counts them) get lookahead slots, no
        place in its token count or its block hashes until they are accepted."""
        for seq, n in plan:
            start = seq.num_computed
            drafts = tuple(self._drafts.pop(seq, ())) if self._drafting else ()
            n -= len(drafts)
            step.copies += self.bm.append(seq.seq_id, seq.token_ids[start : start + n], num_lookahead_slots=len(drafts))
            self._scheduled(step, group, seq, start, n, drafts)

    def _scheduled(self, step: SchedulerOutput, group: SequenceGroup, seq: Sequence, start: int, n: int,
                   drafts: tuple[int, ...] = ()) -> None:  # fmt: skip
        """Count ``n`` recorded tokens of ``seq`` (and its ``drafts``) in the step; at its first sample, fork the
        group's other samples."""
        seq.num_computed = start + n
        group.first_scheduled_time = group.first_scheduled_time or time.perf_counter()
        forks = ()
        if group.unforked and seq.num_computed == seq.num_tokens:
            forks = tuple(self.fork(group, seq, index) for index in group.unforked)
            group.unforked = []
        if group.parked and seq.num_computed == group.fork_at:
            self._unpark(group, seq)
        step.add(ScheduledSeq(seq, group, start, n, forks, _prompt_positions(group, seq, start, n), drafts))

    def _unpark(self, group: SequenceGroup, root: Sequence) -> None:
        """Fork every parked sequence from ``root``, which now holds the ``fork_at`` tokens they start with."""
        for seq in group.parked:
            if seq.block_hashes is not None and seq.block_hashes.num_tokens < group.fork_at:
                seq.block_hashes.extend(seq.token_ids[seq.block_hashes.num_tokens : group.fork_at])
            # root holds exactly fork_at tokens, all shared (a partial last block is copied on the first write)
            self.bm.fork(root.seq_id, seq.seq_id, hashes=seq.block_hashes)
            seq.num_computed, seq.status = group.fork_at, root.status
        group.parked, group.fork_at = [], 0

    def _park(self, group: SequenceGroup) -> None:
        """Before recomputing a group of several sequences: park all but the first until it reaches their shared
        whole blocks, or, if they share none, the tokens they share (the partial block is copied on write); each
        sequence keeps at least one token of its own to compute.

        No step then computes more than one sequence's tokens: without chunked prefill a request is admitted
        against that budget alone, so recomputing diverged samples side by side could never be scheduled.
        """
        seqs, bs = group.unfinished(), self.bm.block_size
        shared = min(_common_prefix_len([s.token_ids for s in seqs]), min(s.num_tokens for s in seqs) - 1)
        group.fork_at = (shared // bs * bs or shared) if len(seqs) > 1 else 0
        group.parked = seqs[1:] if group.fork_at else []

    # -- preemption -------------------------------------------------------
    def _preempt(self, group: SequenceGroup, step: SchedulerOutput) -> None:
        """Take a group off the GPU: swap its blocks to the CPU pool, or drop them for recompute."""
        self.running.remove(group)
        step.preempted.append(group)
        group.num_preemptions += 1
        seqs = group.active()
        ids = [seq.seq_id for seq in seqs]
        if self.config.preemption_mode == "swap" and self.bm.can_swap_out(ids):
            step.swap_out += self.bm.swap_out(ids)  # blocks shared within the group move once
            group.set_status(SequenceStatus.SWAPPED)
            self._enqueue(self.swapped, group)
            self.num_preemptions["swap"] += 1
            return
        for seq in seqs:
            self._free(seq)
            seq.num_computed, seq.status = 0, SequenceStatus.WAITING
        self._park(group)
        self._enqueue(self.waiting, group)
        self.num_preemptions["recompute"] += 1

    # -- swapped and waiting ----------------------------------------------
    def _schedule_queued(self, step: SchedulerOutput) -> None:
        """Swap in and admit in one merged order over the swapped and waiting heads; stop at the first that cannot.

        A waiting group goes first only when it is ahead of every swapped group (``_ahead_of_swapped``): never
        under fcfs (swapped groups all resume first), under priority when its (priority, arrival) is smaller
        than the swapped head's (ties resume the swapped group: none is passed by an equal or lesser one).
        """
        while self._schedule_waiting(step) and self.swapped and self._swap_in_head(step):
            pass  # each pass: the waiting groups ahead of the swapped head, then that head

    def _ahead_of_swapped(self, group: SequenceGroup) -> bool:
        """Whether a waiting group may start before the swapped groups: none swapped, or, under the priority
        policy, it is more important than the swapped head (the swapped queue is in (priority, arrival) order)."""
        if not self.swapped:
            return True
        return self._by_priority and _priority_key(group) < _priority_key(self.swapped[0])

    def _swap_in_head(self, step: SchedulerOutput) -> bool:
        """Swap the first swapped group back in and schedule what fits of it; False if it does not fit."""
        group = self.swapped[0]
        ids = [seq.seq_id for seq in group.active()]
        if not (self.bm.can_swap_in(ids) and self._fits_seqs(group) and self._fits_lora(group)):  # shared blocks once
            return False
        self.swapped.popleft()
        step.swap_in += self.bm.swap_in(ids)
        group.set_status(SequenceStatus.RUNNING)
        self._admitted(group)
        plan = self._plan_running(group, self._tokens_left(step), len(step.scheduled))
        if plan and self._fits_without_drafts(plan):
            self._commit(group, plan, step)
        return True

    def _schedule_waiting(self, step: SchedulerOutput) -> bool:
        """Admit the waiting groups ahead of the swapped ones in order; one whose blocks are still being read keeps
        its place and is passed, as one whose adapter has no slot (``_fits_lora``). Returns False if one of them could
        not start (head-of-line blocking).

        When nothing else would run this step, the first such group's read is waited for.
        """
        reading, blocked = self._admit_waiting(step, wait=False)
        if reading and not (step.scheduled or self.running):
            reading, blocked = self._admit_waiting(step, wait=True)
        return not blocked

    def _admit_waiting(self, step: SchedulerOutput, *, wait: bool) -> tuple[bool, bool]:
        """Admit waiting groups ahead of the swapped ones until one does not fit (``wait``: the first group's reads
        are waited for).

        Returns whether a group was passed because its read has not landed, and whether one could not start.
        """
        passed: list[SequenceGroup] = []  # kept in place: read pending, or no slot for the adapter
        reading, blocked = False, False
        first_passed: SequenceGroup | None = None  # the first group passed over for its adapter
        while self.waiting and self._ahead_of_swapped(self.waiting[0]):
            group = self.waiting[0]
            if not self._fits_lora(group, first_passed):
                first_passed = first_passed or group
                passed.append(self.waiting.popleft())
                continue
            if not self._fits_seqs(group):
                blocked = True
                break
            if not self._blocks_read(group, wait=wait):
                reading = True
                passed.append(self.waiting.popleft())
                continue
            wait = False
            plan = self._plan_prefill(group, step)
            if plan is None:
                blocked = True
                break
            self.waiting.popleft()
            self._start(group, plan, step)
        self.waiting.extendleft(reversed(passed))
        return reading, blocked

    def _start(self, group: SequenceGroup, plan: list[tuple[Sequence, int, int]], step: SchedulerOutput) -> None:
        """Allocate a waiting group's planned tokens (prefix-cache hits skipped), schedule them, and run it."""
        salt = group.cache_salt
        for seq, cached, n in plan:
            if group.reads_prefix_cache:
                ids = seq.token_ids[: cached + n]
                looked_up = seq.num_computed + _num_to_compute(group, seq)  # the whole prompt, once per admission
                start = self.bm.allocate(seq.seq_id, ids, cache_salt=salt, hashes=seq.block_hashes,
                                         num_queried=looked_up, priority=group.priority)  # >= cached  # fmt: skip
            else:  # anonymous tokens: no prefix-cache hit (prompt positions must be computed to be scored)
                start = self.bm.allocate(seq.seq_id, cached + n, cache_salt=salt, priority=group.priority)
            if group.num_cached_tokens is None:  # its first admission: the first sequence's prefix-cache hit
                group.num_cached_tokens = start
            self._scheduled(step, group, seq, start, cached + n - start)
        group.set_status(SequenceStatus.RUNNING)
        self._admitted(group)

    def _blocks_read(self, group: SequenceGroup, *, wait: bool) -> bool:
        """Whether a waiting group's blocks of a lower tier are in the host tier (reads of the others started)."""
        if self.prefetch is None or not group.reads_prefix_cache:
            return True
        ready, salt = True, group.cache_salt
        for seq in group.active():
            ids = seq.token_ids[: seq.num_computed + _num_to_compute(group, seq)]
            ready &= self.prefetch.prefetch(seq.seq_id, ids, seq.block_hashes, salt, wait=wait)
        return ready

    def _plan_prefill(self, group: SequenceGroup, step: SchedulerOutput) -> list[tuple[Sequence, int, int]] | None:
        """(seq, cached tokens, new tokens) for every active sequence of a waiting group, or None if it cannot start.

        One admission query answers from the sequences' kept block hashes (nothing hashed twice):
        their cached tokens, then whether the tokens planned fit above the watermark. Each
        sequence gets at least one token: the budget keeps one per later sequence in reserve.
        """
        seqs = group.active()
        tokens = [s.token_ids[: s.num_computed + _num_to_compute(group, s)] for s in seqs]  # to fork_at if parked
        requests = zip(tokens, (s.block_hashes for s in seqs))
        if not group.reads_prefix_cache:
            requests = [(len(t), None) for t in tokens]  # counts of anonymous tokens: nothing cached
        admission = self.bm.admission(requests, cache_salt=group.cache_salt)
        plan, left = [], self._tokens_left(step)
        for i, (seq, cached) in enumerate(zip(seqs, admission.cached)):
            n, mine = len(tokens[i]) - cached, left - (len(seqs) - 1 - i)
            if n > mine and not self.config.enable_chunked_prefill:
                return None
            n = min(n, mine)
            if n <= 0:
                return None
            plan.append((seq, cached, n))
            left -= n
        return plan if admission.fits([c + n for _, c, n in plan]) else None

    def _admitted(self, group: SequenceGroup) -> None:
        """Put a group just admitted or swapped in among the running: last, or in (priority, arrival) order."""
        if self._by_priority:
            self._enqueue(self.running, group)
        else:
            self.running.append(group)

    def _fits_seqs(self, group: SequenceGroup) -> bool:
        """Whether the running groups' reserved sequences leave room for ``group``'s."""
        running = sum(g.num_seqs_reserved() for g in self.running)
        return running + group.num_seqs_reserved() <= self.config.max_num_seqs

    def _fits_lora(self, group: SequenceGroup, first_passed: SequenceGroup | None = None) -> bool:
        """Whether ``group``'s adapter (if any) runs beside the running groups' within ``max_loras``; past
        ``first_passed`` (a group waiting for a slot) only beside a running group ahead of it, so adapters drain."""
        if group.lora is None:
            return True
        adapters = {g.lora for g in self.running if g.lora is not None}
        if group.lora not in adapters:
            return len(adapters) < self.max_loras
        if first_passed is None:
            return True
        ahead = self._order_key(first_passed)
        return any(g.lora == group.lora and self._order_key(g) < ahead for g in self.running)

    def _order_key(self, group: SequenceGroup) -> tuple[int, float]:
        """The policy's queue order: (priority, arrival), or arrival alone under fcfs."""
        return _priority_key(group) if self._by_priority else (0, group.arrival_time)


def _insert_by_arrival(queue: deque[SequenceGroup], group: SequenceGroup) -> None:
    """Requeue a preempted group ahead of every group that arrived after it (FCFS)."""
    at = next((i for i, g in enumerate(queue) if g.arrival_time > group.arrival_time), len(queue))
    queue.insert(at, group)


def _priority_key(group: SequenceGroup) -> tuple[int, float]:
    """The priority policy's order: more important (lower priority) first, then earlier arrival."""
    return group.priority, group.arrival_time


def _is_decode(group: SequenceGroup) -> bool:
    """A group whose every sequence only needs its last sampled token computed."""
    return all(s.num_uncomputed == 1 and s.num_computed > 0 for s in group.active())


def _num_to_compute(group: SequenceGroup, seq: Sequence) -> int:
    """Tokens ``seq`` still has to compute before it samples, or, while others are parked on it, before they fork."""
    end = group.fork_at if group.parked else seq.num_tokens
    return end - seq.num_computed


def _prompt_positions(group: SequenceGroup, seq: Sequence, start: int, n: int) -> range:
    """Positions among ``[start, start + n)`` whose logits score a prompt token the group has no log-probability of."""
    if group.prompt_logprobs is None:
        return range(0)
    lo, hi = max(start, len(group.prompt_logprobs) - 1), min(start + n, seq.prompt_len - 1)
    return range(lo, max(lo, hi))


def _common_prefix_len(token_lists: list[list[int]]) -> int:
    """Length of the longest prefix every list starts with."""
    first, n = token_lists[0], min(map(len, token_lists))
    for other in token_lists[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return n


__all__ = ["CopyOp", "Scheduler", "ScheduledSeq", "SchedulerOutput"]

"""The engine's live beam searches: each step selects their beams' tokens beside the sampled requests.

A step's sampled rows are split: those of a beam-search group go to its :class:`BeamRequest`
(:mod:`scheduler.engine.beam_selection`), the others to the sampler. Every ready search's
candidates come back in one device->host copy (so a step with both kinds makes two). A search
whose selection raises fails alone, as a request whose sampling raises does; the engine aborts
it ("error", every live beam freed) and returns its output with ``error`` set.

A beam search's :class:`~scheduler.core.outputs.RequestOutput` holds its hypotheses best first
(index = rank, finish reason "stop" or "length"); while it runs, the hypotheses so far and then its
live beams (finish reason None), ``width`` at most. Cut short (aborted, or failed alone), it holds the
same, every one ending with "abort" / "error" (hypotheses too: none is final before the search ends),
as every running sample of an aborted request does.
"""

from __future__ import annotations

from paged_kv.block_manager import BlockManager
from scheduler.core.outputs import RequestOutput
from scheduler.core.scheduler import Scheduler
from scheduler.core.scheduler_output import SampledToken
from scheduler.core.sequence import Sequence, SequenceGroup
from scheduler.engine.beam_selection import BeamRequest, BeamSearchParams, Meter, candidates_of, stop_ids
from scheduler.engine.faults import isolate

Row = tuple[SequenceGroup, Sequence, int]  # an entry of SchedulerOutput.samples: (group, sequence, logits row)


class BeamRequests:
    """Every live beam search of an engine, by request id; their selection each step and their outputs."""

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager) -> None:
        self.scheduler, self.bm = scheduler, block_manager
        self.live: dict[str, BeamRequest] = {}  # invariant: exactly the beam searches the scheduler holds

    def __bool__(self) -> bool:
        return bool(self.live)

    def __contains__(self, group: SequenceGroup) -> bool:
        req = self.live.get(group.request_id)
        return req is not None and req.group is group

    def add(self, group: SequenceGroup, params: BeamSearchParams, *, measure: bool = False) -> BeamRequest:
        """Track a queued group as a beam search (the caller forks its beams: it was added with fork_samples off);
        ``measure``: meter its beams' blocks each step."""
        eos = stop_ids(params, self.scheduler.eos_token_ids)
        req = self.live[group.request_id] = BeamRequest(group, params, eos, measure=measure)
        return req

    def split(self, samples: list[Row]) -> tuple[list[Row], list[Row]]:
        """A step's sampled rows: (those of beam searches, the others)."""
        beams, others = [], []
        for row in samples:
            (beams if row[0] in self else others).append(row)
        return beams, others

    def measure(self) -> None:
        """Record the GPU blocks each metered search's beams hold, shared and as if unshared (and per shared meter);
        the others' block tables are not read."""
        bm = self.bm
        totals: dict[int, tuple[Meter, set[int], list[int]]] = {}  # id(meter) -> (meter, its blocks, [unshared])
        for req in self.live.values():
            if req.meter is None:
                continue
            tables = [bm.block_table(s.seq_id) for s in req.beams if s.seq_id in bm and not bm.is_swapped(s.seq_id)]
            blocks, unshared = {b for t in tables for b in t}, sum(map(len, tables))
            req.meter.record(len(blocks), unshared)
            if req.total is not None:
                _, union, count = totals.setdefault(id(req.total), (req.total, set(), [0]))
                union |= blocks
                count[0] += unshared
        for meter, union, count in totals.values():
            meter.record(len(union), count[0])

    def select(self, rows: list[Row], logits, errors: dict[SequenceGroup, BaseException]) -> list[SampledToken]:
        """Collect the step's beam logits; advance each search whose beams are all computed; return their tokens.

        A search whose selection raises goes into ``errors`` and gets no token (the caller aborts it).
        """
        for group, seq, row in rows:
            self.live[group.request_id].ready[seq.seq_id] = logits[row]
        ready = [r for r in self.live.values() if r.all_ready()]  # after a chunked re-prefill some beams wait
        tokens: list[SampledToken] = []
        for req, cands in isolate(ready, candidates_of, lambda r: r.group, errors):
            try:
                tokens += req.advance(cands, self.scheduler)
            except Exception as e:  # this search alone fails
                errors[req.group] = e
        return tokens

    def output(self, group: SequenceGroup, error: str | None = None) -> RequestOutput:
        """A search's output (see the module); once its group has finished, the search is done and forgotten."""
        req = self.live[group.request_id]
        if group.is_finished():
            del self.live[group.request_id]
            req.done, req.error = True, error
        return RequestOutput.from_group(group, outputs=req.outputs(), error=error)

    def clear(self, error: str) -> None:
        """Forget every search (a failed step aborted them all): each is done with ``error``."""
        for req in self.live.values():
            req.done, req.error = True, error
        self.live.clear()

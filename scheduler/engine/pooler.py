"""The pooler: a step's pooled hidden-state rows folded into each embedding request's vector.

The runner returns, after the forward, the final-norm hidden states of the rows ``out.pooled`` names (in that
order: each request's rows of the step, :attr:`ScheduledSeq.pool_offsets`). LAST keeps the prompt's last row;
MEAN adds every chunk's rows to a running sum on the device (a chunk that starts at position 0, a fresh prompt or
one recomputed after a preemption, starts the sum again), so chunked prefill reads no device value mid-request.
The step that computes a request's last prompt token finishes its vector: MEAN divides by the prompt length, then
the vector is cut to ``dimensions`` and L2-normalized when ``normalize`` (vLLM's order), and every vector finished
in the step comes to the host in one transfer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scheduler.core.pooling_params import PoolerConfig
from scheduler.core.scheduler_output import SchedulerOutput
from scheduler.core.sequence import SequenceGroup
from scheduler.runner.host_fetch import Fetch, fetch


class Pooler:
    """Folds each step's pooled rows into the embedding requests' state; finishes their vectors."""

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    def collect(self, out: SchedulerOutput, rows: torch.Tensor | None) -> None:
        """Fold the step's pooled rows (``[P, hidden]`` float32, ``out.pooled`` order) into their requests; the
        requests whose prompt the step finished get ``embedding`` (one device->host transfer for all)."""
        items = out.pooled
        if not items:
            return
        finished: list[SequenceGroup] = []
        for s, part in zip(items, rows.split([len(s.pool_offsets) for s in items])):
            group = s.group
            if not group.pool_all:  # LAST: the one row of the step that reaches the prompt's end
                group.pooled = part[0]
            elif s.start == 0 or group.pooled is None:  # invariant: MEAN reads no prefix cache, so 0 starts a prompt
                group.pooled = part.sum(0)
            else:
                group.pooled = group.pooled + part.sum(0)
            if s.reaches_end:
                finished.append(group)
        if finished:
            vectors = fetch(*(Fetch([self._vector(g)], list) for g in finished))  # one device->host transfer
            for group, vector in zip(finished, vectors):
                group.embedding, group.pooled = vector, None

    @staticmethod
    def _vector(group: SequenceGroup) -> torch.Tensor:
        """A finished request's vector on the device: pooled, cut to its dimensions, normalized if asked."""
        params = group.pooling
        vector = group.pooled / group.seqs[0].prompt_len if group.pool_all else group.pooled  # [hidden]
        vector = vector[: params.dimensions]
        return F.normalize(vector, dim=-1) if params.normalize else vector


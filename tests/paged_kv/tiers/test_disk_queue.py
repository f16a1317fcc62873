"""The write queue: drops the oldest past its byte limit, never the newest; pending hashes; row picks."""

from __future__ import annotations

import torch
from disk_helpers import BS, FP16, batch, chain

from paged_kv.tiers.disk_queue import WriteQueue, joined, rows
from paged_kv.tiers.disk_queue import batch as write_of


def _writes(n):
    out = []
    for i in range(n):
        blocks = chain(range(100 * i, 100 * i + BS))[3]
        out.append(write_of(blocks, batch(FP16, blocks)[0], None, [0]))
    return out


def test_past_the_limit_the_oldest_writes_go_and_their_hashes_are_no_longer_pending():
    w = _writes(4)
    queue = WriteQueue(max_bytes=2 * w[0].nbytes)
    assert [queue.push(x) for x in w] == [0, 0, 1, 1]
    assert len(queue) == 2 and queue.bytes == 2 * w[0].nbytes
    assert queue.pending == {w[2].blocks[0].hash, w[3].blocks[0].hash}
    first = queue.pop()
    assert first is w[2] and queue.bytes == w[0].nbytes and first.blocks[0].hash in queue.pending
    queue.done(first)
    assert queue.pending == {w[3].blocks[0].hash}


def test_a_write_larger_than_the_limit_is_kept_alone():
    w = _writes(2)
    queue = WriteQueue(max_bytes=1)
    assert queue.push(w[0]) == 0 and queue.push(w[1]) == 1
    assert len(queue) == 1 and queue.pop() is w[1]


def test_rows_are_views_when_consecutive_and_copies_otherwise():
    t = torch.arange(24).view(6, 4)
    view = rows(t, [2, 3, 4])
    assert view.data_ptr() == t[2].data_ptr() and torch.equal(view, t[2:5])
    picked = rows(t, [0, 2, 5])
    assert torch.equal(picked, t[[0, 2, 5]]) and picked.data_ptr() != t.data_ptr()
    assert joined([view]) is view and torch.equal(joined([t[:2], t[4:]]), t[[0, 1, 4, 5]])

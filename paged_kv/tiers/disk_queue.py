"""The disk tier's write queue: batches waiting for the writer thread, bounded in bytes."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_kv.tiers.disk_format import DiskBlock


@dataclass(slots=True)
class Write:
    """Blocks for one file: kv [n, 2, L, B, H, D], scales [n, 2, L, B, H] or None."""

    blocks: list[DiskBlock]
    kv: torch.Tensor
    scales: torch.Tensor | None
    nbytes: int  # tensor bytes held


class WriteQueue:
    """Writes in arrival order; past ``max_bytes`` queued, the oldest are dropped (never the newest).

    Not thread-safe: the tier's lock guards every call. A popped write's hashes stay ``pending``
    until :meth:`done`, so a block is queued or being written at most once.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.pending: set[bytes] = set()  # hashes queued or being written
        self.bytes = 0  # tensor bytes queued (a popped write no longer counts)
        self._writes: deque[Write] = deque()

    def __len__(self) -> int:
        return len(self._writes)

    def push(self, write: Write) -> int:
        """Queue a write; how many blocks of older writes were dropped to keep within ``max_bytes``."""
        self._writes.append(write)
        self.bytes += write.nbytes
        self.pending.update(b.hash for b in write.blocks)
        dropped = 0
        while self.bytes > self.max_bytes and len(self._writes) > 1:
            old = self._writes.popleft()
            self.bytes -= old.nbytes
            self.pending.difference_update(b.hash for b in old.blocks)
            dropped += len(old.blocks)
        return dropped

    def pop(self) -> Write:
        """The oldest write, for the writer (its hashes stay pending)."""
        write = self._writes.popleft()
        self.bytes -= write.nbytes
        return write

    def done(self, write: Write) -> None:
        """A popped write is on disk, or given up."""
        self.pending.difference_update(b.hash for b in write.blocks)


def batch(blocks: Sequence[DiskBlock], kv: torch.Tensor, scales: torch.Tensor | None, picks: list[int]) -> Write:
    """The picked blocks of a batch as one write (views when the picks are consecutive)."""
    kv = rows(kv, picks)
    scales = None if scales is None else rows(scales, picks)
    return Write([blocks[i] for i in picks], kv, scales, kv.nbytes + (0 if scales is None else scales.nbytes))


def rows(t: torch.Tensor, picks: list[int]) -> torch.Tensor:
    """``t[picks]`` along dim 0: a view when the picks are consecutive (the usual case), else a copy."""
    if picks == list(range(picks[0], picks[0] + len(picks))):
        return t[picks[0] : picks[0] + len(picks)]
    return t[torch.tensor(picks)]


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts concatenated along dim 0 (the part itself when there is one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)

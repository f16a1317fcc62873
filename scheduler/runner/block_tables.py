"""Persistent block tables: one device row per live sequence, updated with what a step changed.

A step's block tables are gathered on the device from these rows, so the host work of a
step grows with the entries that changed (a new block, a copy-on-write replacement), not
with the blocks the batch holds. A host mirror of the rows gives the slot mapping without
reading the device. Block ids are validated here, on the host, as they enter a row.

Invariant: for a sequence with a row, entries ``[0, synced)`` of the row equal its block
manager table, except that the last synced entry may since have been replaced by
copy-on-write (appends only touch the block holding the next token and later ones), so a
sync rewrites from ``synced - 1``. Whatever replaces earlier blocks of a sequence (swap,
preemption, free) must :meth:`release` its row first.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import torch

from kernels.metadata import host_positions, offsets
from paged_kv.block_manager import BlockManager
from paged_kv.errors import OutOfRangeError, describe


class DeviceRows:
    """The device side of the tables: rows ``[R, width]`` int32 written with update triples.

    The driver's :class:`BlockTables` owns one; each tensor-parallel worker keeps its own copy,
    fed the same updates and row count, so every rank gathers the same tables.
    """

    def __init__(self, width: int, device: torch.device, rows: int = 64) -> None:
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)  # [R, width]

    @property
    def num_rows(self) -> int:
        """Rows allocated on the device."""
        return self.table.shape[0]

    def grow_to(self, rows: int) -> None:
        """Allocate up to ``rows`` rows, keeping the existing ones (copied on the device)."""
        old = self.table.shape[0]
        if rows > old:
            table = self.table.new_zeros(rows, self.table.shape[1])
            table[:old] = self.table
            self.table = table

    def apply_updates(self, rows: torch.Tensor, cols: torch.Tensor, ids: torch.Tensor) -> None:
        """Write update entries ``(rows, cols, ids)`` [U], already on the device, into the rows."""
        if rows.numel():
            self.table[rows, cols] = ids.to(torch.int32)


class BlockTables:
    """Rows ``[R, width]`` int32 of block ids on the device, with a host mirror and a row per sequence."""

    def __init__(self, bm: BlockManager, width: int, device: torch.device, rows: int = 64) -> None:
        self.bm, self.width, self.device = bm, width, device
        self.block_size = bm.block_size
        self.host = np.zeros((rows, width), dtype=np.int32)  # mirror of self.table
        self.device_rows = DeviceRows(width, device, rows)
        self.synced = np.zeros(rows, dtype=np.int64)  # entries of each row known current
        self._rows: dict[Hashable, int] = {}
        self._free = list(range(rows - 1, -1, -1))
        self._updates: list[tuple[int, int, list[int]]] = []  # (row, first column, ids) not yet on the device

    def __len__(self) -> int:
        return len(self._rows)

    def sync(self, seq_id: Hashable, num_tokens: int, force: bool = False) -> int:
        """Bring a sequence's row up to its ``num_tokens`` tokens; return the row.

        A known row is re-read only when it lacks blocks for ``num_tokens`` or ``force``
        (the step made copy-on-write copies, which may have replaced its last block).
        """
        row = self._rows.get(seq_id)
        if row is not None and not force and self.synced[row] * self.block_size >= num_tokens:
            return row
        if row is None:
            row = self._new_row(seq_id)
        start = max(0, int(self.synced[row]) - 1)
        ids = self.bm.block_table(seq_id, start)
        end = start + len(ids)
        if end > self.width or (ids and not 0 <= min(ids) <= max(ids) < self.bm.gpu.num_blocks):
            self.release(seq_id)
            bad = end if end > self.width else (min(ids) if min(ids) < 0 else max(ids))
            raise OutOfRangeError(describe(f"block table of {seq_id!r}", bad, "block ids in the pool, within width"))
        self.host[row, start:end] = ids
        self.synced[row] = end
        self._updates.append((row, start, ids))
        return row

    def sync_all(self, seq_ids: list[Hashable], num_tokens: np.ndarray, force: bool = False) -> np.ndarray:
        """:meth:`sync` for a step's sequences; returns their rows ``[S]`` int64 (only stale rows are re-read)."""
        rows = np.fromiter((self._rows.get(i, -1) for i in seq_ids), np.int64, len(seq_ids))
        stale = (rows < 0) | (self.synced[rows] * self.block_size < num_tokens) | force
        for i in np.flatnonzero(stale).tolist():
            rows[i] = self.sync(seq_ids[i], int(num_tokens[i]), force=True)
        return rows

    def release(self, seq_id: Hashable) -> None:
        """Forget a sequence's row (its blocks were freed, swapped or preempted); a no-op without one."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self.synced[row] = 0
            self._free.append(row)

    def take_updates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, columns, ids) int64 of every entry synced since the last call, to apply on the device."""
        if not self._updates:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        rows, first, ids = zip(*self._updates)
        counts = np.fromiter(map(len, ids), np.int64, len(ids))
        which, cols = host_positions(np.array(first, np.int64), counts, offsets(counts))  # update, column [U]
        self._updates.clear()
        flat = np.fromiter((b for block_ids in ids for b in block_ids), np.int64, len(cols))
        return np.array(rows, np.int64)[which], cols, flat

    @property
    def table(self) -> torch.Tensor:
        """The device rows ``[R, width]`` int32."""
        return self.device_rows.table

    def apply_updates(self, rows: torch.Tensor, cols: torch.Tensor, ids: torch.Tensor) -> None:
        """Write :meth:`take_updates`' entries, already on the device, into the device rows."""
        self.device_rows.apply_updates(rows, cols, ids)

    def _new_row(self, seq_id: Hashable) -> int:
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._rows[seq_id] = row
        return row

    def _grow(self) -> None:
        """Double the rows (device rows copied on the device, host rows on the host)."""
        old = self.host.shape[0]
        self.host = np.concatenate([self.host, np.zeros_like(self.host)])
        self.synced = np.concatenate([self.synced, np.zeros_like(self.synced)])
        self.device_rows.grow_to(2 * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))

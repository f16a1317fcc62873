"""Persistent block tables: one device row per live sequence, told what changed, never re-read.

A step's block tables are gathered on the device from these rows. The block manager keeps a
journal of every table entry it sets and every table it drops (``take_table_changes``), the
scheduler hands it over in each :class:`~scheduler.core.scheduler_output.SchedulerOutput`, and
:meth:`BlockTables.apply` replays it here: the host work of a step grows with the entries that
changed (a new block, a copy-on-write replacement, a fork), not with the blocks the batch holds.
A host mirror of the rows gives the slot mapping and the cascade plan without reading the device.
Block ids are validated here, on the host, as they enter a row.

Invariant: after applying a step's journal, entries ``[0, len(table))`` of every live
sequence's row equal its block-manager table; entries past them are stale and never read.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from paged_kv.block_manager import RELEASED, TableEntry
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

    def __init__(self, width: int, num_blocks: int, device: torch.device, rows: int = 64) -> None:
        self.width, self.num_blocks, self.device = width, num_blocks, device
        self.host = np.zeros((rows, width), dtype=np.int32)  # mirror of the device rows
        self.device_rows = DeviceRows(width, device, rows)
        self._rows: dict[Hashable, int] = {}
        self._free = list(range(rows - 1, -1, -1))
        self._updates: list[np.ndarray] = []  # [3, U] (row, column, id) not yet on the device

    def __len__(self) -> int:
        return len(self._rows)

    def apply(self, changes: Sequence[TableEntry]) -> None:
        """Replay a journal slice in order: ``(seq, index, block)`` sets an entry, ``RELEASED`` drops the row.

        Every entry is checked first (index within the width, block in the pool): on a bad one
        nothing is applied and OutOfRangeError names it.
        """
        if not changes:
            return
        index = np.fromiter((c[1] for c in changes), np.int64, len(changes))
        block = np.fromiter((c[2] for c in changes), np.int64, len(changes))
        self._check(changes, index, block)
        rows = np.fromiter((self._row_of(seq_id, i) for seq_id, i, _ in changes), np.int64, len(changes))
        keep = _last_of_each(rows * self.width + index, index != RELEASED)  # a later entry wins over an earlier one
        self.host[rows[keep], index[keep]] = block[keep]
        self._updates.append(np.stack([rows[keep], index[keep], block[keep]]))

    def rows(self, seq_ids: Sequence[Hashable]) -> np.ndarray:
        """The rows ``[S]`` int64 of a step's sequences (each holds blocks, so each has a row)."""
        return np.fromiter((self._rows[i] for i in seq_ids), np.int64, len(seq_ids))

    def take_updates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, columns, ids) int64 of every entry set since the last call, to apply on the device."""
        if not self._updates:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        rows, cols, ids = np.concatenate(self._updates, axis=1) if len(self._updates) > 1 else self._updates[0]
        self._updates.clear()
        keep = _last_of_each(rows * self.width + cols, np.ones(len(rows), dtype=bool))
        return rows[keep], cols[keep], ids[keep]

    @property
    def table(self) -> torch.Tensor:
        """The device rows ``[R, width]`` int32."""
        return self.device_rows.table

    def apply_updates(self, rows: torch.Tensor, cols: torch.Tensor, ids: torch.Tensor) -> None:
        """Write :meth:`take_updates`' entries, already on the device, into the device rows."""
        self.device_rows.apply_updates(rows, cols, ids)

    def _check(self, changes: Sequence[TableEntry], index: np.ndarray, block: np.ndarray) -> None:
        """OutOfRangeError on the first entry whose index or block does not fit the rows or the pool."""
        bad = (index != RELEASED) & ((index < 0) | (index >= self.width) | (block < 0) | (block >= self.num_blocks))
        if bad.any():
            seq_id, i, b = changes[int(np.flatnonzero(bad)[0])]
            expected = f"index in [0, {self.width}) and block id in [0, {self.num_blocks})"
            raise OutOfRangeError(describe(f"block table entry of {seq_id!r}", (i, b), expected))

    def _row_of(self, seq_id: Hashable, index: int) -> int:
        """The row an entry goes to (a new one for a sequence without); a release frees it and returns -1."""
        if index == RELEASED:
            row = self._rows.pop(seq_id, None)
            if row is not None:
                self._free.append(row)
            return -1
        row = self._rows.get(seq_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self._rows[seq_id] = self._free.pop()
        return row

    def _grow(self) -> None:
        """Double the rows (device rows copied on the device, host rows on the host)."""
        old = self.host.shape[0]
        self.host = np.concatenate([self.host, np.zeros_like(self.host)])
        self.device_rows.grow_to(2 * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))


def _last_of_each(keys: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Indices, in order, of the last valid occurrence of each key (numpy leaves repeated assignments undefined)."""
    where = np.flatnonzero(valid)
    if len(where) == len(np.unique(keys[where])):
        return where
    last = len(where) - 1 - np.unique(keys[where][::-1], return_index=True)[1]
    return where[np.sort(last)]


"""The disk tier of the prefix cache: KV blocks in files that outlive the engine, shared by engines.

The host tier writes blocks through with :meth:`DiskTier.put` (queued, written by one background
thread); a prefix lookup asks :meth:`DiskTier.find` (the index only, no I/O) and loads the hit
with :meth:`DiskTier.read`. A block is a hit only if its hash, its parent hash and its token ids
all match the request, as in the device pool. The directory is scanned at construction and, with
``refresh_interval_s``, rescanned on a background thread, so the files other engines write into a
shared directory are found while this one runs (:meth:`DiskTier.refresh` rescans at once). The file format is in
:mod:`paged_kv.tiers.disk_format`, the rules for engines sharing a directory in
:mod:`paged_kv.tiers.disk_store`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_kv.config import check_refresh_interval
from paged_kv.errors import ClosedError, check_int, check_type, describe
from paged_kv.tiers.disk_checks import check_capacity, check_chain, check_put, prepare_directory
from paged_kv.tiers.disk_format import DiskBlock, file_bytes
from paged_kv.tiers.disk_index import Change
from paged_kv.tiers.disk_queue import WriteQueue, batch, joined, rows
from paged_kv.tiers.disk_store import DiskStore, Loaded
from paged_kv.tiers.fingerprint import ModelFingerprint

__all__ = ["DiskBlock", "DiskTier", "DiskTierStats", "ModelFingerprint"]

MAX_BLOCKS_PER_FILE = 1024
DEFAULT_MAX_PENDING_BYTES = 1 << 30  # queued tensor bytes past this drop the oldest queued writes
READ_THREADS = min(4, os.cpu_count() or 1)  # files of one read load at once (I/O and checksums release the GIL)
logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class DiskTierStats:
    """A snapshot of a disk tier's counters."""

    num_blocks: int  # blocks indexed
    num_files: int  # files indexed (of this model)
    bytes_used: int  # their sizes
    capacity_bytes: int
    hits: int  # blocks read and verified
    bytes_read: int
    bytes_written: int
    files_skipped: int  # corrupt, truncated, foreign or unreadable files met (each counted once)
    writes_dropped: int  # blocks whose write was dropped (queue over its limit, or a write error)


class DiskTier:
    """KV blocks of one model in a directory of safetensors files, within a byte budget.

    Writes queued at exit without :meth:`close` (or :meth:`flush`) are lost; at worst they leave
    temporary files, which later scans delete once stale. ``refresh_interval_s``: seconds between
    background rescans of the directory (None or 0: only at construction and on :meth:`refresh`).
    """

    def __init__(self, directory: str | os.PathLike, *, capacity_bytes: int, fingerprint: ModelFingerprint,
                 blocks_per_file: int = 8, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 refresh_interval_s: float | None = None) -> None:  # fmt: skip
        check_type("fingerprint", fingerprint, ModelFingerprint, "a ModelFingerprint")
        check_int("blocks_per_file", blocks_per_file, low=1, high=MAX_BLOCKS_PER_FILE)
        check_int("max_pending_bytes", max_pending_bytes, low=1)
        interval = check_refresh_interval("refresh_interval_s", refresh_interval_s)
        one_block_file = file_bytes(fingerprint, 1)
        capacity = check_capacity(capacity_bytes, one_block_file)
        self.fingerprint = fingerprint
        self._store = DiskStore(prepare_directory(directory), fingerprint, capacity)
        self._per_file = min(blocks_per_file, capacity // one_block_file)  # k blocks <= k one-block files: fits
        self._cond = threading.Condition(self._store.lock)  # one lock for the index and the queue
        self._queue = WriteQueue(max_pending_bytes)
        self._busy = self._closed = self._stopping = False
        self._store.refresh()
        self._writer = threading.Thread(target=self._write_loop, name="paged-kv-disk-writer", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="paged-kv-disk-reader")
        self._rescanner: threading.Thread | None = None
        if interval is not None:
            self._rescanner = threading.Thread(target=self._rescan_loop, args=(interval,), name="paged-kv-disk-rescan",
                                               daemon=True)  # fmt: skip
            self._rescanner.start()

    @property
    def directory(self) -> Path:
        """The directory of the files."""
        return self._store.directory

    @property
    def capacity_bytes(self) -> int:
        """The byte budget of this model's files in the directory."""
        return self._store.capacity_bytes

    # -- lookups ----------------------------------------------------------------------------------------
    def find(self, parent: bytes, hashes: Sequence[bytes], contents: Sequence[bytes], limit: int) -> int:
        """How many leading blocks of the chain are indexed (hash, parent and tokens all match); no I/O."""
        limit = check_chain(parent, hashes, contents, limit)
        with self._cond:
            return len(self._store.index.chain(parent, hashes, contents, limit))

    def read(self, parent: bytes, hashes: Sequence[bytes], contents: Sequence[bytes], limit: int
             ) -> tuple[list[DiskBlock], torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """The leading blocks of the chain read and verified, with kv [n, 2, L, B, H, D] and scales [n, 2, L, B, H].

        Stops before the first block whose file is missing, corrupt or foreign (that file leaves
        the index). kv is None when no block was read; scales is None then and for float dtypes.
        """
        limit = check_chain(parent, hashes, contents, limit)
        with self._cond:
            wanted = self._store.index.chain(parent, hashes, contents, limit)
            runs = self._store.index.plan(wanted)
        jobs, start = [], 0
        for name, slots in runs:
            jobs.append((name, dict(zip(slots, wanted[start : start + len(slots)]))))
            start += len(slots)
        got: list[DiskBlock] = []
        kv_parts, scale_parts = [], []
        with contextlib.closing(self._load_all(jobs)) as loads:  # closing it ends every load before read returns
            for (_, slots), loaded in zip(runs, loads):
                if loaded is None:
                    break
                _, kv, scales = loaded
                kv_parts.append(rows(kv, slots))
                scale_parts += [] if scales is None else [rows(scales, slots)]
                got += wanted[len(got) : len(got) + len(slots)]
        with self._cond:
            self._store.counts["hits"] += len(got)
        if not got:
            return [], None, None
        return got, joined(kv_parts), joined(scale_parts) if scale_parts else None

    def _load_all(self, jobs: list[tuple[str, dict[int, DiskBlock]]]) -> Iterator[Loaded | None]:
        """Each file loaded and verified, in order: on the reader threads when there are several.

        Closed early (the read stopped at a miss), it cancels the loads not started and waits for the
        running ones, so no load outlives the read: none deletes a corrupt file or marks one used later.
        """
        with self._cond:  # close() shuts the pool down only after it set _closed under this lock
            parallel = len(jobs) > 1 and not self._closed
            futures = [self._readers.submit(self._store.load, *job) for job in jobs] if parallel else []
        if not parallel:
            yield from (self._store.load(*job) for job in jobs)
            return
        try:
            yield from (future.result() for future in futures)
        finally:
            for future in futures:
                future.cancel()
            wait(futures)

    # -- writes -----------------------------------------------------------------------------------------
    def put(self, blocks: Sequence[DiskBlock], kv: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Queue blocks for writing (kv [n, 2, L, B, H, D], scales [n, 2, L, B, H] or None); returns at once.

        The tier takes ownership of the tensors. Blocks already indexed or queued are skipped.
        Past ``max_pending_bytes`` queued, the oldest queued writes are dropped and counted.
        """
        blocks = check_put(self.fingerprint, blocks, kv, scales)
        with self._cond:
            if self._closed:
                raise ClosedError(describe("self", "a closed DiskTier", "an open DiskTier to put blocks in"))
            indexed, pending, keep, seen = self._store.index.blocks, self._queue.pending, [], set()
            for i, block in enumerate(blocks):
                if block.hash not in indexed and block.hash not in pending and block.hash not in seen:
                    keep.append(i)
                    seen.add(block.hash)
            for start in range(0, len(keep), self._per_file):
                dropped = self._queue.push(batch(blocks, kv, scales, keep[start : start + self._per_file]))
                self._store.counts["writes_dropped"] += dropped
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every queued write is on disk and indexed, and the budget kept."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and not self._busy)

    def _write_loop(self) -> None:
        """The writer thread: each queued batch becomes one file, then the budget is kept."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:
                    return
                write = self._queue.pop()
                self._busy = True
                fresh = [i for i, b in enumerate(write.blocks) if b.hash not in self._store.index.blocks]
            try:
                if fresh:  # blocks a refresh indexed meanwhile are not written again
                    part = batch(write.blocks, write.kv, write.scales, fresh)
                    self._store.write(part.blocks, part.kv, part.scales)
                    self._store.evict()
            except Exception:  # noqa: BLE001 -- no caller to raise to: log, count the loss, keep writing
                logger.exception("disk tier: writing %d blocks failed", len(write.blocks))
                with self._cond:
                    self._store.counts["writes_dropped"] += len(write.blocks)
            finally:
                with self._cond:
                    self._queue.done(write)
                    self._busy = False
                    self._cond.notify_all()

    # -- the directory, life and reports ----------------------------------------------------------------
    def refresh(self) -> None:
        """Rescan the directory: index files other engines wrote since, forget vanished ones, keep the budget."""
        self._store.refresh()

    def _rescan_loop(self, interval: float) -> None:
        """The rescan thread: a refresh every ``interval`` seconds until :meth:`close` begins (which wakes it)."""
        while True:
            with self._cond:  # the wait releases the lock: lookups, puts and the writer go on meanwhile
                if self._cond.wait_for(lambda: self._closed, timeout=interval):
                    return
            try:
                self._store.refresh()  # takes the index lock only between its I/O
            except Exception:  # noqa: BLE001 -- no caller to raise to: log it, and the next rescan tries again
                logger.exception("disk tier: rescanning %s failed", self.directory)

    def close(self) -> None:
        """Stop the rescans, flush, then stop the writer thread; later calls do nothing."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()  # wakes the rescan thread out of its wait
        if self._rescanner is not None:
            self._rescanner.join()  # at most the scan it is running
        self.flush()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._writer.join()
        self._readers.shutdown()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def take_changes(self) -> list[Change]:
        """The journal since the last call: ("stored", blocks) entering the index, ("removed", blocks) leaving it."""
        with self._cond:
            return self._store.index.take_changes()

    def indexed_blocks(self) -> list[DiskBlock]:
        """Every block in the index now (a snapshot)."""
        with self._cond:
            return list(self._store.index.blocks.values())

    @property
    def stats(self) -> DiskTierStats:
        """The counters now."""
        with self._cond:
            index = self._store.index
            return DiskTierStats(num_blocks=len(index.blocks), num_files=len(index.files), bytes_used=index.bytes_used,
                                 capacity_bytes=self.capacity_bytes, **self._store.counts)  # fmt: skip


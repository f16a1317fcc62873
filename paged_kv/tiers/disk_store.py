"""One model's block files in one directory: the index under a lock, scans, verified loads, writes, eviction.

Multi-engine rules (several processes may share the directory):
- a file is written once under its content-derived name and never modified; engines only create,
  rename over, ``os.utime`` (on use) and delete files;
- each engine indexes the files of its own model (fingerprint) that it wrote or found by a scan;
  other models' files are known by their names and skipped unread;
- the byte budget counts the indexed files; past it the least recently used (oldest mtime, read
  again just before the delete) are deleted; a file already gone is fine;
- a file gone between index and read is a miss; a corrupt file of our model leaves the index and
  is deleted; a file of another model is never read, deleted or counted in the budget;
- a file of our model that cannot be read now (an I/O error, or a header that no longer lists the
  blocks indexed) leaves the index but stays, and every later scan tries it again.

Within one engine, scans (``refresh``) may run on one thread while the writer writes and evicts on
another and readers load: ``lock`` guards the index and is never held across I/O; two more locks,
held across I/O, serialize the scans with each other and the evictions with each other (a scan
takes ``_scanning`` then, to evict, ``_evicting``; nothing takes them the other way round).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from paged_kv.tiers.disk_files import delete_quietly, remove_if_stale, write_atomically
from paged_kv.tiers.disk_format import (
    TMP_PREFIX,
    DiskBlock,
    RejectedFile,
    decode,
    encode,
    file_name,
    name_tag,
    read_header,
)  # fmt: skip
from paged_kv.tiers.disk_index import DiskIndex, FileEntry
from paged_kv.tiers.fingerprint import ModelFingerprint

Loaded = tuple[tuple[DiskBlock, ...], torch.Tensor, torch.Tensor | None]  # a file's blocks, kv, scales
COUNTERS = ("hits", "bytes_read", "bytes_written", "files_skipped", "writes_dropped")
logger = logging.getLogger(__name__)


class DiskStore:
    """The files of one model in a directory, indexed; every method takes ``lock`` itself, never across I/O."""

    def __init__(self, directory: Path, fingerprint: ModelFingerprint, capacity_bytes: int) -> None:
        self.directory, self.fingerprint, self.capacity_bytes = directory, fingerprint, capacity_bytes
        self.lock = threading.RLock()  # guards the index, the counters and the skipped files
        # held across I/O, never by lookups or reads: one scan at a time, one eviction at a time (two evictions
        # at once could both pick the oldest file, and one delete it after the other saw it used again)
        self._scanning, self._evicting = threading.Lock(), threading.Lock()
        self.index = DiskIndex()
        self.counts = dict.fromkeys(COUNTERS, 0)
        # files skipped and still there (counted and logged once) -> whether a scan tries them again
        self._skipped: dict[str, bool] = {}

    def refresh(self) -> None:
        """Rescan: index our model's files written since, forget vanished ones, keep the budget."""
        with self._scanning:
            self._rescan()

    def _rescan(self) -> None:
        """One scan: the listing and the new files' headers without ``lock``, each index change under it.

        A name listed but indexed meanwhile (our writer's file) only gets its size and mtime again;
        a name indexed but not listed stays if it exists (written after the listing); a file that
        vanishes before its header is read is skipped, as a miss.
        """
        ours: set[str] = set()
        try:
            with os.scandir(self.directory) as entries:
                names = [e.name for e in entries]
        except FileNotFoundError:  # removed under us: every file is gone; later writes need the directory
            names = []
            self.directory.mkdir(parents=True, exist_ok=True)
        for name in names:
            tag = name_tag(name)
            if name.startswith(TMP_PREFIX):
                remove_if_stale(self.directory / name)
            elif tag == self.fingerprint.tag:
                ours.add(name)
            elif tag is not None:
                self._note_skip(name, RejectedFile("another model's file (by its name)", foreign=True))
        with self.lock:
            unlisted = set(self.index.files) - ours
            new = sorted(name for name in ours - set(self.index.files) if self._skipped.get(name, True))
        for name in unlisted:  # gone, or written and indexed after the listing
            if not (self.directory / name).exists():
                self._forget(name)
        for name in new:
            self._scan(name)
        self.evict()

    def _scan(self, name: str) -> None:
        """Index a file from its header, or skip it."""
        path = self.directory / name
        try:
            blocks = read_header(path, self.fingerprint)
            stat = path.stat()
        except FileNotFoundError:
            return
        except OSError as err:
            self._reject(name, RejectedFile(f"unreadable ({err})"), delete=False)
            return
        except RejectedFile as rejected:
            self._reject(name, rejected)
            return
        with self.lock:
            self.index.add(name, FileEntry(size=stat.st_size, mtime_ns=stat.st_mtime_ns, blocks=blocks))
            self._skipped.pop(name, None)  # it serves again: a later failure is a new one

    def load(self, name: str, expect: dict[int, DiskBlock]) -> Loaded | None:
        """A file's verified blocks and tensors, marked used, if it holds ``expect`` (slot -> block).

        None if it cannot serve: gone (a miss), unreadable, corrupt or foreign; it leaves the index.
        """
        path = self.directory / name
        try:
            data = path.read_bytes()
            loaded = decode(data, self.fingerprint)
        except FileNotFoundError:
            self._forget(name)
            return None
        except OSError as err:
            self._reject(name, RejectedFile(f"unreadable ({err})"), delete=False)
            return None
        except RejectedFile as rejected:
            self._reject(name, rejected)
            return None
        if any(loaded[0][slot] != block for slot, block in expect.items()):
            self._reject(name, RejectedFile("its header no longer lists the indexed blocks"), delete=False)
            return None
        with self.lock:
            self.counts["bytes_read"] += len(data)
        self._mark_used(name)
        return loaded

    def _mark_used(self, name: str) -> None:
        """Set a file's mtime to now, the LRU mark every engine sees.

        The kernel stamps it (not ``time.time_ns()``), so it compares right with the mtimes of files
        written later, whose clock may be coarser than Python's.
        """
        path = self.directory / name
        try:
            os.utime(path)
            mtime = path.stat().st_mtime_ns
        except OSError:
            return  # deleted meanwhile: the data in hand is verified all the same
        with self.lock:
            self.index.touch(name, mtime)

    def write(self, blocks: list[DiskBlock], kv: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Write one file atomically (kv [n, 2, L, B, H, D], scales [n, 2, L, B, H] or None) and index it."""
        data = encode(self.fingerprint, blocks, kv, scales)
        name = file_name(self.fingerprint, blocks)
        write_atomically(self.directory, name, data)
        try:
            mtime = (self.directory / name).stat().st_mtime_ns
        except FileNotFoundError:
            return  # another engine evicted it already
        with self.lock:
            self.index.add(name, FileEntry(size=len(data), mtime_ns=mtime, blocks=tuple(blocks)))
            self.counts["bytes_written"] += len(data)

    def evict(self) -> None:
        """Delete least recently used files until the indexed bytes fit the budget.

        A candidate's mtime is read again first: another engine may have used the file since.
        """
        with self._evicting:
            self._evict()

    def _evict(self) -> None:
        """The eviction loop (``_evicting`` held)."""
        rechecked: set[str] = set()
        while True:
            with self.lock:
                if self.index.bytes_used <= self.capacity_bytes:
                    return
                name, entry = self.index.oldest()
            try:
                mtime = (self.directory / name).stat().st_mtime_ns
            except FileNotFoundError:
                mtime = None
            if mtime is not None and mtime > entry.mtime_ns and name not in rechecked:
                rechecked.add(name)
                with self.lock:
                    self.index.touch(name, mtime)
                continue
            self._forget(name)
            if mtime is not None:
                delete_quietly(self.directory / name)

    def _forget(self, name: str) -> None:
        """Drop a file from the index."""
        with self.lock:
            self.index.remove(name)

    def _reject(self, name: str, rejected: RejectedFile, *, delete: bool = True) -> None:
        """Drop a file that cannot serve from the index; delete it if it is a corrupt file of our model.

        ``delete=False``: the file may serve later (unreadable now, or rewritten since it was indexed),
        so it stays and later scans try it again.
        """
        self._forget(name)
        self._note_skip(name, rejected, retry=not delete)
        if delete and not rejected.foreign and delete_quietly(self.directory / name):
            with self.lock:
                self._skipped.pop(name, None)  # a new file under this name is checked afresh

    def _note_skip(self, name: str, rejected: RejectedFile, *, retry: bool = False) -> None:
        """Count and log a skipped file, once per file; ``retry``: whether later scans try it again."""
        with self.lock:
            known = name in self._skipped
            self._skipped[name] = retry
            if known:
                return
            self.counts["files_skipped"] += 1
        logger.warning("disk tier: skipped %s in %s: %s", name, self.directory, rejected)

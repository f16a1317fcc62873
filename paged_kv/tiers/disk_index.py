"""The disk tier's in-memory index: which file holds which block, the bytes they take, and a journal.

Invariants (the caller holds one lock around every call; nothing here does I/O):
- a block hash is indexed if and only if at least one indexed file holds it with the parent and
  tokens first seen for that hash (a file that claims the same hash with other content adds no
  location for it: it can never serve that hash);
- ``bytes_used`` is the sum of the indexed files' sizes;
- the journal's "stored" minus its "removed" blocks, over the index's life, are the indexed blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from paged_kv.tiers.disk_format import DiskBlock

Change = tuple[str, list[DiskBlock]]  # ("stored" | "removed", blocks)


@dataclass(slots=True)
class FileEntry:
    """An indexed file: its size, its last use (mtime) and the blocks it holds, slot by slot."""

    size: int
    mtime_ns: int
    blocks: tuple[DiskBlock, ...]
    order: int = field(default=0)  # breaks mtime ties: later use, larger order


class DiskIndex:
    """Block hash to (file, slot) locations over the files of one model in one directory."""

    def __init__(self) -> None:
        self.files: dict[str, FileEntry] = {}
        self.blocks: dict[bytes, DiskBlock] = {}  # hash -> the block's identity
        self._locations: dict[bytes, dict[str, int]] = {}  # hash -> {file name: slot}, in arrival order
        self.bytes_used = 0
        self._changes: list[Change] = []
        self._clock = itertools.count(1)

    def add(self, name: str, entry: FileEntry) -> None:
        """Index a file (a known name only gets its new size and mtime)."""
        old = self.files.get(name)
        entry.order = next(self._clock)
        self.files[name] = entry
        self.bytes_used += entry.size - (old.size if old else 0)
        if old is not None:
            entry.blocks = old.blocks  # same name, same content
            return
        stored = []
        for slot, block in enumerate(entry.blocks):
            known = self.blocks.get(block.hash)
            if known is None:
                self.blocks[block.hash] = block
                self._locations[block.hash] = {name: slot}
                stored.append(block)
            elif known == block:
                self._locations[block.hash][name] = slot
        if stored:
            self._changes.append(("stored", stored))

    def remove(self, name: str) -> FileEntry | None:
        """Forget a file (None if it was not indexed); blocks it alone held leave the index."""
        entry = self.files.pop(name, None)
        if entry is None:
            return None
        self.bytes_used -= entry.size
        removed = []
        for block in entry.blocks:
            where = self._locations.get(block.hash)
            if where is not None and where.pop(name, None) is not None and not where:
                del self._locations[block.hash], self.blocks[block.hash]
                removed.append(block)
        if removed:
            self._changes.append(("removed", removed))
        return entry

    def chain(self, parent: bytes, hashes: Sequence[bytes], contents: Sequence[bytes], limit: int) -> list[DiskBlock]:
        """The indexed leading blocks of a chain: hash, parent and tokens must all match, at most ``limit``."""
        found: list[DiskBlock] = []
        for h, tokens in zip(hashes[: max(limit, 0)], contents):
            block = self.blocks.get(h)
            if block is None or block.parent != parent or block.tokens != tokens:
                break
            found.append(block)
            parent = h
        return found

    def plan(self, blocks: Sequence[DiskBlock]) -> list[tuple[str, list[int]]]:
        """Runs of consecutive indexed blocks read from one file each: (file name, slots), in block order.

        A block stays in the previous block's file when that file holds it too, so runs are long.
        """
        runs: list[tuple[str, list[int]]] = []
        current = None
        for block in blocks:
            where = self._locations[block.hash]
            name = current if current in where else next(iter(where))
            if name != current:
                runs.append((name, []))
                current = name
            runs[-1][1].append(where[name])
        return runs

    def touch(self, name: str, mtime_ns: int) -> None:
        """Record a use of a file (no-op if it left the index)."""
        entry = self.files.get(name)
        if entry is not None:
            entry.mtime_ns, entry.order = max(entry.mtime_ns, mtime_ns), next(self._clock)

    def oldest(self) -> tuple[str, FileEntry] | None:
        """The least recently used file (smallest mtime, then least recent here), or None."""
        if not self.files:
            return None
        return min(self.files.items(), key=lambda item: (item[1].mtime_ns, item[1].order))

    def take_changes(self) -> list[Change]:
        """The journal since the last call, oldest first, and clear it."""
        changes, self._changes = self._changes, []
        return changes

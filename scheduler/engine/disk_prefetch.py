"""Reads of waiting prompts' blocks from the disk tier, in the background, into the host tier.

A prompt whose blocks past its device and host hits are on disk is not admitted until they
are read: :meth:`DiskPrefetch.prefetch` starts the read on a reader thread and answers False
while it runs, so the scheduler keeps the request waiting (in its place) and the running
requests keep decoding. The data lands in the host tier on the scheduler's thread, at the
first call after the read is done; only then does the request's admission count it as cached.

Invariant: the block manager is touched on the scheduler's thread only; the reader thread
touches the disk tier alone (its index has a lock of its own).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from paged_kv.block_hash import BlockHashes
from paged_kv.block_manager import BlockManager
from paged_kv.host_tier import BlockRecord
from paged_kv.tiers.disk_tier import DiskTier

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Read:
    """One sequence's read in flight: blocks, kv [n, 2, L, B, H, D] and scales when done."""

    future: Future
    retry: bool  # a second read, after the first no longer continued the upper tiers' blocks


class DiskPrefetch:
    """The disk reads of waiting sequences, one at a time on a reader thread, keyed by sequence id."""

    def __init__(self, bm: BlockManager, disk: DiskTier) -> None:
        self.bm = bm
        self.disk = disk
        self._reads: dict[int, _Read] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="paged-kv-disk-prefetch")

    @property
    def num_reading(self) -> int:
        """Sequences whose read has not landed in the host tier yet."""
        return len(self._reads)

    def prefetch(
        self, key: int, token_ids: list[int], hashes: BlockHashes | None, cache_salt: str | None, *, wait: bool = False
    ) -> bool:
        """Whether sequence ``key``'s blocks on disk are in the host tier (or there are none); ``wait``: make it so.

        The first call looks the prompt up in the disk's index (no I/O) and starts a read of the
        hit; a later call after the read is done fills the host tier with it and answers True.
        """
        read = self._reads.get(key)
        if read is None:
            read = self._start(key, token_ids, hashes, cache_salt, retry=False)
        while read is not None:
            if not (wait or read.future.done()):
                return False
            del self._reads[key]
            if self._land(read, token_ids, hashes, cache_salt) or read.retry:
                return True
            read = self._start(key, token_ids, hashes, cache_salt, retry=True)
        return True

    def forget(self, key: int) -> None:
        """Drop sequence ``key``'s read, if any: it left the queue (its result, if it comes, is discarded)."""
        read = self._reads.pop(key, None)
        if read is not None:
            read.future.cancel()

    def close(self) -> None:
        """Drop every read and stop the reader thread (after the read it is running); idempotent."""
        for key in list(self._reads):
            self.forget(key)
        self._reader.shutdown(wait=True)

    def _start(
        self, key: int, token_ids: list[int], hashes: BlockHashes | None, cache_salt: str | None, *, retry: bool
    ) -> _Read | None:
        """Start reading the blocks the disk holds past the prompt's device and host hits; None if it holds none."""
        parent, chain, contents = self.bm.chain_past_cache(token_ids, cache_salt=cache_salt, hashes=hashes)
        n = self.disk.find(parent, chain, contents, len(chain)) if chain else 0
        if n == 0:
            return None
        future = self._reader.submit(self.disk.read, parent, chain[:n], contents[:n], n)
        read = self._reads[key] = _Read(future=future, retry=retry)
        return read

    def _land(self, read: _Read, token_ids: list[int], hashes: BlockHashes | None, cache_salt: str | None) -> bool:
        """Fill the host tier with the part of a finished read that continues what the upper tiers hold now.

        While it ran, the device or host tier may have gained the read's first blocks (another
        request computed them: those are skipped) or lost the blocks it continues (False: it no
        longer connects, and the caller reads again once).
        """
        try:
            blocks, kv, scales = read.future.result()
        except Exception:  # noqa: BLE001 -- a failed read is a miss: the request computes those tokens
            logger.exception("disk tier: a prefetch read failed")
            return True
        if not blocks:
            return True
        parent, chain, _ = self.bm.chain_past_cache(token_ids, cache_salt=cache_salt, hashes=hashes)
        at = next((i for i, b in enumerate(blocks) if b.parent == parent), None)
        if at is None:  # the upper tiers now hold all of it and more (done), or lost what it continues
            return not chain
        records = [BlockRecord(b.hash, b.parent, b.tokens) for b in blocks[at:]]
        self.bm.fill_host(records, (kv[at:], None if scales is None else scales[at:]))
        return True

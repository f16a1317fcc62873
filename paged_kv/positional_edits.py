"""Edits of sequences by position, for the compatibility facades: in-place writes, truncation, a
sliding window, and a growing pool.

The engine never needs these: it grows sequences by appending ids and lets the prefix cache
follow. The facades address slots by position, as the cache APIs they present do.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from paged_kv.block_pool import BlockId, CopyOp, SeqId
from paged_kv.config import MAX_BLOCKS
from paged_kv.errors import OutOfBlocksError, check_int


class PositionalEdits:
    """The facades' edits by position of a :class:`~paged_kv.block_manager.BlockManager`, which inherits them.

    Relies on the manager's ``gpu``, ``config``, ``block_size`` and ``_version`` (bumped by every change), its
    private ``_get_resident``, ``_blocks_for``, ``_blocks_to_write``, ``_copy_on_write``, ``_freeze``
    (stop caching a sequence, keep records of its full blocks) and ``_log`` (the journal), and the
    fields of its per-sequence ``_Seq`` (``blocks``, ``num_tokens``, ``hashes``, ``frozen``, ``priority``). The
    manager's rules hold here: a method that raises changes nothing, every table entry a method sets
    is journaled, and a caller's BlockHashes is never cut (a private copy is).
    """

    def can_prepare_write(self, seq_id: SeqId, start: int, end: int) -> bool:
        """Whether ``prepare_write`` over ``[start, end)`` would find enough free blocks."""
        return len(self._shared_in(self._get_resident(seq_id).blocks, start, end)) <= self.gpu.num_free

    def prepare_write(self, seq_id: SeqId, start: int, end: int) -> list[CopyOp]:
        """Make the blocks holding positions ``[start, end)`` private before an in-place overwrite.

        Shared blocks are copied (the returned (src, dst) pairs are owed to the
        device); private cached blocks leave the prefix cache, since their
        content is about to change.
        """
        seq = self._get_resident(seq_id)
        cow = self._shared_in(seq.blocks, start, end)
        if len(cow) > self.gpu.num_free:
            raise OutOfBlocksError(f"end={end}: needs {len(cow)} blocks, expected at most {self.gpu.num_free} free")
        if end == start:  # an empty range writes nothing: nothing to copy, unhash or forget
            return []
        copies = self._copy_on_write(seq_id, seq, cow)
        written = seq.blocks[start // self.block_size : self._blocks_for(end)]
        cached = [b for b in written if self.gpu.hash_of[b] is not None]
        for b in cached:
            self.gpu.unregister(b)
        rewritten = start < min(end, seq.num_tokens) and (seq.hashes is not None or seq.frozen is not None)
        if rewritten:
            self._freeze(seq, start)  # the slots from ``start`` no longer hold the ids they were given
        if copies or cached or rewritten:  # else nothing changed: private, uncached slots of an uncached sequence
            self._version += 1
        return copies

    def _shared_in(self, table: list[BlockId], start: int, end: int) -> list[int]:
        """Logical indices of the shared blocks of ``table`` holding positions ``[start, end)``, both checked."""
        check_int("end", end, low=0, high=len(table) * self.block_size)
        check_int("start", start, low=0, high=end)
        indices = range(start // self.block_size, self._blocks_for(end)) if end > start else range(0)
        return [i for i in indices if self.gpu.ref_counts[table[i]] > 1]

    def num_blocks_to_write_all(self, requests: Iterable[tuple[SeqId, int, int]]) -> int:
        """Free blocks that readying positions ``[start, end)`` of each ``(seq_id, start, end)`` in turn takes.

        Per sequence, as ``append`` up to ``end`` followed by ``prepare_write(start,
        end)`` does: new blocks past its table, plus a private copy of each shared
        block in the range. Copy-on-write gives up the shared block, so when ``k``
        listed sequences share a block and all write it, ``k - 1`` copies are
        made: the last writer holds it alone. Each sequence may appear once.
        """
        return self._blocks_to_write(requests)

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Shrink a sequence to its first ``num_tokens`` tokens; whole blocks past them are freed (``num_tokens``
        equal to its count frees only lookahead blocks, its hashes kept as they are).

        The journal records nothing for the entries dropped (a reader never reads past a table's end).
        """
        seq = self._get_resident(seq_id)
        check_int("num_tokens", num_tokens, low=0, high=seq.num_tokens)
        self._version += 1
        keep = self._blocks_for(num_tokens)
        self.gpu.release(reversed(seq.blocks[keep:]), seq.priority)
        del seq.blocks[keep:]
        if num_tokens == seq.num_tokens:  # only lookahead blocks dropped: no token cut, the hashes hold
            return
        if seq.hashes is not None:
            seq.hashes = seq.hashes.copy(num_tokens)  # a private copy: a caller's object is only ever extended
        else:
            self._freeze(seq, num_tokens)  # cut the records swap_in would offer again
        seq.num_tokens = num_tokens

    def drop_front(self, seq_id: SeqId, num_blocks: int) -> None:
        """Release the first ``num_blocks`` blocks of a sequence (a sliding window); later positions shift down.

        Position ``p`` becomes ``p - num_blocks * block_size`` and ``num_tokens``
        shrinks alike (to 0 at least). Full blocks computed before the drop stay
        in the prefix cache under their hashes, but the sequence registers no new
        ones: what is computed from now on has not seen the dropped tokens.
        """
        seq = self._get_resident(seq_id)
        check_int("num_blocks", num_blocks, low=0, high=len(seq.blocks))
        if not num_blocks:
            return
        self._version += 1
        self.gpu.release(reversed(seq.blocks[:num_blocks]), seq.priority)  # like free: the head is evicted last
        del seq.blocks[:num_blocks]
        self._freeze(seq, seq.num_tokens)
        if seq.frozen is not None and num_blocks <= len(seq.frozen.hashes):
            seq.frozen.drop_front(num_blocks)  # swap_in re-registers the rest with their true parent
        else:
            seq.frozen = None
        seq.num_tokens = max(0, seq.num_tokens - num_blocks * self.block_size)
        self._log(seq_id, seq.blocks)

    def add_blocks(self, num_blocks: int) -> None:
        """Grow the GPU pool by ``num_blocks`` free blocks (the storage must grow alike)."""
        check_int("num_blocks", num_blocks, low=0, high=MAX_BLOCKS - self.gpu.num_blocks)
        self._version += 1
        self.gpu.grow(num_blocks)
        # config.num_blocks is the pool's size, so the watermark stays its fraction of the grown pool (as vLLM's)
        self.config = replace(self.config, num_blocks=self.gpu.num_blocks)

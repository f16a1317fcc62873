"""A fixed pool of KV blocks: reference counts, free blocks and the prefix cache.

Invariants (verified by :meth:`BlockPool.check`):
- every block is exactly one of: free (ref 0, no hash), cached-evictable
  (ref 0, has a hash) or in use (ref > 0);
- ``_cached[h] == b`` if and only if ``hash_of[b] == h``.
Every operation is O(1) per block: the free blocks form a stack, the evictable
ones an ``OrderedDict`` in LRU order (oldest first) per eviction priority. A block takes
the priority of the release that left it unreferenced (vLLM's request ``priority``: a
lower value is more important); eviction empties the least important level first, each
level oldest first.

With ``journal=True`` the pool records every change of its cache index, in order, as
``(kind, block, hash, parent, tokens)``: ``STORED`` when a block is registered under a hash,
``EVICTED`` when an unreferenced cached block is taken for reuse (its content still intact
until the new owner writes it), ``DROPPED`` when an in-use block's hash is forgotten (it is
about to be overwritten), and ``(CLEARED, -1, None, None, None)`` when the whole index is reset.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from paged_kv.block_hash import BlockHash
from paged_kv.errors import OutOfBlocksError, PagedKVError

BlockId = int
CopyOp = tuple[BlockId, BlockId]  # (src, dst): a block copy owed to the device
SeqId = Hashable  # a block manager's name for a sequence
TokenKey = tuple[int, ...] | bytes  # a block's token ids, compared on every hit (the manager uses int64 bytes)
CacheRecord = tuple[str, BlockId, "BlockHash | None", "BlockHash | None", "TokenKey | None"]
STORED, EVICTED, DROPPED, CLEARED = "stored", "evicted", "dropped", "cleared"


class BlockPool:
    """Hands out block ids, counts references and keeps freed full blocks cached for reuse."""

    def __init__(self, num_blocks: int, name: str = "gpu", *, journal: bool = False) -> None:
        self.num_blocks = num_blocks
        self.name = name
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[BlockHash | None] = [None] * num_blocks  # each block's cache key; read-only outside
        self._parent: list[BlockHash | None] = [None] * num_blocks
        self._tokens: list[TokenKey | None] = [None] * num_blocks
        self._free: list[BlockId] = list(range(num_blocks - 1, -1, -1))  # pop() yields 0 first
        self._evictable: dict[int, OrderedDict[BlockId, None]] = {}  # priority -> LRU order, oldest first
        self._level = [0] * num_blocks  # an evictable block's priority
        self._num_evictable = 0
        self._cached: dict[BlockHash, BlockId] = {}
        self.num_evictions = 0
        self.journal: list[CacheRecord] | None = [] if journal else None  # see the module docstring

    def grow(self, n: int) -> None:
        """Add ``n`` free blocks with the next ids (existing ids stay valid)."""
        start = self.num_blocks
        self.num_blocks += n
        self.ref_counts += [0] * n
        self.hash_of += [None] * n
        self._parent += [None] * n
        self._tokens += [None] * n
        self._level += [0] * n
        self._free[:0] = range(start + n - 1, start - 1, -1)  # older free ids still pop first

    # -- counts -----------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: never-cached free plus cached-evictable."""
        return len(self._free) + self._num_evictable

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        """Cached blocks with no reference, kept until their slot is needed."""
        return self._num_evictable

    # -- allocation -------------------------------------------------------
    def take(self, n: int) -> list[BlockId]:
        """Hand out ``n`` blocks with refcount 1: uncached ones first, then evict LRU cached ones."""
        if n > self.num_free:
            raise OutOfBlocksError(
                f"num_blocks={n}: expected at most {self.num_free} free {self.name} blocks"
            )
        free = self._free
        k = min(n, len(free))
        blocks = free[len(free) - k :]
        blocks.reverse()  # lowest ids first, for readable tables
        del free[len(free) - k :]
        if n > k:
            blocks += self._evict_oldest_n(n - k)
        refs = self.ref_counts
        for b in blocks:
            refs[b] = 1
        return blocks

    def _evict_oldest_n(self, n: int) -> list[BlockId]:
        """Drop the ``n`` least recently freed cached blocks from the cache and return them."""
        cached, hashes, parents, tokens = self._cached, self.hash_of, self._parent, self._tokens
        blocks = []
        journal = self.journal
        level = self._least_important()
        for _ in range(n):
            if not level:
                level = self._least_important()
            block = level.popitem(last=False)[0]
            if journal is not None:
                journal.append((EVICTED, block, hashes[block], parents[block], tokens[block]))
            del cached[hashes[block]]
            hashes[block] = parents[block] = tokens[block] = None
            blocks.append(block)
        self.num_evictions += n
        self._num_evictable -= n
        return blocks

    def _least_important(self) -> OrderedDict[BlockId, None]:
        """The non-empty level of evictable blocks evicted first (the highest priority value); empty ones dropped."""
        evictable = self._evictable
        if len(evictable) == 1:  # one priority in use: the common case
            return next(iter(evictable.values()))
        for p in [p for p, level in evictable.items() if not level]:
            del evictable[p]
        return evictable[max(evictable)]

    def touch(self, block: BlockId) -> None:
        """Add a reference; a cached-evictable block comes back into use."""
        self.touch_all((block,))

    def touch_all(self, blocks: Iterable[BlockId]) -> None:
        """``touch`` each block in turn."""
        refs, evictable, level = self.ref_counts, self._evictable, self._level
        for b in blocks:
            if refs[b] == 0:
                del evictable[level[b]][b]
                self._num_evictable -= 1
            refs[b] += 1

    def count_evictable(self, blocks: Iterable[BlockId]) -> int:
        """How many of ``blocks`` are free but still hold cached content."""
        refs, hashes = self.ref_counts, self.hash_of
        return sum(1 for b in blocks if not refs[b] and hashes[b] is not None)

    def release(self, blocks: Iterable[BlockId], priority: int = 0) -> None:
        """Drop one reference each; at zero a cached block becomes evictable at ``priority`` (most recent last)."""
        refs, hashes, free = self.ref_counts, self.hash_of, self._free
        evictable = self._evictable.get(priority)
        if evictable is None:
            evictable = self._evictable[priority] = OrderedDict()
        level, n = self._level, 0
        for b in blocks:
            refs[b] -= 1
            if refs[b] == 0:
                if hashes[b] is None:
                    free.append(b)
                else:
                    evictable[b] = None
                    level[b] = priority
                    n += 1
        self._num_evictable += n

    # -- prefix cache -----------------------------------------------------
    def lookup_chain(
        self, parent: BlockHash, hashes: Sequence[BlockHash], tokens: Sequence[TokenKey], limit: int
    ) -> list[BlockId]:
        """The longest run of cached blocks along a hash chain (block i's parent is hash i-1), at most ``limit``.

        A block is a hit only if its hash, its parent hash and its token ids all match.
        """
        cached, parents, contents = self._cached, self._parent, self._tokens
        hits: list[BlockId] = []
        for i in range(min(limit, len(hashes))):
            h = hashes[i]
            block = cached.get(h)
            if block is None or parents[block] != parent or contents[block] != tokens[i]:
                break
            hits.append(block)
            parent = h
        return hits

    def chain_ending_at(self, h: BlockHash) -> list[BlockId]:
        """The cached blocks of the hash chain ending at ``h``, last first, back to the first block not cached."""
        cached, parents, blocks = self._cached, self._parent, []
        block = cached.get(h)
        while block is not None:
            blocks.append(block)
            block = cached.get(parents[block])
        return blocks

    def register_chain(
        self, blocks: Iterable[BlockId], hashes: Iterable[BlockHash], parent: BlockHash, tokens: Iterable[TokenKey]
    ) -> None:
        """Record each full in-use block of a hash chain under its hash, unless that content is already cached.

        Block i's parent is hash i-1 (``parent`` for the first).
        """
        cached, block_hashes, parents, contents = self._cached, self.hash_of, self._parent, self._tokens
        journal = self.journal
        for block, h, toks in zip(blocks, hashes, tokens):
            if h not in cached and block_hashes[block] is None:
                cached[h] = block
                block_hashes[block], parents[block], contents[block] = h, parent, toks
                if journal is not None:
                    journal.append((STORED, block, h, parent, toks))
            parent = h

    def unregister(self, block: BlockId) -> None:
        """Forget the content of an in-use block about to be overwritten in place."""
        if self.hash_of[block] is not None:
            self._drop_hash(block)

    def _drop_hash(self, block: BlockId) -> None:
        if self.journal is not None:
            self.journal.append((DROPPED, block, self.hash_of[block], self._parent[block], self._tokens[block]))
        del self._cached[self.hash_of[block]]
        self.hash_of[block] = self._parent[block] = self._tokens[block] = None

    def cached_blocks(self) -> list[tuple[BlockId, BlockHash, BlockHash, TokenKey]]:
        """Every cached block with its hash, parent hash and token ids, in no particular order."""
        return [(b, h, self._parent[b], self._tokens[b]) for h, b in self._cached.items()]

    def reset_cache(self) -> None:
        """Forget every cached hash; evictable blocks become plain free blocks."""
        journal, self.journal = self.journal, None  # one CLEARED record, not a DROPPED per block
        for block in list(self._cached.values()):
            self._drop_hash(block)
        if journal is not None:
            journal.append((CLEARED, -1, None, None, None))
        self.journal = journal
        for level in self._evictable.values():
            self._free.extend(level)
        self._evictable.clear()
        self._num_evictable = 0

    # -- invariants -------------------------------------------------------
    def check(self, expected_refs: list[int]) -> None:
        """Verify the invariants against reference counts recomputed from the block tables."""
        _require(expected_refs == self.ref_counts, f"{self.name}: refcounts differ from block tables")
        free = set(self._free)
        evictable = {b for level in self._evictable.values() for b in level}
        _require(len(evictable) == self._num_evictable, f"{self.name}: evictable count")
        _require(len(free) == len(self._free), f"{self.name}: a block is twice in the free list")
        _require(not free & evictable, f"{self.name}: a block is both free and evictable")
        for b in range(self.num_blocks):
            in_use = self.ref_counts[b] > 0
            _require(in_use + (b in free) + (b in evictable) == 1, f"{self.name}: block {b} state")
            _require((b in free) == (self.hash_of[b] is None and not in_use), f"{self.name}: free block {b} hashed")
            if self.hash_of[b] is not None:
                _require(self._cached.get(self.hash_of[b]) == b, f"{self.name}: hash of block {b} unmapped")
        _require(len(self._cached) == sum(h is not None for h in self.hash_of), f"{self.name}: stale hash map")
        _require(self.num_free + sum(r > 0 for r in self.ref_counts) == self.num_blocks, "free + used != total")


class InvariantError(PagedKVError, AssertionError):
    """Raised by ``check()`` when an internal invariant is broken (a bug, not bad input)."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise InvariantError(what)

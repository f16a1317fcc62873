"""The block manager: block tables of sequences over a shared, copy-on-write block pool.

A sequence's block table maps its logical blocks to physical blocks of the GPU
pool (or, while swapped out, of the CPU pool). Full blocks are content-hashed
and shared through the prefix cache; ``fork`` shares the blocks of a parent's prefix.
A write into a block whose refcount is > 1 gets a fresh block and returns the
(src, dst) copy it owes, which the caller runs on the device before the write.
The engine's interface is here; the facades' edits by position are the
:class:`~paged_kv.positional_edits.PositionalEdits` mixin.

Every method that raises leaves the manager exactly as it was: each one first
computes what it needs, checks it, and only then mutates.

The table journal (``track_changes=True``) records, in order, every block-table entry an
operation sets as ``(seq_id, index, block)``, and ``(seq_id, RELEASED, RELEASED)`` when a
sequence's table is gone (freed or swapped out). Entries a truncation drops are not
recorded: a reader never reads a table past the sequence's blocks. So replaying the journal
from the start onto empty rows gives every resident sequence's table as a prefix of its row.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from paged_kv.block_hash import BlockHash, BlockHashes, salt_root
from paged_kv.block_pool import BlockId, BlockPool, CacheRecord, CopyOp, InvariantError, SeqId
from paged_kv.cache_tiers import CacheEvent, CacheTiers
from paged_kv.config import PRIORITY_MAX, PRIORITY_MIN, BlockManagerConfig
from paged_kv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfBlocksError,
    SequenceStateError,
    UnknownSequenceError,
    check_bool,
    check_int,
    check_type,
    describe,
)
from paged_kv.host_tier import HostTier
from paged_kv.positional_edits import PositionalEdits
from paged_kv.stats import BlockManagerStats, HitCounter
from paged_kv.tokens import Tokens, as_token_array

TableEntry = tuple[SeqId, int, BlockId]  # (seq_id, logical index, physical block), or a release
RELEASED = -1  # index and block of the journal entry that says a sequence's table is gone


@dataclass(slots=True)
class _Seq:
    """Per-sequence state.

    ``hashes`` describes the ids of a cacheable sequence (every slot holds the KV of the id it
    was given) and may cover more (a caller's object, ahead of the sequence); None otherwise.
    ``frozen``: once a sequence stops being cacheable, a private copy of the records of the
    full blocks it had, cut by later edits, that ``swap_in`` offers to the prefix cache again.
    """

    blocks: list[BlockId]
    num_tokens: int
    hashes: BlockHashes | None
    frozen: BlockHashes | None = None
    swapped: bool = False
    priority: int = 0  # its blocks' eviction priority once released (lower: kept longer)


@dataclass(frozen=True, kw_only=True)
class Admission:
    """A group's prefix hits at one state of a manager (``cached[i]``: leading tokens of request i found).

    Only valid until the manager next changes: ``fits`` then raises SequenceStateError.
    """

    cached: tuple[int, ...]
    _manager: BlockManager = field(repr=False, compare=False)
    _version: int = field(repr=False)
    _hits: tuple[tuple[BlockId, ...], ...] = field(repr=False)
    _lengths: tuple[int, ...] = field(repr=False)

    def fits(self, num_tokens: Iterable[int]) -> bool:
        """Whether allocating ``num_tokens[i]`` tokens of each request (``cached[i] <= num_tokens[i] <=`` its length)
        leaves the watermark of free blocks intact.

        Exact for one request (as ``can_allocate``). For several, a bound that never says yes
        wrongly: a request's hits count only as far as they are blocks in use now or hits of
        the first request (which takes them before any block is taken); blocks past that, and
        blocks an earlier request of the group registers, count as new.
        """
        return self._manager._fits(self, num_tokens)


class BlockManager(PositionalEdits, CacheTiers):
    """Allocates, grows, forks, swaps and frees the block tables of sequences."""

    def __init__(self, config: BlockManagerConfig, *, track_changes: bool = False) -> None:
        check_type("config", config, BlockManagerConfig, "a BlockManagerConfig")
        self.config = config
        self.block_size = config.block_size
        tiered = config.num_host_blocks > 0 and config.enable_prefix_caching
        self.gpu = BlockPool(config.num_blocks, "gpu", journal=tiered or config.track_cache_events)
        self.cpu = BlockPool(config.num_cpu_blocks, "cpu")
        self.host = HostTier(config.num_host_blocks, config.host_store) if tiered else None
        self._owed: list[CacheRecord] = []  # device records the host tier has not seen yet
        self._events: list[CacheEvent] | None = [] if config.track_cache_events else None
        self._pins: dict[Hashable, list[BlockId]] = {}  # pinned prefixes: device blocks held while pinned
        self._seqs: dict[SeqId, _Seq] = {}
        self._hits = HitCounter()
        self.num_cow_copies = 0
        self._journal: list[TableEntry] | None = [] if check_bool("track_changes", track_changes) else None
        self._version = 0  # bumped by every change: an Admission of another version is stale

    # -- queries ----------------------------------------------------------
    def __contains__(self, seq_id: SeqId) -> bool:
        """Whether ``seq_id`` is allocated; an unhashable id can never be, so it answers False (no error)."""
        try:
            return seq_id in self._seqs
        except TypeError:  # unhashable
            return False

    def block_table(self, seq_id: SeqId, start: int = 0) -> list[BlockId]:
        """The physical blocks of a sequence from logical block ``start`` on, in order (a copy)."""
        blocks = self._get(seq_id).blocks
        return blocks[check_int("start", start, high=len(blocks)) :]

    def num_tokens(self, seq_id: SeqId) -> int:
        """Tokens whose slots the sequence holds (lookahead slots not counted)."""
        return self._get(seq_id).num_tokens

    def is_swapped(self, seq_id: SeqId) -> bool:
        """Whether the sequence's blocks currently live in the CPU pool."""
        return self._get(seq_id).swapped

    def seq_ids(self) -> list[SeqId]:
        """Every sequence the manager holds."""
        return list(self._seqs)

    @property
    def num_free_blocks(self) -> int:
        """GPU blocks that can be handed out now (free, or cached and evictable)."""
        return self.gpu.num_free

    @property
    def usage(self) -> float:
        """Fraction of the GPU pool's blocks in use by some sequence."""
        return self.gpu.num_used / self.gpu.num_blocks

    def take_table_changes(self) -> list[TableEntry]:
        """The journal of table entries set since the last call (see the module docstring), and clear it."""
        if self._journal is None:
            raise InvalidArgumentError(describe("track_changes", False, "a manager built with track_changes=True"))
        changes, self._journal = self._journal, []
        return changes

    # -- admission and allocate -------------------------------------------
    def num_cached_tokens(
        self, token_ids: Tokens, *, cache_salt: str | bytes | None = None, hashes: BlockHashes | None = None
    ) -> int:
        """Leading tokens a new allocation of ``token_ids`` would find in the prefix cache (``hashes``: as allocate)."""
        ids = as_token_array("token_ids", token_ids)
        h, n = self._stream(ids, cache_salt, hashes), _count(ids, token_ids)
        hits = self._hits_of(h, n)
        return (len(hits) + len(self._host_hits(h, len(hits), n))) * self.block_size

    def admission(
        self, requests: Iterable[tuple[Tokens, BlockHashes | None]], *, cache_salt: str | bytes | None = None
    ) -> Admission:
        """The prefix hits of one group's ``(token_ids, hashes or None)`` requests, to ask ``fits`` of.

        Hashes only the blocks the kept objects lack (see ``allocate``); the manager does not change.
        """
        salt_root(cache_salt)  # checked even for no request
        hits, lengths, cached = [], [], []
        for token_ids, hashes in _pairs(requests, "(token_ids, hashes) pairs"):
            ids = as_token_array("token_ids", token_ids)
            lengths.append(_count(ids, token_ids))
            h = self._stream(ids, cache_salt, hashes)
            hits.append(tuple(self._hits_of(h, lengths[-1])))
            cached.append((len(hits[-1]) + len(self._host_hits(h, len(hits[-1]), lengths[-1]))) * self.block_size)
        return Admission(cached=tuple(cached), _manager=self,
                         _version=self._version, _hits=tuple(hits), _lengths=tuple(lengths))  # fmt: skip

    def can_allocate(
        self, token_ids: Tokens, *, cache_salt: str | bytes | None = None, hashes: BlockHashes | None = None,
        num_lookahead_slots: int = 0,
    ) -> bool:
        """Whether ``allocate`` would succeed and leave the watermark of free blocks intact."""
        check_int("num_lookahead_slots", num_lookahead_slots, low=0, high=1 << 20)
        ids = as_token_array("token_ids", token_ids)
        n = _count(ids, token_ids)
        hits = self._hits_of(self._stream(ids, cache_salt, hashes), n)
        need = self._blocks_for(n + num_lookahead_slots) - len(hits) + self.gpu.count_evictable(hits)
        return self.gpu.num_free - need >= self.config.watermark_blocks

    def _fits(self, admission: Admission, num_tokens: Iterable[int]) -> bool:
        """``Admission.fits``: checked against the manager's current version."""
        if admission._version != self._version:
            raise SequenceStateError(describe("admission", admission, (
                f"an Admission of the manager as it is now (it was made at version {admission._version}, "
                f"the manager changed since: version {self._version}); ask admission() again")))
        counts = _items(num_tokens, "token counts", "num_tokens")
        if len(counts) != len(admission._lengths):
            expected = f"{len(admission._lengths)} counts, one a request"
            raise InvalidArgumentError(describe("num_tokens", counts, expected))
        refs, need, first = self.gpu.ref_counts, 0, set()
        for i, (hits, cached, n) in enumerate(zip(admission._hits, admission.cached, admission._lengths)):
            k = check_int(f"num_tokens[{i}]", counts[i], low=cached, high=n)
            hits = hits[: self._max_hit_blocks(k)]
            if i == 0:  # a hit with no reference is evictable: taking it back uses a free block
                first, need = set(hits), need + sum(refs[b] == 0 for b in hits)
            else:  # an earlier request's new blocks may evict it: count it and the rest of the chain as new
                hits = hits[: next((j for j, b in enumerate(hits) if not refs[b] and b not in first), len(hits))]
            need += self._blocks_for(k) - len(hits)
        return self.gpu.num_free - need >= self.config.watermark_blocks

    def allocate(
        self, seq_id: SeqId, token_ids: Tokens, *, cache_salt: str | bytes | None = None,
        hashes: BlockHashes | None = None, num_lookahead_slots: int = 0, num_queried: int | None = None,
        priority: int = 0,
    ) -> int:
        """Give a new sequence blocks for its prompt; return how many leading tokens were cached.

        ``token_ids`` is a list of ids (hashed for prefix caching) or a count of anonymous
        tokens (never cached). A hit never covers the last token, so at least one token is
        always left to compute. ``hashes``: a BlockHashes the caller keeps for this token
        stream (the manager's block size, the salt's root; precondition: it describes these
        ids, and may cover more). It is extended only where it does not cover them, and the
        manager keeps it, extending it as the sequence grows: kept across preemption, no block
        is hashed twice. One object per live sequence: sequences that may diverge (samples of
        one prompt) each take their own (``copy()`` hashes nothing). ``num_queried``: the tokens
        the hit rate counts as looked up (default: those allocated); a caller allocating the
        first chunk of a longer prompt passes the whole prompt, whose hits the chunk holds.
        ``priority`` (vLLM's request priority: lower is more important) orders the eviction of
        its blocks once released: the cache evicts the highest value first, then LRU.
        Raises OutOfBlocksError (nothing changed) when the blocks do not fit.
        """
        self._check_new_id("seq_id", seq_id)
        check_int("num_lookahead_slots", num_lookahead_slots, low=0, high=1 << 20)
        ids = as_token_array("token_ids", token_ids)
        n = _count(ids, token_ids)
        queried = n if num_queried is None else check_int("num_queried", num_queried, low=n, high=1 << 40)
        if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            check_int("priority", priority, low=PRIORITY_MIN, high=PRIORITY_MAX)
        h, gpu = self._stream(ids, cache_salt, hashes), self.gpu
        hits = self._hits_of(h, n)
        # host hits go in new device blocks, loaded before the step reads them
        loads = self._host_hits(h, len(hits), n) if self.host is not None else ()
        num_new = self._blocks_for(n + num_lookahead_slots) - len(hits)
        num_revived = gpu.count_evictable(hits)
        if num_new + num_revived > gpu.num_free:
            raise OutOfBlocksError(
                f"token_ids (len {n}): needs {num_new + num_revived} blocks, expected at most {gpu.num_free} free"
            )
        self._version += 1
        gpu.touch_all(hits)
        new = gpu.take(num_new)
        seq = self._seqs[seq_id] = _Seq(hits + new, n, h)
        if priority:
            seq.priority = priority
        self._log(seq_id, seq.blocks)
        if loads:
            self.host.load(loads, new[: len(loads)])
        if h is not None:
            self._grow(seq, ids, len(hits))
        cached = (len(hits) + len(loads)) * self.block_size
        if ids is not None:
            self._hits.record(queried, cached)
        return cached

    def _stream(
        self, ids: array | None, cache_salt: str | bytes | None, hashes: BlockHashes | None
    ) -> BlockHashes | None:
        """The hashes of a new stream of ``ids`` (None if it is not cached): ``hashes``, checked and extended where
        it does not cover them, or a new object."""
        root = salt_root(cache_salt)
        if hashes is not None:
            self._check_hashes("hashes", hashes, root)
        if ids is None or not self.config.enable_prefix_caching:
            return None
        if hashes is None:
            hashes = BlockHashes._of(self.block_size, root)
        hashes._cover(len(ids), ids)
        return hashes

    def _check_hashes(self, name: str, hashes: object, root: BlockHash | None) -> None:
        """Raise unless ``hashes`` is a BlockHashes of the manager's block size chained from ``root`` (if given)."""
        check_type(name, hashes, BlockHashes, "a BlockHashes or None")
        if hashes.block_size != self.block_size:
            expected = f"{self.block_size}, the manager's block size"
            raise InvalidArgumentError(describe(f"{name}.block_size", hashes.block_size, expected))
        if root is not None and hashes.root != root:
            raise InvalidArgumentError(describe(f"{name}.root", hashes.root.hex()[:16], "the root of this cache_salt"))

    def _hits_of(self, hashes: BlockHashes | None, num_tokens: int) -> list[BlockId]:
        """Cached blocks matching the longest prefix of full blocks of a stream of ``num_tokens``, never its last."""
        if hashes is None:
            return []
        return self.gpu.lookup_chain(hashes.root, hashes.hashes, hashes.contents, self._max_hit_blocks(num_tokens))

    def _grow(self, seq: _Seq, ids: array, first: int) -> None:
        """A cacheable sequence's last ids (at least those its hashes lack) are ``ids``: extend its hashes where
        they do not cover them, then offer its blocks from ``first`` on that are now full to the prefix cache.

        The path by which a sequence's hashes grow (allocate, append, swap_in; append_all's fast
        path makes the same two calls inline): ``BlockHashes._cover`` then ``_offer``.
        """
        seq.hashes._cover(seq.num_tokens, ids)
        if seq.num_tokens // self.block_size > first:
            self._offer(seq, seq.hashes, first)

    def _offer(self, seq: _Seq, h: BlockHashes, first: int) -> None:
        """Register full blocks ``first..`` of ``seq`` under their hashes in ``h`` (as far as ``h`` has them)."""
        last = min(seq.num_tokens // self.block_size, len(h.hashes))
        if last > first:
            parent = h.hashes[first - 1] if first else h.root
            self.gpu.register_chain(seq.blocks[first:last], h.hashes[first:last], parent, h.contents[first:last])

    def _freeze(self, seq: _Seq, num_tokens: int) -> None:
        """Stop caching ``seq``; keep private records of its full blocks below position ``num_tokens`` (for swap_in)."""
        records = seq.hashes if seq.hashes is not None else seq.frozen
        seq.hashes = None
        if records is not None:
            seq.frozen = records.copy(min(num_tokens // self.block_size, len(records.hashes)) * self.block_size)

    # -- append -----------------------------------------------------------
    def can_append(self, seq_id: SeqId, num_new_tokens: int = 1, *, num_lookahead_slots: int = 0) -> bool:
        """Whether ``append`` of ``num_new_tokens`` (plus lookahead) would find enough free blocks."""
        need = self.num_blocks_to_append(seq_id, num_new_tokens, num_lookahead_slots=num_lookahead_slots)
        return need <= self.gpu.num_free

    def num_blocks_to_append(self, seq_id: SeqId, num_new_tokens: int = 1, *, num_lookahead_slots: int = 0) -> int:
        """Free blocks ``append`` of ``num_new_tokens`` (plus lookahead) takes: new blocks plus copy-on-write copies."""
        seq = self._get_resident(seq_id)
        check_int("num_new_tokens", num_new_tokens, low=0)
        check_int("num_lookahead_slots", num_lookahead_slots, low=0, high=1 << 20)
        cow, new = self._append_cost(seq, num_new_tokens, num_lookahead_slots)
        return len(cow) + new

    def can_append_all(self, requests: Iterable[tuple[SeqId, int]]) -> bool:
        """Whether ``append_all`` of ``num_new_tokens`` for each ``(seq_id, num_new_tokens)`` would find the blocks.

        The blocks counted are those ``append`` of each in turn takes, copy-on-write copies included.
        """
        spans = []
        for seq_id, n in _pairs(requests, "(seq_id, num_new_tokens) pairs"):
            start = self._get_resident(seq_id).num_tokens
            spans.append((seq_id, start, start + check_int("num_new_tokens", n, low=0)))
        return self._blocks_to_write(spans) <= self.gpu.num_free

    def _blocks_to_write(self, requests: Iterable[tuple[SeqId, int, int]]) -> int:
        """``num_blocks_to_write_all``: new blocks past each table plus the copies of shared blocks written."""
        holders: dict[BlockId, int] = {}  # shared block -> refcount left after the copies counted so far
        return sum(self._write_cost(seq, start, end, holders) for seq, start, end in self._write_spans(requests))

    def _write_cost(self, seq: _Seq, start: int, end: int, holders: dict[BlockId, int]) -> int:
        """Blocks readying ``[start, end)`` of ``seq`` takes after the writes already counted in ``holders``."""
        need = max(0, self._blocks_for(end) - len(seq.blocks))
        touched = seq.blocks[start // self.block_size : self._blocks_for(end)] if end > start else []
        for b in touched:
            refs = holders.get(b, self.gpu.ref_counts[b])
            if refs > 1:
                need, holders[b] = need + 1, refs - 1
        return need

    def _write_spans(self, requests: Iterable[tuple[SeqId, int, int]]) -> list[tuple[_Seq, int, int]]:
        """Checked ``(seq, start, end)``: resident, distinct, ``start`` within the tokens held, ``end >= start``."""
        spans, seen = [], set()
        for seq_id, start, end in _pairs(requests, "(seq_id, start, end) triples", size=3):
            seq = self._get_resident(seq_id)
            if seq_id in seen:
                raise InvalidArgumentError(describe("seq_id", seq_id, "each sequence at most once"))
            seen.add(seq_id)
            check_int("start", start, low=0, high=seq.num_tokens)
            spans.append((seq, start, check_int("end", end, low=start)))
        return spans

    def append(self, seq_id: SeqId, token_ids: Tokens, *, num_lookahead_slots: int = 0) -> list[CopyOp]:
        """Grow a sequence by new tokens; return the copy-on-write copies owed before writing them.

        Blocks the new tokens land in that are shared (refcount > 1) are
        replaced by fresh blocks; the returned (src, dst) pairs must be copied
        on the device before the new KV is written.
        """
        seq = self._get_resident(seq_id)
        check_int("num_lookahead_slots", num_lookahead_slots, low=0, high=1 << 20)
        ids = as_token_array("token_ids", token_ids)
        n = _count(ids, token_ids)
        cow, num_new = self._append_cost(seq, n, num_lookahead_slots)
        if len(cow) + num_new > self.gpu.num_free:
            raise _append_out_of_blocks(seq_id, n, len(cow) + num_new, self.gpu.num_free)
        self._version += 1
        return self._append_now(seq_id, seq, ids, n, cow, num_new)

    def _append_now(
        self, seq_id: SeqId, seq: _Seq, ids: array | None, n: int, cow: list[int], num_new: int
    ) -> list[CopyOp]:
        """The mutation of ``append``, its cost ``(cow, num_new)`` checked."""
        copies = self._copy_on_write(seq_id, seq, cow) if cow else []
        if num_new:
            old = len(seq.blocks)
            seq.blocks += self.gpu.take(num_new)
            self._log(seq_id, seq.blocks[old:], old)
        start = seq.num_tokens
        self._unhash_written(seq, start // self.block_size, n)
        seq.num_tokens += n
        if ids is None:  # anonymous tokens: the slots from ``start`` hold no ids we know
            self._freeze(seq, start)
        elif seq.hashes is not None:
            self._grow(seq, ids, start // self.block_size)
        return copies

    def append_all(self, requests: Iterable[tuple[SeqId, Tokens]]) -> list[CopyOp]:
        """``append`` each ``(seq_id, token_ids)`` in turn, all or nothing; return every copy owed, in order.

        The result (tables, copies, prefix-cache registrations, journal, stats) is exactly
        that of a loop of ``append`` without lookahead. Each sequence may appear once. If
        any request is invalid or the pool cannot hold them all, it raises what the first
        failing ``append`` of that loop would and nothing changes. One token per sequence
        landing in a private block is the fast path (a decode step).
        """
        plan = self._plan_append_all(requests)
        if plan:
            self._version += 1
        copies: list[CopyOp] = []
        bs, gpu, journal, hash_of = self.block_size, self.gpu, self._journal, self.gpu.hash_of
        for seq_id, seq, ids, n in plan:  # in order: blocks are taken and hashes registered as the loop would
            if n is not None:
                copies += self._append_now(seq_id, seq, ids, n, *self._append_cost(seq, n, 0))
                continue
            nt = seq.num_tokens  # fast: the token's block is private, or new (checked by the plan)
            seq.num_tokens = n = nt + 1
            if nt % bs:
                if hash_of[seq.blocks[nt // bs]] is not None:  # as _unhash_written: written in place
                    gpu.unregister(seq.blocks[nt // bs])
            elif nt // bs == len(seq.blocks):  # the first token of a new block
                seq.blocks += gpu.take(1)
                if journal is not None:
                    journal.append((seq_id, nt // bs, seq.blocks[-1]))
            h = seq.hashes
            if h is not None:  # _grow, inline: the same two steps
                h._cover(n, ids)
                if not n % bs:
                    self._offer(seq, h, nt // bs)
        return copies

    def _plan_append_all(self, requests: Iterable[tuple[SeqId, Tokens]]) -> list[tuple]:
        """Checked ``(seq_id, seq, ids, n)`` per request, in order; ``n`` None marks a fast append of the
        one id in the list ``ids`` (into a private block, or the first slot of a new one).

        Raises as a loop of ``append`` would at its first failure; the blocks
        needed are counted as ``can_append_all`` counts them.
        """
        seqs, refs, bs, free = self._seqs, self.gpu.ref_counts, self.block_size, self.gpu.num_free
        plan, seen, holders, need = [], set(), {}, 0
        add_seen, add_plan = seen.add, plan.append
        for item in _items(requests, "(seq_id, token_ids) pairs"):
            if type(item) is not tuple or len(item) != 2:
                _check_item(item, "(seq_id, token_ids) pairs", 2)
            seq_id, tokens = item
            try:
                seq = seqs[seq_id]
            except (KeyError, TypeError):
                seq = self._get(seq_id)  # raises UnknownSequenceError
            if seq.swapped:
                self._get_resident(seq_id)  # raises SequenceStateError
            if seq_id in seen:
                raise InvalidArgumentError(describe("seq_id", seq_id, "each sequence at most once"))
            add_seen(seq_id)
            if type(tokens) is list and len(tokens) == 1 and type(token := tokens[0]) is int and 0 <= token <= _MAX_ID:
                i = seq.num_tokens // bs
                if i < len(seq.blocks) and refs[seq.blocks[i]] == 1:  # into a private block: no cost
                    add_plan((seq_id, seq, tokens, None))
                    continue
                if i == len(seq.blocks):  # into a new block (nothing shared is written)
                    need += 1
                    if need > free:
                        raise _append_out_of_blocks(seq_id, 1, 1, free - need + 1)
                    add_plan((seq_id, seq, tokens, None))
                    continue
            ids = as_token_array("token_ids", tokens)
            n = _count(ids, tokens)
            cost = self._write_cost(seq, seq.num_tokens, seq.num_tokens + n, holders)
            need += cost
            if need > free:
                raise _append_out_of_blocks(seq_id, n, cost, free - need + cost)
            add_plan((seq_id, seq, ids, n))
        return plan

    def _append_cost(self, seq: _Seq, n: int, lookahead: int) -> tuple[list[int], int]:
        """Logical indices of shared blocks the write lands in, and new blocks needed."""
        first, end = seq.num_tokens // self.block_size, self._blocks_for(seq.num_tokens + n)
        touched = range(first, min(end, len(seq.blocks))) if n else range(0)
        cow = [i for i in touched if self.gpu.ref_counts[seq.blocks[i]] > 1]
        new = max(0, self._blocks_for(seq.num_tokens + n + lookahead) - len(seq.blocks))
        return cow, new

    def _copy_on_write(self, seq_id: SeqId, seq: _Seq, cow: list[int]) -> list[CopyOp]:
        """Swap each shared block at the given logical indices for a private copy (journaled)."""
        fresh = self.gpu.take(len(cow))
        copies = []
        for i, dst in zip(cow, fresh):
            src = seq.blocks[i]
            self.gpu.release((src,))
            seq.blocks[i] = dst
            copies.append((src, dst))
        self.num_cow_copies += len(copies)
        if self._journal is not None:
            self._journal += [(seq_id, i, seq.blocks[i]) for i in cow]
        return copies

    def _unhash_written(self, seq: _Seq, first: int, n: int) -> None:
        """A private block about to be written in place loses its cached identity."""
        if n and first < len(seq.blocks) and seq.num_tokens % self.block_size:
            self.gpu.unregister(seq.blocks[first])

    # -- fork / free ------------------------------------------------------
    def fork(
        self, parent_id: SeqId, child_id: SeqId, *, num_tokens: int | None = None, hashes: BlockHashes | None = None
    ) -> None:
        """Make ``child_id`` share the blocks of ``parent_id``'s first ``num_tokens`` tokens (default: every block).

        O(blocks), no data copied: a shared partial last block is copied on the first write
        into it. ``hashes``: the child's own BlockHashes (covering at least ``num_tokens``,
        possibly its own continuation), kept and extended as in ``allocate``; by default a
        copy of the parent's, cut at ``num_tokens``. Ignored if the parent is not cacheable.
        """
        parent = self._get_resident(parent_id)
        self._check_new_id("child_id", child_id)
        n = parent.num_tokens if num_tokens is None else check_int("num_tokens", num_tokens, high=parent.num_tokens)
        blocks = parent.blocks if num_tokens is None else parent.blocks[: self._blocks_for(n)]
        h = parent.hashes
        if hashes is not None:
            self._check_hashes("hashes", hashes, None if h is None else h.root)
            if h is not None and hashes.num_tokens < n:
                raise InvalidArgumentError(describe("hashes", hashes, f"a BlockHashes covering at least {n} tokens"))
        self._version += 1
        self.gpu.touch_all(blocks)
        if h is not None and hashes is None:
            hashes = h.copy(n)
        child = self._seqs[child_id] = _Seq(list(blocks), n, None if h is None else hashes, priority=parent.priority)
        if parent.frozen is not None:
            child.frozen = parent.frozen.copy(min(n // self.block_size, len(parent.frozen.hashes)) * self.block_size)
        self._log(child_id, child.blocks)

    def free(self, seq_id: SeqId) -> None:
        """Release every block of a sequence; cached full blocks stay reusable until evicted."""
        seq = self._get(seq_id)
        self._version += 1
        pool = self.cpu if seq.swapped else self.gpu
        pool.release(reversed(seq.blocks), seq.priority)  # tail blocks become the first to evict
        del self._seqs[seq_id]
        if self._journal is not None:
            self._journal.append((seq_id, RELEASED, RELEASED))

    # -- swap -------------------------------------------------------------
    # Swapping moves a set of sequences together: each distinct block they hold is copied
    # once and referenced in the other pool as often as in this one, so blocks shared within
    # the set stay shared there and back. A block also held by a sequence outside the set
    # stays where it is for that sequence (the set gets its own copy). One sequence is the
    # one-element set; a str is refused (it would be a set of characters).
    def can_swap_out(self, seq_ids: Iterable[SeqId]) -> bool:
        """Whether the CPU pool has room for the resident sequences' distinct blocks."""
        seqs = self._group(seq_ids, swapped=False)[1]
        return len(_distinct_blocks(seqs)) <= self.cpu.num_free

    def swap_out(self, seq_ids: Iterable[SeqId]) -> list[CopyOp]:
        """Move resident sequences to the CPU pool together, sharing kept; return the (gpu, cpu) copies to run first.

        Each distinct block moves once, whatever the number of sequences sharing it.
        """
        ids, seqs = self._group(seq_ids, swapped=False)
        mapping = self._swap(ids, seqs, self.gpu, self.cpu, to_cpu=True)
        if self._journal is not None:
            self._journal += [(seq_id, RELEASED, RELEASED) for seq_id in ids]
        return mapping

    def can_swap_in(self, seq_ids: Iterable[SeqId]) -> bool:
        """Whether all are swapped out and the GPU pool has room (above the watermark) for their distinct blocks."""
        seqs = self._group(seq_ids)[1]
        need = len(_distinct_blocks(seqs))
        return all(s.swapped for s in seqs) and self.gpu.num_free - need >= self.config.watermark_blocks

    def swap_in(self, seq_ids: Iterable[SeqId]) -> list[CopyOp]:
        """Bring swapped-out sequences back together, sharing kept; return the (cpu, gpu) copies to run first.

        Their full blocks are offered to the prefix cache again.
        """
        ids, seqs = self._group(seq_ids, swapped=True)
        mapping = self._swap(ids, seqs, self.cpu, self.gpu, to_cpu=False)
        for seq_id, seq in zip(ids, seqs):
            self._log(seq_id, seq.blocks)
            if seq.hashes is not None:
                self._grow(seq, _NO_IDS, 0)
            elif seq.frozen is not None:
                self._offer(seq, seq.frozen, 0)
        return mapping

    def _group(self, seq_ids: Iterable[SeqId], *, swapped: bool | None = None) -> tuple[list[SeqId], list[_Seq]]:
        """The ids and sequences named, checked: known, each once, swapped out (or resident) if ``swapped`` says so."""
        if isinstance(seq_ids, (str, bytes)):
            raise InvalidArgumentError(describe("seq_ids", seq_ids, "an iterable of sequence ids (not a string)"))
        try:
            ids = list(seq_ids)
        except TypeError:
            raise InvalidArgumentError(describe("seq_ids", seq_ids, "an iterable of sequence ids")) from None
        seqs = [self._get(seq_id) for seq_id in ids]
        for seq_id, seq in zip(ids, seqs):
            if swapped is False and seq.swapped:
                self._get_resident(seq_id)  # raises SequenceStateError
            if swapped and not seq.swapped:
                raise SequenceStateError(describe("seq_id", seq_id, "a swapped-out sequence"))
        if len({id(seq) for seq in seqs}) < len(seqs):
            dup = next(seq_id for i, seq_id in enumerate(ids) if seq_id in ids[:i])
            raise InvalidArgumentError(describe("seq_id", dup, "each sequence at most once"))
        return ids, seqs

    def _swap(
        self, ids: list[SeqId], seqs: list[_Seq], src: BlockPool, dst: BlockPool, *, to_cpu: bool
    ) -> list[CopyOp]:
        """Copy each distinct block of ``seqs`` once into ``dst``, with their references; release them in ``src``."""
        blocks = _distinct_blocks(seqs)
        if len(blocks) > dst.num_free:
            raise OutOfBlocksError(
                f"seq_ids={ids!r} hold blocks={len(blocks)}: expected at most {dst.num_free} free {dst.name} blocks"
            )
        self._version += 1
        new = dict(zip(blocks, dst.take(len(blocks))))  # each with refcount 1
        dst.touch_all(new[b] for b, refs in blocks.items() for _ in range(refs - 1))  # the other sharers in the set
        for seq in seqs:
            src.release(reversed(seq.blocks), seq.priority)  # as free: tail blocks become the first to evict
            seq.blocks, seq.swapped = [new[b] for b in seq.blocks], to_cpu
        return list(new.items())

    # -- prefix cache -----------------------------------------------------
    def reset_prefix_cache(self, *, keep_pinned: bool = False) -> None:
        """Forget every cached block hash (device and host tiers; with ``keep_pinned`` the pinned prefixes' stay,
        registered again after the reset) and restart the since-reset hit rate."""
        kept = self._pinned_records() if check_bool("keep_pinned", keep_pinned) else []
        self._version += 1
        self._drain(self.gpu, "GPU")  # the events so far, in order, then one CLEARED for every tier
        if self.host is not None:
            self._drain(self.host.pool, "CPU")
        self._owed = []  # a reset after a failed step: what it registered may never have been written
        self.gpu.reset_cache()
        if self.host is not None:
            self.host.clear()
            self.host.pool.journal = []
        self._hits.reset()
        for block, h, parent, tokens in kept:  # journaled after the CLEARED record: announced again
            self.gpu.register_chain([block], [h], parent, [tokens])

    def _max_hit_blocks(self, num_tokens: int) -> int:
        """A hit never covers the last token: at least one is always left to compute."""
        return max(0, (num_tokens - 1) // self.block_size)

    # -- introspection ----------------------------------------------------
    def stats(self) -> BlockManagerStats:
        """A snapshot of pool occupancy, prefix-cache hit rates and fragmentation."""
        gpu = self.gpu
        return BlockManagerStats(
            num_blocks=gpu.num_blocks, num_free=gpu.num_free, num_used=gpu.num_used,
            num_cached=gpu.num_cached, num_evictable=gpu.num_evictable,
            num_cpu_used=self.cpu.num_used, num_sequences=len(self._seqs),
            hit_rate=self._hits.lifetime_rate(), hit_rate_since_reset=self._hits.rate(),
            num_queried_tokens=self._hits.total_queried, num_hit_tokens=self._hits.total_hits,
            fragmentation=self._fragmentation(), num_cow_copies=self.num_cow_copies,
            num_evictions=gpu.num_evictions, **self._host_stats(),
        )

    def _host_stats(self) -> dict[str, int]:
        """The host tier's fields of the stats (none without a host tier)."""
        host = self.host
        if host is None:
            return {}
        bs = self.block_size
        return dict(num_host_blocks=host.pool.num_blocks, num_host_cached=host.pool.num_cached,
                    num_host_hit_tokens=host.num_hit_blocks * bs, num_lower_hit_tokens=host.num_lower_hit_blocks * bs,
                    num_host_stored_blocks=host.num_stored_blocks)  # fmt: skip

    def _fragmentation(self) -> float:
        """Fraction of slots in used GPU blocks that hold no token."""
        fill: dict[BlockId, int] = {}
        for seq in self._seqs.values():
            if seq.swapped:
                continue
            for i, b in enumerate(seq.blocks):
                n = min(self.block_size, max(0, seq.num_tokens - i * self.block_size))
                fill[b] = max(fill.get(b, 0), n)
        slots = len(fill) * self.block_size
        return 0.0 if not slots else 1.0 - sum(fill.values()) / slots

    def check(self) -> None:
        """Verify every invariant of the manager and its pools (debug; O(total blocks))."""
        refs = {"gpu": [0] * self.gpu.num_blocks, "cpu": [0] * self.cpu.num_blocks}
        for seq_id, seq in self._seqs.items():
            table = refs["cpu" if seq.swapped else "gpu"]
            for b in seq.blocks:
                table[b] += 1
            if len(seq.blocks) < self._blocks_for(seq.num_tokens):
                raise InvariantError(f"seq {seq_id!r}: {len(seq.blocks)} blocks for {seq.num_tokens} tokens")
            h = seq.hashes
            if h is not None and not (
                len(h.hashes) == len(h.contents) and len(h.tail) < self.block_size
                and h.num_tokens == len(h.hashes) * self.block_size + len(h.tail) >= seq.num_tokens
            ):  # fmt: skip
                raise InvariantError(f"seq {seq_id!r}: {len(h.hashes)} hashes for {seq.num_tokens} tokens")
        for blocks in self._pins.values():
            for b in blocks:
                refs["gpu"][b] += 1
        self.gpu.check(refs["gpu"])
        self.cpu.check(refs["cpu"])
        if self.host is not None:
            self.host.check()

    # -- helpers ----------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _log(self, seq_id: SeqId, blocks: list[BlockId], start: int = 0) -> None:
        """Journal ``blocks`` as the entries of ``seq_id``'s table from index ``start`` on."""
        if self._journal is not None:
            self._journal += [(seq_id, i, b) for i, b in enumerate(blocks, start)]

    def _check_new_id(self, name: str, seq_id: SeqId) -> None:
        try:
            taken = seq_id in self._seqs
        except TypeError:  # unhashable
            raise InvalidArgumentError(describe(name, seq_id, "a hashable id")) from None
        if taken:
            raise DuplicateSequenceError(describe(name, seq_id, "an id not already allocated"))

    def _get(self, seq_id: SeqId) -> _Seq:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(describe("seq_id", seq_id, "an allocated sequence")) from None

    def _get_resident(self, seq_id: SeqId) -> _Seq:
        seq = self._get(seq_id)
        if seq.swapped:
            raise SequenceStateError(describe("seq_id", seq_id, "a sequence resident on the GPU (it is swapped out)"))
        return seq


_MAX_ID = (1 << 63) - 1  # token ids are int64
_NO_IDS = array("q")  # no ids; never mutated


def _count(ids: array | None, token_ids: Tokens) -> int:
    """Number of tokens of a validated token spec: its ids, or the anonymous count."""
    return len(ids) if ids is not None else token_ids


def _pairs(requests: Iterable[tuple], expected: str, size: int = 2) -> list[tuple]:
    """``requests`` as a list of ``size``-tuples, or InvalidArgumentError naming the first bad item."""
    items = _items(requests, expected)
    for item in items:
        _check_item(item, expected, size)
    return items


def _items(requests: Iterable, expected: str, name: str = "requests") -> list:
    """``requests`` as a list (the same list if it is one), or InvalidArgumentError."""
    if type(requests) is list:
        return requests
    try:
        return list(requests)
    except TypeError:
        raise InvalidArgumentError(describe(name, requests, f"an iterable of {expected}")) from None


def _check_item(item: object, expected: str, size: int) -> None:
    """Raise InvalidArgumentError unless ``item`` is a tuple or list of ``size`` elements."""
    if not isinstance(item, (tuple, list)) or len(item) != size:
        raise InvalidArgumentError(describe("requests", item, f"an iterable of {expected}"))


def _append_out_of_blocks(seq_id: SeqId, n: int, need: int, free: int) -> OutOfBlocksError:
    """The error of an ``append`` of ``n`` tokens that needs ``need`` blocks with ``free`` left."""
    return OutOfBlocksError(
        f"token_ids (len {n}): needs {need} blocks for seq_id={seq_id!r}, expected at most {free} free"
    )


def _distinct_blocks(seqs: list[_Seq]) -> dict[BlockId, int]:
    """Each block the sequences hold, in order of first appearance, with how many of them hold it."""
    blocks: dict[BlockId, int] = {}
    for seq in seqs:
        for b in seq.blocks:
            blocks[b] = blocks.get(b, 0) + 1
    return blocks

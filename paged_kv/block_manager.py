"""The block manager: block tables of sequences over a shared, copy-on-write block pool.

A sequence's block table maps its logical blocks to physical blocks of the GPU
pool (or, while swapped out, of the CPU pool). Full blocks are content-hashed
and shared through the prefix cache; ``fork`` shares every block of a parent.
A write into a block whose refcount is > 1 gets a fresh block and returns the
(src, dst) copy it owes, which the caller runs on the device before the write.

Every method that raises leaves the manager exactly as it was: each one first
computes what it needs, checks it, and only then mutates.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from paged_kv.block_hash import BlockHash, block_bytes, hash_blocks, root_hash
from paged_kv.block_pool import BlockId, BlockPool, InvariantError
from paged_kv.config import MAX_BLOCKS, BlockManagerConfig
from paged_kv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfBlocksError,
    SequenceStateError,
    UnknownSequenceError,
    check_int,
    check_type,
    describe,
)
from paged_kv.stats import BlockManagerStats, HitCounter
from paged_kv.tokens import Tokens, as_token_array

SeqId = Hashable
CopyOp = tuple[BlockId, BlockId]  # (src, dst)
TableChange = tuple[Hashable, int, BlockId]  # (seq_id, logical index, new physical block)
ROOT_CACHE_SIZE = 1024  # root hashes kept for recently used cache salts


@dataclass(slots=True)
class _Seq:
    """Per-sequence state. While ``cacheable``: ``full`` holds the int64 token bytes of each full
    block, ``hashes`` their chained hashes and ``tail`` the ids past the last full block.
    ``root`` is the parent hash of ``hashes[0]``: the salt's root until ``drop_front``."""

    blocks: list[BlockId]
    num_tokens: int
    root: BlockHash
    cacheable: bool
    full: list[bytes] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    tail: array = field(default_factory=lambda: array("q"))
    swapped: bool = False


class BlockManager:
    """Allocates, grows, forks, swaps and frees the block tables of sequences."""

    def __init__(self, config: BlockManagerConfig) -> None:
        check_type("config", config, BlockManagerConfig, "a BlockManagerConfig")
        self.config = config
        self.block_size = config.block_size
        self.gpu = BlockPool(config.num_blocks, "gpu")
        self.cpu = BlockPool(config.num_cpu_blocks, "cpu")
        self._seqs: dict[SeqId, _Seq] = {}
        self._hits = HitCounter()
        self.num_cow_copies = 0

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

    # -- allocate ---------------------------------------------------------
    def num_cached_tokens(self, token_ids: Tokens, *, cache_salt: str | None = None) -> int:
        """Leading tokens a fresh allocation of ``token_ids`` would find in the prefix cache."""
        ids = as_token_array("token_ids", token_ids)
        return len(self._lookup(ids, self._root(cache_salt))) * self.block_size

    def can_allocate(self, token_ids: Tokens, *, cache_salt: str | None = None, num_lookahead_slots: int = 0) -> bool:
        """Whether ``allocate`` would succeed and leave the watermark of free blocks intact."""
        check_int("num_lookahead_slots", num_lookahead_slots, low=0, high=1 << 20)
        ids = as_token_array("token_ids", token_ids)
        hits = self._lookup(ids, self._root(cache_salt))
        need = self._blocks_for(len_of(token_ids) + num_lookahead_slots) - len(hits)
        need += self.gpu.count_evictable(hits)
        return self.gpu.num_free - need >= self.config.watermark_blocks

    def allocate(
        self, seq_id: SeqId, token_ids: Tokens, *, cache_salt: str | None = None, num_lookahead_slots: int = 0
    ) -> int:
        """Give a new sequence blocks for its prompt; return how many leading tokens were cached.

        ``token_ids`` is a list of ids (hashed for prefix caching) or a count of
        anonymous tokens (never cached). A hit never covers the last token, so
        at least one token is always left to compute. Raises OutOfBlocksError
        (nothing changed) when the blocks do not fit.
        """
        self._check_new_id("seq_id", seq_id)
        check_int("num_lookahead_slots", num_lookahead_slots, low=0, high=1 << 20)
        ids = as_token_array("token_ids", token_ids)
        root = self._root(cache_salt)
        n = len(ids) if ids is not None else token_ids
        cacheable = ids is not None and self.config.enable_prefix_caching
        gpu = self.gpu
        hashes, contents = self._block_keys(ids, root) if cacheable else ([], [])
        hits = gpu.lookup_chain(root, hashes, contents, self._max_hit_blocks(n)) if hashes else []
        num_new = self._blocks_for(n + num_lookahead_slots) - len(hits)
        num_revived = gpu.count_evictable(hits)
        if num_new + num_revived > gpu.num_free:
            raise OutOfBlocksError(
                f"token_ids (len {n}): needs {num_new + num_revived} blocks, "
                f"expected at most {gpu.num_free} free"
            )
        gpu.touch_all(hits)
        seq = _Seq(hits + gpu.take(num_new), n, root, cacheable, [], [], _NO_IDS)
        if cacheable:
            self._register_new(seq, hashes, contents, len(hits))
            seq.tail = ids[len(hashes) * self.block_size :]
        self._seqs[seq_id] = seq
        if ids is not None:
            self._hits.record(n, len(hits) * self.block_size)
        return len(hits) * self.block_size

    def _block_keys(self, ids: array, root: BlockHash) -> tuple[list[BlockHash], list[bytes]]:
        """Chained hashes and int64 token bytes of every full block of ``ids``."""
        return hash_blocks(root, ids, self.block_size), block_bytes(ids, self.block_size)

    def _register_new(self, seq: _Seq, hashes: list[BlockHash], contents: list[bytes], first: int) -> None:
        """Append full blocks ``first..`` to a sequence's cache records and offer them to the prefix cache."""
        parent = seq.hashes[-1] if seq.hashes else seq.root
        if first:  # blocks before ``first`` were hits: already registered under these hashes
            parent = hashes[first - 1]
        start = len(seq.hashes) + first
        self.gpu.register_chain(seq.blocks[start:], hashes[first:], parent, contents[first:])
        seq.hashes += hashes
        seq.full += contents

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

    def num_blocks_to_append_all(self, requests: Iterable[tuple[SeqId, int]]) -> int:
        """Free blocks that ``append`` of each ``(seq_id, num_new_tokens)`` in turn takes, copies included."""
        spans = []
        for seq_id, n in _pairs(requests, "(seq_id, num_new_tokens) pairs"):
            start = self._get_resident(seq_id).num_tokens
            spans.append((seq_id, start, start + check_int("num_new_tokens", n, low=0)))
        return self.num_blocks_to_write_all(spans)

    def num_blocks_to_write_all(self, requests: Iterable[tuple[SeqId, int, int]]) -> int:
        """Free blocks that readying positions ``[start, end)`` of each ``(seq_id, start, end)`` in turn takes.

        Per sequence, as ``append`` up to ``end`` followed by ``prepare_write(start,
        end)`` does: new blocks past its table, plus a private copy of each shared
        block in the range. Copy-on-write gives up the shared block, so when ``k``
        listed sequences share a block and all write it, ``k - 1`` copies are
        made: the last writer holds it alone. Each sequence may appear once.
        """
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
        n = len(ids) if ids is not None else len_of(token_ids)
        cow, num_new = self._append_cost(seq, n, num_lookahead_slots)
        if len(cow) + num_new > self.gpu.num_free:
            raise _append_out_of_blocks(seq_id, n, len(cow) + num_new, self.gpu.num_free)
        return self._append_now(seq, ids, n, cow, num_new)

    def _append_now(self, seq: _Seq, ids: array | None, n: int, cow: list[int], num_new: int) -> list[CopyOp]:
        """The mutation of ``append``, its cost ``(cow, num_new)`` checked."""
        copies = self._copy_on_write(seq, cow)
        seq.blocks += self.gpu.take(num_new)
        if ids is None:
            seq.cacheable = False
        self._extend(seq, ids, n)
        return copies

    def can_append_all(self, requests: Iterable[tuple[SeqId, int]]) -> bool:
        """Whether ``append_all`` of ``num_new_tokens`` for each ``(seq_id, num_new_tokens)`` would find the blocks."""
        return self.num_blocks_to_append_all(requests) <= self.gpu.num_free

    def append_all(
        self, requests: Iterable[tuple[SeqId, Tokens]], *, changed: list[TableChange] | None = None
    ) -> list[CopyOp]:
        """``append`` each ``(seq_id, token_ids)`` in turn, all or nothing; return every copy owed, in order.

        The result (tables, copies, prefix-cache registrations, stats) is exactly
        that of a loop of ``append`` without lookahead. Each sequence may appear
        once. If any request is invalid or the pool cannot hold them all, it
        raises what the first failing ``append`` of that loop would and nothing
        changes. One token per sequence landing in a private block is the fast
        path (a decode step). If ``changed`` is a list, every block-table entry the
        call sets is appended to it as ``(seq_id, index, block)``: copy-on-write
        replacements, then new blocks past the old end, in the order made; all
        other entries are as before, so a persistent device table needs only these.
        """
        if changed is not None and not isinstance(changed, list):
            raise InvalidArgumentError(describe("changed", type(changed).__name__, "a list to extend, or None"))
        plan = self._plan_append_all(requests)
        copies: list[CopyOp] = []
        bs, gpu, one = self.block_size, self.gpu, array("q", (0,))
        for seq_id, seq, token in plan:  # in order: blocks are taken and hashes registered as the loop would
            if type(token) is not int:
                copies += self._append_changes(seq_id, seq, *token, changed)
                continue
            nt = seq.num_tokens  # fast: the token's block is private, or new (checked by the plan)
            seq.num_tokens = nt + 1
            if nt % bs:
                gpu.unregister(seq.blocks[nt // bs])  # as _unhash_written: written in place
            elif nt // bs == len(seq.blocks):  # the first token of a new block
                seq.blocks += gpu.take(1)
                if changed is not None:
                    changed.append((seq_id, nt // bs, seq.blocks[-1]))
            if seq.cacheable:
                one[0] = token
                pending = seq.tail + one
                if len(pending) < bs:
                    seq.tail = pending
                else:
                    self._set_tail(seq, pending)
        return copies

    def _append_changes(
        self, seq_id: SeqId, seq: _Seq, ids: array | None, n: int, changed: list[TableChange] | None
    ) -> list[CopyOp]:
        """``append`` of a checked request, its cost taken now; log the table entries it sets into ``changed``."""
        cow, num_new = self._append_cost(seq, n, 0)
        old_len = len(seq.blocks)
        copies = self._append_now(seq, ids, n, cow, num_new)
        if changed is not None:
            changed += [(seq_id, i, seq.blocks[i]) for i in cow]
            changed += [(seq_id, i, seq.blocks[i]) for i in range(old_len, len(seq.blocks))]
        return copies

    def _plan_append_all(self, requests: Iterable[tuple[SeqId, Tokens]]) -> list[tuple]:
        """Checked ``(seq_id, seq, token)`` per request, in order: an int ``token`` is the one id of a
        fast append (into a private block, or the first slot of a new one), else ``token`` is ``(ids, n)``.

        Raises as a loop of ``append`` would at its first failure; the blocks
        needed are counted as ``num_blocks_to_append_all`` counts them.
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
                    add_plan((seq_id, seq, token))
                    continue
                if i == len(seq.blocks):  # into a new block (nothing shared is written)
                    need += 1
                    if need > free:
                        raise _append_out_of_blocks(seq_id, 1, 1, free - need + 1)
                    add_plan((seq_id, seq, token))
                    continue
            ids = as_token_array("token_ids", tokens)
            n = len(ids) if ids is not None else len_of(tokens)
            cost = self._write_cost(seq, seq.num_tokens, seq.num_tokens + n, holders)
            need += cost
            if need > free:
                raise _append_out_of_blocks(seq_id, n, cost, free - need + cost)
            add_plan((seq_id, seq, (ids, n)))
        return plan

    def _append_cost(self, seq: _Seq, n: int, lookahead: int) -> tuple[list[int], int]:
        """Logical indices of shared blocks the write lands in, and new blocks needed."""
        first, end = seq.num_tokens // self.block_size, self._blocks_for(seq.num_tokens + n)
        touched = range(first, min(end, len(seq.blocks))) if n else range(0)
        cow = [i for i in touched if self.gpu.ref_counts[seq.blocks[i]] > 1]
        new = max(0, self._blocks_for(seq.num_tokens + n + lookahead) - len(seq.blocks))
        return cow, new

    def _copy_on_write(self, seq: _Seq, cow: list[int]) -> list[CopyOp]:
        """Swap each shared block at the given logical indices for a private copy."""
        fresh = self.gpu.take(len(cow))
        copies = []
        for i, dst in zip(cow, fresh):
            src = seq.blocks[i]
            self.gpu.release((src,))
            seq.blocks[i] = dst
            copies.append((src, dst))
        self.num_cow_copies += len(copies)
        return copies

    def _extend(self, seq: _Seq, ids: array | None, n: int) -> None:
        """Record ``n`` new tokens (``ids``, None if anonymous); register blocks they fill.

        Pre: the blocks exist and are private.
        """
        self._unhash_written(seq, seq.num_tokens // self.block_size, n)
        seq.num_tokens += n
        if ids is not None and seq.cacheable:
            self._set_tail(seq, seq.tail + ids)

    def _set_tail(self, seq: _Seq, pending: array) -> None:
        """The ids past the last full block are ``pending``: register each block they fill, keep the rest."""
        if len(pending) >= self.block_size:  # a block fills up
            hashes, contents = self._block_keys(pending, seq.hashes[-1] if seq.hashes else seq.root)
            self._register_new(seq, hashes, contents, 0)
            pending = pending[len(hashes) * self.block_size :]
        seq.tail = pending

    def _unhash_written(self, seq: _Seq, first: int, n: int) -> None:
        """A private block about to be written in place loses its cached identity."""
        if n and first < len(seq.blocks) and seq.num_tokens % self.block_size:
            self.gpu.unregister(seq.blocks[first])

    def can_prepare_write(self, seq_id: SeqId, start: int, end: int) -> bool:
        """Whether ``prepare_write`` over ``[start, end)`` would find enough free blocks."""
        return len(self._shared_in(self._get_resident(seq_id), start, end)) <= self.gpu.num_free

    def prepare_write(self, seq_id: SeqId, start: int, end: int) -> list[CopyOp]:
        """Make the blocks holding positions ``[start, end)`` private before an in-place overwrite.

        Shared blocks are copied (the returned (src, dst) pairs are owed to the
        device); private cached blocks leave the prefix cache, since their
        content is about to change.
        """
        seq = self._get_resident(seq_id)
        cow = self._shared_in(seq, start, end)
        if len(cow) > self.gpu.num_free:
            raise OutOfBlocksError(f"end={end}: needs {len(cow)} blocks, expected at most {self.gpu.num_free} free")
        if end == start:  # an empty range writes nothing: nothing to copy, unhash or forget
            return []
        copies = self._copy_on_write(seq, cow)
        for i in range(start // self.block_size, self._blocks_for(end)):
            self.gpu.unregister(seq.blocks[i])
        if start < min(end, seq.num_tokens):
            seq.cacheable = False  # the slots from ``start`` no longer hold the ids they were given
        # hashes of the rewritten blocks are stale (swap_in would re-register them)
        del seq.full[start // self.block_size :], seq.hashes[start // self.block_size :]
        return copies

    def _shared_in(self, seq: _Seq, start: int, end: int) -> list[int]:
        check_int("end", end, low=0, high=len(seq.blocks) * self.block_size)
        check_int("start", start, low=0, high=end)
        blocks = range(start // self.block_size, self._blocks_for(end)) if end > start else range(0)
        return [i for i in blocks if self.gpu.ref_counts[seq.blocks[i]] > 1]

    def add_blocks(self, num_blocks: int) -> None:
        """Grow the GPU pool by ``num_blocks`` free blocks (the storage must grow alike)."""
        check_int("num_blocks", num_blocks, low=0, high=MAX_BLOCKS - self.gpu.num_blocks)
        self.gpu.grow(num_blocks)

    # -- fork / free / truncate -------------------------------------------
    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (O(blocks), no data copied)."""
        parent = self._get_resident(parent_id)
        self._check_new_id("child_id", child_id)
        for b in parent.blocks:
            self.gpu.touch(b)
        self._seqs[child_id] = _Seq(
            list(parent.blocks), parent.num_tokens, parent.root, parent.cacheable,
            list(parent.full), list(parent.hashes), parent.tail[:],
        )

    def free(self, seq_id: SeqId) -> None:
        """Release every block of a sequence; cached full blocks stay reusable until evicted."""
        seq = self._get(seq_id)
        pool = self.cpu if seq.swapped else self.gpu
        pool.release(reversed(seq.blocks))  # tail blocks become the first to evict
        del self._seqs[seq_id]

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Shrink a sequence to its first ``num_tokens`` tokens; whole blocks past them are freed."""
        seq = self._get_resident(seq_id)
        check_int("num_tokens", num_tokens, low=0, high=seq.num_tokens)
        keep = self._blocks_for(num_tokens)
        self.gpu.release(reversed(seq.blocks[keep:]))
        del seq.blocks[keep:]
        nfull, rest = divmod(num_tokens, self.block_size)
        if seq.cacheable:
            partial = seq.tail if nfull >= len(seq.full) else _ids_of(seq.full[nfull])
            seq.tail = partial[:rest]
        del seq.full[nfull:], seq.hashes[nfull:]  # even uncacheable: swap_in re-registers them
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
        self.gpu.release(reversed(seq.blocks[:num_blocks]))  # like free: the head is evicted last
        del seq.blocks[:num_blocks]
        seq.num_tokens = max(0, seq.num_tokens - num_blocks * self.block_size)
        self._drop_front_hashes(seq, num_blocks)

    def _drop_front_hashes(self, seq: _Seq, num_blocks: int) -> None:
        """Keep the hash records of the blocks left, chained from the last dropped hash; stop caching."""
        if num_blocks <= len(seq.hashes):  # swap_in re-registers the rest with their true parent
            seq.root = seq.hashes[num_blocks - 1]
            del seq.hashes[:num_blocks], seq.full[:num_blocks]
        else:
            seq.hashes, seq.full = [], []
        seq.cacheable, seq.tail = False, _NO_IDS

    # -- swap -------------------------------------------------------------
    # Swapping moves a set of sequences together: each distinct block they hold is copied
    # once and referenced in the other pool as often as in this one, so blocks shared within
    # the set stay shared there and back. A block also held by a sequence outside the set
    # stays where it is for that sequence (the set gets its own copy). One sequence is the
    # one-element set.
    def can_swap_out(self, seq_id: SeqId) -> bool:
        """Whether the CPU pool has room for the sequence's blocks."""
        return self.can_swap_out_group((seq_id,))

    def swap_out(self, seq_id: SeqId) -> list[CopyOp]:
        """Move a sequence to the CPU pool; return the (gpu, cpu) block copies to run first."""
        return self.swap_out_group((seq_id,))

    def can_swap_in(self, seq_id: SeqId) -> bool:
        """Whether the GPU pool has room (above the watermark) for a swapped-out sequence."""
        return self.can_swap_in_group((seq_id,))

    def swap_in(self, seq_id: SeqId) -> list[CopyOp]:
        """Bring a swapped-out sequence back; return the (cpu, gpu) block copies to run first."""
        return self.swap_in_group((seq_id,))

    def num_distinct_blocks(self, seq_ids: Iterable[SeqId]) -> int:
        """Blocks the sequences hold together, each shared block counted once (what swapping them moves)."""
        return len(_distinct_blocks(self._group(seq_ids)[1]))

    def can_swap_out_group(self, seq_ids: Iterable[SeqId]) -> bool:
        """Whether the CPU pool has room for the resident sequences' distinct blocks."""
        seqs = self._group(seq_ids, swapped=False)[1]
        return len(_distinct_blocks(seqs)) <= self.cpu.num_free

    def swap_out_group(self, seq_ids: Iterable[SeqId]) -> list[CopyOp]:
        """Move resident sequences to the CPU pool together, sharing kept; return the (gpu, cpu) copies to run first.

        Each distinct block moves once, whatever the number of sequences sharing it.
        """
        return self._swap(*self._group(seq_ids, swapped=False), self.gpu, self.cpu, to_cpu=True)

    def can_swap_in_group(self, seq_ids: Iterable[SeqId]) -> bool:
        """Whether all are swapped out and the GPU pool has room (above the watermark) for their distinct blocks."""
        seqs = self._group(seq_ids)[1]
        need = len(_distinct_blocks(seqs))
        return all(s.swapped for s in seqs) and self.gpu.num_free - need >= self.config.watermark_blocks

    def swap_in_group(self, seq_ids: Iterable[SeqId]) -> list[CopyOp]:
        """Bring swapped-out sequences back together, sharing kept; return the (cpu, gpu) copies to run first.

        Their full blocks are offered to the prefix cache again.
        """
        ids, seqs = self._group(seq_ids, swapped=True)
        mapping = self._swap(ids, seqs, self.cpu, self.gpu, to_cpu=False)
        for seq in seqs:
            self._register_full(seq)
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
        new = dict(zip(blocks, dst.take(len(blocks))))  # each with refcount 1
        dst.touch_all(new[b] for b, refs in blocks.items() for _ in range(refs - 1))  # the other sharers in the set
        for seq in seqs:
            src.release(reversed(seq.blocks))  # as free: tail blocks become the first to evict
            seq.blocks, seq.swapped = [new[b] for b in seq.blocks], to_cpu
        return list(new.items())

    def _register_full(self, seq: _Seq) -> None:
        """Offer a swapped-in sequence's full blocks to the prefix cache again."""
        self.gpu.register_chain(seq.blocks, seq.hashes, seq.root, seq.full)

    # -- prefix cache -----------------------------------------------------
    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash and restart the since-reset hit rate."""
        self.gpu.reset_cache()
        self._hits.reset()

    def _root(self, cache_salt: str | None) -> BlockHash:
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidArgumentError(describe("cache_salt", cache_salt, "a str or None"))
        return _root_cached(cache_salt)

    def _max_hit_blocks(self, num_tokens: int) -> int:
        """A hit never covers the last token: at least one is always left to compute."""
        return max(0, (num_tokens - 1) // self.block_size)

    def _lookup(self, ids: array | None, root: BlockHash) -> list[BlockId]:
        """Cached blocks matching the longest prefix of full blocks, never covering the last token."""
        if ids is None or not self.config.enable_prefix_caching:
            return []
        head = ids[: self._max_hit_blocks(len(ids)) * self.block_size]
        hashes, contents = self._block_keys(head, root)
        return self.gpu.lookup_chain(root, hashes, contents, len(hashes))

    # -- introspection ----------------------------------------------------
    def stats(self) -> BlockManagerStats:
        """A snapshot of pool occupancy, prefix-cache hit rates and fragmentation."""
        gpu = self.gpu
        return BlockManagerStats(
            num_blocks=gpu.num_blocks, num_free=gpu.num_free, num_used=gpu.num_used,
            num_cached=gpu.num_cached, num_evictable=gpu.num_evictable,
            num_cpu_used=self.cpu.num_used, num_sequences=len(self._seqs),
            hit_rate=self._hits.lifetime_rate(), hit_rate_since_reset=self._hits.rate(),
            fragmentation=self._fragmentation(), num_cow_copies=self.num_cow_copies,
            num_evictions=gpu.num_evictions,
        )

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
            if seq.cacheable and len(seq.hashes) != seq.num_tokens // self.block_size:
                raise InvariantError(f"seq {seq_id!r}: {len(seq.hashes)} hashes for {seq.num_tokens} tokens")
        self.gpu.check(refs["gpu"])
        self.cpu.check(refs["cpu"])

    # -- helpers ----------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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
_NO_IDS = array("q")  # the empty tail; never mutated in place (tails are replaced, not extended)


def _ids_of(data: bytes) -> array:
    """Token ids back from their int64 bytes."""
    ids = array("q")
    ids.frombytes(data)
    return ids


def _pairs(requests: Iterable[tuple], expected: str, size: int = 2) -> list[tuple]:
    """``requests`` as a list of ``size``-tuples, or InvalidArgumentError naming the first bad item."""
    items = _items(requests, expected)
    for item in items:
        _check_item(item, expected, size)
    return items


def _items(requests: Iterable[tuple], expected: str) -> list[tuple]:
    """``requests`` as a list (the same list if it is one), or InvalidArgumentError."""
    if type(requests) is list:
        return requests
    try:
        return list(requests)
    except TypeError:
        raise InvalidArgumentError(describe("requests", requests, f"an iterable of {expected}")) from None


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


def len_of(token_ids: Tokens) -> int:
    """Number of tokens in a token spec (a list of ids or a count)."""
    return token_ids if isinstance(token_ids, int) else len(token_ids)


@functools.lru_cache(maxsize=ROOT_CACHE_SIZE)
def _root_cached(cache_salt: str | None) -> BlockHash:
    """``root_hash(cache_salt)``, remembered for the most recently used salts (bounded: salts are per tenant)."""
    return root_hash(cache_salt)

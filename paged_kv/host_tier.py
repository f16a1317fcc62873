"""The host tier of the prefix cache: which blocks to store below the device pool and load back.

A :class:`HostTier` indexes a pool of host blocks (a :class:`BlockPool` named "host") by the
same chained block hashes as the device pool, verified the same way on every hit (hash,
parent hash and token ids), with its own LRU. It decides; it moves no data. Each step the
block manager hands the runner a :class:`TierOps` to run, in this order:

1. ``stores`` (device -> host): cached device blocks the step evicted (policy ``"evict"``),
   copied before anything in the step overwrites them;
2. ``fills``: blocks read from a lower tier (disk) into host blocks;
3. ``loads`` (host -> device): host hits of the requests admitted this step, into the fresh
   device blocks that hold them, before the forward reads them;
4. ``post_stores`` (device -> host, policy ``"write"``): every device block the step filled,
   copied after the forward wrote it.

Invariants: a host block read by a load or written by a fill or a store is pinned (referenced)
from the moment it is chosen until the step's ops are taken, so no other op of the same step
can reuse it; a store's host block is registered under the device block's hash at once, and the
runner runs a step's ops before the next step's, so a later load reads what the store wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from paged_kv.block_hash import BlockHash
from paged_kv.block_pool import EVICTED, STORED, BlockId, BlockPool, CacheRecord, CopyOp
from paged_kv.errors import InvalidArgumentError, describe

HASH_BYTES = 32  # a block hash (SHA-256), and its parent's


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """A cached block's identity: its hash, its parent's hash and its token ids (int64 bytes)."""

    hash: BlockHash
    parent: BlockHash
    tokens: bytes


def check_record(name: str, record: object, token_bytes: int) -> None:
    """Raise InvalidArgumentError unless ``record``'s ``hash`` and ``parent`` are 32 bytes and ``tokens`` is
    ``token_bytes`` bytes (a BlockRecord, or any block identity with those fields)."""
    for field_name, size in (("hash", HASH_BYTES), ("parent", HASH_BYTES), ("tokens", token_bytes)):
        value = getattr(record, field_name)
        if not isinstance(value, bytes) or len(value) != size:
            shown = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
            raise InvalidArgumentError(describe(f"{name}.{field_name}", shown, f"{size} bytes"))


@dataclass(frozen=True, slots=True)
class Fill:
    """Blocks read from a lower tier: ``payload`` (the reader's data, opaque here) goes into ``host_blocks``."""

    host_blocks: list[BlockId]
    records: list[BlockRecord]
    payload: object


@dataclass(kw_only=True)
class TierOps:
    """One step's transfers between the device pool and the host tier, in the order they must run."""

    stores: list[tuple[BlockId, BlockId, BlockRecord]] = field(default_factory=list)  # (device, host, block)
    fills: list[Fill] = field(default_factory=list)
    loads: list[CopyOp] = field(default_factory=list)  # (host, device)
    post_stores: list[tuple[BlockId, BlockId, BlockRecord]] = field(default_factory=list)  # (device, host, block)

    def __bool__(self) -> bool:
        return bool(self.stores or self.fills or self.loads or self.post_stores)


class HostTier:
    """The host tier's index over ``num_blocks`` host blocks, fed by a device pool's journal."""

    def __init__(self, num_blocks: int, policy: str) -> None:
        self.pool = BlockPool(num_blocks, "host", journal=True)
        self.policy = policy
        self._pinned: list[BlockId] = []  # loaded or filled this step: released when the ops are taken
        self._ops = TierOps()
        self._filled: set[BlockId] = set()  # host blocks a fill of this step writes
        self.num_hit_blocks = 0  # blocks loaded back to the device from the host tier, over its life
        self.num_lower_hit_blocks = 0  # of the loads, blocks a lower tier filled in the same step
        self.num_stored_blocks = 0

    def hits(self, parent: BlockHash, hashes: Sequence[BlockHash], contents: Sequence[bytes], limit: int) -> list[int]:
        """Host blocks continuing a chain whose device hits end at ``parent`` (at most ``limit``)."""
        if limit <= 0 or not self.pool.num_cached:
            return []
        return self.pool.lookup_chain(parent, hashes, contents, limit)

    def load(self, host_blocks: list[BlockId], device_blocks: list[BlockId]) -> None:
        """Owe the loads of ``host_blocks`` into ``device_blocks`` this step (the host blocks pinned until then)."""
        self.pool.touch_all(host_blocks)
        self._pinned += host_blocks
        self._ops.loads += zip(host_blocks, device_blocks)
        lower = sum(b in self._filled for b in host_blocks) if self._filled else 0
        self.num_lower_hit_blocks += lower
        self.num_hit_blocks += len(host_blocks) - lower

    def fill(self, records: list[BlockRecord], payload: object) -> int:
        """Take host blocks for a lower tier's leading ``records`` and owe their fill; how many fit.

        The host blocks of the chain the records continue are pinned for the step first: taking
        room must not evict the prefix the fill extends (the host hits the request will load).
        """
        if records:
            prefix = self.pool.chain_ending_at(records[0].parent)
            self.pool.touch_all(prefix)
            self._pinned += prefix
        room = min(len(records), self.pool.num_free)
        if room == 0:
            return 0
        blocks = self.pool.take(room)  # pinned (refcount 1) until the step's ops are taken
        for b, r in zip(blocks, records):
            self.pool.register_chain((b,), (r.hash,), r.parent, (r.tokens,))
        self._pinned += blocks
        self._filled.update(blocks)
        self._ops.fills.append(Fill(blocks, records[:room], payload))
        return room

    def take_ops(self, device_records: list[CacheRecord]) -> TierOps:
        """The step's ops, with the stores the device pool's journal owes; unpin this step's host blocks."""
        for kind, block, h, parent, tokens in device_records:
            if kind == EVICTED or (kind == STORED and self.policy == "write"):
                store = self._store(block, BlockRecord(h, parent, tokens))
                if store is not None:
                    (self._ops.stores if kind == EVICTED else self._ops.post_stores).append(store)
        self.pool.release(self._pinned)
        ops, self._ops, self._pinned = self._ops, TierOps(), []
        self._filled.clear()
        return ops

    def _store(self, device_block: BlockId, r: BlockRecord) -> tuple[BlockId, BlockId, BlockRecord] | None:
        """A host block for a device block's content, or None if the tier has it already (refreshed) or is full."""
        pool = self.pool
        held = pool.lookup_chain(r.parent, (r.hash,), (r.tokens,), 1)
        if held:
            if pool.ref_counts[held[0]] == 0:  # most recently used again
                pool.touch_all(held)
                pool.release(held)
            return None
        if pool.num_free == 0:  # every host block pinned by this step
            return None
        block = pool.take(1)  # pinned until the ops are taken: no later store of the step reuses it
        pool.register_chain(block, (r.hash,), r.parent, (r.tokens,))
        self._pinned += block
        self.num_stored_blocks += 1
        return device_block, block[0], r

    def clear(self) -> None:
        """Forget every cached host block (pinned ones stay pinned until the ops are taken)."""
        self.pool.reset_cache()

    def check(self) -> None:
        """Verify the host pool's invariants (pinned blocks are its only references)."""
        refs = [0] * self.pool.num_blocks
        for b in self._pinned:
            refs[b] += 1
        self.pool.check(refs)

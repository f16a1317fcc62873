"""The block manager's lower tiers, cache events and pinned prefixes.

A mixin of :class:`~paged_kv.block_manager.BlockManager`: the host tier's lookups and the
step's transfers (``paged_kv.host_tier``), a lower tier's fill of the host tier, the journal
of every cache-index change (KV events), and prefixes pinned on the device.

Relies on the manager's ``gpu`` pool, ``host`` (a HostTier or None), ``block_size``,
``_version``, ``_owed`` (device records the host tier has not seen), ``_events`` (None when
not tracked), ``_pins``, and its private ``_stream``, ``_hits_of`` and ``_max_hit_blocks``.
The manager's rules hold here: a method that raises changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable

from paged_kv.block_hash import BlockHash, BlockHashes, salt_root
from paged_kv.block_pool import BlockId, BlockPool, CacheRecord
from paged_kv.errors import DuplicateSequenceError, InvalidArgumentError, UnknownSequenceError, check_type, describe
from paged_kv.host_tier import BlockRecord, TierOps, check_record
from paged_kv.tokens import Tokens, as_token_array

CacheEvent = tuple[str, CacheRecord]  # (medium "GPU" or "CPU", a pool's journal record)


class CacheTiers:
    """The host tier, cache events and pins of a block manager, which inherits them."""

    # -- tiers and cache events ------------------------------------------
    def take_tier_ops(self) -> TierOps:
        """The host-tier transfers owed since the last call, in the order they must run (see paged_kv.host_tier)."""
        self._drain(self.gpu, "GPU")
        if self.host is None:
            return TierOps()
        owed, self._owed = self._owed, []
        ops = self.host.take_ops(owed)
        self._drain(self.host.pool, "CPU")
        return ops

    def take_cache_events(self) -> list[CacheEvent]:
        """Every change of the device and host cache indexes since the last call, in order (KV events)."""
        if self._events is None:
            raise InvalidArgumentError(describe("track_cache_events", False, "a manager configured to track them"))
        self._drain(self.gpu, "GPU")
        if self.host is not None:
            self._drain(self.host.pool, "CPU")
        events, self._events = self._events, []
        return events

    def _drain(self, pool: BlockPool, medium: str) -> None:
        """Move a pool's journal to the events (and a device pool's to the host tier's owed records)."""
        records = pool.journal
        if not records:
            return
        pool.journal = []
        if self._events is not None:
            self._events += [(medium, r) for r in records]
        if pool is self.gpu and self.host is not None:
            self._owed += records

    # -- pinned prefixes ---------------------------------------------------
    def pin(self, pin_id: Hashable, token_ids: Tokens, *, cache_salt: str | bytes | None = None) -> int:
        """Hold the cached device blocks of ``token_ids``'s leading full blocks while pinned; return tokens held.

        Pinned blocks are referenced, so never evicted. Only the run cached now is held: pin
        a prompt after a request has computed it (``LLMEngine.pin_prefix`` does).
        """
        try:
            taken = pin_id in self._pins
        except TypeError:
            raise InvalidArgumentError(describe("pin_id", pin_id, "a hashable id")) from None
        if taken:
            raise DuplicateSequenceError(describe("pin_id", pin_id, "an id not already pinned"))
        ids = as_token_array("token_ids", token_ids)
        if ids is None:
            raise InvalidArgumentError(describe("token_ids", token_ids, "a sequence of token ids (not a count)"))
        h = self._stream(ids, cache_salt, None)
        blocks = [] if h is None else self.gpu.lookup_chain(h.root, h.hashes, h.contents, len(h.hashes))
        self._version += 1
        self.gpu.touch_all(blocks)
        self._pins[pin_id] = blocks
        return len(blocks) * self.block_size

    def unpin(self, pin_id: Hashable) -> None:
        """Release a pinned prefix's blocks (cached and evictable again, most recently used)."""
        try:
            blocks = self._pins.pop(pin_id)
        except (KeyError, TypeError):
            raise UnknownSequenceError(describe("pin_id", pin_id, "a pinned prefix's id")) from None
        self._version += 1
        self.gpu.release(reversed(blocks))

    @property
    def pinned(self) -> dict[Hashable, int]:
        """Tokens held by each pinned prefix."""
        return {k: len(v) * self.block_size for k, v in self._pins.items()}

    @property
    def num_pinned_blocks(self) -> int:
        """Device blocks held by pinned prefixes (each once: pins may share blocks)."""
        return len({b for blocks in self._pins.values() for b in blocks})

    def _pinned_records(self) -> list[tuple[BlockId, BlockHash, BlockHash, bytes]]:
        """Each cached block pinned prefixes hold, once, in chain order: (block, hash, parent hash, contents)."""
        records = {b: (b, h, parent, tokens) for b, h, parent, tokens in self.gpu.cached_blocks()}
        pinned = dict.fromkeys(b for blocks in self._pins.values() for b in blocks)
        return [records[b] for b in pinned if b in records]

    def num_pinned_blocks_apart(self, token_ids: Tokens, *, cache_salt: str | bytes | None = None) -> int:
        """Device blocks held by pinned prefixes that a new allocation of ``token_ids`` would not share (hit)."""
        ids = as_token_array("token_ids", token_ids)
        salt_root(cache_salt)
        if not self._pins:
            return 0
        pinned = {b for blocks in self._pins.values() for b in blocks}
        if ids is None:  # anonymous tokens share nothing
            return len(pinned)
        head = ids[: max(map(len, self._pins.values())) * self.block_size + 1]  # a pin is shared within its length
        return len(pinned.difference(self._hits_of(self._stream(head, cache_salt, None), len(head))))

    def chain_past_cache(
        self, token_ids: Tokens, *, cache_salt: str | bytes | None = None, hashes: BlockHashes | None = None
    ) -> tuple[BlockHash, list[BlockHash], list[bytes]]:
        """The full blocks of a prompt past its device and host hits (never its last token): a lower tier's query.

        ``(parent, hashes, contents)``: what :meth:`fill_host` may add, in chain order.
        """
        ids = as_token_array("token_ids", token_ids)
        h, n = self._stream(ids, cache_salt, hashes), len(ids) if ids is not None else token_ids
        if h is None or self.host is None:
            return (b"", [], [])
        gpu = len(self._hits_of(h, n))
        k = gpu + len(self._host_hits(h, gpu, n))
        end = self._max_hit_blocks(n)
        return (h.hashes[k - 1] if k else h.root), h.hashes[k:end], h.contents[k:end]

    def fill_host(self, records: list[BlockRecord], payload: object) -> int:
        """Add a lower tier's blocks (``records``, chained, with their data ``payload``) to the host tier.

        Returns how many leading records found room; the runner writes ``payload`` into their
        host blocks before this step's loads (``TierOps.fills``).
        """
        if self.host is None:
            raise InvalidArgumentError(describe("num_host_blocks", 0, "> 0 for a lower tier to fill the host tier"))
        check_type("records", records, list, "a list of BlockRecord")
        for i, r in enumerate(records):
            check_type(f"records[{i}]", r, BlockRecord, "a BlockRecord")
            check_record(f"records[{i}]", r, 8 * self.block_size)  # else the host pool would index what never hits
        self._version += 1
        return self.host.fill(records, payload)

    def _host_hits(self, hashes: BlockHashes | None, num_hits: int, num_tokens: int) -> list[BlockId]:
        """Host-tier blocks continuing a stream's ``num_hits`` device hits (never covering its last token)."""
        if self.host is None or hashes is None:
            return []
        limit = self._max_hit_blocks(num_tokens) - num_hits
        if limit <= 0 or len(hashes.hashes) <= num_hits:
            return []
        parent = hashes.hashes[num_hits - 1] if num_hits else hashes.root
        end = num_hits + limit
        return self.host.hits(parent, hashes.hashes[num_hits:end], hashes.contents[num_hits:end], limit)


"""The engine's KV cache events: every change of each tier's cache index, published after each step.

The block manager journals its device ("GPU") and host ("CPU") indexes, the disk tier its own
("STORAGE"); after a step (once its K/V is written and its stores are issued) the changes become
vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events, one batch per step, and go
to the publisher. A block's parent is its chain's previous hash; a prompt's first block has
the root hash of its cache salt as parent (it never appears as a block hash, so a router reads
it as vLLM's ``None``).

A block computed through a LoRA adapter names it (``lora_name``, ``lora_id``): the engine names the
root of each adapter's chains (:meth:`CacheEvents.name_root`), and a stored block whose parent is
named inherits its name. The names are remembered per hash for the last ``MAX_NAMED`` blocks.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Protocol

from paged_kv.block_manager import BlockManager
from paged_kv.block_pool import CLEARED, DROPPED, EVICTED, STORED
from scheduler.core.kv_events_config import KVEventsConfig
from scheduler.engine.kv_event_publisher import EventPublisher, make_publisher
from scheduler.engine.kv_events import MEDIUM_STORAGE, KVEventRecorder, LoRATag

MAX_NAMED = 1 << 20  # block hashes whose adapter is remembered (the oldest forgotten first)


class DiskJournal(Protocol):
    """What the events need of the disk tier (``paged_kv.tiers.DiskTier`` has it)."""

    def take_changes(self) -> list[tuple[str, list]]:
        """("stored" | "removed", blocks) since the last call, in order."""
        ...

    def indexed_blocks(self) -> list:
        """Every block indexed now."""
        ...


class CacheEvents:
    """Turns the tiers' journals into one batch of vLLM KV events per step and publishes it."""

    def __init__(self, config: KVEventsConfig, bm: BlockManager, disk: DiskJournal | None = None) -> None:
        self.bm = bm
        self.disk = disk
        self.recorder = KVEventRecorder()
        self.publisher: EventPublisher = make_publisher(config)
        self._lora: OrderedDict[bytes, LoRATag] = OrderedDict()  # hash (or adapter root) -> its adapter

    def name_root(self, root: bytes, name: str, lora_id: int) -> None:
        """Name the adapter whose chains start at ``root`` (blocks stored after it carry the name)."""
        self._tag(root, (lora_id, name))

    def _tag(self, h: bytes, tag: LoRATag) -> None:
        self._lora[h] = tag
        self._lora.move_to_end(h)
        if len(self._lora) > MAX_NAMED:
            self._lora.popitem(last=False)

    def _lora_of(self, h: bytes, parent: bytes | None) -> LoRATag | None:
        """A stored block's adapter: its parent's (remembered for the block too), or None."""
        tag = self._lora.get(parent) if parent is not None else None
        if tag is not None:
            self._tag(h, tag)
        return tag

    def after_step(self) -> None:
        """Record the step's cache changes and publish them as one batch (nothing if none)."""
        self.record()
        batch = self.recorder.take_batch()
        if batch is not None:
            self.publisher.publish(batch)

    def record(self) -> None:
        """Record the tiers' changes since the last call, in the order each tier made them."""
        bs, recorder, cleared = self.bm.block_size, self.recorder, False
        for medium, (kind, _, h, parent, tokens) in self.bm.take_cache_events():
            if kind == STORED:
                recorder.stored([h], parent, _ids(tokens), bs, medium, lora=self._lora_of(h, parent))
            elif kind in (EVICTED, DROPPED):
                recorder.removed([h], medium)
            elif kind == CLEARED:
                recorder.cleared()
                cleared = True
        if self.disk is not None:
            self._record_disk(cleared)

    def _record_disk(self, cleared: bool) -> None:
        """The disk tier's changes; after an ``AllBlocksCleared`` (which empties every tier for a router, but
        the disk's files outlive a reset) every block it holds, announced again."""
        changes = self.disk.take_changes()
        if cleared:
            changes = [("stored", self.disk.indexed_blocks())]  # the index now: every change folded in
        for kind, blocks in changes:
            for b in blocks:
                if kind == "stored":
                    self.recorder.stored([b.hash], b.parent, _ids(b.tokens), self.bm.block_size, MEDIUM_STORAGE,
                                         lora=self._lora_of(b.hash, b.parent))  # fmt: skip
                else:
                    self.recorder.removed([b.hash], MEDIUM_STORAGE)

    def shutdown(self) -> None:
        """Publish what is left, then close the publisher."""
        self.after_step()
        self.publisher.shutdown()


def _ids(tokens: bytes) -> list[int]:
    """A block's token ids from their int64 bytes (the block manager's and the disk tier's records)."""
    return array("q", tokens).tolist()

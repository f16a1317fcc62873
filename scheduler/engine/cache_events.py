"""The engine's KV cache events: every change of each tier's cache index, published after each step.

The block manager journals its device ("GPU") and host ("CPU") indexes, the disk tier its own
("STORAGE"); after a step (once its K/V is written and its stores are issued) the changes become
vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events, one batch per step, and go
to the publisher. A block's parent is its chain's previous hash; a prompt's first block has
the root hash of its cache salt as parent (it never appears as a block hash, so a router reads
it as vLLM's ``None``).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from paged_kv.block_manager import BlockManager
from paged_kv.block_pool import CLEARED, DROPPED, EVICTED, STORED
from scheduler.core.kv_events_config import KVEventsConfig
from scheduler.engine.kv_event_publisher import EventPublisher, make_publisher
from scheduler.engine.kv_events import MEDIUM_STORAGE, KVEventRecorder

DiskChanges = Callable[[], list[tuple[str, list]]]  # the disk tier's take_changes


class CacheEvents:
    """Turns the tiers' journals into one batch of vLLM KV events per step and publishes it."""

    def __init__(self, config: KVEventsConfig, bm: BlockManager, disk_changes: DiskChanges | None = None) -> None:
        self.bm = bm
        self.disk_changes = disk_changes
        self.recorder = KVEventRecorder()
        self.publisher: EventPublisher = make_publisher(config)

    def after_step(self) -> None:
        """Record the step's cache changes and publish them as one batch (nothing if none)."""
        self.record()
        batch = self.recorder.take_batch()
        if batch is not None:
            self.publisher.publish(batch)

    def record(self) -> None:
        """Record the tiers' changes since the last call, in the order each tier made them."""
        bs, recorder = self.bm.block_size, self.recorder
        for medium, (kind, _, h, parent, tokens) in self.bm.take_cache_events():
            if kind == STORED:
                recorder.stored([h], parent, _ids(tokens), bs, medium)
            elif kind in (EVICTED, DROPPED):
                recorder.removed([h], medium)
            elif kind == CLEARED:
                recorder.cleared()
        for kind, blocks in self.disk_changes() if self.disk_changes is not None else ():
            for b in blocks:
                if kind == "stored":
                    recorder.stored([b.hash], b.parent, _ids(b.tokens), bs, MEDIUM_STORAGE)
                else:
                    recorder.removed([b.hash], MEDIUM_STORAGE)

    def shutdown(self) -> None:
        """Publish what is left, then close the publisher."""
        self.after_step()
        self.publisher.shutdown()


def _ids(tokens: bytes) -> list[int]:
    """A block's token ids from their int64 bytes (the block manager's and the disk tier's records)."""
    return array("q", tokens).tolist()

"""Runs a step's host-tier transfers (:class:`~paged_kv.host_tier.TierOps`) between the device and host pools.

On CPU every copy runs synchronously, in the order the ops require: stores, fills, loads
before the forward; post-stores after it. On CUDA the copies run on a side stream: the
compute stream waits for them on the device before the forward (its writes may reuse a
stored block, its reads need the loaded ones), and the host waits for a store only when a
later fill or load touches a host block it has not landed yet: a store's rows land in a
pinned staging buffer, and are scattered into the host pool (and written through to disk)
at the start of a later step, once its event has completed, oldest first.
Nothing here reads a device value on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged_kv.host_tier import BlockRecord, TierOps
from paged_kv.kv_cache import PagedKVCache

WriteThrough = Callable[[list[BlockRecord], torch.Tensor, torch.Tensor | None], None]  # (blocks, kv, scales)
Store = tuple[int, int, BlockRecord]  # (device block, host block, its identity)


class TierTransfers:
    """The copies between a device pool and its host tier, with an optional write-through to a lower tier."""

    def __init__(
        self, device_cache: PagedKVCache, host_cache: PagedKVCache, write_through: WriteThrough | None
    ) -> None:
        self.device_cache = device_cache
        self.host_cache = host_cache
        self.write_through = write_through
        cuda = device_cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(device_cache.device) if cuda else None
        self._landing: list[tuple[torch.cuda.Event, list[Store], list[torch.Tensor]]] = []  # CUDA stores in flight
        self.bytes_stored = self.bytes_loaded = 0

    def before_forward(self, ops: TierOps) -> None:
        """Stores of evicted blocks, fills from a lower tier, then loads of host hits."""
        self._land()
        if ops.stores:
            self._store(ops.stores)
        for fill in ops.fills:
            self._land_before(fill.host_blocks)  # an older store to a reused host block must not land over it
            kv, scales = fill.payload  # one row per record read; the host tier may have taken fewer (its room)
            n = len(fill.host_blocks)
            self.host_cache.write_blocks(fill.host_blocks, kv[:n], None if scales is None else scales[:n])
        if ops.loads:
            self._load(ops.loads)

    def after_forward(self, ops: TierOps) -> None:
        """Stores of the blocks the forward filled (the ``"write"`` policy)."""
        if ops.post_stores:
            self._store(ops.post_stores)

    def flush(self) -> None:
        """Wait for every store in flight and land it (shutdown, tests)."""
        for event, _, _ in self._landing:
            event.synchronize()
        self._land()

    # -- copies ------------------------------------------------------------
    def _store(self, stores: list[Store]) -> None:
        self.bytes_stored += len(stores) * self.host_cache.spec.bytes_per_block
        if self.stream is None:
            self.host_cache.swap_from(self.device_cache, [(d, h) for d, h, _ in stores])
            self._written(stores)
            return
        src = torch.tensor([d for d, _, _ in stores], dtype=torch.int64).to(self.device_cache.device)
        compute = torch.cuda.current_stream(self.device_cache.device)
        self.stream.wait_stream(compute)  # the blocks hold what earlier steps wrote
        with torch.cuda.stream(self.stream):
            staged = [_pinned_like(t, len(stores)).copy_(t.index_select(0, src), non_blocking=True)
                      for t in self.device_cache.tensors()]  # fmt: skip
            event = torch.cuda.Event()
            event.record(self.stream)
        compute.wait_event(event)  # the step's writes may reuse these blocks
        self._landing.append((event, stores, staged))

    def _land_before(self, host_blocks: list[int]) -> None:
        """Wait for and land the stores in flight if one of them targets ``host_blocks`` (nothing on CPU)."""
        if self._landing:
            touched = set(host_blocks)
            if any(h in touched for _, stores, _ in self._landing for _, h, _ in stores):
                self.flush()

    def _land(self) -> None:
        """Scatter completed CUDA stores into the host pool, oldest first, and write them through."""
        while self._landing and self._landing[0][0].query():
            _, stores, staged = self._landing.pop(0)
            dst = torch.tensor([h for _, h, _ in stores], dtype=torch.int64)
            for t, rows in zip(self.host_cache.tensors(), staged):
                t.index_copy_(0, dst, rows)
            self._written(stores)

    def _load(self, loads: list[tuple[int, int]]) -> None:
        self.bytes_loaded += len(loads) * self.host_cache.spec.bytes_per_block
        if self.stream is None:
            self.device_cache.swap_from(self.host_cache, loads)
            return
        self._land_before([h for h, _ in loads])  # a load may read a block an in-flight store has not landed yet
        compute = torch.cuda.current_stream(self.device_cache.device)
        with torch.cuda.stream(self.stream):
            self.device_cache.swap_from(self.host_cache, loads)  # pinned source: non-blocking on this stream
            event = torch.cuda.Event()
            event.record(self.stream)
        compute.wait_event(event)

    def _written(self, stores: list[Store]) -> None:
        """Hand the stored blocks, now in the host pool, to the lower tier."""
        if self.write_through is not None:
            kv, scales = self.host_cache.read_blocks([h for _, h, _ in stores])
            self.write_through([r for _, _, r in stores], kv, scales)


def _pinned_like(t: torch.Tensor, n: int) -> torch.Tensor:
    """A pinned host buffer for ``n`` blocks of device tensor ``t``."""
    return torch.empty((n, *t.shape[1:]), dtype=t.dtype, pin_memory=True)

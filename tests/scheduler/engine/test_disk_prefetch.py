"""Background reads from the disk tier: what lands in the host tier when the upper tiers changed meanwhile."""

from __future__ import annotations

import threading

import pytest
import torch

from paged_kv import BlockManager, BlockManagerConfig
from paged_kv.tiers.disk_tier import DiskBlock, DiskTier, ModelFingerprint
from scheduler.engine.disk_prefetch import DiskPrefetch

BS = 2
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # 4 full blocks a hit may cover (never the last token)
FP = ModelFingerprint(architecture="Toy", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=BS)


class GatedDisk:
    """A disk tier whose reads wait for ``gate`` and are counted; the blocks of ``PROMPT`` on it."""

    def __init__(self, directory, bm: BlockManager) -> None:
        self.tier = DiskTier(directory, capacity_bytes=1 << 24, fingerprint=FP)
        parent, hashes, contents = bm.chain_past_cache(PROMPT)
        self.blocks = [DiskBlock(hash=h, parent=p, tokens=c) for h, p, c in zip(hashes, [parent, *hashes], contents)]
        self.kv = {b.hash: torch.randn(FP.kv_shape, generator=torch.Generator().manual_seed(i))
                   for i, b in enumerate(self.blocks)}  # fmt: skip
        self.tier.put(self.blocks, torch.stack(list(self.kv.values())), None)
        self.tier.flush()
        self.gate = threading.Event()
        self.reads: list[int] = []
        self.find = self.tier.find

    def read(self, *args):
        assert self.gate.wait(10)
        got = self.tier.read(*args)
        self.reads.append(len(got[0]))
        return got

    def hashes(self) -> list[bytes]:
        return [b.hash for b in self.blocks]


@pytest.fixture
def tiers(tmp_path):
    bm = BlockManager(BlockManagerConfig(num_blocks=16, block_size=BS, watermark=0.0, num_host_blocks=8))
    disk = GatedDisk(tmp_path, bm)
    prefetch = DiskPrefetch(bm, disk)
    yield bm, disk, prefetch
    disk.tier.close()


def filled(bm: BlockManager, disk: GatedDisk) -> list[bytes]:
    """The hashes of the blocks this step's fills bring into the host tier (their payload checked against the disk)."""
    ops = bm.take_tier_ops()
    got = []
    for fill in ops.fills:
        kv, scales = fill.payload
        assert scales is None and torch.equal(kv, torch.stack([disk.kv[r.hash] for r in fill.records]))
        got += [r.hash for r in fill.records]
    return got


def test_a_read_in_flight_answers_not_ready_until_it_lands_then_fills_the_host_tier(tiers):
    bm, disk, prefetch = tiers
    assert not prefetch.prefetch(0, PROMPT, None, None)
    assert not prefetch.prefetch(0, PROMPT, None, None) and prefetch.num_reading == 1 and not filled(bm, disk)
    disk.gate.set()
    assert prefetch.prefetch(0, PROMPT, None, None, wait=True)
    assert filled(bm, disk) == disk.hashes() and prefetch.num_reading == 0
    assert bm.admission([(PROMPT, None)]).cached == (4 * BS,)  # the request is admitted with the hit


def test_a_prompt_the_disk_has_nothing_of_is_ready_at_once_without_a_read(tiers):
    bm, disk, prefetch = tiers
    assert prefetch.prefetch(0, [40, 41, 42, 43, 44], None, None)
    assert prefetch.num_reading == 0 and disk.reads == []


def test_blocks_the_device_gained_while_reading_are_skipped(tiers):
    bm, disk, prefetch = tiers
    assert not prefetch.prefetch(0, PROMPT, None, None)
    bm.allocate(99, PROMPT[:4])  # another request computes the first two blocks meanwhile
    bm.free(99)
    disk.gate.set()
    assert prefetch.prefetch(0, PROMPT, None, None, wait=True)
    assert filled(bm, disk) == disk.hashes()[2:]
    assert bm.admission([(PROMPT, None)]).cached == (4 * BS,)


def test_a_read_that_no_longer_continues_the_host_tier_is_read_again_once(tiers):
    bm, disk, prefetch = tiers
    disk.gate.set()
    assert prefetch.prefetch(0, PROMPT[:5], None, None, wait=True)  # the first two blocks into the host tier
    first_two = filled(bm, disk)
    disk.gate.clear()
    assert not prefetch.prefetch(1, PROMPT, None, None)  # reads blocks 2 and 3, continuing the host's
    bm.reset_prefix_cache()  # the host tier forgets the two blocks the read continues
    disk.gate.set()
    assert prefetch.prefetch(1, PROMPT, None, None, wait=True)
    assert disk.reads == [2, 2, 4]  # the stale read was dropped and the whole chain read again
    assert filled(bm, disk) == first_two + disk.hashes()[2:]


def test_a_forgotten_read_is_dropped_and_a_later_prefetch_starts_over(tiers):
    bm, disk, prefetch = tiers
    assert not prefetch.prefetch(0, PROMPT, None, None)
    prefetch.forget(0)
    assert prefetch.num_reading == 0
    disk.gate.set()
    assert prefetch.prefetch(0, PROMPT, None, None, wait=True) and len(filled(bm, disk)) == 4


def test_a_failed_read_is_a_miss(tiers):
    bm, disk, prefetch = tiers

    def broken(*args):
        raise OSError("disk gone")

    disk.read = broken
    assert prefetch.prefetch(0, PROMPT, None, None, wait=True)
    assert not filled(bm, disk) and bm.admission([(PROMPT, None)]).cached == (0,)

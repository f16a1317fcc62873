"""DiskTier: round trips, restart, chain semantics, budget, journal and the write queue."""

from __future__ import annotations

import threading
import time

import pytest
from disk_helpers import (
    BIG, BS, FP16, assert_data_of, batch, chain, fingerprint, indexed, journal_set, one_block_file, our_files, store,
)  # fmt: skip

from paged_kv.tiers import disk_store
from paged_kv.tiers.disk_tier import DiskTier

DTYPES = ["float16", "bfloat16", "float32", "int8", "float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_returns_the_bytes_written(tmp_path, dtype):
    fp = fingerprint(dtype=dtype)
    root, hashes, contents, blocks = chain(range(5 * BS))
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=fp, blocks_per_file=2) as tier:
        store(tier, blocks)
        assert tier.find(root, hashes, contents, limit=10) == 5
        got, kv, scales = tier.read(root, hashes, contents, limit=10)
        assert got == blocks
        assert_data_of(fp, blocks, kv, scales)
        assert (scales is not None) == fp.quantized
        s = tier.stats
        sizes = sum(p.stat().st_size for p in our_files(tmp_path, fp))
        assert (s.num_blocks, s.num_files, s.hits) == (5, 3, 5)  # 2 + 2 + 1 blocks per file
        assert s.bytes_written == s.bytes_used == sizes and s.bytes_read == sizes
        assert (s.files_skipped, s.writes_dropped) == (0, 0)


def test_restart_finds_the_blocks_and_reads_identical_tensors(tmp_path):
    root, hashes, contents, blocks = chain(range(7 * BS))
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16) as tier:
        store(tier, blocks)
    again = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16)
    assert again.find(root, hashes, contents, limit=7) == 7
    got, kv, scales = again.read(root, hashes, contents, limit=7)
    assert got == blocks
    assert_data_of(FP16, blocks, kv, scales)
    assert journal_set(again.take_changes()) == set(hashes)  # found by the scan: journaled as stored
    again.close()


def test_find_and_read_stop_at_the_first_missing_block_and_at_limit(tmp_path):
    root, hashes, contents, blocks = chain(range(5 * BS))
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, blocks_per_file=1) as tier:
        store(tier, [blocks[i] for i in (0, 1, 3, 4)])
        assert tier.find(root, hashes, contents, limit=5) == 2
        got, kv, _ = tier.read(root, hashes, contents, limit=5)
        assert got == blocks[:2] and kv.shape[0] == 2
        assert tier.find(root, hashes, contents, limit=1) == 1
        assert tier.read(root, hashes, contents, limit=0) == ([], None, None)
        assert tier.find(root, hashes[3:], contents[3:], limit=5) == 0  # block 3's parent is not root


def test_same_hash_with_other_parent_or_tokens_is_a_miss(tmp_path):
    root, hashes, contents, blocks = chain(range(3 * BS))
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16) as tier:
        store(tier, blocks)
        forged = list(contents)
        forged[1] = bytes(8 * BS)  # a colliding request: same hashes, other tokens for block 1
        assert tier.find(root, hashes, forged, limit=3) == 1
        assert tier.read(root, hashes, forged, limit=3)[0] == blocks[:1]
        assert tier.find(bytes(32), hashes, contents, limit=3) == 0  # other parent
        assert tier.read(bytes(32), hashes, contents, limit=3) == ([], None, None)


def test_another_salt_never_hits(tmp_path):
    _, hashes, contents, blocks = chain(range(2 * BS), salt="tenant-a")
    other_root, other_hashes, other_contents, _ = chain(range(2 * BS), salt="tenant-b")
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16) as tier:
        store(tier, blocks)
        assert tier.find(other_root, other_hashes, other_contents, limit=2) == 0
        assert tier.find(other_root, hashes, contents, limit=2) == 0  # even with tenant a's hashes
        assert tier.read(other_root, hashes, contents, limit=2) == ([], None, None)


def test_put_skips_blocks_already_indexed_or_queued(tmp_path):
    _, _, _, blocks = chain(range(4 * BS))
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16) as tier:
        kv, _ = batch(FP16, blocks[:2])
        tier.put(blocks[:2], kv, None)
        tier.put(blocks[:2], kv, None)  # queued already
        tier.flush()
        written = tier.stats.bytes_written
        store(tier, blocks[:2])  # indexed already: nothing to write
        assert tier.stats.bytes_written == written and len(our_files(tmp_path)) == 1
        store(tier, [blocks[0], blocks[0], blocks[2]])  # only block 2 is new, once
        assert tier.stats.num_blocks == 3 and len(our_files(tmp_path)) == 2


def test_budget_evicts_least_recently_used_files(tmp_path):
    capacity = 3 * one_block_file()
    chains = [chain(range(100 * i, 100 * i + BS)) for i in range(6)]
    with DiskTier(tmp_path, capacity_bytes=capacity, fingerprint=FP16, blocks_per_file=1) as tier:
        for _, _, _, blocks in chains[:3]:
            store(tier, blocks)
        root, hashes, contents, _ = chains[0]
        assert len(tier.read(root, hashes, contents, limit=1)[0]) == 1  # chain 0 is now the most recent
        for _, _, _, blocks in chains[3:5]:
            store(tier, blocks)
        alive = [tier.find(r, h, c, limit=1) for r, h, c, _ in chains[:5]]
        assert alive == [1, 0, 0, 1, 1]  # chains 1 and 2 were least recently used
        s = tier.stats
        assert s.bytes_used <= capacity and s.num_files == 3 == len(our_files(tmp_path))
        assert journal_set(tier.take_changes()) == indexed(tier)


def test_files_never_exceed_the_budget_even_when_blocks_per_file_would(tmp_path):
    capacity = 2 * one_block_file()
    root, hashes, contents, blocks = chain(range(5 * BS))
    with DiskTier(tmp_path, capacity_bytes=capacity, fingerprint=FP16, blocks_per_file=8) as tier:
        store(tier, blocks)
        assert tier.stats.bytes_used <= capacity and tier.stats.num_blocks >= 1
        assert all(p.stat().st_size <= capacity for p in our_files(tmp_path))
        assert indexed(tier) <= set(hashes) and blocks[-1].hash in indexed(tier)  # the newest kept


def test_the_journal_matches_the_index_through_writes_evictions_and_restart(tmp_path):
    capacity = 4 * one_block_file()
    tier = DiskTier(tmp_path, capacity_bytes=capacity, fingerprint=FP16, blocks_per_file=2)
    live: set[bytes] = set()
    for i in range(6):
        store(tier, chain(range(50 * i, 50 * i + 3 * BS))[3])
        journal_set(tier.take_changes(), live)
        assert live == indexed(tier)
    tier.close()
    restarted = DiskTier(tmp_path, capacity_bytes=capacity, fingerprint=FP16)
    assert journal_set(restarted.take_changes()) == indexed(restarted) == live
    assert restarted.take_changes() == []  # drained
    restarted.close()


def test_put_never_waits_for_the_disk_and_drops_the_oldest_writes_past_the_limit(tmp_path, monkeypatch):
    started, release = threading.Event(), threading.Event()
    real_write = disk_store.DiskStore.write

    def slow_write(self, *args):
        started.set()
        assert release.wait(10)
        return real_write(self, *args)

    monkeypatch.setattr(disk_store.DiskStore, "write", slow_write)
    chains = [chain(range(100 * i, 100 * i + BS))[3] for i in range(5)]
    one = batch(FP16, chains[0])[0].nbytes
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, max_pending_bytes=2 * one) as tier:
        tier.put(chains[0], *batch(FP16, chains[0]))
        assert started.wait(10)  # the writer holds chain 0 and waits
        for blocks in chains[1:]:
            tier.put(blocks, *batch(FP16, blocks))  # returns at once though the writer is stuck
        assert tier.stats.writes_dropped == 2  # chains 1 and 2, the oldest queued
        release.set()
        tier.flush()
        assert indexed(tier) == {chains[i][0].hash for i in (0, 3, 4)}


def test_a_failed_write_is_counted_and_leaves_no_file(tmp_path, monkeypatch):
    def no_space(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_store, "write_atomically", no_space)
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16) as tier:
        store(tier, chain(range(2 * BS))[3])
        assert tier.stats.writes_dropped == 2 and tier.stats.num_blocks == 0
    assert list(tmp_path.iterdir()) == []


def test_a_read_that_stops_at_a_miss_leaves_no_load_running(tmp_path, monkeypatch):
    # a miss in the first file ends the read; the later files' loads must not outlive it (one of
    # them could delete a corrupt file, or mark a file used, after the caller got its answer)
    root, hashes, contents, blocks = chain(range(4 * BS))
    real_load, running = disk_store.DiskStore.load, []

    def load(self, name, expect):
        if any(b.hash == hashes[0] for b in expect.values()):
            return None  # the first file: unreadable now
        running.append(name)
        time.sleep(0.3)  # a later file: still loading when the first one has missed
        running.remove(name)
        return real_load(self, name, expect)

    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, blocks_per_file=1) as tier:
        store(tier, blocks)
        monkeypatch.setattr(disk_store.DiskStore, "load", load)
        assert tier.read(root, hashes, contents, limit=4) == ([], None, None)
        assert running == []

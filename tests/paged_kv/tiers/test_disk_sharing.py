"""Several DiskTiers on one directory: concurrent writers, reads during writes, another process, LRU across engines."""

from __future__ import annotations

import multiprocessing
import threading
import time

from disk_helpers import (
    BIG, BS, FP16, assert_data_of, batch, chain, fingerprint, indexed, journal_set, one_block_file, our_files, store,
    write_in_child,
)  # fmt: skip

from paged_kv.tiers.disk_tier import DiskTier

WIDE = fingerprint(num_layers=4, num_kv_heads=4, head_dim=64)  # 16 KiB blocks: writes take a while


def _read_all(tier, chains):
    """Read each chain fully from ``tier``, checking every block returned; the blocks read."""
    total = 0
    for root, hashes, contents, _ in chains:
        got, kv, scales = tier.read(root, hashes, contents, limit=len(hashes))
        assert [b.hash for b in got] == hashes[: len(got)]
        assert_data_of(tier.fingerprint, got, kv, scales)
        total += len(got)
    return total


def test_two_tiers_writing_at_once_see_each_other_after_refresh(tmp_path):
    chains = [chain(range(100 * i, 100 * i + 3 * BS)) for i in range(8)]
    a = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, blocks_per_file=2)
    b = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, blocks_per_file=2)
    work = {a: chains[:5], b: chains[3:]}  # chains 3 and 4 written by both
    threads = [threading.Thread(target=lambda t=t: [store(t, c[3]) for c in work[t]]) for t in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = {h for c in chains for h in c[1]}
    for tier in (a, b):
        tier.refresh()
        assert indexed(tier) == everything and _read_all(tier, chains) == 24
        assert tier.stats.files_skipped == 0
        assert journal_set(tier.take_changes()) == everything
        tier.close()


def test_a_reader_never_sees_a_partial_file_while_another_tier_writes(tmp_path):
    chains = [chain(range(1000 * i, 1000 * i + 8 * BS)) for i in range(12)]
    writer = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=WIDE, blocks_per_file=4)
    reader = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=WIDE)
    done = threading.Event()

    def write():
        for c in chains:
            writer.put(c[3], *_batch(c[3]))
        writer.flush()
        done.set()

    thread = threading.Thread(target=write)
    thread.start()
    rounds = read = 0
    while not done.is_set() or rounds == 0:
        reader.refresh()
        read += _read_all(reader, chains)
        rounds += 1
    thread.join()
    reader.refresh()
    assert _read_all(reader, chains) == 96
    assert reader.stats.files_skipped == 0 and writer.stats.files_skipped == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    writer.close()
    reader.close()


def _batch(blocks):
    return batch(WIDE, blocks)


def test_another_process_sees_the_blocks_after_its_flush(tmp_path):
    root, hashes, contents, blocks = chain(range(5 * BS), salt="proc")
    tier = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16)
    child = multiprocessing.get_context("spawn").Process(
        target=write_in_child, args=(str(tmp_path), list(range(5 * BS)), "proc"))  # fmt: skip
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    assert tier.find(root, hashes, contents, limit=5) == 0  # not until a refresh
    tier.refresh()
    got, kv, scales = tier.read(root, hashes, contents, limit=5)
    assert got == blocks
    assert_data_of(FP16, got, kv, scales)
    assert journal_set(tier.take_changes()) == set(hashes)
    tier.close()


def test_eviction_spares_a_file_another_tier_used_since(tmp_path):
    capacity = 3 * one_block_file()
    chains = [chain(range(100 * i, 100 * i + BS)) for i in range(4)]
    owner = DiskTier(tmp_path, capacity_bytes=capacity, fingerprint=FP16, blocks_per_file=1)
    for c in chains[:3]:
        store(owner, c[3])
        time.sleep(0.02)  # distinct mtimes, whatever the file system's clock granularity
    user = DiskTier(tmp_path, capacity_bytes=capacity, fingerprint=FP16)
    root, hashes, contents, _ = chains[0]
    assert len(user.read(root, hashes, contents, limit=1)[0]) == 1  # marks chain 0's file used
    time.sleep(0.02)
    store(owner, chains[3][3])  # over budget: the owner's oldest record is chain 0, but it was used
    alive = [owner.find(r, h, c, limit=1) for r, h, c, _ in chains]
    assert alive == [1, 0, 1, 1]
    assert len(our_files(tmp_path)) == 3
    user.refresh()  # the user forgets the evicted file and indexes the new one
    assert [user.find(r, h, c, limit=1) for r, h, c, _ in chains] == alive
    owner.close()
    user.close()

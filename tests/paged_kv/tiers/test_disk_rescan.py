"""The disk tier's background rescan: engines sharing a directory find each other's files while they run."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from disk_helpers import (
    BIG,
    BS,
    FP16,
    Scans,
    assert_data_of,
    chain,
    indexed,
    journal_set,
    one_block_file,
    our_files,
    store,
)

from paged_kv.errors import InvalidArgumentError
from paged_kv.tiers.disk_format import TMP_PREFIX
from paged_kv.tiers.disk_tier import DiskTier

FAST = 0.02  # seconds between rescans: each test waits for a scan to end, never for a duration


def _chains(n: int, blocks: int = 1) -> list[tuple]:
    return [chain(range(100 * i, 100 * i + blocks * BS), salt="rescan") for i in range(n)]


def _found(tier: DiskTier, chains: list[tuple]) -> list[int]:
    return [tier.find(root, hashes, contents, limit=len(hashes)) for root, hashes, contents, _ in chains]


def test_a_running_tier_finds_another_tiers_blocks_at_its_next_rescan_and_journals_them(tmp_path):
    chains = _chains(3, blocks=3)
    reader = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, refresh_interval_s=FAST)
    scans = Scans(reader)
    assert _found(reader, chains) == [0, 0, 0] and reader.take_changes() == []  # started on an empty directory
    writer = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, blocks_per_file=2)
    for c in chains:
        store(writer, c[3])
    scans.wait_fresh()
    assert _found(reader, chains) == [3, 3, 3]
    for root, hashes, contents, blocks in chains:
        got, kv, scales = reader.read(root, hashes, contents, limit=3)
        assert got == blocks
        assert_data_of(FP16, got, kv, scales)
    everything = {h for c in chains for h in c[1]}
    assert journal_set(reader.take_changes()) == everything  # the "stored" changes a start-up scan makes
    ours, theirs = reader.stats, writer.stats
    assert (ours.num_blocks, ours.num_files) == (theirs.num_blocks, theirs.num_files) == (9, 6)
    assert ours.bytes_used == theirs.bytes_used
    assert ours.files_skipped == 0 and ours.bytes_written == 0
    writer.close()
    reader.close()


def test_a_file_another_tier_evicts_is_a_miss_then_leaves_the_index_with_a_removed_change(tmp_path):
    chains = _chains(4)
    writer = DiskTier(tmp_path, capacity_bytes=3 * one_block_file(), fingerprint=FP16, blocks_per_file=1)
    reader = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, refresh_interval_s=FAST)
    scans = Scans(reader)
    for c in chains[:3]:
        store(writer, c[3])
    scans.wait_fresh()
    live = journal_set(reader.take_changes())
    assert _found(reader, chains) == [1, 1, 1, 0]
    store(writer, chains[3][3])  # over its budget: the writer deletes its least recently used file, chain 0's
    assert _found(writer, chains) == [0, 1, 1, 1] and len(our_files(tmp_path)) == 3
    root, hashes, contents, _ = chains[0]
    assert reader.read(root, hashes, contents, limit=1) == ([], None, None)  # stale index or not: a miss
    scans.wait_fresh()
    assert _found(reader, chains) == [0, 1, 1, 1]
    journal_set(reader.take_changes(), into=live)
    assert live == indexed(reader) == set(chains[1][1] + chains[2][1] + chains[3][1])
    assert reader.stats.files_skipped == 0 and reader.stats.bytes_used == 3 * one_block_file()
    writer.close()
    reader.close()


def test_files_a_rescan_finds_count_in_the_budget_and_are_evicted_as_at_start_up(tmp_path):
    chains = _chains(4)
    small = DiskTier(tmp_path, capacity_bytes=2 * one_block_file(), fingerprint=FP16, refresh_interval_s=FAST)
    scans = Scans(small)
    writer = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, blocks_per_file=1)
    for c in chains:
        store(writer, c[3])
    scans.wait_fresh()
    assert small.stats.bytes_used <= small.capacity_bytes
    assert len(our_files(tmp_path)) == 2 and small.stats.num_files == 2
    assert sum(_found(small, chains)) == 2
    assert journal_set(small.take_changes()) == indexed(small)  # stored then removed, or never announced
    writer.refresh()  # the writer learns of the deletes at its own scan: its reads of them were misses
    assert _found(writer, chains) == _found(small, chains)
    writer.close()
    small.close()


def test_rescans_during_our_own_writes_journal_each_block_once(tmp_path):
    chains = _chains(40, blocks=2)
    tier = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, blocks_per_file=1, refresh_interval_s=1e-4)
    scans = Scans(tier)
    changes = []
    for c in chains:  # each file is listed by scans before, while or after the writer indexes it
        store(tier, c[3])
        changes += tier.take_changes()
    scans.wait_fresh()
    changes += tier.take_changes()
    everything = {h for c in chains for h in c[1]}
    assert journal_set(changes) == indexed(tier) == everything  # never "stored" twice
    assert tier.stats.num_files == len(our_files(tmp_path)) == 80 and tier.stats.files_skipped == 0
    tier.close()


def test_a_rescan_leaves_a_temporary_file_being_written_alone(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, refresh_interval_s=FAST)
    scans = Scans(tier)
    partial = tmp_path / f"{TMP_PREFIX}4242-writing"
    partial.write_bytes(b"half a file")
    scans.wait_fresh()
    assert partial.read_bytes() == b"half a file"
    assert tier.stats.num_files == 0 and tier.stats.files_skipped == 0
    tier.close()


def test_a_failed_rescan_is_logged_and_the_next_one_scans(tmp_path, caplog):
    tier = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, refresh_interval_s=FAST)
    scans = Scans(tier, fail=1)
    root, hashes, contents, blocks = chain(range(2 * BS))
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16) as writer:
        store(writer, blocks)
    with caplog.at_level(logging.ERROR, logger="paged_kv.tiers.disk_tier"):
        scans.wait_fresh()
    assert scans.fail == 0 and "rescanning" in caplog.text
    assert tier.find(root, hashes, contents, limit=2) == 2
    tier.close()


def test_close_stops_the_rescans_at_once_whatever_the_interval(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, refresh_interval_s=3600)
    rescanner = next(t for t in threading.enumerate() if t.name == "paged-kv-disk-rescan" and t.is_alive())
    start = time.monotonic()
    tier.close()
    assert time.monotonic() - start < 5.0
    assert not rescanner.is_alive()


@pytest.mark.parametrize("interval", [None, 0, 0.0])
def test_no_interval_means_no_rescan_thread(tmp_path, interval):
    before = {t for t in threading.enumerate() if t.name == "paged-kv-disk-rescan"}
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, refresh_interval_s=interval):
        assert {t for t in threading.enumerate() if t.name == "paged-kv-disk-rescan"} == before


@pytest.mark.parametrize("bad", [-1.0, -1e-9, float("nan"), float("inf"), True, "5", 1e300])
def test_a_bad_interval_raises_naming_it_and_creates_nothing(tmp_path, bad):
    target = tmp_path / "new" / "cache"
    with pytest.raises(InvalidArgumentError, match=r"^refresh_interval_s=.*expected .*seconds"):
        DiskTier(target, capacity_bytes=BIG, fingerprint=FP16, refresh_interval_s=bad)
    assert list(tmp_path.iterdir()) == []

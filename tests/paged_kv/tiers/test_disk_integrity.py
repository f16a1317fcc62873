"""DiskTier never loads a bad file: truncated, flipped bytes, other models' files, temporary files."""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest
from disk_helpers import (
    BIG, BS, FP16, assert_data_of, chain, fingerprint, flip_byte, header_end, indexed, journal_set, one_block_file,
    our_files, store,
)  # fmt: skip

from paged_kv.tiers import disk_store
from paged_kv.tiers.disk_files import STALE_TMP_SECONDS
from paged_kv.tiers.disk_format import file_bytes, file_name
from paged_kv.tiers.disk_tier import DiskTier


def _replace(path, offset: int, new: bytes) -> None:
    """Overwrite bytes of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(new)


def _value_offset(path, key: str, skip: int = 0) -> int:
    """Offset of a character inside a header metadata value."""
    return path.read_bytes().index(f'"{key}":"'.encode()) + len(key) + 4 + skip


def _other_hex(path, offset: int) -> bytes:
    """A hex digit (or base64 letter) other than the one at ``offset``."""
    return b"1" if path.read_bytes()[offset : offset + 1] != b"1" else b"2"


CORRUPTIONS = {
    "truncated": lambda p: os.truncate(p, p.stat().st_size - 3),
    "tensor byte": lambda p: flip_byte(p, header_end(p) + 5),
    "last byte": lambda p: flip_byte(p, -1),
    "length prefix": lambda p: flip_byte(p, 0),
    "json": lambda p: flip_byte(p, 9),
    "token in header": lambda p: _replace(p, o := _value_offset(p, "tokens", 7), _other_hex(p, o)),
    "hash in header": lambda p: _replace(p, o := _value_offset(p, "hashes", 3), _other_hex(p, o)),
    "fingerprint in header": lambda p: _replace(p, _value_offset(p, "architecture"), b"X"),
    "data checksum": lambda p: _replace(p, o := _value_offset(p, "data_checksum", 10), _other_hex(p, o)),
    "tensor offsets": lambda p: _replace(p, p.read_bytes().index(b'"data_offsets":[0,') + 16, b"1"),
    "emptied": lambda p: os.truncate(p, 0),
}


def _two_files(tmp_path):
    """A tier with a chain of 4 blocks in two files (the second file is the one to spoil)."""
    tier = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16, blocks_per_file=2)
    root, hashes, contents, blocks = chain(range(4 * BS))
    store(tier, blocks)
    second = next(p for p in our_files(tmp_path) if p.name == _name_of(tier, blocks[2:]))
    return tier, (root, hashes, contents, blocks), second


def _name_of(tier, blocks):
    return file_name(tier.fingerprint, blocks)


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_spoiled_file_is_skipped_on_read_counted_logged_once_and_deleted(tmp_path, kind, caplog):
    tier, (root, hashes, contents, blocks), second = _two_files(tmp_path)
    CORRUPTIONS[kind](second)
    assert tier.find(root, hashes, contents, limit=4) == 4  # the index does not know yet
    with caplog.at_level(logging.WARNING, logger="paged_kv.tiers"):
        got, kv, scales = tier.read(root, hashes, contents, limit=4)
        assert tier.read(root, hashes, contents, limit=4)[0] == blocks[:2]
    assert got == blocks[:2]
    assert_data_of(FP16, got, kv, scales)
    assert tier.find(root, hashes, contents, limit=4) == 2
    assert tier.stats.files_skipped == 1 and not second.exists()
    assert sum(second.name in r.getMessage() for r in caplog.records) == 1
    assert journal_set(tier.take_changes()) == indexed(tier) == set(hashes[:2])
    tier.close()


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_spoiled_file_is_skipped_by_the_scan_of_a_new_tier(tmp_path, kind):
    tier, (root, hashes, contents, blocks), second = _two_files(tmp_path)
    tier.close()
    CORRUPTIONS[kind](second)
    again = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16)
    if kind in ("tensor byte", "last byte"):  # only a read checks the tensor bytes
        assert again.find(root, hashes, contents, limit=4) == 4
        assert again.read(root, hashes, contents, limit=4)[0] == blocks[:2]
    assert again.find(root, hashes, contents, limit=4) == 2
    assert again.stats.files_skipped == 1 and not second.exists()
    assert again.stats.bytes_used == sum(p.stat().st_size for p in our_files(tmp_path))
    again.close()


@pytest.mark.parametrize("changes", [{"dtype": "bfloat16"}, {"head_dim": 16}, {"block_size": 8},
                                     {"architecture": "Other"}, {"hash_scheme": "sha256:other/v9"}])  # fmt: skip
def test_other_models_files_are_skipped_counted_left_intact_and_outside_the_budget(tmp_path, changes, caplog):
    other = fingerprint(**changes)
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=other, blocks_per_file=1) as foreign:
        store(foreign, chain(range(3 * other.block_size), block_size=other.block_size)[3])
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    assert len(before) == 3
    root, hashes, contents, blocks = chain(range(3 * BS))
    capacity = 3 * one_block_file()  # less than ours and theirs together
    assert capacity < sum(len(data) for data in before.values()) + file_bytes(FP16, 3)
    with caplog.at_level(logging.WARNING, logger="paged_kv.tiers"):
        tier = DiskTier(tmp_path, capacity_bytes=capacity, fingerprint=FP16)
        tier.refresh()
        tier.refresh()
    assert tier.stats.files_skipped == 3 and tier.stats.num_files == 0 and tier.stats.bytes_used == 0
    assert tier.find(root, hashes, contents, limit=3) == 0
    assert len([r for r in caplog.records if "another model" in r.getMessage()]) == 3  # once per file
    store(tier, blocks)
    tier.refresh()
    assert tier.find(root, hashes, contents, limit=3) == 3  # the budget counts our files only
    assert {p: p.read_bytes() for p in before} == before  # theirs untouched
    tier.close()


def test_a_foreign_file_under_our_name_is_skipped_and_left_intact(tmp_path):
    other = fingerprint(dtype="float32")
    with DiskTier(tmp_path / "other", capacity_bytes=BIG, fingerprint=other) as foreign:
        store(foreign, chain(range(BS))[3])
    theirs = our_files(tmp_path / "other", other)[0]
    disguised = tmp_path / "mine" / theirs.name.replace(other.tag, FP16.tag)
    disguised.parent.mkdir()
    disguised.write_bytes(theirs.read_bytes())
    tier = DiskTier(disguised.parent, capacity_bytes=BIG, fingerprint=FP16)
    assert tier.stats.files_skipped == 1 and tier.stats.num_blocks == 0
    assert disguised.read_bytes() == theirs.read_bytes()
    tier.close()


def test_temporary_files_are_never_indexed_and_stale_ones_are_removed(tmp_path):
    fresh, stale = tmp_path / ".tmp-1-fresh", tmp_path / ".tmp-1-stale"
    for p in (fresh, stale):
        p.write_bytes(b"partial")
    old = time.time() - STALE_TMP_SECONDS - 5
    os.utime(stale, (old, old))
    (tmp_path / "notes.txt").write_text("not ours")
    tier = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16)
    assert fresh.exists() and not stale.exists() and (tmp_path / "notes.txt").exists()
    assert tier.stats.num_files == 0 and tier.stats.files_skipped == 0
    tier.close()


def test_a_file_deleted_behind_the_index_is_a_miss_not_an_error(tmp_path):
    tier, (root, hashes, contents, blocks), second = _two_files(tmp_path)
    second.unlink()
    assert tier.read(root, hashes, contents, limit=4)[0] == blocks[:2]
    assert tier.stats.files_skipped == 0 and tier.find(root, hashes, contents, limit=4) == 2
    first = our_files(tmp_path)[0]
    first.unlink()
    tier.refresh()  # vanished files are forgotten
    assert tier.stats.num_files == 0 and tier.stats.bytes_used == 0
    assert journal_set(tier.take_changes()) == indexed(tier) == set()
    tier.close()


def test_a_directory_removed_under_the_tier_empties_the_index_and_writes_go_on(tmp_path):
    directory = tmp_path / "cache"
    root, hashes, contents, blocks = chain(range(2 * BS))
    tier = DiskTier(directory, capacity_bytes=BIG, fingerprint=FP16)
    store(tier, blocks[:1])
    shutil.rmtree(directory)
    tier.refresh()
    assert tier.stats.num_blocks == 0 and directory.is_dir()
    store(tier, blocks)
    assert tier.read(root, hashes, contents, limit=2)[0] == blocks
    tier.close()


def test_a_file_unreadable_at_scan_is_kept_and_indexed_by_a_later_refresh(tmp_path, monkeypatch, caplog):
    tier, (root, hashes, contents, blocks), second = _two_files(tmp_path)
    tier.close()
    real = disk_store.read_header

    def eio_on_second(path, fp):  # the second file cannot be read for now (EIO, too many open files, ...)
        if path == second:
            raise OSError(5, "Input/output error")
        return real(path, fp)

    monkeypatch.setattr(disk_store, "read_header", eio_on_second)
    with caplog.at_level(logging.WARNING, logger="paged_kv.tiers"):
        again = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16)
        again.refresh()  # still unreadable: tried again, counted and logged once
    assert again.find(root, hashes, contents, limit=4) == 2 and second.exists()
    assert again.stats.files_skipped == 1 and sum(second.name in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setattr(disk_store, "read_header", real)  # readable again
    again.refresh()
    got, kv, scales = again.read(root, hashes, contents, limit=4)
    assert got == blocks
    assert_data_of(FP16, got, kv, scales)
    assert journal_set(again.take_changes()) == indexed(again) == set(hashes)
    again.close()


def test_a_file_unreadable_on_read_is_kept_and_indexed_by_a_later_refresh(tmp_path, monkeypatch):
    tier, (root, hashes, contents, blocks), second = _two_files(tmp_path)
    real, spoiled = disk_store.decode, second.read_bytes()

    def eio_on_second(data, fp):  # reading the second file fails for now
        if data == spoiled:
            raise OSError(5, "Input/output error")
        return real(data, fp)

    monkeypatch.setattr(disk_store, "decode", eio_on_second)
    assert tier.read(root, hashes, contents, limit=4)[0] == blocks[:2]
    assert tier.find(root, hashes, contents, limit=4) == 2 and second.exists() and tier.stats.files_skipped == 1
    monkeypatch.setattr(disk_store, "decode", real)
    tier.refresh()
    got, kv, scales = tier.read(root, hashes, contents, limit=4)
    assert got == blocks
    assert_data_of(FP16, got, kv, scales)
    tier.close()

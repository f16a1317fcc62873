"""DiskTier's bad input: typed errors naming the argument, and nothing created, queued or written."""

from __future__ import annotations

import os

import pytest
import torch
from disk_helpers import BIG, BS, FP16, batch, chain, fingerprint, one_block_file, our_files

from paged_kv.errors import ClosedError, InvalidArgumentError, OutOfRangeError, PagedKVError
from paged_kv.tiers.disk_tier import DiskBlock, DiskTier


def _construct(directory, **changes):
    kwargs = {"capacity_bytes": BIG, "fingerprint": FP16} | changes
    return DiskTier(directory, **kwargs)


@pytest.mark.parametrize(("changes", "name"), [
    ({"capacity_bytes": 100}, "capacity_bytes"),
    ({"capacity_bytes": 2.5}, "capacity_bytes"),
    ({"blocks_per_file": 0}, "blocks_per_file"),
    ({"fingerprint": {"architecture": "Toy"}}, "fingerprint"),
    ({"max_pending_bytes": 0}, "max_pending_bytes"),
])  # fmt: skip
def test_bad_arguments_raise_naming_them_and_create_nothing(tmp_path, changes, name):
    target = tmp_path / "new" / "cache"
    with pytest.raises(PagedKVError, match=f"^{name}=") as err:
        _construct(target, **changes)
    assert isinstance(err.value, (InvalidArgumentError, OutOfRangeError)) and "expected" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_capacity_below_one_block_file_names_the_minimum(tmp_path):
    with pytest.raises(InvalidArgumentError, match=rf"capacity_bytes={one_block_file() - 1}: .*>= {one_block_file()}"):
        _construct(tmp_path, capacity_bytes=one_block_file() - 1)
    _construct(tmp_path, capacity_bytes=one_block_file()).close()


def test_directory_that_is_a_file_or_cannot_be_created_or_written(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match="directory=.*plain.*a directory"):
        _construct(plain)
    with pytest.raises(InvalidArgumentError, match="directory=.*can be created"):
        _construct(plain / "sub")
    with pytest.raises(InvalidArgumentError, match="directory=.*a str or os.PathLike"):
        _construct(42)
    assert [p.name for p in tmp_path.iterdir()] == ["plain"] and plain.read_bytes() == b"x"


def test_directory_that_cannot_be_written(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if _probe_writes(locked):  # root writes anywhere: try a read-only file system instead
            locked = next((p for p in ("/sys", "/proc/self") if not _probe_writes(p)), None)
            if locked is None:
                pytest.skip("no unwritable directory on this machine")
        with pytest.raises(InvalidArgumentError, match="directory=.*a writable directory"):
            _construct(locked)
    finally:
        (tmp_path / "locked").chmod(0o700)
    assert list((tmp_path / "locked").iterdir()) == []


def _probe_writes(directory) -> bool:
    """Whether a file can be created in the directory."""
    try:
        with open(f"{directory}/.probe-test", "xb"):
            pass
    except OSError:
        return False
    os.unlink(f"{directory}/.probe-test")
    return True


def _bad_puts(blocks):
    kv, _ = batch(FP16, blocks)
    short = DiskBlock(hash=blocks[0].hash, parent=blocks[0].parent, tokens=b"\0" * 8)
    return [
        ("blocks", "xyz", kv),
        ("blocks\\[0\\]", [b"not a block", blocks[1]], kv),
        ("blocks\\[0\\].tokens", [short, blocks[1]], kv),
        ("blocks\\[1\\].hash", [blocks[0], DiskBlock(hash=b"h", parent=blocks[1].parent, tokens=blocks[1].tokens)], kv),
        ("kv.dtype", blocks, kv.float()),
        ("kv.shape", blocks, kv[:1]),
        ("kv.shape", blocks, kv[..., :4]),
        ("kv.device", blocks, kv.to("meta")),
        ("kv", blocks, kv.tolist()),
    ]


@pytest.mark.parametrize("case", range(9))
def test_bad_put_raises_naming_the_argument_and_queues_nothing(tmp_path, case):
    blocks = chain(range(2 * BS))[3]
    name, bad_blocks, bad_kv = _bad_puts(blocks)[case]
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16) as tier:
        with pytest.raises(InvalidArgumentError, match=name):
            tier.put(bad_blocks, bad_kv, None)
        tier.flush()
        assert tier.stats.num_blocks == 0 and tier.stats.bytes_written == 0
    assert list(tmp_path.iterdir()) == []


def test_scales_must_match_the_dtype(tmp_path):
    blocks = chain(range(2 * BS))[3]
    q8 = fingerprint(dtype="int8")
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=q8) as tier:
        kv, scales = batch(q8, blocks)
        with pytest.raises(InvalidArgumentError, match="scales"):
            tier.put(blocks, kv, None)
        with pytest.raises(InvalidArgumentError, match="scales.dtype"):
            tier.put(blocks, kv, scales.half())
        with pytest.raises(InvalidArgumentError, match="scales.shape"):
            tier.put(blocks, kv, scales[:, :1])
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16) as tier:
        with pytest.raises(InvalidArgumentError, match="scales=.*None for dtype float16"):
            tier.put(blocks, batch(FP16, blocks)[0], torch.ones(2, 2, 2, BS, 2))
    assert list(tmp_path.iterdir()) == []


def test_bad_lookups_raise_naming_the_argument(tmp_path):
    root, hashes, contents, _ = chain(range(2 * BS))
    with DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16) as tier:
        for call in (tier.find, tier.read):
            with pytest.raises(InvalidArgumentError, match="contents="):
                call(root, hashes, contents[:1], 2)
            with pytest.raises(InvalidArgumentError, match="limit=-1"):
                call(root, hashes, contents, -1)
            with pytest.raises(InvalidArgumentError, match="parent="):
                call("root", hashes, contents, 2)


def test_close_is_idempotent_and_put_after_close_raises(tmp_path):
    blocks = chain(range(BS))[3]
    tier = DiskTier(tmp_path, capacity_bytes=BIG, fingerprint=FP16)
    tier.put(blocks, *batch(FP16, blocks))
    tier.close()  # flushes first
    tier.close()
    assert tier.stats.num_blocks == 1 and len(our_files(tmp_path)) == 1
    with pytest.raises(ClosedError, match="closed DiskTier"):
        tier.put(blocks, *batch(FP16, blocks))

"""Argument checks of the disk tier: each raises a typed error naming the argument, before any effect."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from paged_kv.errors import InvalidArgumentError, check_int, check_type, describe
from paged_kv.host_tier import check_record
from paged_kv.tensor_checks import check_shape, check_tensor
from paged_kv.tiers.disk_files import temp_path
from paged_kv.tiers.disk_format import DiskBlock
from paged_kv.tiers.fingerprint import ModelFingerprint

_CPU = torch.device("cpu")


def prepare_directory(directory: object) -> Path:
    """The tier's directory, created if missing; InvalidArgumentError unless it is a writable directory.

    Writability is probed by creating and deleting a temporary file. The directories this call
    created are removed again if the probe fails.
    """
    check_type("directory", directory, (str, os.PathLike), "a str or os.PathLike path")
    path = Path(os.fspath(directory))
    if path.exists() and not path.is_dir():
        raise InvalidArgumentError(describe("directory", str(path), "a directory (it is a file)"))
    created = [p for p in (path, *path.parents) if not p.exists()]  # leaf first
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        expected = f"a directory that can be created ({err})"
        raise InvalidArgumentError(describe("directory", str(path), expected)) from None
    probe = temp_path(path)
    try:
        with open(probe, "xb"):
            pass
        probe.unlink()
    except OSError as err:
        for p in created:
            p.rmdir()
        raise InvalidArgumentError(describe("directory", str(path), f"a writable directory ({err})")) from None
    return path


def check_capacity(capacity_bytes: object, one_block_file: int) -> int:
    """``capacity_bytes`` if it holds at least a one-block file (of ``one_block_file`` bytes)."""
    capacity = check_int("capacity_bytes", capacity_bytes)
    if capacity < one_block_file:
        raise InvalidArgumentError(describe(
            "capacity_bytes", capacity, f"an integer >= {one_block_file}, the size of a one-block file of this model"))
    return capacity


def check_chain(parent: object, hashes: object, contents: object, limit: object) -> int:
    """Check a chain lookup's arguments; return ``limit``."""
    check_type("parent", parent, bytes, "bytes (the chain's parent hash)")
    check_type("hashes", hashes, Sequence, "a sequence of block hashes")
    check_type("contents", contents, Sequence, "a sequence of int64 token bytes")
    if len(contents) != len(hashes):
        raise InvalidArgumentError(describe("contents", f"{len(contents)} blocks", f"one per hash ({len(hashes)})"))
    return check_int("limit", limit)


def check_put(fingerprint: ModelFingerprint, blocks: object, kv: object, scales: object) -> list[DiskBlock]:
    """Check a batch to store: blocks, kv [n, 2, L, B, H, D] and scales [n, 2, L, B, H] (or None); the blocks."""
    check_type("blocks", blocks, Sequence, "a sequence of DiskBlock")
    blocks = list(blocks)
    for i, block in enumerate(blocks):
        _check_block(f"blocks[{i}]", block, 8 * fingerprint.block_size)
    n = len(blocks)
    check_tensor("kv", kv, ndim=6, dtypes=(fingerprint.torch_dtype,), device=_CPU)
    check_shape("kv", kv, (n, *fingerprint.kv_shape))
    if fingerprint.quantized:
        check_tensor("scales", scales, ndim=5, dtypes=(torch.float32,), device=_CPU)
        check_shape("scales", scales, (n, *fingerprint.scales_shape))
    elif scales is not None:
        raise InvalidArgumentError(describe("scales", type(scales).__name__, f"None for dtype {fingerprint.dtype}"))
    return blocks


def _check_block(name: str, block: object, token_bytes: int) -> None:
    """One block: 32-byte hash and parent, ``token_bytes`` of tokens."""
    check_type(name, block, DiskBlock, "a DiskBlock")
    check_record(name, block, token_bytes)

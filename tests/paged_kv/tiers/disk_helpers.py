"""Shared helpers of the disk-tier tests: a tiny model, hash chains, block data derived from the hash."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

from paged_kv.block_hash import block_bytes, hash_blocks, root_hash
from paged_kv.tiers.disk_format import file_bytes
from paged_kv.tiers.disk_tier import DiskBlock, DiskTier, ModelFingerprint

BS = 4  # tokens per block
FP16 = ModelFingerprint(architecture="Toy", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=BS)
BIG = 1 << 24  # a budget nothing in these tests fills


def fingerprint(**changes: object) -> ModelFingerprint:
    """The tiny model's fingerprint with some fields changed."""
    return dataclasses.replace(FP16, **changes)


def chain(tokens: Iterable[int], salt: str | None = None, block_size: int = BS
          ) -> tuple[bytes, list[bytes], list[bytes], list[DiskBlock]]:  # fmt: skip
    """(root, hashes, contents, blocks) of the full blocks of a token list under a salt."""
    ids = list(tokens)
    root = root_hash(salt)
    hashes, contents = hash_blocks(root, ids, block_size), block_bytes(ids, block_size)
    blocks = [DiskBlock(hash=h, parent=p, tokens=c) for h, p, c in zip(hashes, [root, *hashes[:-1]], contents)]
    return root, hashes, contents, blocks


def block_data(fp: ModelFingerprint, block: DiskBlock) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's kv [2, L, B, H, D] and scales [2, L, B, H] (or None), a function of its hash alone."""
    gen = torch.Generator().manual_seed(int.from_bytes(block.hash[:8], "little"))
    values = torch.randn(fp.kv_shape, generator=gen) * 4
    if fp.dtype == "int8":
        kv = values.round().clamp(-127, 127).to(torch.int8)
    else:
        kv = values.to(fp.torch_dtype)
    scales = torch.rand(fp.scales_shape, generator=gen) + 0.01 if fp.quantized else None
    return kv, scales


def batch(fp: ModelFingerprint, blocks: list[DiskBlock]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kv [n, 2, L, B, H, D] and scales [n, 2, L, B, H] (or None) of blocks, from their hashes."""
    if not blocks:
        scales = torch.empty((0, *fp.scales_shape)) if fp.quantized else None
        return torch.empty((0, *fp.kv_shape), dtype=fp.torch_dtype), scales
    data = [block_data(fp, b) for b in blocks]
    return torch.stack([k for k, _ in data]), (torch.stack([s for _, s in data]) if fp.quantized else None)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same dtype, shape and bytes (NaN-safe, any dtype)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_data_of(fp: ModelFingerprint, blocks: list[DiskBlock], kv: torch.Tensor | None,
                   scales: torch.Tensor | None) -> None:  # fmt: skip
    """Assert that kv and scales are exactly the data the blocks were written with."""
    if not blocks:
        assert kv is None and scales is None
        return
    want_kv, want_scales = batch(fp, blocks)
    assert same_bits(kv, want_kv)
    assert (scales is None) if want_scales is None else same_bits(scales, want_scales)


def store(tier: DiskTier, blocks: list[DiskBlock]) -> None:
    """Put blocks with their data and wait until they are written."""
    tier.put(blocks, *batch(tier.fingerprint, blocks))
    tier.flush()


def one_block_file(fp: ModelFingerprint = FP16) -> int:
    """Bytes of a one-block file of the model."""
    return file_bytes(fp, 1)


def our_files(directory: Path, fp: ModelFingerprint = FP16) -> list[Path]:
    """The block files of a model in a directory, sorted by name."""
    return sorted(p for p in directory.iterdir() if p.name.startswith(f"kv-{fp.tag}-"))


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte of a file in place (offset from the start; negative from the end)."""
    with open(path, "r+b") as f:
        f.seek(offset if offset >= 0 else os.path.getsize(path) + offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def header_end(path: Path) -> int:
    """Offset of the first tensor byte (8-byte length + JSON header)."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def journal_set(changes: Iterable[tuple[str, list[DiskBlock]]], into: set[bytes] | None = None) -> set[bytes]:
    """The block hashes a journal leaves indexed: stored minus removed, in order."""
    live = set() if into is None else into
    for kind, blocks in changes:
        assert kind in ("stored", "removed")
        for b in blocks:
            if kind == "stored":
                assert b.hash not in live, "stored twice without a removal"
                live.add(b.hash)
            else:
                assert b.hash in live, "removed without being stored"
                live.discard(b.hash)
    return live


def indexed(tier: DiskTier) -> set[bytes]:
    """The hashes a tier has indexed now."""
    return {b.hash for b in tier.indexed_blocks()}


def write_in_child(directory: str, tokens: list[int], salt: str | None) -> None:
    """Run in a spawned process: store a chain's blocks in the directory and close."""
    with DiskTier(directory, capacity_bytes=BIG, fingerprint=FP16) as tier:
        store(tier, chain(tokens, salt)[3])


class Scans:
    """Counts a tier's scans as they end (its store's ``refresh`` wrapped), so a test waits for one, not the clock.

    ``fail``: how many of the next scans raise OSError instead of scanning (a failing file system).
    """

    def __init__(self, tier: DiskTier, fail: int = 0) -> None:
        self._cond = threading.Condition()
        self.done, self.fail = 0, fail
        store = tier._store
        scan = store.refresh

        def counted() -> None:
            try:
                if self.fail:
                    self.fail -= 1
                    raise OSError("the disk is gone for a moment")
                scan()
            finally:
                with self._cond:
                    self.done += 1
                    self._cond.notify_all()

        store.refresh = counted

    def wait_fresh(self, timeout: float = 60.0) -> None:
        """Wait until a scan begun after this call has ended (the second to end: one may be under way now)."""
        with self._cond:
            target = self.done + 2
            assert self._cond.wait_for(lambda: self.done >= target, timeout), "no rescan came"

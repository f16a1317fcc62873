"""Disk tier throughput (issue 22): DiskTier put+flush and read vs raw files of the same bytes.

Run ``python benchmarks/bench_disk_tier.py [--blocks 64] [--dir /path/on/the/disk]``. A block is
Llama-3-8B's (32 layers, 8 KV heads, head_dim 128, 16 tokens, bf16: 2 MiB). The tier writes
``blocks_per_file`` (8) blocks a file with header, checksums, fsync and rename; the baseline writes
the same tensor bytes, the same chunks, with fsync and rename, and reads them back with no checks.
Reads are timed twice: warm (the page cache holds the files just written) and cold (each file's
pages dropped with posix_fadvise first). MB/s counts tensor bytes (10^6 bytes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

from paged_kv.block_hash import block_bytes, hash_blocks, root_hash  # noqa: E402
from paged_kv.tiers.disk_tier import DiskBlock, DiskTier, ModelFingerprint  # noqa: E402

FP = ModelFingerprint(architecture="LlamaForCausalLM", num_layers=32, num_kv_heads=8, head_dim=128,
                      dtype="bfloat16", block_size=16)  # fmt: skip
PER_FILE = 8


def chains(num_blocks: int) -> list[tuple[bytes, list[bytes], list[bytes], list[DiskBlock]]]:
    """Prompts of 16 blocks each (the last one shorter), as (root, hashes, contents, blocks)."""
    out = []
    for start in range(0, num_blocks, 16):
        ids = list(range(start * 16, (start + min(16, num_blocks - start)) * 16))
        root = root_hash(None)
        hashes, contents = hash_blocks(root, ids, 16), block_bytes(ids, 16)
        blocks = [DiskBlock(hash=h, parent=p, tokens=c) for h, p, c in zip(hashes, [root, *hashes[:-1]], contents)]
        out.append((root, hashes, contents, blocks))
    return out


def drop_cache(directory: Path) -> None:
    """Ask the kernel to forget the cached pages of every file in ``directory`` (they are clean: fsynced)."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def tier_side(directory: Path, work, kv: torch.Tensor) -> dict[str, float]:
    """Seconds to put+flush, then to read every chain warm and cold, through DiskTier."""
    capacity = 2 * kv.nbytes + (64 << 20)

    starts = [sum(len(w[3]) for w in work[:i]) for i in range(len(work))]
    parts = [(blocks, kv[s : s + len(blocks)]) for s, (*_, blocks) in zip(starts, work)]  # the caller's copies

    def write():
        with DiskTier(directory, capacity_bytes=capacity, fingerprint=FP, blocks_per_file=PER_FILE) as tier:
            for blocks, part in parts:
                tier.put(blocks, part, None)

    def read():
        with DiskTier(directory, capacity_bytes=capacity, fingerprint=FP) as tier:
            got = sum(len(tier.read(r, h, c, len(h))[0]) for r, h, c, _ in work)
        assert got == kv.shape[0]

    seconds = {"write": timed(write), "read warm": timed(read)}
    drop_cache(directory)
    seconds["read cold"] = timed(read)
    return seconds


def raw_side(directory: Path, kv: torch.Tensor) -> dict[str, float]:
    """The same bytes in the same chunks as plain files: fsync + rename to write, read with no checks."""
    chunks = [kv[i : i + PER_FILE] for i in range(0, kv.shape[0], PER_FILE)]

    def write():
        for i, chunk in enumerate(chunks):
            tmp = directory / f".tmp-{i}"
            with open(tmp, "wb") as f:
                f.write(chunk.contiguous().view(torch.uint8).numpy().tobytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, directory / f"raw-{i}")

    def read():
        for i, chunk in enumerate(chunks):
            data = bytearray((directory / f"raw-{i}").read_bytes())
            torch.frombuffer(data, dtype=torch.bfloat16).view(chunk.shape).clone()

    seconds = {"write": timed(write), "read warm": timed(read)}
    drop_cache(directory)
    seconds["read cold"] = timed(read)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk to measure (default: a temp dir)")
    args = parser.parse_args()
    kv = torch.randn(args.blocks, *FP.kv_shape).to(torch.bfloat16)  # kv: [n, 2, L, B, H, D]
    megabytes = kv.nbytes / 1e6
    root = Path(tempfile.mkdtemp(prefix="bench-disk-tier-", dir=args.dir))
    try:
        (root / "tier").mkdir()
        (root / "raw").mkdir()
        tier = tier_side(root / "tier", chains(args.blocks), kv)
        raw = raw_side(root / "raw", kv)
    finally:
        shutil.rmtree(root)
    print(f"{args.blocks} blocks of {FP.bytes_per_block / 2**20:.0f} MiB ({megabytes:.0f} MB), {PER_FILE} per file, in {root.parent}")
    print(f"{'':10} {'DiskTier MB/s':>14} {'raw files MB/s':>15} {'ratio':>6}")
    for what in tier:
        a, b = megabytes / tier[what], megabytes / raw[what]
        print(f"{what:10} {a:14.0f} {b:15.0f} {a / b:6.2f}")


if __name__ == "__main__":
    main()

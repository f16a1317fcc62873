"""Block hashes: chained SHA-256, a typed salt root, identical across processes; a stream's kept hashes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from array import array
from pathlib import Path

import pytest

import paged_kv.block_hash as block_hash_module
from paged_kv.block_hash import BlockHashes, block_bytes, hash_blocks, root_hash
from paged_kv.errors import InvalidArgumentError

REPO = Path(__file__).resolve().parents[2]


def hash_block(parent: bytes, token_ids) -> bytes:
    """The hash of one full block: ``hash_blocks`` over exactly one block's ids."""
    (h,) = hash_blocks(parent, token_ids, len(token_ids))
    return h


def test_root_hash_matches_the_documented_layout():
    # domain tag, then the salt as one typed, length-prefixed field (None is just b"N")
    assert root_hash() == hashlib.sha256(b"paged-kv/block/v1N").digest()
    salt = "tenant-é".encode()
    field = b"S" + len(salt).to_bytes(8, "little") + salt
    assert root_hash("tenant-é") == hashlib.sha256(b"paged-kv/block/v1" + field).digest()


def test_root_hash_separates_salts_and_types():
    roots = [root_hash(None), root_hash(""), root_hash("a"), root_hash(b"a"), root_hash("1"), root_hash("ab")]
    assert len(set(roots)) == len(roots)
    assert all(len(r) == 32 for r in roots)


@pytest.mark.parametrize("key", [1.5, [1], object(), 1])
def test_root_hash_rejects_other_salt_types(key):
    with pytest.raises(InvalidArgumentError, match="cache_salt"):
        root_hash(key)


def test_hash_block_is_sha256_of_parent_and_int64_tokens():
    parent = root_hash()
    expected = hashlib.sha256(parent + array("q", [1, 2, 3]).tobytes()).digest()
    assert hash_block(parent, [1, 2, 3]) == expected
    assert hash_block(parent, (1, 2, 3)) == expected


def test_hash_block_depends_on_parent_content_and_order():
    a, b = root_hash("a"), root_hash("b")
    assert hash_block(a, [1, 2]) != hash_block(b, [1, 2])
    assert hash_block(a, [1, 2]) != hash_block(a, [2, 1])
    assert hash_block(a, [1, 2]) != hash_block(a, [1, 3])
    assert hash_block(a, [1 << 40]) != hash_block(a, [0])


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_hash_blocks_chains_hash_block_over_full_blocks_only(block_size):
    rng = random.Random(block_size)
    tokens = [rng.randrange(50_000) for _ in range(50)]
    parent, expected = root_hash("s"), []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        expected.append(parent)
    assert hash_blocks(root_hash("s"), tokens, block_size) == expected
    assert len(expected) == len(tokens) // block_size


def test_hash_blocks_of_too_few_tokens_is_empty():
    assert hash_blocks(root_hash(), [], 4) == []
    assert hash_blocks(root_hash(), [1, 2, 3], 4) == []


def test_a_prefix_has_a_prefix_of_the_hashes():
    tokens = list(range(40))
    assert hash_blocks(root_hash(), tokens[:17], 8) == hash_blocks(root_hash(), tokens, 8)[:2]


_CHILD = """
import json
from paged_kv.block_hash import hash_blocks, root_hash
roots = [root_hash(), root_hash("tenant"), root_hash(b"x")]
print(json.dumps([[h.hex() for h in hash_blocks(r, list(range(1000, 1064)), 16)] + [r.hex()] for r in roots]))
"""


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_hashes_are_identical_across_processes(seed):
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    roots = [root_hash(), root_hash("tenant"), root_hash(b"x")]
    here = [[h.hex() for h in hash_blocks(r, list(range(1000, 1064)), 16)] + [r.hex()] for r in roots]
    assert json.loads(out.stdout) == here


# -- BlockHashes: a stream's hashes, kept and extended ------------------------------------------------
@pytest.mark.parametrize("seed", range(8))
def test_a_stream_extended_in_pieces_has_the_hashes_of_its_ids_at_once(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 3, 4, 16])
    tokens = [rng.randrange(50_000) for _ in range(rng.randrange(80))]
    h, at = BlockHashes(block_size, cache_salt="s"), 0
    while at < len(tokens):
        step = rng.randrange(0, 2 * block_size + 2)
        h.extend(tokens[at : at + step])
        at += step
    nfull = len(tokens) // block_size * block_size
    assert h.hashes == hash_blocks(root_hash("s"), tokens, block_size)
    assert h.contents == block_bytes(tokens, block_size) and list(h.tail) == tokens[nfull:]
    assert h.num_tokens == len(tokens) and h.root == root_hash("s") and h.block_size == block_size


def test_each_block_is_hashed_once_however_the_stream_grows(monkeypatch):
    calls = []
    real, _ = block_hash_module.sha256, block_hash_module.salt_root(None)  # the root is remembered: made first
    monkeypatch.setattr(block_hash_module, "sha256", lambda data=b"": calls.append(data) or real(data))
    h = BlockHashes(4)
    for token in range(10):
        h.extend([token])
    h.extend([])
    h.extend(list(range(10, 21)))
    assert len(calls) == len(h.hashes) == 5 and len(set(calls)) == 5


def test_copy_cuts_anywhere_and_is_independent():
    h = BlockHashes(4)
    h.extend(list(range(10)))
    for n in range(11):
        cut = h.copy(n)
        assert cut.num_tokens == n and len(cut.hashes) == n // 4 and list(cut.tail) == list(range(n // 4 * 4, n))
        cut.extend(list(range(n, 10)))
        assert cut == h  # the same stream again: a cut keeps the tail ids it needs
    whole = h.copy()
    whole.extend([10, 11])
    assert h.num_tokens == 10 and whole.num_tokens == 12 and whole != h


def test_drop_front_chains_the_rest_from_the_last_hash_dropped():
    h = BlockHashes(4)
    h.extend(list(range(14)))
    full = h.copy()
    h.drop_front(2)
    assert h.root == full.hashes[1] and h.hashes == full.hashes[2:] and h.num_tokens == 6
    h.extend([14, 15])
    full.extend([14, 15])
    assert h.hashes == full.hashes[2:]  # later blocks chain as they would have
    h.drop_front(0)
    assert h.hashes == full.hashes[2:]


def test_a_stream_takes_ids_only():
    h = BlockHashes(4)
    for bad in (3, "ab", [1, -1], [1.5], [True]):
        with pytest.raises(InvalidArgumentError, match="^token_ids="):
            h.extend(bad)
    assert h == BlockHashes(4) and "num_tokens=0" in repr(h)
    with pytest.raises(InvalidArgumentError, match="^cache_salt="):
        BlockHashes(4, cache_salt=7)


def test_a_bytes_salt_roots_apart_from_the_same_str():
    """The engine's own salts (bytes: a LoRA adapter's key) never root the chain of a user's str salt."""
    assert BlockHashes(4, cache_salt=b"ab").root != BlockHashes(4, cache_salt="ab").root
    assert BlockHashes(4, cache_salt=b"ab").root == BlockHashes(4, cache_salt=b"ab").root

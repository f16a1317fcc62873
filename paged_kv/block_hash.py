"""Content hashes of full blocks for prefix caching.

A block's hash chains over its parent's hash, its token ids and the sequence's
extra keys, with SHA-256 from hashlib: identical across processes and runs
(no Python ``hash()``, no pickle), and collision-resistant enough for user
data. The block pool still compares token ids and parent hash on every hit, so
even a collision can never serve one prompt another prompt's KV.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import sha256

from paged_kv.errors import InvalidArgumentError, describe

BlockHash = bytes  # a 32-byte SHA-256 digest

_DOMAIN = b"paged-kv/block/v1"


def root_hash(cache_salt: str | bytes | None = None, extra_keys: Sequence[str | int | bytes] = ()) -> BlockHash:
    """The parent hash of a sequence's first block: separates tenants (salt) and other namespaces."""
    h = sha256(_DOMAIN)
    for key in (cache_salt, *extra_keys):
        _update_field(h, key)
    return h.digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block: SHA-256 over the parent hash and the token ids as int64."""
    return sha256(parent + array("q", token_ids).tobytes()).digest()


def hash_blocks(parent: BlockHash, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (the trailing partial block is not hashed)."""
    hashes: list[BlockHash] = []
    append = hashes.append
    for chunk in block_bytes(token_ids, block_size):
        parent = sha256(parent + chunk).digest()
        append(parent)
    return hashes


def block_bytes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The token ids of every full block as int64 bytes, exactly what its hash covers after the parent."""
    data = token_ids.tobytes() if type(token_ids) is array and token_ids.typecode == "q" else _int64(token_ids)
    step = 8 * block_size
    return [data[start : start + step] for start in range(0, (len(token_ids) // block_size) * step, step)]


def _int64(token_ids: Sequence[int]) -> bytes:
    return array("q", token_ids).tobytes()


def _update_field(h, key: str | int | bytes | None) -> None:
    """Feed one typed, length-prefixed field so that no two key lists serialise alike."""
    if key is None:
        h.update(b"N")
        return
    if isinstance(key, str):
        tag, raw = b"S", key.encode("utf-8")
    elif isinstance(key, bytes):
        tag, raw = b"B", key
    elif isinstance(key, int):
        tag, raw = b"I", str(key).encode("ascii")
    else:
        raise InvalidArgumentError(describe("extra key", key, "str, bytes, int or None"))
    h.update(tag + len(raw).to_bytes(8, "little") + raw)

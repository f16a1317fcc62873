"""Content hashes of full blocks for prefix caching, kept with the token stream they describe.

A block's hash chains over its parent's hash and its token ids (as int64), with SHA-256
from hashlib: identical across processes and runs (no Python ``hash()``, no pickle), and
collision-resistant enough for user data. The chain starts at the root hash of the
sequence's cache salt. The block pool still compares token ids and parent hash on every
hit, so even a collision can never serve one prompt another prompt's KV.

A :class:`BlockHashes` holds one stream's chain and grows with the stream: each block is
hashed once in its life, however often the stream is looked up, admitted or allocated.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from hashlib import sha256

from paged_kv.config import MAX_BLOCK_SIZE
from paged_kv.errors import InvalidArgumentError, check_int, describe
from paged_kv.tokens import as_token_array

BlockHash = bytes  # a 32-byte SHA-256 digest

_DOMAIN = b"paged-kv/block/v1"
HASH_SCHEME = "sha256:" + _DOMAIN.decode()  # names this chaining in stored blocks (the disk tier's files)
ROOT_CACHE_SIZE = 1024  # root hashes kept for recently used cache salts


def root_hash(cache_salt: str | bytes | None = None) -> BlockHash:
    """The parent hash of a sequence's first block: separates tenants (salt)."""
    h = sha256(_DOMAIN)
    _update_field(h, cache_salt)
    return h.digest()


def salt_root(cache_salt: str | bytes | None) -> BlockHash:
    """``root_hash(cache_salt)`` of a str, bytes or None salt (else InvalidArgumentError), remembered for recent salts.

    A user's salt is a str; bytes salts are the engine's own keys (a LoRA adapter's, with the request's salt
    inside): typed apart in the hash, no str salt roots the chain a bytes salt does."""
    if cache_salt is not None and not isinstance(cache_salt, (str, bytes)):
        raise InvalidArgumentError(describe("cache_salt", cache_salt, "a str, bytes or None"))
    return _root_cached(cache_salt)


@functools.lru_cache(maxsize=ROOT_CACHE_SIZE)
def _root_cached(cache_salt: str | bytes | None) -> BlockHash:
    """``root_hash(cache_salt)``, remembered for the most recently used salts (bounded: salts are per tenant)."""
    return root_hash(cache_salt)


def hash_blocks(parent: BlockHash, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (the trailing partial block is not hashed)."""
    return chain_hashes(parent, block_bytes(token_ids, block_size))


def chain_hashes(parent: BlockHash, contents: Sequence[bytes]) -> list[BlockHash]:
    """The chained hashes of blocks given as int64 bytes: block i's parent is block i-1's hash (``parent`` first)."""
    hashes: list[BlockHash] = []
    append = hashes.append
    for chunk in contents:
        parent = sha256(parent + chunk).digest()
        append(parent)
    return hashes


def block_bytes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The token ids of every full block as int64 bytes, exactly what its hash covers after the parent."""
    data = token_ids.tobytes() if type(token_ids) is array and token_ids.typecode == "q" else _int64(token_ids)
    step = 8 * block_size
    return [data[start : start + step] for start in range(0, (len(token_ids) // block_size) * step, step)]


class BlockHashes:
    """A token stream's chained full-block hashes, kept with the stream and extended as it grows.

    ``hashes[i]`` is block ``i``'s hash: SHA-256 over ``hashes[i - 1]`` (``root`` for block 0)
    and ``contents[i]``, the block's ids as int64 bytes (what a prefix hit compares); ``tail``
    holds the ids past the last full block and ``num_tokens`` counts them all. ``extend``
    hashes exactly the blocks its ids fill, so each block is hashed once in the object's
    life. The fields are read-only to everyone but the object's methods.
    """

    __slots__ = ("block_size", "root", "hashes", "contents", "tail", "num_tokens")

    def __init__(self, block_size: int, *, cache_salt: str | bytes | None = None) -> None:
        self._start(check_int("block_size", block_size, low=1, high=MAX_BLOCK_SIZE), salt_root(cache_salt))

    def _start(self, block_size: int, root: BlockHash) -> BlockHashes:
        """Make this an empty stream of checked ``block_size`` from ``root``."""
        self.block_size, self.root = block_size, root
        self.hashes: list[BlockHash] = []
        self.contents: list[bytes] = []
        self.tail = array("q")
        self.num_tokens = 0  # == len(hashes) * block_size + len(tail); len(tail) < block_size
        return self

    @classmethod
    def _of(cls, block_size: int, root: BlockHash) -> BlockHashes:
        """An empty stream of a checked block size and root (the block manager's own, without checks)."""
        return cls.__new__(cls)._start(block_size, root)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append ids to the stream, hashing each block they fill."""
        ids = as_token_array("token_ids", token_ids)
        if ids is None:
            raise InvalidArgumentError(describe("token_ids", token_ids, "a sequence of token ids (not a count)"))
        self._cover(self.num_tokens + len(ids), ids)

    def _cover(self, num_tokens: int, ids: array) -> None:
        """Extend the stream to ``num_tokens`` ids, of which validated ``ids`` are the last (at least all it lacks).

        The one place a stream grows (``extend``, and the block manager for every sequence).
        """
        missing = num_tokens - self.num_tokens
        if missing <= 0:
            return
        tail = self.tail
        tail.extend(ids if missing == len(ids) else ids[len(ids) - missing :])
        self.num_tokens = num_tokens
        if len(tail) >= self.block_size:  # blocks fill: hash them, keep the rest
            contents = block_bytes(tail, self.block_size)
            self.hashes += chain_hashes(self.hashes[-1] if self.hashes else self.root, contents)
            self.contents += contents
            del tail[: len(contents) * self.block_size]

    def copy(self, num_tokens: int | None = None) -> BlockHashes:
        """An independent copy describing the first ``num_tokens`` ids (default: all); nothing is hashed again."""
        n = self.num_tokens if num_tokens is None else check_int("num_tokens", num_tokens, high=self.num_tokens)
        nfull, rest = divmod(n, self.block_size)
        new = BlockHashes.__new__(BlockHashes)
        new.block_size, new.root, new.num_tokens = self.block_size, self.root, n
        new.hashes, new.contents = self.hashes[:nfull], self.contents[:nfull]
        partial = self.tail if nfull == len(self.hashes) else _ids_of(self.contents[nfull])
        new.tail = partial[:rest]
        return new

    def drop_front(self, num_blocks: int) -> None:
        """Forget the first ``num_blocks`` full blocks; the hash of the last one dropped becomes the root."""
        k = check_int("num_blocks", num_blocks, high=len(self.hashes))
        if k:
            self.root = self.hashes[k - 1]
            del self.hashes[:k], self.contents[:k]
            self.num_tokens -= k * self.block_size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockHashes):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in BlockHashes.__slots__)

    def __repr__(self) -> str:
        return (f"BlockHashes(block_size={self.block_size}, num_tokens={self.num_tokens}, "
                f"blocks={len(self.hashes)}, root={self.root.hex()[:12]})")


def _ids_of(data: bytes) -> array:
    """Token ids back from their int64 bytes."""
    ids = array("q")
    ids.frombytes(data)
    return ids


def _int64(token_ids: Sequence[int]) -> bytes:
    return array("q", token_ids).tobytes()


def _update_field(h, key: str | bytes | None) -> None:
    """Feed one typed, length-prefixed field so that no two salts serialise alike."""
    if key is None:
        h.update(b"N")
        return
    if isinstance(key, str):
        tag, raw = b"S", key.encode("utf-8")
    elif isinstance(key, bytes):
        tag, raw = b"B", key
    else:
        raise InvalidArgumentError(describe("cache_salt", key, "str, bytes or None"))
    h.update(tag + len(raw).to_bytes(8, "little") + raw)

"""The disk tier's file format: safetensors files of a few KV blocks each, checked before any use.

Format ``paged-kv/disk/v1``. A file holds ``n`` blocks of one model (``1 <= n <= blocks_per_file``)
in the safetensors layout (8-byte little-endian header length, JSON header, tensor bytes)::

    kv:     [n, 2, num_layers, block_size, num_kv_heads, head_dim]  storage dtype (K at 0, V at 1)
    scales: [n, 2, num_layers, block_size, num_kv_heads]            float32, quantized dtypes only

The header's metadata (strings only):

- ``format``: ``paged-kv/disk/v1``;
- the model fingerprint: ``architecture``, ``num_layers``, ``num_kv_heads``, ``head_dim``, ``dtype``,
  ``block_size``, ``hash_scheme``; a file is ours only if all seven equal ours;
- ``num_blocks``; ``hashes`` and ``parents``: comma-separated hex of each block's 32-byte hash and of
  its parent's; ``tokens``: base64 of the blocks' token ids (int64 bytes, ``8 * block_size`` each),
  concatenated in block order;
- ``data_checksum``: BLAKE2b-256 (hex) of the tensor bytes, ``kv`` then ``scales``;
- ``header_checksum``: BLAKE2b-256 (hex) of every other metadata entry, as sorted-key JSON.

Naming: ``kv-<model>-<content>.safetensors``, where ``<model>`` is 16 hex digits of a digest of the
format and fingerprint, and ``<content>`` 32 hex digits of a digest of the blocks' hashes. Engines
that write the same blocks of the same model write the same name with equal content; engines of
different models never share a name, and a scan knows another model's file by its name alone.

Atomicity: a file is written under ``.tmp-<pid>-<uuid>`` in its directory, fsynced, then renamed to
its final name with ``os.replace`` (and the directory fsynced): a final name only ever holds a
complete file. Scans ignore ``.tmp-`` names and delete those left for ten minutes (a crashed writer).

Checks: a scan reads only headers (the size must cover the header's tensors: no truncation; format,
header checksum, fingerprint, block list); a read checks all of that again on the bytes it read,
then dtypes, shapes and the data checksum, before any tensor is used. ``disk_store`` holds the
multi-engine rules (budget, eviction, refresh).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load, save

from paged_kv.tiers.fingerprint import FORMAT_VERSION, ModelFingerprint

DIGEST_BYTES = 32  # BLAKE2b-256 for both checksums
TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"kv-([0-9a-f]{16})-([0-9a-f]{32})\.safetensors")


@dataclass(frozen=True, kw_only=True, slots=True)
class DiskBlock:
    """One block's identity: its chained hash, its parent's hash and its token ids as int64 bytes."""

    hash: bytes
    parent: bytes
    tokens: bytes  # len == 8 * block_size


class RejectedFile(Exception):
    """A file that must not be used; ``foreign`` when it is another model's (left alone), else corrupt.

    Internal to the disk tier: it never reaches a caller.
    """

    def __init__(self, reason: str, *, foreign: bool = False) -> None:
        super().__init__(reason)
        self.foreign = foreign


def file_name(fingerprint: ModelFingerprint, blocks: Sequence[DiskBlock]) -> str:
    """The content-derived name of the file holding ``blocks`` of this model."""
    content = hashlib.blake2b(b"".join(b.hash for b in blocks), digest_size=16).hexdigest()
    return f"kv-{fingerprint.tag}-{content}.safetensors"


def name_tag(name: str) -> str | None:
    """The model tag of a block file's name, or None if the name is not a block file's."""
    match = _NAME.fullmatch(name)
    return match.group(1) if match else None


def encode(fingerprint: ModelFingerprint, blocks: Sequence[DiskBlock], kv: torch.Tensor,
           scales: torch.Tensor | None) -> bytes:
    """The file's bytes: ``kv`` [n, 2, L, B, H, D] and ``scales`` [n, 2, L, B, H] (or None) with the header."""
    tensors = {"kv": kv.contiguous()} | ({} if scales is None else {"scales": scales.contiguous()})
    meta = fingerprint.to_metadata() | {
        "format": FORMAT_VERSION,
        "num_blocks": str(len(blocks)),
        "hashes": ",".join(b.hash.hex() for b in blocks),
        "parents": ",".join(b.parent.hex() for b in blocks),
        "tokens": base64.b64encode(b"".join(b.tokens for b in blocks)).decode("ascii"),
        "data_checksum": _data_digest(tensors.values()),
    }
    meta["header_checksum"] = _header_digest(meta)
    return save(tensors, metadata=meta)


def file_bytes(fingerprint: ModelFingerprint, num_blocks: int) -> int:
    """The exact size of a file of ``num_blocks`` blocks (every header field has a fixed length)."""
    n, step = num_blocks, 8 * fingerprint.block_size
    blocks = [DiskBlock(hash=bytes(32), parent=bytes(32), tokens=bytes(step))] * n
    kv = torch.zeros((n, *fingerprint.kv_shape), dtype=fingerprint.torch_dtype)
    scales = torch.zeros((n, *fingerprint.scales_shape)) if fingerprint.quantized else None
    return len(encode(fingerprint, blocks, kv, scales))


def read_header(path: Path, fingerprint: ModelFingerprint) -> tuple[DiskBlock, ...]:
    """The blocks a file holds, from its header alone; RejectedFile if it is truncated, corrupt or foreign.

    FileNotFoundError passes through: the file vanished (another engine evicted it).
    """
    try:
        with safe_open(path, framework="pt") as f:  # checks that the file covers the header's tensors
            meta = f.metadata()
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except SafetensorError as err:
        raise RejectedFile(f"unreadable safetensors file ({err})") from None
    blocks = _check_metadata(meta, fingerprint)
    if shapes != _expected_shapes(fingerprint, len(blocks)):
        raise RejectedFile(f"tensor shapes {shapes} do not fit the header's {len(blocks)} blocks")
    return blocks


def decode(data: bytes, fingerprint: ModelFingerprint) -> tuple[tuple[DiskBlock, ...], torch.Tensor,
                                                               torch.Tensor | None]:
    """A file's blocks, kv [n, 2, L, B, H, D] and scales [n, 2, L, B, H] (or None), all checked; else RejectedFile."""
    meta = _metadata_of(data)
    blocks = _check_metadata(meta, fingerprint)
    try:
        tensors = load(data)
    except SafetensorError as err:
        raise RejectedFile(f"unreadable safetensors data ({err})") from None
    if {k: tuple(t.shape) for k, t in tensors.items()} != _expected_shapes(fingerprint, len(blocks)):
        raise RejectedFile("tensor shapes do not fit the header")
    kv, scales = tensors["kv"], tensors.get("scales")
    if kv.dtype != fingerprint.torch_dtype or (scales is not None and scales.dtype != torch.float32):
        raise RejectedFile(f"tensor dtypes {kv.dtype}, {None if scales is None else scales.dtype} are not ours")
    if _data_digest(t for t in (kv, scales) if t is not None) != meta["data_checksum"]:
        raise RejectedFile("data checksum mismatch")
    return blocks, kv, scales


def _metadata_of(data: bytes) -> object:
    """The ``__metadata__`` of a safetensors buffer's header (RejectedFile if the header is unreadable)."""
    size = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + size]) if 8 + size <= len(data) else None
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise RejectedFile("unreadable header")
    return header.get("__metadata__")


def _check_metadata(meta: object, fingerprint: ModelFingerprint) -> tuple[DiskBlock, ...]:
    """The blocks a header lists, once its format, checksum and fingerprint are ours; else RejectedFile."""
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise RejectedFile("no string metadata in the header")
    if meta.get("format") != FORMAT_VERSION:
        raise RejectedFile(f"format {meta.get('format')!r} is not {FORMAT_VERSION!r}", foreign=True)
    if meta.get("header_checksum") != _header_digest(meta):
        raise RejectedFile("header checksum mismatch")
    try:
        theirs = ModelFingerprint.from_metadata(meta)
    except (ValueError, KeyError) as err:
        raise RejectedFile(f"fingerprint unreadable ({err})", foreign=True) from None
    if theirs != fingerprint:
        diff = {f.name: v for f in fields(theirs) if (v := getattr(theirs, f.name)) != getattr(fingerprint, f.name)}
        raise RejectedFile(f"another model's file {diff}", foreign=True)
    return _blocks_of(meta, fingerprint.block_size)


def _blocks_of(meta: Mapping[str, str], block_size: int) -> tuple[DiskBlock, ...]:
    """The block list of a checked header (RejectedFile if its fields disagree in length)."""
    try:
        n = int(meta["num_blocks"])
        hashes = [bytes.fromhex(h) for h in meta["hashes"].split(",")]
        parents = [bytes.fromhex(p) for p in meta["parents"].split(",")]
        tokens = base64.b64decode(meta["tokens"], validate=True)
    except (KeyError, ValueError) as err:
        raise RejectedFile(f"block list unreadable ({err})") from None
    step = 8 * block_size
    if n < 1 or len(hashes) != n or len(parents) != n or len(tokens) != n * step \
            or any(len(h) != 32 for h in hashes + parents):  # fmt: skip
        raise RejectedFile(f"block list of {n} blocks is inconsistent")
    return tuple(DiskBlock(hash=h, parent=p, tokens=tokens[i * step : (i + 1) * step])
                 for i, (h, p) in enumerate(zip(hashes, parents)))  # fmt: skip


def _expected_shapes(fingerprint: ModelFingerprint, n: int) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of a file of ``n`` blocks."""
    shapes = {"kv": (n, *fingerprint.kv_shape)}
    return shapes | {"scales": (n, *fingerprint.scales_shape)} if fingerprint.quantized else shapes


def _header_digest(meta: Mapping[str, str]) -> str:
    """BLAKE2b-256 hex of every metadata entry but the header checksum itself."""
    body = json.dumps({k: v for k, v in meta.items() if k != "header_checksum"}, sort_keys=True)
    return hashlib.blake2b(body.encode("utf-8"), digest_size=DIGEST_BYTES).hexdigest()


def _data_digest(tensors: Iterable[torch.Tensor]) -> str:
    """BLAKE2b-256 hex of the raw bytes of contiguous tensors, in order."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for t in tensors:
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()

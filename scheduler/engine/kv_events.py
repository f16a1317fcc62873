"""KV cache events in vLLM's wire format, and the recorder that collects one engine step's events.

KV-aware routers (llm-d, NVIDIA Dynamo) track which blocks each replica holds from the events vLLM
publishes; paged-kv publishes the same payloads. The structs below are those of vLLM's
``vllm/distributed/kv_events.py`` (main, September 2026): the same names, fields, order and defaults.
A batch is a msgpack array ``[ts, events, data_parallel_rank]``. An event is tagged with its class
name, in one of two encodings (``KVEventsConfig.event_encoding``, :func:`encode_batch`):

- ``"map"``: ``{"type": "BlockStored", "block_hashes": ..., ...}``, fields equal to their default left
  out: vLLM 0.26 and later (vllm#42892), byte for byte. llm-d's decoder reads it since llm-d-kv-cache#661.
- ``"array"``: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]``: vLLM's positional layout before 0.26, cut after the last field that is not its
  default (vLLM itself sent every field: msgspec ignores ``omit_defaults`` on array structs). With the
  fields paged-kv sets that is vLLM 0.13-0.15's exact layout, the one every array decoder found reads
  (llm-d's Go decoder wants an exact length; msgspec and Dynamo take shorter arrays).

Block hashes are paged-kv's 32-byte SHA-256 digests, sent as msgpack bin (vLLM's ``ExternalBlockHash``
is ``bytes | int``; llm-d keys a block by the last 8 bytes, big-endian).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from paged_kv.config import MAX_BLOCK_SIZE
from paged_kv.errors import InvalidArgumentError, check_int, check_type, describe
from scheduler.core.kv_events_config import ENCODINGS

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"  # vLLM's one medium for its file-system and object-store tiers (vllm#48123)
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)

ExternalBlockHash = bytes | int  # what vLLM's consumers accept; paged-kv sends bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events with its wall-clock time and the publisher's data-parallel rank."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events; the tag (key ``"type"``) is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks became cached: a chain of hashes, the parent of its first block, their tokens."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]  # the tokens of all the blocks, len(block_hashes) * block_size of them
    block_size: int
    lora_id: int | None  # deprecated by vLLM in favour of lora_name, still on the wire
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # one entry per block (mm ids, lora, salt)
    group_idx: int | None = None  # the KV cache group (hybrid models)
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # "LOCAL" or "REMOTE" for storage tiers; None: unspecified
    ownership: str | None = None  # the secondary offloading tier that emitted the event


class BlockRemoved(KVCacheEvent):
    """Blocks left the cache of one medium."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the cache was dropped (a prefix-cache reset)."""


class KVEventBatch(EventBatch):
    """An :class:`EventBatch` of KV cache events, in the order they happened."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encode_batch(batch: KVEventBatch, encoding: str, encoder: msgspec.msgpack.Encoder | None = None) -> bytes:
    """The msgpack payload of ``batch`` with its events as tagged maps or positional arrays (module docstring)."""
    enc = encoder or msgspec.msgpack.Encoder()
    if encoding == "map":
        return enc.encode(batch)
    if encoding != "array":
        raise InvalidArgumentError(describe("encoding", encoding, f"one of {ENCODINGS}"))
    return enc.encode([batch.ts, [_as_array(e) for e in batch.events], batch.data_parallel_rank])


def _as_array(event: KVCacheEvent) -> list[Any]:
    """``[tag, field values...]`` up to the last field that is required or not its default."""
    names, defaults, required = _layout(type(event))
    values = [getattr(event, name) for name in names]
    n = len(values)
    while n > required and values[n - 1] == defaults[n - 1]:
        n -= 1
    return [type(event).__name__, *values[:n]]


@functools.cache
def _layout(cls: type) -> tuple[tuple[str, ...], tuple[Any, ...], int]:
    """A struct's field names, their defaults, and how many fields have none (they come first)."""
    fields = msgspec.structs.fields(cls)
    required = sum(f.default is msgspec.NODEFAULT for f in fields)
    return tuple(f.name for f in fields), tuple(f.default for f in fields), required


LoRATag = tuple[int, str]  # a block's adapter: (lora_id, lora_name)


class KVEventRecorder:
    """Collects the events of one engine step in order; ``take_batch`` hands them over as one batch.

    A ``stored`` whose parent is the last hash of the previous event, a ``BlockStored`` of the same
    medium and block size, extends that event (vLLM sends one chain per request and step).
    """

    def __init__(self) -> None:
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def __len__(self) -> int:
        return len(self._events)

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int], block_size: int,
               medium: str = MEDIUM_GPU, *, lora: LoRATag | None = None) -> None:  # fmt: skip
        """Record that the full blocks ``hashes`` (a chain after ``parent``) holding ``token_ids`` were cached
        (``lora``: the (lora_id, lora_name) of the adapter they were computed through)."""
        hashes, tokens = _check_stored(hashes, parent, token_ids, block_size, medium)
        lora_id, lora_name = lora if lora is not None else (None, None)
        last = self._events[-1] if self._events else None
        if (isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent
                and last.medium == medium and last.block_size == block_size
                and last.lora_name == lora_name):  # fmt: skip
            last.block_hashes.extend(hashes)
            last.token_ids.extend(tokens)
            return
        event = BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=block_size,
                            lora_id=lora_id, medium=medium, lora_name=lora_name)  # fmt: skip
        self._events.append(event)

    def removed(self, hashes: Sequence[bytes], medium: str = MEDIUM_GPU) -> None:
        """Record that the blocks ``hashes`` left the cache of ``medium``."""
        hashes = _check_hashes("hashes", hashes)
        _check_medium(medium)
        self._events.append(BlockRemoved(block_hashes=hashes, medium=medium))

    def cleared(self) -> None:
        """Record that the whole cache was dropped."""
        self._events.append(AllBlocksCleared())

    def take_batch(self) -> KVEventBatch | None:
        """The recorded events as one batch stamped with the wall-clock time (None if none), and start afresh."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(ts=time.time(), events=events)


def _check_stored(hashes: object, parent: object, token_ids: object, block_size: object,
                  medium: object) -> tuple[list[bytes], list[int]]:  # fmt: skip
    """The checked hashes and token ids (as new lists) of a ``stored`` call; raise naming the bad argument."""
    blocks = _check_hashes("hashes", hashes)
    if parent is not None:
        check_type("parent", parent, bytes, "bytes (a block hash) or None")
    size = check_int("block_size", block_size, low=1, high=MAX_BLOCK_SIZE)
    _check_medium(medium)
    return blocks, _check_tokens(token_ids, len(blocks) * size)


def _check_tokens(token_ids: object, count: int) -> list[int]:
    """``token_ids`` as a new list if it holds exactly ``count`` Python ints, else raise naming it."""
    check_type("token_ids", token_ids, Sequence, "a sequence of token ids")
    tokens = list(token_ids)  # type: ignore[call-overload]
    if len(tokens) != count:
        raise InvalidArgumentError(describe("token_ids", f"<{len(tokens)} tokens>",
                                            f"len(hashes) * block_size = {count} tokens"))  # fmt: skip
    bad = next((t for t in tokens if type(t) is not int), None)
    if bad is not None:
        raise InvalidArgumentError(describe("token_ids", bad, "Python ints only"))
    return tokens


def _check_hashes(name: str, hashes: object) -> list[bytes]:
    """``hashes`` as a new list if it is a non-empty sequence of non-empty bytes, else raise naming it."""
    if isinstance(hashes, (bytes, str)) or not isinstance(hashes, Sequence) or not hashes:
        raise InvalidArgumentError(describe(name, hashes, "a non-empty sequence of block hashes (bytes)"))
    out = list(hashes)
    bad = next((h for h in out if type(h) is not bytes or not h), None)
    if bad is not None:
        raise InvalidArgumentError(describe(name, bad, "block hashes as non-empty bytes"))
    return out


def _check_medium(medium: object) -> None:
    if medium not in MEDIA:
        raise InvalidArgumentError(describe("medium", medium, f"one of {MEDIA}"))

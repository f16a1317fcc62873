"""A KV event consumer written for vLLM, as a router would write one: vLLM's structs and its ZMQ protocol.

The structs restate vLLM's definitions (vllm/distributed/kv_events.py, main of September 2026: events
as tagged maps since vllm#42892), and, in the ``V025`` / ``V015`` / ``V011`` namespaces, the positional
(``array_like``) definitions of vLLM 0.25, 0.13-0.15 and 0.11, whose tags are spelled out because a
nested class's default tag would be its qualified name. Nothing here imports paged-kv: these decode
what paged-kv publishes as a vLLM consumer would.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --- vLLM main: EventBatch positional, events tagged maps -----------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --- older vLLM: events positional (array_like) ----------------------------------------------------
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V025:
    """vLLM 0.25: every field through kv_cache_spec_sliding_window."""

    class BlockStored(_ArrayEvent, tag="BlockStored"):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(_ArrayEvent, tag="BlockRemoved"):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(EventBatch):
        events: list[V025.BlockStored | V025.BlockRemoved | V025.AllBlocksCleared]


class V015:
    """vLLM 0.13-0.15: lora_name is the last field (the layout llm-d's Go structs have)."""

    class BlockStored(_ArrayEvent, tag="BlockStored"):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(_ArrayEvent, tag="BlockRemoved"):
        block_hashes: list[bytes | int]
        medium: str | None

    class AllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(EventBatch):
        events: list[V015.BlockStored | V015.BlockRemoved | V015.AllBlocksCleared]


class V011:
    """vLLM 0.11's example subscriber: medium is the last field."""

    class BlockStored(_ArrayEvent, tag="BlockStored"):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(_ArrayEvent, tag="BlockRemoved"):
        block_hashes: list[bytes | int]
        medium: str | None

    class AllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(EventBatch):
        events: list[V011.BlockStored | V011.BlockRemoved | V011.AllBlocksCleared]


# --- the ZMQ side -----------------------------------------------------------------------------------
def subscribe(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    """A SUB socket connected to ``endpoint``, filtering on ``topic``."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def receive(sub: zmq.Socket, timeout_ms: int = 2000) -> tuple[bytes, int, bytes] | None:
    """The next ``(topic, seq, payload)``, or None if nothing comes within ``timeout_ms``."""
    if not sub.poll(timeout_ms):
        return None
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), payload


def request_replay(ctx: zmq.Context, endpoint: str, start_seq: int, timeout_ms: int = 2000) -> list[list[bytes]]:
    """Ask for the batches since ``start_seq`` over a DEALER (a REQ takes one reply only): the replies' frames."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        replies = []
        deadline = time.monotonic() + timeout_ms / 1000
        while time.monotonic() < deadline and dealer.poll(timeout_ms):
            replies.append(dealer.recv_multipart())
            if replies[-1][2] == END_SEQ:
                break
        return replies
    finally:
        dealer.close(linger=0)

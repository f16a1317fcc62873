"""KV cache events: vLLM's bytes, decoded by a consumer written for vLLM, over vLLM's ZMQ protocol.

Every socket wait is bounded; PUB drops what it sends before a subscription lands, so subscribers
first ``join`` (probe batches until one arrives).
"""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import vllm_kv_consumer as vllm
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.errors import InvalidArgumentError, PagedKVError, PublisherClosedError
from scheduler.core.kv_events_config import KVEventsConfig
from scheduler.engine.kv_event_publisher import END_SEQ, NullEventPublisher, ZmqEventPublisher, make_publisher
from scheduler.engine.kv_events import (
    MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventRecorder, encode_batch,
)  # fmt: skip

TOPIC = "kv@pod-0@model"
H = [bytes([i]) * 32 for i in range(8)]  # 32-byte block hashes, like paged-kv's SHA-256 digests


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def make_pub():
    made = []

    def make(**kw) -> ZmqEventPublisher:
        kw = {"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*", "topic": TOPIC} | kw
        made.append(ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, **kw)))
        return made[-1]

    yield make
    for pub in made:
        pub.shutdown(timeout=2.0)


@pytest.fixture
def hold_port():
    """Reserve TCP ports for the test: a bound, never listening socket with SO_REUSEADDR on each.

    On Linux it keeps every other bind of the port (port 0 included) and every outgoing connection off
    it, but lets a reusing listener bind it, as ZeroMQ's do: a test can bind a port, release it and bind
    it again with no other process (another pytest worker) able to take it in between.
    """
    held = []

    def hold() -> int:
        sock = socket.socket()
        held.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
        return sock.getsockname()[1]

    yield hold
    for sock in held:
        sock.close()


def probe() -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[AllBlocksCleared()])


def join(pub: ZmqEventPublisher, sub: zmq.Socket, base: int = 0) -> tuple[int, int]:
    """Publish probes until one arrives and drain the rest; (first seq received, next seq). ``base``: seqs used."""
    sent, deadline = 0, time.monotonic() + 10
    got = None
    while got is None and time.monotonic() < deadline:
        pub.publish(probe())
        sent += 1
        got = vllm.receive(sub, 50)
    assert got is not None, "the subscription never landed"
    first = last = got[1]
    while last < base + sent - 1:
        got = vllm.receive(sub)
        assert got is not None and got[1] == last + 1
        last = got[1]
    return first, base + sent


def step_batches() -> list[KVEventBatch]:
    """Three engine steps' batches: a chain stored in two calls (merged), a removal and a CPU store, a reset."""
    rec = KVEventRecorder()
    rec.stored(H[0:2], None, list(range(8)), 4)
    rec.stored(H[2:3], H[1], list(range(8, 12)), 4)
    first = rec.take_batch()
    rec.removed([H[2]])
    rec.stored(H[3:4], H[1], [7, 7, 7, 7], 4, MEDIUM_CPU)
    second = rec.take_batch()
    rec.cleared()
    return [first, second, rec.take_batch()]


def summary(event) -> tuple:
    """What a router reads from an event, whichever struct family decoded it."""
    fields = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
    return (type(event).__name__, *(getattr(event, f, None) for f in fields))


# --- the bytes ---------------------------------------------------------------------------------------
def fixed_batch(cls=KVEventBatch, stored=BlockStored, removed=BlockRemoved, cleared=AllBlocksCleared):
    """The same batch built from any struct family."""
    return cls(ts=1.5, data_parallel_rank=0, events=[
        stored(block_hashes=[H[1], H[2]], parent_block_hash=H[0], token_ids=list(range(8)), block_size=4,
               lora_id=None, medium="GPU", lora_name=None),
        removed(block_hashes=[H[0]], medium="CPU"),
        cleared(),
    ])  # fmt: skip


def test_structs_are_vllms_fields_in_vllms_order():
    for ours, theirs in [(BlockStored, vllm.BlockStored), (BlockRemoved, vllm.BlockRemoved),
                         (AllBlocksCleared, vllm.AllBlocksCleared), (KVEventBatch, vllm.KVEventBatch)]:  # fmt: skip
        layout = lambda cls: [(f.name, f.default) for f in msgspec.structs.fields(cls)]  # noqa: E731
        assert layout(ours) == layout(theirs)


def test_map_encoding_is_vllm_mains_bytes():
    theirs = msgspec.msgpack.encode(fixed_batch(vllm.KVEventBatch, vllm.BlockStored, vllm.BlockRemoved,
                                                vllm.AllBlocksCleared))  # fmt: skip
    assert encode_batch(fixed_batch(), "map") == theirs


def test_array_encoding_is_vllm_015s_bytes_and_older_and_newer_array_consumers_read_it():
    v = vllm.V015
    payload = encode_batch(fixed_batch(), "array")
    assert payload == msgspec.msgpack.encode(fixed_batch(v.KVEventBatch, v.BlockStored, v.BlockRemoved,
                                                         v.AllBlocksCleared))  # fmt: skip
    # llm-d's Go structs (vmihailenco/msgpack) want exactly [tag, 7 fields] and [tag, hashes, medium]
    assert [len(e) for e in msgspec.msgpack.decode(payload)[1]] == [8, 3, 1]
    want = [summary(e) for e in fixed_batch().events]
    for family in (vllm.V025, vllm.V015, vllm.V011):  # vLLM 0.25 takes the missing tail as defaults
        decoded = msgspec.msgpack.Decoder(family.KVEventBatch).decode(payload)
        got = [summary(e) for e in decoded.events]
        assert got == want if family is not vllm.V011 else [g[:6] for g in got] == [w[:6] for w in want]


def test_literal_bytes_of_a_small_batch():
    batch = KVEventBatch(ts=0.5, events=[AllBlocksCleared()], data_parallel_rank=0)
    float_half = b"\xcb\x3f\xe0" + bytes(6)
    assert encode_batch(batch, "map") == b"\x93" + float_half + b"\x91\x81\xa4type\xb0AllBlocksCleared\x00"
    assert encode_batch(batch, "array") == b"\x93" + float_half + b"\x91\x91\xb0AllBlocksCleared\x00"


def test_encode_batch_rejects_an_unknown_encoding():
    with pytest.raises(InvalidArgumentError, match="^encoding='json'"):
        encode_batch(fixed_batch(), "json")


# --- the live stream ---------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding,consumer", [("map", vllm.KVEventBatch), ("array", vllm.V025.KVEventBatch)])
def test_every_batch_reaches_a_vllm_consumer_in_order(make_pub, ctx, encoding, consumer):
    pub = make_pub(event_encoding=encoding)
    sub = vllm.subscribe(ctx, pub.endpoint, TOPIC.encode())
    _, seq = join(pub, sub)
    batches = step_batches()
    want = [[summary(e) for e in b.events] for b in batches]
    for b in batches:
        pub.publish(b)
    decoder = msgspec.msgpack.Decoder(consumer)
    for i, events in enumerate(want):
        topic, got_seq, payload = vllm.receive(sub)
        assert (topic, got_seq) == (TOPIC.encode(), seq + i)  # consecutive: nothing lost
        decoded = decoder.decode(payload)
        assert [summary(e) for e in decoded.events] == events
        assert decoded.data_parallel_rank == 0 and decoded.ts == batches[i].ts
    assert pub.published == seq + len(batches) and pub.dropped == 0
    assert len(want[0]) == 1 and len(want[0][0][1]) == 3  # the two chained stores went out as one event


def test_a_subscriber_sees_the_gap_and_replay_fills_it(make_pub, ctx):
    pub = make_pub(event_encoding="map")
    lost = step_batches()
    for b in lost:  # no subscriber yet: PUB drops them, the buffer keeps them
        pub.publish(b)
    deadline = time.monotonic() + 10
    while len(vllm.request_replay(ctx, pub.replay_endpoint, 0)) <= len(lost):  # sent (the thread may lag)
        assert time.monotonic() < deadline, "the publisher never sent the first batches"
    sub = vllm.subscribe(ctx, pub.endpoint, TOPIC.encode())
    first, next_seq = join(pub, sub, base=len(lost))
    assert first > 0  # seq jumped from "none yet" (-1): batches 0..first-1 are missing
    replies = vllm.request_replay(ctx, pub.replay_endpoint, 0)
    assert replies[-1] == [b"", b"", END_SEQ, b""]
    assert all(r[:2] == [b"", TOPIC.encode()] for r in replies[:-1])
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == list(range(next_seq))
    decoder = msgspec.msgpack.Decoder(vllm.KVEventBatch)
    for b, reply in zip(lost, replies):
        assert [summary(e) for e in decoder.decode(reply[3]).events] == [summary(e) for e in b.events]


def test_replay_keeps_the_last_buffer_steps_batches_and_ignores_bad_requests(make_pub, ctx):
    pub = make_pub(buffer_steps=4)
    for _ in range(10):
        pub.publish(probe())
    seqs, deadline = [], time.monotonic() + 10
    while seqs[-1:] != [9] and time.monotonic() < deadline:  # until the thread has sent all ten
        seqs = [int.from_bytes(r[2], "big") for r in vllm.request_replay(ctx, pub.replay_endpoint, 0)[:-1]]
    assert seqs == [6, 7, 8, 9]
    bad = ctx.socket(zmq.DEALER)
    bad.connect(pub.replay_endpoint)
    bad.send_multipart([b"not a sequence number"])
    bad.send_multipart([b"", (8).to_bytes(8, "big")])
    # one peer's requests are answered in order: an answer to the bad one would come before these
    replies = [next_reply(bad) for _ in range(3)]
    assert [int.from_bytes(r[2], "big", signed=True) for r in replies] == [8, 9, -1]
    assert vllm.request_replay(ctx, pub.replay_endpoint, 100) == [[b"", b"", END_SEQ, b""]]
    assert not bad.poll(0)  # nor any after them
    bad.close(linger=0)


def next_reply(sock: zmq.Socket) -> list[bytes]:
    """The next reply frames on a replay DEALER (a bounded wait: a missing reply fails the test)."""
    assert sock.poll(5000), "no reply"
    return sock.recv_multipart()


def stall_sends(monkeypatch, pub: ZmqEventPublisher) -> tuple[threading.Event, threading.Event]:
    """Make the publisher thread wait inside its next sends until released; (entered, release)."""
    entered, release, send = threading.Event(), threading.Event(), pub._send

    def stalled(*args):
        entered.set()
        release.wait(10)
        send(*args)

    monkeypatch.setattr(pub, "_send", stalled)
    return entered, release


def test_a_full_queue_drops_counts_and_leaves_a_gap(make_pub, ctx, monkeypatch):
    pub = make_pub(max_queue_size=2)
    sub = vllm.subscribe(ctx, pub.endpoint, TOPIC.encode())
    _, seq = join(pub, sub)
    entered, release = stall_sends(monkeypatch, pub)
    pub.publish(probe())  # the thread takes it and stalls
    assert entered.wait(5)
    for _ in range(4):  # two fill the queue, two are dropped: publish returns at once all the same
        pub.publish(probe())
    assert pub.dropped == 2
    release.set()
    assert [vllm.receive(sub)[1] for _ in range(3)] == [seq, seq + 1, seq + 2]  # the queue is empty again
    pub.publish(probe())
    assert vllm.receive(sub)[1] == seq + 5  # the subscriber sees two numbers missing
    assert pub.dropped == 2 and pub.published == seq + 6  # the dropped ones were numbered


def test_shutdown_sends_what_is_queued_then_closes(make_pub, ctx, hold_port):
    ports = hold_port(), hold_port()  # no other process can take them once released
    endpoints = f"tcp://*:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"
    pub = make_pub(endpoint=endpoints[0], replay_endpoint=endpoints[1])
    sub = vllm.subscribe(ctx, pub.endpoint, TOPIC.encode())
    _, seq = join(pub, sub)
    for _ in range(50):
        pub.publish(probe())
    pub.shutdown(timeout=5.0)
    assert [vllm.receive(sub)[1] for _ in range(50)] == list(range(seq, seq + 50))
    with pytest.raises(PublisherClosedError):
        pub.publish(probe())
    pub.shutdown()  # a second call does nothing
    again = make_pub(endpoint=endpoints[0], replay_endpoint=endpoints[1])  # both were released
    assert (port(again.endpoint), port(again.replay_endpoint)) == tuple(map(str, ports))


def test_shutdown_gives_up_after_its_timeout(make_pub, monkeypatch):
    pub = make_pub()
    entered, release = stall_sends(monkeypatch, pub)
    pub.publish(probe())
    assert entered.wait(5)
    for _ in range(3):
        pub.publish(probe())
    start = time.monotonic()
    pub.shutdown(timeout=0.2)
    assert time.monotonic() - start < 5  # bounded although the thread is stuck
    assert pub.dropped == 3
    release.set()


# --- configuration and construction ------------------------------------------------------------------
def test_config_defaults_are_vllms():
    c = KVEventsConfig()
    got = (c.enable_kv_cache_events, c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm,
           c.max_queue_size, c.topic)  # fmt: skip
    assert got == (False, "zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")


@pytest.mark.parametrize("field,value", [
    ("enable_kv_cache_events", 1), ("publisher", "kafka"), ("endpoint", "http://host:5557"), ("endpoint", 5557),
    ("replay_endpoint", "tcp://"), ("buffer_steps", 0), ("hwm", -1), ("max_queue_size", 0),
    ("max_queue_size", 1.5), ("topic", b"kv"), ("event_encoding", "json"),
])  # fmt: skip
def test_config_rejects_a_bad_field_naming_it(field, value):
    with pytest.raises(InvalidArgumentError, match=f"^{field}=") as e:
        KVEventsConfig(**{field: value})
    assert isinstance(e.value, PagedKVError)


def test_make_publisher_follows_the_config():
    assert isinstance(make_publisher(None), NullEventPublisher)
    assert isinstance(make_publisher(KVEventsConfig()), NullEventPublisher)  # disabled
    assert isinstance(make_publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="null")), NullEventPublisher)
    pub = make_publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*"))
    assert isinstance(pub, ZmqEventPublisher) and pub.replay_endpoint is None
    pub.shutdown()
    null = NullEventPublisher()
    null.publish(probe())
    null.shutdown()


def port(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[1]


def test_an_address_in_use_raises_naming_it(make_pub):
    taken = make_pub()
    with pytest.raises(InvalidArgumentError, match="^endpoint="):
        make_pub(endpoint=f"tcp://*:{port(taken.endpoint)}")
    with pytest.raises(InvalidArgumentError, match="^replay_endpoint="):
        make_pub(replay_endpoint=taken.replay_endpoint)
    with pytest.raises(InvalidArgumentError, match="^batch="):
        taken.publish([AllBlocksCleared()])


def test_a_failed_replay_bind_releases_the_pub_port(make_pub, hold_port):
    taken = make_pub()
    pub_port = hold_port()  # no other process can take it once released
    with pytest.raises(InvalidArgumentError, match="^replay_endpoint=") as failed:
        make_pub(endpoint=f"tcp://*:{pub_port}", replay_endpoint=taken.replay_endpoint)
    # the traceback keeps the half-built publisher alive: released by the constructor, not by garbage collection
    assert failed.tb is not None
    assert port(make_pub(endpoint=f"tcp://*:{pub_port}", replay_endpoint=None).endpoint) == str(pub_port)


# --- the recorder --------------------------------------------------------------------------------------
def test_recorder_merges_only_a_continuing_chain_of_the_same_medium():
    rec = KVEventRecorder()
    assert rec.take_batch() is None
    rec.stored(H[0:1], None, [1, 2], 2)
    rec.stored(H[1:2], H[0], [3, 4], 2)  # continues: merged
    rec.stored(H[2:3], H[0], [5, 6], 2)  # a branch off H[0]: new event
    rec.stored(H[3:4], H[2], [7, 8], 2, MEDIUM_CPU)  # continues, other medium: new event
    rec.removed([H[3]], MEDIUM_CPU)
    rec.stored(H[4:5], H[3], [9, 9], 2, MEDIUM_CPU)  # a removal came between: new event
    batch = rec.take_batch()
    assert [summary(e)[:4] for e in batch.events] == [
        ("BlockStored", [H[0], H[1]], None, [1, 2, 3, 4]), ("BlockStored", [H[2]], H[0], [5, 6]),
        ("BlockStored", [H[3]], H[2], [7, 8]), ("BlockRemoved", [H[3]], None, None),
        ("BlockStored", [H[4]], H[3], [9, 9]),
    ]  # fmt: skip
    assert [e.medium for e in batch.events] == [MEDIUM_GPU, MEDIUM_GPU, MEDIUM_CPU, MEDIUM_CPU, MEDIUM_CPU]
    assert len(rec) == 0 and rec.take_batch() is None


def test_recorder_copies_its_inputs():
    rec, hashes, tokens = KVEventRecorder(), [H[0]], [1, 2]
    rec.stored(hashes, None, tokens, 2)
    hashes.append(H[1])
    tokens.append(3)
    assert summary(rec.take_batch().events[0])[1:4] == ([H[0]], None, [1, 2])


@pytest.mark.parametrize("args,name", [
    (([], None, [], 2), "hashes"), ((H[0], None, [1, 2], 2), "hashes"), (([b""], None, [1, 2], 2), "hashes"),
    (([1234], None, [1, 2], 2), "hashes"), ((H[0:1], "parent", [1, 2], 2), "parent"),
    ((H[0:1], None, [1, 2], 0), "block_size"), ((H[0:1], None, [1, 2, 3], 2), "token_ids"),
    ((H[0:1], None, [1, 2.0], 2), "token_ids"), ((H[0:1], None, 12, 2), "token_ids"),
    ((H[0:1], None, [1, 2], 2, "gpu"), "medium"),
])  # fmt: skip
def test_recorder_rejects_bad_input_naming_it_and_records_nothing(args, name):
    rec = KVEventRecorder()
    rec.cleared()
    with pytest.raises(PagedKVError, match=f"^{name}="):  # block_size 0: OutOfRangeError
        rec.stored(*args)
    with pytest.raises(InvalidArgumentError, match="^hashes="):
        rec.removed([])
    with pytest.raises(InvalidArgumentError, match="^medium="):
        rec.removed(H[0:1], "DISK")
    assert len(rec) == 1


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 3), st.booleans()), max_size=12))
def test_recorded_events_describe_exactly_the_blocks_stored(calls):
    """Merged or not, each block keeps its parent, its tokens and its medium, in order."""
    rec, want, made = KVEventRecorder(), [], [b"root"]
    for parent_pick, n, on_cpu in calls:
        parent = made[parent_pick % len(made)]
        new = [(len(made) + i).to_bytes(32, "big") for i in range(n)]
        medium = MEDIUM_CPU if on_cpu else MEDIUM_GPU
        tokens = [[len(made) + i] * 2 for i in range(n)]
        rec.stored(new, None if parent == b"root" else parent, sum(tokens, []), 2, medium)
        for i, h in enumerate(new):
            want.append((h, [parent, *new][i], tokens[i], medium))
        made += new
    got = []
    for e in (rec.take_batch() or KVEventBatch(ts=0.0, events=[])).events:
        parents = [e.parent_block_hash or b"root", *e.block_hashes]
        got += [(h, parents[i], e.token_ids[2 * i: 2 * i + 2], e.medium) for i, h in enumerate(e.block_hashes)]
    assert got == want

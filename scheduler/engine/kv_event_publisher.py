"""Publishing KV cache event batches on ZeroMQ as vLLM does: three frames, sequence numbers, replay.

The protocol of vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``, 0.26 and later):

- live: a PUB socket sends each batch as ``[topic, seq, payload]``; ``seq`` numbers the batches from
  0, one per batch, as 8 bytes big-endian; ``payload`` is :func:`~scheduler.engine.kv_events.encode_batch`.
  A subscriber that sees ``seq`` jump has lost batches.
- replay: a ROUTER socket takes ``[b"", start_seq]`` (a REQ client's envelope; a DEALER sends the empty
  frame itself) and answers ``[b"", topic, seq, payload]`` for each kept batch with ``seq >= start_seq``,
  oldest first, then the end marker ``[b"", b"", -1, b""]`` (-1 as 8 signed bytes). The last
  ``buffer_steps`` batches are kept. (vLLM before 0.26 left the topic frame out of replies.)

``publish`` runs in the engine's thread and never blocks: it numbers the batch and queues it. When the
queue is full the batch is dropped and counted, and its number stays unused, so subscribers see the
gap (vLLM blocks the engine instead). One background thread owns both sockets (ZeroMQ sockets are
not thread-safe): it encodes, sends, keeps the replay buffer and answers replay requests.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Protocol

import msgspec
import zmq

from paged_kv.errors import InvalidArgumentError, PublisherClosedError, check_int, check_real, check_type, describe
from scheduler.core.kv_events_config import KVEventsConfig
from scheduler.engine.kv_events import KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the seq frame that ends a replay
_POLL_S = 0.02  # how long the thread waits for a batch before it looks at replay requests again
_REPLAYS_PER_TURN = 4  # replay requests answered between two batches, so the live stream keeps going
_LINGER_MS = 500  # how long closing the PUB socket may take to hand the last messages to the network
_ABORT_WAIT_S = 0.5


class EventPublisher(Protocol):
    """What the engine publishes its KV event batches through."""

    def publish(self, batch: KVEventBatch) -> None:
        """Send ``batch`` on (never blocking the caller)."""

    def shutdown(self) -> None:
        """Flush what is pending, within a bounded time, and release the publisher's resources."""


class NullEventPublisher:
    """Publishes nothing: events are disabled."""

    def publish(self, batch: KVEventBatch) -> None:
        """Discard ``batch``."""

    def shutdown(self) -> None:
        """Nothing to release."""


class ZmqEventPublisher:
    """vLLM's PUB/ROUTER publisher (see the module docstring): sequence numbers, a replay buffer, no blocking."""

    SHUTDOWN_TIMEOUT = 1.0  # seconds ``shutdown`` waits for the queue to drain, as vLLM's

    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int = 0) -> None:
        """Open and bind (or connect) the sockets now, so a bad endpoint raises here; then start the thread."""
        check_type("config", config, KVEventsConfig, "a KVEventsConfig")
        self._rank = check_int("data_parallel_rank", data_parallel_rank)
        self._config = config
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)  # (seq, payload), thread-owned
        self._lock = threading.Lock()  # guards the counters and the closed flag
        self._next_seq = 0
        self._dropped = 0
        self._closed = False
        self._stopping, self._abort = threading.Event(), threading.Event()
        self._ctx = zmq.Context()
        try:
            self._pub, self.endpoint = _open(self._ctx, zmq.PUB, "endpoint", config.endpoint, config.hwm)
            self._replay, self.replay_endpoint = None, None
            if config.replay_endpoint is not None:
                self._replay, self.replay_endpoint = _open(self._ctx, zmq.ROUTER, "replay_endpoint",
                                                           config.replay_endpoint, config.hwm, bind=True)  # fmt: skip
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()  # from here on only the thread touches the sockets and the buffer

    @property
    def published(self) -> int:
        """Batches numbered so far (sent, queued or dropped): the last one's seq is ``published - 1``."""
        return self._next_seq

    @property
    def dropped(self) -> int:
        """Batches dropped so far: the queue was full, or shutdown gave up on them."""
        return self._dropped

    def publish(self, batch: KVEventBatch) -> None:
        """Number ``batch`` and queue it, never blocking; when the queue is full drop it (counted in ``dropped``).

        The publisher takes the batch over: it stamps its ``data_parallel_rank`` if it has none.
        """
        check_type("batch", batch, KVEventBatch, "a KVEventBatch")
        with self._lock:
            if self._closed:
                raise PublisherClosedError(describe("publisher", "shut down", "publish() before shutdown()"))
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            if batch.data_parallel_rank is None:
                batch.data_parallel_rank = self._rank
            try:
                self._queue.put_nowait((seq, batch))
            except queue.Full:
                self._dropped += 1

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """Send what is queued (waiting at most ``timeout`` seconds), then close the sockets; then a no-op."""
        check_real("timeout", timeout, low=0.0)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stopping.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events: %d batches not sent %.1f s after shutdown", self._queue.qsize(), timeout)
            self._abort.set()
            self._thread.join(_ABORT_WAIT_S)
        with self._lock:
            self._dropped += self._queue.qsize()
        if not self._thread.is_alive():
            self._ctx.term()  # the thread closed the sockets; waits at most their linger

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _run(self) -> None:
        """The thread: send queued batches in order, answer replay requests; on stop, drain the queue and close."""
        encoder = msgspec.msgpack.Encoder()
        try:
            while not self._abort.is_set():
                try:
                    if not self._turn(encoder):
                        return
                except Exception:  # a socket error must not end the stream for good
                    logger.exception("KV events: publisher error; going on")
        finally:
            self._pub.close(linger=0 if self._abort.is_set() else _LINGER_MS)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _turn(self, encoder: msgspec.msgpack.Encoder) -> bool:
        """Answer replay requests, then send the next batch if one comes soon; False once stopping and drained."""
        self._serve_replay()
        try:
            seq, batch = self._queue.get(timeout=_POLL_S)
        except queue.Empty:
            return not self._stopping.is_set()
        self._send(seq, batch, encoder)
        return True

    def _send(self, seq: int, batch: KVEventBatch, encoder: msgspec.msgpack.Encoder) -> None:
        """Publish one batch and keep it for replay; a batch that fails to encode is logged and skipped."""
        try:
            payload = encode_batch(batch, self._config.event_encoding, encoder)
        except Exception:  # the gap in the numbers tells subscribers
            logger.exception("KV events: batch %d could not be encoded; skipped", seq)
            return
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))  # PUB drops at HWM, never blocks
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        """Answer up to a few pending replay requests from the buffer."""
        sock = self._replay
        for _ in range(_REPLAYS_PER_TURN):
            if sock is None or not sock.poll(0):
                return
            frames = sock.recv_multipart()
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                logger.warning("KV events: ignored a malformed replay request of %d frames", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            sock.send_multipart((client, b"", b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig | None, *, data_parallel_rank: int = 0) -> EventPublisher:
    """A :class:`ZmqEventPublisher` when ``config`` enables events with publisher "zmq", else a null one."""
    if config is not None:
        check_type("config", config, KVEventsConfig, "a KVEventsConfig or None")
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank=data_parallel_rank)


def _open(ctx: zmq.Context, kind: int, name: str, address: str, hwm: int, *,
          bind: bool | None = None) -> tuple[zmq.Socket, str]:  # fmt: skip
    """A socket bound (or connected, by vLLM's rule unless ``bind`` says) to ``address``, and its resolved address."""
    bind = _binds(address) if bind is None else bind
    sock = ctx.socket(kind)
    sock.hwm = hwm
    try:
        sock.bind(address) if bind else sock.connect(address)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        verb = "bind" if bind else "connect to"
        raise InvalidArgumentError(describe(name, address, f"an address this process can {verb} ({e})")) from e
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _binds(address: str) -> bool:
    """vLLM's rule: bind a wildcard or IPv6-any TCP address and every ipc/inproc one; connect to the rest."""
    return "*" in address or "::" in address or address.startswith(("ipc://", "inproc://"))

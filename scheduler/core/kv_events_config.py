"""Configuration of KV cache event publishing: vLLM's ``KVEventsConfig`` fields, with its defaults."""

from __future__ import annotations

from dataclasses import dataclass

from paged_kv.errors import InvalidArgumentError, check_bool, check_int, check_type, describe

ENCODINGS = ("array", "map")  # an event as a positional array (vLLM <= 0.25) or a tagged map (>= 0.26)
PUBLISHERS = ("null", "zmq")
SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    """Whether, where and how KV cache events are published (field names and defaults as vLLM's)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # or "null"; vLLM's None default means "zmq" when events are enabled
    endpoint: str = "tcp://*:5557"  # the PUB socket: bound if it has "*" or "::" or is ipc/inproc, else connected
    replay_endpoint: str | None = None  # the ROUTER socket serving replay requests (always bound); None: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZeroMQ high-water mark of the PUB socket (0: unlimited)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; more are dropped
    topic: str = ""  # the first frame of every message; subscribers filter on its prefix
    event_encoding: str = "array"  # paged-kv's own: events as arrays (vLLM <= 0.25) or tagged maps (>= 0.26)

    def __post_init__(self) -> None:
        check_bool("enable_kv_cache_events", self.enable_kv_cache_events)
        _check_choice("publisher", self.publisher, PUBLISHERS)
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
        check_int("buffer_steps", self.buffer_steps, low=1)
        check_int("hwm", self.hwm, low=0)
        check_int("max_queue_size", self.max_queue_size, low=1)
        check_type("topic", self.topic, str, "a str")
        _check_choice("event_encoding", self.event_encoding, ENCODINGS)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(describe(name, value, f"one of {choices}"))


def _check_endpoint(name: str, value: object) -> None:
    """Raise naming ``name`` unless ``value`` is a ZeroMQ address with a transport paged-kv serves."""
    check_type(name, value, str, "a str")
    scheme = next((s for s in SCHEMES if value.startswith(s)), None)  # type: ignore[union-attr]
    if scheme is None or len(value) == len(scheme):  # type: ignore[arg-type]
        raise InvalidArgumentError(describe(name, value, f"a ZeroMQ address starting with one of {SCHEMES}"))

"""Facade 001: the "contiguous" float32 ``KvCache`` with the ``KvCacheAccess`` trait, on pages.

The documented cache keeps one ``max_seq_len * kv_dim`` float32 buffer per
layer for K and one for V. Here the tokens live in one paged sequence of a
float32 :class:`~paged_kv.compat.pool.KVPool` (``kv_dim`` split as
``num_kv_heads x head_dim``, one head of ``kv_dim`` by default): pages are
taken as tokens are stored, ``truncate`` / ``clear`` hand whole pages back, and
``copy()`` shares pages copy-on-write.

Position protocol (as documented): ``store_kv`` writes the token at position
``seq_len()`` for one layer; ``advance()`` then makes it part of the cache. A
position advanced over without ``store_kv`` reads as zeros on a fresh page (pages
are zeroed when taken, so caches sharing a pool never see each other's data);
after ``truncate``, as documented, a kept page's old data stays until overwritten.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import safetensors
import safetensors.numpy
import torch

from paged_kv.compat._common import (
    as_vector,
    check_index,
    extend_zeroed,
    make_pool,
    readonly,
    to_numpy,
)
from paged_kv.compat.pool import KVPool, PagedSeq
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, check_int, describe

__all__ = ["KvCache", "KvCacheAccess", "KvCacheSnapshot", "KvStatePayload"]

TokenFn = Callable[[int, np.ndarray], object]


class KvCacheAccess(ABC):
    """The documented ``KvCacheAccess`` trait: per-layer K/V storage addressed by position."""

    @abstractmethod
    def seq_len(self) -> int:
        """Current sequence length (number of cached tokens)."""

    @abstractmethod
    def store_kv(self, layer: int, key: object, value: object) -> None:
        """Store one token's ``kv_dim`` key and value floats for ``layer`` at the current position."""

    @abstractmethod
    def get_keys(self, layer: int) -> np.ndarray:
        """All cached keys of ``layer``: ``seq_len * kv_dim`` float32s."""

    @abstractmethod
    def get_values(self, layer: int) -> np.ndarray:
        """All cached values of ``layer``: ``seq_len * kv_dim`` float32s."""

    @abstractmethod
    def advance(self) -> None:
        """Advance the cache position by one token."""

    @abstractmethod
    def kv_dim(self) -> int:
        """KV dimension per token (``num_kv_heads * head_dim``)."""

    def for_each_key(self, layer: int, f: TokenFn) -> None:
        """Call ``f(pos, key)`` for every cached token of ``layer`` (``key``: ``kv_dim`` float32s)."""
        _for_each(self.get_keys(layer), self.kv_dim(), f)

    def for_each_value(self, layer: int, f: TokenFn) -> None:
        """Call ``f(pos, value)`` for every cached token of ``layer`` (``value``: ``kv_dim`` float32s)."""
        _for_each(self.get_values(layer), self.kv_dim(), f)


def _for_each(flat: np.ndarray, kv_dim: int, f: TokenFn) -> None:
    """Call ``f(pos, row)`` over the ``kv_dim``-sized rows of ``flat``."""
    if not callable(f):
        raise InvalidArgumentError(describe("f", type(f).__name__, "a callable f(pos, data)"))
    for pos, row in enumerate(flat.reshape(-1, kv_dim)):
        f(pos, row)


@dataclass(frozen=True)
class KvCacheSnapshot:
    """Per-layer flat copies of the ``seq_len * kv_dim`` valid K and V floats, and ``seq_len``."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    seq_len: int


@dataclass(frozen=True, eq=False)
class KvStatePayload:
    """A serialisable cache state; ``to_bytes()`` / ``from_bytes()`` use the safetensors format.

    Fields are validated and frozen on construction: ``keys`` / ``values`` become
    tuples of ``num_layers`` read-only float32 arrays of ``seq_len * kv_dim``.
    """

    num_layers: int
    kv_dim: int
    seq_len: int
    keys: Sequence[np.ndarray]
    values: Sequence[np.ndarray]

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, low=1)
        check_int("kv_dim", self.kv_dim, low=1)
        check_int("seq_len", self.seq_len)
        size = self.seq_len * self.kv_dim
        for name in ("keys", "values"):
            rows = _layer_list(name, getattr(self, name), self.num_layers)
            frozen = tuple(readonly(to_numpy(as_vector(f"{name}[{i}]", r, size))) for i, r in enumerate(rows))
            object.__setattr__(self, name, frozen)

    def to_bytes(self) -> bytes:
        """The payload in safetensors format: tensors ``keys.<layer>`` / ``values.<layer>`` of ``[seq_len, kv_dim]``."""
        shape = (self.seq_len, self.kv_dim)
        tensors = {f"{name}.{i}": getattr(self, name)[i].reshape(shape) for name in ("keys", "values")
                   for i in range(self.num_layers)}
        return safetensors.numpy.save(tensors, metadata={"format": "paged-kv/KvStatePayload/1"})

    @classmethod
    def from_bytes(cls, data: bytes) -> KvStatePayload:
        """Parse bytes written by :meth:`to_bytes`; malformed input raises ``InvalidArgumentError``."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(describe("data", type(data).__name__, "bytes"))
        try:
            tensors = safetensors.numpy.load(bytes(data))
        except safetensors.SafetensorError as exc:
            expected = f"a safetensors payload ({exc})"
            raise InvalidArgumentError(describe("data", f"{len(data)} bytes", expected)) from None
        num_layers = len(tensors) // 2
        names = {f"{n}.{i}" for n in ("keys", "values") for i in range(num_layers)}
        if not tensors or set(tensors) != names:
            raise InvalidArgumentError(describe("data", sorted(tensors), "tensors keys.<layer> and values.<layer>"))
        first = tensors["keys.0"]
        for name, t in tensors.items():
            if t.dtype != np.float32 or t.ndim != 2 or t.shape != first.shape:
                raise InvalidArgumentError(describe(f"data[{name}]", (str(t.dtype), t.shape), f"float32 {first.shape}"))
        seq_len, kv_dim = first.shape
        pick = lambda n: [tensors[f"{n}.{i}"].reshape(-1) for i in range(num_layers)]  # noqa: E731
        return cls(num_layers, kv_dim, seq_len, pick("keys"), pick("values"))


def _layer_list(name: str, rows: object, num_layers: int) -> Sequence[object]:
    """``rows`` if it is a sequence of exactly ``num_layers`` per-layer entries, else raise."""
    try:
        count = len(rows)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(describe(name, type(rows).__name__, "a sequence of per-layer arrays")) from None
    if isinstance(rows, (str, bytes)) or count != num_layers:
        raise InvalidArgumentError(describe(f"len({name})", count, f"num_layers={num_layers}"))
    return rows  # type: ignore[return-value]


class KvCache(KvCacheAccess):
    """Float32 K/V of ``num_layers`` layers, ``kv_dim`` floats per token, stored in pages."""

    def __init__(
        self,
        num_layers: int,
        max_seq_len: int,
        kv_dim: int,
        *,
        num_kv_heads: int | None = None,
        pool: KVPool | None = None,
        block_size: int | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        self._max_seq_len = check_int("max_seq_len", max_seq_len)
        self._kv_dim = check_int("kv_dim", kv_dim, low=1)
        pool_heads = pool.spec.num_kv_heads if isinstance(pool, KVPool) else 1
        heads = num_kv_heads if num_kv_heads is not None else pool_heads
        heads = check_int("num_kv_heads", heads, low=1)
        if kv_dim % heads:
            raise InvalidArgumentError(describe("num_kv_heads", heads, f"a divisor of kv_dim={kv_dim}"))
        self._pool = make_pool(pool, num_layers=num_layers, num_kv_heads=heads, head_dim=kv_dim // heads,
                               dtype=torch.float32, block_size=block_size, device=device)
        self._num_layers = num_layers
        self._seq = self._pool.new_seq()
        self._len = 0  # invariant: self._seq.length is _len, or _len + 1 once the current position is stored

    # -- KvCacheAccess ---------------------------------------------------------
    def seq_len(self) -> int:
        """Current sequence length (number of cached tokens)."""
        return self._len

    def kv_dim(self) -> int:
        """KV dimension per token (``num_kv_heads * head_dim``)."""
        return self._kv_dim

    def store_kv(self, layer: int, key: object, value: object) -> None:
        """Store one token's ``kv_dim`` key and value floats for ``layer`` at position ``seq_len()``."""
        layer = self._layer(layer)
        device = self._pool.storage.device
        k, v = (as_vector(n, x, self._kv_dim, device=device) for n, x in (("key", key), ("value", value)))
        if self._len >= self._max_seq_len:
            raise OutOfRangeError(describe("seq_len", self._len, f"below max_seq_len={self._max_seq_len} (cache full)"))
        held = self._seq.length
        if held == self._len:
            extend_zeroed(self._seq, 1)
        try:
            self._seq.write(layer, self._len, k.view(1, *self._head_shape), v.view(1, *self._head_shape))
        except BaseException:
            self._seq.truncate(held)
            raise

    def get_keys(self, layer: int) -> np.ndarray:
        """All cached keys of ``layer``: a read-only flat array of ``seq_len * kv_dim`` float32s."""
        return readonly(to_numpy(self._read(layer)[0].reshape(-1)))

    def get_values(self, layer: int) -> np.ndarray:
        """All cached values of ``layer``: a read-only flat array of ``seq_len * kv_dim`` float32s."""
        return readonly(to_numpy(self._read(layer)[1].reshape(-1)))

    def advance(self) -> None:
        """Advance the position by one token; raises ``OutOfRangeError`` at ``max_seq_len``."""
        if self._len >= self._max_seq_len:
            raise OutOfRangeError(describe("seq_len", self._len, f"below max_seq_len={self._max_seq_len} to advance"))
        if self._seq.length == self._len:
            extend_zeroed(self._seq, 1)  # a position never stored reads as zeros
        self._len += 1

    # -- KvCache -----------------------------------------------------------------
    def clear(self) -> None:
        """Drop every cached token; all pages go back to the pool."""
        self._seq.truncate(0)
        self._len = 0

    def max_seq_len(self) -> int:
        """The maximum sequence length."""
        return self._max_seq_len

    def num_layers(self) -> int:
        """The number of layers."""
        return self._num_layers

    def truncate(self, n: int) -> None:
        """Keep the first ``min(n, seq_len())`` tokens (never extends); whole pages past them go back."""
        n = check_int("n", n)
        if n < self._len:
            self._seq.truncate(n)
            self._len = n

    def memory_usage_bytes(self) -> int:
        """Bytes of the pages this cache holds (K and V, all layers), not of ``max_seq_len``."""
        return self._seq.nbytes

    @property
    def pool(self) -> KVPool:
        """The block pool holding this cache's pages."""
        return self._pool

    # -- snapshots and payloads --------------------------------------------------
    def snapshot(self) -> KvCacheSnapshot:
        """Copies of the ``seq_len * kv_dim`` valid floats of every layer's K and V."""
        layers = [self._read(layer) for layer in range(self.num_layers())]
        flat = lambda t: to_numpy(t.reshape(-1))  # noqa: E731
        return KvCacheSnapshot([flat(k) for k, _ in layers], [flat(v) for _, v in layers], self._len)

    def restore_from_snapshot(self, keys: Sequence[object], values: Sequence[object], seq_len: int) -> None:
        """Replace the state by ``seq_len`` tokens of per-layer flat ``keys`` / ``values``; checked first."""
        self._restore(keys, values, seq_len, "")

    def to_payload(self) -> KvStatePayload:
        """The current state as a serialisable :class:`KvStatePayload`."""
        snap = self.snapshot()
        return KvStatePayload(self.num_layers(), self._kv_dim, snap.seq_len, snap.keys, snap.values)

    def restore_from_payload(self, payload: KvStatePayload) -> None:
        """Restore from ``payload`` after checking its layer count, ``kv_dim`` and lengths fit this cache."""
        if not isinstance(payload, KvStatePayload):
            raise InvalidArgumentError(describe("payload", type(payload).__name__, "a KvStatePayload"))
        for name, want in (("num_layers", self.num_layers()), ("kv_dim", self._kv_dim)):
            if getattr(payload, name) != want:
                raise InvalidArgumentError(describe(f"payload.{name}", getattr(payload, name), f"{want}"))
        self._restore(payload.keys, payload.values, payload.seq_len, "payload.")

    # -- copying -------------------------------------------------------------------
    def copy(self) -> KvCache:
        """An independent cache sharing this one's pages copy-on-write (no data copied)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._seq = self._seq.fork()
        return twin

    __copy__ = copy

    def __deepcopy__(self, memo: dict) -> KvCache:
        """Same as :meth:`copy`: copy-on-write pages already behave as a deep copy."""
        return self.copy()

    def __repr__(self) -> str:
        return (f"KvCache(num_layers={self.num_layers()}, max_seq_len={self._max_seq_len}, kv_dim={self._kv_dim}, "
                f"seq_len={self._len}, pages={self._seq.num_pages})")

    # -- internals -------------------------------------------------------------------
    @property
    def _head_shape(self) -> tuple[int, int]:
        return self._pool.spec.num_kv_heads, self._pool.spec.head_dim

    def _layer(self, layer: object) -> int:
        return check_index("layer", layer, self.num_layers())

    def _read(self, layer: object) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` for positions ``[0, seq_len)``: ``[seq_len, H, D]`` each."""
        return self._seq.read(self._layer(layer), 0, self._len)

    def _restore(self, keys: object, values: object, seq_len: object, prefix: str) -> None:
        """Check everything, write it into a fresh sequence, then swap it in (all or nothing)."""
        seq_len = check_int(f"{prefix}seq_len", seq_len)
        if seq_len > self._max_seq_len:
            raise OutOfRangeError(describe(f"{prefix}seq_len", seq_len, f"at most max_seq_len={self._max_seq_len}"))
        rows = {}
        for name, data in (("keys", keys), ("values", values)):
            per_layer = _layer_list(f"{prefix}{name}", data, self.num_layers())
            rows[name] = [as_vector(f"{prefix}{name}[{i}]", r, seq_len * self._kv_dim, device=self._pool.storage.device)
                          .view(seq_len, *self._head_shape) for i, r in enumerate(per_layer)]
        self._swap_in(self._filled_seq(rows["keys"], rows["values"], seq_len), seq_len)

    def _filled_seq(self, keys: list[torch.Tensor], values: list[torch.Tensor], seq_len: int) -> PagedSeq:
        """A new sequence of this pool holding ``keys`` / ``values`` ``[seq_len, H, D]`` per layer."""
        seq = self._pool.new_seq()
        try:
            extend_zeroed(seq, seq_len)  # the last page's slots past seq_len read as zeros after advance()
            for layer, (k, v) in enumerate(zip(keys, values)):
                seq.write(layer, 0, k, v)
        except BaseException:
            seq.free()
            raise
        return seq

    def _swap_in(self, seq: PagedSeq, seq_len: int) -> None:
        old, self._seq, self._len = self._seq, seq, seq_len
        old.free()

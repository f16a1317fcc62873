"""Facade 000: the ndarray ``KvCache`` (float64, ``[seq_len, num_heads, head_dim]`` per layer) on pages.

The documented cache concatenates each layer's new K/V along the sequence
dimension. Here every layer's rows live in one paged sequence of a float64
:class:`~paged_kv.compat.pool.KVPool`: pages are taken as the longest layer
grows, never for ``max_seq_len`` up front, and ``copy()`` shares them
copy-on-write. ``keys`` / ``values`` / ``get_kv`` return read-only NumPy arrays
gathered from the pages (the cache's data cannot be edited through them).
"""

from __future__ import annotations

import numpy as np
import torch

from paged_kv.compat._common import as_tensor, check_index, make_pool, readonly, to_numpy
from paged_kv.compat.pool import KVPool
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, PagedKVError, check_int, describe

__all__ = ["KvCache", "KvCacheError", "InvalidArgument", "ShapeMismatch", "LayerOutOfBounds", "CapacityExceeded"]


class KvCacheError(PagedKVError):
    """Base of every error this facade raises (the documented ``KvCacheError``)."""


class InvalidArgument(KvCacheError, InvalidArgumentError):
    """An argument has the wrong type (e.g. a layer index that is no integer)."""


class ShapeMismatch(InvalidArgument):
    """``new_k`` / ``new_v`` are not numeric ``[new_tokens, num_heads, head_dim]`` arrays of one shape."""


class LayerOutOfBounds(KvCacheError, OutOfRangeError):
    """The layer index is not in ``[0, num_layers)``."""


class CapacityExceeded(KvCacheError, OutOfRangeError):
    """The append would grow a layer past ``max_seq_len``."""


class KvCache:
    """Per-layer float64 K/V of shape ``[seq_len, num_heads, head_dim]``, stored in pages."""

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        max_seq_len: int,
        *,
        pool: KVPool | None = None,
        block_size: int | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        self._max_seq_len = check_int("max_seq_len", max_seq_len)
        check_int("num_heads", num_heads, low=1)  # the pool would name it num_kv_heads
        self._pool = make_pool(
            pool, num_layers=num_layers, num_kv_heads=num_heads, head_dim=head_dim,
            dtype=torch.float64, block_size=block_size, device=device,
        )
        self._seq = self._pool.new_seq()
        self._lens = [0] * num_layers  # rows cached per layer; the sequence holds max(_lens) slots

    # -- documented fields (read-only here) -------------------------------
    @property
    def num_layers(self) -> int:
        """Number of transformer layers."""
        return len(self._lens)

    @property
    def num_heads(self) -> int:
        """Number of attention heads."""
        return self._pool.spec.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Size of one head's vector."""
        return self._pool.spec.head_dim

    @property
    def max_seq_len(self) -> int:
        """Maximum allowed sequence length (per layer)."""
        return self._max_seq_len

    @property
    def seq_len(self) -> int:
        """Current cached sequence length (that of layer 0)."""
        return self._lens[0]

    @property
    def keys(self) -> list[np.ndarray]:
        """Cached K per layer: read-only float64 arrays ``[len, num_heads, head_dim]``."""
        return [self._gather(layer)[0] for layer in range(self.num_layers)]

    @property
    def values(self) -> list[np.ndarray]:
        """Cached V per layer: read-only float64 arrays ``[len, num_heads, head_dim]``."""
        return [self._gather(layer)[1] for layer in range(self.num_layers)]

    @property
    def pool(self) -> KVPool:
        """The block pool holding this cache's pages."""
        return self._pool

    # -- documented methods ------------------------------------------------
    def append_kv(self, layer: int, new_k: object, new_v: object) -> None:
        """Append ``new_k`` / ``new_v`` ``[new_tokens, num_heads, head_dim]`` to ``layer``'s cache."""
        layer = check_index("layer", layer, self.num_layers, error=LayerOutOfBounds, type_error=InvalidArgument)
        k, v = self._as_rows(new_k, new_v)  # [T, H, D] float64 each
        start, count = self._lens[layer], k.shape[0]
        if start + count > self._max_seq_len:
            room = self._max_seq_len - start
            raise CapacityExceeded(describe("new_k", f"{count} new tokens", f"at most {room} (max_seq_len="
                                            f"{self._max_seq_len}, layer {layer} holds {start})"))
        if count:
            self._write(layer, start, k, v)
            self._lens[layer] = start + count

    def get_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``(keys, values)`` of ``layer`` as read-only float64 arrays, or ``None`` if out of range."""
        try:
            layer = check_index("layer", layer, self.num_layers, type_error=InvalidArgument)
        except OutOfRangeError:
            return None
        return self._gather(layer)

    def current_len(self) -> int:
        """Current cached sequence length (positions cached in layer 0)."""
        return self._lens[0]

    def memory_usage_bytes(self) -> int:
        """Bytes of the pages this cache holds (8 bytes per float64 slot, K and V, all layers).

        Counts whole pages actually held, not ``max_seq_len``; pages shared with
        a ``copy()`` count for each cache holding them.
        """
        return self._seq.nbytes

    # -- copying -------------------------------------------------------------
    def copy(self) -> KvCache:
        """An independent cache sharing this one's pages copy-on-write (no data copied)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._lens, twin._seq = list(self._lens), self._seq.fork()
        return twin

    __copy__ = copy

    def __deepcopy__(self, memo: dict) -> KvCache:
        """Same as :meth:`copy`: copy-on-write pages already behave as a deep copy."""
        return self.copy()

    def __repr__(self) -> str:
        return (f"KvCache(num_layers={self.num_layers}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"seq_len={self.seq_len}, max_seq_len={self._max_seq_len}, pages={self._seq.num_pages})")

    # -- internals -----------------------------------------------------------
    def _as_rows(self, new_k: object, new_v: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Both inputs as float64 ``[T, H, D]`` tensors on the pool's device, of one shape."""
        dims = (self.num_heads, self.head_dim)
        device = self._pool.storage.device
        k = as_tensor("new_k", new_k, dtype=torch.float64, shape=(None, *dims), device=device, error=ShapeMismatch)
        v = as_tensor("new_v", new_v, dtype=torch.float64, shape=tuple(k.shape), device=device, error=ShapeMismatch)
        return k, v

    def _write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write rows at ``[start, start + T)`` of ``layer``, growing the sequence; all or nothing."""
        held = self._seq.length
        end = start + k.shape[0]
        # new pages plus a copy of every shared page written (a shorter layer writes into earlier pages)
        self._pool.ensure_free(self._pool.manager.num_blocks_to_write_all([(self._seq.seq_id, start, end)]))
        if end > held:
            self._seq.extend(end - held)
        try:
            self._seq.write(layer, start, k, v)
        except BaseException:
            self._seq.truncate(held)
            raise

    def _gather(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Read-only float64 copies of ``layer``'s cached K and V."""
        k, v = self._seq.read(layer, 0, self._lens[layer])
        return readonly(to_numpy(k, np.float64)), readonly(to_numpy(v, np.float64))

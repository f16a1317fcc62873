"""Facade 003: ``QuantizedKVCache`` (F32 / INT8 / FP8 K/V with per-head scales), on pages.

The documented cache preallocates ``max_seq_len`` positions per layer. Here
positions live in pages of a :class:`~paged_kv.compat.pool.KVPool` whose storage
dtype is the format's (float32, int8, float8_e4m3fn, float8_e5m2): the
kernels' ``write_kv`` quantizes on write and the pool's gather dequantizes on
read, following :mod:`kernels.quant` (one float32 scale per (position, head),
``scale = max|x| / QMAX``; FP8 codes are torch's: round to nearest even,
saturating). Pages are taken as positions are written and given back by
``truncate``, ``reset`` and ``shift_left``; ``copy()`` shares them copy-on-write.

The cache is one :class:`~paged_kv.compat.pool.PagedSeq` that always holds
whole pages, zeroed when taken. ``shift_left`` moves nothing: the cache keeps
an offset of dead slots (fewer than one page) at the front of its first page
and gives whole leading pages back with ``PagedSeq.drop_front``.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from paged_kv.compat._common import (
    as_vector,
    check_finite,
    check_index,
    extend_zeroed,
    make_pool,
    readonly,
    to_numpy,
)
from paged_kv.compat.pool import KVPool
from paged_kv.errors import InvalidArgumentError, check_int, describe

__all__ = ["KVCacheFormat", "QuantizedKVCache"]


class KVCacheFormat(enum.Enum):
    """Storage format of a :class:`QuantizedKVCache`."""

    F32 = "f32"
    INT8 = "int8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def dtype(self) -> torch.dtype:
        """The torch storage dtype of this format."""
        return _DTYPES[self]

    @property
    def bytes_per_element(self) -> int:
        """Bytes one stored element takes (scales not included)."""
        return self.dtype.itemsize

    @property
    def scaled(self) -> bool:
        """Whether values are stored as codes with one float32 scale per (position, head)."""
        return self is not KVCacheFormat.F32


_DTYPES = {
    KVCacheFormat.F32: torch.float32,
    KVCacheFormat.INT8: torch.int8,
    KVCacheFormat.FP8_E4M3: torch.float8_e4m3fn,
    KVCacheFormat.FP8_E5M2: torch.float8_e5m2,
}


def _as_format(fmt: object) -> KVCacheFormat:
    """A :class:`KVCacheFormat` from a member, its name ("INT8") or its value ("int8")."""
    if isinstance(fmt, KVCacheFormat):
        return fmt
    if isinstance(fmt, str):
        for member in KVCacheFormat:
            if fmt in (member.name, member.value):
                return member
    raise InvalidArgumentError(describe("format", fmt, f"a KVCacheFormat ({', '.join(m.name for m in KVCacheFormat)})"))


class QuantizedKVCache:
    """K/V of ``num_layers`` layers stored in ``format``, one position at a time, in pages."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        format: KVCacheFormat | str,  # noqa: A002 (the documented name)
        *,
        pool: KVPool | None = None,
        block_size: int | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        self._format = _as_format(format)
        self._max_seq_len = check_int("max_seq_len", max_seq_len)
        self._pool = make_pool(pool, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               dtype=self._format.dtype, block_size=block_size, device=device)
        self._num_layers = num_layers
        self._seq = self._pool.new_seq()  # whole pages; logical position p at slot p + _offset
        self._offset = 0  # dead slots at the front of the first page, < block_size (0 with no page)
        self._len = 0
        self._dirty = 0  # positions [_len, _dirty) may still hold data from before a truncate

    # -- documented fields (read-only here) -------------------------------
    @property
    def format(self) -> KVCacheFormat:
        """Storage format."""
        return self._format

    @property
    def seq_len(self) -> int:
        """Current sequence length (one past the highest position written)."""
        return self._len

    @property
    def max_seq_len(self) -> int:
        """Positions the cache can hold."""
        return self._max_seq_len

    @property
    def num_kv_heads(self) -> int:
        """KV heads per position."""
        return self._pool.spec.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Floats per head vector."""
        return self._pool.spec.head_dim

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return self._num_layers

    @property
    def pool(self) -> KVPool:
        """The block pool holding this cache's pages."""
        return self._pool

    @property
    def k_data(self) -> list[np.ndarray]:
        """Raw key bytes per layer (read-only uint8, built on demand from the pages).

        Layout: element ``(head, pos, d)`` at element index ``(head * max_seq_len + pos)
        * head_dim + d``, ``format.bytes_per_element`` bytes each in native byte order
        (FP8 as torch's float8 bits, INT8 as two's complement); unwritten positions are 0.
        """
        return [self._raw(layer, 0)[0] for layer in range(self.num_layers)]

    @property
    def v_data(self) -> list[np.ndarray]:
        """Raw value bytes per layer, laid out like :attr:`k_data`."""
        return [self._raw(layer, 1)[0] for layer in range(self.num_layers)]

    @property
    def k_scales(self) -> list[np.ndarray]:
        """Key scales per layer (read-only float32, index ``head * max_seq_len + pos``; empty for F32)."""
        return [self._raw(layer, 0)[1] for layer in range(self.num_layers)]

    @property
    def v_scales(self) -> list[np.ndarray]:
        """Value scales per layer, laid out like :attr:`k_scales`."""
        return [self._raw(layer, 1)[1] for layer in range(self.num_layers)]

    # -- documented methods ----------------------------------------------------
    def write_kv(self, layer: int, pos: int, k_data: object, v_data: object) -> None:
        """Quantize and store ``num_kv_heads * head_dim`` key and value floats at ``pos`` of ``layer``.

        ``seq_len`` becomes ``max(seq_len, pos + 1)``; a position that joins the cache
        reads as zeros in every layer until written there. INT8/FP8 formats reject NaN
        and infinity (their scale would be lost).
        """
        layer = check_index("layer", layer, self.num_layers)
        pos = check_index("pos", pos, self._max_seq_len)
        k, v = (self._vector(name, x) for name, x in (("k_data", k_data), ("v_data", v_data)))
        held = self._seq.length
        self._hold(pos + 1)
        try:
            self._zero_stale(self._len, min(pos + 1, self._dirty))
            self._seq.write(layer, pos + self._offset, k, v)
        except BaseException:
            self._seq.truncate(held)  # the pages it took go back
            raise
        self._len = max(self._len, pos + 1)

    def read_k(self, layer: int, head: int, pos: int) -> np.ndarray:
        """The dequantized key of ``head`` at ``pos``: ``head_dim`` float32s."""
        pos = check_index("pos", pos, self._len)
        return self.read_k_range(layer, head, pos, pos + 1)

    def read_v(self, layer: int, head: int, pos: int) -> np.ndarray:
        """The dequantized value of ``head`` at ``pos``: ``head_dim`` float32s."""
        pos = check_index("pos", pos, self._len)
        return self.read_v_range(layer, head, pos, pos + 1)

    def read_k_range(self, layer: int, head: int, start_pos: int, end_pos: int) -> np.ndarray:
        """Dequantized keys of ``head`` at ``[start_pos, end_pos)``: flat ``(end - start) * head_dim`` float32s."""
        return self._read_range(0, layer, head, start_pos, end_pos)

    def read_v_range(self, layer: int, head: int, start_pos: int, end_pos: int) -> np.ndarray:
        """Dequantized values of ``head`` at ``[start_pos, end_pos)``: flat ``(end - start) * head_dim`` float32s."""
        return self._read_range(1, layer, head, start_pos, end_pos)

    def reset(self) -> None:
        """Empty the cache for a new sequence; every page goes back to the pool."""
        self._keep(0)
        self._len = self._dirty = 0

    def remaining_capacity(self) -> int:
        """Positions left before ``max_seq_len``."""
        return self._max_seq_len - self._len

    def is_full(self) -> bool:
        """Whether ``seq_len`` has reached ``max_seq_len``."""
        return self._len >= self._max_seq_len

    def memory_usage(self) -> int:
        """Bytes of the pages held (codes of K and V over all layers, plus their float32 scales).

        Counts whole pages actually held, not ``max_seq_len``; pages shared with a
        ``copy()`` count for each cache holding them.
        """
        return self._seq.nbytes

    def truncate(self, new_len: int) -> None:
        """Keep positions ``[0, min(new_len, seq_len))`` (never extends); whole pages past them go back."""
        new_len = check_int("new_len", new_len)
        if new_len < self._len:
            self._keep(new_len)
            self._dirty = min(max(self._dirty, self._len), self._capacity)
            self._len = new_len

    def shift_left(self, amount: int) -> None:
        """Drop the oldest ``amount`` positions (sliding window); position ``p`` becomes ``p - amount``.

        Whole leading pages go back to the pool and no data moves. ``amount >= seq_len``
        empties the cache; ``amount == 0`` changes nothing.
        """
        amount = check_int("amount", amount)
        if amount >= self._len:
            self.reset()
        elif amount:  # whole pages of dead slots go back; fewer than one page stay as the offset
            pages, self._offset = divmod(self._offset + amount, self._pool.block_size)
            self._seq.drop_front(pages)
            self._len -= amount
            self._dirty = max(self._dirty - amount, 0)

    # -- copying -------------------------------------------------------------------
    def copy(self) -> QuantizedKVCache:
        """An independent cache sharing this one's pages copy-on-write (no data copied)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._seq = self._seq.fork()
        return twin

    __copy__ = copy

    def __deepcopy__(self, memo: dict) -> QuantizedKVCache:
        """Same as :meth:`copy`: copy-on-write pages already behave as a deep copy."""
        return self.copy()

    def __repr__(self) -> str:
        return (f"QuantizedKVCache(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
                f"max_seq_len={self._max_seq_len}, head_dim={self.head_dim}, format={self._format.name}, "
                f"seq_len={self._len}, pages={self._seq.num_pages})")

    # -- internals -------------------------------------------------------------------
    @property
    def _capacity(self) -> int:
        """Logical positions the held pages can store."""
        return self._seq.length - self._offset

    def _hold(self, n: int) -> None:
        """Hold zeroed pages for logical positions ``[0, n)``; all or nothing."""
        if self._capacity < n:
            bs = self._pool.block_size
            extend_zeroed(self._seq, -(-(n - self._capacity) // bs) * bs)  # at a page boundary: fresh pages only

    def _keep(self, n: int) -> None:
        """Keep only the pages of logical positions ``[0, n)``; the offset goes with the last page."""
        bs = self._pool.block_size
        pages = -(-(self._offset + n) // bs) if n else 0
        self._seq.truncate(pages * bs)
        if not pages:
            self._offset = 0

    def _vector(self, name: str, x: object) -> torch.Tensor:
        """``x`` as float32 ``[1, H, D]`` on the pool's device; finite for scaled formats."""
        t = as_vector(name, x, self.num_kv_heads * self.head_dim, device=self._pool.storage.device)
        if self._format.scaled:
            check_finite(name, t)
        return t.view(1, self.num_kv_heads, self.head_dim)

    def _zero_stale(self, start: int, end: int) -> None:
        """Zero positions ``[start, end)`` of every layer (slots left from before a truncate).

        Fresh pages are zeroed when taken, so only the stale tail of a truncated
        cache needs this: at most one page, and only on the first write past it.
        """
        if end > start:
            zeros = torch.zeros(end - start, self.num_kv_heads, self.head_dim, device=self._pool.storage.device)
            for layer in range(self.num_layers):
                self._seq.write(layer, start + self._offset, zeros, zeros)

    def _read_range(self, which: int, layer: object, head: object, start: object, end: object) -> np.ndarray:
        """Dequantized K (``which=0``) or V (1) of one head over ``[start, end)``, flat float32."""
        layer = check_index("layer", layer, self.num_layers)
        head = check_index("head", head, self.num_kv_heads)
        end = check_int("end_pos", end, low=0, high=self._len)
        start = check_int("start_pos", start, low=0, high=end)
        pair = self._seq.read(layer, start + self._offset, end + self._offset, torch.float32)
        return to_numpy(pair[which][:, head].reshape(-1))  # [T, H, D] dequantized -> head's [T * D]

    def _raw(self, layer: int, which: int) -> tuple[np.ndarray, np.ndarray]:
        """Codes as bytes ``[H * max_seq_len * D * itemsize]`` and scales ``[H * max_seq_len]`` of one layer."""
        t, scale = self._pool.storage.layer(layer)[which::2]
        raw = t.view(torch.uint8)  # [N, B, H, D * itemsize]: fp8 has no indexing kernels everywhere
        slots = self._pool.storage.slots(self._seq.block_table(), self._offset, self._offset + self._len)
        heads, width = self.num_kv_heads, raw.shape[-1]
        data = torch.zeros(heads, self._max_seq_len, width, dtype=torch.uint8, device=t.device)
        data[:, : self._len] = raw.view(-1, heads, width)[slots].transpose(0, 1)  # [H, T, D * itemsize]
        scales = torch.zeros(heads, self._max_seq_len if scale is not None else 0, device=t.device)
        if scale is not None:
            scales[:, : self._len] = scale.view(-1, heads)[slots].transpose(0, 1)  # [H, T]
        return readonly(to_numpy(data.reshape(-1), np.uint8)), readonly(to_numpy(scales.reshape(-1)))

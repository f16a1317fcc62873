"""004: ``KVCache`` and ``KVCacheEntry``, the documented port of transformers' DynamicCache, on pages.

Tensors are shaped ``(batch, num_kv_heads, seq_len, head_dim)``. The first
``update`` of a layer sets it, later ones append along ``seq_len`` and return
the full ``(key, value)``, equal to ``torch.cat`` of every input so far
(exactly, unless the storage holds less than the inputs: a quantized ``dtype=``, or
a shared ``pool=`` of a narrower float dtype, which rounds them). Layers past the
current count are added on demand; ``seq_len()`` follows layer 0.

Storage: each batch row is one :class:`~paged_kv.compat.pool.PagedSeq`
covering every layer, so ``select_rows`` (beam-search reorder, repeat, select)
and ``copy()`` are block-table edits with copy-on-write, never tensor copies.
Layers are updated one after another, so a row reserves slots up to the
longest layer and each layer writes at its own length; positions a layer has
not written yet are never read. Adjacent rows given bitwise-equal K/V (beam
search's repeated prompt) keep sharing their pages. Pages held grow with the
tokens cached and return to the pool on ``clear``/``truncate``, and leading pages
on ``drop_front`` (a sliding window).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_kv.compat._common import make_pool
from paged_kv.compat.pool import KVPool, PagedSeq
from paged_kv.config import MAX_BLOCK_SIZE
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, SequenceStateError, check_int, describe
from paged_kv.kv_cache import KERNEL_DTYPES, RAW_DTYPES
from paged_kv.tensor_checks import check_device, check_shape

__all__ = ["KVCache", "KVCacheEntry"]

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
STORAGE_DTYPES = KERNEL_DTYPES + (torch.float64,)
MAX_LAYERS = 1 << 12
_WRITE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the write kernel takes
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size integer views, for bitwise equality


class KVCache:
    """A growing per-layer K/V cache of ``(batch, num_kv_heads, seq_len, head_dim)`` tensors, stored in pages."""

    def __init__(
        self,
        *,
        pool: KVPool | None = None,
        block_size: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if block_size is not None:
            check_int("block_size", block_size, low=1, high=MAX_BLOCK_SIZE)
        if dtype is not None and dtype not in STORAGE_DTYPES:
            raise InvalidArgumentError(describe("dtype", dtype, f"a storage dtype, one of {STORAGE_DTYPES}"))
        self._block_size, self._storage_dtype = block_size, dtype
        self._device = _as_device(device)
        self._owns_pool = pool is None  # a private pool may be rebuilt or given more layers
        self._pool = None if pool is None else _shared_pool(pool, block_size, device, dtype)
        self._rows: list[PagedSeq] = []  # one per batch row, all of one length
        self._lens: list[int | None] = []  # per layer: positions written, None = no entry yet
        self._dtype: torch.dtype | None = None  # dtype of the inputs (and outputs) while rows exist

    @classmethod
    def with_num_layers(cls, num_layers: int, **kwargs: object) -> KVCache:
        """A cache with ``num_layers`` empty layer slots (more are still added on demand)."""
        cache = cls(**kwargs)
        cache._lens = [None] * cache._check_layer("num_layers", num_layers, count=True)
        return cache

    # -- documented API ---------------------------------------------------
    def seq_len(self) -> int:
        """Positions cached in layer 0 (0 while layer 0 has no entry)."""
        return (self._lens[0] or 0) if self._lens else 0

    def is_empty(self) -> bool:
        """Whether layer 0 caches no position."""
        return self.seq_len() == 0

    def cache_position(self) -> int:
        """The next position to fill (for RoPE): ``seq_len()``."""
        return self.seq_len()

    def get(self, layer_idx: int) -> KVCacheEntry | None:
        """The entry of layer ``layer_idx`` (a live view), or None if that layer has none."""
        if isinstance(layer_idx, bool):
            raise InvalidArgumentError(describe("layer_idx", layer_idx, "an integer"))
        index = check_int("layer_idx", layer_idx, low=-(1 << 62))
        if not 0 <= index < len(self._lens) or self._lens[index] is None:
            return None
        return KVCacheEntry._view(self, index)

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Set (first update) or append to layer ``layer_idx``; return its full ``(key, value)``."""
        layer = self._check_layer("layer_idx", layer_idx)
        self._check_kv(key, value)
        start = (self._lens[layer] or 0) if layer < len(self._lens) else 0
        riders = self._riders(key, value, start)
        self._reserve(key, layer, start, riders)  # the last step that may raise
        self._write(layer, start, key, value, riders)
        self._lens[layer] = start + key.shape[2]
        return self._read(layer)

    def clear(self) -> None:
        """Drop every entry (the layer count stays); all pages return to the pool."""
        for row in self._rows:
            row.free()
        self._rows, self._dtype = [], None
        self._lens = [None] * len(self._lens)

    # -- paging extras ----------------------------------------------------
    def num_layers(self) -> int:
        """Layer slots (with or without an entry)."""
        return len(self._lens)

    def batch_size(self) -> int:
        """Rows cached (0 after ``clear`` or before the first update)."""
        return len(self._rows)

    def select_rows(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Make row ``j`` the current row ``indices[j]`` in every layer (beam-search reorder, repeat, select).

        Block-table edits only: a row picked once moves, one picked again is forked
        copy-on-write, one not picked returns its pages. ``len(indices)`` is the new batch.
        """
        picked = _check_indices(indices, len(self._rows))
        rows, used = [], set()
        for i in picked:
            rows.append(self._rows[i].fork() if i in used else self._rows[i])
            used.add(i)
        for i, row in enumerate(self._rows):
            if i not in used:
                row.free()
        self._rows = rows

    def truncate(self, new_len: int, layer_idx: int | None = None) -> None:
        """Keep the first ``new_len`` positions of every layer (or of one); never extends; pages past return."""
        new_len = check_int("new_len", new_len, low=0)
        layers = range(len(self._lens))
        if layer_idx is not None:
            layers = [self._check_layer("layer_idx", layer_idx, high=len(self._lens) - 1)]
        for i in layers:
            if self._lens[i] is not None:
                self._lens[i] = min(self._lens[i], new_len)
        keep = max((n for n in self._lens if n is not None), default=0)
        for row in self._rows:
            row.truncate(keep)

    def droppable_pages(self, keep_last: int = 0) -> int:
        """Leading pages whose positions all lie below every layer's length minus ``keep_last`` (0 without rows).

        With ``keep_last=0`` it is the most ``drop_front`` takes; a sliding window of
        ``w`` positions may drop ``droppable_pages(w)`` and keep every layer's last ``w``.
        """
        keep_last = check_int("keep_last", keep_last, low=0)
        if not self._rows:
            return 0
        return max(min(n or 0 for n in self._lens) - keep_last, 0) // self._pool.block_size

    def drop_front(self, num_pages: int) -> None:
        """Give back the first ``num_pages`` pages of every row (a sliding window); positions shift down.

        Position ``p`` of every layer becomes ``p - num_pages * block_size`` and each
        layer's length shrinks alike, so every layer must hold that many positions (a
        layer with no entry holds none): at most :meth:`droppable_pages`. Pages shared
        with a copy stay with it.
        """
        num_pages = check_int("num_pages", num_pages, low=0, high=self.droppable_pages())
        if not num_pages:
            return
        for row in self._rows:
            row.drop_front(num_pages)
        shift = num_pages * self._pool.block_size
        self._lens = [None if n is None else n - shift for n in self._lens]

    @property
    def num_pages(self) -> int:
        """Distinct pages the rows hold (pages shared between rows counted once)."""
        return len(set().union(*(row.block_table() for row in self._rows)))

    @property
    def nbytes(self) -> int:
        """Bytes of the pages actually held (every layer of a page, K and V, scales included)."""
        return 0 if self._pool is None else self.num_pages * self._pool.bytes_per_page

    @property
    def pool(self) -> KVPool | None:
        """The pool the pages come from (None before the first update of a private cache)."""
        return self._pool

    def copy(self) -> KVCache:
        """A copy sharing every page copy-on-write (O(pages)); the two diverge safely."""
        twin = object.__new__(KVCache)
        twin.__dict__.update(self.__dict__)
        twin._rows = [row.fork() for row in self._rows]
        twin._lens = list(self._lens)
        return twin

    def __copy__(self) -> KVCache:
        return self.copy()

    def __deepcopy__(self, memo: dict) -> KVCache:
        return self.copy()  # copy-on-write pages already give a copy independent of the original

    def __repr__(self) -> str:
        return f"KVCache(seq_len={self.seq_len()}, batch={len(self._rows)}, lens={self._lens}, pages={self.num_pages})"

    # -- checks (nothing is changed before all pass) ------------------------
    def _check_layer(self, name: str, value: object, *, count: bool = False, high: int | None = None) -> int:
        """A layer index (or count) within what this cache's pool can hold."""
        if isinstance(value, bool):
            raise InvalidArgumentError(describe(name, value, "an integer"))
        if high is None:
            high = self._pool.spec.num_layers if self._pool is not None and not self._owns_pool else MAX_LAYERS
            high -= 0 if count else 1
        return check_int(name, value, low=0, high=high)

    def _check_kv(self, key: object, value: object) -> None:
        """key/value: float tensors of one 4-D shape matching the cached batch, heads, head size and dtype."""
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(describe(name, type(t).__name__, "a torch.Tensor"))
            if t.dtype not in INPUT_DTYPES:
                raise InvalidArgumentError(describe(f"{name}.dtype", t.dtype, f"one of {INPUT_DTYPES}"))
        check_shape("key", key, self._expected_shape())
        if key.shape[0] == 0 or key.shape[1] == 0 or key.shape[3] == 0:
            raise InvalidArgumentError(describe("key.shape", list(key.shape), "batch, heads and head_dim >= 1"))
        check_shape("value", value, tuple(key.shape))
        want, owner = (self._dtype, "the cache") if self._rows else (key.dtype, "key")
        for name, t in (("key", key), ("value", value)):
            if t.dtype != want:
                raise InvalidArgumentError(describe(f"{name}.dtype", t.dtype, f"{want}, the dtype of {owner}"))

    def _expected_shape(self) -> tuple[int | None, ...]:
        """``[batch, heads, *, head_dim]`` as fixed by the rows and the pool (None = free)."""
        batch = len(self._rows) or None
        spec = self._pool.spec if self._pool is not None and (self._rows or not self._owns_pool) else None
        return (batch, spec and spec.num_kv_heads, None, spec and spec.head_dim)

    # -- storage ------------------------------------------------------------
    def _reserve(self, key: torch.Tensor, layer: int, start: int, riders: list[bool]) -> None:
        """Make sure pool, layer slot, rows and free pages exist for this write; raise before any change."""
        if self._pool is None or (self._owns_pool and not self._rows and not self._pool_fits(key)):
            pool = self._new_pool(key, max(layer + 1, len(self._lens)))
        else:
            pool = self._pool
        end = start + key.shape[2]
        pool.ensure_free(_pages_needed(pool, self._rows, riders, start, end))
        self._pool = pool
        if layer >= pool.spec.num_layers:
            pool.add_layers(layer + 1 - pool.spec.num_layers)
        self._lens += [None] * (layer + 1 - len(self._lens))
        if not self._rows:
            self._rows, self._dtype = _new_rows(pool, riders, end), key.dtype

    def _riders(self, key: torch.Tensor, value: torch.Tensor, start: int) -> list[bool]:
        """Rows whose write is the previous row's: equal new K/V into the same pages, which nobody else holds.

        Such runs (beam search's repeated prompt) keep sharing their pages: the
        first row of a run writes them in place, the others need no copy.
        """
        end, rows, batch = start + key.shape[2], self._rows, key.shape[0]
        if end == start or batch == 1 or (rows and end > rows[0].length):
            return [False] * batch
        tables = [row.block_table()[start // self._pool.block_size :] for row in rows]
        if rows and not any(a == b for a, b in zip(tables, tables[1:])):
            return [False] * batch
        riders = [False] + _adjacent_equal(key, value)
        if rows:
            refs = self._pool.manager.gpu.ref_counts
            riders = [r and tables[i] == tables[i - 1] for i, r in enumerate(riders)]
            for first, last in _runs(riders):
                if any(refs[b] != last + 1 - first for b in tables[first]):
                    riders[first + 1 : last + 1] = [False] * (last - first)
        return riders

    def _pool_fits(self, key: torch.Tensor) -> bool:
        """Whether the (idle, private) pool has the geometry of ``key``."""
        spec = self._pool.spec
        want = self._storage_dtype or key.dtype
        return (spec.num_kv_heads, spec.head_dim, spec.dtype) == (key.shape[1], key.shape[3], want)

    def _new_pool(self, key: torch.Tensor, num_layers: int) -> KVPool:
        """A private growable pool for ``key``'s heads, head size and dtype."""
        return make_pool(
            None, num_layers=num_layers, num_kv_heads=key.shape[1], head_dim=key.shape[3],
            dtype=self._storage_dtype or key.dtype, block_size=self._block_size, device=self._device or key.device,
        )

    def _write(self, layer: int, start: int, key: torch.Tensor, value: torch.Tensor, riders: list[bool]) -> None:
        """Write ``[start, start + T)`` of every row in one kernel call (copy-on-write first; riders ride along)."""
        end = start + key.shape[2]
        if end == start:
            return
        pool, rows = self._pool, self._rows
        for row in rows:
            if end > row.length:
                row.extend(end - row.length)
        in_run = _in_run(riders)
        owing = [row for row, run in zip(rows, in_run) if not run]
        pool.storage.copy_blocks([op for row in owing for op in pool.manager.prepare_write(row.seq_id, start, end)])
        writers = [i for i, rider in enumerate(riders) if not rider]
        slots = torch.cat([pool.storage.slots(rows[i].block_table(), start, end) for i in writers])  # [W*T]
        if len(writers) < len(rows):
            key, value = key[writers], value[writers]
        k, v = (self._flatten(t) for t in (key, value))  # [W*T, H, D]
        pool.storage.write(layer, k, v, slots)

    def _flatten(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, H, T, D)`` -> ``[B*T, H, D]`` on the pool's device, in a dtype the storage takes."""
        storage = self._pool.spec.dtype
        dtype = storage if storage in RAW_DTYPES else (t.dtype if t.dtype in _WRITE_DTYPES else torch.float32)
        t = t.detach().to(device=self._pool.storage.device, dtype=dtype)
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])

    def _read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer`` of every row as ``(B, H, n, D)`` tensors in the input dtype (one gather)."""
        n, batch, spec = self._lens[layer], len(self._rows), self._pool.spec
        tables = [row.block_table() for row in self._rows]  # equal lengths: rows have one length
        span = len(tables[0]) * spec.block_size
        flat = [b for table in tables for b in table]
        k, v = self._pool.storage.gather(layer, flat, 0, batch * span, self._dtype)  # [B*span, H, D]
        shape = (batch, span, spec.num_kv_heads, spec.head_dim)
        return tuple(t.view(shape)[:, :n].transpose(1, 2).contiguous() for t in (k, v))


class KVCacheEntry:
    """One layer's cached ``key`` and ``value``, ``(batch, num_kv_heads, seq_len, head_dim)``, stored in pages."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, **kwargs: object) -> None:
        cache = KVCache(**kwargs)
        cache.update(0, key, value)
        self._cache, self._layer = cache, 0

    @classmethod
    def _view(cls, cache: KVCache, layer: int) -> KVCacheEntry:
        """The entry of ``layer`` in ``cache``, reading and appending through it."""
        entry = object.__new__(cls)
        entry._cache, entry._layer = cache, layer
        return entry

    @property
    def key(self) -> torch.Tensor:
        """The cached keys ``(batch, num_kv_heads, seq_len, head_dim)`` (a fresh tensor)."""
        return self._kv()[0]

    @property
    def value(self) -> torch.Tensor:
        """The cached values ``(batch, num_kv_heads, seq_len, head_dim)`` (a fresh tensor)."""
        return self._kv()[1]

    def seq_len(self) -> int:
        """Positions cached (dim 2 of ``key``)."""
        return self._cache._lens[self._layer] or 0

    def update(self, new_key: torch.Tensor, new_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append along the sequence dimension; return the full ``(key, value)``."""
        return self._cache.update(self._layer, new_key, new_value)

    def copy(self) -> KVCacheEntry:
        """A copy sharing pages copy-on-write; the two diverge safely."""
        return KVCacheEntry._view(self._cache.copy(), self._layer)

    def __copy__(self) -> KVCacheEntry:
        return self.copy()

    def __deepcopy__(self, memo: dict) -> KVCacheEntry:
        return self.copy()

    def __repr__(self) -> str:
        return f"KVCacheEntry(layer={self._layer}, seq_len={self.seq_len()})"

    def _kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache._lens[self._layer] is None:
            raise SequenceStateError(describe("entry", self, "an entry of a layer that was not cleared since"))
        return self._cache._read(self._layer)


# -- helpers ------------------------------------------------------------------
def _as_device(device: object) -> torch.device | None:
    """``device`` as a torch.device (None stays None), or a typed error naming it."""
    return None if device is None else check_device("device", device)


def _shared_pool(pool: object, block_size: int | None, device: object, dtype: torch.dtype | None) -> KVPool:
    """Check a caller's pool against the keywords given alongside it."""
    if not isinstance(pool, KVPool):
        raise InvalidArgumentError(describe("pool", type(pool).__name__, "a KVPool or None"))
    spec = pool.spec
    if spec.dtype not in STORAGE_DTYPES:
        raise InvalidArgumentError(describe("pool.dtype", spec.dtype, f"one of {STORAGE_DTYPES}"))
    return make_pool(
        pool, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        dtype=dtype or spec.dtype, block_size=block_size, device=device,
    )


def _check_indices(indices: object, batch: int) -> list[int]:
    """A non-empty list of row indices, each in ``[0, batch)``."""
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1 or indices.is_floating_point() or indices.dtype == torch.bool:
            raise InvalidArgumentError(describe("indices", indices, "a 1-D integer tensor"))
        indices = indices.tolist()
    try:
        picked = list(indices)
    except TypeError:
        raise InvalidArgumentError(describe("indices", indices, "a sequence of row indices")) from None
    if not picked:
        raise InvalidArgumentError(describe("indices", picked, "at least one row index"))
    for i in picked:
        if isinstance(i, bool):
            raise InvalidArgumentError(describe("indices", i, "integers"))
        if batch == 0:
            raise OutOfRangeError(describe("indices", picked, "no index: the cache holds no rows"))
        check_int("indices", i, low=0, high=batch - 1)
    return [int(i) for i in picked]


def _pages_needed(pool: KVPool, rows: list[PagedSeq], riders: list[bool], start: int, end: int) -> int:
    """Exact count of free pages that writing ``[start, end)`` of every row takes: new pages plus CoW copies."""
    if not rows:
        return riders.count(False) * -(-end // pool.block_size)
    # a row in a run writes its run's pages in place, which it already holds
    writes = [(row.seq_id, start, end) for row, run in zip(rows, _in_run(riders)) if not run]
    return pool.manager.num_blocks_to_write_all(writes)


def _new_rows(pool: KVPool, riders: list[bool], end: int) -> list[PagedSeq]:
    """Fresh rows reserving ``end`` positions; a rider is a fork of the row before it (sharing its pages)."""
    rows: list[PagedSeq] = []
    for rider in riders:
        if rider:
            rows.append(rows[-1].fork())
        else:
            rows.append(pool.new_seq())
            rows[-1].extend(end)
    return rows


def _adjacent_equal(key: torch.Tensor, value: torch.Tensor) -> list[bool]:
    """``[i]``: whether rows ``i`` and ``i + 1`` have bitwise equal new keys and values (one device sync)."""
    bits = _BITS[key.element_size()]
    k, v = key.contiguous().view(bits), value.contiguous().view(bits)  # bitwise: -0.0 differs from 0.0
    same = (k[1:] == k[:-1]).flatten(1).all(1) & (v[1:] == v[:-1]).flatten(1).all(1)  # [B-1]
    return same.tolist()


def _runs(riders: list[bool]) -> list[tuple[int, int]]:
    """``(first, last)`` row of every run: a non-rider followed by the riders after it (length >= 2)."""
    runs, first = [], 0
    for i, rider in enumerate(riders + [False]):
        if not rider:
            if i - 1 > first:
                runs.append((first, i - 1))
            first = i
    return runs


def _in_run(riders: list[bool]) -> list[bool]:
    """Rows that belong to a run (its first row included): they write shared pages in place."""
    return [r or (i + 1 < len(riders) and riders[i + 1]) for i, r in enumerate(riders)]

"""Facade 002: a TurboQuant-style compressed multi-head KV cache on paged storage.

Every key and value vector is quantised on arrival by a
:class:`~paged_kv.compat.turboquant.TurboQuantizer` (rotation, Lloyd-Max codes,
QJL sketch of the residual: inner products are estimated without bias).
A token's record (packed codes, packed signs, norm, residual norm) is one uint8
row of a page in a :class:`~paged_kv.compat.pool.KVPool` (one layer, one
"head" of ``record_bytes``). Each head is one
:class:`~paged_kv.compat.pool.PagedSeq`: a sliding window gives whole leading
pages back with ``drop_front`` and ``copy()`` shares every page copy-on-write.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from paged_kv.compat._common import as_tensor, check_between, check_finite, make_pool, to_numpy
from paged_kv.compat.pool import KVPool, PagedSeq
from paged_kv.compat.turboquant import SEED_MODULUS, KvCacheConfig, TurboQuantizer
from paged_kv.errors import InvalidArgumentError, check_bool, check_int, describe
from paged_kv.tensor_checks import check_shape

MAX_HEADS = 4096  # head h of a multi-head cache is seeded (seed + h) mod 2**64


class DimensionMismatch(InvalidArgumentError):
    """A vector, or a list of per-head vectors, does not have the expected length."""


class NonFiniteInput(InvalidArgumentError):
    """An input vector holds NaN or infinity (after conversion to float32), or a stored one's norm overflows float32."""


def compressed_pool(
    config: KvCacheConfig, *, block_size: int = 16, num_blocks: int | None = None, device: str | torch.device = "cpu"
) -> KVPool:
    """A pool that compressors of ``config``'s geometry (any seed) can share; ``num_blocks=None`` grows."""
    config = _check_config(config)
    return KVPool(
        num_layers=1, num_kv_heads=1, head_dim=config.record_bytes, dtype=torch.uint8,
        block_size=block_size, num_blocks=num_blocks, device=device,
    )


# -- input conversion ----------------------------------------------------------
def _vector(name: str, x: object, dim: int, device: torch.device) -> torch.Tensor:
    """``x`` as a finite float32 vector ``[dim]`` on ``device``."""
    t = as_tensor(name, x, dtype=torch.float32, device=device)
    check_shape(name, t, (dim,), error=DimensionMismatch)
    check_finite(name, t, error=NonFiniteInput)
    return t


def _per_head(name: str, xs: object, count: int, dim: int, device: torch.device) -> torch.Tensor:
    """``count`` vectors of ``dim`` (a list of vectors or a 2-D array) as finite float32 ``[count, dim]``."""
    if isinstance(xs, (torch.Tensor, np.ndarray)):
        rows = as_tensor(name, xs, dtype=torch.float32, device=device)
        check_shape(name, rows, (count, dim), error=DimensionMismatch)
        check_finite(name, rows, error=NonFiniteInput)
        return rows
    if isinstance(xs, (str, bytes)) or not hasattr(xs, "__len__"):
        raise InvalidArgumentError(describe(name, type(xs).__name__, f"a list of {count} vectors"))
    if len(xs) != count:
        raise DimensionMismatch(describe(f"len({name})", len(xs), f"{count} (one vector per head)"))
    return torch.stack([_vector(f"{name}[{h}]", x, dim, device) for h, x in enumerate(xs)])


def _check_norms(names: list[tuple[str, str]], x: torch.Tensor, records: torch.Tensor, q: TurboQuantizer) -> None:
    """Raise unless every record of vectors ``x`` ``[H, 2, d]`` holds a finite norm and residual norm.

    A record keeps both as float32; a finite vector longer than float32's maximum (or whose
    quantisation residual is) would be stored as inf. ``names[h]`` names head ``h``'s key and value.
    """
    bad = (~torch.isfinite(q.norms(records))).any(-1).nonzero()  # [n, 2]: (head, key 0 / value 1)
    if len(bad):
        h, which = bad[0].tolist()
        norm = float(x[h, which].double().norm())
        most = torch.finfo(torch.float32).max
        raise NonFiniteInput(describe(
            names[h][which], f"a vector of norm {norm:.4g}", f"a norm (and residual norm) float32 holds, <= {most:.4g}"
        ))


def _scores_f32(products: torch.Tensor, head_dim: int) -> np.ndarray:
    """float64 estimates of ``q . k`` as float32 scores ``q . k / sqrt(head_dim)``.

    Scaled before the cast, so a score float32 holds is finite; one past float32's range (a key and
    query both near its limit) rounds to +-inf as IEEE overflow does, never NaN.
    """
    return to_numpy((products / math.sqrt(head_dim)).float())


# -- paged storage -------------------------------------------------------------
def _store(pool: KVPool, heads: list[KvCacheCompressor], records: torch.Tensor) -> None:
    """Append one token's records ``[H, 2, R]`` (key, value) to each of ``H`` heads: all of them or none."""
    pool.ensure_free(sum(head._seq.pages_to_append(1) for head in heads))  # raises before any change
    slots: list[int] = []
    try:
        for head in heads:
            slots.append(head._reserve())
        index = torch.tensor(slots, dtype=torch.int64, device=pool.storage.device)
        pool.storage.write(0, records[:, :1], records[:, 1:], index)  # [H, 1 kv-head, R] each, one scatter
    except BaseException:
        for head in heads[: len(slots)]:
            head._unreserve()
        raise


# -- the documented API --------------------------------------------------------
def _check_config(config: object) -> KvCacheConfig:
    """Return ``config`` if it is a KvCacheConfig, else raise naming it."""
    if not isinstance(config, KvCacheConfig):
        raise InvalidArgumentError(describe("config", type(config).__name__, "a KvCacheConfig"))
    return config


class KvCacheCompressor:
    """One attention head's keys and values, quantised on arrival and stored in pages of a pool."""

    def __init__(
        self,
        config: KvCacheConfig,
        *,
        pool: KVPool | None = None,
        block_size: int | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        self.config = _check_config(config)
        self.pool = make_pool(
            pool, num_layers=1, num_kv_heads=1, head_dim=config.record_bytes, dtype=torch.uint8,
            block_size=block_size, device=device,
        )
        self.quantizer = TurboQuantizer([config], self.pool.storage.device)
        self._seq = self.pool.new_seq()  # record i at position i + _skip
        self._skip = 0  # records evicted from the front of the first page, < block_size (0 when empty)

    @classmethod
    def _assemble(cls, config: KvCacheConfig, pool: KVPool, quantizer: TurboQuantizer, seq: PagedSeq, skip: int = 0):
        """A compressor from its parts (no checks): for copies and multi-head caches."""
        self = object.__new__(cls)
        self.config, self.pool, self.quantizer, self._seq, self._skip = config, pool, quantizer, seq, skip
        return self

    @property
    def device(self) -> torch.device:
        """Where the pages and the quantiser's matrices live."""
        return self.pool.storage.device

    def push(self, key: object, value: object) -> None:
        """Quantise and append one token's ``key`` and ``value`` (``head_dim`` floats each)."""
        d = self.config.head_dim
        kv = torch.stack([_vector("key", key, d, self.device), _vector("value", value, d, self.device)]).unsqueeze(0)
        records = self.quantizer.encode(kv)  # [1, 2, R]
        _check_norms([("key", "value")], kv, records, self.quantizer)
        _store(self.pool, [self], records)

    def len(self) -> int:
        """Number of (key, value) pairs stored."""
        return self._seq.length - self._skip

    def __len__(self) -> int:
        return self.len()

    def is_empty(self) -> bool:
        """Whether no pair is stored."""
        return self.len() == 0

    def attention_scores(self, query: object) -> np.ndarray:
        """Estimated ``q . k / sqrt(head_dim)`` for every cached key, oldest first (float32, no softmax)."""
        q = _vector("query", query, self.config.head_dim, self.device)
        if self.is_empty():
            return np.zeros(0, dtype=np.float32)
        scores = self.quantizer.inner_products(self._records(0).unsqueeze(0), q.unsqueeze(0))[0]  # float64
        return _scores_f32(scores, self.config.head_dim)

    def decode_keys(self, *, with_residual: bool = False) -> np.ndarray:
        """Approximate keys ``[len, head_dim]`` float32; ``with_residual`` adds the unbiased residual estimate."""
        check_bool("with_residual", with_residual)
        return to_numpy(self.quantizer.decode(self._records(0).unsqueeze(0), with_residual=with_residual)[0])

    def decode_values(self, *, with_residual: bool = False) -> np.ndarray:
        """Approximate values ``[len, head_dim]`` float32; ``with_residual`` as in :meth:`decode_keys`."""
        check_bool("with_residual", with_residual)
        return to_numpy(self.quantizer.decode(self._records(1).unsqueeze(0), with_residual=with_residual)[0])

    @property
    def num_pages(self) -> int:
        """Pages this head holds (pages shared with a copy count for both)."""
        return self._seq.num_pages

    @property
    def nbytes(self) -> int:
        """Bytes of the pages actually held (keys and values), not a preallocated maximum."""
        return self._seq.nbytes

    def compression_ratio(self) -> float:
        """Original float32 bytes of the stored keys and values / bytes of the pages held; 1.0 when empty."""
        if self.is_empty():
            return 1.0
        return 2 * self.len() * self.config.head_dim * 4 / self.nbytes

    def evict_outside_window(self, window_size: int) -> None:
        """Keep only the newest ``window_size`` pairs; pages left holding none go back to the pool."""
        window = check_int("window_size", window_size, low=0)
        if self.len() > window:
            pages, self._skip = divmod(self._skip + self.len() - window, self.pool.block_size)
            self._seq.drop_front(pages)
            if not window:
                self.clear()  # also the page of evicted records left behind

    def clear(self) -> None:
        """Drop every pair and give every page back."""
        self._seq.truncate(0)
        self._skip = 0

    def copy(self) -> KvCacheCompressor:
        """A clone sharing every page copy-on-write; the two diverge safely afterwards."""
        return KvCacheCompressor._assemble(self.config, self.pool, self.quantizer, self._seq.fork(), self._skip)

    def __copy__(self) -> KvCacheCompressor:
        return self.copy()

    def __deepcopy__(self, memo: dict) -> KvCacheCompressor:
        return self.copy()  # copy-on-write already makes the clone independent

    def _reserve(self) -> int:
        """Take one more record's slot and return its id; the caller made ``pages_to_append(1)`` pages free."""
        pos = self._seq.extend(1)  # copies a shared last page first (copy-on-write)
        bs = self.pool.block_size
        return self._seq.block_table()[pos // bs] * bs + pos % bs

    def _unreserve(self) -> None:
        """Give back the newest record's slot (undoes a ``_reserve``)."""
        self._seq.truncate(self._seq.length - 1)

    def _records(self, which: int) -> torch.Tensor:
        """Live key (0) or value (1) records, ``[len, R]`` uint8, oldest first."""
        slots = self.pool.storage.slots(self._seq.block_table(), self._skip, self._seq.length)
        cache = self.pool.storage.layer(0)[which]  # [N, B, 1, R]
        return cache.view(-1, cache.shape[-1])[slots]

    def __repr__(self) -> str:
        c = self.config
        return f"KvCacheCompressor(len={self.len()}, head_dim={c.head_dim}, bits={c.bits}, projections={c.projections})"


class MultiHeadKvCache:
    """Multi-head compressed KV cache: one :class:`KvCacheCompressor` per head (head ``h`` seeded ``seed + h``)."""

    def __init__(
        self,
        num_heads: int,
        config: KvCacheConfig,
        *,
        pool: KVPool | None = None,
        block_size: int | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        n = check_between("num_heads", num_heads, 1, MAX_HEADS)
        config = _check_config(config)
        self.config = config
        self.pool = make_pool(
            pool, num_layers=1, num_kv_heads=1, head_dim=config.record_bytes, dtype=torch.uint8,
            block_size=block_size, device=device,
        )
        configs = [replace(config, seed=(config.seed + h) % SEED_MODULUS) for h in range(n)]
        self.quantizer = TurboQuantizer(configs, self.pool.storage.device)  # all heads, batched
        self._heads = [
            KvCacheCompressor._assemble(c, self.pool, self.quantizer.head(h), self.pool.new_seq())
            for h, c in enumerate(configs)
        ]

    def push_token(self, keys: object, values: object) -> None:
        """Append one token: ``num_heads`` key and value vectors of ``head_dim``; all checked before any is stored."""
        h, d, dev = len(self._heads), self.config.head_dim, self.pool.storage.device
        k, v = _per_head("keys", keys, h, d, dev), _per_head("values", values, h, d, dev)  # [H, d] each
        kv = torch.stack([k, v], dim=1)  # [H, 2, d]
        records = self.quantizer.encode(kv)  # [H, 2, R]
        _check_norms([(f"keys[{i}]", f"values[{i}]") for i in range(h)], kv, records, self.quantizer)
        _store(self.pool, self._heads, records)

    def attention_scores(self, queries: object) -> list[np.ndarray]:
        """Per head, the estimated ``q . k / sqrt(head_dim)`` of every cached key (``num_heads`` queries)."""
        q = _per_head("queries", queries, len(self._heads), self.config.head_dim, self.pool.storage.device)
        if len({head.len() for head in self._heads}) > 1:  # heads evicted separately: one at a time
            return [head.attention_scores(q[i]) for i, head in enumerate(self._heads)]
        keys = torch.stack([head._records(0) for head in self._heads])  # [H, T, R]
        scores = self.quantizer.inner_products(keys, q)  # [H, T] float64
        return list(_scores_f32(scores, self.config.head_dim))

    def len(self) -> int:
        """Number of tokens stored (in head 0)."""
        return self._heads[0].len()

    def __len__(self) -> int:
        return self.len()

    def is_empty(self) -> bool:
        """Whether no token is stored."""
        return self.len() == 0

    def num_heads(self) -> int:
        """Number of heads."""
        return len(self._heads)

    def head(self, index: int) -> KvCacheCompressor | None:
        """Head ``index``'s compressor (the live one, not a copy), or None when out of range."""
        i = check_int("index", index, low=-(1 << 63))
        return self._heads[i] if 0 <= i < len(self._heads) else None

    def evict_outside_window(self, window_size: int) -> None:
        """Keep only the newest ``window_size`` tokens of every head."""
        window = check_int("window_size", window_size, low=0)
        for head in self._heads:
            head.evict_outside_window(window)

    @property
    def nbytes(self) -> int:
        """Bytes of the pages actually held by every head."""
        return sum(head.nbytes for head in self._heads)

    def compression_ratio(self) -> float:
        """Original float32 bytes of every head's keys and values / bytes of the pages held; 1.0 when empty."""
        if self.nbytes == 0:
            return 1.0
        return sum(2 * head.len() * self.config.head_dim * 4 for head in self._heads) / self.nbytes

    def clear(self) -> None:
        """Drop every token of every head and give the pages back."""
        for head in self._heads:
            head.clear()

    def copy(self) -> MultiHeadKvCache:
        """A clone sharing every page copy-on-write; the two diverge safely afterwards."""
        clone = object.__new__(MultiHeadKvCache)
        clone.config, clone.pool, clone.quantizer = self.config, self.pool, self.quantizer
        clone._heads = [head.copy() for head in self._heads]
        return clone

    def __copy__(self) -> MultiHeadKvCache:
        return self.copy()

    def __deepcopy__(self, memo: dict) -> MultiHeadKvCache:
        return self.copy()

    def __repr__(self) -> str:
        return f"MultiHeadKvCache(num_heads={self.num_heads()}, len={self.len()}, config={self.config})"

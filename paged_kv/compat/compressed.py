"""Facade 002: a TurboQuant-style compressed multi-head KV cache on paged storage.

Every key and value vector is quantised on arrival. Its norm is kept as a
float32; its direction is rotated by a seeded random orthogonal matrix, which
makes every coordinate follow one known law (that of a coordinate of a uniform
unit vector), and each rotated coordinate gets a ``bits``-bit Lloyd-Max code
for that law. The residual ``r`` left by the codes gets a QJL sketch: the
signs of ``S r`` for a seeded Gaussian ``S`` of ``projections`` rows, plus
``|r|``. An inner product is then estimated without bias::

    <q, k> ~ <q, k_codes> + |r| * sqrt(pi / 2) / projections * <S q, sign(S r)>

A token's record (packed codes, packed signs, norm, residual norm) is one uint8
row of a page in a :class:`~paged_kv.compat.pool.KVPool` (one layer, one
"head" of ``record_bytes``). Each head is one
:class:`~paged_kv.compat.pool.PagedSeq`: a sliding window gives whole leading
pages back with ``drop_front`` and ``copy()`` shares every page copy-on-write.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from paged_kv.compat._common import as_tensor, check_finite, check_shape, make_pool, to_numpy
from paged_kv.compat.pool import KVPool, PagedSeq
from paged_kv.errors import InvalidArgumentError, check_int, describe

MAX_HEAD_DIM = 4096
MAX_PROJECTIONS = 1 << 14
MAX_HEADS = 4096
SEED_MODULUS = 1 << 64  # seeds are u64; head h of a multi-head cache uses (seed + h) mod 2**64
_SIGMAS = 12.0  # rotated coordinates beyond 12 standard deviations carry < 1e-30 of the mass
_CHUNK = 1 << 22  # floats per decoded temporary (long caches are scored and decoded in slices)


class DimensionMismatch(InvalidArgumentError):
    """A vector, or a list of per-head vectors, does not have the expected length."""


class NonFiniteInput(InvalidArgumentError):
    """An input vector holds NaN or infinity (after conversion to float32)."""


def _check_between(name: str, value: object, low: int, high: int) -> int:
    """Return ``value`` as an int in ``[low, high]``, else raise InvalidArgumentError naming it."""
    v = check_int(name, value, low=low)
    if v > high:
        raise InvalidArgumentError(describe(name, value, f"an integer in [{low}, {high}]"))
    return v


@dataclass(frozen=True)
class KvCacheConfig:
    """The quantiser of one head, fully determined by ``(head_dim, bits, projections, seed)``."""

    head_dim: int
    bits: int  # bits per rotated coordinate, 1..=16
    projections: int  # rows of the QJL sign sketch of the residual, >= 1
    seed: int  # u64: seeds the rotation and the sketch

    def __post_init__(self) -> None:
        for name, low, high in (
            ("head_dim", 1, MAX_HEAD_DIM), ("bits", 1, 16),
            ("projections", 1, MAX_PROJECTIONS), ("seed", 0, SEED_MODULUS - 1),
        ):
            object.__setattr__(self, name, _check_between(name, getattr(self, name), low, high))

    @property
    def code_bytes(self) -> int:
        """Bytes of one vector's packed coordinate codes."""
        return -(-self.head_dim * self.bits // 8)

    @property
    def sign_bytes(self) -> int:
        """Bytes of one vector's packed QJL signs."""
        return -(-self.projections // 8)

    @property
    def record_bytes(self) -> int:
        """Bytes of one vector's record: codes, signs, then norm and residual norm (float32 each)."""
        return self.code_bytes + self.sign_bytes + 8


def compressed_pool(
    config: KvCacheConfig, *, block_size: int = 16, num_blocks: int | None = None, device: str | torch.device = "cpu"
) -> KVPool:
    """A pool that compressors of ``config``'s geometry (any seed) can share; ``num_blocks=None`` grows."""
    return KVPool(
        num_layers=1, num_kv_heads=1, head_dim=config.record_bytes, dtype=torch.uint8,
        block_size=block_size, num_blocks=num_blocks, device=device,
    )


# -- bit packing ---------------------------------------------------------------
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` ``[T, n]`` (ints below ``2**bits``) into ``[T, ceil(n * bits / 8)]`` uint8, LSB first."""
    t, n = codes.shape
    shifts = torch.arange(bits, device=codes.device)
    stream = ((codes.long().unsqueeze(-1) >> shifts) & 1).reshape(t, n * bits)  # code i owns bits [i*bits, ...)
    stream = F.pad(stream, (0, -(n * bits) % 8)).view(t, -1, 8)
    return (stream << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``[T, B]`` uint8 -> ``[T, n]`` int32 codes."""
    if 8 % bits == 0:  # 1, 2, 4, 8: codes never straddle a byte
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [T, B, 8 // bits]
        return codes.view(packed.shape[0], -1)[:, :n].to(torch.int32)
    if bits == 16:
        pairs = packed.view(packed.shape[0], -1, 2).to(torch.int32)  # [T, n, 2], little end first
        return pairs[..., 0] | (pairs[..., 1] << 8)
    start = torch.arange(n, device=packed.device) * bits  # first bit of each code
    span = (start // 8).unsqueeze(1) + torch.arange(3, device=packed.device)  # [n, 3]: a code spans <= 3 bytes
    window = F.pad(packed, (0, 2)).to(torch.int32)[:, span]  # [T, n, 3]
    word = window[..., 0] | (window[..., 1] << 8) | (window[..., 2] << 16)
    return (word >> (start % 8).to(torch.int32)) & ((1 << bits) - 1)


def _float_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[N, k]`` floats as ``[N, 4k]`` uint8 (float32, native byte order)."""
    return x.to(torch.float32).contiguous().view(torch.uint8)


def _bytes_float(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_float_bytes`: ``[N, 4k]`` uint8 -> ``[N, k]`` float32."""
    return b.clone(memory_format=torch.contiguous_format).view(torch.float32)  # fresh: 4-byte aligned


# -- the scalar codebook -------------------------------------------------------
def _coordinate_law(dim: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid points and probabilities of one coordinate of a uniform random unit vector in R^dim."""
    if dim == 1:
        return torch.tensor([-1.0, 1.0], dtype=torch.float64), torch.tensor([0.5, 0.5], dtype=torch.float64)
    theta_max = math.asin(min(1.0, _SIGMAS / math.sqrt(dim)))
    theta = (torch.arange(n, dtype=torch.float64) + 0.5) / n * (2 * theta_max) - theta_max
    log_w = (dim - 2) * torch.log(torch.cos(theta))  # t = sin(theta) has density ~ cos(theta)^(dim - 2)
    w = torch.exp(log_w - log_w.max())
    return torch.sin(theta), w / w.sum()


@functools.lru_cache(maxsize=64)
def lloyd_max_codebook(dim: int, bits: int) -> torch.Tensor:
    """The ``2**bits`` sorted levels minimising the MSE of one rotated unit-vector coordinate (float64)."""
    levels = 1 << bits
    t, w = _coordinate_law(dim, max(1 << 15, 16 * levels))
    cdf = torch.cumsum(w.pow(1 / 3), 0)  # high-resolution optimum: level density ~ pdf^(1/3)
    quantiles = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    c = t[torch.searchsorted(cdf / cdf[-1], quantiles).clamp(max=t.numel() - 1)]
    for _ in range(60 if bits <= 6 else 8 if bits <= 10 else 2):  # Lloyd: cells by nearest level, levels to cell means
        cell = torch.bucketize(t, (c[1:] + c[:-1]) / 2)
        mass = torch.bincount(cell, weights=w, minlength=levels)
        mean = torch.bincount(cell, weights=w * t, minlength=levels) / mass.clamp_min(1e-300)
        c, old = torch.where(mass > 0, mean, c).sort().values, c
        if float((c - old).abs().max()) < 1e-12:
            break
    return c


def _head_matrices(config: KvCacheConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded Haar rotation ``[d, d]`` and QJL matrix ``[m, d]`` of one head (float64, CPU draws)."""
    d, m = config.head_dim, config.projections
    gen = torch.Generator().manual_seed(config.seed)  # drawn on the CPU: the same matrices on every device
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    rotation = q * torch.sign(torch.diagonal(r))  # fixing QR's arbitrary signs makes it Haar
    return rotation, torch.randn(m, d, generator=gen, dtype=torch.float64)


class TurboQuantizer:
    """The quantisers of H heads of one geometry (a rotation and a sketch each): encode, score, decode."""

    def __init__(self, configs: list[KvCacheConfig], device: str | torch.device = "cpu") -> None:
        cfg = configs[0]
        if any(replace(c, seed=0) != replace(cfg, seed=0) for c in configs):
            raise InvalidArgumentError(describe("configs", configs, "one head_dim, bits and projections"))
        self.configs, self.config = list(configs), cfg
        rotations, sketches = zip(*map(_head_matrices, configs))
        self.rotation = torch.stack(rotations).to(device, torch.float32)  # [H, d, d]: y = R x
        self.sketch = torch.stack(sketches).to(device, torch.float32)  # S: [H, m, d]
        levels = lloyd_max_codebook(cfg.head_dim, cfg.bits)
        self.levels = levels.to(device, torch.float32)  # [2**bits]
        self.bounds = ((levels[1:] + levels[:-1]) / 2).to(device, torch.float32)  # [2**bits - 1]
        self.qjl_scale = math.sqrt(math.pi / 2) / cfg.projections

    def head(self, h: int) -> TurboQuantizer:
        """Head ``h``'s quantiser (its matrices are views, not copies)."""
        one = object.__new__(TurboQuantizer)
        one.__dict__.update(self.__dict__)
        one.configs, one.config = [self.configs[h]], self.configs[h]
        one.rotation, one.sketch = self.rotation[h : h + 1], self.sketch[h : h + 1]
        return one

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Records ``[H, T, record_bytes]`` uint8 of vectors ``x`` ``[H, T, head_dim]``."""
        norm = x.double().norm(dim=-1, keepdim=True)  # [H, T, 1]; float64: large finite inputs do not overflow
        y = (x.double() / norm.clamp_min(1e-300)).float() @ self.rotation.mT  # [H, T, d] rotated direction
        codes = torch.bucketize(y, self.bounds)  # [H, T, d] nearest level
        resid = norm.float() * (y - self.levels[codes])  # [H, T, d] rotated residual
        signs = (resid @ self.sketch.mT) >= 0  # [H, T, m]
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731  [H * T, k]
        norms = torch.cat([norm.float(), resid.norm(dim=-1, keepdim=True)], dim=-1)  # [H, T, 2]
        parts = (pack_bits(flat(codes), self.config.bits), pack_bits(flat(signs), 1), _float_bytes(flat(norms)))
        return torch.cat(parts, dim=1).view(*x.shape[:2], -1)

    def _chunks(self, records: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Records ``[H, T, R]`` in token slices whose decoded temporaries stay near ``_CHUNK`` floats."""
        per_token = records.shape[0] * max(self.config.head_dim, self.config.projections)
        return records.split(max(1, _CHUNK // per_token), dim=1) if records.shape[1] else ()

    def _fields(self, rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Records ``[H, T, R]`` -> unit-norm levels ``[H, T, d]``, signs ``[H, T, m]`` (+-1), norms ``[H, T, 2]``."""
        cfg = self.config
        cb, sb = cfg.code_bytes, cfg.sign_bytes
        h, t = rec.shape[:2]
        flat = rec.reshape(h * t, -1)
        codes = unpack_bits(flat[:, :cb], cfg.head_dim, cfg.bits).view(-1)
        levels = self.levels.index_select(0, codes).view(h, t, -1)  # int32 indices are fine here
        signs = unpack_bits(flat[:, cb : cb + sb], cfg.projections, 1).view(h, t, -1).float() * 2 - 1
        return levels, signs, _bytes_float(flat[:, cb + sb :]).view(h, t, 2)

    def inner_products(self, records: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """Unbiased estimates ``[H, T]`` of ``<k, q>`` from key records ``[H, T, R]``, queries ``[H, d]``."""
        # Row-wise sums, not matmuls: a score does not depend on how many keys or heads share the call.
        q_rot = (self.rotation * queries.unsqueeze(1)).sum(-1)  # [H, d]: rotate the query, not every key back
        s_q = (self.sketch * q_rot.unsqueeze(1)).sum(-1)  # [H, m]
        out = []
        for rec in self._chunks(records):
            levels, signs, norms = self._fields(rec)
            main = (levels * q_rot.unsqueeze(1)).sum(-1)  # [H, t]
            qjl = (signs * s_q.unsqueeze(1)).sum(-1)  # [H, t]
            out.append(norms[..., 0] * main + norms[..., 1] * self.qjl_scale * qjl)
        return torch.cat(out, dim=1) if out else queries.new_zeros(queries.shape[0], 0)

    def decode(self, records: torch.Tensor, *, with_residual: bool = False) -> torch.Tensor:
        """Vectors ``[H, T, d]`` from records ``[H, T, R]``; ``with_residual`` adds the sketch's residual estimate."""
        out = []
        for rec in self._chunks(records):
            levels, signs, norms = self._fields(rec)
            y = norms[..., :1] * levels  # [H, t, d] in the rotated basis
            if with_residual:  # E[S^T sign(S r)] = sqrt(2 / pi) * m * r / |r|
                y = y + norms[..., 1:] * self.qjl_scale * (signs @ self.sketch)
            out.append(y @ self.rotation)  # back to the original basis
        h, d = records.shape[0], self.config.head_dim
        return torch.cat(out, dim=1) if out else torch.zeros(h, 0, d, device=records.device)


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
        kv = torch.stack([_vector("key", key, d, self.device), _vector("value", value, d, self.device)])
        _store(self.pool, [self], self.quantizer.encode(kv.unsqueeze(0)))  # records: [1, 2, R]

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
        scores = self.quantizer.inner_products(self._records(0).unsqueeze(0), q.unsqueeze(0))[0]
        return to_numpy(scores / math.sqrt(self.config.head_dim))

    def decode_keys(self, *, with_residual: bool = False) -> np.ndarray:
        """Approximate keys ``[len, head_dim]`` float32; ``with_residual`` adds the unbiased residual estimate."""
        return to_numpy(self.quantizer.decode(self._records(0).unsqueeze(0), with_residual=with_residual)[0])

    def decode_values(self, *, with_residual: bool = False) -> np.ndarray:
        """Approximate values ``[len, head_dim]`` float32; ``with_residual`` as in :meth:`decode_keys`."""
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
        n = _check_between("num_heads", num_heads, 1, MAX_HEADS)
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
        records = self.quantizer.encode(torch.stack([k, v], dim=1))  # [H, 2, R]
        _store(self.pool, self._heads, records)

    def attention_scores(self, queries: object) -> list[np.ndarray]:
        """Per head, the estimated ``q . k / sqrt(head_dim)`` of every cached key (``num_heads`` queries)."""
        q = _per_head("queries", queries, len(self._heads), self.config.head_dim, self.pool.storage.device)
        if len({head.len() for head in self._heads}) > 1:  # heads evicted separately: one at a time
            return [head.attention_scores(q[i]) for i, head in enumerate(self._heads)]
        keys = torch.stack([head._records(0) for head in self._heads])  # [H, T, R]
        scores = self.quantizer.inner_products(keys, q) / math.sqrt(self.config.head_dim)  # [H, T]
        return list(to_numpy(scores))

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

"""TurboQuant-style vector quantiser: random rotation, Lloyd-Max codes, QJL residual sketch.

A vector's norm is kept as a float32; its direction is rotated by a seeded
random orthogonal matrix, which makes every coordinate follow one known law
(that of a coordinate of a uniform unit vector), and each rotated coordinate
gets a ``bits``-bit Lloyd-Max code for that law. The residual ``r`` left by the
codes gets a QJL sketch: the signs of ``S r`` for a seeded Gaussian ``S`` of
``projections`` rows, plus ``|r|``. An inner product is then estimated without
bias::

    <q, k> ~ <q, k_codes> + |r| * sqrt(pi / 2) / projections * <S q, sign(S r)>

A vector's record is ``record_bytes`` uint8: packed codes, packed signs, then
the norm and the residual norm as float32 (computed in float64, so any finite
input whose norms float32 holds is recorded; the facade refuses the others).
Used by facade 002 (:mod:`paged_kv.compat.compressed`), which stores records in pages.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from paged_kv.compat._common import check_between

# The public name is the quantiser's configuration; the quantiser and its bit packing are the
# compressed facade's machinery, called only with inputs the facade has already checked.
__all__ = ["KvCacheConfig"]
from paged_kv.errors import InvalidArgumentError, describe

MAX_HEAD_DIM = 4096
MAX_PROJECTIONS = 1 << 14
SEED_MODULUS = 1 << 64  # seeds are u64
_SIGMAS = 12.0  # rotated coordinates beyond 12 standard deviations carry < 1e-30 of the mass
_CHUNK = 1 << 22  # floats per decoded temporary (long caches are scored and decoded in slices)


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
            object.__setattr__(self, name, check_between(name, getattr(self, name), low, high))

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
        """Records ``[H, T, record_bytes]`` uint8 of vectors ``x`` ``[H, T, head_dim]``.

        A norm or residual norm past float32's range is stored as inf: the facades refuse such
        vectors (see :meth:`norms`) before storing their records.
        """
        norm = x.double().norm(dim=-1, keepdim=True)  # [H, T, 1]; float64: large finite inputs do not overflow
        y = (x.double() / norm.clamp_min(1e-300)).float() @ self.rotation.mT  # [H, T, d] rotated direction
        codes = torch.bucketize(y, self.bounds)  # [H, T, d] nearest level
        unit = y - self.levels[codes]  # [H, T, d] rotated residual / norm: the residual's direction, never overflows
        signs = (unit @ self.sketch.mT) >= 0  # [H, T, m]: sign(S r) = sign(S r / norm)
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731  [H * T, k]
        norms = torch.cat([norm, norm * unit.double().norm(dim=-1, keepdim=True)], dim=-1)  # [H, T, 2] float64
        parts = (pack_bits(flat(codes), self.config.bits), pack_bits(flat(signs), 1), _float_bytes(flat(norms)))
        return torch.cat(parts, dim=1).view(*x.shape[:2], -1)

    def norms(self, records: torch.Tensor) -> torch.Tensor:
        """The norms and residual norms ``[H, T, 2]`` float32 that records ``[H, T, R]`` hold."""
        tail = self.config.code_bytes + self.config.sign_bytes
        return _bytes_float(records[..., tail:].reshape(-1, 8)).view(*records.shape[:2], 2)

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
        return levels, signs, self.norms(rec)

    def inner_products(self, records: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """Unbiased estimates ``[H, T]`` float64 of ``<k, q>`` from key records ``[H, T, R]``, queries ``[H, d]``."""
        # Row-wise sums, not matmuls: a score does not depend on how many keys or heads share the call.
        # float64 throughout: a float32 query's rotation, sketch and products with a key's float32 norms
        # cannot overflow, so finite inputs give finite estimates (float32 overflowed to inf, then NaN).
        q_rot = (self.rotation.double() * queries.double().unsqueeze(1)).sum(-1)  # [H, d]: rotate q, not every key
        s_q = (self.sketch.double() * q_rot.unsqueeze(1)).sum(-1)  # [H, m]
        out = []
        for rec in self._chunks(records):
            levels, signs, norms = self._fields(rec)
            main = (levels.double() * q_rot.unsqueeze(1)).sum(-1)  # [H, t]
            qjl = (signs.double() * s_q.unsqueeze(1)).sum(-1)  # [H, t]
            out.append(norms[..., 0].double() * main + norms[..., 1].double() * self.qjl_scale * qjl)
        return torch.cat(out, dim=1) if out else queries.new_zeros(queries.shape[0], 0, dtype=torch.float64)

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

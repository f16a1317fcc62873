"""Input checks of the paged attention wrappers (decode and prefill), run before any launch.

Paged attention reads K/V through block tables: an out-of-range block id in a table entry
that is read would read wild memory, so the ids actually in use (those covering positions
``[window_start, seq_len)``) are bounded here. Entries outside that range are padding and
are never read, so they are never checked. The bounds come back as device scalars, and
each wrapper syncs them together with its own values in one host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels._checks import check_cache_pair, check_scales
from paged_kv.tensor_checks import FLOAT_DTYPES, INDEX_DTYPES, check_shape, check_tensor
from kernels.attention_metadata import AttentionMetadata, check_metadata
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, check_int, describe

MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class CacheGeometry:
    """Sizes of a validated paged KV cache ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    quantized: bool


def check_cache(q, k_cache, v_cache, k_scale, v_scale) -> CacheGeometry:
    """Validate q ``[N, Hq, D]``, the K/V caches and their scales; return the cache geometry."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_cache_pair(k_cache, v_cache, q.device)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if num_blocks < 1 or block_size < 1 or num_kv_heads < 1 or not 1 <= head_dim <= MAX_HEAD_DIM:
        raise InvalidArgumentError(
            describe("k_cache.shape", tuple(k_cache.shape), f"non-empty, head_dim <= {MAX_HEAD_DIM}")
        )
    if q.shape[2] != head_dim:
        raise InvalidArgumentError(describe("q.shape[2]", q.shape[2], f"head_dim {head_dim} of the cache"))
    if q.shape[1] % num_kv_heads != 0 or q.shape[1] == 0:
        raise InvalidArgumentError(describe("q.shape[1]", q.shape[1], f"a positive multiple of {num_kv_heads}"))
    quantized = check_scales(k_scale, v_scale, k_cache, q.device)
    return CacheGeometry(
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        quantized=quantized,
    )


def _check_real(name: str, value: object, *, positive: bool) -> float:
    """Return ``value`` as a finite float (> 0 when ``positive``) or raise InvalidArgumentError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(describe(name, value, "a finite real number"))
    if positive and value <= 0:
        raise InvalidArgumentError(describe(name, value, "a number > 0"))
    return float(value)


def check_options(head_dim: int, scale, sliding_window, soft_cap) -> tuple[float, int | None, float | None]:
    """Validate the attention options; resolve ``scale=None`` to ``1/sqrt(head_dim)``."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _check_real("scale", scale, positive=False)
    if sliding_window is not None:
        sliding_window = check_int("sliding_window", sliding_window, low=1)
    if soft_cap is not None:
        soft_cap = _check_real("soft_cap", soft_cap, positive=True)
    return scale, sliding_window, soft_cap


def check_tables(block_tables, seq_lens, num_seqs: int, device: torch.device) -> None:
    """Validate the dtypes and shapes of block_tables ``[num_seqs, max_blocks]`` and seq_lens ``[num_seqs]``."""
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    if block_tables.shape[0] != num_seqs:
        raise InvalidArgumentError(describe("block_tables.shape[0]", block_tables.shape[0], f"num_seqs={num_seqs}"))


def window_start(seq_lens: torch.Tensor, sliding_window: int | None, q_lens: torch.Tensor | None = None):
    """First KV position any query of each sequence attends to: ``[S]`` int64."""
    lens = seq_lens.long()
    if sliding_window is None:
        return torch.zeros_like(lens)
    first_q = lens - 1 if q_lens is None else lens - q_lens.long()
    return (first_q - sliding_window + 1).clamp(min=0)


def block_id_bounds(block_tables, seq_lens, kv_start, block_size: int) -> list[torch.Tensor]:
    """Device scalars [min, max] of the block ids covering positions [kv_start, seq_len) (no sync).

    With no block in use the pair is (int64 max, -1), which every range check accepts.
    """
    big = torch.iinfo(torch.int64).max
    if block_tables.numel() == 0:
        return [torch.tensor(big, device=block_tables.device), torch.tensor(-1, device=block_tables.device)]
    logical = torch.arange(block_tables.shape[1], device=block_tables.device)  # [max_blocks]
    first = (kv_start // block_size)[:, None]
    last = ((seq_lens - 1).div(block_size, rounding_mode="floor"))[:, None]
    used = (logical[None, :] >= first) & (logical[None, :] <= last)  # [S, max_blocks]
    ids = block_tables.long()
    return [torch.where(used, ids, big).min(), torch.where(used, ids, -1).max()]


def check_block_ids(lo: int, hi: int, num_blocks: int) -> None:
    """Raise OutOfRangeError unless every block id in use lies in ``[0, num_blocks)``."""
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise OutOfRangeError(describe("block_tables", bad, f"block ids in [0, {num_blocks}) where used"))


def check_prepared(
    q, k_cache, v_cache, meta: AttentionMetadata, k_scale, v_scale, scale, sliding_window, soft_cap
) -> tuple[CacheGeometry, tuple[float, int | None, float | None]]:
    """The host-only checks of a prepared attention call: cache, options, metadata; returns (geometry, options)."""
    geo = check_cache(q, k_cache, v_cache, k_scale, v_scale)
    opts = check_options(geo.head_dim, scale, sliding_window, soft_cap)
    check_metadata(meta, num_blocks=geo.num_blocks, block_size=geo.block_size, device=q.device)
    return geo, opts

"""Host checks of the kernel wrappers, run before any launch, and the Triton/torch backend choice.

Every wrapper validates shapes, dtypes, devices and index ranges before it launches anything:
the generic tensor checks live in :mod:`paged_kv.tensor_checks`; the K/V cache pair, scales,
geometry, options and block tables are checked here. Paged attention reads K/V through block
tables, and an out-of-range block id in an entry that is read would read wild memory, so the
ids actually in use (those covering positions ``[window_start, seq_len)``) are bounded here;
entries outside that range are padding, never read, never checked. The bounds come back as
device scalars, and each checked wrapper syncs them with its own values in one host sync.

A prepared call (one step's :mod:`kernels.metadata`) reads no device value; :class:`BoundCall`
holds one checked once for a step, which the step's other layers run without the checks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from paged_kv.errors import InvalidArgumentError, OutOfRangeError, check_int, check_real, describe
from paged_kv.tensor_checks import CACHE_DTYPES, FLOAT_DTYPES, INDEX_DTYPES, QUANT_DTYPES, check_shape, check_tensor

Backend = Literal["auto", "triton", "torch"]
Options = tuple[float, int | None, float | None]  # (scale, sliding_window, soft_cap), checked
MAX_HEAD_DIM = 256


def use_triton(backend: Backend, *tensors: torch.Tensor) -> bool:
    """Pick the Triton path: 'auto' means CUDA tensors run Triton, CPU tensors run torch."""
    if backend not in ("auto", "triton", "torch"):
        raise InvalidArgumentError(describe("backend", backend, "'auto', 'triton' or 'torch'"))
    if backend == "auto":
        return all(t.is_cuda for t in tensors)
    return backend == "triton"


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Triton needs CUDA tensors, or the interpreter (TRITON_INTERPRET=1) for CPU tensors."""
    if all(t.is_cuda for t in tensors) or os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise InvalidArgumentError(describe("backend", "triton", "CUDA tensors (or TRITON_INTERPRET=1 on CPU)"))


def launches_triton(backend: Backend, q: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether an attention call over q's rows runs Triton (:func:`use_triton`); device-checked when it launches."""
    run_triton = use_triton(backend, q, *tensors)
    if q.shape[0] and run_triton:
        check_triton_device(q)
    return run_triton


def check_cache_pair(k_cache: object, v_cache: object, device: torch.device | None = None) -> None:
    """Check K/V caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` of one cache dtype and one shape."""
    check_tensor("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES, device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))


def check_scales(k_scale: object, v_scale: object, k_cache: torch.Tensor, device: torch.device | None = None) -> bool:
    """Check the scales: float32 ``[num_blocks, block_size, num_kv_heads]`` for a quantized cache, else None.

    Returns whether the cache is quantized.
    """
    quantized = k_cache.dtype in QUANT_DTYPES
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not quantized:
            if scale is not None:
                raise InvalidArgumentError(describe(name, "a tensor", f"None for a {k_cache.dtype} cache"))
            continue
        if scale is None:
            raise InvalidArgumentError(describe(name, None, f"a float32 scale tensor for a {k_cache.dtype} cache"))
        check_tensor(name, scale, ndim=3, dtypes=(torch.float32,), device=device)
        check_shape(name, scale, tuple(k_cache.shape[:3]))
    return quantized


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
    return CacheGeometry(num_blocks, block_size, num_kv_heads, head_dim, quantized)


def check_options(head_dim: int, scale, sliding_window, soft_cap) -> Options:
    """Validate the attention options; resolve ``scale=None`` to ``1/sqrt(head_dim)``."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_real("scale", scale)
    if sliding_window is not None:
        sliding_window = check_int("sliding_window", sliding_window, low=1)
    if soft_cap is not None:
        soft_cap = check_real("soft_cap", soft_cap, low=0.0, open_low=True)
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


def layer_signature(*tensors: torch.Tensor | None) -> tuple:
    """What a layer's call must share with the checked one: each tensor's shape, strides, dtype and device."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors)


class BoundCall:
    """A prepared kernel call checked once, on one layer of a step; the step's other layers run it unchecked.

    Every layer of a paged cache has one geometry, and each layer's queries (or new K/V) one shape:
    a call whose tensors have the checked shapes, strides, dtypes and devices (an O(1) comparison of
    host values) runs the launch as checked; any other raises InvalidArgumentError before it.
    """

    def __init__(self, run: Callable[..., Any], *checked: torch.Tensor | None) -> None:
        self.run = run  # run(*tensors): the launch, with the metadata, geometry and options bound
        self._checked, self._signature = checked, None  # the signature is taken when a layer is first run

    def __call__(self, *tensors: torch.Tensor | None) -> Any:
        """Run the call on one layer's tensors, given in the order they were checked in."""
        if self._signature is None:
            self._signature, self._checked = layer_signature(*self._checked), ()
        if layer_signature(*tensors) != self._signature:
            got = [None if t is None else tuple(t.shape) for t in tensors]
            raise InvalidArgumentError(describe("tensors", got, "the shapes, strides, dtypes and devices bound to"))
        return self.run(*tensors)

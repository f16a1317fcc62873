"""Paged KV storage: the device tensors the kernels read and write.

Layout (the one every kernel reads), per layer::

    k, v:             [num_blocks, block_size, num_kv_heads, head_dim]   storage dtype
    k_scale, v_scale: [num_blocks, block_size, num_kv_heads]             float32, quantized only

A token at logical position ``p`` of a sequence with block table ``t`` lives
in slot ``t[p // block_size] * block_size + p % block_size``. Storage dtypes
are any float dtype, or int8 / float8_e4m3fn / float8_e5m2 with one float32
scale per (token, head) (dequantized value = code * scale).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from kernels.block_copy import copy_blocks, swap_blocks
from kernels.cache_write import check_slots, write_kv
from kernels.quant import is_quantized
from paged_kv.config import MAX_BLOCK_SIZE, MAX_BLOCKS
from paged_kv.errors import InvalidArgumentError, check_bool, check_int, check_type, describe
from paged_kv.tensor_checks import INDEX_DTYPES, check_device, check_dtype, check_range, check_shape, check_tensor
from paged_kv.tokens import as_id_list

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
RAW_DTYPES = (torch.float64, torch.uint8)  # stored as given, no kernel: float64 facades, packed codes
STORAGE_DTYPES = KERNEL_DTYPES + RAW_DTYPES
READ_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what ``gather`` may return


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Shape and storage dtype of the paged KV tensors of one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, low=1, high=1 << 12)
        check_int("num_kv_heads", self.num_kv_heads, low=1, high=1 << 12)
        check_int("head_dim", self.head_dim, low=1, high=1 << 14)
        check_int("block_size", self.block_size, low=1, high=MAX_BLOCK_SIZE)
        check_dtype("dtype", self.dtype, STORAGE_DTYPES)

    @property
    def quantized(self) -> bool:
        """Whether the storage holds int8/fp8 codes with float32 scales."""
        return is_quantized(self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers, K and V, scales included."""
        slots = self.block_size * self.num_kv_heads
        per_layer = slots * self.head_dim * self.dtype.itemsize + (slots * 4 if self.quantized else 0)
        return 2 * self.num_layers * per_layer

    def num_blocks_for_bytes(self, budget_bytes: int) -> int:
        """How many blocks fit in a byte budget."""
        check_int("budget_bytes", budget_bytes, low=self.bytes_per_block)
        return min(budget_bytes // self.bytes_per_block, MAX_BLOCKS)


class LayerKV(NamedTuple):
    """The four tensors of one layer (scales are None for float storage)."""

    k: torch.Tensor  # [N, B, H, D]
    v: torch.Tensor  # [N, B, H, D]
    k_scale: torch.Tensor | None  # [N, B, H] float32
    v_scale: torch.Tensor | None  # [N, B, H] float32


class PagedKVCache:
    """Owns the per-layer paged K/V tensors and applies writes, copies and swaps to them."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, device: str | torch.device = "cpu", *, pin_memory: bool = False
    ) -> None:
        check_type("spec", spec, KVCacheSpec, "a KVCacheSpec")
        check_int("num_blocks", num_blocks, low=1, high=MAX_BLOCKS)
        self.device = check_device("device", device)
        # Page-locked host pages speed up copies to an accelerator: they are made only for CPU storage on a
        # machine that has one (without, torch has no pinned allocator and pageable pages serve alike, as
        # they do for device storage). The attribute says whether the pages are pinned.
        pin_memory = check_bool("pin_memory", pin_memory)
        self.pin_memory = pin_memory and self.device.type == "cpu" and torch.accelerator.is_available()
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.layers = [self._make_layer(shape) for _ in range(spec.num_layers)]

    @classmethod
    def from_bytes(cls, spec: KVCacheSpec, budget_bytes: int, device: str | torch.device = "cpu") -> PagedKVCache:
        """A cache with as many blocks as fit in ``budget_bytes``."""
        check_type("spec", spec, KVCacheSpec, "a KVCacheSpec")
        return cls(spec, spec.num_blocks_for_bytes(budget_bytes), device)

    def _make_layer(self, shape: tuple[int, ...]) -> LayerKV:
        pin = self.pin_memory
        make = lambda s, dt: torch.zeros(s, dtype=dt, device=self.device, pin_memory=pin)  # noqa: E731
        quantized = self.spec.quantized
        scales = (make(shape[:3], torch.float32), make(shape[:3], torch.float32)) if quantized else (None, None)
        return LayerKV(make(shape, self.spec.dtype), make(shape, self.spec.dtype), *scales)

    def grow(self, num_blocks: int) -> None:
        """Append ``num_blocks`` zeroed blocks to every tensor (existing block ids keep their data)."""
        check_int("num_blocks", num_blocks, low=0, high=MAX_BLOCKS - self.num_blocks)
        grown = lambda t: None if t is None else self._grown(t, num_blocks)  # noqa: E731
        self.layers = [LayerKV(*map(grown, layer)) for layer in self.layers]
        self.num_blocks += num_blocks

    def _grown(self, t: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """``t`` with ``num_blocks`` zeroed blocks appended, in new storage pinned as the cache was built."""
        # torch.cat allocates pageable memory whatever its inputs are: allocate with the cache's pinning and copy.
        shape = (t.shape[0] + num_blocks, *t.shape[1:])
        out = torch.zeros(shape, dtype=t.dtype, device=t.device, pin_memory=self.pin_memory)
        out[: t.shape[0]].copy_(t)
        return out

    def add_layers(self, num_layers: int) -> None:
        """Append ``num_layers`` zeroed layers; every block id gains slots in them, existing layers untouched."""
        check_int("num_layers", num_layers, low=0, high=(1 << 12) - self.spec.num_layers)
        self.spec = replace(self.spec, num_layers=self.spec.num_layers + num_layers)
        shape = (self.num_blocks, self.spec.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self.layers = self.layers + [self._make_layer(shape) for _ in range(num_layers)]

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        return self.spec.block_size

    @property
    def nbytes(self) -> int:
        """Bytes held by every tensor of the cache."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor with a leading block dimension (K, V and scales of every layer)."""
        return [t for layer in self.layers for t in layer if t is not None]

    def layer(self, index: int) -> LayerKV:
        """The tensors of one layer."""
        check_int("layer", index, low=0, high=self.spec.num_layers - 1)
        return self.layers[index]

    # -- writes -----------------------------------------------------------
    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter new tokens' K/V ``[T, H, D]`` into their slots (quantizing if needed)."""
        lk = self.layer(layer)
        if self.spec.dtype in RAW_DTYPES:
            self._write_raw(lk, key, value, slot_mapping)
        else:
            write_kv(key, value, lk.k, lk.v, slot_mapping, k_scale=lk.k_scale, v_scale=lk.v_scale)

    def _write_raw(self, lk: LayerKV, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Store values as given (float64 or raw bytes) into distinct, in-range slots."""
        check_tensor("slot_mapping", slots, ndim=1, dtypes=INDEX_DTYPES)
        shape = (slots.shape[0], *lk.k.shape[2:])
        for name, t in (("key", key), ("value", value)):
            check_tensor(name, t, ndim=3, dtypes=(self.spec.dtype,))
            check_shape(name, t, shape)
        check_slots(slots, self.num_blocks * self.block_size)
        slots = slots.to(lk.k.device)
        keep = slots >= 0
        for cache, t in ((lk.k, key), (lk.v, value)):
            cache.view(-1, *cache.shape[2:])[slots[keep]] = t[keep].to(cache.device)

    def copy_blocks(self, mapping: Sequence[tuple[int, int]]) -> None:
        """Run the (src, dst) block copies a block manager owes (copy-on-write) in one batch.

        ``mapping`` is what :func:`kernels.copy_blocks` takes: (src, dst) int pairs or a ``[P, 2]`` integer tensor.
        """
        copy_blocks(self.tensors(), mapping)  # validates (an empty mapping copies nothing)

    def swap_from(self, other: PagedKVCache, mapping: Sequence[tuple[int, int]]) -> None:
        """Copy blocks ``other[src] -> self[dst]`` between pools (CPU <-> GPU swapping)."""
        check_type("other", other, PagedKVCache, "a PagedKVCache")
        if other.spec != self.spec:
            raise InvalidArgumentError(describe("other.spec", other.spec, f"{self.spec}"))
        swap_blocks(other.tensors(), self.tensors(), mapping)  # validates (an empty mapping copies nothing)

    def read_blocks(self, blocks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Whole blocks as one tensor ``kv: [n, 2, L, B, H, D]`` (K then V) and ``scales: [n, 2, L, B, H]`` or None."""
        ids = self._block_ids("blocks", blocks)
        kv = torch.stack([torch.stack([layer.k[ids], layer.v[ids]], 1) for layer in self.layers], 2)
        if not self.spec.quantized:
            return kv, None
        return kv, torch.stack([torch.stack([la.k_scale[ids], la.v_scale[ids]], 1) for la in self.layers], 2)

    def write_blocks(self, blocks: Sequence[int], kv: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Overwrite whole blocks with ``read_blocks``'s layout (checked before anything is written)."""
        ids = self._block_ids("blocks", blocks)
        shape = (len(blocks), 2, self.spec.num_layers, *self.layers[0].k.shape[1:])
        check_tensor("kv", kv, ndim=6, dtypes=(self.spec.dtype,))
        check_shape("kv", kv, shape)
        if self.spec.quantized:
            check_tensor("scales", scales, ndim=5, dtypes=(torch.float32,))
            check_shape("scales", scales, shape[:5])
        elif scales is not None:
            raise InvalidArgumentError(describe("scales", "a tensor", f"None for {self.spec.dtype} storage"))
        ids = ids.to(self.device)
        for i, layer in enumerate(self.layers):
            layer.k[ids], layer.v[ids] = kv[:, 0, i].to(self.device), kv[:, 1, i].to(self.device)
            if scales is not None:
                layer.k_scale[ids] = scales[:, 0, i].to(self.device)
                layer.v_scale[ids] = scales[:, 1, i].to(self.device)

    def _block_ids(self, name: str, blocks: Sequence[int]) -> torch.Tensor:
        """Distinct block ids, checked in range, as an int64 tensor on the cache's device."""
        ids = torch.tensor(as_id_list(name, blocks, "block ids"), dtype=torch.int64)
        check_range(name, ids, 0, self.num_blocks)
        if ids.unique().numel() != ids.numel():
            raise InvalidArgumentError(describe(name, list(blocks), "distinct block ids"))
        return ids.to(self.device)

    # -- reads ------------------------------------------------------------
    def gather(
        self, layer: int, block_table: Sequence[int], start: int, end: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read K/V of positions ``[start, end)`` of a sequence as ``[T, H, D]`` (dequantized)."""
        lk = self.layer(layer)
        if dtype is not None:
            check_dtype("dtype", dtype, READ_DTYPES)
        slots = self.slots(block_table, start, end)
        out_dtype = dtype or (torch.float32 if self.spec.quantized else self.spec.dtype)
        return tuple(self._read(t, s, slots, out_dtype) for t, s in ((lk.k, lk.k_scale), (lk.v, lk.v_scale)))

    def _read(self, t: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype):
        flat = t.view(-1, *t.shape[2:])[slots]  # [T, H, D]
        if scale is None:
            return flat.to(dtype)
        return (flat.to(torch.float32) * scale.view(-1, scale.shape[-1])[slots].unsqueeze(-1)).to(dtype)

    def slots(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Slot ids of logical positions ``[start, end)`` of a sequence, checked against the table."""
        bs = self.block_size
        ids = as_id_list("block_table", block_table, "block ids")  # ints only: 1.7 or True is no block id
        check_int("end", end, low=0, high=len(ids) * bs)
        check_int("start", start, low=0, high=end)
        table = torch.tensor(ids, dtype=torch.int64)
        check_range("block_table", table, 0, self.num_blocks)
        pos = torch.arange(start, end, dtype=torch.int64)
        return (table[pos // bs] * bs + pos % bs).to(self.device)

"""Copy whole cache blocks: ``copy_blocks`` inside one pool (copy-on-write forks), ``swap_blocks`` across pools.

``copy_blocks`` copies every (src, dst) pair in every tensor given (each
layer's K, V and scale tensors) in ONE Triton launch: the grid runs over
(pair, tensor, chunk); each tensor is passed as its raw address plus its words
per block, and a program copies one 1024-word chunk of one block, as machine
words (the widest of 8/4/2/1 bytes that divides every block size and address).
Tensors may differ in dtype and per-block size but share ``num_blocks`` (dim 0)
and one device.

A batch must be order-independent: dst ids are distinct and no id is both a
src and a dst. A src may feed several dsts (one block forked many times).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.checks import Backend, check_triton_device, use_triton
from kernels.quant import as_storage
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, describe
from paged_kv.tensor_checks import check_contiguous, check_range, check_same_device, check_tensor

BlockMapping = torch.Tensor | Sequence[tuple[int, int]]

_WORD_DTYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}
_COPY_BLOCK = 1024  # words per program
_TABLE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_TABLE_CACHE_SIZE = 16


def copy_blocks(caches: Sequence[torch.Tensor], block_mapping: BlockMapping, *, backend: Backend = "auto") -> None:
    """Copy block ``src`` to block ``dst`` for every pair, in every tensor of ``caches`` (dim 0 = block id).

    ``backend="torch"`` is the torch reference: one index_select + index_put_ per tensor.
    """
    caches = _check_caches(caches)
    triton_path = use_triton(backend, *caches)
    if triton_path:
        check_triton_device(caches[0])
    num_blocks = caches[0].shape[0]
    pairs = mapping_to_pairs(block_mapping)  # [P, 2] int64, CPU
    check_range("block_mapping", pairs, 0, num_blocks)
    _check_order_free(pairs)
    if pairs.shape[0] == 0:
        return
    if triton_path:
        _copy_triton(caches, pairs)
    else:
        _copy_torch(caches, pairs)


def swap_blocks(
    src_caches: Sequence[torch.Tensor], dst_caches: Sequence[torch.Tensor], block_mapping: BlockMapping
) -> None:
    """Copy block ``src`` of each src tensor to block ``dst`` of its dst tensor (e.g. CPU pool <-> GPU pool).

    ``src_caches[i]`` and ``dst_caches[i]`` share per-block shape and dtype; the
    pools may differ in device and num_blocks. Copies from pinned CPU memory, or
    into pinned CPU memory, are issued non-blocking (one sync at the end).
    """
    src_caches = _check_caches(src_caches, "src_caches")
    dst_caches = _check_caches(dst_caches, "dst_caches")
    _check_pool_pairs(src_caches, dst_caches)
    pairs = mapping_to_pairs(block_mapping)  # [P, 2] int64, CPU
    check_range("block_mapping[:, 0]", pairs[:, 0], 0, src_caches[0].shape[0])
    check_range("block_mapping[:, 1]", pairs[:, 1], 0, dst_caches[0].shape[0])
    _check_distinct("block_mapping[:, 1]", pairs[:, 1])
    if pairs.shape[0] == 0:
        return
    _swap(src_caches, dst_caches, pairs)


# ---------------------------------------------------------------- validation


def mapping_to_pairs(block_mapping: BlockMapping) -> torch.Tensor:
    """Normalize a [P, 2] integer tensor or a sequence of (src, dst) int pairs to a CPU int64 [P, 2] tensor."""
    if isinstance(block_mapping, torch.Tensor):
        if block_mapping.is_floating_point() or block_mapping.is_complex() or block_mapping.dtype == torch.bool:
            raise InvalidArgumentError(describe("block_mapping.dtype", block_mapping.dtype, "an integer dtype"))
        if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
            raise InvalidArgumentError(describe("block_mapping.shape", tuple(block_mapping.shape), "[num_pairs, 2]"))
        return block_mapping.to("cpu", torch.int64)
    if isinstance(block_mapping, (str, bytes)) or not isinstance(block_mapping, Sequence):
        got = type(block_mapping).__name__
        raise InvalidArgumentError(describe("block_mapping", got, "a tensor or (src, dst) pairs"))
    rows = [_pair(i, p) for i, p in enumerate(block_mapping)]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)


def _pair(i: int, pair: object) -> tuple[int, int]:
    """One (src, dst) pair of Python/numpy/torch integers."""
    try:
        src, dst = pair  # type: ignore[misc]
        if isinstance(src, bool) or isinstance(dst, bool):  # bools are never block ids
            raise TypeError
        ids = operator.index(src), operator.index(dst)
    except (TypeError, ValueError):
        raise InvalidArgumentError(describe(f"block_mapping[{i}]", pair, "a (src, dst) pair of ints")) from None
    if not all(-(1 << 63) <= b < (1 << 63) for b in ids):  # past int64: out of every pool's range
        raise OutOfRangeError(describe(f"block_mapping[{i}]", pair, "int64 block ids"))
    return ids


def _check_caches(caches: object, name: str = "caches") -> list[torch.Tensor]:
    """A non-empty sequence of contiguous tensors on one device sharing dim 0 (num_blocks)."""
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence) or len(caches) == 0:
        raise InvalidArgumentError(describe(name, type(caches).__name__, "a non-empty sequence of tensors"))
    tensors = [check_tensor(f"{name}[{i}]", t) for i, t in enumerate(caches)]
    for i, t in enumerate(tensors):
        if t.dim() == 0 or t.shape[0] != tensors[0].shape[0]:
            raise InvalidArgumentError(describe(f"{name}[{i}].shape", tuple(t.shape), "dim 0 = num_blocks of [0]"))
        check_contiguous(f"{name}[{i}]", t)
    check_same_device({f"{name}[{i}]": t for i, t in enumerate(tensors)})
    return tensors


def _check_pool_pairs(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor]) -> None:
    """Paired tensors have the same per-block shape and dtype."""
    if len(src_caches) != len(dst_caches):
        raise InvalidArgumentError(describe("len(dst_caches)", len(dst_caches), f"{len(src_caches)} like src_caches"))
    for i, (s, d) in enumerate(zip(src_caches, dst_caches)):
        if s.dtype != d.dtype or s.shape[1:] != d.shape[1:]:
            got = (d.dtype, tuple(d.shape[1:]))
            raise InvalidArgumentError(describe(f"dst_caches[{i}]", got, f"{(s.dtype, tuple(s.shape[1:]))}"))


def _check_order_free(pairs: torch.Tensor) -> None:
    """dst ids distinct and disjoint from src ids, so the copies commute."""
    _check_distinct("block_mapping[:, 1]", pairs[:, 1])
    both = pairs[:, 1][torch.isin(pairs[:, 1], pairs[:, 0])]
    if both.numel():
        raise InvalidArgumentError(describe("block_mapping", int(both[0]), "no block id both a src and a dst"))


def _check_distinct(name: str, ids: torch.Tensor) -> None:
    """Raise if an id repeats."""
    ordered = torch.sort(ids).values
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.numel():
        raise InvalidArgumentError(describe(name, int(repeated[0]), "distinct block ids"))


# ---------------------------------------------------------------- torch paths


def _copy_torch(caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
    """Reference: one index_select + index_put_ per tensor (CPU index_copy_ is slow for 16-bit dtypes)."""
    pairs = pairs.to(caches[0].device)
    for t in caches:
        s = as_storage(t)
        s.index_put_((pairs[:, 1],), s.index_select(0, pairs[:, 0]))


def _swap(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
    """Gather src rows (staged in pinned memory when a CPU side is pinned), move, scatter."""
    src_device, dst_device = src_caches[0].device, dst_caches[0].device
    src_idx, dst_idx = pairs[:, 0].to(src_device), pairs[:, 1].to(dst_device)
    moved = [_gather_to(as_storage(s), src_idx, as_storage(d)) for s, d in zip(src_caches, dst_caches)]
    if src_device.type == "cuda" and dst_device.type == "cpu":
        torch.cuda.current_stream(src_device).synchronize()  # non-blocking D2H copies must land first
    for d, rows in zip(dst_caches, moved):
        as_storage(d).index_put_((dst_idx,), rows)


def _gather_to(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Rows ``src_idx`` of ``src`` on ``dst``'s device."""
    if src.device.type == "cpu" and dst.device.type == "cuda" and src.is_pinned():
        staged = torch.empty((src_idx.numel(), *src.shape[1:]), dtype=src.dtype, pin_memory=True)
        torch.index_select(src, 0, src_idx, out=staged)
        return staged.to(dst.device, non_blocking=True)
    rows = src.index_select(0, src_idx)
    if src.device.type == "cuda" and dst.device.type == "cpu" and dst.is_pinned():
        staged = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        return staged.copy_(rows, non_blocking=True)
    return rows.to(dst.device)


# ---------------------------------------------------------------- triton path


def _copy_triton(caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
    """One launch over (pair, tensor, chunk); a program copies BLOCK words of one block of one tensor."""
    device = caches[0].device
    word = _word_bytes(caches)
    addresses, words = _tensor_table(caches, word)
    mapping = pairs.to(device)  # [P, 2]
    max_words = max(_block_bytes(t) for t in caches) // word
    grid = (pairs.shape[0], len(caches), max(1, triton.cdiv(max_words, _COPY_BLOCK)))
    _copy_blocks_kernel[grid](addresses, words, mapping, WORD=_WORD_DTYPES[word], BLOCK=_COPY_BLOCK)


def _word_bytes(caches: list[torch.Tensor]) -> int:
    """Widest word (8/4/2/1 bytes) dividing every address and every block's byte size."""
    common = 8
    for t in caches:
        common = math.gcd(common, t.data_ptr(), _block_bytes(t))
    return common


def _block_bytes(t: torch.Tensor) -> int:
    """Bytes of one block (one dim-0 slice) of a contiguous tensor."""
    return t[0].numel() * t.element_size() if t.shape[0] else 0


def _tensor_table(caches: list[torch.Tensor], word: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 addresses [N] and words per block [N] on the caches' device (memoized: engines reuse one list)."""
    device = caches[0].device
    addresses = [t.data_ptr() for t in caches]
    words = [_block_bytes(t) // word for t in caches]
    key = (device, word, tuple(addresses), tuple(words))
    if key not in _TABLE_CACHE:
        if len(_TABLE_CACHE) >= _TABLE_CACHE_SIZE:
            _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
        table = torch.tensor([addresses, words], dtype=torch.int64).to(device)  # [2, N]
        _TABLE_CACHE[key] = (table[0], table[1])
    return _TABLE_CACHE[key]


@triton.jit
def _copy_blocks_kernel(addresses_ptr, words_ptr, mapping_ptr, WORD: tl.constexpr, BLOCK: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    tensor = tl.program_id(1)
    chunk = tl.program_id(2)
    base = tl.load(addresses_ptr + tensor).to(tl.pointer_type(WORD))  # the tensor's data, as words
    num_words = tl.load(words_ptr + tensor)  # words per block of this tensor
    src = base + tl.load(mapping_ptr + 2 * pair) * num_words
    dst = base + tl.load(mapping_ptr + 2 * pair + 1) * num_words
    offs = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < num_words  # chunks past a smaller tensor's block do nothing
    tl.store(dst + offs, tl.load(src + offs, mask=mask, other=0), mask=mask)

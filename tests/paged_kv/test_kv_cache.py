"""PagedKVCache: layout, sizing, writes, reads, copies, swaps, growth and their errors."""

from __future__ import annotations

import pytest
import torch

from paged_kv.errors import InvalidArgumentError, OutOfRangeError, PagedKVError
from paged_kv.kv_cache import KVCacheSpec, PagedKVCache

FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
QUANT = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def make(dtype=torch.float32, num_blocks=8, layers=2, heads=2, head_dim=8, block_size=4) -> PagedKVCache:
    spec = KVCacheSpec(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    return PagedKVCache(spec, num_blocks)


def snapshot(cache: PagedKVCache) -> list[torch.Tensor]:
    return [t.clone() for t in cache.tensors()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", FLOAT + QUANT)
def test_layout_shapes_and_bytes(dtype):
    cache = make(dtype)
    layer = cache.layer(1)
    assert layer.k.shape == (8, 4, 2, 8) and layer.k.dtype == dtype
    quantized = dtype in QUANT
    assert (layer.k_scale is not None) == quantized
    if quantized:
        assert layer.k_scale.shape == (8, 4, 2) and layer.k_scale.dtype == torch.float32
    assert cache.nbytes == cache.num_blocks * cache.spec.bytes_per_block


def test_from_bytes_fits_budget():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
    budget = 10 * spec.bytes_per_block + 17
    cache = PagedKVCache.from_bytes(spec, budget)
    assert cache.num_blocks == 10 and cache.nbytes <= budget


@pytest.mark.parametrize("dtype", FLOAT + QUANT)
def test_write_then_gather_roundtrip(dtype):
    torch.manual_seed(0)
    cache = make(dtype)
    table = [5, 2, 7]  # shuffled, non-contiguous pages
    k, v = torch.randn(10, 2, 8, dtype=torch.float64), torch.randn(10, 2, 8, dtype=torch.float64)
    src = (k, v) if dtype == torch.float64 else (k.float(), v.float())
    cache.write(1, *src, cache.slots(table, 0, 10))
    gk, gv = cache.gather(1, table, 0, 10, dtype=torch.float64)
    tol = {torch.float32: 1e-7, torch.float64: 0, torch.float16: 2e-3, torch.bfloat16: 2e-2,
           torch.int8: 2e-2, torch.float8_e4m3fn: 0.15, torch.float8_e5m2: 0.3}[dtype]
    assert (gk - k).abs().max() <= tol * k.abs().max() and (gv - v).abs().max() <= tol * v.abs().max()
    part_k, _ = cache.gather(1, table, 3, 7, dtype=torch.float64)
    assert torch.equal(part_k, gk[3:7])
    assert not cache.layer(0).k.view(torch.uint8).any()  # other layer untouched


def test_pin_memory_without_an_accelerator_falls_back_to_pageable_pages(monkeypatch):
    # torch has no pinned allocator without an accelerator (it raised an untyped RuntimeError);
    # pinning only speeds up copies to one, so the host pages stay pageable and say so
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.int8)
    cache = PagedKVCache(spec, 2, "cpu", pin_memory=True)
    assert cache.pin_memory is False and not any(t.is_pinned() for t in cache.tensors())
    k = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    cache.write(0, k, k, cache.slots([1], 0, 3))
    assert torch.allclose(cache.gather(0, [1], 0, 3)[0], k, atol=k.abs().max().item() / 127)
    with pytest.raises(InvalidArgumentError, match="^pin_memory="):
        PagedKVCache(spec, 2, "cpu", pin_memory=1)


def test_slots_follow_the_block_table():
    cache = make(block_size=4)
    assert cache.slots([5, 2], 2, 7).tolist() == [22, 23, 8, 9, 10]


@pytest.mark.parametrize("dtype", (torch.float32, torch.int8))
def test_copy_blocks_copies_every_layer_and_scale(dtype):
    torch.manual_seed(1)
    cache = make(dtype)
    for layer in range(2):
        cache.write(layer, torch.randn(8, 2, 8), torch.randn(8, 2, 8), cache.slots([1, 3], 0, 8))
    cache.copy_blocks([(1, 4), (3, 6)])
    for layer in range(2):
        a = cache.gather(layer, [1, 3], 0, 8)
        b = cache.gather(layer, [4, 6], 0, 8)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.uint8))
def test_a_tensor_mapping_copies_exactly_as_pairs(dtype):
    # kernels.copy_blocks takes a [P, 2] integer tensor; the cache must take the same mapping
    as_pairs, as_tensor = make(dtype), make(dtype)
    for c in (as_pairs, as_tensor):
        for t in c.tensors():
            t.copy_(torch.arange(t.numel()).reshape(t.shape).to(dtype))
    as_pairs.copy_blocks([(1, 4), (3, 6)])
    as_tensor.copy_blocks(torch.tensor([[1, 4], [3, 6]], dtype=torch.int32))
    assert same(snapshot(as_pairs), snapshot(as_tensor))
    assert not same(snapshot(as_pairs), snapshot(make(dtype)))  # something was copied
    empty = snapshot(as_tensor)
    as_tensor.copy_blocks(torch.empty(0, 2, dtype=torch.int64))  # an empty tensor copies nothing
    assert same(snapshot(as_tensor), empty)


def test_swap_roundtrip_between_pools():
    torch.manual_seed(2)
    gpu, cpu = make(num_blocks=6), make(num_blocks=4)
    gpu.write(0, torch.randn(6, 2, 8), torch.randn(6, 2, 8), gpu.slots([2, 5], 0, 6))
    before = gpu.gather(0, [2, 5], 0, 6)
    cpu.swap_from(gpu, [(2, 0), (5, 3)])
    back = make(num_blocks=6)
    back.swap_from(cpu, [(0, 1), (3, 4)])
    after = back.gather(0, [1, 4], 0, 6)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_grow_keeps_data_and_ids():
    cache = make(num_blocks=2)
    k = torch.randn(8, 2, 8)
    cache.write(0, k, k, cache.slots([0, 1], 0, 8))
    cache.grow(3)
    assert cache.num_blocks == 5 and cache.layer(0).k.shape[0] == 5
    assert torch.equal(cache.gather(0, [0, 1], 0, 8)[0], k)


@pytest.mark.parametrize("dtype", (torch.float16, torch.int8), ids=str)
def test_grow_allocates_with_the_pinning_the_cache_was_built_with(monkeypatch, dtype):
    # torch.cat returns pageable pages: a pinned host cache that grew lost its pinning. Without an
    # accelerator torch cannot pin, so a stand-in allocator records which storages were asked pinned.
    pinned: set[int] = set()
    real_zeros = torch.zeros

    def zeros(*args, pin_memory=False, **kwargs):
        out = real_zeros(*args, **kwargs)
        if pin_memory:
            pinned.add(out.data_ptr())
        return out

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch, "zeros", zeros)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    cache = PagedKVCache(spec, 2, "cpu", pin_memory=True)
    assert cache.pin_memory and all(t.data_ptr() in pinned for t in cache.tensors())
    k = torch.randn(8, 2, 8, generator=torch.Generator().manual_seed(0))
    cache.write(1, k, k, cache.slots([0, 1], 0, 8))
    before = [t.clone() for t in cache.tensors()]
    cache.grow(3)
    assert all(t.shape[0] == 5 and t.data_ptr() in pinned for t in cache.tensors())
    assert all(torch.equal(t[:2], b) and not t[2:].view(torch.uint8).any() for t, b in zip(cache.tensors(), before))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pinned_host_cache_stays_pinned_when_it_grows():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.int8)
    cache = PagedKVCache(spec, 2, "cpu", pin_memory=True)
    k = torch.randn(8, 2, 8, generator=torch.Generator().manual_seed(0))
    cache.write(0, k, k, cache.slots([0, 1], 0, 8))
    before = cache.gather(0, [0, 1], 0, 8)[0]
    cache.grow(3)
    assert cache.num_blocks == 5 and all(t.is_pinned() for t in cache.tensors())
    assert torch.equal(cache.gather(0, [0, 1], 0, 8)[0], before)
    unpinned = PagedKVCache(spec, 2, "cpu")
    unpinned.grow(1)
    assert not any(t.is_pinned() for t in unpinned.tensors())


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_layers=0), dict(head_dim=-1), dict(block_size=0), dict(dtype=torch.int32)],
)
def test_spec_rejects_bad_values(kwargs):
    base = dict(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32) | kwargs
    with pytest.raises(PagedKVError) as info:
        KVCacheSpec(**base)
    assert next(iter(kwargs)) in str(info.value)


def test_bad_writes_raise_and_write_nothing():
    cache = make(torch.float64)
    before = snapshot(cache)
    k = torch.randn(3, 2, 8, dtype=torch.float64)
    with pytest.raises(OutOfRangeError, match="slot_mapping"):
        cache.write(0, k, k, torch.tensor([0, 1, 8 * 4]))
    with pytest.raises(InvalidArgumentError, match="key"):
        cache.write(0, k.float(), k, torch.tensor([0, 1, 2]))
    with pytest.raises(OutOfRangeError, match="layer"):
        cache.write(2, k, k, torch.tensor([0, 1, 2]))
    assert same(before, snapshot(cache))


def test_bad_reads_raise():
    cache = make()
    with pytest.raises(OutOfRangeError, match="block_table"):
        cache.gather(0, [0, 99], 0, 5)
    with pytest.raises(OutOfRangeError, match="end"):
        cache.gather(0, [0], 0, 5)  # one block of 4 slots cannot hold 5 tokens
    with pytest.raises(InvalidArgumentError, match="other.spec"):
        make().swap_from(make(torch.float16), [(0, 0)])

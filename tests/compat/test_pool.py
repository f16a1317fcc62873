"""KVPool / PagedSeq: the paged machinery under every facade."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from paged_kv.compat.pool import KVPool
from paged_kv.compat.quantized import QuantizedKVCache
from paged_kv.errors import InvalidArgumentError, OutOfBlocksError, OutOfRangeError


def pool(**kw) -> KVPool:
    return KVPool(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, **kw)


def fill(seq, n: int, seed: int = 0) -> torch.Tensor:
    """Append n positions of random K (V = -K) to every layer; return K."""
    k = torch.randn(n, 2, 4, generator=torch.Generator().manual_seed(seed))
    start = seq.extend(n)
    for layer in range(2):
        seq.write(layer, start, k, -k)
    return k


def test_pages_grow_with_length_and_private_pool_doubles():
    p = pool()
    seq = p.new_seq()
    assert seq.num_pages == 0
    k = fill(seq, 9)
    assert seq.length == 9 and seq.num_pages == 3
    k2 = fill(seq, 40, seed=1)  # past the initial 4 blocks: the private pool grows
    assert seq.num_pages == 13 and p.manager.gpu.num_blocks >= 13
    got, neg = seq.read(1)
    assert torch.equal(got, torch.cat([k, k2])) and torch.equal(neg, -got)
    p.manager.check()


def test_fixed_pool_raises_and_changes_nothing():
    p = pool(num_blocks=2)
    seq = p.new_seq()
    fill(seq, 8)
    with pytest.raises(OutOfBlocksError):
        seq.extend(1)
    assert seq.length == 8 and seq.num_pages == 2
    p.manager.check()


def test_fork_is_copy_on_write_both_ways():
    p = pool()
    a = p.new_seq()
    k = fill(a, 6)
    b = a.fork()
    assert b.block_table() == a.block_table()
    new = torch.ones(1, 2, 4)
    b.write(0, 5, new, new)  # overwrite a shared position: b gets a private page
    assert torch.equal(a.read(0)[0], k)
    assert torch.equal(b.read(0)[0][5:], new) and torch.equal(b.read(0)[0][:5], k[:5])
    a.write(0, 0, new, new)  # a's first page is still shared with b
    assert torch.equal(b.read(0)[0][0], k[0])
    p.manager.check()


def test_truncate_returns_pages_and_free_is_idempotent():
    p = pool()
    seq = p.new_seq()
    fill(seq, 10)
    seq.truncate(5)
    assert seq.length == 5 and seq.num_pages == 2
    seq.free()
    seq.free()
    assert p.manager.gpu.num_used == 0


def test_garbage_collected_sequence_returns_its_pages():
    p = pool()
    fill(p.new_seq(), 7)
    gc.collect()
    assert p.manager.gpu.num_used == 0


def test_sequences_in_one_pool_are_isolated():
    p = pool()
    a, b = p.new_seq(), p.new_seq()
    ka, kb = fill(a, 5, seed=1), fill(b, 3, seed=2)
    assert torch.equal(a.read(0)[0], ka) and torch.equal(b.read(0)[0], kb)
    assert not set(a.block_table()) & set(b.block_table())


def test_bad_positions_raise():
    p = pool()
    seq = p.new_seq()
    fill(seq, 3)
    with pytest.raises(OutOfRangeError, match="start"):
        seq.write(0, 3, torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))
    with pytest.raises(OutOfRangeError, match="end"):
        seq.read(0, 0, 4)


def test_drop_front_gives_back_leading_pages_and_shifts_positions():
    p = pool()
    seq = p.new_seq()
    k = fill(seq, 10)  # pages: 0-3 | 4-7 | 8-9
    twin = seq.fork()
    used = p.manager.gpu.num_used
    seq.drop_front(1)
    assert seq.length == 6 and seq.num_pages == 2 and p.manager.gpu.num_used == used  # the twin keeps page 0
    assert torch.equal(seq.read(0)[0], k[4:]) and torch.equal(twin.read(0)[0], k)
    k2 = fill(seq, 3, seed=1)  # grows at the new end: a private copy of the shared last page, then a new page
    assert seq.length == 9 and torch.equal(seq.read(1)[0], torch.cat([k[4:], k2]))
    assert torch.equal(twin.read(1)[0], k)
    twin.drop_front(3)
    assert twin.length == 0 and twin.num_pages == 0
    p.manager.check()
    with pytest.raises(OutOfRangeError, match="num_pages"):
        seq.drop_front(4)
    with pytest.raises(InvalidArgumentError, match="num_pages"):
        seq.drop_front(1.5)
    assert seq.length == 9 and seq.num_pages == 3


def test_pages_to_append_counts_new_pages_and_a_shared_last_page():
    p = pool(num_blocks=6)
    seq = p.new_seq()
    assert seq.pages_to_append(0) == 0 and seq.pages_to_append(1) == 1
    fill(seq, 6)
    assert [seq.pages_to_append(n) for n in (1, 2, 3, 6, 7)] == [0, 0, 1, 1, 2]
    twin = seq.fork()
    assert [twin.pages_to_append(n) for n in (0, 1, 3)] == [0, 1, 2]
    free = p.manager.gpu.num_free
    twin.extend(3)
    assert p.manager.gpu.num_free == free - 2
    with pytest.raises(InvalidArgumentError, match="n="):
        seq.pages_to_append(-1)


def test_compatible_takes_numpy_integers_and_rejects_floats_and_bools():
    p = pool()
    p.compatible(num_layers=np.int64(2), head_dim=np.int32(4), block_size=np.uint8(4), dtype=torch.float32)
    cache = QuantizedKVCache(np.int64(2), np.int64(2), 8, np.int64(4), "F32", pool=p, block_size=np.int64(4))
    assert cache.pool is p
    for name, bad in (("num_layers", 2.0), ("head_dim", True), ("num_layers", 3), ("dtype", "float32")):
        with pytest.raises(InvalidArgumentError, match=f"^(pool.)?{name}="):
            p.compatible(**{name: bad})

"""Facade 003: quantized.QuantizedKVCache (F32 / INT8 / FP8 through the kernels) on pages."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from kernels.quant import dequantize, quantize_per_token_head
from paged_kv.compat.pool import KVPool
from paged_kv.compat.quantized import KVCacheFormat, QuantizedKVCache
from paged_kv.errors import InvalidArgumentError, OutOfBlocksError, OutOfRangeError, PagedKVError

L, H, D, BS, MAX = 2, 3, 8, 4, 24
FORMATS = list(KVCacheFormat)
SCALED = [f for f in FORMATS if f is not KVCacheFormat.F32]
FP8_BITS = {KVCacheFormat.FP8_E4M3: (3, 7), KVCacheFormat.FP8_E5M2: (2, 15)}  # (mantissa bits, exponent bias)


def vectors(seed: int, n: int) -> np.ndarray:
    """Random float32 [n, H * D] with magnitudes spread over a few decades per head."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-3, 3, size=(n, H, 1))
    return (rng.standard_normal((n, H, D)) * scale).astype(np.float32).reshape(n, H * D)


def expected(fmt: KVCacheFormat, x: np.ndarray) -> np.ndarray:
    """What the cache should read back for rows ``x`` [n, H * D]: the quant contract's dequantized value."""
    t = torch.from_numpy(x).view(-1, H, D)
    if fmt is KVCacheFormat.F32:
        return x.copy()
    codes, scales = quantize_per_token_head(t, fmt.dtype)
    return dequantize(codes, scales).reshape(x.shape).numpy()


def new(fmt: KVCacheFormat = KVCacheFormat.INT8, max_seq_len: int = MAX, **kw) -> QuantizedKVCache:
    return QuantizedKVCache(L, H, max_seq_len, D, fmt, block_size=BS, **kw)


def read_all(cache: QuantizedKVCache) -> np.ndarray:
    """Every layer's K and V of [0, seq_len): [L, 2, seq_len, H, D]."""
    n = cache.seq_len
    return np.array([[[getattr(cache, f"read_{w}_range")(layer, h, 0, n).reshape(n, D) for h in range(H)]
                      for w in "kv"] for layer in range(L)]).transpose(0, 1, 3, 2, 4)


def state(cache: QuantizedKVCache) -> tuple:
    return (cache.seq_len, read_all(cache).tobytes(), cache.memory_usage(), cache.pool.manager.gpu.num_free,
            [a.tobytes() for a in cache.k_data + cache.v_data + cache.k_scales + cache.v_scales])


def fill(cache: QuantizedKVCache, k: np.ndarray, v: np.ndarray, start: int = 0) -> None:
    for i in range(k.shape[0]):
        for layer in range(L):
            cache.write_kv(layer, start + i, k[i] * (layer + 1), v[i] * (layer + 1))


# -- round trips -------------------------------------------------------------------------------
def test_f32_round_trip_is_bit_exact():
    x = vectors(0, 6)
    x[0, :4] = [1e-40, -0.0, 3.0e38, -1.17e-38]  # subnormal, signed zero, near max, near min normal
    cache = new(KVCacheFormat.F32)
    for pos in range(6):
        cache.write_kv(0, pos, x[pos], -x[pos])
    got = read_all(cache)[0]  # [2, 6, H, D]
    np.testing.assert_array_equal(got[0].reshape(6, -1).view(np.uint32), x.view(np.uint32))
    np.testing.assert_array_equal(got[1].reshape(6, -1).view(np.uint32), (-x).view(np.uint32))
    raw = cache.k_data[0].view(np.float32).reshape(H, MAX, D)[:, :6].transpose(1, 0, 2).reshape(6, -1)
    np.testing.assert_array_equal(raw.view(np.uint32), x.view(np.uint32))


def test_int8_error_within_half_a_scale_and_codes_in_documented_layout():
    x = vectors(1, 10)
    cache = new(KVCacheFormat.INT8)
    fill(cache, x, x)
    per_head = x.reshape(10, H, D)
    scale = np.abs(per_head).max(-1) / np.float32(127)  # [pos, head]
    for h in range(H):
        got = cache.read_k_range(0, h, 0, 10).reshape(10, D)
        assert (np.abs(got - per_head[:, h]) <= scale[:, h, None] / 2 * (1 + 1e-6) + 1e-30).all()
    codes = cache.k_data[0].view(np.int8).reshape(H, MAX, D)
    scales = cache.k_scales[0].reshape(H, MAX)
    np.testing.assert_allclose(scales[:, :10], scale.T, rtol=1e-7)
    np.testing.assert_array_equal(codes[:, :10], np.round(per_head / scales[:, :10].T[..., None]).astype(np.int8)
                                  .transpose(1, 0, 2))
    assert not codes[:, 10:].any() and not scales[:, 10:].any()


@pytest.mark.parametrize("fmt", list(FP8_BITS))
def test_fp8_error_within_the_formats_rounding_and_torch_encodings(fmt):
    mant, bias = FP8_BITS[fmt]
    x = vectors(2, 12)
    cache = new(fmt)
    fill(cache, x, x)
    per_head = x.reshape(12, H, D)
    scales = cache.v_scales[0].reshape(H, MAX)[:, :12].T.copy()  # [pos, head]
    np.testing.assert_allclose(scales, np.abs(per_head).max(-1) / torch.finfo(fmt.dtype).max, rtol=1e-7)
    for h in range(H):
        got = cache.read_v_range(0, h, 0, 12).reshape(12, D)
        s = scales[:, h, None]
        tol = np.maximum(np.abs(per_head[:, h]) * 2.0 ** -(mant + 1), s * 2.0 ** -(bias + mant)) * (1 + 1e-6)
        assert (np.abs(got - per_head[:, h]) <= tol + 1e-30).all()
    y = torch.from_numpy(per_head) / torch.from_numpy(scales)[..., None]  # what the codes encode
    want = y.clamp(-torch.finfo(fmt.dtype).max, torch.finfo(fmt.dtype).max).to(fmt.dtype).view(torch.uint8)
    raw = cache.v_data[0].reshape(H, MAX, D)[:, :12].transpose(1, 0, 2)
    np.testing.assert_array_equal(raw, want.numpy())


@pytest.mark.parametrize("fmt", FORMATS)
def test_reads_match_the_quantization_contract(fmt):
    x = vectors(3, 5)
    cache = new(fmt)
    fill(cache, x, 2 * x)
    for pos in range(5):
        for h in range(H):
            np.testing.assert_array_equal(cache.read_k(1, h, pos), expected(fmt, 2 * x)[pos, h * D:(h + 1) * D])
            np.testing.assert_array_equal(cache.read_v(0, h, pos), expected(fmt, 2 * x)[pos, h * D:(h + 1) * D])


def test_zero_vectors_store_zero_scales_and_read_zero():
    cache = new(KVCacheFormat.INT8)
    cache.write_kv(0, 0, np.zeros(H * D), np.zeros(H * D))
    assert not cache.read_k(0, 1, 0).any() and not cache.k_scales[0].any()


def test_f32_stores_non_finite_values_but_scaled_formats_reject_them():
    cache = new(KVCacheFormat.F32)
    x = np.zeros(H * D, np.float32)
    x[3], x[D] = np.nan, -np.inf
    cache.write_kv(0, 0, x, x)
    np.testing.assert_array_equal(cache.read_k(0, 0, 0)[3], np.nan)
    for fmt in SCALED:
        q = new(fmt)
        before = state(q)
        with pytest.raises(InvalidArgumentError, match="k_data"):
            q.write_kv(0, 0, x, np.zeros(H * D))
        assert state(q) == before


# -- positions, capacity ---------------------------------------------------------------------------
def test_seq_len_is_one_past_the_highest_written_position_and_gaps_read_zero():
    cache = new(KVCacheFormat.F32)
    assert (cache.seq_len, cache.remaining_capacity(), cache.is_full()) == (0, MAX, False)
    x = vectors(4, 2)
    cache.write_kv(0, 5, x[0], x[0])
    assert cache.seq_len == 6 and cache.remaining_capacity() == MAX - 6
    cache.write_kv(1, 2, x[1], x[1])
    assert cache.seq_len == 6
    got = read_all(cache)  # [L, 2, 6, H, D]
    np.testing.assert_array_equal(got[0, 0, 5].reshape(-1), x[0])
    np.testing.assert_array_equal(got[1, 1, 2].reshape(-1), x[1])
    assert not got[0, :, :5].any() and not got[1, :, [0, 1, 3, 4, 5]].any()
    cache.write_kv(0, MAX - 1, x[0], x[0])
    assert cache.is_full() and cache.remaining_capacity() == 0


def test_reset_empties_and_returns_pages():
    cache = new()
    fill(cache, vectors(5, 9), vectors(6, 9))
    cache.reset()
    assert (cache.seq_len, cache.memory_usage(), cache.read_k_range(0, 0, 0, 0).size) == (0, 0, 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_memory_is_pages_held_plus_scales_not_max_seq_len(fmt):
    cache = new(fmt, 1_000_000)
    per_slot = H * D * fmt.bytes_per_element + (H * 4 if fmt is not KVCacheFormat.F32 else 0)
    assert cache.pool.bytes_per_page == 2 * L * BS * per_slot
    x = vectors(7, 2 * BS + 1)
    for n in range(1, 2 * BS + 2):
        fill(cache, x[n - 1:n], x[n - 1:n], start=n - 1)
        assert cache.memory_usage() == -(-n // BS) * cache.pool.bytes_per_page


def test_views_have_the_documented_sizes_and_are_read_only():
    cache = new(KVCacheFormat.FP8_E5M2)
    fill(cache, vectors(8, 3), vectors(9, 3))
    assert [a.size for a in cache.k_data] == [H * MAX * D] * L
    assert [a.size for a in cache.v_scales] == [H * MAX] * L
    assert new(KVCacheFormat.F32).k_scales[0].size == 0
    assert new(KVCacheFormat.F32).v_data[1].size == H * MAX * D * 4
    for arr in (cache.k_data[0], cache.v_data[1], cache.k_scales[0], cache.v_scales[1]):
        with pytest.raises(ValueError):
            arr[0] = 1


# -- errors --------------------------------------------------------------------------------------------
GOOD = np.ones(H * D, np.float32)
BAD_WRITES = [
    ((L, 0, GOOD, GOOD), OutOfRangeError, "layer"),
    ((0, MAX, GOOD, GOOD), OutOfRangeError, "pos"),
    ((0, -1, GOOD, GOOD), OutOfRangeError, "pos"),
    ((0, "1", GOOD, GOOD), InvalidArgumentError, "pos"),
    ((0, 0, GOOD[:-1], GOOD), InvalidArgumentError, "k_data"),
    ((0, 0, GOOD, np.ones((H, D))), InvalidArgumentError, "v_data"),
    ((0, 0, GOOD, "no"), InvalidArgumentError, "v_data"),
]


@pytest.mark.parametrize("args, err, name", BAD_WRITES)
def test_bad_writes_raise_typed_errors_and_change_nothing(args, err, name):
    cache = new()
    fill(cache, vectors(10, 3), vectors(11, 3))
    before = state(cache)
    with pytest.raises(err, match=name) as info:
        cache.write_kv(*args)
    assert isinstance(info.value, PagedKVError)
    assert state(cache) == before


@pytest.mark.parametrize("call, err, name", [
    (lambda c: c.read_k(L, 0, 0), OutOfRangeError, "layer"),
    (lambda c: c.read_v(0, H, 0), OutOfRangeError, "head"),
    (lambda c: c.read_k(0, 0, 3), OutOfRangeError, "pos"),
    (lambda c: c.read_v(0, -1, 0), OutOfRangeError, "head"),
    (lambda c: c.read_k_range(0, 0, 2, 1), OutOfRangeError, "start_pos"),
    (lambda c: c.read_v_range(0, 0, 0, 4), OutOfRangeError, "end_pos"),
    (lambda c: c.truncate(-1), InvalidArgumentError, "new_len"),
    (lambda c: c.shift_left(-2), InvalidArgumentError, "amount"),
    (lambda c: c.shift_left(None), InvalidArgumentError, "amount"),
])
def test_bad_reads_and_shrinks_raise_typed_errors_and_change_nothing(call, err, name):
    cache = new()
    fill(cache, vectors(12, 3), vectors(13, 3))
    before = state(cache)
    with pytest.raises(err, match=name):
        call(cache)
    assert state(cache) == before


def test_constructor_checks_format_and_geometry():
    assert new("INT8").format is KVCacheFormat.INT8 and new("fp8_e4m3").format is KVCacheFormat.FP8_E4M3
    for bad in ("int4", 3, None):
        with pytest.raises(InvalidArgumentError, match="format"):
            new(bad)
    for args in ((0, H, MAX, D), (L, 0, MAX, D), (L, H, -1, D), (L, H, MAX, 0)):
        with pytest.raises(InvalidArgumentError):
            QuantizedKVCache(*args, KVCacheFormat.F32)
    pool = KVPool(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.int8, block_size=BS)
    with pytest.raises(InvalidArgumentError, match="pool.dtype"):
        QuantizedKVCache(L, H, MAX, D, KVCacheFormat.FP8_E4M3, pool=pool)


def test_zero_capacity_cache_rejects_every_write():
    cache = new(max_seq_len=0)
    assert cache.is_full() and cache.remaining_capacity() == 0
    with pytest.raises(OutOfRangeError, match="pos"):
        cache.write_kv(0, 0, GOOD, GOOD)


# -- truncate / shift_left --------------------------------------------------------------------------------
def test_truncate_never_extends_returns_pages_and_forgets_the_tail():
    cache = new(KVCacheFormat.F32)
    x = vectors(14, 11)
    fill(cache, x, x)
    cache.truncate(20)
    assert cache.seq_len == 11
    cache.truncate(6)
    assert cache.seq_len == 6 and cache.memory_usage() == 2 * cache.pool.bytes_per_page
    cache.write_kv(0, 7, x[0], x[0])  # position 6 (old data, same page) joins as zeros
    assert cache.seq_len == 8
    got = read_all(cache)
    assert not got[:, :, 6].any() and not got[1, :, 7].any()
    np.testing.assert_array_equal(got[0, 0, :6].reshape(6, -1), x[:6])


@pytest.mark.parametrize("fmt", FORMATS)
def test_shift_left_slides_the_window(fmt):
    x = vectors(15, 14)
    cache = new(fmt)
    fill(cache, x, -x)
    want = read_all(cache)
    cache.shift_left(0)
    np.testing.assert_array_equal(read_all(cache), want)
    cache.shift_left(3)
    assert cache.seq_len == 11
    np.testing.assert_array_equal(read_all(cache), want[:, :, 3:])
    fill(cache, x[:2], x[:2], start=11)  # keep generating into the window
    cache.shift_left(6)
    np.testing.assert_array_equal(read_all(cache)[:, :, :5], want[:, :, 9:])
    np.testing.assert_array_equal(read_all(cache)[0, 0, 5:].reshape(2, -1), expected(fmt, x[:2]))
    cache.shift_left(cache.seq_len)
    assert cache.seq_len == 0 and cache.memory_usage() == 0


def test_shift_left_gives_back_whole_leading_pages_without_moving_data():
    cache = new(KVCacheFormat.INT8)
    fill(cache, vectors(16, 4 * BS), vectors(17, 4 * BS))  # exactly 4 pages
    storage = [t.clone() for t in cache.pool.storage.tensors()]
    free = cache.pool.manager.gpu.num_free
    cache.shift_left(BS + 1)  # one whole page and one slot
    assert cache.pool.manager.gpu.num_free == free + 1
    assert cache.memory_usage() == 3 * cache.pool.bytes_per_page
    assert all(torch.equal(a, b) for a, b in zip(storage, cache.pool.storage.tensors()))  # nothing written
    cache.shift_left(BS - 1)  # the offset reaches a page boundary: one more page goes back
    assert cache.memory_usage() == 2 * cache.pool.bytes_per_page and cache.seq_len == 2 * BS


def test_shift_left_then_truncate_then_write():
    cache = new(KVCacheFormat.F32)
    x = vectors(18, 10)
    fill(cache, x, x)
    cache.shift_left(3)
    cache.truncate(2)
    cache.write_kv(1, 4, x[9], x[9])
    got = read_all(cache)
    np.testing.assert_array_equal(got[0, 0, :2].reshape(2, -1), x[3:5])
    assert not got[:, :, 2:4].any() and not got[0, :, 4].any()
    np.testing.assert_array_equal(got[1, 1, 4].reshape(-1), x[9])


# -- sharing ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [QuantizedKVCache.copy, copy.copy, copy.deepcopy])
def test_copy_shares_pages_and_diverges(make):
    x = vectors(19, 6)
    cache = new(KVCacheFormat.FP8_E4M3)
    fill(cache, x, x)
    want, free = read_all(cache), cache.pool.manager.gpu.num_free
    twin = make(cache)
    assert cache.pool.manager.gpu.num_free == free and twin.memory_usage() == cache.memory_usage()
    twin.write_kv(0, 2, -x[0], -x[0])
    twin.shift_left(1)
    cache.write_kv(1, 6, x[0], x[0])
    np.testing.assert_array_equal(read_all(cache)[:, :, :6], want)
    np.testing.assert_array_equal(read_all(twin)[:, :, 2:], want[:, :, 3:])
    np.testing.assert_array_equal(twin.read_k(0, 0, 1), expected(KVCacheFormat.FP8_E4M3, -x[:1])[0, :D])
    assert (cache.seq_len, twin.seq_len) == (7, 5)


def test_caches_sharing_a_pool_never_see_each_others_data():
    pool = KVPool(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.int8, block_size=BS, num_blocks=3)
    a = QuantizedKVCache(L, H, MAX, D, KVCacheFormat.INT8, pool=pool)
    fill(a, vectors(20, 3 * BS), vectors(21, 3 * BS))
    a.reset()
    b = QuantizedKVCache(L, H, MAX, D, "INT8", pool=pool)
    b.write_kv(0, 2 * BS + 1, GOOD, GOOD)  # takes all three recycled pages
    got = read_all(b)
    assert not got[1].any() and not got[0, :, : 2 * BS + 1].any()
    assert not any(s.any() for s in b.k_scales[1:])


def test_full_fixed_pool_raises_and_changes_nothing():
    pool = KVPool(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float32, block_size=BS, num_blocks=2)
    cache = QuantizedKVCache(L, H, MAX, D, KVCacheFormat.F32, pool=pool)
    fill(cache, vectors(22, 2 * BS - 1), vectors(23, 2 * BS - 1))
    twin = cache.copy()
    for c, pos in ((cache, 2 * BS), (twin, 1)):  # a new page, or a copy of a shared one: none free
        before = state(c)
        with pytest.raises(OutOfBlocksError):
            c.write_kv(0, pos, GOOD, GOOD)
        assert state(c) == before


# -- against a dense model --------------------------------------------------------------------------------
class Dense:
    """The documented cache as a dense array of dequantized values."""

    def __init__(self, fmt: KVCacheFormat) -> None:
        self.fmt, self.data, self.len = fmt, np.zeros((L, 2, MAX, H * D), np.float32), 0

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        if pos >= self.len:
            self.data[:, :, self.len:pos + 1] = 0
            self.len = pos + 1
        self.data[layer, :, pos] = expected(self.fmt, np.stack([k, v]))

    def shift(self, n: int) -> None:
        n = min(n, self.len)
        self.data[:, :, : self.len - n] = self.data[:, :, n: self.len].copy()
        self.len -= n


@pytest.mark.parametrize("fmt", [KVCacheFormat.F32, KVCacheFormat.INT8])
def test_random_operations_match_a_dense_model(fmt):
    rng = np.random.default_rng(24)
    caches = [(new(fmt), Dense(fmt))]
    for step in range(150):
        i = int(rng.integers(len(caches)))
        cache, model = caches[i]
        ops = ["write", "write", "write", "truncate", "shift", "copy", "reset"]
        op = rng.choice(ops, p=[.3, .2, .2, .1, .1, .05, .05])
        if op == "write":
            layer, pos = int(rng.integers(L)), int(min(rng.integers(model.len + 3), MAX - 1))
            k, v = vectors(step, 2)
            cache.write_kv(layer, pos, k, v)
            model.write(layer, pos, k, v)
        elif op == "truncate":
            n = int(rng.integers(model.len + 2))
            cache.truncate(n)
            model.len = min(model.len, n)
        elif op == "shift":
            n = int(rng.integers(model.len + 2))
            cache.shift_left(n)
            model.shift(n)
        elif op == "copy" and len(caches) < 4:
            twin = Dense(fmt)
            twin.data, twin.len = model.data.copy(), model.len
            caches.append((cache.copy(), twin))
        elif op == "reset":
            cache.reset()
            model.len = 0
        for c, m in caches:
            assert c.seq_len == m.len
            held = read_all(c).reshape(L, 2, m.len, H * D)
            np.testing.assert_array_equal(held, m.data[:, :, : m.len], err_msg=f"{step}")
            assert c.memory_usage() <= (-(-m.len // BS) + 1) * c.pool.bytes_per_page
        cache.pool.manager.check()

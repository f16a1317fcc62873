"""Tests of kernels/cache_write.py: Triton (interpreter) vs torch reference vs a naive per-token loop."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from backend_device import call_on_backend

import kernels.cache_write as write_kv_module
from kernels.cache_write import write_kv, write_kv_prepared
from kernels.metadata import prepare_attention_metadata
from kernels.quant import as_storage, is_quantized, quant_max, quantize_per_token_head
from paged_kv.errors import InvalidArgumentError, OutOfRangeError

CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
SENTINEL_BYTE = 0x7F  # NaN for every float/fp8 cache byte pattern used; 127 for int8


@dataclass
class Cache:
    """One layer's K/V cache (and scales when quantized), pre-filled with sentinel bytes."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the layer, for byte comparisons."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def snapshot(self) -> list[torch.Tensor]:
        """Byte copies of every tensor."""
        return [raw(t).clone() for t in self.tensors()]


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes."""
    return t.contiguous().view(torch.uint8)


def make_cache(num_blocks: int, block_size: int, heads: int, head_dim: int, dtype: torch.dtype) -> Cache:
    """A cache whose every byte is the sentinel (NaN floats, 0x7F codes)."""

    def filled(*shape: int, dt: torch.dtype) -> torch.Tensor:
        t = torch.empty(*shape, dtype=dt)
        raw(t).fill_(SENTINEL_BYTE)
        return t

    k = filled(num_blocks, block_size, heads, head_dim, dt=dtype)
    v = filled(num_blocks, block_size, heads, head_dim, dt=dtype)
    if not is_quantized(dtype):
        return Cache(k, v, None, None)
    k_scale = filled(num_blocks, block_size, heads, dt=torch.float32)
    v_scale = filled(num_blocks, block_size, heads, dt=torch.float32)
    return Cache(k, v, k_scale, v_scale)


def run(cache: Cache, key, value, slots, backend: str) -> None:
    """write_kv into ``cache``, on the backend's device (the CPU cache receives the result)."""
    scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    call_on_backend(write_kv, key, value, cache.k, cache.v, slots, **scales, backend=backend)


def naive_expectation(cache: Cache, key, value, slots) -> list[torch.Tensor]:
    """Bytes after writing token by token in a Python loop."""
    out = Cache(*[None if t is None else t.clone() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale)])
    block_size = cache.k.shape[1]
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for x, dst, scale in ((key, out.k, out.k_scale), (value, out.v, out.v_scale)):
            if scale is None:
                dst[block, offset] = x[i].to(dst.dtype)
                continue
            codes, scales = quantize_per_token_head(x[i : i + 1], dst.dtype)
            as_storage(dst)[block, offset] = as_storage(codes[0])
            scale[block, offset] = scales[0]
    return [raw(t) for t in out.tensors()]


def sample(num_tokens: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """key, value [T, H, D] over several magnitudes, with one all-zero head vector."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-3, 3, num_tokens)[:, None, None]
    key = torch.randn(num_tokens, heads, head_dim, generator=gen) * spread
    value = torch.randn(num_tokens, heads, head_dim, generator=gen)
    key[0, heads - 1] = 0.0
    return key.to(dtype), value.to(dtype)


def random_slots(num_tokens: int, num_slots: int, seed: int, dtype=torch.int64) -> torch.Tensor:
    """Distinct slots with every third token padded (-1)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::3] = -1
    return slots.to(dtype)


# (heads, head_dim, block_size, num_blocks)
CONFIGS = [(1, 8, 4, 3), (4, 12, 8, 2), (2, 64, 16, 2)]


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS)
def test_triton_matches_reference_and_naive(dtype: torch.dtype, config: tuple[int, int, int, int]) -> None:
    heads, head_dim, block_size, num_blocks = config
    key, value = sample(10, heads, head_dim, torch.float32, seed=heads + head_dim)
    slots = random_slots(10, num_blocks * block_size, seed=block_size)
    caches = {b: make_cache(num_blocks, block_size, heads, head_dim, dtype) for b in ("triton", "torch")}
    expected = naive_expectation(caches["torch"], key, value, slots)
    for backend, cache in caches.items():
        run(cache, key, value, slots, backend)
        for got, want in zip(cache.tensors(), expected):
            assert torch.equal(raw(got), want), backend


@pytest.mark.parametrize("key_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.int8])
def test_input_dtype_differs_from_cache(key_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    key, value = sample(6, 2, 16, key_dtype, seed=7)
    slots = random_slots(6, 16, seed=8, dtype=torch.int32)
    caches = [make_cache(2, 8, 2, 16, cache_dtype) for _ in range(2)]
    expected = naive_expectation(caches[0], key, value, slots)
    run(caches[0], key, value, slots, "triton")
    ref = caches[1]
    write_kv(key, value, ref.k, ref.v, slots, k_scale=ref.k_scale, v_scale=ref.v_scale, backend="torch")
    for cache in caches:
        assert all(torch.equal(raw(g), w) for g, w in zip(cache.tensors(), expected))


def test_bfloat16_rounds_half_to_even() -> None:
    # 1 + 2**-8 ties between 1 and 1 + 2**-7 (even: 1); 1 + 3 * 2**-8 ties upward to 1 + 2**-6
    row = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20])
    key = row.reshape(1, 1, 4)
    cache = make_cache(1, 1, 1, 4, torch.bfloat16)
    run(cache, key, key, torch.tensor([0]), "triton")
    assert cache.k.flatten().float().tolist() == [1.0, 1 + 2**-6, -1.0, 1 + 2**-7]


def fp8_nearest_even(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Oracle: the finite fp8 code nearest to each y, ties to the even code."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).float()
    finite = torch.isfinite(values)
    codes, values = codes[finite], values[finite]
    dist = (values[None, :] - y.reshape(-1, 1)).abs()  # [N, codes]
    best = dist.min(dim=1, keepdim=True).values
    wrong_sign = torch.signbit(values)[None, :] != torch.signbit(y.reshape(-1, 1))  # +0 vs -0
    tie_break = (codes.to(torch.int64) & 1)[None, :] * 1000 + wrong_sign * 10
    pick = torch.where(dist == best, tie_break, torch.full_like(tie_break, 10**6)).argmin(dim=1)
    return codes[pick].reshape(y.shape)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_codes_round_to_nearest_even_at_every_tie(dtype: torch.dtype) -> None:
    qmax = quant_max(dtype)
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = torch.sort(values[torch.isfinite(values) & (values >= 0)]).values
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties, subnormal range included
    y = torch.cat([grid, mids, grid[1:] * 0.999, -mids, -grid])
    width = 31  # each row: [qmax, 31 values] -> scale 1, codes are y rounded
    y = torch.cat([y, torch.zeros(-y.numel() % width)]).reshape(-1, width)
    key = torch.cat([torch.full((y.shape[0], 1), qmax), y], dim=1).reshape(-1, 1, width + 1)
    slots = torch.arange(key.shape[0])
    caches = [make_cache(1, key.shape[0], 1, width + 1, dtype) for _ in range(2)]
    for cache, backend in zip(caches, ("triton", "torch")):
        run(cache, key, key, slots, backend)
        assert torch.all(cache.k_scale == 1.0)
        got = raw(cache.k).reshape(-1, width + 1)[:, 1:]
        assert torch.equal(got, fp8_nearest_even(y, dtype)), backend


def test_int8_codes_round_half_to_even() -> None:
    key = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.4999]).reshape(1, 1, 10)
    cache = make_cache(1, 2, 1, 10, torch.int8)
    run(cache, key, key, torch.tensor([1]), "triton")
    assert cache.k[0, 1, 0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126, 3]
    assert cache.k_scale[0, 1, 0].item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_strided_key_from_fused_qkv(dtype: torch.dtype) -> None:
    qkv = torch.randn(5, 3 * 2 * 16, generator=torch.Generator().manual_seed(9))
    key = qkv[:, 32:64].view(5, 2, 16)  # strides (96, 16, 1): not contiguous
    value = qkv[:, 64:].view(5, 2, 16)
    slots = torch.tensor([3, -1, 0, 7, 5])
    caches = [make_cache(2, 4, 2, 16, dtype) for _ in range(2)]
    run(caches[0], key, value, slots, "triton")
    run(caches[1], key.contiguous(), value.contiguous(), slots, "torch")
    assert all(torch.equal(raw(a), raw(b)) for a, b in zip(caches[0].tensors(), caches[1].tensors()))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_padding_and_empty_batches_write_nothing(backend: str) -> None:
    key, value = sample(4, 2, 8, torch.float32, seed=1)
    cache = make_cache(2, 4, 2, 8, torch.float8_e4m3fn)
    before = cache.snapshot()
    run(cache, key, value, torch.full((4,), -1), backend)
    run(cache, key[:0], value[:0], torch.empty(0, dtype=torch.int64), backend)
    assert all(torch.equal(raw(t), b) for t, b in zip(cache.tensors(), before))


def test_auto_backend_runs_torch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object) -> None:
        raise AssertionError("Triton path taken for CPU tensors")

    monkeypatch.setattr(write_kv_module, "_write_triton", forbidden)
    key, value = sample(3, 1, 8, torch.float32, seed=2)
    cache = make_cache(1, 4, 1, 8, torch.float32)
    run(cache, key, value, torch.tensor([2, 0, -1]), "auto")
    assert torch.equal(cache.k[0, 2], key[0]) and torch.equal(cache.v[0, 0], value[1])


def _error_cases():
    """(description, kwargs overrides, expected error) for write_kv's validation."""
    f32, i8 = torch.float32, torch.int8
    return [
        ("slot past the end", dict(slots=torch.tensor([0, 16, 1])), OutOfRangeError),
        ("duplicate slot", dict(slots=torch.tensor([5, -1, 5])), InvalidArgumentError),
        ("float slots", dict(slots=torch.tensor([0.0, 1.0, 2.0])), InvalidArgumentError),
        ("slots too short", dict(slots=torch.tensor([0, 1])), InvalidArgumentError),
        ("value shape", dict(value=torch.zeros(3, 2, 4)), InvalidArgumentError),
        ("head count", dict(key=torch.zeros(3, 1, 8), value=torch.zeros(3, 1, 8)), InvalidArgumentError),
        ("zero heads", dict(key=torch.zeros(3, 0, 8), value=torch.zeros(3, 0, 8)), InvalidArgumentError),
        ("integer key", dict(key=torch.zeros(3, 2, 8, dtype=torch.int32)), InvalidArgumentError),
        ("key not a tensor", dict(key=[[0.0]]), InvalidArgumentError),
        ("cache dtypes differ", dict(v_cache=torch.zeros(2, 8, 2, 8, dtype=torch.float8_e5m2)), InvalidArgumentError),
        ("cache not contiguous", dict(k_cache=torch.zeros(2, 8, 8, 2, dtype=i8).transpose(2, 3)), InvalidArgumentError),
        ("missing scale", dict(k_scale=None), InvalidArgumentError),
        ("scale shape", dict(v_scale=torch.zeros(2, 8, 1, dtype=f32)), InvalidArgumentError),
        ("scale dtype", dict(v_scale=torch.zeros(2, 8, 2, dtype=torch.float16)), InvalidArgumentError),
        ("device mismatch", dict(slots=torch.zeros(3, dtype=torch.int64, device="meta")), InvalidArgumentError),
        ("unknown backend", dict(backend="cuda"), InvalidArgumentError),
    ]


@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
@pytest.mark.parametrize("case", _error_cases(), ids=lambda c: c[0])
def test_bad_input_raises_typed_error_and_writes_nothing(backend: str, case) -> None:
    _, overrides, error = case
    key, value = sample(3, 2, 8, torch.float32, seed=3)
    cache = make_cache(2, 8, 2, 8, torch.int8)
    before = cache.snapshot()
    args = dict(key=key, value=value, k_cache=cache.k, v_cache=cache.v, slots=torch.tensor([0, 3, 9]),
                k_scale=cache.k_scale, v_scale=cache.v_scale, backend=backend)  # fmt: skip
    args.update(overrides)
    with pytest.raises(error):
        call_on_backend(write_kv, args["key"], args["value"], args["k_cache"], args["v_cache"], args["slots"],
                 k_scale=args["k_scale"], v_scale=args["v_scale"], backend=args["backend"])  # fmt: skip
    assert all(torch.equal(raw(t), b) for t, b in zip(cache.tensors(), before))


def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    key, value = sample(2, 1, 8, torch.float32, seed=5)
    cache = make_cache(1, 4, 1, 8, torch.float32)
    before = cache.snapshot()
    with pytest.raises(InvalidArgumentError, match="backend"):  # CPU tensors, on purpose
        write_kv(key, value, cache.k, cache.v, torch.tensor([0, 1]), backend="triton")
    assert all(torch.equal(raw(t), b) for t, b in zip(cache.tensors(), before))


def test_scales_forbidden_for_float_cache() -> None:
    key, value = sample(2, 1, 8, torch.float32, seed=4)
    cache = make_cache(1, 4, 1, 8, torch.float16)
    before = cache.snapshot()
    with pytest.raises(InvalidArgumentError, match="k_scale"):
        call_on_backend(
            write_kv, key, value, cache.k, cache.v, torch.tensor([0, 1]), k_scale=torch.zeros(1, 4, 1), backend="triton"
        )
    assert all(torch.equal(raw(t), b) for t, b in zip(cache.tensors(), before))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_prepared_write_rejects_a_scale_on_another_device(backend: str) -> None:
    key, value = sample(2, 2, 8, torch.float32, seed=6)
    cache = make_cache(2, 8, 2, 8, torch.int8)
    meta = prepare_attention_metadata([[0], [1]], [0, 0], [1, 1], block_size=8, num_blocks=2)
    before = cache.snapshot()
    elsewhere = torch.zeros(2, 8, 2, device="meta")  # on a GPU: a CPU scale beside a CUDA cache
    with pytest.raises(InvalidArgumentError, match="v_scale.device"):
        call_on_backend(write_kv_prepared, key, value, cache.k, cache.v, meta, k_scale=cache.k_scale,
                        v_scale=elsewhere, backend=backend)  # fmt: skip
    assert all(torch.equal(raw(t), b) for t, b in zip(cache.tensors(), before))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_cuda_triton_matches_cpu_reference(dtype: torch.dtype) -> None:
    key, value = sample(33, 8, 128, torch.bfloat16, seed=11)
    slots = random_slots(33, 4 * 16, seed=12)
    cpu = make_cache(4, 16, 8, 128, dtype)
    gpu = Cache(*[None if t is None else t.cuda() for t in (cpu.k, cpu.v, cpu.k_scale, cpu.v_scale)])
    run(cpu, key, value, slots, "torch")
    run(gpu, key.cuda(), value.cuda(), slots.cuda(), "auto")
    assert all(torch.equal(raw(g).cpu(), raw(c)) for g, c in zip(gpu.tensors(), cpu.tensors()))

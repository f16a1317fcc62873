"""Tests of kernels/block_copy.py: one-launch block copies (Triton interpreter vs torch vs naive) and swaps."""

from __future__ import annotations

import pytest
import torch
from backend_device import TRITON_DEVICE, call_on_backend, gpu_test

import kernels.block_copy as copy_module
from kernels.block_copy import copy_blocks, mapping_to_pairs, swap_blocks
from paged_kv.errors import InvalidArgumentError, OutOfRangeError

NUM_BLOCKS = 7


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes."""
    return t.contiguous().view(torch.uint8)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype`` (NaN patterns included: comparisons are bytewise)."""
    t = torch.empty(shape, dtype=dtype)
    raw(t).copy_(torch.randint(0, 256, raw(t).shape, dtype=torch.uint8, generator=gen))
    return t


def layer_tensors(seed: int, extra: tuple[tuple[int, ...], torch.dtype] | None = None) -> list[torch.Tensor]:
    """Two layers of K/V caches of every dtype plus their scales; an optional oddly sized tensor."""
    gen = torch.Generator().manual_seed(seed)
    specs = [
        ((NUM_BLOCKS, 4, 2, 8), torch.float32), ((NUM_BLOCKS, 4, 2, 8), torch.float16),
        ((NUM_BLOCKS, 4, 2, 8), torch.bfloat16), ((NUM_BLOCKS, 4, 2, 8), torch.int8),
        ((NUM_BLOCKS, 4, 2, 8), torch.float8_e4m3fn), ((NUM_BLOCKS, 4, 2), torch.float32),
        ((NUM_BLOCKS, 2, 1, 16), torch.float8_e5m2), ((NUM_BLOCKS, 2, 1), torch.float32),
    ]  # fmt: skip
    if extra is not None:
        specs.append(extra)
    return [random_tensor(shape, dtype, gen) for shape, dtype in specs]


def naive_copy(tensors: list[torch.Tensor], pairs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Expected bytes: each pair copied block by block in a Python loop."""
    out = [raw(t).clone() for t in tensors]  # bytes [num_blocks * bytes_per_block]
    for t, o in zip(tensors, out):
        blocks = o.view(t.shape[0], -1)
        for src, dst in pairs:
            blocks[dst] = blocks[src]
    return out


# extras that force word sizes 1, 2 and 4 (the default set copies 8-byte words), and blocks
# larger than one program's chunk of 1024 words
EXTRAS = {
    "words8": None,
    "words4": ((NUM_BLOCKS, 3), torch.float32),
    "words2": ((NUM_BLOCKS, 5), torch.float16),
    "words1": ((NUM_BLOCKS, 3), torch.uint8),
    "words8-2chunks": ((NUM_BLOCKS, 3, 1000), torch.float32),
    "words1-3chunks": ((NUM_BLOCKS, 2101), torch.uint8),
}
PAIRS = [(0, 3), (0, 5), (2, 6), (1, 4)]  # block 0 forked twice


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("extra", list(EXTRAS), ids=str)
def test_copy_matches_naive(backend: str, extra: str) -> None:
    tensors = layer_tensors(seed=len(extra), extra=EXTRAS[extra])
    expected = naive_copy(tensors, PAIRS)
    call_on_backend(copy_blocks, tensors, PAIRS, backend=backend)
    for t, want in zip(tensors, expected):
        assert torch.equal(raw(t), want)


def test_word_size_follows_the_least_aligned_tensor() -> None:
    for name, word in (("words8", 8), ("words4", 4), ("words2", 2), ("words1", 1), ("words1-3chunks", 1)):
        assert copy_module._word_bytes(layer_tensors(0, EXTRAS[name])) == word
    offset_view = torch.zeros(NUM_BLOCKS * 4 + 1, dtype=torch.int32)[1:].view(NUM_BLOCKS, 4)
    assert copy_module._word_bytes([offset_view]) == 4  # address only 4-byte aligned


@pytest.mark.parametrize("mapping_dtype", [torch.int32, torch.int64])
def test_tensor_mapping_and_reference_agree(mapping_dtype: torch.dtype) -> None:
    a, b = layer_tensors(seed=5), layer_tensors(seed=5)
    mapping = torch.tensor(PAIRS, dtype=mapping_dtype)
    call_on_backend(copy_blocks, a, mapping, backend="triton")
    copy_blocks(b, mapping, backend="torch")
    assert all(torch.equal(raw(x), raw(y)) for x, y in zip(a, b))
    assert torch.equal(mapping, torch.tensor(PAIRS, dtype=mapping_dtype))  # input untouched


def test_repeated_calls_reuse_and_refresh_the_address_table() -> None:
    # the same device tensors twice: the second call finds the first call's table
    first, second = ([t.to(TRITON_DEVICE) for t in layer_tensors(seed=seed)] for seed in (6, 7))
    for tensors in (first, first, second):
        expected = naive_copy(tensors, [(1, 2)])
        call_on_backend(copy_blocks, tensors, [(1, 2)], backend="triton")  # already there: nothing moves
        assert all(torch.equal(raw(t), w) for t, w in zip(tensors, expected))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty_mapping_is_a_no_op(backend: str) -> None:
    tensors = layer_tensors(seed=8)
    before = [raw(t).clone() for t in tensors]
    call_on_backend(copy_blocks, tensors, [], backend=backend)
    call_on_backend(copy_blocks, tensors, torch.empty(0, 2, dtype=torch.int64), backend=backend)
    assert all(torch.equal(raw(t), b) for t, b in zip(tensors, before))


def test_mapping_to_pairs_normalizes_inputs() -> None:
    import numpy as np

    pairs = mapping_to_pairs([(np.int64(1), 2), [3, torch.tensor(4)]])
    assert pairs.dtype == torch.int64 and pairs.tolist() == [[1, 2], [3, 4]]
    assert mapping_to_pairs(()).shape == (0, 2)


def _copy_error_cases():
    """(id, caches override or None, mapping, expected error)."""
    return [
        ("dst past the end", None, [(0, NUM_BLOCKS)], OutOfRangeError),
        ("negative src", None, [(-1, 2)], OutOfRangeError),
        ("duplicate dst", None, [(0, 2), (1, 2)], InvalidArgumentError),
        ("id both src and dst", None, [(0, 2), (2, 3)], InvalidArgumentError),
        ("float pair", None, [(0, 2.0)], InvalidArgumentError),
        ("triple", None, [(0, 2, 3)], InvalidArgumentError),
        ("mapping not pairs", None, 5, InvalidArgumentError),
        ("float tensor mapping", None, torch.tensor([[0.0, 1.0]]), InvalidArgumentError),
        ("mapping shape", None, torch.tensor([0, 1]), InvalidArgumentError),
        ("num_blocks differ", [torch.zeros(NUM_BLOCKS - 1, 4)], [(0, 1)], InvalidArgumentError),
        ("not contiguous", [torch.zeros(4, NUM_BLOCKS).t()], [(0, 1)], InvalidArgumentError),
        ("other device", [torch.zeros(NUM_BLOCKS, 4, device="meta")], [(0, 1)], InvalidArgumentError),
        ("not a tensor", [[0.0] * NUM_BLOCKS], [(0, 1)], InvalidArgumentError),
    ]


@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
@pytest.mark.parametrize("case", _copy_error_cases(), ids=lambda c: c[0])
def test_copy_rejects_bad_input_and_writes_nothing(backend: str, case) -> None:
    _, extra, mapping, error = case
    tensors = layer_tensors(seed=9)
    before = [raw(t).clone() for t in tensors]
    with pytest.raises(error):
        call_on_backend(copy_blocks, tensors + (extra or []), mapping, backend=backend)
    assert all(torch.equal(raw(t), b) for t, b in zip(tensors, before))


def test_copy_rejects_bad_caches_and_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgumentError, match="caches"):
        copy_blocks([], [(0, 1)])
    with pytest.raises(InvalidArgumentError, match="caches"):
        copy_blocks(torch.zeros(NUM_BLOCKS, 4), [(0, 1)])
    tensors = layer_tensors(seed=10)
    before = [raw(t).clone() for t in tensors]
    with pytest.raises(InvalidArgumentError, match="backend"):
        copy_blocks(tensors, [(0, 1)], backend="gpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors cannot run Triton without the interpreter
    with pytest.raises(InvalidArgumentError, match="backend"):
        copy_blocks(tensors, [(0, 1)], backend="triton")
    assert all(torch.equal(raw(t), b) for t, b in zip(tensors, before))


def test_auto_backend_runs_torch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object) -> None:
        raise AssertionError("Triton path taken for CPU tensors")

    monkeypatch.setattr(copy_module, "_copy_triton", forbidden)
    tensors = layer_tensors(seed=11)
    expected = naive_copy(tensors, PAIRS)
    copy_blocks(tensors, PAIRS)
    assert all(torch.equal(raw(t), w) for t, w in zip(tensors, expected))


# ---------------------------------------------------------------- swap_blocks


def pool(num_blocks: int, seed: int) -> list[torch.Tensor]:
    """A pool of K cache, V cache (fp8) and scales with ``num_blocks`` blocks."""
    gen = torch.Generator().manual_seed(seed)
    return [
        random_tensor((num_blocks, 4, 2, 8), torch.bfloat16, gen),
        random_tensor((num_blocks, 4, 2, 8), torch.float8_e4m3fn, gen),
        random_tensor((num_blocks, 4, 2), torch.float32, gen),
    ]


def test_swap_between_pools_of_different_sizes() -> None:
    cpu_pool, device_pool = pool(3, seed=1), pool(9, seed=2)
    device_before = [raw(t).clone() for t in device_pool]
    swap_blocks(cpu_pool, device_pool, [(0, 8), (2, 0), (1, 2)])  # swap in
    for c, d, b in zip(cpu_pool, device_pool, device_before):
        moved = raw(d).view(9, -1)
        assert torch.equal(moved[[8, 0, 2]], raw(c).view(3, -1)[[0, 2, 1]])
        untouched = [1, 3, 4, 5, 6, 7]
        assert torch.equal(moved[untouched], b.view(9, -1)[untouched])
    swap_blocks(device_pool, cpu_pool, torch.tensor([[8, 1], [8, 2]]))  # one block out twice
    for c, d in zip(cpu_pool, device_pool):
        assert torch.equal(raw(c).view(3, -1)[1], raw(d).view(9, -1)[8])
        assert torch.equal(raw(c).view(3, -1)[2], raw(d).view(9, -1)[8])


def test_swap_within_one_pool_reads_before_writing() -> None:
    tensors = pool(4, seed=3)
    before = [raw(t).clone().view(4, -1) for t in tensors]
    swap_blocks(tensors, tensors, [(0, 1), (1, 0)])  # an exchange: reads all sources first
    for t, b in zip(tensors, before):
        assert torch.equal(raw(t).view(4, -1)[[0, 1, 2, 3]], b[[1, 0, 2, 3]])


@pytest.mark.parametrize(
    "case",
    [
        ("src id past src pool", lambda s, d: (s, d, [(3, 0)]), OutOfRangeError),
        ("dst id past dst pool", lambda s, d: (s, d, [(0, 9)]), OutOfRangeError),
        ("duplicate dst", lambda s, d: (s, d, [(0, 1), (2, 1)]), InvalidArgumentError),
        ("dtype differs", lambda s, d: (s, [d[0].float(), *d[1:]], [(0, 1)]), InvalidArgumentError),
        ("shape differs", lambda s, d: (s, [*d[:2], d[2][:, :2].contiguous()], [(0, 1)]), InvalidArgumentError),
        ("pool lengths differ", lambda s, d: (s, d[:2], [(0, 1)]), InvalidArgumentError),
        ("empty pools", lambda s, d: ([], [], [(0, 1)]), InvalidArgumentError),
        ("mixed devices in a pool", lambda s, d: (s, [*d[:2], d[2].to("meta")], [(0, 1)]), InvalidArgumentError),
    ],
    ids=lambda c: c[0],
)
def test_swap_rejects_bad_input_and_writes_nothing(case) -> None:
    _, build, error = case
    src, dst = pool(3, seed=4), pool(9, seed=5)
    before = [raw(t).clone() for t in src + dst]
    args = build(src, dst)
    with pytest.raises(error):
        swap_blocks(*args)
    assert all(torch.equal(raw(t), b) for t, b in zip(src + dst, before))


def test_all_tensors_and_pairs_copied_in_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    launches = []
    kernel = copy_module._copy_blocks_kernel

    class CountingKernel:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(copy_module, "_copy_blocks_kernel", CountingKernel())
    tensors = layer_tensors(seed=12, extra=EXTRAS["words1-3chunks"])
    expected = naive_copy(tensors, PAIRS)
    call_on_backend(copy_blocks, tensors, PAIRS, backend="triton")
    assert launches == [(len(PAIRS), len(tensors), 3)]
    assert all(torch.equal(raw(t), w) for t, w in zip(tensors, expected))


@gpu_test
def test_cuda_copy_matches_reference() -> None:
    on_gpu = [t.cuda() for t in layer_tensors(seed=13, extra=EXTRAS["words8-2chunks"])]
    reference = [t.clone() for t in on_gpu]
    copy_blocks(on_gpu, torch.tensor(PAIRS, device="cuda"))  # auto: Triton
    copy_blocks(reference, PAIRS, backend="torch")
    assert all(torch.equal(raw(a), raw(b)) for a, b in zip(on_gpu, reference))


@gpu_test
@pytest.mark.parametrize("pinned", [True, False])
def test_cuda_swap_out_and_in(pinned: bool) -> None:
    cpu_pool = [t.pin_memory() if pinned else t for t in pool(3, seed=6)]
    gpu_pool = [t.cuda() for t in pool(9, seed=7)]
    original = [raw(t).cpu().view(9, -1).clone() for t in gpu_pool]
    swap_blocks(gpu_pool, cpu_pool, [(4, 0), (7, 2)])  # out
    for c, o in zip(cpu_pool, original):
        assert torch.equal(raw(c).view(3, -1)[[0, 2]], o[[4, 7]])
    swap_blocks(cpu_pool, gpu_pool, [(0, 1), (2, 8)])  # back in, elsewhere
    torch.cuda.synchronize()
    for g, o in zip(gpu_pool, original):
        assert torch.equal(raw(g).cpu().view(9, -1)[[1, 8]], o[[4, 7]])

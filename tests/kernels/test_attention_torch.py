"""The torch attention core (the CPU engine's path): slot layout, scratch reuse, strided caches, no host reads.

Decode and prefill results are compared with attention_cases' dense float64 truth (caches with
NaN in every slot no sequence owns) or with the same call on a contiguous cache.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import (
    F32,
    I8,
    TOL,
    assert_close,
    build_paged,
    cu_seqlens,
    naive_decode,
    naive_prefill,
    random_q,
    run_decode,
    run_prefill,
)
from no_host_reads import forbid_host_reads

import kernels.attention_torch as core
import kernels.decode_attention as dec
import kernels.prefill_attention as pre
from kernels.attention_torch import scratch, token_slots


def test_token_slots_read_only_entries_in_use():
    # block size 4; seq 0: 10 tokens, window start 5; seq 1: 3 tokens; seq 2: empty
    tables = torch.tensor([[-9, 7, 2, 99], [5, -1, -1, -1], [-3, -3, -3, -3]], dtype=torch.int32)
    lens = torch.tensor([10, 3, 0], dtype=torch.int32)
    kv_start = torch.tensor([5, 0, 0])
    slots, inside = token_slots(tables, lens, kv_start, 12, 4)
    # positions < 5 clamp to 5 (block 7, slot 1), positions >= 10 to 9 (block 2, slot 1)
    assert slots[0].tolist() == [29] * 6 + [30, 31, 8, 9] + [9] * 2
    assert slots[1].tolist() == [20, 21, 22] + [22] * 9
    assert slots[2].tolist() == [0] * 12  # an empty sequence reads slot 0, never its table
    assert inside[0].tolist() == [False] * 5 + [True] * 5 + [False] * 2
    assert inside[1].tolist() == [True] * 3 + [False] * 9
    assert not inside[2].any()


def test_token_slots_from_start_lays_out_the_window():
    tables = torch.tensor([[-9, 7, 2, 99], [5, -1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([10, 3], dtype=torch.int32)
    slots, inside = token_slots(tables, lens, torch.tensor([6, 0]), 4, 4, from_start=True)
    assert slots.tolist() == [[30, 31, 8, 9], [20, 21, 22, 22]]  # columns are positions 6..9 and 0..3
    assert inside.tolist() == [[True] * 4, [True] * 3 + [False]]


def test_scratch_reuses_one_buffer_per_role_and_dtype():
    a = scratch("test-a", (4, 8), torch.float32, torch.device("cpu"))
    b = scratch("test-a", (2, 3), torch.float32, torch.device("cpu"))
    c = scratch("test-b", (2, 3), torch.float32, torch.device("cpu"))
    d = scratch("test-a", (2, 3), torch.int64, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and b.shape == (2, 3)
    assert c.data_ptr() != a.data_ptr() and d.data_ptr() != a.data_ptr()
    grown = scratch("test-a", (64, 64), torch.float32, torch.device("cpu"))
    assert grown.shape == (64, 64) and grown.numel() == 64 * 64
    huge = (core.SCRATCH_MAX_BYTES // 4 + 1,)
    first, second = (scratch("test-a", huge, torch.float32, torch.device("meta")) for _ in range(2))
    assert first.shape == huge and first is not second  # not kept: other devices get fresh tensors


def test_scratch_made_in_inference_mode_is_written_outside_it():
    """The engine's forward runs in inference mode; a later direct kernel call must still reuse the buffers."""
    with torch.inference_mode():
        made = scratch("test-inference", (4, 8), torch.float32, torch.device("cpu"))
    again = scratch("test-inference", (4, 8), torch.float32, torch.device("cpu"))
    again.fill_(1.0)  # an inference tensor would refuse this in-place write
    assert again.data_ptr() == made.data_ptr() and not again.is_inference()


def _decode_inputs(dtype=F32, seed=21):
    paged = build_paged(
        [5, 33, 17], block_size=8, num_kv_heads=2, head_dim=32, dtype=dtype, shared_blocks=1, seed=seed
    )
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(seed + 1))
    return paged, q


@pytest.mark.parametrize("dtype", [F32, I8], ids=["f32-embedding-bag", "int8-gather"])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_torch_path_reads_no_device_value(dtype, window):
    """Given (min_len, max_len) from the host, the torch decode path reads no tensor value (no device sync)."""
    paged, q = _decode_inputs(dtype)
    expected = run_decode(q, paged, backend="torch", sliding_window=window, return_lse=True)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens)
    with forbid_host_reads():
        out, lse = dec._decode_torch(*args, (32**-0.5, window, None), paged.k_scale, paged.v_scale, (5, 33), True)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    assert_close(out, naive_decode(q, paged, sliding_window=window)[0], TOL[F32])


def test_prefill_torch_path_reads_no_device_value():
    """Given (max_q, max_len, max_ctx) from the host, the torch prefill path reads no tensor value."""
    lens, q_lens = [32, 50, 1, 9], [32, 20, 1, 0]
    paged = build_paged(lens, block_size=16, num_kv_heads=2, head_dim=32, seed=25, shared_blocks=1)
    q = random_q(q_lens, 4, 32, F32, seed=26)
    expected = run_prefill(q, paged, q_lens, return_lse=True)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, cu_seqlens(q_lens))
    with forbid_host_reads():
        out, lse = pre._prefill_torch(*args, (32**-0.5, None, None), None, None, (32, 50, 30), True)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    assert_close(out, naive_prefill(q, paged, q_lens)[0], TOL[F32])


def _strided(cache: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in a non-contiguous tensor: every other block of a bigger one, or head_dim padded."""
    if how == "blocks":
        big = torch.full((2 * cache.shape[0], *cache.shape[1:]), math.nan)
        big[::2] = cache
        return big[::2]
    big = torch.full((*cache.shape[:3], 2 * cache.shape[3]), math.nan)
    big[..., : cache.shape[3]] = cache
    return big[..., : cache.shape[3]]


@pytest.mark.parametrize("how", ["blocks", "head_dim"])
def test_strided_float32_cache_takes_the_gather_path(how):
    """A non-contiguous float32 cache cannot be summed in place; gathered, it gives the contiguous result."""
    paged, q = _decode_inputs(seed=27)
    expected = run_decode(q, paged, backend="torch", return_lse=True)  # contiguous: embedding_bag
    k, v = _strided(paged.k_cache, how), _strided(paged.v_cache, how)
    assert not k.is_contiguous()
    out, lse = dec.paged_decode_attention(
        q, k, v, paged.block_tables, paged.seq_lens, return_lse=True, backend="torch"
    )
    torch.testing.assert_close(out, expected[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, expected[1], atol=1e-6, rtol=1e-5)
    assert_close(out, naive_decode(q, paged)[0], TOL[F32])


def test_window_covering_no_sequence_fully_needs_no_mask():
    """Every sequence at least as long as the window: L = window columns, all visible, no mask."""
    paged = build_paged([60, 55, 64], block_size=8, num_kv_heads=2, head_dim=32, seed=29, shared_blocks=2)
    paged.block_tables[0, :1] = paged.nan_block  # positions < 8 lie before the window of 50 at length 60
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(30))
    out, lse = run_decode(q, paged, backend="torch", sliding_window=50, return_lse=True)
    expected, expected_lse = naive_decode(q, paged, sliding_window=50)
    assert_close(out, expected, TOL[F32])
    assert_close(lse, expected_lse, TOL[F32])


def test_outputs_survive_later_calls():
    """Gather buffers are reused from call to call; what a call returns stays its own."""
    paged, q = _decode_inputs(seed=31)
    first = run_decode(q, paged, backend="torch", return_lse=True)
    kept = [t.clone() for t in first]
    other = build_paged([70, 9], block_size=16, num_kv_heads=4, head_dim=32, seed=33)
    run_decode(torch.randn(2, 8, 32), other, backend="torch", return_lse=True)
    run_prefill(torch.randn(79, 8, 32), other, [70, 9], return_lse=True, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(first, kept))
    again = run_decode(q, paged, backend="torch", return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(again, kept))

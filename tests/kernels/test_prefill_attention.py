"""Paged prefill / extend attention: Triton kernel (interpreter on CPU) and torch reference vs dense float64.

Batches mix full prefills, chunked extends over a cached prefix, decode-like q_len = 1
and empty (q_len = 0) sequences; caches come from attention_cases' builder (shuffled,
shared blocks, NaN in every slot no sequence owns).
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import (
    BF16,
    E5M2,
    F16,
    F32,
    I8,
    TOL,
    assert_close,
    assert_rejected,
    build_for_gpu,
    build_paged,
    cu_seqlens,
    fail_launch,
    naive_prefill,
    random_q,
    run_decode,
    run_prefill,
)
from backend_device import call_on_backend

import kernels.prefill_attention as pre
from kernels.prefill_attention import paged_prefill_attention
from paged_kv.errors import InvalidArgumentError, OutOfRangeError

# (q dtype, cache dtype, Hq, Hkv, head_dim, block_size, seq_lens, q_lens)
PREFILL_CASES = [
    pytest.param(F32, F32, 4, 4, 64, 16, [32, 50, 1, 9], [32, 20, 1, 0], id="mha-f32-full-extend-single-empty"),
    pytest.param(F16, F16, 8, 2, 80, 8, [40, 17, 24], [13, 1, 24], id="gqa-f16-d80-bs8"),
    pytest.param(BF16, BF16, 6, 1, 64, 32, [70, 33], [70, 2], id="mqa-bf16-group6-bs32"),
    pytest.param(F32, BF16, 4, 2, 128, 12, [30, 12], [11, 12], id="gqa-q32-kvbf16-d128-bs12"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("q_dtype,cache_dtype,hq,hkv,head_dim,block_size,lens,q_lens", PREFILL_CASES)
def test_prefill_matches_naive(backend, q_dtype, cache_dtype, hq, hkv, head_dim, block_size, lens, q_lens):
    paged = build_paged(
        lens, block_size=block_size, num_kv_heads=hkv, head_dim=head_dim, dtype=cache_dtype, seed=21, shared_blocks=1
    )
    q = random_q(q_lens, hq, head_dim, q_dtype, seed=22)
    out, lse = run_prefill(q, paged, q_lens, backend=backend, return_lse=True)
    expected, expected_lse = naive_prefill(q, paged, q_lens)
    assert out.dtype == q_dtype and out.shape == q.shape and lse.shape == q.shape[:2]
    assert_close(out, expected, TOL[q_dtype])
    assert_close(lse, expected_lse, TOL[q_dtype])
    assert_close(run_prefill(q, paged, q_lens, backend=backend), expected, TOL[q_dtype])  # torch: the SDPA path


@pytest.mark.parametrize(
    "q_dtype,cache_dtype", [(F32, F32), (F16, F16), (BF16, I8)], ids=["f32", "f16", "bf16-over-int8"]
)
def test_unmasked_tiles_below_the_diagonal(q_dtype, cache_dtype):
    """Long cached prefixes and a chunk over several query tiles: the kernel's unmasked full-tile phase."""
    lens, q_lens = [150, 97, 70], [40, 97, 3]  # extend over 110 cached; a 97-token prompt; a short extend
    paged = build_paged(lens, block_size=16, num_kv_heads=2, head_dim=64, dtype=cache_dtype, seed=31, shared_blocks=2)
    q = random_q(q_lens, 4, 64, q_dtype, seed=32)
    out, lse = run_prefill(q, paged, q_lens, backend="triton", return_lse=True)
    expected, expected_lse = naive_prefill(q, paged, q_lens)
    assert_close(out, expected, TOL[q_dtype])
    assert_close(lse, expected_lse, TOL[q_dtype])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_sliding_window_and_soft_cap(backend):
    lens, q_lens = [60, 23, 5], [44, 23, 1]
    paged = build_paged(lens, block_size=8, num_kv_heads=2, head_dim=64, dtype=F16, seed=23)
    paged.block_tables[0, :1] = paged.nan_block  # positions < 8: before every window of sequence 0
    q = random_q(q_lens, 4, 64, F16, seed=24, gain=3.0)  # large logits: the cap bites
    opts = dict(sliding_window=9, soft_cap=3.0, scale=0.25)
    out = run_prefill(q, paged, q_lens, backend=backend, **opts)
    expected = naive_prefill(q, paged, q_lens, **opts)[0]
    assert_close(out, expected, TOL[F16])
    assert (naive_prefill(q, paged, q_lens, scale=0.25)[0] - expected).abs().max() > 0.05


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_window_narrower_than_a_kv_tile(backend):
    # 60 new tokens at positions 40..99, window 4: for the query at 70 the whole KV tile 0..63
    # is masked before its first visible key, so the online softmax must start from an empty row.
    paged = build_paged([100], block_size=16, num_kv_heads=2, head_dim=64, seed=34)
    q = random_q([60], 4, 64, F32, seed=35)
    out = run_prefill(q, paged, [60], backend=backend, sliding_window=4)
    assert_close(out, naive_prefill(q, paged, [60], sliding_window=4)[0], TOL[F32])


@pytest.mark.parametrize("cache_dtype", [I8, E5M2])
def test_quantized_cache(cache_dtype):
    lens, q_lens = [40, 19], [17, 19]
    paged = build_paged(lens, block_size=16, num_kv_heads=2, head_dim=64, dtype=cache_dtype, seed=25, shared_blocks=1)
    q = random_q(q_lens, 4, 64, BF16, seed=26)
    expected = naive_prefill(q, paged, q_lens)[0]  # on the dequantized values
    assert_close(run_prefill(q, paged, q_lens, backend="triton"), expected, TOL[BF16])
    assert_close(run_prefill(q, paged, q_lens, backend="torch"), expected, TOL[BF16])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_q_len_one_equals_decode(backend):
    paged = build_paged([1, 29, 64], block_size=16, num_kv_heads=2, head_dim=64, dtype=F16, seed=27, shared_blocks=1)
    q = random_q([1, 1, 1], 8, 64, F16, seed=28)
    out, lse = run_prefill(q, paged, [1, 1, 1], backend=backend, return_lse=True, sliding_window=20)
    dec_out, dec_lse = run_decode(q, paged, backend=backend, return_lse=True, sliding_window=20)
    torch.testing.assert_close(out, dec_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, dec_lse, atol=1e-4, rtol=1e-4)


def test_auto_backend_on_cpu_runs_torch(monkeypatch):
    paged = build_paged([12, 5], block_size=8, num_kv_heads=1, head_dim=64, seed=29)
    q = random_q([4, 5], 2, 64, F32, seed=30)
    expected = run_prefill(q, paged, [4, 5], backend="torch")
    monkeypatch.setattr(pre, "_prefill_triton", fail_launch)
    torch.testing.assert_close(run_prefill(q, paged, [4, 5]), expected, atol=0, rtol=0)
    ref = paged_prefill_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, cu_seqlens([4, 5]), backend="torch"
    )
    torch.testing.assert_close(ref, expected, atol=0, rtol=0)


def test_reference_chunks_long_queries(monkeypatch):
    monkeypatch.setattr(pre, "MAX_LOGITS", 4 * 100 * 3)  # three query rows per chunk
    paged = build_paged([100, 7], block_size=16, num_kv_heads=2, head_dim=64, seed=31)
    q = random_q([10, 7], 4, 64, F32, seed=32)
    assert_close(run_prefill(q, paged, [10, 7], backend="torch"), naive_prefill(q, paged, [10, 7])[0], TOL[F32])


def test_empty_inputs():
    paged = build_paged([5], block_size=8, num_kv_heads=1, head_dim=64)
    cache = (paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens)
    out = call_on_backend(paged_prefill_attention, torch.zeros(0, 2, 64), *cache, cu_seqlens([0]), backend="triton")
    assert out.shape == (0, 2, 64)
    empty = call_on_backend(
        paged_prefill_attention, torch.zeros(0, 2, 64), paged.k_cache, paged.v_cache,
        paged.block_tables[:0], paged.seq_lens[:0], torch.zeros(1, dtype=torch.int32), backend="triton",
    )  # fmt: skip
    assert empty.shape == (0, 2, 64)


def test_kernel_builds_for_gpu():
    calls = """
kc = torch.randn(6, 16, 2, 256)
bt, lens = torch.arange(6, dtype=torch.int32).view(2, 3), torch.tensor([40, 20], dtype=torch.int32)
cu = torch.tensor([0, 30, 35], dtype=torch.int32)
pre.paged_prefill_attention(torch.randn(35, 8, 256).half(), kc.half(), kc.half(), bt, lens, cu, backend="triton",
                            sliding_window=8, soft_cap=30.0)
codes, scale = kc[..., :96].to(torch.int8), torch.ones(6, 16, 2)
pre.paged_prefill_attention(torch.randn(35, 12, 96), codes, codes, bt, lens, cu, k_scale=scale, v_scale=scale,
                            backend="triton")
kb = torch.randn(6, 16, 2, 128)
for cd in (torch.bfloat16, torch.int8, torch.float8_e4m3fn):  # 16-bit dots: the 128 x 64 tile
    c, sc = kb.to(cd), (None if cd == torch.bfloat16 else scale)
    pre.paged_prefill_attention(torch.randn(35, 8, 128).bfloat16(), c, c, bt, lens, cu, k_scale=sc, v_scale=sc,
                                backend="triton")
"""
    assert build_for_gpu(calls) == ["_prefill_kernel"] * 5


def _valid_inputs():
    paged = build_paged([20, 9], block_size=8, num_kv_heads=2, head_dim=64, seed=33)
    q = torch.randn(12, 4, 64)
    cache = dict(k_cache=paged.k_cache, v_cache=paged.v_cache, block_tables=paged.block_tables)
    return dict(cache, q=q, seq_lens=paged.seq_lens, cu_seqlens_q=cu_seqlens([5, 7]))


def _cu(values):
    return lambda d: d.update(cu_seqlens_q=torch.tensor(values, dtype=torch.int32))


BAD_INPUTS = [
    ("q-rank", lambda d: d.update(q=d["q"][0]), InvalidArgumentError),
    ("v-dtype", lambda d: d.update(v_cache=d["v_cache"].half()), InvalidArgumentError),
    ("hq-not-multiple", lambda d: d.update(q=d["q"][:, :3]), InvalidArgumentError),
    ("cu-rank", lambda d: d.update(cu_seqlens_q=d["cu_seqlens_q"][None]), InvalidArgumentError),
    ("cu-dtype", lambda d: d.update(cu_seqlens_q=d["cu_seqlens_q"].float()), InvalidArgumentError),
    ("cu-length", _cu([0, 12]), InvalidArgumentError),
    ("cu-not-from-zero", _cu([1, 5, 12]), InvalidArgumentError),
    ("cu-decreasing", _cu([0, 8, 7]), InvalidArgumentError),
    ("cu-end-not-total", _cu([0, 5, 11]), InvalidArgumentError),
    ("seq-shorter-than-q", _cu([0, 2, 12]), OutOfRangeError),
    ("lens-over-capacity", lambda d: d.update(seq_lens=torch.tensor([20, 41], dtype=torch.int32)), OutOfRangeError),
    ("block-id-high", lambda d: d["block_tables"].__setitem__((1, 1), 999), OutOfRangeError),
    ("table-rows", lambda d: d.update(block_tables=d["block_tables"][:1]), InvalidArgumentError),
    ("table-no-columns", lambda d: d.update(block_tables=d["block_tables"][:, :0]), OutOfRangeError),
    ("window-negative", lambda d: d.update(sliding_window=-3), InvalidArgumentError),
    ("soft-cap-inf", lambda d: d.update(soft_cap=math.inf), InvalidArgumentError),
    ("missing-scales-unneeded", lambda d: d.update(v_scale=torch.ones(3)), InvalidArgumentError),
    ("backend", lambda d: d.update(backend="gpu"), InvalidArgumentError),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("change,error", [(c, e) for _, c, e in BAD_INPUTS], ids=[n for n, _, _ in BAD_INPUTS])
def test_invalid_input_raises_before_launch(monkeypatch, backend, change, error):
    inputs = dict(_valid_inputs(), backend=backend)
    change(inputs)
    assert_rejected(monkeypatch, pre, ("_prefill_triton", "_prefill_torch"), paged_prefill_attention, inputs, error)

"""Paged decode attention: Triton kernel (interpreter on CPU) and torch reference vs a dense float64 softmax.

Caches come from :mod:`attention_cases` (shuffled, shared prefix blocks, NaN in every
slot no sequence owns), the truth from its dense float64 ``naive_decode``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from attention_cases import (
    BF16,
    E4M3,
    E5M2,
    F16,
    F32,
    I8,
    TOL,
    assert_close,
    assert_rejected,
    build_for_gpu,
    build_paged,
    fail_launch,
    naive_decode,
    run_decode,
)
from backend_device import call_on_backend

import kernels.decode_attention as dec
from kernels.attention_triton import dot_dtype
from kernels.decode_attention import paged_decode_attention
from paged_kv.errors import InvalidArgumentError, OutOfRangeError

# (q dtype, cache dtype, Hq, Hkv, head_dim, block_size, seq_lens, shared blocks)
DECODE_CASES = [
    pytest.param(F32, F32, 4, 4, 64, 16, [1, 16, 45, 64], 1, id="mha-f32-bs16"),
    pytest.param(F16, F16, 8, 2, 80, 8, [17, 40, 1], 2, id="gqa-f16-d80-bs8"),
    pytest.param(BF16, BF16, 6, 1, 64, 32, [70, 5], 1, id="mqa-bf16-group6-bs32"),
    pytest.param(F32, F16, 4, 2, 96, 12, [25, 36], 1, id="gqa-q32-kv16-d96-bs12"),
    pytest.param(BF16, BF16, 4, 2, 256, 128, [130, 3], 1, id="gqa-bf16-d256-bs128"),
    pytest.param(F16, F32, 2, 2, 128, 64, [64, 9], 0, id="mha-q16-kv32-d128-bs64"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("q_dtype,cache_dtype,hq,hkv,head_dim,block_size,lens,shared", DECODE_CASES)
def test_decode_matches_naive(backend, q_dtype, cache_dtype, hq, hkv, head_dim, block_size, lens, shared):
    paged = build_paged(
        lens, block_size=block_size, num_kv_heads=hkv, head_dim=head_dim, dtype=cache_dtype, seed=1,
        shared_blocks=shared,
    )  # fmt: skip
    q = torch.randn(len(lens), hq, head_dim, generator=torch.Generator().manual_seed(2)).to(q_dtype)
    out, lse = run_decode(q, paged, return_lse=True, backend=backend)
    expected, expected_lse = naive_decode(q, paged)
    assert out.dtype == q_dtype and out.shape == q.shape and lse.dtype == F32
    assert_close(out, expected, TOL[q_dtype])
    assert_close(lse, expected_lse, TOL[q_dtype])
    assert_close(run_decode(q, paged, backend=backend), expected, TOL[q_dtype])  # without lse


# Error bound of the output vs attention over the unquantized values, per format: absmax scaling
# leaves a relative code error of 1/254 (int8), 2^-4 (e4m3: 3 mantissa bits), 2^-3 (e5m2).
QUANT_BOUND = {I8: 0.03, E4M3: 0.2, E5M2: 0.4}  # worst seen over 5 seeds: 0.013, 0.12, 0.22


@pytest.mark.parametrize("cache_dtype,q_dtype", [(I8, F16), (E4M3, BF16), (E5M2, F32)])
def test_decode_quantized_cache(cache_dtype, q_dtype):
    paged = build_paged(
        [1, 50, 33], block_size=16, num_kv_heads=2, head_dim=64, dtype=cache_dtype, seed=3, shared_blocks=1
    )
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(4)).to(q_dtype)
    out = run_decode(q, paged, backend="triton", num_splits=2)
    ref = run_decode(q, paged, backend="torch")
    assert_close(out, naive_decode(q, paged)[0], TOL[q_dtype])  # exact dequantized values
    assert_close(ref, naive_decode(q, paged)[0], TOL[q_dtype])
    err = (out.double() - naive_decode(q, paged, exact=True)[0]).abs().max().item()
    assert err < QUANT_BOUND[cache_dtype]


def test_every_e4m3_code_decodes_exactly():
    # One key per sequence: the output is that key's V row, dequantized. The kernel decodes e4m3
    # from raw bytes; all 254 finite codes (normals, subnormals, +-0) must match torch's float().
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(2, 1, 1, 128)  # [blocks, bs, Hkv, D]
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0  # the two NaN codes
    v_cache = codes.view(E4M3)
    k_cache = torch.zeros_like(codes).view(E4M3)
    scales = torch.full((2, 1, 1), 0.5)
    out = call_on_backend(
        paged_decode_attention, torch.randn(2, 1, 128), k_cache, v_cache,
        torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32),
        k_scale=scales, v_scale=scales, backend="triton",
    )  # fmt: skip
    assert torch.equal(out[:, 0], v_cache[:, 0, 0].float() * 0.5)


def test_split_kv_gives_same_result():
    # 8 splits of 200 tokens leave splits with no work (lse -inf) for the merge to skip.
    paged = build_paged([200, 1, 130], block_size=16, num_kv_heads=2, head_dim=64, seed=5, shared_blocks=3)
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(6))
    base, base_lse = run_decode(q, paged, backend="triton", num_splits=1, return_lse=True)
    for splits in (3, 8):
        out, lse = run_decode(q, paged, backend="triton", num_splits=splits, return_lse=True)
        torch.testing.assert_close(out, base, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, base_lse, atol=1e-5, rtol=1e-5)
    assert_close(base, naive_decode(q, paged)[0], TOL[F32])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_sliding_window_and_soft_cap(backend):
    paged = build_paged([90, 7, 40], block_size=8, num_kv_heads=2, head_dim=64, dtype=F16, seed=7)
    paged.block_tables[0, :5] = paged.nan_block  # blocks 0..4 (positions < 40) lie before the window of 50
    q = (3 * torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(8))).to(F16)  # large logits: cap bites
    opts = dict(sliding_window=50, soft_cap=4.0, scale=0.3)
    out, lse = run_decode(q, paged, backend=backend, num_splits=2, return_lse=True, **opts)
    expected, expected_lse = naive_decode(q, paged, **opts)
    assert_close(out, expected, TOL[F16])
    assert_close(lse, expected_lse, TOL[F16])
    uncapped = naive_decode(q, paged, scale=0.3, sliding_window=50)[0]
    assert (uncapped - expected).abs().max() > 0.05  # the cap changes the result


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_int64_tables_and_strided_q(backend):
    paged = build_paged([33, 8], block_size=8, num_kv_heads=2, head_dim=64, seed=13)
    wide = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(14))
    q = wide[:, ::2]  # [2, 4, 64] with head stride 128
    tables, lens = paged.block_tables.long(), paged.seq_lens.long()
    out = call_on_backend(paged_decode_attention, q, paged.k_cache, paged.v_cache, tables, lens, backend=backend)
    assert_close(out, naive_decode(q, paged)[0], TOL[F32])


def test_auto_backend_on_cpu_runs_torch(monkeypatch):
    paged = build_paged([20, 3], block_size=8, num_kv_heads=1, head_dim=64, seed=9)
    q = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(10))
    expected = run_decode(q, paged, backend="torch")
    monkeypatch.setattr(dec, "_decode_triton", fail_launch)
    torch.testing.assert_close(run_decode(q, paged), expected, atol=0, rtol=0)
    torch.testing.assert_close(paged_decode_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, backend="torch"), expected, atol=0, rtol=0)


def test_empty_batch():
    paged = build_paged([5], block_size=8, num_kv_heads=1, head_dim=64)
    out, lse = call_on_backend(
        paged_decode_attention, torch.zeros(0, 2, 64), paged.k_cache, paged.v_cache,
        paged.block_tables[:0], paged.seq_lens[:0], backend="triton", return_lse=True,
    )  # fmt: skip
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2)


def test_kernels_build_for_gpu():
    # Every (q, cache) dtype pair the tile table distinguishes, head sizes 128 and 256, builds for sm80
    # and sm90 without register spills; sm80 has no e4m3 type, so e4m3 caches reach the kernel as bytes.
    calls = """
bt, lens = torch.arange(6, dtype=torch.int32).view(2, 3), torch.tensor([40, 20], dtype=torch.int32)
scale = torch.ones(6, 16, 2)
for d in (128, 256):
    kc = torch.randn(6, 16, 2, d)
    q = torch.randn(2, 8, d, dtype=torch.bfloat16)
    dec.paged_decode_attention(q, kc.bfloat16(), kc.bfloat16(), bt, lens, backend="triton",
                               sliding_window=8, soft_cap=30.0, num_splits=3)
    dec.paged_decode_attention(q.float(), kc, kc, bt, lens, backend="triton", num_splits=1)
    for qd, cd in ((torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn),
                   (torch.bfloat16, torch.int8), (torch.float16, torch.float8_e5m2)):
        codes = kc.to(cd)
        dec.paged_decode_attention(q.to(qd), codes, codes, bt, lens, k_scale=scale, v_scale=scale,
                                   backend="triton", num_splits=1)
"""
    assert build_for_gpu(calls) == ["_decode_split_kernel", "_merge_splits_kernel"] + ["_decode_split_kernel"] * 5 \
        + ["_decode_split_kernel", "_merge_splits_kernel"] + ["_decode_split_kernel"] * 5


@pytest.mark.parametrize(
    "q_dtype,cache_dtype,expected",
    [(BF16, BF16, "bf16"), (F16, F16, "fp16"), (BF16, I8, "bf16"), (F16, E4M3, "fp16"), (BF16, E5M2, "bf16"),
     (F32, BF16, "fp32"), (BF16, F32, "fp32"), (F16, BF16, "fp32"), (F32, I8, "fp32")],
)  # fmt: skip
def test_dot_dtype_keeps_16_bit_operands_where_exact(q_dtype, cache_dtype, expected):
    q, cache = torch.zeros(1, dtype=q_dtype), torch.zeros(1).to(cache_dtype)
    assert str(dot_dtype(_on_fake_cuda(q), cache)) == expected
    on_cpu = "fp32" if q_dtype == BF16 else expected  # the interpreter's bf16 tl.dot is wrong: float32 there
    assert str(dot_dtype(q, cache)) == on_cpu


def _on_fake_cuda(t):
    """A stand-in with ``t``'s dtype whose device reads as CUDA (dot_dtype only looks at dtype and device)."""
    return SimpleNamespace(dtype=t.dtype, device=torch.device("cuda", 0))


def test_ragged_batch_splits_by_tokens_not_by_longest():
    # Automatic splits of 256 tokens: the 700-token sequence takes 3 splits, the short ones 1 (the rest exit).
    paged = build_paged([700, 1, 40, 300], block_size=16, num_kv_heads=2, head_dim=64, dtype=F16, seed=21)
    q = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(22)).to(F16)
    out, lse = run_decode(q, paged, backend="triton", return_lse=True, sliding_window=600)
    expected, expected_lse = naive_decode(q, paged, sliding_window=600)
    assert_close(out, expected, TOL[F16])
    assert_close(lse, expected_lse, TOL[F16])


def _valid_inputs():
    paged = build_paged([20, 9], block_size=8, num_kv_heads=2, head_dim=64, seed=11)
    q = torch.randn(2, 4, 64)
    cache = dict(k_cache=paged.k_cache, v_cache=paged.v_cache)
    return dict(cache, q=q, block_tables=paged.block_tables, seq_lens=paged.seq_lens)


def _quantized_inputs():
    paged = build_paged([20, 9], block_size=8, num_kv_heads=2, head_dim=64, dtype=I8, seed=12)
    inputs = dict(q=torch.randn(2, 4, 64), k_cache=paged.k_cache, v_cache=paged.v_cache)
    scales = dict(k_scale=paged.k_scale, v_scale=paged.v_scale)
    return dict(inputs, **scales, block_tables=paged.block_tables, seq_lens=paged.seq_lens)


def _set_table(value, row=0, col=0):
    def change(d):
        d["block_tables"] = d["block_tables"].clone()
        d["block_tables"][row, col] = value
    return change


BAD_INPUTS = [
    ("q-rank", lambda d: d.update(q=d["q"][0]), InvalidArgumentError),
    ("q-int", lambda d: d.update(q=d["q"].int()), InvalidArgumentError),
    ("q-not-tensor", lambda d: d.update(q=d["q"].tolist()), InvalidArgumentError),
    ("k-rank", lambda d: d.update(k_cache=d["k_cache"][0]), InvalidArgumentError),
    ("v-shape", lambda d: d.update(v_cache=d["v_cache"][:-1]), InvalidArgumentError),
    ("v-dtype", lambda d: d.update(v_cache=d["v_cache"].half()), InvalidArgumentError),
    ("head-dim", lambda d: d.update(q=d["q"][..., :32]), InvalidArgumentError),
    ("head-dim-too-big", lambda d: d.update(q=torch.zeros(2, 4, 512), k_cache=torch.zeros(5, 8, 2, 512),
                                            v_cache=torch.zeros(5, 8, 2, 512)), InvalidArgumentError),
    ("hq-not-multiple", lambda d: d.update(q=d["q"][:, :3]), InvalidArgumentError),
    ("table-dtype", lambda d: d.update(block_tables=d["block_tables"].float()), InvalidArgumentError),
    ("table-rows", lambda d: d.update(block_tables=d["block_tables"][:1]), InvalidArgumentError),
    ("table-device", lambda d: d.update(block_tables=d["block_tables"].to("meta")), InvalidArgumentError),
    ("lens-shape", lambda d: d.update(seq_lens=d["seq_lens"][:1]), InvalidArgumentError),
    ("lens-zero", lambda d: d.update(seq_lens=torch.tensor([20, 0], dtype=torch.int32)), OutOfRangeError),
    ("lens-over-capacity", lambda d: d.update(seq_lens=torch.tensor([20, 41], dtype=torch.int32)), OutOfRangeError),
    ("table-no-columns", lambda d: d.update(block_tables=d["block_tables"][:, :0]), OutOfRangeError),
    ("block-id-high", _set_table(10_000, 0, 2), OutOfRangeError),
    ("block-id-negative", _set_table(-1, 1, 1), OutOfRangeError),
    ("scales-for-float-cache", lambda d: d.update(k_scale=torch.ones(d["k_cache"].shape[:3]),
                                                  v_scale=torch.ones(d["k_cache"].shape[:3])), InvalidArgumentError),
    ("window-zero", lambda d: d.update(sliding_window=0), InvalidArgumentError),
    ("soft-cap-negative", lambda d: d.update(soft_cap=-1.0), InvalidArgumentError),
    ("scale-nan", lambda d: d.update(scale=math.nan), InvalidArgumentError),
    ("splits-zero", lambda d: d.update(num_splits=0), OutOfRangeError),
    ("splits-huge", lambda d: d.update(num_splits=10_000), OutOfRangeError),
    ("backend", lambda d: d.update(backend="cuda"), InvalidArgumentError),
]
BAD_QUANT_INPUTS = [
    ("missing-scales", lambda d: d.update(k_scale=None), InvalidArgumentError),
    ("scale-shape", lambda d: d.update(v_scale=d["v_scale"][:, :4]), InvalidArgumentError),
    ("scale-dtype", lambda d: d.update(k_scale=d["k_scale"].half()), InvalidArgumentError),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "make,change,error",
    [(_valid_inputs, c, e) for _, c, e in BAD_INPUTS] + [(_quantized_inputs, c, e) for _, c, e in BAD_QUANT_INPUTS],
    ids=[name for name, _, _ in BAD_INPUTS + BAD_QUANT_INPUTS],
)
def test_invalid_input_raises_before_launch(monkeypatch, backend, make, change, error):
    inputs = dict(make(), backend=backend)
    change(inputs)
    assert_rejected(monkeypatch, dec, ("_decode_triton", "_decode_torch"), paged_decode_attention, inputs, error)


def test_unused_table_entries_are_not_validated():
    inputs = _valid_inputs()
    inputs["block_tables"][1, 2:] = -7  # past seq_len 9 at block size 8: padding
    inputs["block_tables"][0, 0] = 10_000  # before the window of 8 at seq_len 20: never read
    out = call_on_backend(paged_decode_attention, **inputs, sliding_window=8, backend="triton")
    ref = call_on_backend(paged_decode_attention, **inputs, sliding_window=8, backend="torch")
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [{}, {"sliding_window": 7}, {"soft_cap": 5.0, "return_lse": True}])
def test_torch_path_in_sequence_groups_matches_whole_batch(monkeypatch, options):
    """The CPU path splits big batches into groups of sequences: one sequence per group gives the same result."""
    import importlib

    module = importlib.import_module("kernels.decode_attention")
    paged = build_paged([5, 16, 33, 1], block_size=8, num_kv_heads=2, head_dim=16, shared_blocks=1, seed=3)
    q = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(4))
    whole = run_decode(q, paged, backend="torch", **options)
    monkeypatch.setattr(module, "TORCH_CHUNK_BYTES", 1)  # every group holds a single sequence
    grouped = run_decode(q, paged, backend="torch", **options)
    for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (whole, grouped))):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

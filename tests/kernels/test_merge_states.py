"""Merging attention states: Triton kernel (interpreter on CPU) and torch path vs softmax over the union."""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import BF16, F16, F32, TOL, assert_close, assert_rejected, build_for_gpu, build_paged, run_decode
from backend_device import call_on_backend

import kernels.merge_states as ms
from kernels.decode_attention import paged_decode_attention
from kernels.merge_states import merge_attention_states
from paged_kv.errors import InvalidArgumentError


def softmax_state(logits, values):
    """Float64 attention state over one key set: logits [N, H, L], values [N, H, L, D] -> (out, lse)."""
    lse = torch.logsumexp(logits, -1)
    out = (torch.softmax(logits, -1)[..., None] * values).sum(-2)
    return out, lse


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_merge_equals_attention_over_union(backend, dtype):
    gen = torch.Generator().manual_seed(41)
    logits = 3 * torch.randn(7, 3, 20, generator=gen, dtype=torch.float64)
    values = torch.randn(7, 3, 20, 40, generator=gen, dtype=torch.float64)  # head_dim 40: padded lanes
    out_a, lse_a = softmax_state(logits[..., :6], values[..., :6, :])
    out_b, lse_b = softmax_state(logits[..., 6:], values[..., 6:, :])
    out, lse = call_on_backend(
        merge_attention_states, out_a.to(dtype), lse_a.float(), out_b.to(dtype), lse_b.float(), backend=backend
    )
    expected, expected_lse = softmax_state(logits, values)
    assert out.dtype == dtype and lse.dtype == F32
    assert_close(out, expected, TOL[dtype])
    assert_close(lse, expected_lse, 1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty_parts(backend):
    gen = torch.Generator().manual_seed(42)
    out_a, out_b = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    lse_a, lse_b = torch.randn(3, 2, generator=gen), torch.randn(3, 2, generator=gen)
    lse_a[0], lse_b[1] = -math.inf, -math.inf  # token 0: only b; token 1: only a
    lse_a[2, 1] = lse_b[2, 1] = -math.inf  # both empty
    out_a[0] = out_b[1] = out_a[2, 1] = out_b[2, 1] = math.nan  # an empty part's output is ignored
    out, lse = call_on_backend(merge_attention_states, out_a, lse_a, out_b, lse_b, backend=backend)
    torch.testing.assert_close(out[0], out_b[0])
    torch.testing.assert_close(lse[0], lse_b[0])
    torch.testing.assert_close(out[1], out_a[1])
    torch.testing.assert_close(lse[1], lse_a[1])
    assert torch.equal(out[2, 1], torch.zeros(16)) and lse[2, 1].item() == -math.inf
    torch.testing.assert_close(out[2, 0], _by_hand(out_a[2, 0], lse_a[2, 0], out_b[2, 0], lse_b[2, 0]))


def _by_hand(out_a, lse_a, out_b, lse_b):
    """Both parts non-empty: out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b)."""
    w_a, w_b = math.exp(lse_a.item()), math.exp(lse_b.item())
    return (w_a * out_a + w_b * out_b) / (w_a + w_b)


def test_shared_prefix_then_suffix_equals_full_decode():
    # Sequences 0 and 1 share 2 full blocks (32 tokens); attend the prefix once for both, each
    # suffix separately, merge: equal to decode over the whole sequence.
    paged = build_paged([50, 41], block_size=16, num_kv_heads=2, head_dim=64, seed=43, shared_blocks=2)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(44))
    full = run_decode(q, paged, backend="triton")
    caches = (paged.k_cache, paged.v_cache)
    prefix_table = paged.block_tables[:, :2]
    prefix_out, prefix_lse = run_decode_on(q, caches, prefix_table, [32, 32])
    suffix_out, suffix_lse = run_decode_on(q, caches, paged.block_tables[:, 2:], [50 - 32, 41 - 32])
    out, _ = call_on_backend(merge_attention_states, prefix_out, prefix_lse, suffix_out, suffix_lse, backend="triton")
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)


def run_decode_on(q, caches, table, lens):
    """Triton decode over an explicit block table (a slice of the full one) with lse."""
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return call_on_backend(paged_decode_attention, q, *caches, table, seq_lens, backend="triton", return_lse=True)


def test_strided_inputs_and_reference():
    gen = torch.Generator().manual_seed(45)
    big = torch.randn(4, 6, 32, generator=gen)
    out_a, out_b = big[:, ::2], big[:, 1::2]  # non-contiguous [4, 3, 32] views
    lse_a, lse_b = torch.randn(3, 4, generator=gen).T, torch.randn(4, 3, generator=gen)
    out, lse = call_on_backend(merge_attention_states, out_a, lse_a, out_b, lse_b, backend="triton")
    ref_out, ref_lse = merge_attention_states(out_a, lse_a, out_b, lse_b, backend="torch")
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)


def test_kernel_builds_for_gpu():
    calls = """
out, lse = torch.randn(5, 4, 80, dtype=torch.bfloat16), torch.randn(5, 4)
ms.merge_attention_states(out, lse, out, lse, backend="triton")
"""
    assert build_for_gpu(calls) == ["_merge_kernel"]


def _valid():
    outs = dict(out_a=torch.zeros(4, 2, 8), out_b=torch.zeros(4, 2, 8))
    return dict(outs, lse_a=torch.zeros(4, 2), lse_b=torch.zeros(4, 2))


BAD_INPUTS = [
    ("out-rank", lambda d: d.update(out_a=torch.zeros(4, 16))),
    ("out-int", lambda d: d.update(out_a=torch.zeros(4, 2, 8, dtype=torch.int32))),
    ("out-dtype-mismatch", lambda d: d.update(out_b=torch.zeros(4, 2, 8, dtype=F16))),
    ("out-shape-mismatch", lambda d: d.update(out_b=torch.zeros(4, 2, 9))),
    ("lse-shape", lambda d: d.update(lse_a=torch.zeros(4, 3))),
    ("lse-dtype", lambda d: d.update(lse_b=torch.zeros(4, 2, dtype=F16))),
    ("lse-device", lambda d: d.update(lse_b=torch.zeros(4, 2, device="meta"))),
    ("lse-not-tensor", lambda d: d.update(lse_a=0.0)),
    ("backend", lambda d: d.update(backend="cpu")),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("change", [c for _, c in BAD_INPUTS], ids=[n for n, _ in BAD_INPUTS])
def test_invalid_input_raises_before_launch(monkeypatch, backend, change):
    inputs = dict(_valid(), backend=backend)
    change(inputs)
    paths = ("_merge_triton", "_merge_torch")
    assert_rejected(monkeypatch, ms, paths, merge_attention_states, inputs, InvalidArgumentError)

"""Chunk attention (a fresh prefill's own contiguous K/V): every backend vs a dense float64 softmax, the probe, merging.

The CPU backend is PyTorch's flash CPU op per sequence; "flash" (CUDA varlen) runs only with a GPU.
The merge test checks the lse contract end to end: chunk attention over the new tokens merged
with paged prefix attention over the cached ones equals paged prefill attention over both.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from attention_cases import BF16, F16, F32, TOL, assert_close, build_paged, naive_attention

import kernels.chunk_attention as chunk
from kernels.chunk_attention import best_chunk_backend, dense_chunk_attention, dense_chunk_attention_prepared
from kernels.merge_states import merge_attention_states
from kernels.metadata import prepare_chunk_metadata
from kernels.prefill_attention import paged_prefill_attention
from kernels.prefix_attention import paged_prefix_attention
from paged_kv.errors import InvalidArgumentError, OutOfRangeError

CUDA = torch.cuda.is_available()


def chunk_case(lens, hq, hkv, head_dim, dtype=F32, seed=0):
    """(q, k, v) packed ``[T, H, D]`` and the float64 truth (out, lse) of causal attention per sequence."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q, k, v = (torch.randn(total, h, head_dim, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    outs, lses, start = [], [], 0
    for n in lens:
        rows = slice(start, start + n)
        out, lse = naive_attention(q[rows], k[rows], v[rows], list(range(n)), scale=0.3)
        outs.append(out)
        lses.append(lse)
        start += n
    return q, k, v, torch.cat(outs), torch.cat(lses)


CASES = [
    pytest.param([5, 0, 17, 1], 8, 2, 16, F32, id="ragged-gqa4-empty-and-single"),
    pytest.param([33, 2], 4, 4, 32, F32, id="mha"),
    pytest.param([12, 7], 6, 1, 16, F16, id="mqa-f16"),
    pytest.param([9, 24, 3], 8, 2, 64, BF16, id="gqa-bf16"),
]


@pytest.mark.parametrize("backend", ["sdpa", "torch", "auto"])
@pytest.mark.parametrize("lens,hq,hkv,head_dim,dtype", CASES)
def test_chunk_matches_naive(backend, lens, hq, hkv, head_dim, dtype):
    q, k, v, expected, expected_lse = chunk_case(lens, hq, hkv, head_dim, dtype)
    out, lse = dense_chunk_attention(q, k, v, lens, scale=0.3, backend=backend)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == F32 and lse.shape == q.shape[:2]
    assert_close(out, expected, TOL[dtype])
    assert_close(lse, expected_lse, TOL[dtype])


def test_reference_is_the_dense_path_and_default_scale():
    q, k, v, _, _ = chunk_case([6, 4], 4, 2, 16)
    out, lse = dense_chunk_attention(q, k, v, [6, 4], backend="torch")
    truth, truth_lse = naive_attention(q[:6], k[:6], v[:6], list(range(6)), scale=1 / math.sqrt(16))
    assert_close(out[:6], truth, TOL[F32])
    assert_close(lse[:6], truth_lse, TOL[F32])


def test_strided_keys_and_values_as_a_fused_projection_gives_them():
    lens, hq, hkv, d = [7, 5], 4, 2, 16
    q, k, v, expected, _ = chunk_case(lens, hq, hkv, d)
    fused = torch.cat([k, v], dim=1)  # [T, 2 Hkv, D]: k and v are strided views of one projection
    out, _ = dense_chunk_attention(q, fused[:, :hkv], fused[:, hkv:], lens, scale=0.3, backend="sdpa")
    assert_close(out, expected, TOL[F32])


def test_prepared_reads_nothing_back():
    from no_host_reads import forbid_host_reads

    q, k, v, expected, _ = chunk_case([4, 9], 4, 2, 16)
    meta = prepare_chunk_metadata(np.array([4, 9]), "cpu")
    with forbid_host_reads():
        out, _ = dense_chunk_attention_prepared(q, k, v, meta, scale=0.3, backend="sdpa")
    assert_close(out, expected, TOL[F32])


@pytest.fixture
def fresh_probes(monkeypatch):
    """An empty probe memory, restored afterwards."""
    monkeypatch.setattr(chunk, "_probed", {})


def test_probe_accepts_the_cpu_op_and_remembers(fresh_probes, monkeypatch):
    assert best_chunk_backend("cpu", F32, 8, 2, 16) == "sdpa"
    monkeypatch.setitem(chunk._RUNNERS, "sdpa", _wrong)  # not probed again: the answer is remembered
    assert best_chunk_backend("cpu", F32, 8, 2, 16) == "sdpa"


def _wrong(q, k, v, meta, scale):
    out, lse = chunk._dense(q, k, v, meta, scale)
    return out + 0.5, lse


def _broken(q, k, v, meta, scale):
    raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")


@pytest.mark.parametrize("runner", [_wrong, _broken], ids=["wrong-values", "op-raises"])
def test_probe_rejects_a_bad_op_and_auto_falls_back_to_the_reference(fresh_probes, monkeypatch, runner):
    monkeypatch.setitem(chunk._RUNNERS, "sdpa", runner)
    assert best_chunk_backend("cpu", F32, 4, 2, 16) is None
    q, k, v, expected, _ = chunk_case([5, 3], 4, 2, 16)
    out, _ = dense_chunk_attention(q, k, v, [5, 3], scale=0.3)  # auto: the reference, not the bad op
    assert_close(out, expected, TOL[F32])


def test_probe_is_per_geometry(fresh_probes, monkeypatch):
    assert best_chunk_backend("cpu", F32, 4, 2, 16) == "sdpa"
    monkeypatch.setitem(chunk._RUNNERS, "sdpa", _broken)
    assert best_chunk_backend("cpu", F32, 4, 2, 16) == "sdpa"
    assert best_chunk_backend("cpu", F32, 4, 1, 16) is None  # another geometry is probed on its own


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_chunk_merged_with_the_cached_prefix_equals_paged_prefill(dtype):
    """Extend: prefix attention over the cached tokens + chunk attention over the new ones, merged."""
    seq_lens, q_lens, hq, hkv, d, bs = [21, 9, 16], [5, 9, 3], 4, 2, 16, 4
    paged = build_paged(seq_lens, block_size=bs, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    new = [(paged.exact_k[s][n - m :], paged.exact_v[s][n - m :]) for s, (n, m) in enumerate(zip(seq_lens, q_lens))]
    k_new, v_new = (torch.cat([kv[i] for kv in new]).to(dtype) for i in (0, 1))  # [T, Hkv, D]
    caches = dict(k_cache=paged.k_cache, v_cache=paged.v_cache)
    prefix_lens = paged.seq_lens - torch.tensor(q_lens, dtype=torch.int32)
    pre, pre_lse = paged_prefix_attention(q, **caches, block_tables=paged.block_tables, prefix_lens=prefix_lens,
                                          cu_seqlens_q=cu, scale=0.3, backend="torch")  # fmt: skip
    own, own_lse = dense_chunk_attention(q, k_new, v_new, q_lens, scale=0.3)
    out, lse = merge_attention_states(pre, pre_lse, own, own_lse)
    whole, whole_lse = paged_prefill_attention(
        q, **caches, block_tables=paged.block_tables, seq_lens=paged.seq_lens, cu_seqlens_q=cu, scale=0.3,
        return_lse=True, backend="torch",
    )  # fmt: skip
    assert_close(out, whole.float(), TOL[dtype])
    assert_close(lse, whole_lse, TOL[dtype])


@pytest.mark.parametrize(
    "change,error",
    [
        (lambda a: {"query_lens": [5, 2]}, InvalidArgumentError),
        (lambda a: {"query_lens": [9, -1]}, OutOfRangeError),
        (lambda a: {"query_lens": torch.tensor([5, 3])}, InvalidArgumentError),
        (lambda a: {"k": a["k"][:, :, :8]}, InvalidArgumentError),
        (lambda a: {"k": a["k"][:, :1].expand(-1, 3, -1), "v": a["v"][:, :1].expand(-1, 3, -1)}, InvalidArgumentError),
        (lambda a: {"v": a["v"].half()}, InvalidArgumentError),
        (lambda a: {"backend": "triton"}, InvalidArgumentError),
        (lambda a: {"backend": "flash"}, InvalidArgumentError),
        (lambda a: {"scale": math.nan}, InvalidArgumentError),
        (lambda a: {"q": a["q"][:, :, :0], "k": a["k"][:, :, :0], "v": a["v"][:, :, :0]}, InvalidArgumentError),
        (lambda a: {"q": a["q"][:, :0]}, InvalidArgumentError),
    ],
    ids=["lens-sum", "lens-negative", "lens-on-device", "head-dim", "heads-not-divisor", "dtype", "backend",
         "flash-on-cpu", "scale-nan", "head-dim-0", "no-query-heads"],
)  # fmt: skip
def test_bad_input_raises_before_any_op(monkeypatch, change, error):
    q, k, v, _, _ = chunk_case([5, 3], 4, 2, 16)
    inputs = dict(q=q, k=k, v=v, query_lens=[5, 3], backend="torch")
    inputs.update(change(inputs))
    for name in chunk._RUNNERS:
        monkeypatch.setitem(chunk._RUNNERS, name, _broken)
    with pytest.raises(error):
        dense_chunk_attention(**inputs)


def test_prepared_rejects_metadata_of_another_batch():
    q, k, v, _, _ = chunk_case([5, 3], 4, 2, 16)
    with pytest.raises(InvalidArgumentError, match="meta"):
        dense_chunk_attention_prepared(q, k, v, prepare_chunk_metadata([5, 2], "cpu"))
    with pytest.raises(InvalidArgumentError, match="meta"):
        dense_chunk_attention_prepared(q, k, v, "meta")


def test_probe_checks_its_arguments():
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        best_chunk_backend("cpu", F32, 4, 3, 16)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        best_chunk_backend("cpu", torch.int8, 4, 2, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_flash_varlen_on_cuda_matches_naive(dtype):
    lens = [1, 130, 37, 512]
    q, k, v, expected, expected_lse = chunk_case(lens, 32, 8, 128, dtype)
    assert best_chunk_backend("cuda", dtype, 32, 8, 128) == "flash"
    out, lse = dense_chunk_attention(q.cuda(), k.cuda(), v.cuda(), lens, scale=0.3, backend="flash")
    assert_close(out.cpu(), expected, TOL[dtype])
    assert_close(lse.cpu(), expected_lse, TOL[dtype])

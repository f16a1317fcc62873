"""Cascade decode (shared prefix once per group + own suffix, merged) vs plain decode and a dense float64 truth.

Batches come from :func:`attention_cases.build_forked`: groups of sequences sharing prefix
blocks, ungrouped sequences, shuffled blocks, NaN in every slot no sequence owns, groups
interleaved in the batch, ragged suffix lengths.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from attention_cases import (
    BF16,
    E4M3,
    F16,
    F32,
    I8,
    TOL,
    assert_close,
    assert_rejected,
    build_for_gpu,
    build_forked,
    naive_attention,
    run_decode,
)
from backend_device import call_on_backend
from no_host_reads import forbid_host_reads

import kernels.cascade_attention as cas
from kernels.cascade_attention import (
    bind_cascade_decode_attention,
    cascade_decode_attention,
    cascade_decode_attention_prepared,
)
from kernels.metadata import cascade_host_arrays, prepare_cascade_metadata
from paged_kv.errors import InvalidArgumentError, OutOfRangeError


def naive_decode(q, paged, *, soft_cap=None):
    """Dense float64 decode truth of every sequence: (out [S, Hq, D], lse [S, Hq])."""
    scale = 1 / math.sqrt(q.shape[2])
    outs = [
        naive_attention(q[s : s + 1], k, v, [k.shape[0] - 1], scale=scale, soft_cap=soft_cap)
        for s, (k, v) in enumerate(zip(paged.dense_k, paged.dense_v))
    ]
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])


def run_cascade(q, forked, **kwargs):
    """cascade_decode_attention over a Forked bundle, on the backend's device."""
    p = forked.paged
    return call_on_backend(
        cascade_decode_attention, q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, forked.seq_groups,
        forked.prefix_lens, k_scale=p.k_scale, v_scale=p.v_scale, **kwargs,
    )  # fmt: skip


# (groups: (shared prefix, member lengths), Hq, Hkv, D, block size, cache dtype, q dtype)
CASES = [
    pytest.param([(16, [17, 30, 21]), (8, [9, 40])], 4, 2, 16, 8, F32, F32, id="two-groups-gqa-ragged"),
    pytest.param([(24, [25, 27, 40, 33]), (0, [5, 19]), (8, [12])], 4, 4, 32, 8, F32, F32, id="ungrouped-singleton"),
    pytest.param([(12, [13, 20, 16])], 6, 1, 16, 4, F16, F16, id="mqa-group6-f16-bs4"),
    pytest.param([(32, [33, 48]), (16, [20, 17])], 4, 2, 24, 16, BF16, BF16, id="bf16-d24-bs16"),
    pytest.param([(16, [20, 18]), (0, [7])], 2, 2, 16, 8, F16, F32, id="q32-kv16"),
    pytest.param([(16, [17 + i % 9 for i in range(40)])], 4, 2, 16, 8, F32, F32, id="40-members-one-group"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("groups,hq,hkv,head_dim,block_size,dtype,q_dtype", CASES)
def test_cascade_matches_naive_and_plain_decode(backend, groups, hq, hkv, head_dim, block_size, dtype, q_dtype):
    forked = build_forked(groups, block_size=block_size, num_kv_heads=hkv, head_dim=head_dim, dtype=dtype, seed=3)
    q = torch.randn(len(forked.order), hq, head_dim, generator=torch.Generator().manual_seed(4)).to(q_dtype)
    out, lse = run_cascade(q, forked, return_lse=True, backend=backend)
    expected, expected_lse = naive_decode(q, forked.paged)
    assert out.dtype == q_dtype and out.shape == q.shape and lse.dtype == F32
    assert_close(out, expected, TOL[q_dtype])
    assert_close(lse, expected_lse, TOL[q_dtype])
    plain = run_decode(q, forked.paged, backend=backend)
    assert_close(out, plain.double(), 2 * TOL[q_dtype])


@pytest.mark.parametrize("cache_dtype", [I8, E4M3])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cascade_quantized_cache(backend, cache_dtype):
    forked = build_forked([(16, [17, 25]), (8, [10])], block_size=8, num_kv_heads=2, head_dim=16, dtype=cache_dtype)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(5))
    out = run_cascade(q, forked, backend=backend)
    assert_close(out, naive_decode(q, forked.paged)[0], 1e-4)  # the truth is over the dequantized values


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cascade_soft_cap_and_scale(backend):
    forked = build_forked([(16, [17, 22])], block_size=8, num_kv_heads=2, head_dim=16, seed=6)
    q = 4 * torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(7))
    out = run_cascade(q, forked, soft_cap=5.0, backend=backend)
    assert_close(out, naive_decode(q, forked.paged, soft_cap=5.0)[0], TOL[F32])


def test_reference_is_the_torch_path():
    forked = build_forked([(8, [9, 12])], block_size=8, num_kv_heads=1, head_dim=16, seed=8)
    q = torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(9))
    p = forked.paged
    out = cascade_decode_attention(
        q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, forked.seq_groups, forked.prefix_lens, backend="torch"
    )
    assert_close(out, naive_decode(q, p)[0], TOL[F32])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_prepared_reads_no_device_value(backend):
    forked = build_forked([(16, [17, 30]), (0, [9]), (8, [12, 9])], block_size=8, num_kv_heads=2, head_dim=16)
    q = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(10))
    p = forked.paged

    def prepared(q, k_cache, v_cache, backend):
        meta = prepare_cascade_metadata(
            p.block_tables.numpy(), p.seq_lens.numpy(), forked.seq_groups.numpy(), forked.prefix_lens.numpy(),
            block_size=8, num_blocks=k_cache.shape[0], device=q.device,
        )  # fmt: skip
        assert not meta.rows_in_order  # the groups are interleaved and one sequence is ungrouped
        with forbid_host_reads():
            return cascade_decode_attention_prepared(q, k_cache, v_cache, meta, backend=backend)

    out = call_on_backend(prepared, q, p.k_cache, p.v_cache, backend=backend)
    assert_close(out, naive_decode(q, p)[0], TOL[F32])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bound_once_runs_every_layer_like_the_prepared_call(backend):
    forked = build_forked([(16, [17, 30]), (0, [9]), (8, [12, 9])], block_size=8, num_kv_heads=2, head_dim=16)
    q = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(11))
    p = forked.paged
    other = [torch.randn(p.k_cache.shape, generator=torch.Generator().manual_seed(s)) for s in (12, 13)]

    def per_layer(q, layers, backend):
        meta = prepare_cascade_metadata(
            p.block_tables.numpy(), p.seq_lens.numpy(), forked.seq_groups.numpy(), forked.prefix_lens.numpy(),
            block_size=8, num_blocks=p.k_cache.shape[0], device=q.device,
        )  # fmt: skip
        bound = bind_cascade_decode_attention(q, *layers[0], meta, return_lse=True, backend=backend)
        with forbid_host_reads():
            return [(bound(q, k, v, None, None), cascade_decode_attention_prepared(
                q, k, v, meta, return_lse=True, backend=backend)) for k, v in layers]  # fmt: skip

    for got, expected in call_on_backend(per_layer, q, [(p.k_cache, p.v_cache), tuple(other)], backend=backend):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_host_arrays_lay_out_groups_and_suffixes():
    tables = np.array([[5, 6, 7], [1, 2, 3], [5, 6, 8], [1, 4, 0]])
    arrays = cascade_host_arrays(tables, [10, 9, 12, 7], [1, 0, 1, 0], [4, 8], block_size=4)
    assert arrays.q_rows.tolist() == [1, 3, 0, 2] and arrays.cu_seqlens_q.tolist() == [0, 2, 4]
    assert arrays.leaders.tolist() == [1, 0] and arrays.prefix_lens.tolist() == [4, 8]
    assert arrays.first_suffix_block.tolist() == [2, 1, 2, 1] and arrays.suffix_lens.tolist() == [2, 5, 4, 3]
    assert not arrays.rows_in_order
    assert cascade_host_arrays(tables[:1], [10], [0], [4], block_size=4).rows_in_order


@pytest.mark.parametrize(
    "groups,prefix_lens,error",
    [
        ([0, 0, -1], [8], OutOfRangeError),  # 8 shared tokens: not below sequence 1's 7
        ([0, 0, -1], [6], OutOfRangeError),  # not whole blocks
        ([0, 0, -1], [0], OutOfRangeError),  # an empty prefix is no group
        ([0, 0, 2], [4], OutOfRangeError),  # no group 2
        ([0, 0, 0], [4], InvalidArgumentError),  # sequence 2 does not hold the shared block
        ([1, 1, -1], [4, 4], InvalidArgumentError),  # group 0 has no member
    ],
)
def test_bad_grouping_is_rejected_on_the_host(groups, prefix_lens, error):
    with pytest.raises(error):
        cascade_host_arrays(np.array([[0, 1, 2], [0, 3, 4], [5, 6, 7]]), [9, 7, 5], groups, prefix_lens, 4)


def test_checked_call_rejects_before_any_launch(monkeypatch):
    forked = build_forked([(8, [9, 12])], block_size=8, num_kv_heads=1, head_dim=16, seed=8)
    p = forked.paged
    inputs = dict(q=torch.randn(2, 2, 16), k_cache=p.k_cache, v_cache=p.v_cache, block_tables=p.block_tables,
                  seq_lens=p.seq_lens, seq_groups=forked.seq_groups, prefix_lens=torch.tensor([16]))  # fmt: skip
    paths = ["bind_decode_attention", "bind_prefix_attention"]
    assert_rejected(monkeypatch, cas, paths, cascade_decode_attention, inputs, OutOfRangeError)
    inputs["prefix_lens"], inputs["block_tables"] = torch.tensor([8]), p.block_tables.clone().fill_(99)
    assert_rejected(monkeypatch, cas, paths, cascade_decode_attention, inputs, OutOfRangeError)


def test_kernels_build_for_gpu():
    calls = """
kc = torch.randn(12, 16, 2, 64, dtype=torch.float16)
bt = torch.tensor([[0, 1, 2, 3], [0, 1, 4, 5], [6, 7, 8, 9]], dtype=torch.int32)
q = torch.randn(3, 8, 64, dtype=torch.float16)
cas.cascade_decode_attention(q, kc, kc, bt, torch.tensor([50, 60, 20], dtype=torch.int32), torch.tensor([0, 0, -1]),
                             torch.tensor([32]), backend="triton")
"""
    assert build_for_gpu(calls) == ["_decode_split_kernel", "_prefix_kernel", "_merge_kernel"]

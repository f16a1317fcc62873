"""Shared-prefix attention: Triton kernel (interpreter on CPU) and torch reference vs a dense float64 softmax.

Groups of queries each see their group's whole paged prefix (no causal mask). Caches come from
:func:`attention_cases.build_forked`: shuffled blocks, NaN in every slot no sequence owns.
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
)
from backend_device import call_on_backend

import kernels.prefix_attention as pfx
from kernels.metadata import prepare_prefix_metadata
from kernels.prefix_attention import paged_prefix_attention, paged_prefix_attention_prepared, prefix_tile
from paged_kv.errors import InvalidArgumentError, OutOfRangeError


def prefix_case(groups, counts, *, hq, hkv, head_dim, block_size, dtype=F32, q_dtype=F32, seed=0):
    """(q, caches, tables [G, W], prefix_lens [G], cu [G+1], truth out, truth lse): group g has counts[g] queries."""
    forked = build_forked(groups, block_size=block_size, num_kv_heads=hkv, head_dim=head_dim, dtype=dtype, seed=seed)
    paged, seq_groups = forked.paged, forked.seq_groups
    leaders = [int(torch.nonzero(seq_groups == g)[0]) for g in range(len(forked.prefix_lens))]
    q = torch.randn(sum(counts), hq, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(q_dtype)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32)
    outs, lses = [], []
    for g, leader in enumerate(leaders):
        n = int(forked.prefix_lens[g])
        rows = q[cu[g] : cu[g + 1]]
        k, v = paged.dense_k[leader][:n], paged.dense_v[leader][:n]
        out, lse = naive_attention(rows, k, v, [n - 1] * len(rows), scale=1 / math.sqrt(head_dim))
        outs.append(out)
        lses.append(lse)
    tables = paged.block_tables[leaders]
    caches = dict(k_cache=paged.k_cache, v_cache=paged.v_cache, k_scale=paged.k_scale, v_scale=paged.v_scale)
    return q, caches, tables, forked.prefix_lens.to(torch.int32), cu, torch.cat(outs), torch.cat(lses)


# (groups (prefix, member lens), queries per group, Hq, Hkv, D, block size, cache dtype, q dtype)
CASES = [
    pytest.param([(16, [20, 17]), (8, [9, 30])], [3, 2], 4, 2, 16, 8, F32, F32, id="two-groups-gqa"),
    pytest.param([(32, [40]), (8, [9]), (24, [25])], [1, 20, 4], 8, 2, 32, 8, F32, F32, id="many-queries-qtiles"),
    pytest.param([(12, [13, 14])], [5], 6, 1, 16, 4, F16, F16, id="mqa-group6-f16"),
    pytest.param([(16, [17]), (32, [33])], [0, 3], 4, 4, 24, 16, BF16, BF16, id="mha-bf16-d24-empty-group"),
    pytest.param([(8, [9]), (16, [17])], [2, 2], 4, 2, 16, 8, F16, F32, id="q32-kv16"),
    pytest.param([(24, [25, 30])], [64], 4, 2, 16, 8, F32, F32, id="64-queries-one-group"),  # a system-prompt group
    pytest.param([(16, [20]), (8, [9]), (8, [12])], [3, 1, 0], 4, 2, 16, 8, F32, F32, id="empty-last-group"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("groups,counts,hq,hkv,head_dim,block_size,dtype,q_dtype", CASES)
def test_prefix_matches_naive(backend, groups, counts, hq, hkv, head_dim, block_size, dtype, q_dtype):
    q, caches, tables, plens, cu, expected, expected_lse = prefix_case(
        groups, counts, hq=hq, hkv=hkv, head_dim=head_dim, block_size=block_size, dtype=dtype, q_dtype=q_dtype
    )
    for splits in (None, 3):
        out, lse = call_on_backend(
            paged_prefix_attention, q, **_args(caches, tables, plens, cu), num_splits=splits, backend=backend
        )
        assert out.dtype == q_dtype and out.shape == q.shape and lse.shape == q.shape[:2]
        assert_close(out, expected, TOL[q_dtype])
        assert_close(lse, expected_lse, TOL[q_dtype])


def _args(caches, tables, plens, cu):
    return dict(caches, block_tables=tables, prefix_lens=plens, cu_seqlens_q=cu)


@pytest.mark.parametrize("cache_dtype", [I8, E4M3])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_prefix_quantized_cache(backend, cache_dtype):
    q, caches, tables, plens, cu, expected, expected_lse = prefix_case(
        [(16, [17, 20]), (8, [12])], [3, 2], hq=4, hkv=2, head_dim=16, block_size=8, dtype=cache_dtype
    )
    out, lse = call_on_backend(paged_prefix_attention, q, **_args(caches, tables, plens, cu), backend=backend)
    assert_close(out, expected, 1e-4)  # the truth is over the dequantized values
    assert_close(lse, expected_lse, 1e-4)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty_prefix_gives_zero_and_minus_inf(backend):
    q, caches, tables, plens, cu, _, _ = prefix_case([(8, [9]), (8, [9])], [2, 1],
                                                      hq=2, hkv=1, head_dim=16, block_size=8)
    plens = torch.tensor([0, 8], dtype=torch.int32)
    out, lse = call_on_backend(paged_prefix_attention, q, **_args(caches, tables, plens, cu), backend=backend)
    assert (out[:2] == 0).all() and torch.isneginf(lse[:2]).all()
    assert torch.isfinite(out[2]).all() and torch.isfinite(lse[2]).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_prepared_matches_checked_and_reads_nothing_back(backend):
    from no_host_reads import forbid_host_reads

    q, caches, tables, plens, cu, expected, _ = prefix_case([(16, [17, 20]), (8, [9])], [2, 3], hq=4, hkv=2,
                                                            head_dim=16, block_size=8)  # fmt: skip
    counts = np.diff(cu.numpy())

    def prepared(q, caches, tables, plens, backend):
        meta = prepare_prefix_metadata(
            tables.cpu().numpy(), plens.cpu().numpy(), counts, block_size=8, num_blocks=caches["k_cache"].shape[0],
            device=q.device,
        )  # fmt: skip
        with forbid_host_reads():
            return paged_prefix_attention_prepared(q, **caches, meta=meta, backend=backend)

    out, _ = call_on_backend(prepared, q, caches, tables, plens, backend=backend)
    assert_close(out, expected, TOL[F32])


def test_reference_is_the_torch_path():
    q, caches, tables, plens, cu, expected, _ = prefix_case([(8, [9, 10])], [2], hq=2, hkv=2, head_dim=16, block_size=8)
    out, _ = paged_prefix_attention(q, **_args(caches, tables, plens, cu), backend="torch")
    assert_close(out, expected, TOL[F32])


def test_prefix_tile_holds_every_head_of_a_group():
    assert prefix_tile(4, 8) == (32, 8)
    assert prefix_tile(4, 100) == (64, 16)  # capped: several query tiles
    assert prefix_tile(1, 1) == (16, 16)  # dot M padded to 16
    assert prefix_tile(128, 1) == (128, 1)  # a group wider than the cap still fits one query


def _bad_inputs():
    q, caches, tables, plens, cu, _, _ = prefix_case([(8, [9]), (8, [12])], [2, 1],
                                                      hq=2, hkv=1, head_dim=16, block_size=8)
    return dict(q=q, **_args(caches, tables, plens, cu))


@pytest.mark.parametrize(
    "change,error",
    [
        (lambda a: {"cu_seqlens_q": torch.tensor([0, 2, 1], dtype=torch.int32)}, OutOfRangeError),
        (lambda a: {"cu_seqlens_q": torch.tensor([0, 2, 4], dtype=torch.int32)}, OutOfRangeError),
        (lambda a: {"cu_seqlens_q": torch.tensor([0, 3], dtype=torch.int32)}, InvalidArgumentError),
        (lambda a: {"prefix_lens": torch.tensor([8, 99], dtype=torch.int32)}, OutOfRangeError),
        (lambda a: {"block_tables": a["block_tables"].clone().fill_(500)}, OutOfRangeError),
        (lambda a: {"prefix_lens": torch.tensor([8.0, 8.0])}, InvalidArgumentError),
        (lambda a: {"q": a["q"][:, :, :8]}, InvalidArgumentError),
    ],
    ids=["cu-decreasing", "cu-past-rows", "cu-shape", "prefix-too-long", "block-id", "lens-dtype", "head-dim"],
)
def test_bad_input_raises_before_launch(monkeypatch, change, error):
    inputs = _bad_inputs()
    inputs.update(change(inputs))
    assert_rejected(monkeypatch, pfx, ["_prefix_triton", "_prefix_torch"], paged_prefix_attention, inputs, error)


def test_prepared_rejects_bad_metadata():
    q, caches, tables, plens, cu, _, _ = prefix_case([(8, [9])], [2], hq=2, hkv=1, head_dim=16, block_size=8)
    meta = prepare_prefix_metadata(tables.numpy(), plens.numpy(), [2], block_size=8, num_blocks=4, device="cpu")
    with pytest.raises(InvalidArgumentError):
        paged_prefix_attention_prepared(q[:1], **caches, meta=meta)  # rows differ from the metadata's
    with pytest.raises(InvalidArgumentError):
        paged_prefix_attention_prepared(q, **caches, meta="meta")
    with pytest.raises(OutOfRangeError):
        prepare_prefix_metadata(tables.numpy(), [8], [2], block_size=8, num_blocks=1, device="cpu")
    with pytest.raises(OutOfRangeError):
        prepare_prefix_metadata(tables.numpy(), [800], [2], block_size=8, num_blocks=99, device="cpu")


@pytest.mark.parametrize(
    "change,error,named",
    [
        ({"query_counts": [2, -1]}, OutOfRangeError, "query_counts"),
        ({"block_size": 0}, InvalidArgumentError, "block_size"),
        ({"block_size": None}, InvalidArgumentError, "block_size"),
        ({"num_blocks": "8"}, InvalidArgumentError, "num_blocks"),
        ({"device": "no-such-device"}, InvalidArgumentError, "device"),
    ],
    ids=["negative-count", "block-size-0", "block-size-none", "num-blocks-str", "device"],
)
def test_prepare_prefix_metadata_names_the_bad_argument(change, error, named):
    args = dict(tables=[[0, 1], [2, 3]], prefix_lens=[8, 4], query_counts=[2, 1], block_size=4, num_blocks=8,
                device="cpu")  # fmt: skip
    with pytest.raises(error, match=named):
        prepare_prefix_metadata(**{**args, **change})


def test_kernels_build_for_gpu():
    calls = """
kc = torch.randn(8, 16, 2, 128)
bt, plens = torch.arange(8, dtype=torch.int32).view(2, 4), torch.tensor([64, 32], dtype=torch.int32)
cu = torch.tensor([0, 8, 12], dtype=torch.int32)
q = torch.randn(12, 8, 128, dtype=torch.bfloat16)
kb = kc.bfloat16()
pfx.paged_prefix_attention(q, kb, kb, bt, plens, cu, soft_cap=30.0, num_splits=3, backend="triton")
e4m3, scale = kc.to(torch.float8_e4m3fn), torch.ones(8, 16, 2)
pfx.paged_prefix_attention(q.float(), e4m3, e4m3, bt, plens, cu, k_scale=scale, v_scale=scale, backend="triton")
kc8 = torch.randn(8, 16, 2, 256, dtype=torch.float16)
pfx.paged_prefix_attention(torch.randn(12, 16, 256, dtype=torch.float16), kc8, kc8, bt, plens, cu, backend="triton")
"""
    assert build_for_gpu(calls) == ["_prefix_kernel", "_merge_splits_kernel", "_prefix_kernel", "_prefix_kernel"]

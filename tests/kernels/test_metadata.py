"""Prepared attention metadata: host-side validation, and prepared kernels equal to the checked ones with no host read.

The prepared wrappers take block ids and lengths validated on the host and must give exactly the
checked wrappers' results (same kernels, same inputs), while reading no device value themselves.
Bound once on a step's first layer (``bind_*``), a call runs every layer like the prepared call.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from attention_cases import BF16, F32, I8, build_paged, fail_launch
from backend_device import TRITON_DEVICE, call_on_backend
from no_host_reads import LaunchRecorder, forbid_host_reads

import kernels.decode_attention as dec
import kernels.prefill_attention as pre
import kernels.splits as spl
from kernels import (
    AttentionMetadata,
    paged_decode_attention,
    paged_decode_attention_prepared,
    paged_prefill_attention,
    paged_prefill_attention_prepared,
    prepare_attention_metadata,
    write_kv,
    write_kv_prepared,
)
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, PagedKVError

wkv = importlib.import_module("kernels.cache_write")
DEVICE = TRITON_DEVICE  # the interpreter on CPU; inputs are built there, so call_on_backend moves nothing


def _meta(paged, q_lens, device=DEVICE) -> AttentionMetadata:
    lens = paged.seq_lens.tolist()
    computed = [n - q for n, q in zip(lens, q_lens)]
    return prepare_attention_metadata(
        paged.block_tables.tolist(), computed, list(q_lens), block_size=paged.k_cache.shape[1],
        num_blocks=paged.k_cache.shape[0], device=device,
    )  # fmt: skip


def _to(paged, device):
    for name in ("k_cache", "v_cache", "k_scale", "v_scale", "block_tables", "seq_lens"):
        t = getattr(paged, name)
        setattr(paged, name, None if t is None else t.to(device))
    return paged


# -- preparation ------------------------------------------------------------------------------


def test_prepare_builds_tables_lengths_and_slots():
    meta = prepare_attention_metadata([[3, 1], [0]], [5, 0], [2, 3], block_size=4, num_blocks=4)
    assert meta.block_tables.tolist() == [[3, 1], [0, 0]]
    assert meta.seq_lens.tolist() == [7, 3] and meta.cu_seqlens_q.tolist() == [0, 2, 5]
    assert meta.slot_mapping.tolist() == [1 * 4 + 1, 1 * 4 + 2, 0, 1, 2]
    assert (meta.max_seq_len, meta.max_query_len, meta.min_seq_len, meta.max_context_len) == (7, 3, 3, 5)
    assert not meta.is_decode and meta.num_seqs == 2 and meta.num_tokens == 5


@pytest.mark.parametrize(
    "tables,computed,new,error",
    [
        ([[0, 9]], [5], [1], OutOfRangeError),  # block 9 of a 4-block pool is in use
        ([[-1]], [0], [1], OutOfRangeError),
        ([[0]], [4], [1], InvalidArgumentError),  # 5 tokens, one block of 4
        ([[0]], [0], [0], InvalidArgumentError),  # an empty sequence
        ([[0]], [-1], [2], InvalidArgumentError),
        ([[0]], [True], [1], InvalidArgumentError),  # bools are not counts
        ([[0.0]], [0], [1], InvalidArgumentError),
        ([[0], [1]], [0], [1, 1], InvalidArgumentError),
        (torch.zeros(1, 1, dtype=torch.int32), [0], [1], InvalidArgumentError),  # host lists only
        ([[0], [0]], [0, 0], [1, 1], InvalidArgumentError),  # two writers of one slot
    ],
)
def test_prepare_rejects_bad_steps_with_typed_errors(tables, computed, new, error):
    with pytest.raises(error) as info:
        prepare_attention_metadata(tables, computed, new, block_size=4, num_blocks=4)
    assert isinstance(info.value, PagedKVError)


def test_padding_entries_past_a_sequence_are_not_checked():
    meta = prepare_attention_metadata([[2, 1000]], [3], [1], block_size=4, num_blocks=4)
    assert meta.seq_lens.tolist() == [4]


@pytest.mark.parametrize("padding", [2**32 - 1, -(2**40)])
def test_padding_that_no_int32_table_holds_is_a_typed_error(padding):
    with pytest.raises(OutOfRangeError, match=r"tables\[0\]\[1\]"):
        prepare_attention_metadata([[2, padding]], [3], [1], block_size=4, num_blocks=4)


def test_prepared_wrappers_reject_metadata_of_another_pool():
    paged = build_paged([9, 4], block_size=4, num_kv_heads=2, head_dim=16)
    meta = _meta(paged, [1, 1], device=torch.device("cpu"))
    q = torch.randn(2, 4, 16)
    small = paged.k_cache[:2]
    with pytest.raises(OutOfRangeError):
        paged_decode_attention_prepared(q, small, small.clone(), meta, backend="torch")
    with pytest.raises(InvalidArgumentError):
        paged_decode_attention_prepared(q, paged.k_cache.view(-1, 2, 2, 16), paged.v_cache.view(-1, 2, 2, 16), meta)
    with pytest.raises(InvalidArgumentError):
        paged_decode_attention_prepared(q[:1], paged.k_cache, paged.v_cache, meta)  # one query short
    prefill = _meta(paged, [3, 1], device=torch.device("cpu"))
    with pytest.raises(InvalidArgumentError):
        paged_decode_attention_prepared(q, paged.k_cache, paged.v_cache, prefill)  # not a decode step
    with pytest.raises(InvalidArgumentError):
        paged_decode_attention_prepared(q, paged.k_cache, paged.v_cache, "meta")


# -- prepared == checked ----------------------------------------------------------------------

CASES = [
    pytest.param(F32, F32, 4, 2, 32, 4, [1, 9, 23], id="f32-bs4"),
    pytest.param(BF16, BF16, 8, 2, 64, 16, [40, 3], id="bf16-bs16"),
    pytest.param(F32, I8, 4, 4, 32, 8, [17, 8], id="int8-bs8"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("q_dtype,cache_dtype,hq,hkv,head_dim,block_size,lens", CASES)
def test_prepared_decode_equals_checked(backend, q_dtype, cache_dtype, hq, hkv, head_dim, block_size, lens):
    device = DEVICE if backend == "triton" else torch.device("cpu")
    paged = _to(build_paged(lens, block_size=block_size, num_kv_heads=hkv, head_dim=head_dim,
                            dtype=cache_dtype, shared_blocks=1), device)  # fmt: skip
    q = torch.randn(len(lens), hq, head_dim, generator=torch.Generator().manual_seed(1)).to(q_dtype).to(device)
    meta = _meta(paged, [1] * len(lens), device)
    kw = {"k_scale": paged.k_scale, "v_scale": paged.v_scale, "backend": backend, "sliding_window": 7}
    expected = call_on_backend(paged_decode_attention, q, paged.k_cache, paged.v_cache, paged.block_tables,
                               paged.seq_lens, **kw)  # fmt: skip
    got = call_on_backend(paged_decode_attention_prepared, q, paged.k_cache, paged.v_cache, meta, **kw)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("q_dtype,cache_dtype,hq,hkv,head_dim,block_size,lens", CASES)
def test_prepared_prefill_equals_checked(backend, q_dtype, cache_dtype, hq, hkv, head_dim, block_size, lens):
    device = DEVICE if backend == "triton" else torch.device("cpu")
    paged = _to(build_paged(lens, block_size=block_size, num_kv_heads=hkv, head_dim=head_dim,
                            dtype=cache_dtype), device)  # fmt: skip
    q_lens = [max(1, n // 2) for n in lens]
    meta = _meta(paged, q_lens, device)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=torch.Generator().manual_seed(2)).to(q_dtype).to(device)
    kw = {"k_scale": paged.k_scale, "v_scale": paged.v_scale, "backend": backend}
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, meta.cu_seqlens_q)
    expected = call_on_backend(paged_prefill_attention, *args, **kw)
    got = call_on_backend(paged_prefill_attention_prepared, q, paged.k_cache, paged.v_cache, meta, **kw)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("cache_dtype", [F32, BF16, I8])
def test_prepared_write_equals_checked(backend, cache_dtype):
    device = DEVICE if backend == "triton" else torch.device("cpu")
    gen = torch.Generator().manual_seed(3)
    meta = prepare_attention_metadata([[5, 2], [0, 7], [3]], [3, 0, 1], [2, 6, 2], block_size=4, num_blocks=8,
                                      device=device)  # fmt: skip
    key, value = (torch.randn(10, 2, 32, generator=gen).to(device) for _ in range(2))
    caches, scales = [], []
    for _ in range(2):
        storage = torch.zeros(8, 4, 2, 32, dtype=F32 if cache_dtype == I8 else cache_dtype).to(cache_dtype)
        caches.append([storage.to(device), storage.clone().to(device)])
        scale = torch.zeros(8, 4, 2).to(device) if cache_dtype == I8 else None
        scales.append([scale, None if scale is None else scale.clone()])
    call_on_backend(write_kv, key, value, caches[0][0], caches[1][0], meta.slot_mapping, k_scale=scales[0][0],
                    v_scale=scales[1][0], backend=backend)  # fmt: skip
    call_on_backend(write_kv_prepared, key, value, caches[0][1], caches[1][1], meta, k_scale=scales[0][1],
                    v_scale=scales[1][1], backend=backend)  # fmt: skip
    for pair in (*caches, *(s for s in scales if s[0] is not None)):
        assert torch.equal(pair[0].view(torch.uint8), pair[1].view(torch.uint8))


# -- bound once per step, run per layer -------------------------------------------------------


def _layers(cache: torch.Tensor, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` caches of ``cache``'s geometry and dtype: the cache, then ones of other random values."""
    gen = torch.Generator().manual_seed(seed)
    noise = [torch.randn(cache.shape, generator=gen) for _ in range(count - 1)]
    return [cache] + [(64 * n).round().to(cache.dtype) if cache.dtype == I8 else n.to(cache.dtype) for n in noise]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("cache_dtype", [F32, I8])
def test_calls_bound_on_the_first_layer_run_every_layer_like_the_prepared_ones(backend, cache_dtype):
    device = DEVICE if backend == "triton" else torch.device("cpu")
    paged = build_paged([9, 23, 5], block_size=4, num_kv_heads=2, head_dim=16, dtype=cache_dtype, shared_blocks=1)
    layers = list(zip(_layers(paged.k_cache, 3, seed=5), _layers(paged.v_cache, 3, seed=6)))
    decode, prefill = _meta(paged, [1, 1, 1], device), _meta(paged, [4, 7, 2], device)
    q, new = torch.randn(13, 4, 16), torch.randn(13, 2, 16)

    def run(q, new, layers, scales, backend):
        """Per call: (bound result, prepared result) on every layer."""
        kw = {"k_scale": scales[0], "v_scale": scales[1], "backend": backend}
        attend = ((dec.bind_decode_attention, paged_decode_attention_prepared, q[:3], decode),
                  (pre.bind_prefill_attention, paged_prefill_attention_prepared, q, prefill))  # fmt: skip
        results = []
        for bind, prepared, x, meta in attend:
            bound = bind(x, *layers[0], meta, **kw)
            results += [(bound(x, k, v, *scales), prepared(x, k, v, meta, **kw)) for k, v in layers]
        written = [(k.clone(), v.clone()) for k, v in layers]
        bound = wkv.bind_write_kv(new, new, *layers[0], prefill, **kw)
        for (k, v), (k2, v2) in zip(layers, written):
            bound(new, new, k, v, *scales)
            write_kv_prepared(new, new, k2, v2, prefill, **kw)
            results += [(k, k2), (v, v2)]
        return results

    scales = [paged.k_scale, paged.v_scale]
    for got, expected in call_on_backend(run, q, new, layers, scales, backend=backend):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_a_bound_call_rejects_a_layer_of_another_geometry_before_any_launch(monkeypatch):
    paged = build_paged([9, 4], block_size=4, num_kv_heads=2, head_dim=16)
    meta = _meta(paged, [1, 1], torch.device("cpu"))
    q = torch.randn(2, 4, 16)
    bound = dec.bind_decode_attention(q, paged.k_cache, paged.v_cache, meta, backend="torch")
    monkeypatch.setattr(dec, "_decode_torch", fail_launch)
    wider = torch.zeros(paged.k_cache.shape[0] + 1, *paged.k_cache.shape[1:])
    for layer in ((q[:1], paged.k_cache, paged.v_cache), (q, wider, wider), (q.half(), paged.k_cache, paged.v_cache)):
        with pytest.raises(InvalidArgumentError):
            bound(*layer, None, None)


# -- no host reads ----------------------------------------------------------------------------


def test_prepared_torch_paths_read_no_device_value():
    paged = build_paged([9, 30, 1], block_size=4, num_kv_heads=2, head_dim=16, shared_blocks=1)
    decode, prefill = _meta(paged, [1, 1, 1], torch.device("cpu")), _meta(paged, [4, 1, 1], torch.device("cpu"))
    q = torch.randn(3, 4, 16)
    with forbid_host_reads():
        paged_decode_attention_prepared(q, paged.k_cache, paged.v_cache, decode, backend="torch")
        paged_prefill_attention_prepared(torch.randn(6, 4, 16), paged.k_cache, paged.v_cache, prefill,
                                         backend="torch")  # fmt: skip
        k = torch.randn(6, 2, 16)
        write_kv_prepared(k, k, paged.k_cache, paged.v_cache, prefill, backend="torch")


def test_binding_and_bound_torch_calls_read_no_device_value():
    paged = build_paged([9, 30, 1], block_size=4, num_kv_heads=2, head_dim=16, shared_blocks=1)
    decode, q = _meta(paged, [1, 1, 1], torch.device("cpu")), torch.randn(3, 4, 16)
    with forbid_host_reads():
        bound = dec.bind_decode_attention(q, paged.k_cache, paged.v_cache, decode, backend="torch")
        out = bound(q, paged.k_cache.clone(), paged.v_cache.clone(), None, None)  # another layer, same values
    assert torch.equal(out, paged_decode_attention_prepared(q, paged.k_cache, paged.v_cache, decode, backend="torch"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU launch check; on a GPU the sync-debug engine test covers it")
def test_prepared_triton_wrappers_launch_without_reading_device_values(monkeypatch):
    paged = build_paged([9, 300, 1], block_size=4, num_kv_heads=2, head_dim=16)
    decode, prefill = _meta(paged, [1, 1, 1], torch.device("cpu")), _meta(paged, [4, 1, 1], torch.device("cpu"))
    kernels = {}
    for module, name in ((dec, "_decode_split_kernel"), (spl, "_merge_splits_kernel"), (pre, "_prefill_kernel"),
                         (wkv, "_write_kv_kernel")):  # fmt: skip
        kernels[name] = LaunchRecorder()
        monkeypatch.setattr(module, name, kernels[name])
    q, k = torch.randn(6, 4, 16), torch.randn(6, 2, 16)
    with forbid_host_reads():
        call_on_backend(paged_decode_attention_prepared, q[:3], paged.k_cache, paged.v_cache, decode,
                        backend="triton", num_splits=2)  # fmt: skip
        call_on_backend(paged_prefill_attention_prepared, q, paged.k_cache, paged.v_cache, prefill, backend="triton")
        call_on_backend(write_kv_prepared, k, k, paged.k_cache, paged.v_cache, prefill, backend="triton")
    assert kernels["_decode_split_kernel"].calls[0][0] == (3, 2, 2)  # (seqs, kv heads, splits) from host ints
    assert len(kernels["_merge_splits_kernel"].calls) == 1
    assert kernels["_prefill_kernel"].calls[0][0][2] == 3 and len(kernels["_write_kv_kernel"].calls) == 1


def test_host_lengths_drive_the_split_count_not_the_device():
    meta = prepare_attention_metadata([[0] * 64], [1023], [1], block_size=16, num_blocks=1)
    assert spl.choose_num_splits(meta.num_seqs, 8, meta.max_seq_len, torch.device("cpu")) == 2
    assert isinstance(meta.host_seq_lens, np.ndarray) and meta.host_seq_lens.tolist() == [1024]

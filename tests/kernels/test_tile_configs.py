"""Tuned tile tables: lookup order, file checks, and the kernels taking a tuned tile (still correct)."""

from __future__ import annotations

import json

import pytest
import torch
import triton.language as tl
from attention_cases import TOL, assert_close, build_paged, naive_attention
from backend_device import call_on_backend

import kernels.tile_configs as tc
from kernels.decode_attention import decode_tile, decode_tile_key, decode_waves, paged_decode_attention
from kernels.prefill_attention import prefill_tile, prefill_tile_key
from kernels.prefix_attention import prefix_launch, prefix_tile_key
from kernels.tile_configs import check_table, load_table, overriding, save_table, tuned_tile
from paged_kv.errors import InvalidArgumentError

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A 'CUDA' device named 'NVIDIA H100 80GB HBM3' whose tables live in tmp_path."""
    monkeypatch.setattr(tc, "_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(tc, "CONFIG_DIR", tmp_path)
    load_table.cache_clear()
    tc._device_table.cache_clear()
    yield tmp_path
    load_table.cache_clear()
    tc._device_table.cache_clear()


def test_gpu_name_is_a_file_stem(fake_gpu):
    assert tc.gpu_name(CUDA) == "nvidia_h100_80gb_hbm3"
    assert tc.config_path("nvidia_h100_80gb_hbm3") == fake_gpu / "nvidia_h100_80gb_hbm3.json"


def test_lookup_order_override_then_file_and_never_a_file_on_cpu(fake_gpu):
    key = decode_tile_key(128, 2, tl.bfloat16)
    assert key == "decode/d128-c2-bf16"
    save_table(tc.config_path("nvidia_h100_80gb_hbm3"), {key: {"BLOCK_N": 32, "num_warps": 4}})
    assert tuned_tile(key, CUDA) == {"BLOCK_N": 32, "num_warps": 4}
    assert tuned_tile(key, CPU) is None  # CPU tensors never read a GPU table
    with overriding({key: {"BLOCK_N": 128}}):
        with overriding({"other/x": {"waves": 1}}):
            assert tuned_tile(key, CUDA) == {"BLOCK_N": 128}  # the outer override still wins over the file
        assert tuned_tile(key, CPU) == {"BLOCK_N": 128}
    assert tuned_tile(key, CUDA) == {"BLOCK_N": 32, "num_warps": 4}
    assert tuned_tile("decode/d64-c2-bf16", CUDA) is None


def test_save_merges_and_is_read_back(fake_gpu):
    path = fake_gpu / "t.json"
    save_table(path, {"a/x": {"BLOCK_N": 32}, "b/y": {"waves": 2}})
    save_table(path, {"a/x": {"BLOCK_N": 64}})
    assert json.loads(path.read_text()) == {"a/x": {"BLOCK_N": 64}, "b/y": {"waves": 2}}
    assert load_table(path)["a/x"] == {"BLOCK_N": 64}


@pytest.mark.parametrize(
    "table",
    [[1, 2], {"a/x": {}}, {"a/x": {"BLOCK_Q": 16}}, {"a/x": {"BLOCK_N": 0}}, {"a/x": {"BLOCK_N": True}},
     {"a/x": {"BLOCK_N": 16.0}}, {"a/x": 16}, {"a/x": {"BLOCK_N": 48}}, {"a/x": {"num_warps": 6}}],
    ids=["not-a-mapping", "empty-entry", "unknown-field", "zero", "bool", "float", "not-an-entry", "block-48",
         "warps-6"],
)  # fmt: skip
def test_bad_tables_raise_naming_the_place(table):
    with pytest.raises(InvalidArgumentError, match="table"):
        check_table(table)
    with pytest.raises(InvalidArgumentError):
        with overriding(table):
            pass
    assert tc._overrides == []  # a rejected override leaves nothing installed


def test_a_malformed_file_raises_naming_it(fake_gpu):
    path = tc.config_path("nvidia_h100_80gb_hbm3")
    path.write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="nvidia_h100_80gb_hbm3.json"):
        tuned_tile("decode/d128-c2-bf16", CUDA)


def test_tile_functions_take_the_tuned_values():
    key = decode_tile_key(128, 1, tl.bfloat16)
    builtin = decode_tile(128, 1, tl.bfloat16, CPU)
    with overriding({key: {"BLOCK_N": 32, "num_stages": 2, "waves": 4}}):
        assert decode_tile(128, 1, tl.bfloat16, CPU) == (32, builtin[1], 2)  # warps stay built-in
        assert decode_waves(128, 1, tl.bfloat16, CPU) == 4
        assert decode_tile(128, 1, tl.bfloat16) == builtin  # no device: the heuristic
    assert decode_waves(128, 1, tl.bfloat16, CPU) == 2
    pkey = prefill_tile_key(128, 4, tl.bfloat16)
    with overriding({pkey: {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}}):
        assert prefill_tile(128, 4, tl.bfloat16, "tf32", CPU) == (64, 32, 4, 2)
        assert prefill_tile(128, 16, tl.bfloat16, "tf32", CPU) != (64, 32, 4, 2)  # another group, another key
    assert prefix_launch(128, 2, tl.bfloat16, CPU) == decode_tile(128, 2, tl.bfloat16)  # untuned: decode's tile
    with overriding({prefix_tile_key(128, 2, tl.bfloat16): {"BLOCK_N": 128, "num_warps": 4}}):
        assert prefix_launch(128, 2, tl.bfloat16, CPU) == (128, 4, decode_tile(128, 2, tl.bfloat16)[2])


def test_decode_with_a_tuned_tile_is_still_correct():
    paged = build_paged([37, 80], block_size=8, num_kv_heads=2, head_dim=16, seed=4)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(5))
    key = decode_tile_key(16, 4, tl.float32)
    with overriding({key: {"BLOCK_N": 16, "num_warps": 2, "num_stages": 1}}):
        assert decode_tile(16, 4, tl.float32, CPU)[0] == 16
        out = call_on_backend(paged_decode_attention, q, paged.k_cache, paged.v_cache, paged.block_tables,
                              paged.seq_lens, backend="triton")  # fmt: skip
    for s, n in enumerate((37, 80)):
        expected, _ = naive_attention(q[s : s + 1], paged.dense_k[s], paged.dense_v[s], [n - 1], scale=0.25)
        assert_close(out[s : s + 1], expected, TOL[torch.float32])

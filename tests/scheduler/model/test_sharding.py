"""The shard layout: head, intermediate and vocabulary splits, KV-head replication, sliced weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_kv.errors import InvalidArgumentError
from scheduler import LlamaModel, ModelConfig
from scheduler.distributed.parallel_state import TPShard
from scheduler.model.sharding import shard_state_dict

CFG = ModelConfig(vocab_size=255, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=4)  # fmt: skip


def test_kv_heads_split_or_replicate():
    assert [TPShard(r, 2).kv_heads(2, 4) for r in range(2)] == [(0, 1), (1, 2)]
    assert [TPShard(r, 4).kv_heads(2, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # replicated
    with pytest.raises(InvalidArgumentError, match="tensor_parallel_size=3"):
        TPShard(0, 3).kv_heads(2, 6)


def test_shards_hold_their_rows_and_the_last_vocab_part_is_padded():
    torch.manual_seed(0)
    full = LlamaModel(CFG).state_dict()
    parts = [shard_state_dict(CFG, full, TPShard(r, 2)) for r in range(2)]
    assert parts[1]["embed.weight"].shape == (128, 16) and not parts[1]["embed.weight"][-1].any()
    assert torch.equal(torch.cat([p["embed.weight"] for p in parts])[:255], full["embed.weight"])
    qkv = full["layers.0.attn.qkv.weight"]  # [q 16 | k 8 | v 8, hidden]
    assert torch.equal(parts[1]["layers.0.attn.qkv.weight"], torch.cat([qkv[8:16], qkv[20:24], qkv[28:32]]))
    gate_up = full["layers.0.mlp.gate_up.weight"]  # [gate 32 | up 32, hidden]
    assert torch.equal(parts[0]["layers.0.mlp.gate_up.weight"], torch.cat([gate_up[:16], gate_up[32:48]]))
    assert torch.equal(torch.cat([p["layers.0.attn.o.weight"] for p in parts], 1), full["layers.0.attn.o.weight"])
    for r, part in enumerate(parts):
        LlamaModel(CFG, TPShard(r, 2)).load_state_dict(part, strict=True)  # shapes fit the shard's layers


def test_qkv_biases_are_sliced_like_their_rows_and_q_k_norms_replicated():
    cfg = dataclasses.replace(CFG, attention_bias=True, qk_norm=True)  # Qwen2's biases with Qwen3's norms
    torch.manual_seed(0)
    full = {k: torch.randn_like(v) for k, v in LlamaModel(cfg).state_dict().items()}
    parts = [shard_state_dict(cfg, full, TPShard(r, 2)) for r in range(2)]
    bias = full["layers.0.attn.qkv.bias"]  # [q 16 | k 8 | v 8]: rank 0 keeps q heads 0-1, k head 0, v head 0
    assert torch.equal(parts[0]["layers.0.attn.qkv.bias"], torch.cat([bias[:8], bias[16:20], bias[24:28]]))
    for r, part in enumerate(parts):
        for norm in ("q_norm", "k_norm"):  # over head_dim, the same for every head: each rank holds it whole
            assert torch.equal(part[f"layers.0.attn.{norm}.weight"], full[f"layers.0.attn.{norm}.weight"])
        LlamaModel(cfg, TPShard(r, 2)).load_state_dict(part, strict=True)



def test_the_o_bias_is_replicated_and_added_once_after_the_all_reduce(monkeypatch):
    from scheduler.model import parallel_layers

    cfg = dataclasses.replace(CFG, attention_bias=True, o_bias=True)  # Llama / Qwen3 with attention_bias
    torch.manual_seed(0)
    full = {k: torch.randn_like(v) for k, v in LlamaModel(cfg).state_dict().items()}
    parts = [shard_state_dict(cfg, full, TPShard(r, 2)) for r in range(2)]
    o = "layers.0.attn.o."
    assert all(torch.equal(p[o + "bias"], full[o + "bias"]) for p in parts)
    ranks = [LlamaModel(cfg, TPShard(r, 2)) for r in range(2)]
    for model, part in zip(ranks, parts):
        model.load_state_dict(part, strict=True)
    x = torch.randn(3, 16)  # the attention output [T, Hq * D]: rank r holds columns 8r..8r+8
    sent = []  # what each rank hands the all-reduce; one process plays both ranks, rank 1 first
    monkeypatch.setattr(parallel_layers, "all_reduce", lambda t: sent.append(t) or sum(sent))
    ranks[1].layers[0].attn.o(x[:, 8:])
    out = ranks[0].layers[0].attn.o(x[:, :8])  # rank 0 sees both partial sums
    torch.testing.assert_close(out, x @ full[o + "weight"].T + full[o + "bias"])

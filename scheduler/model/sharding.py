"""Slicing a whole model's weights (this project's fused key names) into one rank's shard.

Fused weights are split part by part: ``qkv`` (its weight and, for Qwen2, its bias) keeps this
rank's query heads, then its KV heads of K, then of V; ``gate_up`` keeps this rank's gate rows,
then its up rows. Row-parallel weights (``o``, ``down``) keep their input columns; ``o``'s bias
(Llama, Qwen3 and Qwen3-MoE with ``attention_bias``) is replicated, since the layer adds it after the sum. A sparse MoE
layer's experts are split the same way, each expert along its own intermediate dimension
(``experts.gate_up`` [E, 2I, H] on dim 1, ``experts.down`` [E, H, I] on dim 2), and so is the
shared expert (``shared_expert_intermediate_size``); the router and the shared-expert gate are
replicated. The embedding and LM head keep this rank's vocabulary rows, the last rank's part
padded with zero rows. The norms are replicated: the layer norms, and Qwen3's q/k norms, whose
weight over ``head_dim`` is the same for every head.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from scheduler.distributed.parallel_state import TPShard
from scheduler.model.llama import LlamaModel, ModelConfig


def shard_state_dict(cfg: ModelConfig, state: Mapping[str, torch.Tensor], shard: TPShard) -> dict[str, torch.Tensor]:
    """The tensors of rank ``shard.rank`` from a whole model's state dict (``LlamaModel.state_dict()`` keys)."""
    if shard.size == 1:
        return dict(state)
    d = cfg.head_dim
    q0, q1 = shard.split(cfg.num_heads, "num_heads")
    k0, k1 = shard.kv_heads(cfg.num_kv_heads, cfg.num_heads)
    q_rows = (q0 * d, q1 * d)
    kv_off = cfg.num_heads * d
    k_rows = (kv_off + k0 * d, kv_off + k1 * d)
    v_rows = (k_rows[0] + cfg.num_kv_heads * d, k_rows[1] + cfg.num_kv_heads * d)
    i0, i1 = shard.split(cfg.intermediate_size, "intermediate_size")
    inter = cfg.intermediate_size
    out = {}
    for key, t in state.items():
        if ".mlp." in key and key.split(".mlp.")[1] in MOE_PARTS:
            out[key] = _moe_part(cfg, key.split(".mlp.")[1], t, shard)
        elif key.endswith(("attn.qkv.weight", "attn.qkv.bias")):
            out[key] = _rows(t, q_rows, k_rows, v_rows)
        elif key.endswith("mlp.gate_up.weight"):
            out[key] = _rows(t, (i0, i1), (inter + i0, inter + i1))
        elif key.endswith("attn.o.weight"):
            out[key] = t[:, q0 * d : q1 * d].clone()
        elif key.endswith("mlp.down.weight"):
            out[key] = t[:, i0:i1].clone()
        elif key in ("embed.weight", "lm_head.weight"):
            out[key] = _vocab_rows(t, shard)
        else:  # norms (input, post-attention, final, q/k) and o's bias (added once, after the all-reduce): replicated
            out[key] = t.clone()
    return out


def shard_model(model: LlamaModel, shard: TPShard) -> LlamaModel:
    """A new model holding rank ``shard.rank``'s part of ``model`` (a whole, unsharded model), same dtype/device."""
    weight = model.embed.weight
    part = LlamaModel(model.config, shard)
    part.load_state_dict(shard_state_dict(model.config, model.state_dict(), shard), strict=True)
    return part.to(device=weight.device, dtype=weight.dtype).eval()


# the sparse layers' weights (their keys after ``mlp.``), sliced by _moe_part
MOE_PARTS = ("experts.gate_up", "experts.down", "shared.gate_up.weight", "shared.down.weight",
             "router.weight", "shared_gate.weight")  # fmt: skip


def _moe_part(cfg: ModelConfig, part: str, t: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """This rank's slice of one sparse-layer weight: experts and shared expert by intermediate rows; the rest whole."""
    if part.startswith("experts."):
        a, b = shard.split(cfg.moe_intermediate_size, "moe_intermediate_size")
        size = cfg.moe_intermediate_size
    elif part.startswith("shared."):
        a, b = shard.split(cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size")
        size = cfg.shared_expert_intermediate_size
    else:  # the router and the shared-expert gate: every rank routes every token
        return t.clone()
    if part.endswith("gate_up") or part.endswith("gate_up.weight"):  # [..., 2I, H]: gate rows, then up rows
        return torch.cat([t[..., a:b, :], t[..., size + a : size + b, :]], dim=-2).clone()
    return t[..., a:b].clone()  # down: [..., H, I], this rank's input columns


def _rows(t: torch.Tensor, *ranges: tuple[int, int]) -> torch.Tensor:
    """The rows of each [start, end) range, concatenated."""
    return torch.cat([t[a:b] for a, b in ranges]).clone()


def _vocab_rows(t: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """This rank's vocabulary rows of ``t`` ``[vocab, hidden]``, zero-padded to the part size."""
    start, end = shard.vocab(t.shape[0])
    part = t[start:end]
    pad = (end - start) - part.shape[0]
    return torch.cat([part, part.new_zeros(pad, *t.shape[1:])]) if pad > 0 else part.clone()

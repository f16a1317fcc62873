"""Load a :class:`~scheduler.model.llama.LlamaModel` from a transformers Llama-family model or its state dict.

The checkpoint's separate q/k/v and gate/up projections are concatenated into
the fused ``qkv`` and ``gate_up`` weights (one matmul each per layer). Llama, Mistral,
Qwen2 and Qwen3 share these key names; Qwen2 adds the q/k/v biases (fused the same way), a
Llama, Qwen3 or Qwen3-MoE with ``attention_bias`` those and ``o_proj.bias``, and Qwen3 the
per-head ``self_attn.q_norm`` / ``self_attn.k_norm`` weights. The sparse layers of Mixtral,
Qwen2-MoE and Qwen3-MoE load from transformers v5's fused expert tensors or from a checkpoint
folder's per-expert ones (:func:`_sparse_mlp`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from paged_kv.errors import InvalidArgumentError, check_type, describe
from paged_kv.tensor_checks import FLOAT_DTYPES, check_device, check_dtype
from scheduler.model.llama import LlamaModel, ModelConfig


def from_hf_model(hf_model: torch.nn.Module, *, dtype: torch.dtype | None = None, device=None) -> LlamaModel:
    """Build a model with the weights of a transformers ``LlamaForCausalLM`` (Mistral, Qwen2, Qwen3) object."""
    if not hasattr(hf_model, "config") or not hasattr(hf_model, "state_dict"):
        raise InvalidArgumentError(describe("hf_model", type(hf_model).__name__, "a transformers causal LM"))
    _check_target(dtype, device)
    state = hf_model.state_dict()
    dtype = dtype or next(iter(state.values())).dtype
    return from_state_dict(ModelConfig.from_hf(hf_model.config), state, dtype=dtype, device=device)


def from_state_dict(
    cfg: ModelConfig, state: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32, device=None
) -> LlamaModel:
    """Build a model from a checkpoint state dict with transformers Llama key names."""
    check_type("cfg", cfg, ModelConfig, "a ModelConfig")
    check_type("state", state, Mapping, "a mapping of parameter names to tensors")
    _check_target(dtype, device)
    model = LlamaModel(cfg)
    try:
        model.load_state_dict(convert_state_dict(cfg, state), strict=True)
    except RuntimeError as e:  # shape mismatches
        problem = str(e).splitlines()[-1].strip()
        raise InvalidArgumentError(describe("state_dict", problem, f"weights for {cfg}")) from None
    return model.to(device=device, dtype=dtype).eval()


def _check_target(dtype: torch.dtype | None, device: object) -> None:
    """The model's dtype (a float dtype, None = the checkpoint's) and device (None = where the weights are)."""
    if dtype is not None:
        check_dtype("dtype", dtype, FLOAT_DTYPES)
    if device is not None:
        check_device("device", device)


def convert_state_dict(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map transformers Llama keys to this model's keys, fusing q/k/v and gate/up."""
    get = _getter(state)
    out = {"embed.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    head = state.get("lm_head.weight")
    out["lm_head.weight"] = head if head is not None and not cfg.tie_word_embeddings else out["embed.weight"]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        out[dst + "attn.qkv.weight"] = torch.cat([get(attn + f"{p}_proj.weight") for p in "qkv"])
        if cfg.attention_bias:
            out[dst + "attn.qkv.bias"] = torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"])
        out[dst + "attn.o.weight"] = get(attn + "o_proj.weight")
        if cfg.o_bias:
            out[dst + "attn.o.bias"] = get(attn + "o_proj.bias")
        if cfg.qk_norm:
            out[dst + "attn.q_norm.weight"] = get(attn + "q_norm.weight")
            out[dst + "attn.k_norm.weight"] = get(attn + "k_norm.weight")
        if i in cfg.sparse_layers:
            out.update(_sparse_mlp(cfg, state, src, dst + "mlp."))
        else:
            out.update(_swiglu(get, src + "mlp.", dst + "mlp."))
        out[dst + "input_norm.weight"] = get(src + "input_layernorm.weight")
        out[dst + "post_attn_norm.weight"] = get(src + "post_attention_layernorm.weight")
    return out


def _swiglu(get, src: str, dst: str) -> dict[str, torch.Tensor]:
    """A SwiGLU MLP's ``gate_proj``/``up_proj``/``down_proj`` under ``src`` as the fused ``gate_up`` and ``down``."""
    gate_up = torch.cat([get(src + "gate_proj.weight"), get(src + "up_proj.weight")])
    return {dst + "gate_up.weight": gate_up, dst + "down.weight": get(src + "down_proj.weight")}


def _sparse_mlp(cfg: ModelConfig, state: Mapping[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    """One sparse layer's router, experts and shared expert, from either layout transformers uses.

    transformers v5 models hold the experts fused under ``mlp.``: ``experts.gate_up_proj`` [E, 2I, H] (gate
    rows, then up) and ``experts.down_proj`` [E, H, I]. Checkpoint folders hold them one by one and are
    stacked here: ``mlp.experts.{e}.gate_proj.weight`` (Qwen), ``block_sparse_moe.experts.{e}.w1.weight``
    (Mixtral: w1 gate, w3 up, w2 down; its router ``block_sparse_moe.gate``).
    """
    get = _getter(state)
    mixtral_folder = src + "block_sparse_moe.gate.weight" in state
    moe = src + ("block_sparse_moe." if mixtral_folder else "mlp.")
    out = {dst + "router.weight": get(moe + "gate.weight")}
    if moe + "experts.gate_up_proj" in state:
        out[dst + "experts.gate_up"] = get(moe + "experts.gate_up_proj")
        out[dst + "experts.down"] = get(moe + "experts.down_proj")
    else:
        gate, up, down = ("w1", "w3", "w2") if mixtral_folder else ("gate_proj", "up_proj", "down_proj")
        expert = [f"{moe}experts.{e}." for e in range(cfg.num_experts)]
        out[dst + "experts.gate_up"] = torch.stack([
            torch.cat([get(f"{e}{gate}.weight"), get(f"{e}{up}.weight")]) for e in expert
        ])  # fmt: skip
        out[dst + "experts.down"] = torch.stack([get(f"{e}{down}.weight") for e in expert])
    if cfg.shared_expert_intermediate_size:
        out.update(_swiglu(get, moe + "shared_expert.", dst + "shared."))
        out[dst + "shared_gate.weight"] = get(moe + "shared_expert_gate.weight")
    return out


def _getter(state: Mapping[str, torch.Tensor]):
    def get(key: str) -> torch.Tensor:
        """The tensor under ``key``, or a typed error naming the missing key."""
        if key not in state:
            raise InvalidArgumentError(describe("state_dict", f"missing {key!r}", "transformers Llama key names"))
        return state[key]

    return get

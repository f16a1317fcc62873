"""Load a :class:`~scheduler.model.llama.LlamaModel` from a transformers Llama-family model or its state dict.

The checkpoint's separate q/k/v and gate/up projections are concatenated into
the fused ``qkv`` and ``gate_up`` weights (one matmul each per layer). Llama, Mistral,
Qwen2 and Qwen3 share these key names; Qwen2 adds the q/k/v biases (fused the same way)
and Qwen3 the per-head ``self_attn.q_norm`` / ``self_attn.k_norm`` weights.
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
        if cfg.qk_norm:
            out[dst + "attn.q_norm.weight"] = get(attn + "q_norm.weight")
            out[dst + "attn.k_norm.weight"] = get(attn + "k_norm.weight")
        mlp = src + "mlp."
        out[dst + "mlp.gate_up.weight"] = torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")])
        out[dst + "mlp.down.weight"] = get(src + "mlp.down_proj.weight")
        out[dst + "input_norm.weight"] = get(src + "input_layernorm.weight")
        out[dst + "post_attn_norm.weight"] = get(src + "post_attention_layernorm.weight")
    return out


def _getter(state: Mapping[str, torch.Tensor]):
    def get(key: str) -> torch.Tensor:
        """The tensor under ``key``, or a typed error naming the missing key."""
        if key not in state:
            raise InvalidArgumentError(describe("state_dict", f"missing {key!r}", "transformers Llama key names"))
        return state[key]

    return get

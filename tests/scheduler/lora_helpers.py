"""Helpers of the LoRA tests: seeded random PEFT adapters written to a folder, and their merged transformers oracle."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


def write_adapter(folder: Path, hf_model, *, seed: int, rank: int = 4, alpha: float = 16.0,
                  targets=ALL_TARGETS, std: float = 0.3, **config) -> str:  # fmt: skip
    """A PEFT-format LoRA adapter for ``hf_model`` in ``folder`` (random A and B drawn with ``seed``); its path."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(hf_model.model.layers):
        for module in targets:
            linear = getattr(getattr(layer, _PARENT[module]), module)
            prefix = f"base_model.model.model.layers.{i}.{_PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=g) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=g) * std
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
           "use_rslora": False, "use_dora": False, "modules_to_save": None, "task_type": "CAUSAL_LM"} | config
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return str(folder)


def merged(hf_model, path: str):
    """The oracle: a copy of ``hf_model`` with every target's weight ``W + scale * B @ A`` (PEFT's merge)."""
    cfg = json.loads((Path(path) / "adapter_config.json").read_text())
    r = cfg["r"]
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    from safetensors.torch import load_file

    tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for module in cfg["target_modules"]:
                prefix = f"base_model.model.model.layers.{i}.{_PARENT[module]}.{module}"
                a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
                linear = getattr(getattr(layer, _PARENT[module]), module)
                linear.weight.add_((b @ a) * scale)
    return model

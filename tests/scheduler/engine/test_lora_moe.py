"""LoRA adapters on a mixture-of-experts model: the attention projections and the dense MLP layers take them (equal
to transformers with the adapter merged), a sparse layer's experts take none (refused at load, naming the key)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from sched_helpers import greedy_reference, make_engine, tiny_moe

from paged_kv.errors import InvalidArgumentError
from scheduler import LoRAConfig, LoRARequest, ModelConfig, SamplingParams
from scheduler.model.lora_adapter import load_adapter

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _write(folder, hf, modules: dict[int, tuple[str, ...]], *, seed: int = 3, rank: int = 4) -> str:
    """A PEFT adapter with random A/B on ``modules[layer]`` of each listed layer of ``hf``; its path."""
    folder.mkdir()
    g, tensors, targets = torch.Generator().manual_seed(seed), {}, set()
    for i, names in modules.items():
        layer = hf.model.layers[i]
        for name in names:
            parent = "self_attn" if name in ATTENTION else "mlp"
            linear = getattr(getattr(layer, parent), name)
            prefix = f"base_model.model.model.layers.{i}.{parent}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=g) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=g) * 0.3
            targets.add(name)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8.0, "target_modules": sorted(targets), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def qwen3_moe():
    """A tiny Qwen3-MoE: layers 1 and 3 sparse, 0 and 2 dense."""
    hf = tiny_moe("qwen3_moe")
    assert ModelConfig.from_hf(hf.config).sparse_layers == (1, 3)
    return hf


def _merge(hf, path: str):
    """A copy of ``hf`` with each weight the adapter has merged (``W + scale * B @ A``, layer by layer)."""
    cfg = json.loads(open(f"{path}/adapter_config.json").read())
    scale = cfg["lora_alpha"] / cfg["r"] if not cfg.get("use_rslora") else cfg["lora_alpha"] / math.sqrt(cfg["r"])
    tensors, model = load_file(f"{path}/adapter_model.safetensors"), copy.deepcopy(hf)
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            module = model.get_submodule(key.removeprefix("base_model.model.").removesuffix(".lora_A.weight"))
            module.weight.add_((b @ a) * scale)
    return model


def test_an_adapter_on_attention_and_dense_mlps_of_a_moe_model_equals_merged_transformers(qwen3_moe, prompts,
                                                                                           tmp_path):  # fmt: skip
    modules = {0: ATTENTION + MLP, 1: ATTENTION, 2: ("q_proj", "down_proj"), 3: ("v_proj", "o_proj")}
    path = _write(tmp_path / "moe_adapter", qwen3_moe, modules)
    oracle = _merge(qwen3_moe, path)
    expected = greedy_reference(oracle, prompts[:2], num_new=6)
    base = greedy_reference(qwen3_moe, prompts[:2], num_new=6)
    assert expected != base  # the adapter changes the answers
    engine = make_engine(qwen3_moe, lora=LoRAConfig(max_loras=1, max_lora_rank=8))
    lora = LoRARequest(name="moe", path=path)
    outs = engine.generate(prompts[:2] * 2, GREEDY, lora_request=[lora, lora, None, None])
    assert [o.outputs[0].token_ids for o in outs] == expected + base


def test_an_adapter_on_a_sparse_layers_mlp_is_refused_naming_the_key(qwen3_moe, tmp_path):
    path = _write(tmp_path / "experts", qwen3_moe, {0: ("gate_proj",)})
    blob = tmp_path / "experts" / "adapter_model.safetensors"
    tensors = {k.replace("layers.0.", "layers.1."): v for k, v in load_file(str(blob)).items()}  # layer 1: sparse
    save_file(tensors, str(blob))
    with pytest.raises(InvalidArgumentError, match=r"layers\.1\.mlp\.gate_proj.*mixture-of-experts"):
        load_adapter(path, ModelConfig.from_hf(qwen3_moe.config), 8)

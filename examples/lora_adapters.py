"""Multi-LoRA serving: one base model, requests through two PEFT adapters and through none, batched together.

Writes two small random LoRA adapters for SmolLM2-135M-Instruct (PEFT's folder format: adapter_config.json and
adapter_model.safetensors) in a temporary folder, then answers one question three ways in the same engine steps:
through adapter "pirate", through adapter "terse", and through the base model. The adapters are random (not
trained), so their answers are merely different: the point is that each request gets its own adapter's K/V and
tokens while sharing every step. Runs on the CPU in under a minute, most of it loading the model.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from scheduler import LLM, CacheConfig, EngineConfig, LoRARequest, SamplingParams
from scheduler.model.loader import load_model

TARGETS = {"q_proj": "self_attn", "v_proj": "self_attn", "down_proj": "mlp"}


def write_random_adapter(folder: Path, hf_model, seed: int, rank: int = 8) -> str:
    """A PEFT LoRA adapter with seeded random A and B for q_proj, v_proj and down_proj of every layer."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(hf_model.model.layers):
        for module, parent in TARGETS.items():
            linear = getattr(getattr(layer, parent), module)
            key = f"base_model.model.model.layers.{i}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=g) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=g) * 0.1
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": list(TARGETS), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def main() -> None:
    """Answer one question through two adapters and the base model in the same steps; print the three answers."""
    torch.set_num_threads(1)
    loaded = load_model(None)  # SmolLM2-135M-Instruct
    with tempfile.TemporaryDirectory() as tmp:
        pirate = LoRARequest(name="pirate", path=write_random_adapter(Path(tmp, "pirate"), loaded.hf_model, seed=1))
        terse = LoRARequest(name="terse", path=write_random_adapter(Path(tmp, "terse"), loaded.hf_model, seed=2))
        config = EngineConfig(cache=CacheConfig(num_gpu_blocks=128), device="cpu")
        llm = LLM(loaded, engine_config=config, enable_lora=True, max_loras=2, max_lora_rank=8)
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        params = SamplingParams(max_tokens=24, temperature=0)
        steps = []
        schedule = llm.engine.scheduler.schedule
        llm.engine.scheduler.schedule = lambda **kw: steps.append(out := schedule(**kw)) or out
        outs = llm.chat([chat] * 3, params, lora_request=[pirate, terse, None])
        for name, out in zip(("pirate", "terse", "base"), outs):
            print(f"{name:>6}: {out.outputs[0].text!r}")
        mixed = sum(len({s.group.lora for s in out.scheduled}) == 3 for out in steps)
        print(f"{len(steps)} engine steps, {mixed} of them ran all three (two adapters and the base model) together")
        assert len({o.outputs[0].text for o in outs}) == 3, "each adapter changes the answer"


if __name__ == "__main__":
    main()

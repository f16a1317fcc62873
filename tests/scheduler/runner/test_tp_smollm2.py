"""SmolLM2-135M split over 3 gloo ranks answers token for token like one rank (float32, greedy).

SmolLM2-135M has 9 query heads and 3 KV heads, so it splits over 3 ranks (not 2): one KV head each.
"""

from __future__ import annotations

import pytest
import torch

from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler.entrypoints.workload import chat_workload


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(smollm2):
    torch.set_num_threads(1)
    hf, tokenizer = smollm2
    prompts = [r.prompt_token_ids for r in chat_workload(tokenizer, 3, 8, seed=2)]
    outs = {}
    for tp in (1, 3):
        config = EngineConfig(
            cache=CacheConfig(block_size=16, num_gpu_blocks=64, watermark=0.0),
            scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=4), device="cpu",
            tensor_parallel_size=tp, distributed_timeout_s=120.0,
        )  # fmt: skip
        with LLMEngine.from_hf(hf, config) as engine:
            assert engine.runner.gpu_cache.spec.num_kv_heads == 3 // tp
            done = engine.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
            outs[tp] = [o.outputs[0].token_ids for o in done]
    assert outs[3] == outs[1]

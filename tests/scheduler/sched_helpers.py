"""Helpers of the scheduler tests: constants, a tiny random Llama and an engine factory over a transformers model."""

from __future__ import annotations

import torch

from scheduler import CacheConfig, EngineConfig, LLMEngine, SchedulerConfig

VOCAB = 256
NUM_NEW = 12  # tokens generated per prompt in the reference runs
SHARED = list(range(100, 140))  # a 40-token "system prompt" several prompts start with
TINY_LLAMA = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, eos_token_id=None,
    bos_token_id=None, pad_token_id=None,
)  # fmt: skip


def tiny_llama(seed: int = 0, **overrides):
    """A seeded random float32 LlamaForCausalLM of ``TINY_LLAMA``'s shape, with ``overrides`` of its config fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**(TINY_LLAMA | overrides))).eval()


def make_engine(
    hf_model, *, num_blocks=256, block_size=4, num_cpu_blocks=0, prefix=True, device="cpu", tp=1, **sched
) -> LLMEngine:
    """An engine over ``hf_model``'s weights, on the CPU unless told (no watermark unless given; ``tp`` ranks)."""
    sched.setdefault("max_num_batched_tokens", 256)
    watermark = sched.pop("watermark", 0.0)
    cache = CacheConfig(
        block_size=block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, watermark=watermark,
        enable_prefix_caching=prefix,
    )  # fmt: skip
    config = EngineConfig(
        cache=cache, scheduler=SchedulerConfig(**sched), device=device, tensor_parallel_size=tp,
        distributed_timeout_s=30.0,
    )  # fmt: skip
    return LLMEngine.from_hf(hf_model, config)


def assert_all_freed(engine):
    """Nothing is left referenced: every block is free or only cached."""
    stats = engine.block_manager.stats()
    assert stats.num_used == 0 and stats.num_sequences == 0
    engine.block_manager.check()
    assert not engine.has_unfinished_requests()


def after_each_schedule(engine, record) -> None:
    """Call ``record(out)`` with every SchedulerOutput the engine's scheduler makes from now on."""
    schedule = engine.scheduler.schedule

    def traced():
        out = schedule()
        record(out)
        return out

    engine.scheduler.schedule = traced

"""Helpers of the scheduler tests: constants, tiny random Llama and Qwen models, their greedy references and logits
over packed steps, and an engine factory over a transformers model."""

from __future__ import annotations

import torch

from kernels.metadata import prepare_attention_metadata
from paged_kv.kv_cache import PagedKVCache
from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

VOCAB = 256
NUM_NEW = 12  # tokens generated per prompt in the reference runs
GREEDY = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)  # the engine's side of greedy_reference
SHARED = list(range(100, 140))  # a 40-token "system prompt" several prompts start with
# engine settings the greedy-equality tests run under: name -> (engine kwargs, what must have happened)
ENGINE_CASES = {
    "prefix_caching": (dict(), "hits"),
    "chunked_prefill": (dict(max_num_batched_tokens=8, max_num_seqs=4), "chunks"),
    "whole_prefill": (dict(enable_chunked_prefill=False, max_num_batched_tokens=128), None),
    "no_prefix_cache": (dict(prefix=False), None),
    "preempt_recompute": (dict(num_blocks=20, max_num_batched_tokens=32, max_num_seqs=8), "recompute"),
    "preempt_swap": (
        dict(num_blocks=20, num_cpu_blocks=64, preemption_mode="swap", max_num_batched_tokens=32, max_num_seqs=8),
        "swap",
    ),
}
TINY_LLAMA = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, eos_token_id=None,
    bos_token_id=None, pad_token_id=None,
)  # fmt: skip


def tiny_llama(seed: int = 0, **overrides):
    """A seeded random float32 LlamaForCausalLM of ``TINY_LLAMA``'s shape, with ``overrides`` of its config fields.

    With ``attention_bias=True`` the q/k/v/o biases (transformers starts them at 0) are drawn too.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return draw(LlamaForCausalLM(LlamaConfig(**(TINY_LLAMA | overrides))).eval(), ("_proj.bias",))


def draw(model, suffixes: tuple[str, ...]):
    """``model`` with a seeded random term (std 0.5) added to every parameter whose name ends with a suffix."""
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith(suffixes):
                p.add_(torch.randn_like(p) * 0.5)
    return model


def tiny_qwen(kind: str, seed: int = 0, **overrides):
    """A seeded random float32 Qwen2ForCausalLM ("qwen2") or Qwen3ForCausalLM ("qwen3") of ``TINY_LLAMA``'s shape.

    transformers starts the q/k/v biases at 0 and the q/k norm weights at 1; they are drawn here too, so a model
    that skipped them would compute other logits.
    """
    import transformers

    name = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
    config_cls, model_cls = getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(TINY_LLAMA | overrides))).eval()
    return draw(model, ("_proj.bias", "q_norm.weight", "k_norm.weight"))


# tiny MoE shapes on TINY_LLAMA: kind -> (transformers class prefix, config fields)
TINY_MOE = {
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # a dense layer (mlp_only_layers) between sparse ones, and the gated shared expert
    "qwen2_moe": ("Qwen2Moe", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    # top-k not renormalized (Qwen3-MoE's default), every other layer sparse (decoder_sparse_step=2)
    "qwen3_moe": ("Qwen3Moe", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                   head_dim=32, norm_topk_prob=False, decoder_sparse_step=2)),
    "qwen3_moe_norm": ("Qwen3Moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                        norm_topk_prob=True)),
}  # fmt: skip


def tiny_moe(kind: str, seed: int = 0, **overrides):
    """A seeded random float32 Mixtral, Qwen2-MoE or Qwen3-MoE causal LM (``TINY_MOE[kind]`` on ``TINY_LLAMA``).

    transformers starts the routers and the q/k/v biases at 0 and the q/k norms at 1; they are drawn here too,
    so a model that routed, biased or normed otherwise would compute other logits.
    """
    import transformers

    name, fields = TINY_MOE[kind]
    config_cls, model_cls = getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(TINY_LLAMA | fields | overrides))).eval()
    return draw(model, ("_proj.bias", "q_norm.weight", "k_norm.weight", "gate.weight"))


def greedy_reference(hf_model, prompts: list[list[int]], num_new: int = NUM_NEW) -> list[list[int]]:
    """transformers' greedy continuation of every prompt: ``num_new`` argmax tokens each, nothing suppressed.

    It agrees with the engine's ``GREEDY`` (``ignore_eos=True``) by construction: the engine neither blocks EOS
    nor stops on it, so neither does this loop over the model's own forward and KV cache. transformers'
    ``generate`` cannot stand in: it stops on EOS unless ``min_new_tokens`` is set, and that masks the EOS ids.
    """
    from transformers import DynamicCache

    from paged_kv.integrations.transformers import cache_keyword

    refs, keyword = [], cache_keyword(hf_model)  # "cache" from transformers 5.24 on, "past_key_values" before
    with torch.no_grad():
        for p in prompts:
            kv, tokens, ids = DynamicCache(config=hf_model.config), [], p  # the loop's own cache, grown in place
            for _ in range(num_new):
                out = hf_model(torch.tensor([ids]), use_cache=True, **{keyword: kv})
                tokens.append(int(out.logits[0, -1].argmax()))
                ids = tokens[-1:]
            refs.append(tokens)
    return refs


def packed_forward(model, seqs: list[list[int]], chunks: list[list[int]], block: int = 4) -> list[torch.Tensor]:
    """Run ``seqs`` through ``model`` (a LlamaModel) in packed steps (chunks[s] = new-token counts of seq s per
    step) over a paged cache with non-trivial block ids; every position's logits, per sequence."""
    cache = PagedKVCache(model.kv_cache_spec(block), 96)
    tables = [list(range(32 * i, 32 * i + 32)) for i in range(len(seqs))][::-1]
    done, logits = [0] * len(seqs), [[] for _ in seqs]
    for step in range(len(chunks[0])):
        counts = [c[step] for c in chunks]
        ids = [t for s, n, d in zip(seqs, counts, done) for t in s[d : d + n]]
        pos = [p for n, d in zip(counts, done) for p in range(d, d + n)]
        meta = prepare_attention_metadata(tables, done, counts, block_size=block, num_blocks=96)
        out = model(torch.tensor(ids), torch.tensor(pos), cache, meta, torch.arange(len(ids)))
        for s, rows in enumerate(out.split(counts)):
            logits[s].append(rows)
        done = [d + n for d, n in zip(done, counts)]
    return [torch.cat(rows) for rows in logits]


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(tokens), vocab]`` (float32) over one unpadded sequence."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def assert_packed_logits_match(model, hf_model, prompts: list[list[int]]) -> None:
    """``model``'s logits over packed steps (prefills, chunks, decodes and idle rows) equal transformers'."""
    seqs = [prompts[3], prompts[2], prompts[6][:20]]
    chunks = [[30, 1, 30, 1, 1], [10, 20, 1, 1, 1], [1, 1, 16, 1, 1]]
    for seq, got, n in zip(seqs, packed_forward(model, seqs, chunks), map(sum, chunks)):
        torch.testing.assert_close(got, hf_logits(hf_model, seq[:n]), atol=1e-4, rtol=1e-4)


def assert_greedy_matches(hf_model, prompts: list[list[int]], refs: list[list[int]], sched: dict) -> None:
    """The engine's greedy tokens equal ``refs``: chunked prefill when ``sched`` is given, else prefix hits."""
    engine = make_engine(hf_model, **sched)
    steps = []
    after_each_schedule(engine, steps.append)
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    if sched:  # some prompt was split over steps
        assert any(s.num_tokens < s.seq.num_tokens - s.start for out in steps for s in out.scheduled)
    else:  # the prompts sharing a 40-token prefix read its cached blocks
        assert engine.block_manager.stats().hit_rate > 0.1


def make_engine(
    hf_model, *, num_blocks=256, block_size=4, num_cpu_blocks=0, prefix=True, device="cpu", tp=1, speculative=None,
    lora=None, kv_events=None, **sched,
) -> LLMEngine:
    """An engine over ``hf_model``'s weights, on the CPU unless told (no watermark unless given; ``tp`` ranks;
    ``speculative``: a SpeculativeConfig; ``lora``: a LoRAConfig; ``kv_events``: a KVEventsConfig)."""
    sched.setdefault("max_num_batched_tokens", 256)
    watermark = sched.pop("watermark", 0.0)
    cache = CacheConfig(
        block_size=block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, watermark=watermark,
        enable_prefix_caching=prefix,
    )  # fmt: skip
    config = EngineConfig(
        cache=cache, scheduler=SchedulerConfig(**sched), device=device, tensor_parallel_size=tp,
        distributed_timeout_s=30.0, speculative_config=speculative, lora_config=lora, kv_events=kv_events,
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

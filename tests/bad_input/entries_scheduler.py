"""Bad-input rows of ``scheduler``: the configs, the model, the engine, beam search and the text-level LLM."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from bad_input_machinery import (
    BAD_DTYPE,
    BAD_ID,
    BOOL_FOR_INT,
    INF,
    NAN,
    NAN_INF,
    NONINTEGRAL,
    NOT_NEGATIVE,
    OUT_OF_RANGE,
    WRONG_TYPE,
    Arg,
    Entry,
    requiring,
)

import scheduler

# a lora_request of an engine without LoRA (every subject here has it off): wrong types, a wrong count, an adapter
LORA_REQUEST = {WRONG_TYPE: ["x", 3, [None, None]], BAD_ID: [scheduler.LoRARequest(name="a", path="/no/such")]}
LORA_KEY = {WRONG_TYPE: ["x", 3, scheduler.LoRARequest(name="a", path="/no/such")]}

# -- subjects --------------------------------------------------------------------------------------
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, head_dim=8, max_position_embeddings=128)


def tiny_model() -> scheduler.LlamaModel:
    """A one-layer Llama, seeded (2 query heads, 1 KV head)."""
    torch.manual_seed(0)
    return scheduler.LlamaModel(scheduler.ModelConfig(**TINY, num_layers=1, num_heads=2, num_kv_heads=1))


def engine_config() -> scheduler.EngineConfig:
    """A small CPU engine configuration: 32 blocks of 4, swap space 4."""
    cache_cfg = scheduler.CacheConfig(block_size=4, num_gpu_blocks=32, num_cpu_blocks=4, watermark=0.0)
    return scheduler.EngineConfig(cache=cache_cfg, device="cpu")


def pinned_engine() -> scheduler.LLMEngine:
    """``engine()`` with a pin waiting for its warm-up request (id "paged-kv-pin-0")."""
    e = engine()
    e.pin_prefix([5, 6, 7, 8, 9])
    return e


def engine() -> scheduler.LLMEngine:
    """An engine holding one waiting request 'r0'."""
    e = scheduler.LLMEngine(tiny_model(), engine_config(), eos_token_id=2)
    e.add_request("r0", [1, 2, 3], scheduler.SamplingParams(max_tokens=2))
    return e


@functools.cache
def _tiny_text_model() -> tuple[object, object]:
    """(transformers model, tokenizer): the scheduler tests' tiny Llama and BPE tokenizer, built once."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scheduler"))
    from text_helpers import tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return LlamaForCausalLM(cfg).eval(), tokenizer


def text_engine() -> scheduler.LLMEngine:
    """A text-capable engine: the tiny text model's, with structured outputs enabled."""
    return tiny_llm().engine


def loaded_tiny() -> object:
    """The tiny model and tokenizer as the loader hands them to LLM."""
    from scheduler.model.loader import LoadedModel

    hf, tokenizer = _tiny_text_model()
    return LoadedModel(hf_model=hf, tokenizer=tokenizer, name="tiny")


def tiny_llm() -> scheduler.LLM:
    """A text-level LLM over the tiny model (a fresh engine each time)."""
    return scheduler.LLM(loaded_tiny(), engine_config=engine_config())


def pinned_llm() -> scheduler.LLM:
    """``tiny_llm()`` with one prefix pinned (id "paged-kv-pin-0")."""
    llm = tiny_llm()
    llm.pin_prefix("hello world, hello there")
    return llm


BAD_ROPE = [
    scheduler.ModelConfig(**TINY, num_layers=1, num_heads=2, num_kv_heads=1, rope_scaling=scaling)
    for scaling in (
        {"rope_type": "linear"},
        {"rope_type": "linear", "factor": "x"},
        {"rope_type": "yarn"},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 4.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 64,
        },
    )
]
TOKENS = {OUT_OF_RANGE: [[-1], [1, 10_000]]}  # prompt ids past the vocab too


# entries whose valid call builds a transformers model or config (the optional hf extra)
NEEDS_TRANSFORMERS = (
    "scheduler.LLMEngine.enable_structured_outputs",
    "scheduler.ModelConfig.from_hf",
    "scheduler.LLMEngine.from_hf",
    "scheduler.from_hf_model",
    "scheduler.from_state_dict",
)


def entries() -> list[Entry]:
    """The scheduler's entry points, each with a valid call."""
    return requiring("transformers", _rows(), NEEDS_TRANSFORMERS)


def _rows() -> list[Entry]:
    """The entries, as a table."""
    # a table: one entry point per entry, its arguments side by side
    # fmt: off
    return [
        Entry("scheduler.SamplingParams", scheduler.SamplingParams, {
            "max_tokens": Arg("int", 4, bad={OUT_OF_RANGE: [0, -1]}),
            "min_tokens": Arg("int", 2, bad={OUT_OF_RANGE: [-1, 5]}),  # at most max_tokens
            "temperature": Arg("real", 0.7, bad={OUT_OF_RANGE: [-0.1, 1e-40, 1e39]}),  # 0 or a normal float32
            "top_k": Arg("int", 0, bad={OUT_OF_RANGE: [-2, 1 << 31]}),  # -1 is vLLM's "off"; an int32
            "top_p": Arg("real", 0.9, bad={OUT_OF_RANGE: [0.0, 1.5]}),
            "min_p": Arg("real", 0.1, bad={OUT_OF_RANGE: [-0.1, 1.5]}),
            "seed": Arg("opt_int", 3, bad={OUT_OF_RANGE: [-(1 << 63) - 1, 1 << 63]}),  # any int64
            "n": Arg("int", 1, bad={OUT_OF_RANGE: [0, 1 << 20]}),
            "stop_token_ids": Arg("ids", (5,), bad={WRONG_TYPE: ["12", 5, None, {5: 1}]}),
            "ignore_eos": Arg("bool", False),
            "logprobs": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 1000]}),
            "prompt_logprobs": Arg("opt_int", 2, bad={OUT_OF_RANGE: [-1, 1000]}),
            "stop": Arg("obj", ("\n",), bad={WRONG_TYPE: [3, [""], ["a", 3], b"x"]}),
            "include_stop_str_in_output": Arg("bool", False), "skip_special_tokens": Arg("bool", True),
            "cache_salt": Arg("obj", None, bad={WRONG_TYPE: [3, "", ["x"]]}),
            "presence_penalty": Arg("real", 0.5, bad={OUT_OF_RANGE: [-2.5, 3.0]}),
            "frequency_penalty": Arg("real", -0.5, bad={OUT_OF_RANGE: [-2.5, 3.0]}),
            "repetition_penalty": Arg("real", 1.2, bad={OUT_OF_RANGE: [0.0, -1.0, 1e-40, 1e39]}),
            "logit_bias": Arg("obj", lambda: {1: 2.0, "7": -3.0}, bad={
                WRONG_TYPE: [[1, 2], "x", 3, {"a": 1.0}, {1: "x"}, {True: 1.0}, {1.0: 1.0}],
                OUT_OF_RANGE: [{1: 101.0}, {1: -100.5}, {-1: 1.0}], NAN_INF: [{1: NAN}, {1: INF}]}),
            "allowed_token_ids": Arg("ids", (1, 2), bad={WRONG_TYPE: ["ab", 5, {1: 2}, []]}),  # None: all allowed
            "bad_words": Arg("obj", ("x",), bad={WRONG_TYPE: [3, [""], ["a", 3], b"x", {"a": 1}]}),
            "bad_words_token_ids": Arg("obj", ((1, 2), (3,)), bad={
                WRONG_TYPE: [3, "ab", [[]], [[1, "x"]], {1: 2}, [5]], OUT_OF_RANGE: [[[-1]]],
                BOOL_FOR_INT: [[[True]]], NONINTEGRAL: [[[1.5]]]}),
            "structured_outputs": Arg("obj", None, bad={WRONG_TYPE: [{"regex": "a"}, "a+", 3]})}),
        Entry("scheduler.StructuredOutputsParams", scheduler.StructuredOutputsParams, {
            "json": Arg("obj", None, bad={WRONG_TYPE: [3, "{bad", "[1]", {"a": {1}}]}),
            "regex": Arg("obj", "a+", bad={WRONG_TYPE: [3, "", b"a+"]}),
            "choice": Arg("obj", None, bad={WRONG_TYPE: ["ab", [], ["a", 3]]}),
            "grammar": Arg("obj", None, bad={WRONG_TYPE: [3, "", b"x"]}),
            "json_object": Arg("bool", False), "disable_any_whitespace": Arg("bool", False),
            "start_after": Arg("obj", None, bad={WRONG_TYPE: [3, "ab", [], [[1]]], BOOL_FOR_INT: [[True]],
                                                 NONINTEGRAL: [[1.5]], OUT_OF_RANGE: [[-1]]})}),
        Entry("scheduler.SchedulerConfig", scheduler.SchedulerConfig, {
            "max_num_batched_tokens": Arg("int", 64, bad={OUT_OF_RANGE: [1, 1 << 62]}),
            "max_num_seqs": Arg("int", 8, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            "enable_chunked_prefill": Arg("bool", True),
            "preemption_mode": Arg("obj", "swap", bad={WRONG_TYPE: ["drop", None, ["swap"]]}),
            "scheduling_policy": Arg("obj", "priority", bad={WRONG_TYPE: ["lifo", None, ["priority"]]})}),
        Entry("scheduler.CacheConfig", scheduler.CacheConfig, {
            "block_size": Arg("int", 4, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            "num_gpu_blocks": Arg("opt_int", 8, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            "kv_cache_bytes": Arg("int", 1 << 20, bad={OUT_OF_RANGE: [0]}), "num_cpu_blocks": Arg("int", 0),
            "watermark": Arg("real", 0.01, bad={OUT_OF_RANGE: [1.0, -0.1]}), "enable_prefix_caching": Arg("bool", True),
            "enable_cascade_attention": Arg("bool", True), "enable_dense_prefill": Arg("bool", True),
            "cascade_min_saved_bytes": Arg("opt_int", 0, bad={OUT_OF_RANGE: [-1]}),
            "dtype": Arg("dtype", torch.float16, bad={BAD_DTYPE: [torch.complex64, torch.int16, torch.float64]}),
            "gpu_memory_utilization": Arg("real", None, skip=(WRONG_TYPE,),
                                          bad={OUT_OF_RANGE: [0.0, 1.5, -0.5], WRONG_TYPE: ["0.5"]}),
            "kv_offloading_bytes": Arg("int", 0), "host_store": Arg("obj", "evict", bad={WRONG_TYPE: [None, 3, "lru"]}),
            "kv_disk_dir": Arg("obj", None, bad={WRONG_TYPE: [3, b"x", ""]}),  # without a host tier: refused
            "kv_disk_bytes": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 1]}),  # > 0 only with a disk directory
            "kv_disk_blocks_per_file": Arg("int", 8, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            # None (never rescan) is valid: the wrong types are the family's others
            "kv_disk_refresh_interval_s": Arg("real", 5.0, skip=(WRONG_TYPE,),
                                              bad={OUT_OF_RANGE: [-1.0, 1e300], WRONG_TYPE: ["5", [5.0]]})}),
        Entry("scheduler.EngineConfig", scheduler.EngineConfig, {
            "cache": Arg("obj", lambda: scheduler.CacheConfig(num_cpu_blocks=1), bad={WRONG_TYPE: [None, {}]}),
            "scheduler": Arg("obj", lambda: scheduler.SchedulerConfig(), bad={WRONG_TYPE: [None, {}]}),
            "device": Arg("device", "cpu"), "enforce_eager": Arg("bool", False),
            "tensor_parallel_size": Arg("int", 1, bad={OUT_OF_RANGE: [0, -1, 1 << 62]}),
            "distributed_timeout_s": Arg("real", 60.0, bad={OUT_OF_RANGE: [0.0, -1.0]}),
            "kv_events": Arg("obj", None, bad={WRONG_TYPE: ["tcp://*:5557", {}, 3]}),
            "speculative_config": Arg("obj", None, bad={WRONG_TYPE: ['{"num_speculative_tokens": 2}', {}, 3]}),
            "lora_config": Arg("obj", None, bad={WRONG_TYPE: [{"max_loras": 2}, "x", 3]}),
            "pooler_config": Arg("obj", None, bad={WRONG_TYPE: [{"pooling_type": "MEAN"}, "LAST", 3]})}),
        Entry("scheduler.PoolingParams", scheduler.PoolingParams, {
            "dimensions": Arg("opt_int", None, bad={OUT_OF_RANGE: [0, -1, 1 << 62]}),
            "normalize": Arg("bool", True, skip=(WRONG_TYPE,), bad={WRONG_TYPE: [1, "yes"]})}),  # None: the default
        Entry("scheduler.PoolerConfig", scheduler.PoolerConfig, {
            "pooling_type": Arg("obj", "LAST", bad={WRONG_TYPE: [None, 3, "CLS", "last"]}),
            "normalize": Arg("bool", True), "is_matryoshka": Arg("bool", True),
            "matryoshka_dimensions": Arg("obj", (64, 128), bad={WRONG_TYPE: ["x", 3, [64], ()],
                                                                  OUT_OF_RANGE: [(0,), (64, -1)]})}),
        Entry("scheduler.PoolerConfig.from_json", scheduler.PoolerConfig.from_json, {
            "text": Arg("obj", '{"pooling_type": "MEAN"}', bad={WRONG_TYPE: [None, 3, "x", "[1]"]})}),
        Entry("scheduler.PoolerConfig.resolve", "resolve", {
            "params": Arg("obj", None, bad={WRONG_TYPE: ["x", {"dimensions": 8}],
                                            OUT_OF_RANGE: [scheduler.PoolingParams(dimensions=8)]}),  # not Matryoshka
            "hidden_size": Arg("int", 64)}, scheduler.PoolerConfig),
        Entry("scheduler.LoRAConfig", scheduler.LoRAConfig, {
            "max_loras": Arg("int", 1, bad={OUT_OF_RANGE: [0, -1, 1 << 62]}),
            "max_lora_rank": Arg("int", 8, bad={OUT_OF_RANGE: [0, 12, -1, 1 << 62]}),  # one of vLLM's ranks
            "max_cpu_loras": Arg("opt_int", None, bad={OUT_OF_RANGE: [0, -1, 1 << 62]})}),  # at least max_loras
        Entry("scheduler.LoRARequest", scheduler.LoRARequest, {
            "name": Arg("obj", "sql", bad={WRONG_TYPE: [None, 3, ""]}),
            "path": Arg("obj", "/adapters/sql", bad={WRONG_TYPE: [None, 3, "", b"/x"]})}),
        Entry("scheduler.SpeculativeConfig", scheduler.SpeculativeConfig, {
            "method": Arg("obj", "ngram", bad={WRONG_TYPE: [None, 3, "eagle"]}),
            "num_speculative_tokens": Arg("int", 2, bad={OUT_OF_RANGE: [0, -1, 65]}),
            "prompt_lookup_max": Arg("opt_int", 3, bad={OUT_OF_RANGE: [0, -1, 1 << 20]}),
            "prompt_lookup_min": Arg("opt_int", 1, bad={OUT_OF_RANGE: [0, -1, 4]})}),  # 4: above the max
        Entry("scheduler.SpeculativeConfig.from_json", scheduler.SpeculativeConfig.from_json, {
            "text": Arg("obj", '{"num_speculative_tokens": 2}', bad={WRONG_TYPE: [None, 3, "{", "[2]"]})},
              named={"text": ("speculative_config",)}),
        Entry("scheduler.SpeculativeConfig.from_dict", scheduler.SpeculativeConfig.from_dict, {
            "values": Arg("obj", lambda: {"num_speculative_tokens": 2}, bad={
                WRONG_TYPE: [{"num_speculative_tokens": "2"}, {"num_speculative_tokens": None}],
                OUT_OF_RANGE: [{"num_speculative_tokens": 0}]})},
              named={"values": ("num_speculative_tokens",)}),
        Entry("scheduler.ModelConfig", scheduler.ModelConfig, {
            "vocab_size": Arg("int", 64, bad={OUT_OF_RANGE: [0]}),
            "hidden_size": Arg("int", 16, bad={OUT_OF_RANGE: [0]}),
            "intermediate_size": Arg("int", 32, bad={OUT_OF_RANGE: [0]}),
            "num_layers": Arg("int", 1, bad={OUT_OF_RANGE: [0]}),
            "num_heads": Arg("int", 2, bad={OUT_OF_RANGE: [0]}),
            "num_kv_heads": Arg("int", 1, bad={OUT_OF_RANGE: [0, 3]}),
            "head_dim": Arg("int", 8, bad={OUT_OF_RANGE: [0]}),
            "rms_norm_eps": Arg("real", 1e-5, bad={OUT_OF_RANGE: [0.0, -1.0]}),
            "rope_theta": Arg("real", 10000.0, bad={OUT_OF_RANGE: [0.0, -1.0]}),
            "rope_scaling": Arg("obj", None, bad={WRONG_TYPE: ["linear", 3, ["linear"]]}),
            "max_position_embeddings": Arg("int", 128, bad={OUT_OF_RANGE: [0]}),
            "tie_word_embeddings": Arg("bool", False), "attention_bias": Arg("bool", False),
            "o_bias": Arg("bool", False),
            "qk_norm": Arg("bool", False), "num_experts": Arg("int", 0, bad=NOT_NEGATIVE),
            "num_experts_per_tok": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 1]}),  # 1: more than the 0 experts
            "moe_intermediate_size": Arg("int", 0, bad=NOT_NEGATIVE), "norm_topk_prob": Arg("bool", False),
            "shared_expert_intermediate_size": Arg("int", 0, bad=NOT_NEGATIVE),
            "sparse_layers": Arg("obj", (), bad={WRONG_TYPE: [[0], "0", None], OUT_OF_RANGE: [(1,), (-1,)]})}),
        Entry("scheduler.ModelConfig.from_hf", scheduler.ModelConfig.from_hf, {
            "hf_config": Arg("obj", lambda: hf_config(), bad={WRONG_TYPE: [None, "x", 3]})}),
        Entry("scheduler.BeamSearchParams", scheduler.BeamSearchParams, {
            "width": Arg("int", 2, bad={OUT_OF_RANGE: [0, -1, 1 << 62]}),
            "max_tokens": Arg("int", 4, bad={OUT_OF_RANGE: [0]}),
            "length_penalty": Arg("real", 1.0),
            "early_stopping": Arg("bool", False, bad={WRONG_TYPE: [1, "always", None]}),
            "stop_token_ids": Arg("ids", (5,), bad={WRONG_TYPE: ["12", 5, None]}), "ignore_eos": Arg("bool", False),
            "include_stop_str_in_output": Arg("bool", False), "skip_special_tokens": Arg("bool", True),
            "cache_salt": Arg("opt_str", None), "logprobs": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 1000]})}),
        Entry("scheduler.LlamaModel", scheduler.LlamaModel, {"cfg": Arg("obj", lambda: tiny_model().config,
            bad={WRONG_TYPE: [None, {}, "x"], OUT_OF_RANGE: BAD_ROPE}),
            "shard": Arg("obj", None, bad={WRONG_TYPE: ["x", 3, (0, 2)]})},  # scalings the model cannot build
              named={"cfg": ("cfg", "rope_scaling")}),
        Entry("scheduler.LlamaModel.kv_cache_spec", "kv_cache_spec", {
            "block_size": Arg("int", 4, bad={OUT_OF_RANGE: [0, -1]}), "dtype": Arg("dtype", torch.float16)},
                tiny_model),
        Entry("scheduler.LlamaModel.enable_dense_prefill", "enable_dense_prefill", {
            "enabled": Arg("bool", True)}, tiny_model),
        Entry("scheduler.LLMEngine", scheduler.LLMEngine, {
            "model": Arg("obj", tiny_model, bad={WRONG_TYPE: [None, "x"]}),
            "config": Arg("obj", engine_config, bad={WRONG_TYPE: ["x", {}]}),
            "eos_token_id": Arg("opt_int", 2,
                bad={OUT_OF_RANGE: [-1], WRONG_TYPE: ["3", {1: 2}], NONINTEGRAL: [1.5, [2.5]],
                    BOOL_FOR_INT: [True, [True]]})}),
        Entry("scheduler.LLMEngine.add_request", "add_request", {
            "request_id": Arg("obj", "x", bad={WRONG_TYPE: [None, 7, ["x"]], BAD_ID: ["r0"]}),
            "prompt_token_ids": Arg("ids", [1, 2], bad={**TOKENS, WRONG_TYPE: ["ab", 5, None, []]}),
            "sampling_params": Arg("obj", None, bad={WRONG_TYPE: [{"max_tokens": 3}, "x"]}),
            "fork_samples": Arg("bool", True),
            "priority": Arg("int", 0, bad={OUT_OF_RANGE: [1 << 63, -(1 << 63) - 1]}),
            "lora_request": Arg("obj", None, bad=LORA_REQUEST)}, engine),
        *[Entry(f"scheduler.LLMEngine.{name}", name, {
            "request_id": Arg("obj", "x", bad={WRONG_TYPE: [None, 7, ["x"]], BAD_ID: ["r0"]}),
            "prompt_token_ids": Arg("ids", [1, 2], bad={**TOKENS, WRONG_TYPE: ["ab", 5, None, []]}),
            "params": Arg("obj", lambda: scheduler.BeamSearchParams(width=2, max_tokens=2),
                          bad={WRONG_TYPE: [None, "x", scheduler.SamplingParams()]}),
            **({"priority": Arg("int", 0, bad={OUT_OF_RANGE: [1 << 63, -(1 << 63) - 1]}), "measure": Arg("bool", False),
                "lora_request": Arg("obj", None, bad=LORA_REQUEST)}
               if name == "add_beam_search" else {"lora": Arg("obj", None, bad=LORA_KEY)})}, engine)
          for name in ("add_beam_search", "check_beam_search")],
        *[Entry(f"scheduler.LLMEngine.{name}", name, {
            "request_id": Arg("obj", "x", bad={WRONG_TYPE: [None, 7, ["x"]], BAD_ID: ["r0"]}),
            "prompt_token_ids": Arg("ids", [1, 2], bad={**TOKENS, WRONG_TYPE: ["ab", 5, None, []]}),
            "pooling_params": Arg("obj", None, bad={WRONG_TYPE: [{"dimensions": 3}, "x"],
                                                    OUT_OF_RANGE: [scheduler.PoolingParams(dimensions=8)]}),
            **({"priority": Arg("int", 0, bad={OUT_OF_RANGE: [1 << 63, -(1 << 63) - 1]})}
               if name == "add_pooling_request" else {})}, engine)
          for name in ("add_pooling_request", "check_pooling_request")],
        Entry("scheduler.LLMEngine.pin_prefix", "pin_prefix", {
            "token_ids": Arg("ids", [1, 2, 3, 4, 5], bad={**TOKENS, WRONG_TYPE: ["ab", 5, None, []]}),
            "cache_salt": Arg("opt_str", None)}, engine),
        Entry("scheduler.LLMEngine.unpin", "unpin", {
            "pin_id": Arg("obj", "paged-kv-pin-0", bad={WRONG_TYPE: [None, 3, ["x"]], BAD_ID: ["paged-kv-pin-9"]})},
              pinned_engine),
        Entry("scheduler.LLMEngine.enable_structured_outputs", "enable_structured_outputs", {
            "tokenizer": Arg("obj", lambda: _tiny_text_model()[1], bad={WRONG_TYPE: [None, "x", 3, tiny_model()]}),
            "cache_size": Arg("int", 4, bad={OUT_OF_RANGE: [0, 1 << 21]})}, engine),
        Entry("scheduler.LLMEngine.step", "step", {"select": Arg("obj", None, bad={WRONG_TYPE: ["x", 3]})}, engine),
        Entry("scheduler.LLMEngine.check_structured_outputs", "check_structured_outputs", {
            "structured_outputs": Arg("obj", lambda: scheduler.StructuredOutputsParams(regex="a+"),
                                      bad={WRONG_TYPE: [{"regex": "a+"}, "a+", 3, None]})}, text_engine),
        Entry("scheduler.LLMEngine.stop_samples", "stop_samples", {
            "request_id": Arg("obj", "r0", bad={WRONG_TYPE: [None, 7, ["x"]], BAD_ID: ["zz"]}),
            "indices": Arg("ids", [0], bad={OUT_OF_RANGE: [[-1], [1], [0, 5]]}),  # "r0" has one sample
            "reason": Arg("obj", "stop", bad={WRONG_TYPE: [None, 3, ""]})}, engine),
        Entry("scheduler.LLMEngine.check_request", "check_request", {
            "request_id": Arg("obj", "x", bad={WRONG_TYPE: [None, 7], BAD_ID: ["r0"]}),
            "prompt_token_ids": Arg("ids", [1, 2], bad={**TOKENS, WRONG_TYPE: ["ab", 5, None, []]}),
            "sampling_params": Arg("obj", None, bad={WRONG_TYPE: [{"max_tokens": 3}]}),
            "lora": Arg("obj", None, bad=LORA_KEY)}, engine),
        Entry("scheduler.LLMEngine.load_lora", "load_lora", {
            "lora_request": Arg("obj", None, bad=LORA_REQUEST)}, engine),
        Entry("scheduler.LLMEngine.stage_loras", "stage_loras", {
            "lora_request": Arg("obj", [None], bad={WRONG_TYPE: ["x", 3, None, [3], [[1]], [None, "x"]],
                                                    BAD_ID: [[scheduler.LoRARequest(name="a", path="/no/such")]]})},
              engine),  # fmt: skip
        Entry("scheduler.LLMEngine.new_request_id", "new_request_id", {
            "prefix": Arg("obj", "mine", bad={WRONG_TYPE: [None, 3, "", ["x"]]})}, engine),
        Entry("scheduler.LLMEngine.request_output", "request_output", {
            "request_id": Arg("obj", "r0", bad={WRONG_TYPE: [None, 7, ["x"]], BAD_ID: ["zz"]})}, engine),
        Entry("scheduler.LLM", scheduler.LLM, {
            "model": Arg("obj", loaded_tiny, bad={WRONG_TYPE: [3, ["x"], 2.5],
                BAD_ID: ["/no/such/model", "/no/such/model.gguf"]}),
            "engine_config": Arg("obj", engine_config, bad={WRONG_TYPE: ["x", {}, 3]}),
            "speculative_config": Arg("obj", None, bad={WRONG_TYPE: ["ngram", 3, ["x"]]}),
            "enable_lora": Arg("bool", False),  # the LoRA options are checked even without it
            "max_loras": Arg("int", 1, bad={OUT_OF_RANGE: [0, -1, 1 << 62]}),
            "max_lora_rank": Arg("int", 16, bad={OUT_OF_RANGE: [0, 12, -1, 1 << 62]}),
            "max_cpu_loras": Arg("opt_int", None, bad={OUT_OF_RANGE: [0, -1, 1 << 62]})},
            named={"model": ("model",)}),
        Entry("scheduler.LLM.encode", "encode", {
            "prompt": Arg("obj", "hello", bad={WRONG_TYPE: [None, 3, b"hi"], BOOL_FOR_INT: [[True]],
                NONINTEGRAL: [[1.5]], OUT_OF_RANGE: [[-1]]}),
            "add_special_tokens": Arg("bool", False)}, tiny_llm),
        Entry("scheduler.LLM.chat_prompt", "chat_prompt", {
            "messages": Arg("obj", lambda: [{"role": "user", "content": "hi"}],
                bad={WRONG_TYPE: [None, "hi", [], [{"role": "user"}], [{"role": 3, "content": "x"}]]}),
            "add_generation_prompt": Arg("bool", True), "continue_final_message": Arg("bool", False),
            "chat_template": Arg("opt_str", None, bad={WRONG_TYPE: [3, b"{{ 1 }}", ["x"], ""]}),
            "chat_template_kwargs": Arg("obj", None, bad={WRONG_TYPE: ["x", 3, [("a", 1)], {3: 1},
                                                                    {"messages": []}]}),
            "add_special_tokens": Arg("bool", False),
            "tools": Arg("obj", None, bad={WRONG_TYPE: ["x", 3, [], ["f"], [3], b"[]"]})}, tiny_llm),
        Entry("scheduler.LLM.generate", "generate", {
            "prompts": Arg("obj", lambda: ["hello"], bad={WRONG_TYPE: [None, 3, [3.5], [None]],
                BOOL_FOR_INT: [[[True]]], NONINTEGRAL: [[[1.5]]], OUT_OF_RANGE: [[[-1]], [[10**6]]]}),
            "sampling_params": Arg("obj", None, bad={WRONG_TYPE: ["x", {"max_tokens": 2}]}),
            "use_tqdm": Arg("bool", False),
            "priority": Arg("int", 0, bad={WRONG_TYPE: ["3", None, [1, 2]],  # one int, or one per prompt
                                           OUT_OF_RANGE: [1 << 63, -(1 << 63) - 1, [1 << 63]]}),  # any int64
            "lora_request": Arg("obj", None, bad=LORA_REQUEST)},
              tiny_llm, named={"prompts": ("prompt", "prompts")}),
        Entry("scheduler.LLM.embed", "embed", {
            "prompts": Arg("obj", lambda: ["hello"], bad={WRONG_TYPE: [None, 3, [3.5], [None], []],
                BOOL_FOR_INT: [[[True]]], NONINTEGRAL: [[[1.5]]], OUT_OF_RANGE: [[[-1]], [[10**6]]]}),
            "pooling_params": Arg("obj", None, bad={WRONG_TYPE: ["x", {"dimensions": 2}],
                                                    OUT_OF_RANGE: [scheduler.PoolingParams(dimensions=8)]}),
            "use_tqdm": Arg("bool", False),
            "priority": Arg("int", 0, bad={WRONG_TYPE: ["3", None, [1, 2]],
                                           OUT_OF_RANGE: [1 << 63, -(1 << 63) - 1, [1 << 63]]})},
              tiny_llm, named={"prompts": ("prompt", "prompts")}),
        Entry("scheduler.LLM.beam_search", "beam_search", {
            "prompts": Arg("obj", lambda: ["hello"], bad={WRONG_TYPE: [None, 3, [3.5], [None], []],
                BOOL_FOR_INT: [[[True]]], NONINTEGRAL: [[[1.5]]], OUT_OF_RANGE: [[[-1]], [[10**6]]]}),
            "params": Arg("obj", lambda: scheduler.BeamSearchParams(width=2, max_tokens=2),
                          bad={WRONG_TYPE: ["x", 3, {"width": 2}]}),
            "use_tqdm": Arg("bool", False), "lora_request": Arg("obj", None, bad=LORA_REQUEST)}, tiny_llm,
              named={"prompts": ("prompt", "prompts", "prompt_token_ids")}),
        Entry("scheduler.LLM.pin_prefix", "pin_prefix", {
            "prompt": Arg("obj", "hello world, hello there", bad={WRONG_TYPE: [None, 3, b"hi", [1]],
                BOOL_FOR_INT: [[True] * 4], NONINTEGRAL: [[1.5] * 4], OUT_OF_RANGE: [[-1] * 4, [10**6] * 4]}),
            "cache_salt": Arg("opt_str", None)}, tiny_llm,
              named={"prompt": ("prompt", "token_ids")}),  # a token list shorter than a block is the engine's
        Entry("scheduler.LLM.unpin", "unpin", {
            "pin_id": Arg("obj", "paged-kv-pin-0", bad={WRONG_TYPE: [None, 3, ["x"]], BAD_ID: ["paged-kv-pin-9"]})},
              pinned_llm),
        Entry("scheduler.LLM.chat", "chat", {
            "messages": Arg("obj", lambda: [{"role": "user", "content": "hi"}],
                bad={WRONG_TYPE: [None, "hi", [], [{"role": "user"}]]}),
            "sampling_params": Arg("obj", None, bad={WRONG_TYPE: ["x", {"max_tokens": 2}]}),
            "use_tqdm": Arg("bool", False),
            "add_generation_prompt": Arg("bool", True), "continue_final_message": Arg("bool", False),
            "chat_template": Arg("opt_str", None, bad={WRONG_TYPE: [3, b"{{ 1 }}", ["x"], ""]}),
            "chat_template_kwargs": Arg("obj", None, bad={WRONG_TYPE: ["x", 3, [("a", 1)], {3: 1},
                                                                    {"messages": []}]}),
            "add_special_tokens": Arg("bool", False),
            "tools": Arg("obj", None, bad={WRONG_TYPE: ["x", 3, [], ["f"], [3], b"[]"]}),
            "lora_request": Arg("obj", None, bad=LORA_REQUEST)}, tiny_llm),
        Entry("scheduler.LLMEngine.abort", "abort",
            {"request_id": Arg("obj", "r0", bad={BAD_ID: ["zz", ["r0"], None]})}, engine),
        Entry("scheduler.LLMEngine.fail", "fail", {
            "request_id": Arg("obj", "r0", bad={BAD_ID: ["zz", ["r0"], None]}),
            "error": Arg("obj", "detokenization failed", bad={WRONG_TYPE: [None, 3, ""]})}, engine),
        Entry("scheduler.LLMEngine.generate", "generate", {
            "prompts": Arg("obj", [[1, 2]], bad={WRONG_TYPE: [None, "ab", iter([[1]]), [5]], BOOL_FOR_INT: [[[True]]],
                                                NONINTEGRAL: [[[1.5]]], OUT_OF_RANGE: [[[1], [-1]], [[99]]]}),
            "sampling_params": Arg("obj", lambda: scheduler.SamplingParams(max_tokens=1),
                                   bad={WRONG_TYPE: ["x", [scheduler.SamplingParams(), scheduler.SamplingParams()]]}),
            "use_tqdm": Arg("bool", False), "lora_request": Arg("obj", None, bad=LORA_REQUEST)}, engine,
              named={"prompts": ("prompts", "prompt_token_ids")}),
                 # per-prompt checks
        Entry("scheduler.LLMEngine.from_hf", scheduler.LLMEngine.from_hf, {
            "hf_model": Arg("obj", lambda: hf_model(), bad={WRONG_TYPE: [None, "x", torch.nn.Linear(2, 2)]}),
            "config": Arg("obj", engine_config, bad={WRONG_TYPE: ["x", {}]})}),
        Entry("scheduler.BeamSearch", scheduler.BeamSearch,
            {"engine": Arg("obj", engine, bad={WRONG_TYPE: [None, "x"]})}),
        Entry("scheduler.BeamSearch.generate", "generate", {
            "prompts": Arg("obj", [[1, 2]], bad={WRONG_TYPE: [None, "ab", [5]], BOOL_FOR_INT: [[[True]]],
                                                NONINTEGRAL: [[[1.5]]], OUT_OF_RANGE: [[[-1]], [[99]]]}),
            "params": Arg("obj", lambda: scheduler.BeamSearchParams(width=2, max_tokens=2), bad={WRONG_TYPE: ["x", 3]}),
            "use_tqdm": Arg("bool", False), "lora_request": Arg("obj", None, bad=LORA_REQUEST)},
              lambda: scheduler.BeamSearch(_idle_engine()),
            named={"prompts": ("prompts", "prompt_token_ids")}),  # the per-prompt checks name the prompt
        Entry("scheduler.from_state_dict", scheduler.from_state_dict, {
            "cfg": Arg("obj", lambda: tiny_model().config, bad={WRONG_TYPE: [None, {}]}),
            "state": Arg("obj", lambda: _hf_state(), bad={WRONG_TYPE: [None, "x", {"x": 1}]}),
            "dtype": Arg("dtype", torch.float32), "device": Arg("device", "cpu")}),
        Entry("scheduler.from_hf_model", scheduler.from_hf_model, {
            "hf_model": Arg("obj", lambda: hf_model(), bad={WRONG_TYPE: [None, "x", torch.nn.Linear(2, 2)]}),
            "dtype": Arg("dtype", torch.float32), "device": Arg("device", "cpu")}),
    ]
    # fmt: on


def _idle_engine() -> scheduler.LLMEngine:
    """An engine with no request."""
    return scheduler.LLMEngine(tiny_model(), engine_config(), eos_token_id=2)


def hf_config():
    """The tiny model's transformers LlamaConfig."""
    from transformers import LlamaConfig

    return LlamaConfig(**TINY, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def hf_model():
    """A seeded transformers Llama of the tiny shape."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(hf_config())


def _hf_state() -> dict[str, torch.Tensor]:
    """A transformers-named state dict of the tiny shape."""
    return hf_model().state_dict()


# Public names that are not entry points for bad input, each with the reason.
EXEMPT: dict[str, str] = {
    "scheduler.CompletionOutput": "a result record the engine builds",
    "scheduler.RequestOutput": "a result record the engine builds",
    "scheduler.RequestOutput.from_group": "builds a record from an engine-made SequenceGroup (engine internals)",
    "scheduler.BeamSearchOutput": "a result record beam search builds",
    "scheduler.EmbeddingOutput": "a result record the engine builds",
    "scheduler.EmbeddingRequestOutput": "a result record the engine builds",
    "scheduler.EmbeddingRequestOutput.from_group": "builds a record from an engine-made SequenceGroup (engine "
    "internals)",
    "scheduler.LlamaModel.pool": "the final norm of forward over the model's own hidden states (the rows embedding "
    "requests pool)",
    "scheduler.LlamaModel.forward": "the model's forward pass over engine-made batch tensors (a torch.nn.Module "
    "call inside the runner; its kernels are rows of kernels.*)",
    "scheduler.LlamaModel.hidden_states": "the decoder layers of forward (what CUDA graphs capture), same inputs",
    "scheduler.LlamaModel.compute_logits": "the LM head of forward over the model's own hidden states",
    "scheduler.LLMEngine.sample": "the default selection hook over an engine-made SchedulerOutput and its logits "
    "(engine internals)",
    "scheduler.StructuredOutputsParams.waits": "the scheduler's question at admission, over a prompt add_request has "
    "already checked (engine internals)",
}

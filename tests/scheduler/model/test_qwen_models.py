"""Qwen2 (q/k/v biases) and dense Qwen3 (per-head q/k norms) run on the Llama layers, equal to transformers.

Tiny seeded random models built offline (GQA; Qwen3 with its own head_dim, tied and untied
embeddings): logits over packed steps, greedy generation through the engine with prefix sharing
and chunked prefill, a saved checkpoint folder through the loader and ``LLM.chat``, and the configs
that would compute differently (sliding windows in use, other architectures, other activations) refused by field.
"""

from __future__ import annotations

import pytest
from sched_helpers import (
    GREEDY,
    assert_greedy_matches,
    assert_packed_logits_match,
    greedy_reference,
    make_engine,
    tiny_qwen,
)

from paged_kv.errors import InvalidArgumentError
from scheduler import CacheConfig, EngineConfig, ModelConfig, from_hf_model, from_state_dict

MODELS = {  # name: (kind, config overrides)
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),  # head_dim != hidden / heads, as in real Qwen3 checkpoints
    "qwen3_tied": ("qwen3", {"head_dim": 16, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def qwen(request, prompts):
    """(name, transformers model, its greedy continuations of ``prompts``)."""
    kind, overrides = MODELS[request.param]
    hf = tiny_qwen(kind, **overrides)
    return request.param, hf, greedy_reference(hf, prompts)


def test_the_config_names_what_differs_from_llama(qwen):
    name, hf, _ = qwen
    cfg = ModelConfig.from_hf(hf.config)
    assert cfg.attention_bias == (name == "qwen2")  # Qwen2's biases are always on; its config has no field
    assert cfg.qk_norm == name.startswith("qwen3")
    assert cfg.tie_word_embeddings == (name == "qwen3_tied")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, MODELS[name][1].get("head_dim", 16))


def test_packed_logits_match_transformers(qwen, prompts):
    _, hf, _ = qwen
    assert_packed_logits_match(from_hf_model(hf), hf, prompts)


@pytest.mark.parametrize("sched", [dict(), dict(max_num_batched_tokens=8, max_num_seqs=4)], ids=["prefix", "chunked"])
def test_greedy_generation_is_token_identical_to_transformers(qwen, prompts, sched):
    _, hf, refs = qwen
    assert_greedy_matches(hf, prompts, refs, sched)


def test_a_saved_checkpoint_folder_loads_and_chats_through_llm(tmp_path):
    from text_helpers import save_tiny_qwen

    from scheduler.entrypoints.llm import LLM
    from scheduler.model.loader import load_model

    folder = save_tiny_qwen(tmp_path / "tiny-qwen3", "qwen3", head_dim=32)
    loaded = load_model(folder)
    assert type(loaded.hf_model).__name__ == "Qwen3ForCausalLM"
    llm = LLM(loaded, engine_config=EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=128), device="cpu"))
    messages = [{"role": "user", "content": "hello world"}]
    ids = llm.chat_prompt(messages, chat_template_kwargs={"enable_thinking": False})
    text = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert llm.tokenizer.decode(ids) == text
    (out,) = llm.chat(messages, GREEDY, chat_template_kwargs={"enable_thinking": False})
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == greedy_reference(loaded.hf_model, [ids])[0]


@pytest.mark.parametrize(("kind", "overrides"), [
    ("qwen2", {}),
    ("qwen3", {"head_dim": 32}),  # transformers' reader alone would take Qwen3Config's 128; the loader reads key_length
    ("qwen3", {"head_dim": 32, "attention_bias": True}),  # q/k/v/o biases (transformers' reader alone drops them)
], ids=["qwen2", "qwen3", "qwen3_bias"])  # fmt: skip
def test_a_gguf_file_loads_through_transformers_gguf_reader(tmp_path, prompts, kind, overrides):
    from text_helpers import save_tiny_qwen_gguf, tiny_tokenizer

    from scheduler.model.loader import load_model

    hf = save_tiny_qwen_gguf(tmp_path / f"tiny-{kind}.gguf", kind, **overrides)
    loaded = load_model(tmp_path / f"tiny-{kind}.gguf")
    assert type(loaded.hf_model).__name__ == type(hf).__name__ and loaded.name == f"tiny-{kind}"
    cfg = ModelConfig.from_hf(loaded.hf_model.config)
    assert (cfg.head_dim, cfg.o_bias) == (overrides.get("head_dim", 16), "attention_bias" in overrides)
    text = "hello world, the quick brown fox"
    assert loaded.tokenizer.encode(text, add_special_tokens=False) == tiny_tokenizer().encode(text)
    outs = make_engine(loaded.hf_model).generate(prompts[:3], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy_reference(hf, prompts[:3])


def _gguf_header(path, arch: str, keys: dict[str, int], tensors: tuple[str, ...] = ()):
    """Write a GGUF file at ``path``: ``arch``, the integer ``keys`` (names after ``<arch>.``), 1-d ``tensors``."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        writer.add_uint32(f"{arch}.{key}", value)
    for name in tensors:
        writer.add_tensor(name, np.zeros(4, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return path


@pytest.mark.parametrize(("arch", "keys", "tensors", "match"), [
    ("qwen3", {"attention.key_length": 32, "attention.value_length": 16}, (), r"qwen3\.attention\.value_length\)=16"),
    ("llama", {"attention.key_length": 32, "rope.dimension_count": 16}, (), r"llama\.rope\.dimension_count\)=16"),
    ("llama", {}, ("blk.0.attn_output.bias",), r"llama tensors\)='blk\.0\.attn_output\.bias"),
    ("qwen3", {}, ("blk.0.attn_q.bias", "blk.0.attn_output.bias"), r"qwen3 tensors\)='blk\.0\.attn_q\.bias"),
])  # fmt: skip
def test_a_gguf_file_transformers_would_read_into_other_math_is_refused_naming_the_key(tmp_path, arch, keys,
                                                                                      tensors, match):
    from scheduler.model.loader import load_model

    with pytest.raises(InvalidArgumentError, match=match):
        load_model(_gguf_header(tmp_path / "tiny.gguf", arch, keys, tensors))


def test_a_state_dict_without_the_q_norm_weights_is_refused_naming_the_key():
    hf = tiny_qwen("qwen3", head_dim=16)
    state = dict(hf.state_dict())
    del state["model.layers.1.self_attn.q_norm.weight"]
    with pytest.raises(InvalidArgumentError, match="q_norm"):
        from_state_dict(ModelConfig.from_hf(hf.config), state)


SHAPE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=128)  # fmt: skip


def _config(cls_name: str, **fields):
    import transformers

    return getattr(transformers, cls_name)(**SHAPE, **fields)


@pytest.mark.parametrize("cls_name", ["Qwen2Config", "Qwen3Config"])
@pytest.mark.parametrize("fields", [
    dict(use_sliding_window=False, sliding_window=64),  # the window is off (every Qwen2.5/Qwen3 checkpoint)
    dict(use_sliding_window=True, sliding_window=64, max_window_layers=2),  # no layer from max_window_layers on
    dict(use_sliding_window=True, sliding_window=128, max_window_layers=0),  # a window as long as the context
])  # fmt: skip
def test_qwen_configs_without_a_window_in_use_are_accepted(cls_name, fields):
    assert ModelConfig.from_hf(_config(cls_name, **fields)).num_layers == 2


WINDOW = dict(use_sliding_window=True, sliding_window=64)


@pytest.mark.parametrize(("ok", "bad", "fields", "field"), [
    ("Qwen2Config", "Qwen2Config", WINDOW | dict(max_window_layers=1), "sliding_window"),  # layer 1 slides
    ("Qwen3Config", "Qwen3Config", WINDOW | dict(max_window_layers=0), "sliding_window"),
    ("Qwen3Config", "Qwen3Config", WINDOW | dict(layer_types=["sliding_attention", "full_attention"]),
     "sliding_window"),
    ("Qwen2Config", "Qwen2Config", dict(hidden_act="gelu"), "hidden_act"),
    ("Qwen3Config", "Qwen3Config", dict(hidden_act="relu"), "hidden_act"),
    ("Qwen2Config", "GemmaConfig", dict(), "model_type"),  # MoE Qwens load (tests/scheduler/model/test_moe.py)
])  # fmt: skip
def test_qwen_configs_this_model_would_compute_differently_are_refused_naming_the_field(ok, bad, fields, field):
    assert ModelConfig.from_hf(_config(ok)).num_layers == 2  # the dense Qwen of the same shape loads
    with pytest.raises(InvalidArgumentError, match=f"hf_config.{field}"):
        ModelConfig.from_hf(_config(bad, **fields))


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_qk_norm_that_is_not_a_bool_is_refused_naming_it(value):
    with pytest.raises(InvalidArgumentError, match="qk_norm"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=4, qk_norm=value)  # fmt: skip


@pytest.mark.parametrize("cls_name", ["LlamaConfig", "Qwen3Config", "Qwen3MoeConfig"])
@pytest.mark.parametrize(("fields", "field"), [
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor"),  # transformers rotates the whole head anyway
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, partial_rotary_factor=0.25),
     "rope_parameters.partial_rotary_factor"),  # the attribute moves into rope_parameters; transformers then fails
])  # fmt: skip
def test_a_partial_rotary_factor_is_refused_naming_it(cls_name, fields, field):
    full = dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0})
    assert ModelConfig.from_hf(_config(cls_name, **full)).num_layers == 2  # a factor of 1 rotates the whole head
    with pytest.raises(InvalidArgumentError, match=rf"hf_config\.{field}=0\.(5|25)"):
        ModelConfig.from_hf(_config(cls_name, **fields))


def test_a_v4_partial_rotary_factor_attribute_is_refused_naming_it():
    cfg = _config("LlamaConfig")
    cfg.partial_rotary_factor = 0.5  # a config object that keeps the attribute (transformers v4)
    with pytest.raises(InvalidArgumentError, match=r"hf_config\.partial_rotary_factor=0\.5"):
        ModelConfig.from_hf(cfg)

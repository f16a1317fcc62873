"""``attention_bias`` on Llama, dense Qwen3 and Qwen3-MoE: q/k/v and o_proj biases, equal to transformers.

transformers biases o_proj too on these three (not on Qwen2, Qwen2-MoE, Mistral, Mixtral). Tiny seeded
random models with every bias drawn non-zero (transformers starts them at 0, which would hide a dropped
bias): logits over packed steps, greedy generation through the engine with prefix sharing and chunked
prefill, and the config each model type reads.
"""

from __future__ import annotations

import pytest
from sched_helpers import (
    assert_greedy_matches,
    assert_packed_logits_match,
    greedy_reference,
    tiny_llama,
    tiny_moe,
    tiny_qwen,
)

from scheduler import LlamaModel, ModelConfig, from_hf_model

MODELS = {  # name: a tiny seeded model with attention_bias=True, every bias drawn
    "llama": lambda: tiny_llama(attention_bias=True),
    "qwen3": lambda: tiny_qwen("qwen3", head_dim=32, attention_bias=True),
    "qwen3_moe": lambda: tiny_moe("qwen3_moe", attention_bias=True),
}


@pytest.fixture(scope="module", params=list(MODELS))
def biased(request, prompts):
    """(transformers model, its greedy continuations of ``prompts``)."""
    hf = MODELS[request.param]()
    assert hf.model.layers[0].self_attn.o_proj.bias.abs().min() > 0  # drawn, not transformers' zeros
    return hf, greedy_reference(hf, prompts)


def test_the_config_biases_q_k_v_and_o(biased):
    hf, _ = biased
    cfg = ModelConfig.from_hf(hf.config)
    assert cfg.attention_bias and cfg.o_bias
    model = from_hf_model(hf)
    o = model.layers[1].attn.o
    assert o.bias is not None and o.bias.equal(hf.model.layers[1].self_attn.o_proj.bias)


def test_packed_logits_match_transformers(biased, prompts):
    hf, _ = biased
    assert_packed_logits_match(from_hf_model(hf), hf, prompts)


@pytest.mark.parametrize("sched", [dict(), dict(max_num_batched_tokens=8, max_num_seqs=4)], ids=["prefix", "chunked"])
def test_greedy_generation_is_token_identical_to_transformers(biased, prompts, sched):
    hf, refs = biased
    assert_greedy_matches(hf, prompts, refs, sched)


@pytest.mark.parametrize(("cls_name", "bias_field"), [
    ("Qwen2Config", None), ("MistralConfig", None), ("MixtralConfig", None), ("Qwen2MoeConfig", "qkv_bias"),
])  # fmt: skip
def test_model_types_without_an_o_proj_bias_read_none(cls_name, bias_field):
    import transformers

    fields = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, sliding_window=None, attention_bias=True)  # fmt: skip
    if bias_field:
        fields[bias_field] = True
    cfg = ModelConfig.from_hf(getattr(transformers, cls_name)(**fields))
    assert cfg.attention_bias and not cfg.o_bias
    assert LlamaModel(cfg).layers[0].attn.o.bias is None

"""The compact Llama: logits equal transformers' on packed batches, RoPE scalings, weight loading errors."""

from __future__ import annotations

import pytest
import torch
from sched_helpers import hf_logits, packed_forward

from paged_kv.errors import InvalidArgumentError
from scheduler import ModelConfig, from_hf_model, from_state_dict
from scheduler.model.rope import inverse_frequencies


def test_packed_mixed_batches_match_transformers(tiny_hf, prompts):
    model = from_hf_model(tiny_hf)
    seqs = [prompts[3], prompts[2], prompts[6][:20]]  # 63, 33 and 20 tokens
    # step 0: prefills of different lengths; later: chunks, single tokens (decode) and idle sequences mixed
    chunks = [[30, 1, 30, 1, 1], [10, 20, 1, 1, 1], [1, 1, 16, 1, 1]]
    for seq, got, n in zip(seqs, packed_forward(model, seqs, chunks), map(sum, chunks)):
        assert torch.allclose(got, hf_logits(tiny_hf, seq[:n]), atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)  # fmt: skip
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, rope_scaling=scaling, initializer_range=0.2,
    )  # fmt: skip
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = inverse_frequencies(64, 10000.0, scaling)
    assert torch.allclose(got, expected, rtol=1e-6)
    assert not torch.allclose(got, inverse_frequencies(64, 10000.0))  # the scaling changed something
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    model = from_hf_model(hf)
    tokens = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(0)).tolist()  # past 16 positions
    (got_logits,) = packed_forward(model, [tokens], [[80]])
    assert torch.allclose(got_logits, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_linear_scaling_divides_the_frequencies():
    assert torch.allclose(inverse_frequencies(8, 100.0, {"rope_type": "linear", "factor": 4.0}),
                          inverse_frequencies(8, 100.0) / 4)  # fmt: skip
    with pytest.raises(InvalidArgumentError):
        inverse_frequencies(8, 100.0, {"rope_type": "longrope", "factor": 4.0})


def test_weight_loading_errors_are_typed(tiny_hf):
    cfg = ModelConfig.from_hf(tiny_hf.config)
    state = dict(tiny_hf.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(InvalidArgumentError, match="up_proj"):
        from_state_dict(cfg, state)
    state = dict(tiny_hf.state_dict())
    state["model.norm.weight"] = torch.ones(3)
    with pytest.raises(InvalidArgumentError):
        from_state_dict(cfg, state)
    with pytest.raises(InvalidArgumentError):
        from_hf_model(object())
    with pytest.raises(InvalidArgumentError):
        ModelConfig(
            vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4
        )


def test_state_dict_loading_equals_model_loading(tiny_hf, prompts):
    a = from_hf_model(tiny_hf)
    b = from_state_dict(ModelConfig.from_hf(tiny_hf.config), tiny_hf.state_dict())
    (la,), (lb,) = packed_forward(a, [prompts[2]], [[33]]), packed_forward(b, [prompts[2]], [[33]])
    assert torch.equal(la, lb)


@pytest.mark.parametrize(("field", "value", "kind"), [
    ("hidden_act", "gelu", "llama"), ("mlp_bias", True, "llama"), ("sliding_window", 64, "mistral"),
    ("model_type", "gemma", "llama"),
])  # fmt: skip
def test_configs_this_model_would_compute_differently_are_refused_naming_the_field(field, value, kind):
    from transformers import LlamaConfig, MistralConfig

    shape = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128}  # fmt: skip
    cls = MistralConfig if kind == "mistral" else LlamaConfig
    ok = cls(**shape, **({"sliding_window": None} if kind == "mistral" else {}))
    assert ModelConfig.from_hf(ok).num_layers == 1  # Mistral without a window is a Llama
    bad = cls(**shape)
    setattr(bad, field, value)
    with pytest.raises(InvalidArgumentError, match=f"hf_config.{field}"):
        ModelConfig.from_hf(bad)

"""YaRN rotary scaling equals transformers': frequencies and attention factor, the tiny Llama and Qwen2 through the
engine, the context it derives, and bad keys and refused rope types named."""

from __future__ import annotations

import math

import pytest
import torch
from sched_helpers import (
    GREEDY,
    greedy_reference,
    hf_logits,
    make_engine,
    packed_forward,
    tiny_llama,
    tiny_qwen,
)

from paged_kv.errors import InvalidArgumentError
from scheduler import LlamaModel, ModelConfig, from_hf_model
from scheduler.model.rope import RotaryEmbedding, inverse_frequencies, rope_parameters

QWEN_LONG = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)  # Qwen's documented setting
YARNS = {  # name: (rope_scaling, max_position_embeddings of the config)
    "qwen": (QWEN_LONG, 32768),
    "betas": (dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=4096, beta_fast=16,
                   beta_slow=2), 32768),
    "deepseek_mscale": (dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                             mscale_all_dim=0.707, beta_fast=32, beta_slow=1), 163840),
    "attention_factor": (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=2048,
                              attention_factor=1.5), 8192),
    "no_truncate": (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096, truncate=False), 16384),
    "factor_none": (dict(rope_type="yarn", factor=None, original_max_position_embeddings=2048), 16384),
}  # fmt: skip


@pytest.mark.parametrize("name", list(YARNS))
def test_yarn_frequencies_and_attention_factor_equal_transformers(name):
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling, max_pos = YARNS[name]
    cfg = Qwen2Config(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                      max_position_embeddings=max_pos, rope_theta=1e6, rope_scaling=dict(scaling))  # fmt: skip
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got, factor = rope_parameters(128, 1e6, scaling, max_pos)
    # tolerance: float32 rounding (rtol 1e-6; the ops are transformers', so it is bit-equal on this CPU)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0.0)
    assert math.isclose(factor, expected_factor, rel_tol=1e-12)
    default = inverse_frequencies(128, 1e6)
    assert got[0] == default[0] and got[-1] < default[-1]  # the fastest pair is kept, the slowest interpolated
    assert factor > 1.0


def test_without_yarn_cos_and_sin_are_not_multiplied():
    rope = RotaryEmbedding(16, 10000.0)
    assert rope.attention_factor == 1.0
    positions = torch.arange(40)
    angles = positions.float()[:, None] * inverse_frequencies(16, 10000.0)[None, :]
    cos, sin = rope.cos_sin(positions, torch.float32)
    assert torch.equal(cos[:, 0, :8], angles.cos()) and torch.equal(sin[:, 0, 8:], angles.sin())
    yarn = RotaryEmbedding(16, 10000.0, dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16))
    assert yarn.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    ycos, _ = yarn.cos_sin(positions, torch.float32)
    assert ycos[0].abs().max() == pytest.approx(yarn.attention_factor)  # position 0: cos 1, times the factor


@pytest.mark.parametrize(("cls_name", "max_pos", "scaling", "context", "factor"), [
    ("Qwen2Config", 32768, QWEN_LONG, 131072, 4.0),  # Qwen2.5's docs: add the scaling, keep max_position 32768
    ("Qwen3Config", 40960, QWEN_LONG, 131072, 4.0),  # Qwen3's: the same scaling over max_position 40960
    ("LlamaConfig", 16384, dict(rope_type="yarn", factor=None, original_max_position_embeddings=2048), 16384, 8.0),
    ("LlamaConfig", 4096, dict(rope_type="yarn", factor=2.0), 8192, 2.0),  # original: max_position_embeddings
])  # fmt: skip
def test_the_context_of_a_yarn_config_is_original_times_factor(cls_name, max_pos, scaling, context, factor):
    import transformers

    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos)
    cfg = ModelConfig.from_hf(getattr(transformers, cls_name)(**shape, rope_scaling=dict(scaling)))
    assert cfg.max_position_embeddings == context and cfg.rope_scaling["factor"] == factor
    plain = getattr(transformers, cls_name)(**shape)
    assert ModelConfig.from_hf(plain).max_position_embeddings == max_pos  # without yarn: as before


# tiny models past original_max_position_embeddings=16: prompts of up to 64 tokens, 12 new, context 16 * 8 = 128
TINY_YARN = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=16)
TINY_MODELS = {
    "llama": lambda: tiny_llama(seed=5, rope_scaling=dict(TINY_YARN)),  # max_position_embeddings 512
    "qwen2": lambda: tiny_qwen("qwen2", seed=6, max_position_embeddings=16,  # Qwen's docs: max_position = original
                               rope_scaling=TINY_YARN | dict(beta_slow=0.5, truncate=False)),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(TINY_MODELS))
def yarn_model(request, prompts):
    """(transformers model with yarn, its greedy continuations of ``prompts``)."""
    hf = TINY_MODELS[request.param]()
    return hf, greedy_reference(hf, prompts)


def test_yarn_models_read_their_context_as_vllm_derives_it(yarn_model):
    hf, _ = yarn_model
    cfg = ModelConfig.from_hf(hf.config)
    assert cfg.max_position_embeddings == 16 * 8  # original * factor, whatever max_position_embeddings says
    assert cfg.rope_scaling["factor"] == 8.0 and cfg.rope_scaling["original_max_position_embeddings"] == 16


def test_yarn_packed_logits_match_transformers(yarn_model, prompts):
    hf, _ = yarn_model
    model = from_hf_model(hf)
    assert model.rope.attention_factor > 1.0
    seqs = [prompts[3], prompts[2], prompts[6][:20]]  # 63, 33, 20 tokens: positions past 16
    chunks = [[30, 1, 30, 1, 1], [10, 20, 1, 1, 1], [1, 1, 16, 1, 1]]
    for seq, got, n in zip(seqs, packed_forward(model, seqs, chunks), map(sum, chunks)):
        torch.testing.assert_close(got, hf_logits(hf, seq[:n]), atol=1e-4, rtol=1e-4)


def test_yarn_greedy_generation_is_token_identical_to_transformers(yarn_model, prompts):
    hf, refs = yarn_model
    engine = make_engine(hf, max_num_batched_tokens=16, max_num_seqs=4)  # chunked prefill, decodes beside it
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    with pytest.raises(InvalidArgumentError, match="model context"):
        engine.generate([[1] * 129], GREEDY, use_tqdm=False)  # past original * factor = 128


@pytest.mark.parametrize(("key", "value"), [
    ("factor", 0.5), ("factor", "4"), ("factor", math.nan), ("original_max_position_embeddings", 0),
    ("original_max_position_embeddings", -16), ("beta_fast", -1), ("beta_fast", 0.5), ("beta_slow", "x"),
    ("mscale", -1.0), ("mscale_all_dim", "x"), ("attention_factor", 0.0), ("attention_factor", math.inf),
    ("truncate", "yes"),
])  # fmt: skip
def test_bad_yarn_values_are_refused_naming_the_key(key, value):
    scaling = dict(QWEN_LONG, beta_slow=1.0) | {key: value}
    with pytest.raises(InvalidArgumentError, match=f"rope_scaling.{key}"):
        rope_parameters(128, 1e6, scaling, 32768)


def test_a_yarn_scaling_without_factor_is_refused_naming_it():
    with pytest.raises(InvalidArgumentError, match="rope_scaling.factor"):
        rope_parameters(128, 1e6, dict(rope_type="yarn", original_max_position_embeddings=32768), 32768)


def test_bad_yarn_in_a_transformers_config_is_refused_at_from_hf():
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rope_scaling=dict(QWEN_LONG, beta_fast=0.5))  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="rope_scaling.beta_fast"):
        ModelConfig.from_hf(cfg)


@pytest.mark.parametrize(("kind", "why"), [("dynamic", "sequence length"), ("longrope", "sequence length")])
def test_length_dependent_rope_types_are_refused_naming_rope_type(kind, why):
    cfg = ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, rope_scaling={"rope_type": kind, "factor": 2.0})  # fmt: skip
    with pytest.raises(InvalidArgumentError, match=f"rope_scaling.rope_type.*{kind}.*{why}"):
        LlamaModel(cfg)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip


@pytest.mark.parametrize(("scaling", "name"), [
    ({"rope_type": "linear", "factor": 0.0}, "rope_scaling.factor"),
    ({**LLAMA3, "low_freq_factor": -1.0}, "rope_scaling.low_freq_factor"),
    ({**LLAMA3, "high_freq_factor": 1.0}, "rope_scaling.high_freq_factor"),  # not above low_freq_factor
])  # fmt: skip
def test_bad_linear_and_llama3_values_are_refused_naming_the_key_as_yarn_does(scaling, name):
    with pytest.raises(InvalidArgumentError, match=rf"^{name}=") as info:
        inverse_frequencies(64, 10000.0, scaling)
    assert "rope_scaling[" not in str(info.value)

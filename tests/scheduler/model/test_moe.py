"""Mixtral, Qwen2-MoE and Qwen3-MoE run on the sparse MoE block, equal to transformers.

Tiny seeded random models built offline (routers, q/k/v biases and q/k norms drawn, so a wrong route
changes the logits): Mixtral (every layer sparse, top-k renormalized), Qwen2-MoE (a dense layer from
``mlp_only_layers`` between sparse ones, the sigmoid-gated shared expert), Qwen3-MoE with
``norm_topk_prob`` false (every other layer sparse, ``decoder_sparse_step=2``) and true. Logits over
packed steps, greedy generation through the engine with prefix sharing and chunked prefill, the
per-expert layout of a saved checkpoint folder, router ties, and the configs refused by field.
"""

from __future__ import annotations

import pytest
import torch
from sched_helpers import (
    TINY_LLAMA,
    assert_greedy_matches,
    assert_packed_logits_match,
    greedy_reference,
    hf_logits,
    packed_forward,
    tiny_moe,
)

from paged_kv.errors import InvalidArgumentError, OutOfRangeError
from scheduler import ModelConfig, from_hf_model, from_state_dict
from scheduler.distributed.parallel_state import TPShard
from scheduler.model.llama import LlamaModel
from scheduler.model.moe import Experts, SparseMoE, route

KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_norm")
# kind: (sparse layers, renormalized top-k, shared expert rows) the config must read
EXPECTED = {
    "mixtral": ((0, 1), True, 0),
    "qwen2_moe": ((0, 2), False, 48),
    "qwen3_moe": ((1, 3), False, 0),
    "qwen3_moe_norm": ((0, 1), True, 0),
}


@pytest.fixture(scope="module", params=KINDS)
def moe(request, prompts):
    """(kind, transformers model, its greedy continuations of ``prompts``)."""
    hf = tiny_moe(request.param)
    return request.param, hf, greedy_reference(hf, prompts)


def test_the_config_reads_which_layers_are_sparse_and_how_they_route(moe):
    kind, hf, _ = moe
    cfg = ModelConfig.from_hf(hf.config)
    assert (cfg.sparse_layers, cfg.norm_topk_prob, cfg.shared_expert_intermediate_size) == EXPECTED[kind]
    assert cfg.num_experts == hf.config.num_local_experts if kind == "mixtral" else hf.config.num_experts
    model = from_hf_model(hf)
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["SparseMoE" if i in cfg.sparse_layers else "MLP" for i in range(cfg.num_layers)]


@pytest.mark.parametrize("sched", [dict(), dict(max_num_batched_tokens=8, max_num_seqs=4)], ids=["prefix", "chunked"])
def test_packed_logits_and_greedy_engine_tokens_equal_transformers(moe, prompts, sched):
    _, hf, refs = moe
    if not sched:  # once per model: packed prefill, chunk and decode steps straight through the model
        assert_packed_logits_match(from_hf_model(hf), hf, prompts)
    assert_greedy_matches(hf, prompts, refs, sched)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_a_checkpoint_folder_with_per_expert_weights_loads_equal_to_the_fused_model(tmp_path, prompts, kind):
    # transformers v5 holds the experts fused in memory but writes them one by one (the hub layout)
    from safetensors.torch import load_file
    from text_helpers import tiny_tokenizer

    from scheduler.model.loader import load_model

    hf = tiny_moe(kind)
    hf.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)  # load_model reads a folder's tokenizer too
    on_disk = load_file(tmp_path / "model.safetensors")
    expert = "block_sparse_moe.experts.3.w2.weight" if kind == "mixtral" else "mlp.experts.7.down_proj.weight"
    last = hf.config.num_hidden_layers - 1  # a sparse layer in both
    assert f"model.layers.{last}.{expert}" in on_disk and not any("gate_up_proj" in k for k in on_disk)
    model = from_state_dict(ModelConfig.from_hf(hf.config), on_disk)
    seq = prompts[6]
    (got,) = packed_forward(model, [seq], [[40, 24]])
    torch.testing.assert_close(got, hf_logits(hf, seq), atol=1e-4, rtol=1e-4)
    reloaded = load_model(tmp_path).hf_model  # transformers' own reading of the folder, fused again
    assert type(reloaded).__name__ == type(hf).__name__
    torch.testing.assert_close(packed_forward(from_hf_model(reloaded), [seq], [[64]])[0], got, atol=1e-5, rtol=0)


def test_a_state_dict_without_an_expert_weight_is_refused_naming_the_key(tmp_path):
    from safetensors.torch import load_file

    hf = tiny_moe("qwen2_moe")
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(InvalidArgumentError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        from_state_dict(ModelConfig.from_hf(hf.config), state)


def test_the_router_picks_and_weighs_as_transformers_ties_included():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(12, 8)
    x[6:] = x[:6]  # repeated tokens
    weight = torch.randn(6, 8)
    weight[3] = weight[1]  # experts 1 and 3 tie on every token
    weight[5] = 0.0  # expert 5 ties with anything at logit 0
    for norm in (False, True):
        ref = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=8, num_experts=6, num_experts_per_tok=3,
                                                norm_topk_prob=norm))  # fmt: skip
        ref.weight.data.copy_(weight)
        _, ref_weights, ref_ids = ref(x)
        weights, ids = route(x @ weight.T, 3, norm, x.dtype)
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
        assert ((ids == 1) ^ (ids == 3)).any(-1).any()  # some token's last pick is one of the tied pair


@pytest.mark.parametrize("inter", [8, 6], ids=["aligned", "unaligned"])  # 6 floats: rows of no 16-byte multiple
def test_grouped_experts_equal_a_per_token_loop_with_unpicked_experts_and_no_tokens(inter):
    torch.manual_seed(0)
    experts = Experts(num_experts=5, hidden=8, inter=inter)
    x = torch.randn(7, 8)
    assert experts.aligned(x) == (inter == 8)  # F.grouped_mm, else one matmul pair per picked expert
    ids = torch.tensor([[0, 2], [2, 0], [4, 2], [0, 4], [2, 4], [4, 0], [2, 0]])  # experts 1 and 3 unpicked
    weights = torch.rand(7, 2)
    want = torch.zeros_like(x)
    for t in range(7):
        for w, e in zip(weights[t], ids[t]):
            gate, up = (experts.gate_up[e] @ x[t]).chunk(2)
            want[t] += w * (experts.down[e] @ (torch.nn.functional.silu(gate) * up))
    with torch.no_grad():
        torch.testing.assert_close(experts(x, weights, ids), want, atol=1e-6, rtol=1e-5)
        assert experts(x[:0], weights[:0], ids[:0]).shape == (0, 8)
        if inter == 8:  # both ways of multiplying the sorted runs agree
            rows, ends = torch.randn(10, 8), torch.tensor([3, 3, 7, 7, 10])
            torch.testing.assert_close(experts.grouped(rows, ends), experts.looped(rows, ends), atol=1e-6, rtol=0)


def test_tensor_parallel_experts_split_their_rows_and_the_router_is_replicated():
    from scheduler.model.sharding import shard_state_dict

    hf = tiny_moe("qwen2_moe")
    full = from_hf_model(hf)
    cfg, state = full.config, full.state_dict()
    parts = [shard_state_dict(cfg, state, TPShard(r, 2)) for r in range(2)]
    key = "layers.0.mlp."
    for r, part in enumerate(parts):
        LlamaModel(cfg, TPShard(r, 2)).load_state_dict(part, strict=True)  # the shapes fit the shard's layers
        assert torch.equal(part[key + "router.weight"], state[key + "router.weight"])
        assert torch.equal(part[key + "shared_gate.weight"], state[key + "shared_gate.weight"])
        rows = slice(16 * r, 16 * r + 16)
        gate_up = state[key + "experts.gate_up"]  # [E, 2 * 32, H]: gate rows, then up rows
        assert torch.equal(part[key + "experts.gate_up"], torch.cat([gate_up[:, rows], gate_up[:, 32:][:, rows]], 1))
        assert torch.equal(part[key + "experts.down"], state[key + "experts.down"][:, :, rows])
    # the ranks' partial outputs (each block's own sum, before its all-reduce) add up to the whole block's
    x = torch.randn(9, TINY_LLAMA["hidden_size"])
    halves = []
    for r, part in enumerate(parts):
        block = SparseMoE(cfg, TPShard(r, 2))
        block.load_state_dict({k.removeprefix(key): v for k, v in part.items() if k.startswith(key)})
        block.tp_size = 1  # no group here: keep this rank's partial sum
        halves.append(block(x))
    with torch.no_grad():
        torch.testing.assert_close(halves[0] + halves[1], full.layers[0].mlp(x), atol=1e-5, rtol=1e-5)


SHAPE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=128)  # fmt: skip
WINDOW = dict(use_sliding_window=True, sliding_window=64)


def _config(cls_name: str, **fields):
    import transformers

    return getattr(transformers, cls_name)(**SHAPE, **fields)


@pytest.mark.parametrize(("cls_name", "fields", "field"), [
    ("Qwen2MoeConfig", WINDOW | dict(max_window_layers=2), "sliding_window"),  # layer 0 slides
    ("Qwen3MoeConfig", WINDOW, "sliding_window"),  # every layer slides
    ("MixtralConfig", dict(sliding_window=64), "sliding_window"),
    ("MixtralConfig", dict(hidden_act="gelu"), "hidden_act"),
    ("Qwen2MoeConfig", dict(decoder_sparse_step=0), "decoder_sparse_step"),
])  # fmt: skip
def test_moe_configs_this_model_would_compute_differently_are_refused_naming_the_field(cls_name, fields, field):
    assert ModelConfig.from_hf(_config(cls_name)).num_layers == 2  # the same shape without the field loads
    with pytest.raises(InvalidArgumentError, match=f"hf_config.{field}"):
        ModelConfig.from_hf(_config(cls_name, **fields))


def test_qwen_moe_configs_with_every_layer_dense_load_without_experts():
    cfg = ModelConfig.from_hf(_config("Qwen2MoeConfig", mlp_only_layers=[0, 1]))
    assert cfg.sparse_layers == ()
    assert ModelConfig.from_hf(_config("Qwen3MoeConfig", num_experts=0)).sparse_layers == ()


BASE = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4, sparse_layers=(0, 1))


@pytest.mark.parametrize(("fields", "name", "error"), [
    (dict(MOE, num_experts_per_tok=5), "num_experts_per_tok", OutOfRangeError),  # more than the experts
    (dict(MOE, num_experts_per_tok=0), "num_experts_per_tok", OutOfRangeError),
    (dict(MOE, moe_intermediate_size=0), "moe_intermediate_size", InvalidArgumentError),
    (dict(MOE, sparse_layers=(0, 2)), "sparse_layers", OutOfRangeError),  # past the last layer
    (dict(MOE, sparse_layers=(1, 0)), "sparse_layers", InvalidArgumentError),
    (dict(MOE, sparse_layers=[0, 1]), "sparse_layers", InvalidArgumentError),
    (dict(sparse_layers=(0,)), "num_experts", InvalidArgumentError),  # a sparse layer without experts
    (dict(MOE, shared_expert_intermediate_size=-1), "shared_expert_intermediate_size", InvalidArgumentError),
    (dict(MOE, norm_topk_prob=1), "norm_topk_prob", InvalidArgumentError),
])  # fmt: skip
def test_bad_moe_fields_are_refused_naming_them(fields, name, error):
    assert ModelConfig(**BASE, **MOE).sparse_layers == (0, 1)
    with pytest.raises(error, match=name):
        ModelConfig(**BASE, **fields)


def test_an_expert_size_the_ranks_cannot_split_is_refused_naming_it():
    cfg = ModelConfig(**BASE, **dict(MOE, moe_intermediate_size=3))
    assert LlamaModel(cfg).layers[0].mlp.experts.down.shape == (4, 8, 3)
    with pytest.raises(InvalidArgumentError, match="moe_intermediate_size"):
        LlamaModel(cfg, TPShard(0, 2))


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "llama"])  # llama: Mixtral's GGUF architecture
def test_a_mixture_of_experts_gguf_file_is_refused_naming_its_expert_count(tmp_path, arch):
    import gguf

    from scheduler.model.loader import load_model

    path = tmp_path / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2), writer.add_expert_count(8), writer.add_expert_used_count(2)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(InvalidArgumentError, match=rf"model \({arch}\.expert_count\)=8"):
        load_model(path)

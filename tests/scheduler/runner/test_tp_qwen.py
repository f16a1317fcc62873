"""Tensor parallelism on 2 gloo ranks over Qwen2 (q/k/v biases sliced per rank), Qwen3 (q/k norms replicated)
and attention_bias models (o_proj bias replicated, added once after the all-reduce).

Each rank holds half the query and KV heads, their biases, and the whole q/k norm weights
(they act per head over head_dim); greedy generation with prefix sharing and chunked prefill
must equal transformers' on one process.
"""

from __future__ import annotations

import pytest
from sched_helpers import GREEDY, greedy_reference, make_engine, tiny_llama, tiny_moe, tiny_qwen


@pytest.mark.parametrize(("kind", "overrides"), [("qwen2", {}), ("qwen3", {"head_dim": 32})])
def test_two_ranks_generate_transformers_greedy_tokens(kind, overrides, prompts):
    hf = tiny_qwen(kind, **overrides)
    with make_engine(hf, tp=2, max_num_batched_tokens=16, max_num_seqs=4) as engine:
        assert engine.runner.gpu_cache.spec.num_kv_heads == 1  # one of the two KV heads per rank
        outs = engine.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == greedy_reference(hf, prompts)
        assert engine.block_manager.stats().hit_rate > 0


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_two_ranks_add_the_o_proj_bias_once(kind, prompts):
    # attention_bias: q/k/v biases sliced per rank, o_proj's whole on every rank, added after the all-reduce
    hf = tiny_llama(attention_bias=True) if kind == "llama" else tiny_moe(kind, attention_bias=True)
    with make_engine(hf, tp=2, max_num_batched_tokens=16, max_num_seqs=4) as engine:
        assert engine.runner.model.layers[0].attn.o.bias.shape == (64,)  # whole: hidden_size
        outs = engine.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == greedy_reference(hf, prompts)

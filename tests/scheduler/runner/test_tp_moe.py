"""Tensor parallelism on 2 gloo ranks over the MoE models: each expert's intermediate rows split across ranks.

Every rank holds half of each expert's (and Qwen2-MoE's shared expert's) intermediate rows and the
whole router and shared-expert gate, so both route every token alike; greedy generation with prefix
sharing and chunked prefill must equal transformers' on one process.
"""

from __future__ import annotations

import pytest
from sched_helpers import GREEDY, greedy_reference, make_engine, tiny_moe


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_two_ranks_generate_transformers_greedy_tokens(kind, prompts):
    hf = tiny_moe(kind)
    with make_engine(hf, tp=2, max_num_batched_tokens=16, max_num_seqs=4) as engine:
        experts = engine.runner.model.layers[-1].mlp.experts
        assert experts.down.shape[-1] == 16  # rank 0 holds half of each expert's 32 rows
        outs = engine.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == greedy_reference(hf, prompts)
        assert engine.block_manager.stats().hit_rate > 0

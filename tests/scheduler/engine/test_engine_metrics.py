"""The engine's counters under chunked prefill: the prefix cache is looked up once per admission, whole prompt."""

from __future__ import annotations

from sched_helpers import SHARED, make_engine

from scheduler import SamplingParams


def test_the_hit_rate_counts_each_admitted_prompt_whole_under_chunked_prefill(tiny_hf, prompts):
    engine = make_engine(tiny_hf, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    first, second = prompts[1], prompts[3]  # both start with the 40-token SHARED prefix
    engine.generate([first], SamplingParams(max_tokens=4), use_tqdm=False)
    engine.generate([second], SamplingParams(max_tokens=4), use_tqdm=False)  # its first chunk is 40 cached + 16
    stats = engine.block_manager.stats()
    assert (stats.num_queried_tokens, stats.num_hit_tokens) == (len(first) + len(second), len(SHARED))
    assert stats.hit_rate == len(SHARED) / (len(first) + len(second))  # not 40 / (16 + 56), the first chunks
    assert engine.metrics_summary().prefix_hit_rate == stats.hit_rate

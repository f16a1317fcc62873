"""Speculative decoding over 2 gloo ranks: the drafts travel in the step payload, every rank runs their query, rank 0
verifies; the tokens are those of one rank without drafts (swap preemption and chunked prefill on the way)."""

from __future__ import annotations

import torch
from sched_helpers import make_engine
from spec_helpers import SPEC, assert_drafts_accepted_and_rejected, repeating_prompts, token_ids

from scheduler import SamplingParams

ENGINE = dict(num_blocks=40, num_cpu_blocks=8, max_num_batched_tokens=32, max_num_seqs=8, preemption_mode="swap")


def test_ngram_drafts_over_two_ranks_give_the_tokens_of_one_rank_without_drafts(looping_hf):
    torch.set_num_threads(1)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = make_engine(looping_hf, **ENGINE).generate(repeating_prompts(), params, use_tqdm=False)
    with make_engine(looping_hf, tp=2, speculative=SPEC, **ENGINE) as two:
        outs = two.generate(repeating_prompts(), params, use_tqdm=False)
        assert token_ids(outs) == token_ids(ref)
        assert_drafts_accepted_and_rejected(two)
        assert two.block_manager.stats().num_used == 0
        two.block_manager.check()

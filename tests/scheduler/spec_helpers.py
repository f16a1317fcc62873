"""Helpers of the speculative-decoding tests: a config, repeating prompts, runs with and without drafts, checks."""

from __future__ import annotations

import torch
from sched_helpers import VOCAB, assert_all_freed, make_engine

from paged_kv.block_hash import hash_blocks, salt_root
from scheduler.core.speculative_config import SpeculativeConfig

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


def repeating_prompts(seed: int = 3) -> list[list[int]]:
    """Prompts whose phrases repeat (drafts found in the prompt), of a few lengths; two share a long prefix."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    phrase, shared = rand(5), rand(24)
    return [phrase * 4 + rand(3), shared + rand(7) * 2, rand(9), shared + phrase * 2, rand(2) * 6 + rand(1)]


def token_ids(outs) -> list[list[list[int]]]:
    """Every sample's tokens of every request."""
    return [[o.token_ids for o in out.outputs] for out in outs]


def run_without_drafts(hf, prompts, params, **engine_kwargs):
    """The reference run: the same engine without speculative decoding."""
    engine = make_engine(hf, **engine_kwargs)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert_all_freed(engine)
    return outs


def run_with_drafts(hf, prompts, params, *, speculative=SPEC, **engine_kwargs):
    """``generate`` with drafts; after every step, no block hash of a token that is not a sequence's own is in the
    prefix cache. Returns the outputs and the engine (every block freed, checked)."""
    engine = make_engine(hf, speculative=speculative, **engine_kwargs)
    groups, add, step = [], engine.scheduler.add_request, engine.step

    def recorded_add(*args, **kwargs):
        groups.append(group := add(*args, **kwargs))
        return group

    def checked_step(*args, **kwargs):
        finished = step(*args, **kwargs)
        assert_cache_holds_real_tokens_only(engine, groups)
        return finished

    engine.scheduler.add_request, engine.step = recorded_add, checked_step
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert_all_freed(engine)
    return outs, engine


def assert_cache_holds_real_tokens_only(engine, groups) -> None:
    """Every block registered in the prefix cache is a full block of some sequence's own tokens (prompt + outputs):
    no draft that was rejected was ever hashed."""
    bs = engine.block_manager.block_size
    real = {h for g in groups for s in g.seqs for h in hash_blocks(salt_root(None), s.token_ids, bs)}
    cached = {h for h in engine.block_manager.gpu.hash_of if h is not None}
    assert cached <= real, "a block of draft tokens that were never kept is in the prefix cache"


def assert_drafts_accepted_and_rejected(engine) -> None:
    """Drafts ran, some were accepted and some rejected (the run exercised both paths)."""
    stats = engine.spec.stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats

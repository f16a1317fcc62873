"""Tensor parallelism on 2 gloo ranks: token-identical to one rank, half the KV heads per rank, same pools.

One tp=2 engine and its tp=1 twin (same small pools and budgets: prefix caching, chunked
prefill, swap preemption that falls back to recompute when the CPU pool is full) run the same
workloads: greedy requests, seeded n > 1 sampling and beam search. Since the block manager
decides the same blocks on both, every rank's pools must equal the matching head slice of the
single rank's pools at the end, after the copy-on-write copies and swaps of the run.
"""

from __future__ import annotations

import pytest
import torch
from sched_helpers import NUM_NEW, make_engine

from scheduler import BeamSearch, BeamSearchParams, PoolingParams, SamplingParams

ENGINE = dict(num_blocks=40, num_cpu_blocks=8, max_num_batched_tokens=32, max_num_seqs=8, preemption_mode="swap")


def _run(engine, prompts, beam_prompts) -> dict[str, object]:
    """The three workloads, with the step payloads' block moves counted."""
    moves = {"copies": 0, "swap_out": 0, "swap_in": 0}
    build = engine.runner.inputs.build_payload

    def counting(out, *lora):
        payload = build(out, *lora)
        for k in moves:
            moves[k] += len(getattr(payload, k))
        return payload

    engine.runner.inputs.build_payload = counting
    greedy = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW), use_tqdm=False)
    sampled = engine.generate(
        [prompts[i] for i in (0, 2, 4)], SamplingParams(max_tokens=6, n=3, temperature=0.8, seed=5), use_tqdm=False
    )
    beams = BeamSearch(engine).generate(beam_prompts, BeamSearchParams(width=3, max_tokens=5))
    return {
        "greedy": [o.outputs[0].token_ids for o in greedy],
        "sampled": [[c.token_ids for c in o.outputs] for o in sampled],
        "beams": [[h.token_ids for h in b.hypotheses] for b in beams],
        "moves": moves,
        "preemptions": dict(engine.scheduler.num_preemptions),
        "hit_rate": engine.block_manager.stats().hit_rate,
    }


@pytest.fixture(scope="module")
def runs(tiny_hf, prompts, beam_prompts):
    """(tp=1 engine, its results, tp=2 engine, its results); the tp=2 engine is shut down after the module."""
    torch.set_num_threads(1)
    one = make_engine(tiny_hf, **ENGINE)
    ref = _run(one, prompts, beam_prompts)
    with make_engine(tiny_hf, tp=2, **ENGINE) as two:
        yield one, ref, two, _run(two, prompts, beam_prompts)


def test_outputs_are_token_identical_to_one_rank(runs):
    _, ref, _, got = runs
    assert got["greedy"] == ref["greedy"]
    assert got["sampled"] == ref["sampled"] and all(len(s) == 3 for s in got["sampled"])
    assert got["beams"] == ref["beams"]


def test_the_run_exercised_prefix_caching_preemption_and_block_moves(runs):
    _, ref, _, got = runs
    assert got["preemptions"] == ref["preemptions"]
    assert got["preemptions"]["swap"] > 0 and got["preemptions"]["recompute"] > 0
    assert got["moves"] == ref["moves"] and all(n > 0 for n in got["moves"].values())
    assert got["hit_rate"] > 0


def _embed(engine, prompts) -> list[torch.Tensor]:
    """Un-normalized LAST-token vectors of ``prompts``, run in the same steps as a generation request."""
    for i, p in enumerate(prompts):
        engine.add_pooling_request(f"emb{i}", p, PoolingParams(normalize=False))
    engine.add_request("gen", prompts[0], SamplingParams(max_tokens=4))
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    return [torch.tensor(done[f"emb{i}"].outputs.embedding) for i in range(len(prompts))]


def test_embeddings_equal_one_rank_and_transformers(runs, tiny_hf, prompts):
    """Rank 0 pools (the workers skip the final norm of the pooled rows): the vectors equal one rank's and
    transformers' last hidden state, prompts chunked over steps beside a generation request."""
    one, _, two, _ = runs
    chosen = prompts[:4]
    with torch.no_grad():
        want = [tiny_hf.model(torch.tensor([p])).last_hidden_state[0, -1] for p in chosen]
    for got in (_embed(one, chosen), _embed(two, chosen)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_each_rank_holds_half_the_kv_heads(runs):
    one, _, two, _ = runs
    assert one.runner.gpu_cache.spec.num_kv_heads == 2
    assert two.runner.gpu_cache.spec.num_kv_heads == 1
    assert two.runner.gpu_cache.nbytes * 2 == one.runner.gpu_cache.nbytes
    for k, v in two.executor.gather_kv(0, [0]):
        assert k.shape == v.shape == (1, 4, 1, 16)  # [blocks, block_size, heads of the rank, head_dim]


@pytest.mark.parametrize("pool", ["gpu", "cpu"])
def test_every_rank_pool_equals_its_head_slice_of_one_rank(runs, pool):
    # copy-on-write copies and swaps were applied on both ranks: every block (live or stale) matches
    one, _, two, _ = runs
    cache = one.runner.gpu_cache if pool == "gpu" else one.runner.cpu_cache
    blocks = list(range(cache.num_blocks))
    assert cache.layers[0].k.abs().sum() > 0
    for layer in range(cache.spec.num_layers):
        ranks = two.executor.gather_kv(layer, blocks, pool)
        for rank, (k, v) in enumerate(ranks):
            want = cache.layers[layer]
            torch.testing.assert_close(k, want.k[:, :, rank : rank + 1], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(v, want.v[:, :, rank : rank + 1], rtol=1e-4, atol=1e-5)


"""Recompute mode: a running request a later pin leaves no room to grow is refused at once, not restarted."""

from __future__ import annotations

import pytest
import torch
from sched_helpers import make_engine

from scheduler import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # 2 blocks of 4


def _system() -> list[int]:
    """A 20-token prompt (5 blocks) to pin."""
    return torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()


def _pinned_engine(tiny_hf, chunked: bool):
    """12 blocks, recompute mode; the pin taken after the request arrives holds 5 of them."""
    sched = {"enable_chunked_prefill": chunked, "max_num_seqs": 8, "max_num_batched_tokens": 8 if chunked else 256}
    return make_engine(tiny_hf, num_blocks=12, preemption_mode="recompute", **sched)


def _run(engine, params: SamplingParams, bound: int = 60) -> tuple[dict, int]:
    """Queue "grow", pin the system prompt, step until done or ``bound`` steps; outputs by id, recomputes."""
    engine.add_request("grow", PROMPT, params)
    engine.pin_prefix(_system())
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        assert steps < bound, f"livelock: {engine.scheduler.num_preemptions}"
        outs |= {o.request_id: o for o in engine.step()}
        steps += 1
    return outs, engine.scheduler.num_preemptions["recompute"]


def _lone(tiny_hf, params) -> list[list[int]]:
    roomy = make_engine(tiny_hf, num_blocks=256)
    return [c.token_ids for c in roomy.generate([PROMPT], params, use_tqdm=False)[0].outputs]


CASES = {
    "one": SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0),  # 32 tokens: 8 blocks
    # owes its prompt log-probabilities: its first restart reads no prefix cache, so a chunk always fits
    "prompt_logprobs": SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, prompt_logprobs=1),
}
# two samples that differ share only the prompt: 2 + 3 + 3 blocks at 17 tokens
TWO_SAMPLES = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=1, n=2)


def _check_refused(tiny_hf, engine, outs, params) -> None:
    """"grow" failed with its reason, its tokens so far its lone run's; only the pin's blocks stay."""
    grow = outs["grow"]
    assert [c.finish_reason for c in grow.outputs] == ["error"] * params.n
    assert "'grow' can never be scheduled" in grow.error and "less the 5 held by pinned prefixes" in grow.error
    tokens = [c.token_ids for c in grow.outputs]
    assert all(t == ref[: len(t)] for t, ref in zip(tokens, _lone(tiny_hf, params)))
    assert engine.block_manager.gpu.num_used == 5  # every block freed but the pin's
    engine.block_manager.check()


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_recompute_refuses_one_sequence_that_cannot_grow_without_restarting_it(tiny_hf, chunked, case):
    """Alone and unable to grow, one sequence can never fit (a restart needs the same blocks): it fails with its
    reason at that step, never recomputed (chunked, each restart's first chunk fit, and with its prompt
    log-probabilities owed it was restarted twice)."""
    engine = _pinned_engine(tiny_hf, chunked)
    outs, recomputes = _run(engine, CASES[case])
    _check_refused(tiny_hf, engine, outs, CASES[case])
    assert recomputes == 0


def test_recompute_refuses_a_group_whose_restart_fails_where_it_did(tiny_hf):
    """Two samples that differ, not chunked: a restart computes both tails in one step and fails with the same
    tokens as before, so the second time it fails alone it is refused (it was restarted forever)."""
    engine = _pinned_engine(tiny_hf, chunked=False)
    outs, recomputes = _run(engine, TWO_SAMPLES)
    _check_refused(tiny_hf, engine, outs, TWO_SAMPLES)
    assert recomputes == 1
    first, second = (c.token_ids for c in outs["grow"].outputs)
    assert first != second  # the case: the samples diverged, their tails share no block


@pytest.mark.parametrize(("chunked", "params"), [
    (True, TWO_SAMPLES),  # a restart computes the samples one after another: the first ends, the other fits
    (False, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, n=2)),  # the same tokens: forked at 16
    (True, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, n=2)),
])  # fmt: skip
def test_recompute_restarts_a_group_its_restart_can_fit(tiny_hf, chunked, params):
    """Two samples running hold 2 shared + 3 + 3 blocks at 17 tokens, more than the 7 the pin leaves, but a
    restart may need fewer at once: it is recomputed, not refused, and served as its lone run."""
    engine = _pinned_engine(tiny_hf, chunked)
    outs, recomputes = _run(engine, params)
    assert recomputes >= 1
    assert outs["grow"].error is None
    assert [c.token_ids for c in outs["grow"].outputs] == _lone(tiny_hf, params)
    assert engine.block_manager.gpu.num_used == 5
    engine.block_manager.check()

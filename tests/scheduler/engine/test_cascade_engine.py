"""Cascade decode in the engine: beam search, n > 1 sampling and requests that share a system prompt
give the same outputs with it on and off.

The steps whose sequences share long prefixes (forks of one request, or the cached blocks of a
common system prompt) are planned on the host and attend the shared blocks once per group; the
tests count those calls so that they cannot pass with the cascade path unused, and check cascade
steps against transformers under the host-read guard.
"""

from __future__ import annotations

import pytest
import torch
from beam_helpers import assert_same_beams, hf_beams
from no_host_reads import forbid_host_reads
from sched_helpers import VOCAB

import scheduler.model.attention as attention
import scheduler.runner.step_input as step_input
from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler.engine.beam_search import BeamSearch, BeamSearchParams
from scheduler.runner.step_input import StepInput


@pytest.fixture
def cascade_calls(monkeypatch):
    """Counts the steps' cascade decode calls (bound on a step's first layer, run by every layer)."""
    calls = []
    original = attention.bind_cascade_decode_attention
    monkeypatch.setattr(attention, "bind_cascade_decode_attention",
                        lambda *a, **k: calls.append(1) or original(*a, **k))  # fmt: skip
    return calls


@pytest.fixture(scope="module")
def long_prompt() -> list[int]:
    """A 45-token prompt: 11 full blocks of 4 and one token."""
    return torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(11)).tolist()


def engine(tiny_hf, cascade: bool, min_saved_bytes: int | None = 0) -> LLMEngine:
    """A CPU engine over the tiny model with cascade decode on or off (by default at any saving: tiny caches)."""
    cache = CacheConfig(block_size=4, num_gpu_blocks=256, watermark=0.0, enable_cascade_attention=cascade,
                        cascade_min_saved_bytes=min_saved_bytes)  # fmt: skip
    config = EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=256), device="cpu")
    return LLMEngine.from_hf(tiny_hf, config)


def assert_same_with_cascade_on_and_off(tiny_hf, prompts, params, cascade_calls: list) -> None:
    """Generate with cascade off, then on (where it must be called): same tokens and log-probabilities."""
    off = engine(tiny_hf, False).generate(prompts, params, use_tqdm=False)
    assert not cascade_calls
    on = engine(tiny_hf, True).generate(prompts, params, use_tqdm=False)
    assert cascade_calls
    for a, b in zip(on, off):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, rel=1e-5, abs=1e-5)


def checked_step(eng: LLMEngine, tiny_hf) -> StepInput:
    """Schedule, build and run the engine's next step under the host-read guard; its logits are the model's."""
    out = eng.scheduler.schedule()
    with forbid_host_reads():
        step = eng.runner.inputs.build(out)
        logits = eng.runner.execute(step)
    seqs = [s.seq for s in out.scheduled]
    with torch.no_grad():
        expected = torch.stack([tiny_hf(torch.tensor([s.token_ids])).logits[0, -1] for s in seqs])
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=2e-4)
    return step


@pytest.mark.parametrize("width", [4, 8])
def test_beam_search_is_the_same_with_cascade_on_and_off(tiny_hf, long_prompt, cascade_calls, width):
    params = BeamSearchParams(width=width, max_tokens=8)
    prompts = [long_prompt, long_prompt[:13]]
    off = BeamSearch(engine(tiny_hf, False)).generate(prompts, params)
    assert not cascade_calls
    on = BeamSearch(engine(tiny_hf, True)).generate(prompts, params)
    assert cascade_calls  # the beams of the long prompt shared their blocks
    for a, b in zip(on, off):
        assert [h.token_ids for h in a.hypotheses] == [h.token_ids for h in b.hypotheses]
        assert [h.score for h in a.hypotheses] == pytest.approx([h.score for h in b.hypotheses], rel=1e-5, abs=1e-5)


def test_beam_search_with_cascade_matches_transformers(tiny_hf, long_prompt, cascade_calls):
    out = BeamSearch(engine(tiny_hf, True)).generate([long_prompt], BeamSearchParams(width=4, max_tokens=10))[0]
    assert cascade_calls
    assert_same_beams(out, *hf_beams(tiny_hf, long_prompt, width=4, new=10))


def test_parallel_sampling_is_the_same_with_cascade_on_and_off(tiny_hf, long_prompt, cascade_calls):
    params = [SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10, logprobs=2),
              SamplingParams(n=3, temperature=0.7, top_p=0.9, seed=6, max_tokens=7)]  # fmt: skip
    prompts = [long_prompt, long_prompt[5:40]]
    assert_same_with_cascade_on_and_off(tiny_hf, prompts, params, cascade_calls)


def test_a_cascade_step_reads_no_device_value_and_gives_the_models_logits(tiny_hf, long_prompt):
    eng = engine(tiny_hf, True)
    eng.add_request("beams", long_prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8))
    eng.add_request("alone", long_prompt[:9], SamplingParams(max_tokens=8))
    eng.step()  # prefill; the n samples fork at their first token
    eng.step()
    step = checked_step(eng, tiny_hf)
    assert step.meta.cascade is not None and step.meta.cascade.prefix.num_groups == 1
    assert step.meta.cascade.host.prefix_lens.tolist() == [44]  # 11 shared blocks, the 12th is being written


def test_no_plan_when_off_or_when_nothing_is_shared(tiny_hf, long_prompt):
    for cascade, prompt_len, n in ((False, 45, 4), (True, 45, 1), (True, 9, 4)):
        eng = engine(tiny_hf, cascade)
        eng.add_request("r", long_prompt[:prompt_len], SamplingParams(n=n, temperature=1.0, seed=2, max_tokens=4))
        eng.step()
        assert eng.runner.inputs.build(eng.scheduler.schedule()).meta.cascade is None  # 9 tokens: 2 shared blocks < 4


def system_prompt_requests(long_prompt: list[int]) -> list[list[int]]:
    """Four prompts: the 44-token (11-block) system prompt, then each request's own question."""
    system = long_prompt[:44]
    return [system + [(7 * i + j) % VOCAB for j in range(2 + 3 * i)] for i in range(4)]


def test_requests_sharing_a_system_prompt_are_the_same_with_cascade_on_and_off(tiny_hf, long_prompt, cascade_calls):
    params = [SamplingParams(max_tokens=9), SamplingParams(temperature=1.0, seed=3, max_tokens=8, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=10),
              SamplingParams(max_tokens=6)]  # fmt: skip
    prompts = system_prompt_requests(long_prompt)
    assert_same_with_cascade_on_and_off(tiny_hf, prompts, params, cascade_calls)  # only the system prompt is shared


def test_a_cross_request_cascade_step_reads_no_device_value_and_gives_the_models_logits(tiny_hf, long_prompt):
    eng = engine(tiny_hf, True)
    for i, prompt in enumerate(system_prompt_requests(long_prompt)):
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=8))
    eng.step()  # prefill: every request after the first hits the cached system prompt
    eng.step()
    step = checked_step(eng, tiny_hf)
    assert step.meta.cascade is not None and step.meta.cascade.prefix.num_groups == 1
    assert step.meta.cascade.host.prefix_lens.tolist() == [44] and step.meta.cascade.rows_in_order


def test_decode_steps_with_no_shared_block_skip_the_planner(tiny_hf, long_prompt, monkeypatch):
    planned = []
    original = step_input.plan_cascade
    monkeypatch.setattr(step_input, "plan_cascade", lambda *a, **k: planned.append(1) or original(*a, **k))
    distinct = [[(t + 11 * i) % VOCAB for t in long_prompt] for i in range(1, 4)]  # no block in common
    engine(tiny_hf, True).generate(distinct, SamplingParams(max_tokens=4), use_tqdm=False)
    assert not planned  # one column of the host mirror said no group could form: no [S, W] copy, no plan
    engine(tiny_hf, True).generate(system_prompt_requests(long_prompt), SamplingParams(max_tokens=4), use_tqdm=False)
    assert planned


def test_the_default_floor_keeps_cascade_off_when_it_saves_few_bytes(tiny_hf, long_prompt, cascade_calls):
    eng = engine(tiny_hf, True, min_saved_bytes=None)  # the CPU default: 8 MiB per layer
    cfg = tiny_hf.config
    per_token = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # K+V float32 bytes
    assert eng.runner.inputs.min_saved_tokens == -(-(8 << 20) // per_token)
    eng.generate(system_prompt_requests(long_prompt), SamplingParams(max_tokens=4), use_tqdm=False)
    assert not cascade_calls  # 3 x 44 tokens saved per step: far below the floor
    floor = engine(tiny_hf, True, min_saved_bytes=3 * 44 * per_token)  # exactly what a full step saves
    floor.generate(system_prompt_requests(long_prompt), SamplingParams(max_tokens=4), use_tqdm=False)
    assert cascade_calls

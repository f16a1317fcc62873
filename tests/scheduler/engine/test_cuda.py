"""The engine on a CUDA device (skipped without one): beam search, seeded parallel samples, the main job.

The model is the tiny float32 random Llama of the CPU tests; its transformers twin stays on the
CPU and gives the reference beams.
"""

from __future__ import annotations

import pytest
from backend_device import needs_cuda
from beam_helpers import NEW, WIDTH, assert_same_beams, hf_beams
from sched_helpers import VOCAB, assert_all_freed, make_engine

import scheduler.entrypoints.main_job as main_job
from scheduler import SamplingParams
from scheduler.engine.beam_search import BeamSearch, BeamSearchParams

pytestmark = [pytest.mark.gpu, needs_cuda]


def test_beams_on_cuda_match_transformers(tiny_hf, beam_prompts):
    """Four prompts in one batch on the GPU: every beam and score equals generate(num_beams=4) on the CPU."""
    engine = make_engine(tiny_hf, device="cuda")
    assert next(engine.model.parameters()).is_cuda
    search = BeamSearch(engine)
    outs = search.generate(beam_prompts, BeamSearchParams(width=WIDTH, max_tokens=NEW))
    for prompt, out in zip(beam_prompts, outs):
        assert_same_beams(out, *hf_beams(tiny_hf, prompt))
    assert search.last_memory.peak_blocks < search.last_memory.peak_blocks_unshared  # the beams shared blocks
    assert_all_freed(engine)


@pytest.mark.parametrize("many", [False, True], ids=["one-eos", "quarter-of-vocab-eos"])
def test_beams_with_eos_on_cuda_match_transformers(tiny_hf, beam_prompts, many):
    """EOS ids end hypotheses and the searches stop where transformers stops them (early_stopping=True)."""
    if many:  # K = 64 * width: the whole vocabulary at the first step
        eos = [list(range(0, VOCAB - 4, 4))] * len(beam_prompts)
    else:  # the 4th token of the best EOS-free beam, so that EOS is reached
        eos = [[hf_beams(tiny_hf, p)[0][0][3]] for p in beam_prompts]
    params = [BeamSearchParams(width=WIDTH, max_tokens=NEW, stop_token_ids=e, early_stopping=True) for e in eos]
    engine = make_engine(tiny_hf, device="cuda")
    outs = BeamSearch(engine).generate(beam_prompts, params)
    for prompt, out, e in zip(beam_prompts, outs, eos):
        assert_same_beams(out, *hf_beams(tiny_hf, prompt, eos=e, early_stopping=True))
    assert any(h.finish_reason == "stop" for o in outs for h in o.hypotheses)
    assert_all_freed(engine)


def _parallel_samples(tiny_hf) -> list[list[int]]:
    """Four seeded samples of one prompt on a fresh CUDA engine; checks the blocks they shared."""
    engine = make_engine(tiny_hf, device="cuda", num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)
    prompt = list(range(1, 42))  # 10 full blocks + 1 token in a partial block
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    (out,) = engine.generate([prompt], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert engine.block_manager.num_cow_copies == 3  # the partial block, once per sample but the last
    assert_all_freed(engine)
    return [c.token_ids for c in out.outputs]


def test_seeded_parallel_samples_on_cuda(tiny_hf):
    """n=4 seeded samples on the GPU: six valid tokens each, not all alike, the same again on a new engine."""
    first = _parallel_samples(tiny_hf)
    assert all(len(t) == 6 and all(0 <= x < VOCAB for x in t) for t in first)
    assert len({tuple(t) for t in first}) > 1
    assert _parallel_samples(tiny_hf) == first


def test_seeded_sample_on_cuda_is_independent_of_its_batch(tiny_hf, prompts):
    """A seeded request draws the same tokens alone and in a batch of unseeded ones, on the GPU."""
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=123)
    alone = make_engine(tiny_hf, device="cuda").generate([prompts[3]], params, use_tqdm=False)[0]
    others = [SamplingParams(max_tokens=10, temperature=1.0) for _ in prompts]
    mixed = make_engine(tiny_hf, device="cuda", max_num_batched_tokens=16, max_num_seqs=4)
    batch = mixed.generate(prompts, others[:3] + [params] + others[4:], use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.slow
def test_main_job_runs_on_cuda(monkeypatch):
    """``python -m scheduler --device cuda`` serves its workload on the GPU and ends with the beam search example."""
    engines, searches = [], []
    build, generate = main_job.build_engine, BeamSearch.generate
    monkeypatch.setattr(main_job, "build_engine", lambda *args: engines.append(build(*args)) or engines[-1])
    record = lambda *args, **kw: searches.append(generate(*args, **kw)) or searches[-1]  # noqa: E731
    monkeypatch.setattr(BeamSearch, "generate", record)
    main_job.main([
        "--device", "cuda", "--num-requests", "6", "--max-tokens", "12", "--arrivals-per-step", "2",
        "--max-num-seqs", "4", "--show", "1", "--beam-width", "2", "--threads", "0",
    ])  # fmt: skip
    (engine,) = engines
    assert engine.device.type == "cuda" and next(engine.model.parameters()).is_cuda
    assert engine.metrics_summary().generated_tokens >= 6  # every request answered
    ((best, *_),) = [out.hypotheses for (out,) in searches]
    assert best.token_ids and best.finish_reason in ("stop", "length")
    assert_all_freed(engine)

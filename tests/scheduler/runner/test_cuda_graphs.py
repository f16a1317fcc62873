"""CUDA-graph decode: the capture ladder, and (on a GPU) replay == eager == transformers, with no sync."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from sched_helpers import NUM_NEW

from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler.runner.cuda_graphs import capture_sizes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "max_num_seqs,sizes",
    [(1, [1]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 24]), (64, [1, 2, 4, *range(8, 65, 8)])],
)
def test_capture_sizes_cover_every_batch_up_to_max_num_seqs(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes
    assert all(any(s >= b for s in sizes) for b in range(1, max_num_seqs + 1))


def test_config_switches_are_validated():
    assert EngineConfig(enforce_eager=True).enforce_eager
    assert CacheConfig(gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5
    for bad in (0.0, 1.5, True, "0.9", float("nan")):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            CacheConfig(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager=1)


def _cuda_engine(hf, *, eager: bool, **sched) -> LLMEngine:
    sched.setdefault("max_num_batched_tokens", 64)
    cache = CacheConfig(block_size=4, num_gpu_blocks=256, num_cpu_blocks=sched.pop("num_cpu_blocks", 0))
    config = EngineConfig(cache=cache, scheduler=SchedulerConfig(**sched), device="cuda", enforce_eager=eager)
    return LLMEngine.from_hf(hf, config)


def _greedy(engine: LLMEngine, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def _decoding(hf, prompts, *, eager: bool) -> LLMEngine:
    """A CUDA engine past the prefill of five prompts: its next step is a decode step."""
    engine = _cuda_engine(hf, eager=eager, max_num_seqs=8)
    for i, p in enumerate(prompts[:5]):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4))
    engine.step()
    engine.step()
    return engine


@pytest.mark.gpu
@cuda
def test_graph_replay_equals_eager_forward(tiny_hf, prompts):
    engine = _decoding(tiny_hf, prompts, eager=False)
    step = engine.runner.inputs.build(engine.scheduler.schedule())
    graphs = engine.runner.graphs
    assert graphs.can_run(step)
    replayed = graphs.run(step).clone()
    eager = engine.model(step.input_ids, step.positions, engine.runner.gpu_cache, step.meta, step.logits_indices)
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("sched", [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 8}, {"num_cpu_blocks": 64}],
                         ids=["plain", "chunked-prefill", "swap-space"])  # fmt: skip
def test_engine_with_graphs_equals_eager_and_transformers(tiny_hf, prompts, hf_greedy, sched):
    with_graphs = _greedy(_cuda_engine(tiny_hf, eager=False, **dict(sched)), prompts)
    eager = _greedy(_cuda_engine(tiny_hf, eager=True, **dict(sched)), prompts)
    assert with_graphs == eager == hf_greedy


@pytest.mark.gpu
@cuda
def test_preemption_under_graphs_keeps_outputs(tiny_hf, prompts, hf_greedy):
    cache = CacheConfig(block_size=4, num_gpu_blocks=40, num_cpu_blocks=80)
    for mode in ("recompute", "swap"):
        sched = SchedulerConfig(max_num_batched_tokens=64, preemption_mode=mode)
        engine = LLMEngine.from_hf(tiny_hf, EngineConfig(cache=cache, scheduler=sched, device="cuda"))
        assert _greedy(engine, prompts) == hf_greedy
        assert sum(engine.scheduler.num_preemptions.values()) > 0


@pytest.mark.gpu
@cuda
def test_decode_forward_never_syncs(tiny_hf, prompts):
    engine = _decoding(tiny_hf, prompts, eager=True)
    out = engine.scheduler.schedule()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = engine.runner.inputs.build(out)
        engine.runner.execute(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step.meta.is_decode


@pytest.mark.gpu
@cuda
def test_gpu_memory_utilization_sizes_the_pool_within_budget(tiny_hf):
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.05)
    engine = LLMEngine.from_hf(tiny_hf, EngineConfig(cache=cache, device="cuda"))
    free, total = torch.cuda.mem_get_info()
    pool = engine.runner.gpu_cache
    assert pool.num_blocks > 0 and pool.nbytes <= 0.05 * total
    assert _greedy(engine, [[1, 2, 3]])[0]


@pytest.mark.gpu
@cuda
def test_memory_another_process_holds_does_not_shrink_the_pool(tiny_hf):
    """The share is per engine (vLLM's meaning): 4 GiB held by another process leave the pool as it was."""
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.03)
    config = EngineConfig(cache=cache, device="cuda", enforce_eager=True)
    alone = LLMEngine.from_hf(tiny_hf, config).runner.gpu_cache.num_blocks
    hold = "import sys, torch; x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda'); print('held', flush=True); "
    holder = subprocess.Popen([sys.executable, "-c", hold + "sys.stdin.read()"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        beside = LLMEngine.from_hf(tiny_hf, config).runner.gpu_cache.num_blocks
    finally:
        holder.communicate("")
    assert abs(beside - alone) <= alone // 100  # the same pool, give or take the allocator's rounding

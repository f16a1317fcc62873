"""Tensor parallelism with fewer KV heads than ranks (replicated), and workers that die or hang.

A worker killed mid-run (SIGKILL) or stopped (SIGSTOP: it hangs) must end the driver's call
with a WorkerError within a bounded time, not a hang; shutdown then leaves no child process.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from sched_helpers import VOCAB, make_engine, tiny_llama

from paged_kv.errors import InvalidArgumentError, WorkerError
from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams

TIMEOUT_S = 4.0  # the hang test's step timeout

@pytest.fixture(scope="module")
def one_kv_head_hf():
    """A seeded random Llama with 4 query heads and one KV head (replicated on both ranks)."""
    return tiny_llama(seed=3, num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 30)]


def _no_children_left(engine: LLMEngine) -> None:
    assert all(not p.is_alive() for p in engine.executor.processes)
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


def test_one_kv_head_is_replicated_and_a_killed_worker_raises_a_typed_error(one_kv_head_hf):
    torch.set_num_threads(1)
    params = SamplingParams(max_tokens=8)
    ref = [o.outputs[0].token_ids for o in make_engine(one_kv_head_hf).generate(_prompts(), params, use_tqdm=False)]
    engine = make_engine(one_kv_head_hf, tp=2)
    try:
        got = [o.outputs[0].token_ids for o in engine.generate(_prompts(), params, use_tqdm=False)]
        assert got == ref
        os.kill(engine.executor.processes[0].pid, signal.SIGINT)  # Ctrl-C is the driver's to handle
        again = [o.outputs[0].token_ids for o in engine.generate(_prompts(), params, use_tqdm=False)]
        assert again == ref and engine.executor.processes[0].is_alive()
        (k0, _), (k1, _) = engine.executor.gather_kv(1, list(range(8)))
        assert k0.shape[2] == k1.shape[2] == 1 and torch.equal(k0, k1)  # both ranks hold (and wrote) the one head
        engine.add_request("long", _prompts()[2], SamplingParams(max_tokens=100, ignore_eos=True))
        engine.step()
        worker = engine.executor.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1") as err:
            while engine.has_unfinished_requests():
                engine.step()
        assert err.value.rank == 1 and time.monotonic() - start < 10.0
        with pytest.raises(WorkerError):  # the engine stays failed
            engine.step()
    finally:
        engine.shutdown()
    _no_children_left(engine)


def test_a_hung_worker_raises_within_the_timeout_and_is_killed_at_shutdown(tiny_hf, prompts):
    torch.set_num_threads(1)
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_gpu_blocks=64, watermark=0.0), device="cpu", tensor_parallel_size=2,
        distributed_timeout_s=TIMEOUT_S,
    )  # fmt: skip
    engine = LLMEngine.from_hf(tiny_hf, config)
    try:
        engine.add_request("a", prompts[0], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(engine.executor.processes[0].pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="hung"):
            for _ in range(50):
                engine.step()
        assert TIMEOUT_S * 0.5 < time.monotonic() - start < TIMEOUT_S + 10.0
    finally:
        engine.shutdown()
    _no_children_left(engine)


def test_a_model_that_does_not_split_is_refused_before_any_process_starts(one_kv_head_hf):
    with pytest.raises(InvalidArgumentError, match="tensor_parallel_size=3"):
        make_engine(one_kv_head_hf, tp=3)
    assert multiprocessing.active_children() == [] and not dist.is_initialized()

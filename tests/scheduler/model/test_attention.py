"""The step's attention routes: fresh prompts attend their own K/V (dense chunk), the rest go through the pages.

Routes are decided on the host from the metadata's lengths. The engine tests count the dense
chunk calls, so they cannot pass with the path unused, and compare the outputs with the path
off and with transformers.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from backend_device import needs_cuda
from no_host_reads import forbid_host_reads
from sched_helpers import NUM_NEW, VOCAB

import scheduler.model.attention as attention
from kernels.metadata import prepare_attention_metadata
from paged_kv.kv_cache import KVCacheSpec, PagedKVCache
from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler.model.attention import CHUNK, DECODE, PAGED, AttentionPlan, step_routes


def step_meta(computed, new, block_size=4):
    """CPU metadata of one step: sequence s holds computed[s] tokens and adds new[s] (tables in order)."""
    tables, start = [], 0
    for c, n in zip(computed, new):
        count = -(-(c + n) // block_size)
        tables.append(list(range(start, start + count)))
        start += count
    return prepare_attention_metadata(tables, computed, new, block_size=block_size, num_blocks=start)


def test_routes_fresh_prompts_to_the_dense_chunk_path():
    meta = step_meta([0, 7, 12, 0], [5, 1, 4, 1])  # fresh, decode, extend, fresh single token
    assert step_routes(meta, chunk=True).tolist() == [CHUNK, DECODE, PAGED, CHUNK]
    assert step_routes(meta, chunk=False).tolist() == [PAGED, DECODE, PAGED, DECODE]  # CPU: one query, decode


def test_a_decode_step_stays_one_decode_call():
    meta = step_meta([0, 0], [1, 1])  # two one-token prompts: a decode step, graph-capturable
    assert meta.is_decode
    assert step_routes(meta, chunk=True).tolist() == [DECODE, DECODE]
    assert len(AttentionPlan(meta, "sdpa").parts) == 1


@pytest.mark.parametrize("chunk_backend", ["sdpa", "torch"])
def test_a_mixed_step_attends_like_the_paged_kernels(chunk_backend):
    computed, new = [0, 7, 12, 0], [5, 1, 4, 3]
    meta = step_meta(computed, new)
    hq, hkv, d = 4, 2, 16
    spec = KVCacheSpec(num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=4, dtype=torch.float32)
    cache = PagedKVCache(spec, meta.num_blocks, "cpu")
    gen = torch.Generator().manual_seed(0)
    layer = cache.layers[0]
    for t in (layer.k, layer.v):  # the cached prefixes
        t.copy_(torch.randn(t.shape, generator=gen))
    q = torch.randn(sum(new), hq, d, generator=gen)
    k, v = (torch.randn(sum(new), hkv, d, generator=gen) for _ in range(2))
    paged, dense = AttentionPlan(meta), AttentionPlan(meta, chunk_backend)
    assert [p.chunk is not None for p in dense.parts] == [True, False, False]  # chunk, decode, paged parts
    dense.write(layer, k, v)
    expected = paged.attend(q, k, v, layer, 0.25)
    torch.testing.assert_close(dense.attend(q, k, v, layer, 0.25), expected, atol=2e-6, rtol=2e-6)


def test_a_step_checks_each_kernel_call_once_for_all_its_layers(monkeypatch):
    meta = step_meta([7, 12], [1, 4])  # a decode and an extend: two parts on the CPU
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    cache, gen = PagedKVCache(spec, meta.num_blocks, "cpu"), torch.Generator().manual_seed(1)
    binds = []
    for name in ("bind_write_kv", "bind_decode_attention", "bind_prefill_attention"):
        original = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _f=original, _n=name, **k: binds.append(_n) or _f(*a, **k))
    plan, q = AttentionPlan(meta), torch.randn(5, 4, 16, generator=gen)
    for layer in cache.layers:
        k, v = (torch.randn(5, 2, 16, generator=gen) for _ in range(2))
        plan.write(layer, k, v)
        out = plan.attend(q, k, v, layer, 0.25)
    assert sorted(binds) == ["bind_decode_attention", "bind_prefill_attention", "bind_write_kv"]
    expected = AttentionPlan(meta).attend(q, k, v, cache.layers[-1], 0.25)  # checked on the last layer itself
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.fixture
def chunk_calls(monkeypatch):
    """Counts the layers' dense chunk calls, with the number of new tokens each attended."""
    calls = []
    original = attention.dense_chunk_attention_prepared

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(attention, "dense_chunk_attention_prepared", counting)
    return calls


def engine(tiny_hf, chunk: bool, device: str = "cpu", **sched) -> LLMEngine:
    """An engine (CPU unless told) over the tiny model with the dense chunk path on or off."""
    cache = CacheConfig(block_size=4, num_gpu_blocks=256, watermark=0.0, enable_dense_prefill=chunk)
    config = EngineConfig(cache=cache, scheduler=SchedulerConfig(**sched), device=device)
    return LLMEngine.from_hf(tiny_hf, config)


def test_engine_outputs_are_the_same_with_the_chunk_path_on_and_off(tiny_hf, prompts, hf_greedy, chunk_calls):
    params = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)
    off = engine(tiny_hf, False, max_num_batched_tokens=64).generate(prompts, params, use_tqdm=False)
    assert not chunk_calls
    on = engine(tiny_hf, True, max_num_batched_tokens=64).generate(prompts, params, use_tqdm=False)
    assert chunk_calls
    for a, b, ref in zip(on, off, hf_greedy):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == ref


def test_only_fresh_chunks_take_the_dense_path(tiny_hf, chunk_calls):
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    eng = engine(tiny_hf, True, max_num_batched_tokens=16, max_num_seqs=4)  # prompt prefilled in chunks of 16
    eng.add_request("r", prompt, SamplingParams(max_tokens=3))
    while eng.has_unfinished_requests():
        eng.step()
    layers = tiny_hf.config.num_hidden_layers
    assert chunk_calls == [16] * layers  # only the first chunk has no cached prefix; the rest and decode are paged
    eng.add_request("again", prompt, SamplingParams(max_tokens=2))  # a prefix-cache hit: not fresh either
    eng.step()
    assert len(chunk_calls) == layers


def first_step_logits(eng: LLMEngine, prompts: list[list[int]]) -> tuple[torch.Tensor, object]:
    """Logits ``[R, vocab]`` of the engine's first step (a fresh prefill of ``prompts``), under the host-read guard."""
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_tokens=2))
    out = eng.scheduler.schedule()
    with forbid_host_reads():
        step = eng.runner.inputs.build(out)
        return eng.runner.execute(step), step


def test_a_fresh_prefill_step_reads_no_device_value_and_gives_the_models_logits(tiny_hf, prompts):
    eng = engine(tiny_hf, True)
    logits, step = first_step_logits(eng, prompts[:3])
    assert (step.meta.host_seq_lens == step.meta.host_query_lens).all()
    assert eng.model.chunk_backend == "sdpa"
    with torch.no_grad():
        expected = torch.stack([tiny_hf(torch.tensor([p])).logits[0, -1] for p in prompts[:3]])
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=2e-4)


def test_the_model_probes_once_and_can_turn_the_path_off(tiny_hf):
    eng = engine(tiny_hf, False)
    assert eng.model.chunk_backend is None
    assert eng.model.enable_dense_prefill() == "sdpa"
    assert np.all(step_routes(step_meta([0], [3]), chunk=eng.model.chunk_backend is not None) == CHUNK)


@pytest.mark.gpu
@needs_cuda
def test_a_fresh_bf16_prefill_on_cuda_takes_flash_and_matches_the_paged_kernel(tiny_hf, prompts):
    hf = copy.deepcopy(tiny_hf).to(torch.bfloat16)
    dense, paged = engine(hf, True, device="cuda"), engine(hf, False, device="cuda")
    assert dense.model.chunk_backend == "flash" and paged.model.chunk_backend is None
    with_flash, _ = first_step_logits(dense, prompts[:4])
    without, _ = first_step_logits(paged, prompts[:4])
    torch.testing.assert_close(with_flash, without, atol=5e-2, rtol=5e-2)  # bf16 activations, two summation orders

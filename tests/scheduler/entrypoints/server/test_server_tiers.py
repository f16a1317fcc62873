"""The server over a tiered prefix cache: vLLM's ``priority`` reaches the engine, host hits count as cached
tokens, and /metrics shows each tier's hits, traffic and occupancy as the engine counts them.

The device pool holds 24 blocks of 4 tokens, so a few 40-token prompts evict each other's blocks
to the host tier.
"""

from __future__ import annotations

import pytest
from server_helpers import refused, scrape, serving, wait_idle

from scheduler.core.config import CacheConfig, EngineConfig, SchedulerConfig
from scheduler.entrypoints.server.config import ServerConfig

TIERED = EngineConfig(
    cache=CacheConfig(block_size=4, num_gpu_blocks=24, watermark=0.0, kv_offloading_bytes=1 << 16),
    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), device="cpu",
)  # fmt: skip


@pytest.fixture(scope="module")
def tiered(tiny_model_dir):
    with serving(tiny_model_dir, ServerConfig(), engine=TIERED) as s:
        yield s


def prompt(first: int) -> list[int]:
    """40 token ids (10 full blocks) no other prompt here starts with."""
    return [first] + list(range(3, 42))


def complete(served, ids: list[int], **fields) -> dict:
    r = served.post("completions", {"model": served.model, "prompt": ids, "max_tokens": 2, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prompt_evicted_to_the_host_tier_is_served_from_it_and_counted_as_cached(tiered):
    engine = tiered.llm.engine
    before = engine.block_manager.stats().num_host_hit_tokens
    assert complete(tiered, prompt(200))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for first in (201, 202, 203):  # each takes 11 of the 24 blocks: the first prompt's blocks leave the device
        complete(tiered, prompt(first))
    cached = complete(tiered, prompt(200))["usage"]["prompt_tokens_details"]["cached_tokens"]
    host_hits = engine.block_manager.stats().num_host_hit_tokens - before
    assert cached == host_hits == 36  # its 9 leading blocks (a hit never covers the last token), all from the host


def test_metrics_show_each_tiers_hits_traffic_and_occupancy(tiered):
    for first in (210, 211, 212, 210):  # the last one comes back from the host tier
        complete(tiered, prompt(first))
    wait_idle(tiered)
    samples, engine = scrape(tiered), tiered.llm.engine
    stats, tiers = engine.block_manager.stats(), engine.tiers.stats()
    vllm = (("engine", "0"), ("model_name", tiered.llm.model_name))

    def value(name: str, *labels) -> float:
        return samples[(name, tuple(sorted(labels)))]

    gpu_hits = stats.num_hit_tokens - tiers.host_hit_tokens - tiers.disk_hit_tokens
    assert tiers.host_hit_tokens > 0 and tiers.bytes_loaded > 0 and tiers.bytes_stored > 0
    assert value("vllm:prefix_cache_hits_total", *vllm) == gpu_hits  # the device's, as vLLM counts it
    assert value("vllm:external_prefix_cache_hits_total", *vllm) == tiers.host_hit_tokens
    assert value("vllm:external_prefix_cache_queries_total", *vllm) == stats.num_queried_tokens
    assert value("vllm:kv_offload_store_bytes_total", *vllm) == tiers.bytes_stored
    assert value("vllm:kv_offload_load_bytes_total", *vllm) == tiers.bytes_loaded
    assert value("vllm:kv_offload_total_bytes_total", *vllm, ("transfer_type", "GPU_to_CPU")) == tiers.bytes_stored
    assert value("vllm:kv_offload_total_bytes_total", *vllm, ("transfer_type", "CPU_to_GPU")) == tiers.bytes_loaded
    by_medium = [value("paged_kv:prefix_cache_hits_by_medium_total", ("medium", m)) for m in ("GPU", "CPU", "STORAGE")]
    assert by_medium == [gpu_hits, tiers.host_hit_tokens, 0]
    assert value("paged_kv:kv_offload_cpu_blocks") == tiers.host_blocks == 32  # 64 KiB of 2 KiB blocks
    assert 0 < value("paged_kv:kv_offload_cpu_cached_blocks") == tiers.host_cached_blocks
    rate = value("paged_kv:prefix_cache_hit_rate")
    assert rate == pytest.approx(stats.num_hit_tokens / stats.num_queried_tokens)  # every tier's hits
    assert not any(name.startswith("paged_kv:kv_disk") for name, _ in samples)  # no disk tier configured


def test_vllms_priority_reaches_the_engine_and_a_bad_one_is_a_400(tiered, monkeypatch):
    engine, seen = tiered.llm.engine, []
    add = engine.add_request

    def spy(*args, **kw):
        seen.append(kw.get("priority"))
        return add(*args, **kw)

    monkeypatch.setattr(engine, "add_request", spy)
    complete(tiered, [5, 6, 7], priority=-7)
    chat = {"model": tiered.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "priority": (1 << 63) - 1, "stream": True}  # fmt: skip
    assert tiered.post("chat/completions", chat).status_code == 200
    complete(tiered, [5, 6, 7])
    assert seen == [-7, (1 << 63) - 1, 0]
    for bad in (True, 1.5, "1", 1 << 63, -(1 << 63) - 1, [1]):
        refused(tiered.post("completions", {"model": tiered.model, "prompt": "hi", "priority": bad}), "priority")
    assert len(seen) == 3


def test_metrics_of_the_disk_tier(tiny_model_dir, tmp_path):
    cache = CacheConfig(block_size=4, num_gpu_blocks=24, watermark=0.0, kv_offloading_bytes=8 << 11,
                        kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 20)  # fmt: skip
    config = EngineConfig(cache=cache, scheduler=TIERED.scheduler, device="cpu")
    with serving(tiny_model_dir, ServerConfig(), engine=config) as served:
        for first in (220, 221, 222, 223):
            complete(served, prompt(first))
        served.llm.engine.tiers.disk.flush()  # the writes land before the read (a busy machine delays the writer)
        complete(served, prompt(220))  # the 8-block host tier cannot keep the first: it comes from disk
        complete(served, [5])  # no full block: stores nothing, publishes a fresh snapshot
        wait_idle(served)
        samples, tiers = scrape(served), served.llm.engine.tiers.stats()
    assert tiers.disk_hit_tokens > 0 and tiers.disk_bytes_read > 0
    assert samples[("paged_kv:prefix_cache_hits_by_medium_total", (("medium", "STORAGE"),))] == tiers.disk_hit_tokens
    for name, expected in (("paged_kv:kv_disk_write_bytes_total", tiers.disk_bytes_written),
                           ("paged_kv:kv_disk_read_bytes_total", tiers.disk_bytes_read),
                           ("paged_kv:kv_disk_used_bytes", tiers.disk_bytes_used),
                           ("paged_kv:kv_disk_capacity_bytes", 1 << 20)):  # fmt: skip
        assert samples[(name, ())] == expected > 0, name
    assert samples[("paged_kv:kv_disk_reads_in_flight", ())] == tiers.disk_reads_in_flight == 0  # all landed

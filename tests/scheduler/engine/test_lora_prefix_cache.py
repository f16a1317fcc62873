"""Prefix caching keyed by adapter: blocks computed through an adapter serve only that adapter; KV events name it;
a refused adapter leaves the engine as it was."""

from __future__ import annotations

import re

import pytest
from lora_helpers import write_adapter
from sched_helpers import SHARED, assert_all_freed, make_engine

from paged_kv.errors import InvalidArgumentError
from scheduler import LoRAConfig, LoRARequest, SamplingParams
from scheduler.core.kv_events_config import KVEventsConfig
from scheduler.engine.kv_events import BlockStored

ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)
LORA = LoRAConfig(max_loras=2, max_lora_rank=8)
PROMPT = SHARED + [7, 8, 9]  # 43 tokens: 10 full blocks of 4


@pytest.fixture(scope="module")
def adapters(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [LoRARequest(name=n, path=write_adapter(root / n, tiny_hf, seed=i)) for i, n in enumerate(("x", "y"))]


def _cached(engine, lora_request, salt=None) -> int:
    """Prompt tokens a request through ``lora_request`` found in the prefix cache."""
    params = SamplingParams(max_tokens=1, ignore_eos=True, cache_salt=salt)
    return engine.generate([PROMPT], params, lora_request=lora_request, use_tqdm=False)[0].num_cached_tokens


def test_blocks_are_shared_only_under_the_same_adapter(tiny_hf, adapters):
    x, y = adapters
    engine = make_engine(tiny_hf, lora=LORA)
    assert _cached(engine, x) == 0
    assert _cached(engine, y) == 0  # computed under x: not y's
    assert _cached(engine, None) == 0  # nor the base model's
    assert _cached(engine, x) == 40 and _cached(engine, y) == 40 and _cached(engine, None) == 40
    assert _cached(engine, x, salt="t") == 0  # the request's salt still separates within an adapter
    assert_all_freed(engine)


def test_the_same_name_with_other_weights_shares_nothing(tiny_hf, adapters, tmp_path):
    """An adapter reloaded under its name from other files roots other chains (vLLM keys by name alone)."""
    engine = make_engine(tiny_hf, lora=LORA)
    assert _cached(engine, adapters[0]) == 0
    other = LoRARequest(name="x", path=write_adapter(tmp_path / "x2", tiny_hf, seed=5))
    assert _cached(engine, other) == 0
    assert _cached(engine, other) == 40


def test_kv_events_name_the_adapter_of_each_block(tiny_hf, adapters):
    engine = make_engine(tiny_hf, lora=LORA, kv_events=KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
    batches = []
    engine.cache_events.publisher.publish = batches.append
    engine.generate([PROMPT] * 3, ONE_TOKEN, lora_request=[adapters[0], adapters[1], None], use_tqdm=False)
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    blocks = {}
    for e in stored:
        for h in e.block_hashes:
            blocks[h] = (e.lora_name, e.lora_id)
    assert sorted(blocks.values(), key=str).count(("x", 1)) == 10
    assert list(blocks.values()).count(("y", 2)) == 10 and list(blocks.values()).count((None, None)) == 10


@pytest.mark.parametrize(
    ("config", "field", "value"),
    [
        ({"use_dora": True}, "use_dora", "True"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save", "['lm_head']"),
        ({"bias": "all"}, "bias", "'all'"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules", ""),
        ({"target_modules": ["lm_head"]}, "target_modules", ""),
        ({"r": 16}, "r", "16"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern", ""),
        ({"fan_in_fan_out": True}, "fan_in_fan_out", "True"),
    ],
)  # fmt: skip
def test_a_refused_adapter_config_names_its_field_and_schedules_nothing(tiny_hf, tmp_path, config, field, value):
    path = write_adapter(tmp_path / "bad", tiny_hf, seed=3, **config)
    engine = make_engine(tiny_hf, lora=LORA)
    with pytest.raises(InvalidArgumentError, match=rf"^adapter_config\.json\.{field}={re.escape(value)}"):
        engine.add_request("r", PROMPT, ONE_TOKEN, lora_request=LoRARequest(name="bad", path=path))
    assert not engine.has_unfinished_requests() and engine.runner.loras.names == []
    assert_all_freed(engine)


def test_a_rank_above_max_lora_rank_is_refused(tiny_hf, tmp_path):
    path = write_adapter(tmp_path / "big", tiny_hf, seed=3, rank=16)
    engine = make_engine(tiny_hf, lora=LORA)
    with pytest.raises(InvalidArgumentError, match=r"^adapter_config\.json\.r=16: .*max_lora_rank"):
        engine.add_request("r", PROMPT, ONE_TOKEN, lora_request=LoRARequest(name="big", path=path))


def test_weights_of_the_wrong_shape_or_module_are_refused(tiny_hf, tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_adapter(tmp_path / "shape", tiny_hf, seed=3)
    file = tmp_path / "shape" / "adapter_model.safetensors"
    tensors = load_file(str(file))
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    tensors[key] = tensors[key][:16]
    save_file(tensors, str(file))
    engine = make_engine(tiny_hf, lora=LORA)
    with pytest.raises(InvalidArgumentError, match=r"layers\.1\.k_proj\.lora_B\.weight shape=\(16, 4\)"):
        engine.add_request("r", PROMPT, ONE_TOKEN, lora_request=LoRARequest(name="s", path=path))
    tensors["base_model.model.lm_head.lora_A.weight"] = tensors.pop(key)
    save_file(tensors, str(file))
    with pytest.raises(InvalidArgumentError, match=r"key='base_model\.model\.lm_head\.lora_A\.weight'"):
        engine.add_request("r", PROMPT, ONE_TOKEN, lora_request=LoRARequest(name="s", path=path))


def test_a_missing_or_unreadable_adapter_is_refused(tiny_hf, tmp_path):
    engine = make_engine(tiny_hf, lora=LORA)
    with pytest.raises(InvalidArgumentError, match=r"^lora_request\.path=.*adapter_config\.json"):
        engine.add_request("r", PROMPT, ONE_TOKEN, lora_request=LoRARequest(name="m", path=str(tmp_path / "none")))
    path = write_adapter(tmp_path / "torn", tiny_hf, seed=3)
    (tmp_path / "torn" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InvalidArgumentError, match=r"^lora_request\.path=.*readable adapter_model\.safetensors"):
        engine.add_request("r", PROMPT, ONE_TOKEN, lora_request=LoRARequest(name="t", path=path))
    assert not engine.has_unfinished_requests()


def test_a_batch_with_one_bad_adapter_schedules_nothing(tiny_hf, adapters, tmp_path):
    engine = make_engine(tiny_hf, lora=LORA)
    bad = LoRARequest(name="bad", path=str(tmp_path / "missing"))
    with pytest.raises(InvalidArgumentError, match="^lora_request.path="):
        engine.generate([PROMPT, PROMPT], ONE_TOKEN, lora_request=[adapters[0], bad], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert_all_freed(engine)


def test_lora_off_refuses_a_lora_request(tiny_hf, adapters):
    engine = make_engine(tiny_hf)
    with pytest.raises(InvalidArgumentError, match=r"^lora_request=.*LoRA is off"):
        engine.add_request("r", PROMPT, ONE_TOKEN, lora_request=adapters[0])
    assert engine.runner.loras is None and not engine.has_unfinished_requests()


def test_max_cpu_loras_keeps_the_most_recent_adapters(tiny_hf, adapters, tmp_path):
    engine = make_engine(tiny_hf, lora=LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1))
    engine.generate([PROMPT], ONE_TOKEN, lora_request=adapters[0], use_tqdm=False)
    engine.generate([PROMPT], ONE_TOKEN, lora_request=adapters[1], use_tqdm=False)
    assert engine.runner.loras.names == ["y"]


def test_the_host_tier_keeps_blocks_apart_by_adapter(tiny_hf, adapters):
    """Blocks evicted to the host tier under adapter x are found again by x only, not by y or the base model."""
    from scheduler import CacheConfig, EngineConfig, LLMEngine, SchedulerConfig

    cache = CacheConfig(block_size=4, num_gpu_blocks=14, watermark=0.0, kv_offloading_bytes=1 << 20)
    config = EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=64), device="cpu",
                          lora_config=LORA)  # fmt: skip
    engine = LLMEngine.from_hf(tiny_hf, config)
    x, y = adapters
    assert _cached(engine, x) == 0
    engine.generate([list(range(200, 243))], ONE_TOKEN, use_tqdm=False)  # evicts x's blocks to the host tier
    assert engine.block_manager.stats().num_host_stored_blocks > 0
    assert _cached(engine, y) == 0 and _cached(engine, None) == 0
    engine.generate([list(range(200, 243))], ONE_TOKEN, use_tqdm=False)
    before = engine.block_manager.stats().num_host_hit_tokens
    assert _cached(engine, x) == 40
    assert engine.block_manager.stats().num_host_hit_tokens > before  # found in the host tier

"""LoRAConfig and LoRARequest refuse bad fields by name; adapter keys salt the prefix cache apart."""

from __future__ import annotations

import pytest

from paged_kv.errors import InvalidArgumentError, PagedKVError
from scheduler import EngineConfig, LoRAConfig, LoRARequest
from scheduler.core.lora_request import LoRAKey, lora_per_prompt


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_loras": 0}, "max_loras"),
        ({"max_lora_rank": 12}, "max_lora_rank"),
        ({"max_lora_rank": True}, "max_lora_rank"),
        ({"max_loras": 4, "max_cpu_loras": 3}, "max_cpu_loras"),
    ],
)
def test_lora_config_refuses_a_bad_field_naming_it(kwargs, field):
    with pytest.raises(PagedKVError, match=f"^{field}="):
        LoRAConfig(**kwargs)


def test_lora_config_defaults_and_cpu_loras():
    assert LoRAConfig() == LoRAConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=None)
    assert LoRAConfig(max_loras=2).num_cpu_loras == 2 and LoRAConfig(max_cpu_loras=5).num_cpu_loras == 5


def test_engine_config_takes_a_lora_config_or_none():
    assert EngineConfig(lora_config=LoRAConfig(), tensor_parallel_size=2).lora_config == LoRAConfig()
    with pytest.raises(InvalidArgumentError, match="^lora_config="):
        EngineConfig(lora_config={"max_loras": 2})


@pytest.mark.parametrize(("kwargs", "field"), [({"name": "", "path": "p"}, "name"), ({"name": "a", "path": 3}, "path")])
def test_lora_request_refuses_an_empty_field(kwargs, field):
    with pytest.raises(InvalidArgumentError, match=f"^lora_request.{field}="):
        LoRARequest(**kwargs)
    with pytest.raises(TypeError):
        LoRARequest("a", "p")  # keyword-only


def test_adapter_keys_salt_apart_by_name_files_and_request_salt():
    key = LoRAKey(name="a", lora_id=1, fingerprint="f", path="p")
    salts = {key.cache_salt(None), key.cache_salt(""), key.cache_salt("s"),
             LoRAKey(name="b", lora_id=1, fingerprint="f", path="p").cache_salt(None),
             LoRAKey(name="a", lora_id=1, fingerprint="g", path="p").cache_salt(None)}  # fmt: skip
    assert len(salts) == 5 and all(isinstance(s, bytes) for s in salts)


def test_lora_per_prompt_takes_one_or_one_each():
    r = LoRARequest(name="a", path="p")
    assert lora_per_prompt(r, 2) == [r, r] and lora_per_prompt(None, 1) == [None]
    assert lora_per_prompt([r, None], 2) == [r, None]
    with pytest.raises(InvalidArgumentError, match="^lora_request="):
        lora_per_prompt([r], 2)
    with pytest.raises(InvalidArgumentError, match="^lora_request="):
        lora_per_prompt(["a", None], 2)

"""SpeculativeConfig: vLLM's fields and defaults, typed errors naming the field, from JSON and from a dict."""

from __future__ import annotations

import pytest

from paged_kv.errors import InvalidArgumentError, PagedKVError
from scheduler.core.config import EngineConfig
from scheduler.core.speculative_config import SpeculativeConfig


def test_lookup_bounds_default_to_each_other_then_to_five_as_vllm():
    neither = SpeculativeConfig(num_speculative_tokens=3)
    assert (neither.min_n, neither.max_n) == (5, 5)
    only_max = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4)
    only_min = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2)
    assert (only_max.min_n, only_max.max_n) == (4, 4) and (only_min.min_n, only_min.max_n) == (2, 2)
    both = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=4)
    assert (both.min_n, both.max_n) == (1, 4)


@pytest.mark.parametrize("fields, name", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=65), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2.0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=True), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2, method="eagle"), "method"),
    (dict(num_speculative_tokens=2, prompt_lookup_max=0), "prompt_lookup_max"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=-1), "prompt_lookup_min"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
])  # fmt: skip
def test_bad_values_are_typed_errors_naming_the_field(fields, name):
    with pytest.raises(PagedKVError, match=rf"^{name}="):
        SpeculativeConfig(**fields)


def test_is_frozen_and_keyword_only():
    config = SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(AttributeError):
        config.num_speculative_tokens = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        SpeculativeConfig("ngram", 2)  # type: ignore[misc]


def test_from_json_reads_vllms_flag_and_names_what_is_wrong():
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
    )
    assert config == SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1)
    for text, name in (("{", "speculative_config"), ("[1]", "speculative_config"), ('{"method": "ngram"}',
                       "num_speculative_tokens"), ('{"num_speculative_tokens": 2, "model": "x"}', "model")):
        with pytest.raises(InvalidArgumentError, match=rf"^{name}="):
            SpeculativeConfig.from_json(text)


def test_engine_config_holds_one_or_none():
    assert EngineConfig().speculative_config is None
    spec = SpeculativeConfig(num_speculative_tokens=2)
    assert EngineConfig(speculative_config=spec).speculative_config is spec
    with pytest.raises(InvalidArgumentError, match="^speculative_config="):
        EngineConfig(speculative_config={"num_speculative_tokens": 2})  # type: ignore[arg-type]

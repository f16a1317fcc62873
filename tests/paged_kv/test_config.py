"""BlockManagerConfig: defaults, immutability and validation of every field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from paged_kv.config import MAX_BLOCK_SIZE, MAX_BLOCKS, BlockManagerConfig
from paged_kv.errors import InvalidArgumentError, PagedKVError


def test_defaults():
    cfg = BlockManagerConfig(num_blocks=100)
    assert (cfg.block_size, cfg.num_cpu_blocks, cfg.watermark, cfg.enable_prefix_caching) == (16, 0, 0.01, True)
    assert cfg.watermark_blocks == 1


def test_config_is_frozen_and_keyword_only():
    cfg = BlockManagerConfig(num_blocks=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_blocks = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        BlockManagerConfig(4)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("watermark", "num_blocks", "expected"),
    [(0.0, 100, 0), (0.01, 100, 1), (0.01, 99, 0), (0.25, 10, 2), (0.5, 7, 3), (0.999, 1000, 999)],
)
def test_watermark_blocks_rounds_down(watermark, num_blocks, expected):
    cfg = BlockManagerConfig(num_blocks=num_blocks, watermark=watermark)
    assert cfg.watermark_blocks == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_blocks", 1), ("num_blocks", MAX_BLOCKS),
        ("block_size", 1), ("block_size", MAX_BLOCK_SIZE),
        ("num_cpu_blocks", 0), ("num_cpu_blocks", MAX_BLOCKS),
        ("watermark", 0), ("watermark", 0.5),
        ("enable_prefix_caching", False),
    ],
)
def test_boundary_values_are_accepted(field, value):
    cfg = BlockManagerConfig(**{"num_blocks": 8, field: value})
    assert getattr(cfg, field) == value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_blocks", 0), ("num_blocks", -1), ("num_blocks", MAX_BLOCKS + 1), ("num_blocks", 1 << 80),
        ("num_blocks", 2.0), ("num_blocks", "8"), ("num_blocks", None),
        ("block_size", 0), ("block_size", -16), ("block_size", MAX_BLOCK_SIZE + 1), ("block_size", 16.0),
        ("num_cpu_blocks", -1), ("num_cpu_blocks", MAX_BLOCKS + 1), ("num_cpu_blocks", "0"),
        ("watermark", -0.01), ("watermark", 1.0), ("watermark", 1), ("watermark", 5.0),
        ("watermark", math.nan), ("watermark", math.inf), ("watermark", "0.1"), ("watermark", None),
        ("enable_prefix_caching", "no"), ("enable_prefix_caching", 1), ("enable_prefix_caching", None),
    ],
)
def test_bad_values_raise_naming_the_field(field, value):
    with pytest.raises(PagedKVError, match=rf"^{field}="):
        BlockManagerConfig(**{"num_blocks": 8, field: value})


def test_bad_values_raise_value_error_subclass():
    with pytest.raises(ValueError):
        BlockManagerConfig(num_blocks=8, watermark=2.0)
    with pytest.raises(InvalidArgumentError):
        BlockManagerConfig(num_blocks=8, block_size=16.0)

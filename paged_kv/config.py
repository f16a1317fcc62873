"""Configuration dataclasses, validated at construction."""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass

from paged_kv.errors import InvalidArgumentError, check_bool, check_int, check_real, describe

MAX_BLOCKS = 1 << 26  # 64M blocks: any larger count is a unit mistake, not a real pool
MAX_BLOCK_SIZE = 1 << 12
HOST_STORE_POLICIES = ("evict", "write")
PRIORITY_MIN, PRIORITY_MAX = -(1 << 63), (1 << 63) - 1  # vLLM's request priority: any int64
# Seconds between an engine's rescans of a shared disk-tier directory: another engine's blocks are found
# this long after they are written at worst, for one directory listing (and the headers of new files)
# per interval on a background thread. Blocks reach disk when the host tier receives them, seconds to
# minutes after their prefill, so rescanning much more often would find little sooner.
DISK_REFRESH_INTERVAL_S = 5.0


def check_refresh_interval(name: str, value: object) -> float | None:
    """Seconds between disk rescans as a float, or None for never (None or 0); else InvalidArgumentError.

    The bound is the longest wait a ``threading.Condition`` accepts.
    """
    if value is None:
        return None
    finite = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if not (finite and 0 <= value <= threading.TIMEOUT_MAX):
        expected = f"None or 0 (never rescan) or a finite number of seconds in (0, {threading.TIMEOUT_MAX:g}]"
        raise InvalidArgumentError(describe(name, value, expected))
    return float(value) or None


@dataclass(frozen=True, kw_only=True)
class BlockManagerConfig:
    """Sizes and policies of a :class:`~paged_kv.block_manager.BlockManager`."""

    num_blocks: int  # the GPU pool's size (BlockManager.add_blocks grows it, and the manager's config with it)
    block_size: int = 16
    num_cpu_blocks: int = 0
    watermark: float = 0.01  # fraction of the GPU blocks that can_allocate, fits and can_swap_in keep free (vLLM's)
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0  # the host tier of the prefix cache (0: none); see paged_kv.host_tier
    host_store: str = "evict"  # the host tier receives: "evict" (blocks leaving the pool), "write" (every full block)
    track_cache_events: bool = False  # journal every change of the cache indexes (KV events)

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, low=1, high=MAX_BLOCKS)
        check_int("block_size", self.block_size, low=1, high=MAX_BLOCK_SIZE)
        check_int("num_cpu_blocks", self.num_cpu_blocks, low=0, high=MAX_BLOCKS)
        check_real("watermark", self.watermark, low=0.0, high=1.0, open_high=True)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_int("num_host_blocks", self.num_host_blocks, low=0, high=MAX_BLOCKS)
        if self.host_store not in HOST_STORE_POLICIES:
            raise InvalidArgumentError(describe("host_store", self.host_store, f"one of {HOST_STORE_POLICIES}"))
        check_bool("track_cache_events", self.track_cache_events)

    @property
    def watermark_blocks(self) -> int:
        """Free blocks that ``can_allocate`` keeps in reserve for running sequences."""
        return int(self.watermark * self.num_blocks)

"""Introspection: occupancy and prefix-cache hit-rate figures of a block manager."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class BlockManagerStats:
    """A snapshot of a block manager's GPU pool and prefix cache."""

    num_blocks: int
    num_free: int
    num_used: int
    num_cached: int
    num_evictable: int
    num_cpu_used: int
    num_sequences: int
    hit_rate: float
    hit_rate_since_reset: float
    num_queried_tokens: int  # prompt tokens looked up in the prefix cache, over the manager's life
    num_hit_tokens: int  # of those, tokens found cached
    fragmentation: float
    num_cow_copies: int
    num_evictions: int
    # the host tier (all 0 without one): its blocks, those holding a cached block, and what it served
    num_host_blocks: int = 0
    num_host_cached: int = 0
    num_host_hit_tokens: int = 0  # tokens loaded back from host blocks
    num_lower_hit_tokens: int = 0  # tokens loaded back from a lower tier (disk), through the host tier
    num_host_stored_blocks: int = 0  # device blocks copied to the host tier

    @property
    def usage(self) -> float:
        """Fraction of GPU blocks referenced by a sequence."""
        return self.num_used / self.num_blocks


class HitCounter:
    """Prefix-cache hits over queried tokens, over the whole life and since the last reset."""

    def __init__(self) -> None:
        self.queried = self.hits = 0
        self.total_queried = self.total_hits = 0

    def record(self, queried: int, hits: int) -> None:
        """Count one lookup of ``queried`` tokens of which ``hits`` were cached."""
        self.queried += queried
        self.hits += hits
        self.total_queried += queried
        self.total_hits += hits

    def reset(self) -> None:
        """Restart the since-reset window."""
        self.queried = self.hits = 0

    def rate(self) -> float:
        """Hit rate since the last reset (0.0 before any query)."""
        return self.hits / self.queried if self.queried else 0.0

    def lifetime_rate(self) -> float:
        """Hit rate over the manager's whole life."""
        return self.total_hits / self.total_queried if self.total_queried else 0.0

"""The prefix cache's tiers below the device pool, as the engine runs them: host memory, then disk.

The block manager indexes the host tier (``paged_kv.host_tier``) and owes, each step, the
copies the runner makes (``scheduler.runner.tier_transfers``). This module owns the rest:
the host pool's storage, the disk tier (``paged_kv.tiers.disk_tier``), the write-through of
every block stored on the host to disk (whose directory the disk tier rescans in the background, for
the files of other engines sharing it), the background read of a waiting prompt's blocks from
disk into the host tier before its admission (``scheduler.engine.disk_prefetch``), and, at shutdown, the
spill of the device's cached blocks to disk so a restarted engine finds them.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import MISSING, dataclass, fields

import torch

from paged_kv.block_manager import BlockManager
from paged_kv.host_tier import BlockRecord
from paged_kv.kv_cache import KVCacheSpec, PagedKVCache
from paged_kv.stats import BlockManagerStats
from paged_kv.tiers.disk_tier import DiskBlock, DiskTier, ModelFingerprint
from scheduler.core.config import CacheConfig
from scheduler.engine.disk_prefetch import DiskPrefetch
from scheduler.runner.tier_transfers import TierTransfers

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TierStats:
    """What each tier holds and served (blocks and tokens), and the bytes moved."""

    host_blocks: int
    host_cached_blocks: int
    host_hit_tokens: int
    disk_hit_tokens: int
    disk_bytes_used: int
    disk_capacity_bytes: int
    bytes_stored: int  # device -> host
    bytes_loaded: int  # host -> device
    disk_bytes_written: int
    disk_bytes_read: int
    disk_reads_in_flight: int  # waiting sequences whose blocks are being read from disk


def model_identity(model: torch.nn.Module, config: object) -> str:
    """A name for the K/V a model writes: its family, its config and a digest sampled from its weights.

    Two checkpoints of one geometry (a base model and its fine-tune) write different K/V for the
    same tokens; the disk tier must never serve one the other's. Each tensor's name, shape,
    dtype and first and last 512 values are hashed: cheap at start-up, and any fine-tune moves them.
    The config counts by the fields it sets away from their defaults (:func:`config_items`).
    """
    digest = hashlib.blake2b(repr(config_items(config)).encode(), digest_size=16)
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1)
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        for part in (flat[:512], flat[-512:]):
            digest.update(part.float().cpu().numpy().tobytes())
    return f"llama:{digest.hexdigest()}"


def config_items(config: object) -> list[tuple[str, object]]:
    """A dataclass config's (name, value) pairs but those at their field's default: a field added later whose
    default keeps the old computation (as ``ModelConfig.qk_norm``) leaves the identity, and so the disk tier's
    files, of every model that does not set it as they were."""
    return [(f.name, getattr(config, f.name)) for f in fields(config)
            if f.default is MISSING or getattr(config, f.name) != f.default]  # fmt: skip


class TieredCache:
    """Host storage, transfers and the optional disk tier of one engine's prefix cache."""

    def __init__(
        self, spec: KVCacheSpec, config: CacheConfig, bm: BlockManager, device_cache: PagedKVCache, architecture: str
    ) -> None:
        self.bm = bm
        cuda = device_cache.device.type == "cuda"
        self.host_cache = PagedKVCache(spec, bm.host.pool.num_blocks, "cpu", pin_memory=cuda)
        self.disk: DiskTier | None = None
        self._disk_closed = False
        if config.kv_disk_dir is not None:
            fingerprint = ModelFingerprint.from_spec(spec, architecture)
            self.disk = DiskTier(config.kv_disk_dir, capacity_bytes=config.kv_disk_bytes, fingerprint=fingerprint,
                                 blocks_per_file=config.kv_disk_blocks_per_file,
                                 refresh_interval_s=config.kv_disk_refresh_interval_s)  # fmt: skip
        self.prefetch = DiskPrefetch(bm, self.disk) if self.disk is not None else None  # reads for waiting prompts
        self.transfers = TierTransfers(device_cache, self.host_cache, self._write_through if self.disk else None)

    @staticmethod
    def num_host_blocks(spec: KVCacheSpec, config: CacheConfig) -> int:
        """Host blocks in the configured offloading budget (0: no host tier)."""
        return config.kv_offloading_bytes // spec.bytes_per_block

    def _write_through(self, records: list[BlockRecord], kv: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Blocks the host tier just received go to disk too (the disk tier writes them in the background)."""
        self.disk.put([DiskBlock(hash=r.hash, parent=r.parent, tokens=r.tokens) for r in records], kv, scales)

    def spill(self) -> int:
        """Write every block cached on the device (and not on disk yet) to disk; how many were queued."""
        if self.disk is None:
            return 0
        cached = [c for c in self.bm.gpu.cached_blocks() if not self.disk.find(c[2], [c[1]], [c[3]], 1)]
        if cached:
            kv, scales = self.transfers.device_cache.read_blocks([b for b, _, _, _ in cached])
            blocks = [DiskBlock(hash=h, parent=p, tokens=t) for _, h, p, t in cached]
            self.disk.put(blocks, kv.cpu(), None if scales is None else scales.cpu())
        return len(cached)

    def close(self) -> None:
        """Drop reads, land stores in flight, spill the device's cached blocks, finish disk writes; idempotent."""
        self.transfers.flush()
        if self.disk is not None and not self._disk_closed:
            self.prefetch.close()
            self.spill()
            self.disk.close()
            self._disk_closed = True

    def stats(self, block_stats: BlockManagerStats | None = None) -> TierStats:
        """A snapshot of the tiers' figures (``block_stats``: the block manager's, if the caller has them now)."""
        s, t = self.bm.stats() if block_stats is None else block_stats, self.transfers
        d = self.disk.stats if self.disk is not None else None
        return TierStats(
            host_blocks=s.num_host_blocks, host_cached_blocks=s.num_host_cached, host_hit_tokens=s.num_host_hit_tokens,
            disk_hit_tokens=s.num_lower_hit_tokens, disk_bytes_used=d.bytes_used if d else 0,
            disk_capacity_bytes=d.capacity_bytes if d else 0, bytes_stored=t.bytes_stored, bytes_loaded=t.bytes_loaded,
            disk_bytes_written=d.bytes_written if d else 0, disk_bytes_read=d.bytes_read if d else 0,
            disk_reads_in_flight=self.prefetch.num_reading if self.prefetch else 0,
        )  # fmt: skip

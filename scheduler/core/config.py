"""Configuration of the scheduler and the engine, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from paged_kv.config import (
    DISK_REFRESH_INTERVAL_S,
    HOST_STORE_POLICIES,
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    check_refresh_interval,
)
from paged_kv.errors import InvalidArgumentError, check_bool, check_int, check_real, describe
from paged_kv.kv_cache import KERNEL_DTYPES
from paged_kv.tensor_checks import check_device, check_dtype
from scheduler.core.kv_events_config import KVEventsConfig
from scheduler.core.pooling_params import PoolerConfig
from scheduler.core.speculative_config import SpeculativeConfig

PreemptionMode = Literal["recompute", "swap"]
PREEMPTION_MODES = ("recompute", "swap")
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Per-step budgets and policies of the scheduler."""

    max_num_batched_tokens: int = 512  # new tokens per step (decode + prefill chunks)
    max_num_seqs: int = 64  # sequences per step
    enable_chunked_prefill: bool = True  # split long prompts across steps
    preemption_mode: PreemptionMode = "recompute"
    # vLLM's --scheduling-policy: "priority" serves the queues in (priority, arrival) order and preempts the
    # running request with the largest (priority, arrival) first; "fcfs" serves by arrival, preempts the latest
    scheduling_policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, low=1, high=1 << 16)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, low=self.max_num_seqs, high=1 << 24)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise InvalidArgumentError(describe("preemption_mode", self.preemption_mode, f"one of {PREEMPTION_MODES}"))
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidArgumentError(
                describe("scheduling_policy", self.scheduling_policy, f"one of {SCHEDULING_POLICIES}")
            )


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The paged KV pools: block geometry, sizes, prefix caching and storage dtype."""

    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: as many as fit in kv_cache_bytes
    kv_cache_bytes: int = 256 << 20
    num_cpu_blocks: int = 0  # swap space; must be > 0 for preemption_mode="swap"
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    # decode steps whose sequences share long prefixes (forks, a cached system prompt) attend them once per group
    enable_cascade_attention: bool = True
    # prompts with no cached prefix attend their own K/V with the device's dense kernel (FlashAttention varlen)
    enable_dense_prefill: bool = True
    # K/V bytes per layer a cascade step must save to run (it costs kernels and a merge per layer, and on
    # CUDA the decode graph). None: the device's default, scheduler.runner.cascade_plan.MIN_SAVED_BYTES
    cascade_min_saved_bytes: int | None = None
    dtype: torch.dtype | None = None  # None: the model's dtype
    # CUDA: the fraction of the device's memory the engine may use (weights, activations, graphs and
    # the KV pool, as vLLM means it); the pool gets what is left. None: num_gpu_blocks / kv_cache_bytes.
    gpu_memory_utilization: float | None = None
    # the prefix cache's lower tiers (docs/tiered_cache.md): a host tier of this many bytes (vLLM's
    # --kv-offloading-size, in GiB there), fed by the blocks that leave the pool ("evict") or every full
    # block as it is written ("write"); under it, a disk tier in a directory, kept across restarts
    kv_offloading_bytes: int = 0
    host_store: str = "evict"
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 0
    kv_disk_blocks_per_file: int = 8
    # seconds between rescans of kv_disk_dir on a background thread, to find the files other engines sharing
    # the directory write while this one runs (None or 0: only at start-up)
    kv_disk_refresh_interval_s: float | None = DISK_REFRESH_INTERVAL_S

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, low=1, high=MAX_BLOCK_SIZE)
        utilization = self.gpu_memory_utilization
        if utilization is not None and (
            isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0.0 < utilization <= 1.0
        ):
            raise InvalidArgumentError(describe("gpu_memory_utilization", utilization, "a fraction in (0, 1] or None"))
        if self.num_gpu_blocks is not None:
            check_int("num_gpu_blocks", self.num_gpu_blocks, low=1, high=MAX_BLOCKS)
        check_int("kv_cache_bytes", self.kv_cache_bytes, low=1)
        check_int("num_cpu_blocks", self.num_cpu_blocks, low=0, high=MAX_BLOCKS)
        check_real("watermark", self.watermark, low=0.0, high=1.0, open_high=True)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_bool("enable_cascade_attention", self.enable_cascade_attention)
        check_bool("enable_dense_prefill", self.enable_dense_prefill)
        if self.cascade_min_saved_bytes is not None:
            check_int("cascade_min_saved_bytes", self.cascade_min_saved_bytes, low=0)
        if self.dtype is not None:
            check_dtype("dtype", self.dtype, KERNEL_DTYPES)  # storage the attention kernels read
        self._check_tiers()

    def _check_tiers(self) -> None:
        """The lower tiers' fields: sizes, policy, and a disk tier only under a host tier."""
        check_int("kv_offloading_bytes", self.kv_offloading_bytes, low=0, high=1 << 50)  # 1 PiB: a unit mistake
        if self.host_store not in HOST_STORE_POLICIES:
            raise InvalidArgumentError(describe("host_store", self.host_store, f"one of {HOST_STORE_POLICIES}"))
        if self.kv_offloading_bytes and not self.enable_prefix_caching:
            raise InvalidArgumentError(describe("kv_offloading_bytes", self.kv_offloading_bytes,
                                                "0 when enable_prefix_caching=False (the tiers hold cached blocks)"))
        check_int("kv_disk_blocks_per_file", self.kv_disk_blocks_per_file, low=1, high=1 << 16)
        check_int("kv_disk_bytes", self.kv_disk_bytes, low=0, high=1 << 56)
        check_refresh_interval("kv_disk_refresh_interval_s", self.kv_disk_refresh_interval_s)
        if self.kv_disk_dir is None:
            if self.kv_disk_bytes:
                raise InvalidArgumentError(describe("kv_disk_bytes", self.kv_disk_bytes, "0 without kv_disk_dir"))
            return
        if not isinstance(self.kv_disk_dir, str) or not self.kv_disk_dir:
            raise InvalidArgumentError(describe("kv_disk_dir", self.kv_disk_dir, "a directory path (str) or None"))
        check_int("kv_disk_bytes", self.kv_disk_bytes, low=1)
        if not self.kv_offloading_bytes:
            raise InvalidArgumentError(describe("kv_offloading_bytes", 0, "> 0 with kv_disk_dir (disk reads land "
                                                "in the host tier)"))


MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices (1: tests and toys)


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Multi-LoRA serving (scheduler.core.lora_request): adapters per step, their largest rank, adapters kept loaded."""

    max_loras: int = 1  # distinct adapters in one step (device slots); a request through another one waits
    max_lora_rank: int = 16  # slots are padded to this rank; an adapter of a larger rank is refused
    # adapters kept loaded in host memory, the least recently requested dropped first; None: max_loras
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        check_int("max_loras", self.max_loras, low=1, high=1 << 10)
        if check_int("max_lora_rank", self.max_lora_rank, low=1) not in MAX_LORA_RANKS:
            raise InvalidArgumentError(describe("max_lora_rank", self.max_lora_rank, f"one of {MAX_LORA_RANKS}"))
        if self.max_cpu_loras is not None:
            check_int("max_cpu_loras", self.max_cpu_loras, low=self.max_loras, high=1 << 16)

    @property
    def num_cpu_loras(self) -> int:
        """Adapters kept loaded: ``max_cpu_loras``, or ``max_loras`` when None."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything the engine needs besides the model: cache, scheduler and device."""

    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    device: str | None = None  # None: "cuda" when available, else "cpu"
    enforce_eager: bool = False  # True: no CUDA graphs (every step runs eagerly)
    # ranks the model is split over (scheduler.distributed); > 1 runs eagerly, no CUDA graphs
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 60.0  # a worker that dies or hangs fails a step within this
    kv_events: KVEventsConfig | None = None  # KV cache events for routers (vLLM's format, on ZeroMQ); None: off
    # n-gram speculative decoding (vLLM's --speculative-config; scheduler.engine.spec_decode); None: off
    speculative_config: SpeculativeConfig | None = None
    # vLLM's --enable-lora and its options: requests may name PEFT LoRA adapters; None: off (no adapter served)
    lora_config: LoRAConfig | None = None
    # how embedding requests (LLMEngine.add_pooling_request) are pooled (vLLM's --pooler-config); None: not set,
    # so LLM takes the checkpoint's declared pooling, else PoolerConfig()'s defaults. A PoolerConfig given, even
    # PoolerConfig() itself, is an explicit choice and always wins over the checkpoint's.
    pooler_config: PoolerConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enforce_eager, bool):
            raise InvalidArgumentError(describe("enforce_eager", self.enforce_eager, "a bool"))
        check_int("tensor_parallel_size", self.tensor_parallel_size, low=1, high=1 << 12)
        check_real("distributed_timeout_s", self.distributed_timeout_s, low=0.0, open_low=True)
        if not isinstance(self.cache, CacheConfig):
            raise InvalidArgumentError(describe("cache", self.cache, "a CacheConfig"))
        if self.kv_events is not None and not isinstance(self.kv_events, KVEventsConfig):
            raise InvalidArgumentError(describe("kv_events", self.kv_events, "a KVEventsConfig or None"))
        if not isinstance(self.scheduler, SchedulerConfig):
            raise InvalidArgumentError(describe("scheduler", self.scheduler, "a SchedulerConfig"))
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise InvalidArgumentError(describe("speculative_config", self.speculative_config,
                                                "a SpeculativeConfig or None"))
        self._check_lora()
        if self.pooler_config is not None and not isinstance(self.pooler_config, PoolerConfig):
            raise InvalidArgumentError(describe("pooler_config", self.pooler_config, "a PoolerConfig or None"))
        if self.tensor_parallel_size > 1 and self.cache.kv_offloading_bytes:
            raise InvalidArgumentError(describe("cache.kv_offloading_bytes", self.cache.kv_offloading_bytes,
                                                "0 with tensor_parallel_size > 1 (tiers run on one rank)"))
        if self.scheduler.preemption_mode == "swap" and self.cache.num_cpu_blocks == 0:
            raise InvalidArgumentError(
                describe("cache.num_cpu_blocks", 0, "> 0 when scheduler.preemption_mode='swap'")
            )
        if self.device is not None:
            check_device("device", self.device)

    def _check_lora(self) -> None:
        """A LoRAConfig or None."""
        if self.lora_config is not None and not isinstance(self.lora_config, LoRAConfig):
            raise InvalidArgumentError(describe("lora_config", self.lora_config, "a LoRAConfig or None"))

    def resolved_device(self) -> torch.device:
        """The device the model and the KV cache live on."""
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

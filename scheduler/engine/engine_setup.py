"""The engine's construction: the model on its device, the KV pool's size, the runner and the tiers.

Plain functions of the :class:`~scheduler.core.config.EngineConfig`, called once by
:class:`~scheduler.engine.llm_engine.LLMEngine` in this order: :func:`place_model` (starting the
tensor-parallel workers first when ``tensor_parallel_size > 1``), :func:`num_gpu_blocks`,
:func:`make_block_manager`, :func:`make_runner`, :func:`make_tiers` (with LoRA, :func:`make_loras` right after
:func:`place_model`: its device slots are in use when the pool is sized; the runner gets it); later, on
``enable_structured_outputs``, :func:`make_structured_outputs`. Invariants:

- the device pool, its block manager and the step-input builder agree on ``num_blocks`` and
  ``block_size``; the workers of a tensor-parallel group get the same figures (:class:`WorkerSetup`);
- decode CUDA graphs are captured only on CUDA, without ``enforce_eager`` and with one rank
  (:func:`uses_graphs`), after the workers are set up;
- the host (and disk) tiers exist exactly when the block manager has a host tier, and the runner
  then moves their blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from paged_kv.block_manager import BlockManager
from paged_kv.config import BlockManagerConfig
from paged_kv.errors import InvalidArgumentError, check_int, describe
from paged_kv.kv_cache import KVCacheSpec, PagedKVCache
from paged_kv.tokens import as_id_list
from scheduler.core.config import CacheConfig, EngineConfig
from scheduler.core.kv_events_config import KVEventsConfig
from scheduler.distributed.parallel_state import TPShard
from scheduler.engine.tiered_cache import TieredCache, model_identity
from scheduler.model.llama import LlamaModel
from scheduler.runner.cascade_plan import min_saved_tokens
from scheduler.runner.lora_manager import LoRAManager
from scheduler.runner.memory import plan_kv_memory
from scheduler.runner.model_runner import ModelRunner
from scheduler.runner.step_input import StepInputBuilder
from scheduler.runner.tp_executor import TPExecutor
from scheduler.runner.tp_worker import WorkerSetup

if TYPE_CHECKING:
    from scheduler.engine.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)


def eos_id_set(ids: int | Iterable[int] | None) -> frozenset[int]:
    """EOS ids as a set: None, one id or several (checked like token ids: no bools, no floats)."""
    if ids is None:
        return frozenset()
    if isinstance(ids, int) and not isinstance(ids, bool):
        ids = [ids]
    elif isinstance(ids, (set, frozenset)):
        ids = list(ids)
    return frozenset(as_id_list("eos_token_id", ids, "token ids", "a token id or a list of them"))


def place_model(model: LlamaModel, config: EngineConfig) -> tuple[LlamaModel, torch.device, TPExecutor | None]:
    """The model on its device in eval mode; with tensor parallelism, rank 0's shard once the workers run."""
    device, executor, tp = config.resolved_device(), None, config.tensor_parallel_size
    if tp > 1:
        LlamaModel(model.config, TPShard(0, tp))  # a typed error before any process starts
        executor, model = TPExecutor.launch(model, tp, device, config.distributed_timeout_s)
        device = model.embed.weight.device
    return model.to(device).eval(), device, executor


def uses_graphs(config: EngineConfig, device: torch.device) -> bool:
    """Whether decode steps replay captured CUDA graphs: on CUDA, not ``enforce_eager``, one rank."""
    return device.type == "cuda" and not config.enforce_eager and config.tensor_parallel_size == 1


def kv_events(config: EngineConfig) -> KVEventsConfig | None:
    """The KV-events config when events are enabled, else None."""
    events = config.kv_events
    return events if events is not None and events.enable_kv_cache_events else None


def num_gpu_blocks(model: LlamaModel, spec: KVCacheSpec, config: EngineConfig, device: torch.device,
                   graphs: bool) -> int:  # fmt: skip
    """The pool size: from gpu_memory_utilization on CUDA, else num_gpu_blocks or the byte budget; logged."""
    cc, sc = config.cache, config.scheduler
    if cc.gpu_memory_utilization is not None and device.type == "cuda":
        plan = plan_kv_memory(
            model, spec, utilization=cc.gpu_memory_utilization, max_tokens=sc.max_num_batched_tokens,
            max_seqs=sc.max_num_seqs, graphs=graphs,
        )  # fmt: skip
        logger.info(plan.describe(spec))
        return plan.num_blocks
    num_blocks = cc.num_gpu_blocks or spec.num_blocks_for_bytes(cc.kv_cache_bytes)
    logger.info("KV pool %d blocks x %d tokens = %d tokens, %.3f GiB on %s", num_blocks, spec.block_size,
                num_blocks * spec.block_size, num_blocks * spec.bytes_per_block / 2**30, device)  # fmt: skip
    return num_blocks


def make_block_manager(spec: KVCacheSpec, cc: CacheConfig, num_blocks: int, track_events: bool) -> BlockManager:
    """The allocator over the device pool (and the CPU swap space, the host tier), journaling every change."""
    return BlockManager(BlockManagerConfig(
        num_blocks=num_blocks, block_size=cc.block_size, num_cpu_blocks=cc.num_cpu_blocks,
        watermark=cc.watermark, enable_prefix_caching=cc.enable_prefix_caching,
        num_host_blocks=TieredCache.num_host_blocks(spec, cc), host_store=cc.host_store,
        track_cache_events=track_events,
    ), track_changes=True)  # fmt: skip


def make_runner(model: LlamaModel, spec: KVCacheSpec, num_blocks: int, config: EngineConfig, device: torch.device,
                executor: TPExecutor | None, graphs: bool) -> ModelRunner:  # fmt: skip
    """The KV pools, the step-input builder and the model runner over them (workers set up alike; graphs)."""
    cc = config.cache
    cpu_cache = PagedKVCache(spec, cc.num_cpu_blocks, "cpu") if cc.num_cpu_blocks else None
    gpu_cache = PagedKVCache(spec, num_blocks, device)
    width = min(-(-model.config.max_position_embeddings // cc.block_size), num_blocks)
    per_token = spec.bytes_per_block // (spec.num_layers * spec.block_size)  # K+V bytes of a token in a layer
    floor = min_saved_tokens(per_token, device.type, cc.cascade_min_saved_bytes)
    inputs = StepInputBuilder(cc.block_size, num_blocks, device, width, cascade=cc.enable_cascade_attention,
                              min_saved_tokens=floor)  # fmt: skip
    runner = ModelRunner(model, gpu_cache, cpu_cache, dense_prefill=cc.enable_dense_prefill, inputs=inputs,
                         group=executor)  # fmt: skip
    if executor is not None:
        executor.attach_caches(gpu_cache, cpu_cache)
        dense = cc.enable_dense_prefill
        lc = config.lora_config
        lora = (lc.max_loras, lc.max_lora_rank) if lc is not None else None
        executor.setup(WorkerSetup(num_blocks, cc.num_cpu_blocks, cc.block_size, cc.dtype, width, dense, lora))
    if graphs:
        _capture_graphs(runner, config.scheduler.max_num_seqs, width)
    return runner


def make_loras(model: LlamaModel, config: EngineConfig) -> LoRAManager | None:
    """The adapters' manager (device slots attached to the model) when LoRA is on, else None (the model untouched)."""
    if config.lora_config is None:
        return None
    lc = config.lora_config
    logger.info("LoRA: %d adapters per step, rank <= %d, %d kept loaded", lc.max_loras, lc.max_lora_rank,
                lc.num_cpu_loras)  # fmt: skip
    return LoRAManager(model, lc)


def _capture_graphs(runner: ModelRunner, max_num_seqs: int, width: int) -> None:
    """Capture the decode CUDA graphs (batch 1..max_num_seqs); logged."""
    captured = runner.capture_graphs(max_num_seqs, width)
    logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s, %.2f GiB",
                len(captured.sizes), captured.sizes[-1], captured.capture_seconds, captured.pool_bytes / 2**30)


def make_tiers(model: LlamaModel, spec: KVCacheSpec, cc: CacheConfig, block_manager: BlockManager,
               runner: ModelRunner) -> TieredCache | None:  # fmt: skip
    """The host (and disk) tiers under the device pool, when configured, their transfers given to the runner; logged."""
    if block_manager.host is None:
        return None
    identity = model_identity(model, model.config)
    tiers = TieredCache(spec, cc, block_manager, runner.gpu_cache, identity)
    runner.tiers = tiers.transfers
    logger.info("host tier %d blocks (%.3f GiB, store on %s)%s", tiers.host_cache.num_blocks,
                tiers.host_cache.nbytes / 2**30, cc.host_store,
                f"; disk tier {cc.kv_disk_dir} ({cc.kv_disk_bytes / 2**30:.3f} GiB)" if tiers.disk else "")
    return tiers


def make_structured_outputs(tokenizer, vocab_size: int, eos_token_ids: Iterable[int], device: torch.device,
                            cache_size: int) -> StructuredOutputs:  # fmt: skip
    """The grammars of constrained requests over ``tokenizer`` (xgrammar, ``cache_size`` compiled grammars kept);
    InvalidArgumentError on a bad ``cache_size`` or a tokenizer xgrammar cannot read."""
    check_int("cache_size", cache_size, low=1, high=1 << 20)
    if not callable(getattr(tokenizer, "get_vocab", None)):
        raise InvalidArgumentError(describe("tokenizer", type(tokenizer).__name__, "a transformers tokenizer"))
    from scheduler.engine.structured_outputs import StructuredOutputs  # imports xgrammar (about a second)

    try:
        return StructuredOutputs(tokenizer, vocab_size, eos_token_ids, device, cache_size=cache_size)
    except (RuntimeError, ValueError, TypeError) as e:
        expected = f"a tokenizer xgrammar reads ({e})"
        raise InvalidArgumentError(describe("tokenizer", type(tokenizer).__name__, expected)) from e

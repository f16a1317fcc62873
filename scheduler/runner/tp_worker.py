"""The worker side of tensor parallelism: receive each step's payload, run this rank's shard, repeat.

A worker holds its model shard, its own GPU (and CPU swap) KV pools of its KV heads, and a
copy of the block-table rows. Messages arrive over the gloo control group by broadcast from
rank 0, in this order: one :class:`WorkerSetup`, then any number of
:class:`~scheduler.runner.step_input.StepPayload` (run the step: block moves, then the forward with
its collectives) and :class:`KVQuery` (debug: send back K/V of some blocks), then
:class:`Stop`. The worker never samples: rank 0 does.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from paged_kv.errors import WorkerError
from paged_kv.kv_cache import PagedKVCache
from scheduler.distributed.parallel_state import Groups, TPShard, destroy_groups, init_groups
from scheduler.model.llama import LlamaModel, ModelConfig
from scheduler.model.lora_adapter import load_adapter
from scheduler.model.lora_layers import LoRASlots, attach_lora
from scheduler.runner.block_tables import DeviceRows
from scheduler.runner.model_runner import ModelRunner
from scheduler.runner.step_input import StepMaterializer, StepPayload

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSetup:
    """The pools and tables the driver chose, so every rank allocates the same block ids."""

    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    kv_dtype: torch.dtype | None
    width: int  # block-table columns
    dense_prefill: bool  # fresh prompts attend their own K/V with the dense kernel (CacheConfig)
    lora: tuple[int, int] | None = None  # (max_loras, max_lora_rank): the shard gets adapter slots; None: LoRA off


@dataclass(frozen=True)
class KVQuery:
    """Debug: every rank sends rank 0 the K/V of ``blocks`` of ``layer`` in its GPU or CPU pool."""

    layer: int
    blocks: tuple[int, ...]
    pool: str = "gpu"


@dataclass(frozen=True)
class Stop:
    """End the worker loop."""


def receive(groups: Groups) -> object:
    """The next message broadcast by rank 0 over the control group (its pickled size, then its bytes)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=groups.control)
    data = torch.empty(int(size[0]), dtype=torch.uint8)  # host tensors: no device read
    dist.broadcast(data, src=0, group=groups.control)
    return pickle.loads(data.numpy().tobytes())


def send(message: object, groups: Groups, timeout_s: float) -> None:
    """Rank 0: broadcast ``message`` to :func:`receive`; a WorkerError if a rank does not take it in ``timeout_s``."""
    data = pickle.dumps(message)
    for t in (torch.tensor([len(data)], dtype=torch.int64), torch.frombuffer(bytearray(data), dtype=torch.uint8)):
        work = dist.broadcast(t, src=0, group=groups.control, async_op=True)
        if not work.wait(timeout=timedelta(seconds=timeout_s)):
            raise WorkerError(f"a tensor-parallel worker hung: it took no step payload within {timeout_s} s")


def answer_kv_query(q: KVQuery, gpu: PagedKVCache, cpu: PagedKVCache | None, groups: Groups) -> list | None:
    """Gather every rank's K/V ``([N, B, H_rank, D], [N, B, H_rank, D])`` of the queried blocks on rank 0."""
    pool = gpu if q.pool == "gpu" else cpu
    layer = pool.layers[q.layer]
    idx = torch.tensor(q.blocks, dtype=torch.int64, device=pool.device)
    mine = (layer.k.index_select(0, idx).cpu(), layer.v.index_select(0, idx).cpu())
    out = [None] * groups.shard.size if groups.shard.rank == 0 else None
    dist.gather_object(mine, out, dst=0, group=groups.control)
    return out


def run_worker(model: LlamaModel, groups: Groups, device: torch.device) -> None:
    """Serve rank 0's messages until :class:`Stop` (or until a collective fails: the exception propagates)."""
    setup = receive(groups)
    spec = model.kv_cache_spec(setup.block_size, setup.kv_dtype)
    gpu = PagedKVCache(spec, setup.num_gpu_blocks, device)
    cpu = PagedKVCache(spec, setup.num_cpu_blocks, "cpu") if setup.num_cpu_blocks else None
    runner = ModelRunner(model, gpu, cpu, dense_prefill=setup.dense_prefill, pools=False)  # rank 0 pools
    steps = StepMaterializer(DeviceRows(setup.width, device), device, setup.block_size)
    slots = attach_lora(model, *setup.lora) if setup.lora is not None else None
    while True:
        msg = receive(groups)
        if isinstance(msg, StepPayload):
            for slot, path, fingerprint in msg.lora_loads:
                load_slot(model, slots, slot, path, fingerprint)
            runner.execute(steps.materialize(msg))  # the logits are dropped: rank 0 samples
        elif isinstance(msg, KVQuery):
            answer_kv_query(msg, gpu, cpu, groups)
        else:
            return


def load_slot(model: LlamaModel, slots: LoRASlots, slot: int, path: str, fingerprint: str) -> None:
    """Load the adapter the driver placed in ``slot`` (read from ``path``: the same files, else a WorkerError)."""
    adapter = load_adapter(path, model.config, slots.max_rank)
    if adapter.fingerprint != fingerprint:
        raise WorkerError(f"LoRA adapter {path}: its files changed since the driver loaded them")
    slots.load(slot, adapter)


def local_device(device_type: str, local_rank: int) -> torch.device:
    """This rank's device: ``cuda:{local_rank}`` on CUDA (set as current), else the CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def spawned_worker(
    rank: int, size: int, init_method: str, device_type: str, timeout_s: float, num_threads: int,
    cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, ready,
) -> None:  # fmt: skip
    """Entry point of a worker process the engine spawned: load the shard, say ready, join, serve, clean up."""
    # Ctrl-C reaches the terminal's whole process group: the driver alone handles it and stops the workers
    # (LLMEngine.shutdown), so a worker neither dies mid-collective nor prints a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(num_threads)
    device = local_device(device_type, rank)
    model = LlamaModel(cfg, TPShard(rank, size))
    model.load_state_dict(state, strict=True)
    del state
    model = model.to(device=device, dtype=dtype).eval()
    ready.put(rank)  # the driver joins the group only once every worker got this far (or died: it checks)
    groups = init_groups(rank=rank, size=size, device=device, timeout_s=timeout_s, init_method=init_method)
    try:
        run_worker(model, groups, device)
    finally:
        destroy_groups()


def run_torchrun_worker(model: LlamaModel, device_type: str, timeout_s: float) -> None:
    """Under torchrun, ranks other than 0 call this with the whole model: shard it and serve rank 0 until it stops."""
    from scheduler.model.sharding import shard_model

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = local_device(device_type, int(os.environ.get("LOCAL_RANK", 0)))
    groups = init_groups(rank=rank, size=size, device=device, timeout_s=timeout_s)
    try:
        run_worker(shard_model(model.cpu(), TPShard(rank, size)).to(device), groups, device)
    finally:
        destroy_groups()


def is_torchrun_worker() -> bool:
    """Whether this process is a rank > 0 started by torchrun (it serves rank 0 instead of running an engine)."""
    return int(os.environ.get("RANK", "0")) > 0 and "WORLD_SIZE" in os.environ


def serve_rank(hf_model, config) -> None:
    """Under torchrun, rank > 0: build the whole model from a transformers model, then run its shard for rank 0."""
    from scheduler.model.weights import from_hf_model

    run_torchrun_worker(from_hf_model(hf_model), config.resolved_device().type, config.distributed_timeout_s)

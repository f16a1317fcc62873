"""The driver side of tensor parallelism: start or join the workers, broadcast each step, detect failures.

Two ways to start (:meth:`TPExecutor.launch`):

* local: the engine spawns ``size - 1`` worker processes with ``torch.multiprocessing``
  (spawn context); they meet rank 0 through a file rendezvous in a temporary folder and get
  their weight shards as shared-memory CPU tensors;
* ``torchrun`` (``RANK``/``WORLD_SIZE`` set): every rank was started by torchrun, rank 0 runs
  the engine and the others called :func:`~scheduler.runner.tp_worker.run_torchrun_worker`.

Failures: the model's collectives have the bounded ``distributed_timeout_s``; a worker that
dies makes them fail at once (gloo) or at the timeout, and a hung one at the timeout. The
executor checks its spawned workers' exit codes before each broadcast and after a failed
collective, and raises :class:`~paged_kv.errors.WorkerError` naming the rank when it knows it.
After a failure the engine cannot go on: :meth:`shutdown` (also run at exit) stops what is
left, kills workers that do not stop within a grace period and destroys the process groups.
"""

from __future__ import annotations

import atexit
import os
import queue
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_kv.errors import InvalidArgumentError, WorkerError, describe
from scheduler.distributed.parallel_state import COMM, Groups, TPShard, destroy_groups, init_groups
from scheduler.model.llama import LlamaModel
from scheduler.model.sharding import shard_model, shard_state_dict
from scheduler.runner.tp_worker import KVQuery, Stop, WorkerSetup, send, spawned_worker

T = TypeVar("T")
GRACE_S = 5.0  # how long shutdown waits for a worker to exit before killing it
REAP_S = 1.0  # how long a failed collective waits for a dying worker's exit code
STARTUP_S = 300.0  # how long spawned workers may take to import torch and load their shard


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (``RANK`` and ``WORLD_SIZE`` in the environment)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class TPExecutor:
    """Rank 0's handle on the tensor-parallel group: its workers, its process groups, its broadcasts."""

    def __init__(self, groups: Groups, processes: list, timeout_s: float, rendezvous_dir: str | None) -> None:
        self.groups, self.processes, self.timeout_s = groups, processes, timeout_s
        self._rendezvous_dir = rendezvous_dir
        self.closed = False
        self.failed: WorkerError | None = None
        atexit.register(self.shutdown)

    @property
    def size(self) -> int:
        """Ranks in the group (the driver included)."""
        return self.groups.shard.size

    @classmethod
    def launch(
        cls, model: LlamaModel, size: int, device: torch.device, timeout_s: float
    ) -> tuple[TPExecutor, LlamaModel]:
        """Start (or, under torchrun, join) a group of ``size`` ranks; return it and rank 0's shard of ``model``."""
        if under_torchrun():
            return cls._join(model, size, device, timeout_s)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise InvalidArgumentError(describe(
                "tensor_parallel_size", size, f"at most the {torch.cuda.device_count()} visible CUDA devices"))
        return cls._spawn(model, size, device, timeout_s)

    @classmethod
    def _join(cls, model: LlamaModel, size: int, device: torch.device, timeout_s: float):
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != size or rank != 0:
            raise InvalidArgumentError(describe(
                "tensor_parallel_size", size, f"torchrun's WORLD_SIZE={world}, the engine on RANK 0 (got {rank})"))
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        groups = init_groups(rank=0, size=size, device=device, timeout_s=timeout_s)
        return cls(groups, [], timeout_s, None), shard_model(model.cpu(), TPShard(0, size)).to(device)

    @classmethod
    def _spawn(cls, model: LlamaModel, size: int, device: torch.device, timeout_s: float):
        cpu_model = model.cpu()
        dtype, cfg = cpu_model.embed.weight.dtype, cpu_model.config
        full = cpu_model.state_dict()
        folder = tempfile.mkdtemp(prefix="paged-kv-tp-")
        init_method = f"file://{os.path.join(folder, 'rendezvous')}"
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        processes = []
        for rank in range(1, size):
            state = {k: v.share_memory_() for k, v in shard_state_dict(cfg, full, TPShard(rank, size)).items()}
            args = (rank, size, init_method, device.type, timeout_s, torch.get_num_threads(), cfg, state, dtype, ready)
            p = ctx.Process(target=spawned_worker, args=args, name=f"paged-kv-tp-worker-{rank}", daemon=True)
            p.start()
            processes.append(p)
        if device.type == "cuda":
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        try:
            _wait_ready(processes, ready, max(timeout_s, STARTUP_S))
            groups = init_groups(rank=0, size=size, device=device, timeout_s=timeout_s, init_method=init_method)
        except Exception as e:
            _stop_processes(processes, 0.0)
            shutil.rmtree(folder, ignore_errors=True)
            if isinstance(e, WorkerError):
                raise
            raise WorkerError(f"tensor-parallel workers could not join the group: {e}") from e
        return cls(groups, processes, timeout_s, folder), shard_model(cpu_model, TPShard(0, size)).to(device)

    # -- the per-step protocol ---------------------------------------------
    def broadcast(self, message: object) -> None:
        """Send every worker ``message`` (a step payload, setup, query or stop)."""
        start = time.perf_counter()
        self.guard(lambda: send(message, self.groups, self.timeout_s))
        COMM.add("broadcast", time.perf_counter() - start, 0)

    def setup(self, setup: WorkerSetup) -> None:
        """Tell the workers the pool sizes and table width the driver chose."""
        self.broadcast(setup)

    def guard(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (collectives with the workers); turn a dead, hung or failed worker into a WorkerError."""
        if self.failed is not None:
            raise self.failed
        if self.closed:
            raise WorkerError("the tensor-parallel group was shut down")
        self._check_alive()
        try:
            return fn()
        except WorkerError:
            raise
        except (RuntimeError, dist.DistError) as e:  # DistBackendError, timeouts, gloo's closed connections
            raise self._fail(self._dead_worker(wait_s=REAP_S) or WorkerError(
                f"a tensor-parallel collective failed (a worker hung past {self.timeout_s} s or died): {e}"))

    def gather_kv(self, layer: int, blocks: list[int], pool: str = "gpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Debug: every rank's K/V ``[N, B, H_rank, D]`` of ``blocks`` of ``layer`` (rank 0's ``gpu_cache`` too)."""
        from scheduler.runner.tp_worker import answer_kv_query

        query = KVQuery(layer, tuple(blocks), pool)
        self.broadcast(query)
        return self.guard(lambda: answer_kv_query(query, self.gpu_cache, self.cpu_cache, self.groups))

    def attach_caches(self, gpu_cache, cpu_cache) -> None:
        """Rank 0's own pools (read by :meth:`gather_kv`)."""
        self.gpu_cache, self.cpu_cache = gpu_cache, cpu_cache

    # -- failures and shutdown -----------------------------------------------
    def _check_alive(self) -> None:
        dead = self._dead_worker(wait_s=0.0)
        if dead is not None:
            raise self._fail(dead)

    def _dead_worker(self, wait_s: float) -> WorkerError | None:
        """A WorkerError for the first spawned worker that exited (waiting up to ``wait_s`` for one), else None."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.processes, start=1):
                if p.exitcode is not None:
                    return WorkerError(f"tensor-parallel worker rank {rank} exited with code {p.exitcode}", rank)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _fail(self, error: WorkerError) -> WorkerError:
        self.failed = error
        return error

    def shutdown(self) -> None:
        """Stop the workers (kill those that do not stop in time), destroy the process groups; idempotent."""
        if self.closed:
            return
        if self.failed is None and self._dead_worker(0.0) is None:
            try:
                send(Stop(), self.groups, self.timeout_s)
            except (RuntimeError, dist.DistError):
                pass  # a worker went away meanwhile: it is killed below
        self.closed = True
        _stop_processes(self.processes, GRACE_S if self.failed is None else 0.0)
        destroy_groups()
        if self._rendezvous_dir:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
        atexit.unregister(self.shutdown)


def _wait_ready(processes: list, ready, budget_s: float) -> None:
    """Wait until every spawned worker reported ready; a WorkerError if one exits first or the budget runs out."""
    deadline, pending = time.monotonic() + budget_s, set(range(1, len(processes) + 1))
    while pending:
        for rank, p in enumerate(processes, start=1):
            if p.exitcode is not None:
                raise WorkerError(f"tensor-parallel worker rank {rank} exited with code {p.exitcode} at start-up", rank)
        if time.monotonic() > deadline:
            raise WorkerError(f"tensor-parallel workers {sorted(pending)} not ready within {budget_s} s", min(pending))
        try:
            pending.discard(ready.get(timeout=0.1))
        except queue.Empty:
            pass


def _stop_processes(processes: list, grace_s: float) -> None:
    """Join each process within ``grace_s`` (shared), kill what is left, and reap it."""
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()

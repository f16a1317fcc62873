"""The tensor-parallel layout: which rank holds which heads and rows, and the process groups.

A :class:`TPShard` says where a model shard sits (``rank`` of ``size``). Query heads, the
MLP's intermediate rows and the vocabulary are split into ``size`` equal parts; KV heads too
when there are at least ``size`` of them, else each KV head is replicated on
``size // num_kv_heads`` consecutive ranks (the ranks whose query heads read it). With
``size == 1`` nothing is split and no collective runs: the single-device path is unchanged.

Collectives go through :func:`all_reduce` and :func:`all_gather_last`, which time themselves
into :data:`COMM` (the benchmark reports it per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from paged_kv.errors import InvalidArgumentError, check_int, describe


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of a tensor-parallel group of ``size`` ranks (``TPShard()``: no parallelism)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        check_int("size", self.size, low=1, high=1 << 12)
        check_int("rank", self.rank, low=0, high=self.size - 1)

    def split(self, total: int, name: str) -> tuple[int, int]:
        """[start, end) of this rank's equal part of ``total`` rows (a typed error unless ``size`` divides it)."""
        if total % self.size:
            raise InvalidArgumentError(describe(name, total, f"a multiple of tensor_parallel_size={self.size}"))
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def kv_heads(self, num_kv_heads: int, num_heads: int) -> tuple[int, int]:
        """[start, end) of the KV heads this rank holds (one replicated head when ``num_kv_heads < size``)."""
        self.split(num_heads, "num_heads")
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "num_kv_heads")
        if self.size % num_kv_heads:
            raise InvalidArgumentError(
                describe("num_kv_heads", num_kv_heads, f"a divisor or multiple of tensor_parallel_size={self.size}")
            )
        head = self.rank // (self.size // num_kv_heads)  # the KV head this rank's query heads read
        return head, head + 1

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of this rank's vocabulary rows; the part is ceil(vocab / size), the last rank's padded."""
        part = -(-vocab_size // self.size)
        return self.rank * part, (self.rank + 1) * part


@dataclass
class CommStats:
    """Seconds and bytes spent in the model's collectives in this process (reset by the benchmark)."""

    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0
    by_op: dict[str, float] = field(default_factory=dict)

    def add(self, op: str, seconds: float, nbytes: int) -> None:
        """Count one collective."""
        self.seconds += seconds
        self.bytes += nbytes
        self.calls += 1
        self.by_op[op] = self.by_op.get(op, 0.0) + seconds

    def reset(self) -> None:
        """Start counting from zero."""
        self.seconds, self.bytes, self.calls, self.by_op = 0.0, 0, 0, {}


COMM = CommStats()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group in place (every rank calls it, in the same order)."""
    start = time.perf_counter()
    dist.all_reduce(x, group=_MODEL_GROUP)
    COMM.add("all_reduce", time.perf_counter() - start, x.numel() * x.element_size())
    return x


def all_gather_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` ``[R, n]`` along the last dimension -> ``[R, size * n]``."""
    start = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=_MODEL_GROUP)
    COMM.add("all_gather", time.perf_counter() - start, x.numel() * x.element_size() * size)
    return torch.cat(parts, dim=-1)


_MODEL_GROUP: dist.ProcessGroup | None = None  # the model's collectives (set by init_groups)


@dataclass(frozen=True)
class Groups:
    """The process groups of one tensor-parallel run."""

    shard: TPShard
    control: dist.ProcessGroup  # gloo, the default group: step payloads; waits as long as the driver idles
    model: dist.ProcessGroup  # gloo or NCCL: the model's collectives, bounded by the step timeout


def backend_for(device: torch.device) -> str:
    """NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_groups(
    *, rank: int, size: int, device: torch.device, timeout_s: float, init_method: str = "env://",
    idle_timeout_s: float = 7 * 24 * 3600.0,
) -> Groups:  # fmt: skip
    """Join the default gloo group (control messages) and create the model's group (timeout ``timeout_s``)."""
    global _MODEL_GROUP
    if dist.is_initialized():
        raise InvalidArgumentError(describe("torch.distributed", "already initialized", "one tensor-parallel engine"))
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=idle_timeout_s)
    )
    _MODEL_GROUP = dist.new_group(backend=backend_for(device), timeout=timedelta(seconds=timeout_s))
    return Groups(TPShard(rank, size), dist.group.WORLD, _MODEL_GROUP)


def destroy_groups() -> None:
    """Destroy every process group of this process (a no-op when there is none)."""
    global _MODEL_GROUP
    _MODEL_GROUP = None
    if dist.is_initialized():
        dist.destroy_process_group()

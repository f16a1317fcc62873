"""Host cost of the serving hot path: prepared vs checked kernel calls, and building a step's inputs.

Two side-by-side measurements, each printed with its ratio:

1. ``paged_decode_attention`` per call, checked (validates device tensors: reads bounds back)
   vs prepared (host-validated :class:`~kernels.AttentionMetadata`), and the engine's per-layer call:
   the prepared call bound once per step (``bind_decode_attention``), then run on each layer. On
   CUDA the kernels run and the host time per call is measured over a queue of calls; on the CPU the
   launches are stubbed, so the figure is the wrappers' own Python work. Either way the clock times
   the host's work up to the last call's return, not the kernels.
2. Building a decode step's device inputs at batch 64 and 256 (~1k tokens each): the engine's
   :class:`~scheduler.runner.step_input.StepInputBuilder` (persistent tables, numpy, one upload) vs
   rebuilding every table from lists per step (the engine's previous ``pack_step``).

Run: ``python benchmarks/bench_hot_path.py [--device cuda]``.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from dataclasses import replace
from unittest import mock

import torch
import triton
import triton.language as tl
from bench_engine_gpu import cprofile_top  # benchmarks/, the script's directory, is on sys.path

import kernels.decode_attention as dec
from kernels import paged_decode_attention, paged_decode_attention_prepared, prepare_attention_metadata
from paged_kv import BlockManager, BlockManagerConfig
from scheduler.core.params import SamplingParams
from scheduler.core.scheduler_output import ScheduledSeq, SchedulerOutput
from scheduler.core.sequence import Sequence, SequenceGroup
from scheduler.runner.step_input import StepInputBuilder


def _best_us(fn, repeat: int, rounds: int = 5, sync=lambda: None) -> float:
    """Best mean host microseconds per call of ``fn`` over ``rounds`` rounds of ``repeat`` calls.

    The clock stops when the last call returns, before ``sync``: on CUDA it times the host's
    enqueueing, not the kernels (``repeat`` calls stay well inside the launch queue's depth).
    """
    best = float("inf")
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        elapsed = time.perf_counter() - start
        sync()
        best = min(best, elapsed / repeat * 1e6)
    return best


def decode_inputs(device: torch.device, batch: int, context: int):
    """(q, k_cache, v_cache, metadata) of a decode step: Hq 32, Hkv 8, D 128, block 16; bf16 on CUDA, else float32."""
    bs, hkv, dtype = 16, 8, torch.bfloat16 if device.type == "cuda" else torch.float32
    per_seq = context // bs
    k = torch.randn(batch * per_seq + 1, bs, hkv, 128, dtype=dtype, device=device)  # block 0 unused
    v = torch.randn_like(k)
    q = torch.randn(batch, 32, 128, dtype=dtype, device=device)
    tables = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(batch)]
    meta = prepare_attention_metadata(tables, [context - 1] * batch, [1] * batch, block_size=bs,
                                      num_blocks=k.shape[0], device=device)  # fmt: skip
    return q, k, v, meta


def bench_decode_call(device: torch.device, batch: int = 1, context: int = 1024) -> tuple[float, float, float]:
    """(checked, prepared, bound) host microseconds per decode call on :func:`decode_inputs`."""
    q, k, v, meta = decode_inputs(device, batch, context)
    args = (q, k, v, meta.block_tables, meta.seq_lens)
    backend = "triton" if device.type == "cuda" else "torch"
    stub = mock.patch.object(dec, "_decode_torch", lambda *a, **kw: (q, None))  # the wrappers' own work only
    with nullcontext() if device.type == "cuda" else stub:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        checked = _best_us(lambda: paged_decode_attention(*args, backend=backend), 200, sync=sync)
        prepared = _best_us(lambda: paged_decode_attention_prepared(q, k, v, meta, backend=backend), 200, sync=sync)
        bound = dec.bind_decode_attention(q, k, v, meta, backend=backend)  # once per step
        per_layer = _best_us(lambda: bound(q, k, v, None, None), 200, sync=sync)
    return checked, prepared, per_layer


@triton.jit
def _touch_kernel(x_ptr, n, K0: tl.constexpr, K1: tl.constexpr):
    """Adds 1 to x[0]: the least work a launch can do (its host cost is Triton's launch path alone)."""
    tl.store(x_ptr, tl.load(x_ptr) + n * 0 + K0 - K1 + 1)


def bench_launch_floor(device: torch.device) -> float:
    """Host microseconds of one launch of a trivial Triton kernel with 2 arguments and 2 constexprs (CUDA only)."""
    x = torch.zeros(1, device=device)
    sync = torch.cuda.synchronize
    return _best_us(lambda: _touch_kernel[(1,)](x, 7, K0=2, K1=2), 200, sync=sync)


def profile_bound(device: torch.device, batch: int = 1, context: int = 1024, top: int = 12) -> str:
    """cProfile of 200 calls of the bound per-layer decode (CUDA): the host functions by own time."""
    q, k, v, meta = decode_inputs(device, batch, context)
    bound = dec.bind_decode_attention(q, k, v, meta, backend="triton")
    bound(q, k, v, None, None)
    torch.cuda.synchronize()
    report = cprofile_top(lambda: [bound(q, k, v, None, None) for _ in range(200)], top)
    torch.cuda.synchronize()
    return report


def _decode_step(batch: int, context: int, bs: int = 16) -> tuple[BlockManager, SchedulerOutput]:
    """A block manager holding ``batch`` sequences of ``context`` tokens, and a decode step over them.

    The step carries the manager's journal (every table is new); a later decode step of the same
    sequences whose tokens land in blocks they hold carries none.
    """
    config = BlockManagerConfig(num_blocks=batch * (context // bs + 2), block_size=bs, watermark=0.0)
    bm = BlockManager(config, track_changes=True)
    group = SequenceGroup("g", [], SamplingParams())
    scheduled = []
    for s in range(batch):
        seq = Sequence(s, s, [s] * context)
        bm.allocate(s, seq.token_ids)
        seq.num_computed = context - 1
        scheduled.append(ScheduledSeq(seq, group, context - 1, 1))
    return bm, SchedulerOutput(scheduled, [], [], [], [], bm.take_table_changes())


def list_rebuild_pack(out: SchedulerOutput, bm: BlockManager, device: torch.device):
    """The previous per-step packing: every table copied from the block manager and padded into a new tensor."""
    items = out.scheduled
    ids = [t for s in items for t in s.seq.token_ids[s.start : s.start + s.num_tokens]]
    tables = [bm.block_table(s.seq.seq_id) for s in items]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # [S, W]
    starts = torch.tensor([s.start for s in items])
    counts = torch.tensor([s.num_tokens for s in items])
    seq_of_row = torch.repeat_interleave(torch.arange(len(items)), counts)  # [T]
    pos = starts[seq_of_row] + torch.arange(len(ids)) - torch.cumsum(counts, 0)[seq_of_row] + counts[seq_of_row]
    slots = padded[seq_of_row, pos // bm.block_size].long() * bm.block_size + pos % bm.block_size
    cu = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)
    tensors = (padded, (starts + counts).to(torch.int32), cu, slots, torch.tensor(ids))
    return [t.to(device) for t in tensors]


def bench_build(device: torch.device, batch: int, context: int = 1024) -> tuple[float, float]:
    """(list rebuild, StepInputBuilder) host microseconds per decode step."""
    bm, out = _decode_step(batch, context)
    builder = StepInputBuilder(bm.block_size, bm.config.num_blocks, device, max_blocks_per_seq=context // 16 + 2)
    builder.build(out)  # first step: every row is new
    steady = replace(out, table_changes=[])  # the next decode steps: no table changed
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rebuild = _best_us(lambda: list_rebuild_pack(out, bm, device), 20, sync=sync)
    built = _best_us(lambda: builder.build(steady), 20, sync=sync)
    return rebuild, built


def main() -> None:
    """Print both tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    print("\n| decode call, host us | checked | prepared | bound, per layer | checked / prepared | prepared / bound |")
    print("|---|---:|---:|---:|---:|---:|")
    for batch, context in ((1, 1024), (64, 2048)):
        checked, prepared, bound = bench_decode_call(device, batch, context)
        ratios = f"{checked / prepared:.2f}x | {prepared / bound:.2f}x"
        print(f"| batch {batch} x {context} | {checked:.1f} | {prepared:.1f} | {bound:.1f} | {ratios} |")
    if device.type == "cuda":
        floor = bench_launch_floor(device)
        print(f"\none launch of a trivial Triton kernel (triton {triton.__version__}): {floor:.1f} us")
        print(f"\nhost profile of the bound decode call, batch 1 x 1024, 200 calls:\n{profile_bound(device)}")
    print("\n| decode step inputs, host us | rebuild from lists | StepInputBuilder | ratio |\n|---|---:|---:|---:|")
    for batch in (64, 256):
        rebuild, built = bench_build(device, batch)
        print(f"| batch {batch} x 1024 tokens | {rebuild:.0f} | {built:.0f} | {rebuild / built:.2f}x |")


if __name__ == "__main__":
    main()

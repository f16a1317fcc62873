"""Blocks moved by swap preemption for forked groups: group-aware swap against one sequence at a time.

A tiny random Llama (ours; 2 layers, hidden 64; the block traffic does not depend on the weights) serves,
under a GPU pool too small for all requests at once and ``preemption_mode="swap"``:
beam search of width 4, and sampling with ``n = 4``. Each workload runs twice in the same process:
with the scheduler's group swap (``swap_out`` / ``swap_in`` of the group: each block a group shares
moves once and stays shared) and with the earlier behaviour (one ``swap_out`` / ``swap_in`` per
sequence, shared blocks counted and copied per sequence), restored by patching the manager. The
outputs must be identical; printed are the engine steps, the swap preemptions, the blocks copied
each way (in all and per preemption), and the GPU blocks a swapped group held before swap-out and
after swap-in (means). A first line swaps the issue's example alone: a 4-beam group sharing 43 blocks.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_swap_groups.py
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from paged_kv import BlockManager, BlockManagerConfig  # noqa: E402
from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from scheduler.engine.beam_search import BeamSearch, BeamSearchParams  # noqa: E402
from scheduler.model.llama import LlamaModel, ModelConfig  # noqa: E402

VOCAB = 256
BLOCK_SIZE = 16
GPU_BLOCKS = 96
CPU_BLOCKS = 1024
NUM_PROMPTS = 12
MAX_TOKENS = 64
WIDTH = 4


@dataclass
class SwapLog:
    """Blocks copied each way, and the distinct blocks each group held at swap-out and after swap-in."""

    out_blocks: int = 0
    in_blocks: int = 0
    held_before: list[int] = field(default_factory=list)
    held_after: list[int] = field(default_factory=list)


def tiny_llama() -> LlamaModel:
    """Our Llama with seeded random weights, float32: 2 layers, hidden 64, 4 heads, 2 KV heads."""
    torch.manual_seed(0)
    return LlamaModel(ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024))


def make_engine(model: LlamaModel) -> LLMEngine:
    """An engine whose GPU pool holds about two requests' groups, with a roomy CPU pool."""
    cache = CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=GPU_BLOCKS, num_cpu_blocks=CPU_BLOCKS, watermark=0.0)
    sched = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, preemption_mode="swap")
    return LLMEngine(model, EngineConfig(cache=cache, scheduler=sched, device="cpu"))


def per_sequence(bm: BlockManager) -> None:
    """Make the group calls behave as the scheduler's swaps did before: one sequence at a time."""
    tables = lambda ids: sum(len(bm.block_table(i)) for i in ids)  # noqa: E731  (shared blocks counted per sequence)
    bm.can_swap_out = lambda ids: tables(ids) <= bm.cpu.num_free
    bm.can_swap_in = lambda ids: bm.gpu.num_free - tables(ids) >= bm.config.watermark_blocks
    bm.swap_out = lambda ids: [c for i in ids for c in BlockManager.swap_out(bm, [i])]
    bm.swap_in = lambda ids: [c for i in ids for c in BlockManager.swap_in(bm, [i])]


def logged(bm: BlockManager) -> SwapLog:
    """Record every swap the scheduler makes through ``bm``'s group calls."""
    log, swap_out, swap_in = SwapLog(), bm.swap_out, bm.swap_in

    def out(ids):
        log.held_before.append(distinct_blocks(bm, ids))
        copies = swap_out(ids)
        log.out_blocks += len(copies)
        return copies

    def back(ids):
        copies = swap_in(ids)
        log.in_blocks += len(copies)
        log.held_after.append(distinct_blocks(bm, ids))
        return copies

    bm.swap_out, bm.swap_in = out, back
    return log


def distinct_blocks(bm: BlockManager, ids: list[int]) -> int:
    """Blocks the sequences hold together, each shared block counted once."""
    return len({b for i in ids for b in bm.block_table(i)})


def prompts() -> list[list[int]]:
    """NUM_PROMPTS seeded prompts of 100-300 tokens."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(100, 300, (NUM_PROMPTS,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def shared_group_example(grouped: bool) -> tuple[int, int, int]:
    """Blocks copied out, copied back, and held after, for a prompt of 43 blocks forked into 4 beams."""
    bm = BlockManager(BlockManagerConfig(num_blocks=256, block_size=BLOCK_SIZE, num_cpu_blocks=256, watermark=0.0))
    bm.allocate(0, list(range(43 * BLOCK_SIZE)))
    for child in range(1, WIDTH):
        bm.fork(0, child)
    if not grouped:
        per_sequence(bm)
    ids = list(range(WIDTH))
    out, back = len(bm.swap_out(ids)), len(bm.swap_in(ids))
    return out, back, distinct_blocks(bm, ids)


def run(model: LlamaModel, workload: str, grouped: bool) -> tuple[list, SwapLog, int, int]:
    """Outputs, swap log, swap preemptions and steps of one workload with group or per-sequence swaps."""
    engine = make_engine(model)
    if not grouped:
        per_sequence(engine.block_manager)
    log = logged(engine.block_manager)
    steps, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(1) or schedule()
    if workload == "beam":
        outs = BeamSearch(engine).generate(prompts(), BeamSearchParams(width=WIDTH, max_tokens=MAX_TOKENS,
                                                                       ignore_eos=True))  # fmt: skip
        tokens = [[h.token_ids for h in o.hypotheses] for o in outs]
    else:
        params = SamplingParams(n=WIDTH, max_tokens=MAX_TOKENS, temperature=1.0, seed=0, ignore_eos=True)
        tokens = [[c.token_ids for c in o.outputs] for o in engine.generate(prompts(), params, use_tqdm=False)]
    assert engine.block_manager.stats().num_used == 0 and engine.block_manager.cpu.num_used == 0
    return tokens, log, engine.scheduler.num_preemptions["swap"], len(steps)


def main() -> None:
    """Print, per workload, the blocks moved by per-sequence swaps and by group swaps."""
    torch.set_num_threads(1)
    model = tiny_llama()
    print(f"GPU pool {GPU_BLOCKS} blocks of {BLOCK_SIZE} tokens, {NUM_PROMPTS} prompts of 100-300 tokens, "
          f"{MAX_TOKENS} new tokens, width / n = {WIDTH}")  # fmt: skip
    for grouped in (False, True):
        out, back, held = shared_group_example(grouped)
        print(f"4 beams sharing 43 blocks, {'group' if grouped else 'per-sequence'} swap: "
              f"{out} blocks out, {back} in, {held} held after")  # fmt: skip
    print(f"{'workload':<8} {'swaps':<12} {'steps':>5} {'preemptions':>11} {'blocks out':>10} {'blocks in':>9} "
          f"{'per preemption':>14} {'held at swap-out':>16} {'held after swap-in':>18}")  # fmt: skip
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    for workload in ("beam", "n=4"):
        results = {grouped: run(model, workload, grouped) for grouped in (False, True)}
        assert results[False][0] == results[True][0], "group swap changed the outputs"
        for grouped, (_, log, preemptions, steps) in results.items():
            name = "group" if grouped else "per-sequence"
            print(f"{workload:<8} {name:<12} {steps:>5} {preemptions:>11} {log.out_blocks:>10} {log.in_blocks:>9} "
                  f"{log.out_blocks / max(1, preemptions):>14.1f} {mean(log.held_before):>16.1f} "
                  f"{mean(log.held_after):>18.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

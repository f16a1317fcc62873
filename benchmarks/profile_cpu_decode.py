"""Time and profile the CPU engine's decode step: SmolLM2, 16 sequences of ~250 tokens, 1 thread.

16 random prompts of ``--prompt-len`` tokens are prefilled and decoded (greedy, ignore_eos)
until each holds about ``--context`` tokens; then ``--steps`` decode steps (``engine.step()``,
one new token for each of the 16 sequences) are timed one by one (wall and process CPU time, whose median
and best are printed with the load average), with ``--by-function`` the CPU time per step of the
model's main parts (attention, MLP, norms, rotary, cache writes), then a torch.profiler table of
``--profile-steps`` more steps.

    PYTHONPATH=. .venv/bin/python benchmarks/profile_cpu_decode.py [--steps 20] [--profile-steps 5]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from scheduler.model.loader import load_smollm2  # noqa: E402


def warm_engine(num_seqs: int, prompt_len: int, context: int, budget: int, seed: int) -> LLMEngine:
    """An engine whose ``num_seqs`` sequences are all decoding and hold ``context`` tokens."""
    hf, _ = load_smollm2()
    config = EngineConfig(
        cache=CacheConfig(block_size=16, num_gpu_blocks=2 * num_seqs * (context + budget) // 16),
        scheduler=SchedulerConfig(max_num_seqs=num_seqs), device="cpu",
    )  # fmt: skip
    engine = LLMEngine.from_hf(hf, config)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=context - prompt_len + budget, ignore_eos=True)
    for i in range(num_seqs):
        prompt = torch.randint(100, hf.config.vocab_size, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, params)
    while _shortest(engine, num_seqs) < context:
        if not engine.has_unfinished_requests():
            raise RuntimeError("every request finished before reaching the context length")
        engine.step()
    return engine


# (module, attribute) timed by --by-function; a name missing from the checkout is skipped
TIMED = [
    ("scheduler.model.llama", "LlamaModel.forward"),
    ("scheduler.model.llama", "MLP.forward"),
    ("scheduler.model.llama", "RMSNorm.forward"),
    ("scheduler.model.rope", "RotaryEmbedding.cos_sin"),
    ("scheduler.model.llama", "rotate"),
    ("paged_kv.kv_cache", "PagedKVCache.write"),
    ("scheduler.model.attention", "paged_decode_attention"),
    ("kernels.decode_attention", "_validate_decode"),
    ("kernels.decode_attention", "_decode_torch"),
]


def time_functions(counter: collections.Counter) -> None:
    """Wrap each TIMED function so that its process CPU seconds add up in ``counter``."""
    for module_name, path in TIMED:
        owner = importlib.import_module(module_name)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        if getattr(owner, name, None) is None:
            continue
        setattr(owner, name, _timed(getattr(owner, name), f"{module_name}.{path}", counter))


def _timed(fn, label: str, counter: collections.Counter):
    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            counter[label] += time.process_time() - start

    return wrapper


def _shortest(engine: LLMEngine, num_seqs: int) -> int:
    """Tokens of the shortest running sequence (0 until all ``num_seqs`` run)."""
    running = engine.scheduler.running  # re-read: the scheduler rebuilds the list
    if len(running) < num_seqs:
        return 0
    return min(len(s.token_ids) for g in running for s in g.seqs)


def time_steps(engine: LLMEngine, steps: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (this process) milliseconds of each of ``steps`` engine steps."""
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.step()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return wall, cpu


def main() -> None:
    """Parse options, warm the engine, print step times and the profile table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--context", type=int, default=250)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=15, help="rows of the profiler table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--by-function", action="store_true", help="CPU ms per step of the model's main parts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spent: collections.Counter = collections.Counter()
    if args.by_function:
        time_functions(spent)
    budget = args.steps + args.profile_steps + 4
    engine = warm_engine(args.num_seqs, args.prompt_len, args.context, budget, args.seed)
    time_steps(engine, 2)  # warm-up
    spent.clear()
    wall, cpu = time_steps(engine, args.steps)
    print(f"decode step, {args.num_seqs} seqs at ~{args.context} tokens, {args.threads} thread(s), "
          f"{args.steps} steps: wall median {statistics.median(wall):.1f} ms (best {min(wall):.1f}), "
          f"CPU median {statistics.median(cpu):.1f} ms (best {min(cpu):.1f}); "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    for label, seconds in spent.most_common():
        print(f"  {label:48s} {seconds / args.steps * 1e3:7.1f} ms CPU per step")
    if args.profile_steps:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            time_steps(engine, args.profile_steps)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()

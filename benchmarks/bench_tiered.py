"""The tiered prefix cache on a multi-round chat: no tier, host tier, host + disk, and a restart.

The workload is LMCache's multi-round QA in small: ``--users`` users share a system prompt,
and each has their own document (the user-specific context of LMCache's benchmark) in the
first round; in each of ``--rounds`` rounds every user sends their whole history plus a new
question (random token ids) at once, and the greedy answer (``--answer`` tokens, EOS
ignored) joins the history. The device pool holds about a quarter of the final working set (all users'
histories), so without a tier most of each history is recomputed every round. The three
modes run in one process on the same prompts, and their answers must be identical.

Restart: after the host + disk run the engine shuts down (its cached device blocks spill to
disk); a fresh engine on the same directory serves each returning user's next question, and
so does a cold engine without tiers: TTFT side by side, and the share of the history the
disk served. On CUDA, also the host -> device load bandwidth against a plain pinned copy.

    .venv/bin/python benchmarks/bench_tiered.py [--users 8] [--rounds 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scheduler import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig  # noqa: E402
from scheduler.entrypoints.llm import LLM  # noqa: E402
from scheduler.model.loader import LoadedModel, load_smollm2  # noqa: E402

BLOCK = 16
SYSTEM, DOCUMENT, QUESTION = 256, 512, 32  # tokens


def workload(users: int, rounds: int, seed: int = 0) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and, per round, each user's new turn (random ids of the middle vocabulary): in the
    first round their document and a question, then a question."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731
    turns = [[ids((DOCUMENT if r == 0 else 0) + QUESTION) for _ in range(users)] for r in range(rounds + 1)]
    return ids(SYSTEM), turns


def engine(loaded: LoadedModel, device_blocks: int, host_bytes: int = 0, disk: str | None = None) -> LLM:
    """An engine whose device pool holds ``device_blocks``, with the tiers asked for."""
    cache = CacheConfig(block_size=BLOCK, num_gpu_blocks=device_blocks, watermark=0.0, kv_offloading_bytes=host_bytes,
                        kv_disk_dir=disk, kv_disk_bytes=(4 << 30) if disk else 0)  # fmt: skip
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024)
    return LLM(loaded, engine_config=EngineConfig(cache=cache, scheduler=sched, device="cpu"))


def serve_round(llm: LLM, prompts: list[list[int]], answer: int) -> tuple[list[list[int]], list[float], list[int]]:
    """All prompts at once: (answers, TTFT seconds, cached tokens) per prompt."""
    outs = llm.engine.generate(prompts, SamplingParams(max_tokens=answer, ignore_eos=True), use_tqdm=False)
    answers = [o.outputs[0].token_ids for o in outs]
    return answers, [o.first_token_time - o.arrival_time for o in outs], [o.num_cached_tokens for o in outs]


def chat(llm: LLM, system: list[int], questions: list[list[list[int]]], answer: int, rounds: int) -> dict:
    """Run the rounds; the figures of the run and the users' histories at its end."""
    histories = [list(system) for _ in questions[0]]
    ttft, cached, prompt_tokens, answers = [], 0, 0, []
    start = time.perf_counter()
    for r in range(rounds):
        prompts = [h + q for h, q in zip(histories, questions[r])]
        outs, times, hits = serve_round(llm, prompts, answer)
        histories = [p + a for p, a in zip(prompts, outs)]
        ttft += times
        cached += sum(hits)
        prompt_tokens += sum(map(len, prompts))
        answers.append(outs)
    wall = time.perf_counter() - start
    stats = llm.engine.block_manager.stats()
    return {"ttft": ttft, "wall": wall, "tokens": rounds * len(histories) * answer, "answers": answers,
            "hit": cached / prompt_tokens, "host_hit": stats.num_host_hit_tokens / prompt_tokens,
            "disk_hit": stats.num_lower_hit_tokens / prompt_tokens, "histories": histories}  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf, tokenizer = load_smollm2()
    loaded = LoadedModel(hf, tokenizer, "SmolLM2")
    system, questions = workload(args.users, args.rounds)
    final = SYSTEM + DOCUMENT + args.rounds * (QUESTION + args.answer)
    working_set = args.users * -(-final // BLOCK)
    device_blocks = max(working_set // 4, -(-(final + args.answer) // BLOCK) * 2)
    print(f"machine: {platform.machine()} {platform.processor()}, torch {torch.__version__}, {args.threads} thread(s)")
    print(f"workload: SmolLM2-135M float32, {args.users} users x {args.rounds} rounds, system prompt {SYSTEM}, "
          f"document {DOCUMENT}, question {QUESTION}, answer {args.answer} tokens; final working set {working_set} "
          f"blocks of {BLOCK}, device pool {device_blocks} blocks")  # fmt: skip
    host_bytes = 1 << 30
    runs, disk_dir = {}, tempfile.mkdtemp(prefix="paged-kv-bench-tiered-")
    for mode, host, disk in (("no tier", 0, None), ("host", host_bytes, None), ("host + disk", host_bytes, disk_dir)):
        llm = engine(loaded, device_blocks, host, disk)
        runs[mode] = chat(llm, system, questions, args.answer, args.rounds)
        llm.engine.shutdown()
    report(runs)
    histories = runs["host + disk"]["histories"]
    restart(loaded, device_blocks, host_bytes, disk_dir, histories, questions[args.rounds], args.answer)
    if torch.cuda.is_available():
        load_bandwidth()
    else:
        print("host -> device load bandwidth: no CUDA device here (awaiting a GPU)")


def report(runs: dict[str, dict]) -> None:
    """The three modes side by side, against no tier."""
    base = runs["no tier"]
    same = all(r["answers"] == base["answers"] for r in runs.values())
    print(f"greedy answers identical in every mode: {same}")
    print("| mode | TTFT p50 ms | TTFT p99 ms | generated tok/s | hit rate (host, disk) | TTFT p50 / no tier "
          "| tok/s / no tier |\n|---|---:|---:|---:|---|---:|---:|")  # fmt: skip
    for mode, r in runs.items():
        p50, p99, tps = statistics.median(r["ttft"]) * 1e3, percentile(r["ttft"], 0.99) * 1e3, r["tokens"] / r["wall"]
        base_p50, base_tps = statistics.median(base["ttft"]) * 1e3, base["tokens"] / base["wall"]
        print(f"| {mode} | {p50:.0f} | {p99:.0f} | {tps:.2f} | {r['hit']:.3f} ({r['host_hit']:.3f}, "
              f"{r['disk_hit']:.3f}) | {base_p50 / p50:.2f}x lower | {tps / base_tps:.2f}x |")  # fmt: skip


def restart(loaded: LoadedModel, device_blocks: int, host_bytes: int, disk_dir: str, histories: list[list[int]],
            questions: list[list[int]], answer: int) -> None:  # fmt: skip
    """Returning users' next question on a fresh engine over the same disk directory, against a cold engine."""
    prompts = [h + q for h, q in zip(histories, questions)]
    figures = {}
    for mode, disk in (("cold engine", None), ("restarted, same disk", disk_dir)):
        llm = engine(loaded, device_blocks, host_bytes if disk else 0, disk)
        start = time.perf_counter()
        outs, ttft, cached = serve_round(llm, prompts, answer)
        wall = time.perf_counter() - start
        figures[mode] = (outs, ttft, wall, sum(cached) / sum(len(h) for h in histories))
        llm.engine.shutdown()
    fresh = [h + q[::-1] for h, q in zip(histories, questions)]  # another question: only the history is on disk
    one_by_one(loaded, device_blocks, host_bytes, disk_dir, fresh, answer)
    (cold, t_cold, w_cold, c_cold), (warm, t_warm, w_warm, c_warm) = figures.values()
    print(f"restart: {len(prompts)} returning users, histories {sum(map(len, histories))} tokens; "
          f"answers identical: {cold == warm}")
    # an empty engine: every cached token of the restarted one came from disk (through the host tier), the
    # cold one's only from the other users' shared system prompt computed in the same round
    print("| engine | TTFT p50 ms | TTFT p99 ms | round wall s | history found cached |\n|---|---:|---:|---:|---:|")
    print(f"| cold | {statistics.median(t_cold) * 1e3:.0f} | {percentile(t_cold, 0.99) * 1e3:.0f} | {w_cold:.2f} "
          f"| {c_cold:.3f} |")  # fmt: skip
    print(f"| restarted | {statistics.median(t_warm) * 1e3:.0f} | {percentile(t_warm, 0.99) * 1e3:.0f} | {w_warm:.2f} "
          f"| {c_warm:.3f} (disk) |")  # fmt: skip
    print(f"restart: TTFT p50 {statistics.median(t_cold) / statistics.median(t_warm):.2f}x lower than cold")


def one_by_one(loaded: LoadedModel, device_blocks: int, host_bytes: int, disk_dir: str, prompts: list[list[int]],
               answer: int) -> None:  # fmt: skip
    """The same returning users arriving one at a time (no queueing): a cold engine against a fresh one on the disk.

    The disk directory holds their histories (the restart round spilled its own blocks too, but
    these questions are new).
    """
    ttft = {}
    for mode, disk in (("cold", None), ("restarted", disk_dir)):
        llm = engine(loaded, device_blocks, host_bytes if disk else 0, disk)
        ttft[mode] = [serve_round(llm, [p], answer)[1][0] for p in prompts]
        llm.engine.shutdown()
    cold, warm = statistics.median(ttft["cold"]), statistics.median(ttft["restarted"])
    print(f"restart, users one at a time: TTFT p50 cold {cold * 1e3:.0f} ms, restarted {warm * 1e3:.0f} ms: "
          f"{cold / warm:.2f}x lower")


def load_bandwidth(num_blocks: int = 2048, block_bytes: int = 16 * 8 * 128 * 2 * 2 * 32) -> None:
    """CUDA: host -> device block loads through the tier's path against one plain pinned copy of the same bytes."""
    from paged_kv.kv_cache import KVCacheSpec, PagedKVCache
    from scheduler.runner.tier_transfers import TierTransfers

    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    host = PagedKVCache(spec, num_blocks, "cpu", pin_memory=True)
    device = PagedKVCache(spec, num_blocks, "cuda")
    transfers = TierTransfers(device, host, None)
    pairs = [(i, i) for i in range(num_blocks)]
    plain_src = torch.empty(num_blocks * spec.bytes_per_block, dtype=torch.uint8, pin_memory=True)
    plain_dst = torch.empty_like(plain_src, device="cuda")
    for _ in range(2):  # warm up
        transfers._load(pairs)
        plain_dst.copy_(plain_src, non_blocking=True)
    torch.cuda.synchronize()
    timings = {}
    for name, fn in (("tier load", lambda: transfers._load(pairs)),
                     ("plain pinned copy", lambda: plain_dst.copy_(plain_src, non_blocking=True))):  # fmt: skip
        start = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        timings[name] = num_blocks * spec.bytes_per_block * 5 / (time.perf_counter() - start) / 1e9
    print(f"host -> device: tier load {timings['tier load']:.1f} GB/s, plain pinned copy "
          f"{timings['plain pinned copy']:.1f} GB/s, ratio {timings['tier load'] / timings['plain pinned copy']:.2f}")


if __name__ == "__main__":
    main()

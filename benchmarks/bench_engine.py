"""Engine throughput against transformers' static padded batching, and concurrency against contiguous KV.

Same prompts, same machine, one process: a mixed chat workload on SmolLM2-135M-Instruct
(prompts of ~35 or ~300 tokens, half behind one long system prompt; greedy answers that stop
at EOS or at a per-request limit in [max_tokens / 4, max_tokens]).

- Throughput: generated tokens (each request's own answer, cut at EOS / its limit) per second
  of wall time. The engine runs continuous batching with ``max_num_seqs = batch``; the
  baseline runs ``model.generate`` on static batches of ``batch`` left-padded prompts with
  ``max_new_tokens`` = the batch's largest limit. Both greedy, float32, one thread.
- Concurrency: the sequences the engine holds at once in a KV budget of ``4 x 2048`` token
  slots, against the 4 sequences contiguous per-sequence preallocation at ``max_seq_len``
  2048 fits in it. The engine's figure replays the answers of the throughput run through the
  real scheduler and block manager (no model: the block traffic is that of the run), the
  workload queued 8 times over at once and no sequence cap, so the pool is what binds.

    .venv/bin/python benchmarks/bench_engine.py [--num-requests 64] [--batch 16] [--max-tokens 64] [--repeat 2]
    .venv/bin/python -m pytest benchmarks/bench_engine.py --benchmark-only -s

On a GPU, ``--device cuda`` runs the Llama-3.2-1B-shaped benchmark of ``bench_engine_gpu.py``
instead (nano-vllm's workload; the engine, transformers static batching and transformers
continuous batching in one run).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from paged_kv import BlockManager, BlockManagerConfig  # noqa: E402
from scheduler import CacheConfig, EngineConfig, LLMEngine, SchedulerConfig  # noqa: E402
from scheduler.core.scheduler import Scheduler  # noqa: E402
from scheduler.core.scheduler_output import SampledToken  # noqa: E402
from scheduler.entrypoints.workload import chat_workload  # noqa: E402
from scheduler.model.loader import load_smollm2  # noqa: E402

MAX_SEQ_LEN = 2048
BUDGET_SEQS = 4  # the KV budget, in contiguous max_seq_len sequences
BLOCK_SIZE = 16
REPLAY_COPIES = 8  # the concurrency replay queues the workload this many times, so the pool, not the queue, binds


def run_engine(hf, requests, batch: int) -> tuple[float, list[list[int]]]:
    """Wall seconds and answers of the engine serving every request (all queued at once)."""
    cache = CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=BUDGET_SEQS * MAX_SEQ_LEN // BLOCK_SIZE)
    config = EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_seqs=batch), device="cpu")
    engine = LLMEngine.from_hf(hf, config)
    start = time.perf_counter()
    outs = engine.generate([r.prompt_token_ids for r in requests], [r.params for r in requests], use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def run_static(hf, requests, batch: int, eos: int, pad: int) -> tuple[float, list[list[int]]]:
    """Wall seconds and answers of ``generate`` over static left-padded batches of ``batch`` requests."""
    answers = []
    start = time.perf_counter()
    for i in range(0, len(requests), batch):
        group = requests[i : i + batch]
        width = max(len(r.prompt_token_ids) for r in group)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in group])
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in group])
        limit = max(r.params.max_tokens for r in group)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=limit, pad_token_id=pad)
        for r, row in zip(group, out[:, width:].tolist()):
            row = row[: r.params.max_tokens]
            answers.append(row[: row.index(eos) + 1] if eos in row else row)
    return time.perf_counter() - start, answers


def peak_concurrency(requests, answers: list[list[int]], num_blocks: int, eos: int) -> int:
    """Most sequences running at once when the recorded answers replay through scheduler + block manager."""
    bm = BlockManager(BlockManagerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE), track_changes=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=len(requests), max_num_batched_tokens=max(512, len(requests))),
                      bm, eos_token_ids=[eos])  # fmt: skip
    replay = {}  # request id -> the tokens its sequence is given, in order
    for i, (r, answer) in enumerate(zip(requests, answers)):
        replay[sched.add_request(f"{r.request_id}/{i}", r.prompt_token_ids, r.params).request_id] = answer
    peak = 0
    while sched.has_unfinished():
        out = sched.schedule()
        peak = max(peak, sum(len(g.unfinished()) for g in sched.running))
        chosen = [SampledToken(g, s, replay[g.request_id][s.num_outputs], 0.0) for g, s, _ in out.samples]
        sched.update_from_output(out, chosen)
    return peak


def compare(num_requests: int = 64, batch: int = 16, max_tokens: int = 64, seed: int = 0, repeat: int = 1):
    """Run both sides on the same workload (ABBA order over ``repeat`` rounds, best time each); return the figures."""
    torch.set_num_threads(1)
    hf, tokenizer = load_smollm2()
    requests = chat_workload(tokenizer, num_requests, max_tokens, seed=seed)
    eos = hf.generation_config.eos_token_id
    sides = {
        "static": lambda: run_static(hf, requests, batch, eos, tokenizer.pad_token_id or eos),
        "engine": lambda: run_engine(hf, requests, batch),
    }
    runs: dict[str, list] = {"static": [], "engine": []}
    for i in range(repeat):
        for name in ("engine", "static") if i % 2 == 0 else ("static", "engine"):
            runs[name].append(sides[name]())
    static_s, static_answers = min(runs["static"], key=lambda r: r[0])
    engine_s, engine_answers = min(runs["engine"], key=lambda r: r[0])
    engine_tokens = sum(map(len, engine_answers))
    static_tokens = sum(map(len, static_answers))
    budget_blocks = BUDGET_SEQS * MAX_SEQ_LEN // BLOCK_SIZE
    return {
        "requests": num_requests, "batch": batch, "max_tokens": max_tokens,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "engine_s": engine_s, "engine_tokens": engine_tokens, "engine_tok_s": engine_tokens / engine_s,
        "static_s": static_s, "static_tokens": static_tokens, "static_tok_s": static_tokens / static_s,
        "same_answers": sum(a == b for a, b in zip(engine_answers, static_answers)),
        "engine_concurrency": peak_concurrency(requests * REPLAY_COPIES, engine_answers * REPLAY_COPIES, budget_blocks, eos),
        "contiguous_concurrency": BUDGET_SEQS,
    }  # fmt: skip


def report(f: dict[str, float]) -> str:
    """The figures and the target checks, as printed lines."""
    speedup = f["engine_tok_s"] / f["static_tok_s"]
    conc = f["engine_concurrency"] / f["contiguous_concurrency"]
    return "\n".join([
        f"machine: {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, 1 thread",
        f"workload: {f['requests']} chat requests, {f['prompt_tokens']} prompt tokens, max_tokens {f['max_tokens']}, "
        f"batch {f['batch']}",
        f"engine (continuous batching): {f['engine_tokens']} tokens in {f['engine_s']:.1f} s "
        f"= {f['engine_tok_s']:.1f} tok/s",
        f"transformers static batching: {f['static_tokens']} tokens in {f['static_s']:.1f} s "
        f"= {f['static_tok_s']:.1f} tok/s",
        f"speedup: {speedup:.2f}x (target >= 2x: {'met' if speedup >= 2 else 'NOT met'}); "
        f"identical answers: {f['same_answers']}/{f['requests']}",
        f"concurrent sequences in {BUDGET_SEQS * MAX_SEQ_LEN} KV slots: engine {f['engine_concurrency']}, contiguous "
        f"at max_seq_len {MAX_SEQ_LEN}: {f['contiguous_concurrency']} = {conc:.1f}x "
        f"(target >= 3x: {'met' if conc >= 3 else 'NOT met'})",
    ])  # fmt: skip


def test_engine_vs_static_batching(benchmark):
    """pytest-benchmark entry: one round of the whole comparison, figures printed."""
    figures = benchmark.pedantic(compare, rounds=1, iterations=1)
    print("\n" + report(figures))
    benchmark.extra_info.update(figures)


def main() -> None:
    """Command-line entry: the CPU chat benchmark, or with ``--device cuda`` the GPU one."""
    import bench_engine_gpu

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: SmolLM2 chat workload (below); cuda: bench_engine_gpu.py's Llama-3.2-1B benchmark")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    cpu = p.add_argument_group("CPU benchmark (--device cpu)")
    cpu.add_argument("--num-requests", type=int, default=64)
    cpu.add_argument("--batch", type=int, default=16)
    cpu.add_argument("--max-tokens", type=int, default=64)
    cpu.add_argument("--repeat", type=int, default=1, help="rounds of both sides, alternating order; best time each")
    bench_engine_gpu.add_arguments(p)
    args = p.parse_args()
    if (args.workload or ("nano-vllm" if args.device == "cuda" else "chat")) == "nano-vllm":
        bench_engine_gpu.main(args)
    elif args.device != "cpu":
        p.error("the chat workload is the CPU benchmark: use --device cpu")
    else:
        print(report(compare(args.num_requests, args.batch, args.max_tokens, args.seed, args.repeat)))


if __name__ == "__main__":
    main()

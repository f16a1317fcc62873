"""Where the main job's time per output token goes: its serving loop, round after round, steps timed by kind.

Loads SmolLM2 once, then serves the main job's workload (``python -m scheduler``'s defaults) on a
fresh engine per round. Round 1 pays Triton's compilation of each kernel variant at first use;
later rounds reuse the compiled kernels (as a second run of the main job reuses Triton's disk
cache). Each engine step is timed and sorted by kind: decode-only steps (a CUDA graph replay on a
GPU) and steps with a prompt chunk (eager: every kernel launched from Python). Also printed: each
round's TPOT and TTFT from the engine's metrics.

    PYTHONPATH=. python benchmarks/profile_main_job.py --device cuda [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scheduler.entrypoints.main_job import build_engine, parse_args, serve
from scheduler.entrypoints.workload import chat_workload
from scheduler.model.loader import load_smollm2


def serve_timed(engine, requests, arrivals: int) -> dict[str, list[float]]:
    """The main job's ``serve``, with the wall seconds of every step by kind ('decode' or 'prompt')."""
    times, kind = {"decode": [], "prompt": []}, []
    run, step = engine.runner.run, engine.step

    def classify(out):
        decode = all(s.num_tokens == 1 and s.start >= s.seq.prompt_len for s in out.scheduled)
        kind.append("decode" if decode else "prompt")
        return run(out)

    def timed_step():
        kind.clear()
        start = time.perf_counter()
        finished = step()
        if kind:
            times[kind[0]].append(time.perf_counter() - start)
        return finished

    engine.runner.run, engine.step = classify, timed_step
    try:
        serve(engine, requests, arrivals)
    finally:
        del engine.runner.run, engine.step
    return times


def main() -> None:
    """Serve the workload ``--rounds`` times; print each round's step times and latencies."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=16)
    ours = p.parse_args()
    args = parse_args(["--device", ours.device, "--num-requests", str(ours.num_requests)])
    torch.set_num_threads(args.threads or 1)
    hf, tokenizer = load_smollm2()
    requests = chat_workload(tokenizer, args.num_requests, args.max_tokens, seed=args.seed)
    for r in range(1, ours.rounds + 1):
        engine = build_engine(hf, args)
        times = serve_timed(engine, requests, args.arrivals_per_step)
        lines = [line for line in engine.metrics_summary().format().splitlines() if "TPOT" in line]
        parts = [f"{len(v)} {k} steps, median {statistics.median(v) * 1e3:.2f} ms, total {sum(v):.2f} s"
                 for k, v in times.items() if v]  # fmt: skip
        print(f"round {r} ({ours.device}): " + "; ".join(parts) + f" | {' '.join(lines)}", flush=True)
        engine.shutdown()


if __name__ == "__main__":
    main()

"""Tensor parallelism on CPU: the same workload at tp 1 and tp 2 (gloo), with per-step communication time.

Runs a seeded random Llama (float32) through the engine at tensor_parallel_size 1 and 2 and
prints step time, the driver's time in collectives per step (all-reduces, LM-head gather,
step-payload broadcast) and the ratio. Two CPU ranks share the machine's cores, so this
measures the overhead of the protocol, not a speed-up. Then an estimate for GPUs: the bytes a
decode step all-reduces at batch B (2 per layer + the vocab-parallel embedding, plus the
gathered logits) and the NVLink bandwidth that keeps that communication under 10% of an
assumed step time at tp 2/4/8 (a ring all-reduce moves 2(N-1)/N of the bytes per GPU).

    python benchmarks/bench_tp.py
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scheduler import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    LlamaModel,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,  # noqa: E402
)
from scheduler.distributed.parallel_state import COMM  # noqa: E402

# (name, layers, hidden, vocab, assumed decode step ms at batch 64 on one H100, bf16)
GPU_MODELS = [("Llama-3.2-1B", 16, 2048, 128256, 8.0), ("Llama-3.1-8B", 32, 4096, 128256, 20.0)]


def tiny_model(args) -> LlamaModel:
    """A seeded random float32 Llama."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_layers=args.layers, num_heads=8, num_kv_heads=4, head_dim=args.hidden // 8,
                      max_position_embeddings=1024)  # fmt: skip
    model = LlamaModel(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return model.eval()


def run(args, tp: int) -> dict[str, float]:
    """Wall time, steps and the driver's collective time of the workload at ``tp`` ranks."""
    config = EngineConfig(
        cache=CacheConfig(block_size=16, num_gpu_blocks=256), device="cpu", tensor_parallel_size=tp,
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=args.batch),
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.new, ignore_eos=True)
    with LLMEngine(tiny_model(args), config) as engine:
        engine.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
        COMM.reset()
        steps = 0
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        wall = time.perf_counter() - start
    reduces = COMM.by_op.get("all_reduce", 0.0)
    return {"wall": wall, "steps": steps, "comm": COMM.seconds, "reduce": reduces, "calls": COMM.calls,
            "bytes": COMM.bytes, "broadcast": COMM.by_op.get("broadcast", 0.0)}  # fmt: skip


def estimate_table(batch: int) -> None:
    """Per decode step: bytes all-reduced and gathered, and the NVLink bandwidth for <= 10% of the step."""
    print(f"\n| model | tp | all-reduce MB/step (B={batch}) | ring MB per GPU | logits gather MB | "
          "assumed step ms | GB/s for comm <= 10% of step |\n|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for name, layers, hidden, vocab, step_ms in GPU_MODELS:
        reduce_bytes = (2 * layers + 1) * batch * hidden * 2  # bf16 activations, +1: vocab-parallel embedding
        for n in (2, 4, 8):
            ring = reduce_bytes * 2 * (n - 1) / n
            gather = batch * vocab * 4 * (n - 1) / n  # float32 logits, the other ranks' part
            need = (ring + gather) / (0.1 * step_ms / 1e3) / 1e9
            print(f"| {name} | {n} | {reduce_bytes / 1e6:.2f} | {ring / 1e6:.2f} | {gather / 1e6:.2f} | "
                  f"{step_ms:.0f} | {need:.0f} |")  # fmt: skip


def main() -> None:
    """Run tp 1 and tp 2 and print the table, then the GPU estimate."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    args = p.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, float32; batch {args.batch}, "
          f"prompt {args.prompt}, {args.new} new tokens")  # fmt: skip
    res = {tp: run(args, tp) for tp in (1, 2)}
    print("\n| tp | steps | ms/step | comm ms/step (driver) | of which all-reduce | payload broadcast | "
          "collectives/step | KB/step |\n|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for tp, r in res.items():
        s = r["steps"]
        print(f"| {tp} | {s} | {1e3 * r['wall'] / s:.2f} | {1e3 * r['comm'] / s:.2f} | {1e3 * r['reduce'] / s:.2f} | "
              f"{1e3 * r['broadcast'] / s:.2f} | {r['calls'] / s:.1f} | {r['bytes'] / s / 1e3:.1f} |")  # fmt: skip
    one, two = res[1], res[2]
    print(f"\ntp2 / tp1 step time: {two['wall'] / two['steps'] / (one['wall'] / one['steps']):.2f}x; "
          f"communication is {two['comm'] / two['wall']:.0%} of tp2's step time")  # fmt: skip
    estimate_table(64)


if __name__ == "__main__":
    main()

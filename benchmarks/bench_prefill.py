"""Engine prefill of fresh prompts: the dense chunk path against the paged prefill kernel, same run.

Run ``python benchmarks/bench_prefill.py [--shape llama-3.2-1b] [--prompts 8] [--prompt-len 2048]``.
Each round prefills ``prompts`` fresh random prompts (no shared prefix, prefix caching off) and
samples one token, through two engines over the same weights: ``enable_dense_prefill=True``
(fresh sequences attend their own K/V with the probed dense kernel: FlashAttention varlen on
CUDA, the flash CPU op on CPU) and ``False`` (the paged prefill kernel). Rounds alternate and
the best of ``--repeat`` is kept; prints prompt tokens per second of each and the ratio.
On CPU the defaults shrink to the 'tiny' shape so the script runs in seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

from benchmarks.bench_engine_gpu import SHAPES, random_llama  # noqa: E402
from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from scheduler.model.weights import from_hf_model  # noqa: E402


def build(hf, device: torch.device, chunk: bool, args: argparse.Namespace) -> LLMEngine:
    """An engine with room for one round's prompts; the dense chunk path on or off."""
    tokens = args.prompts * (args.prompt_len + 16)
    cache = CacheConfig(block_size=16, num_gpu_blocks=tokens // 16 + 8, enable_prefix_caching=False,
                        enable_dense_prefill=chunk)  # fmt: skip
    sched = SchedulerConfig(max_num_seqs=args.prompts, max_num_batched_tokens=max(tokens, args.prompts))
    with torch.device(device):
        model = from_hf_model(hf, dtype=hf.dtype)
    return LLMEngine(model, EngineConfig(cache=cache, scheduler=sched, device=str(device), enforce_eager=True))


def prefill_seconds(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Wall time to prefill ``prompts`` and sample one token each (device synchronized)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(prompts, params, use_tqdm=False)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    """Parse arguments, run both engines in alternating rounds, print the table."""
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b" if on_gpu else "tiny")
    p.add_argument("--prompts", type=int, default=8 if on_gpu else 4)
    p.add_argument("--prompt-len", type=int, default=2048 if on_gpu else 512)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    device = torch.device("cuda" if on_gpu else "cpu")
    hf = random_llama(args.shape, device, torch.bfloat16 if on_gpu else torch.float32)
    gen = torch.Generator().manual_seed(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    engines = {name: build(hf, device, name == "dense chunk", args) for name in ("dense chunk", "paged prefill")}
    best = dict.fromkeys(engines, float("inf"))
    for round_ in range(args.repeat + 1):  # round 0 warms up (Triton compiles) and is not kept
        for name, engine in engines.items():
            prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
            seconds = prefill_seconds(engine, prompts)
            best[name] = min(best[name], seconds) if round_ else best[name]
    tokens = args.prompts * args.prompt_len
    print(f"# {args.shape}, {args.prompts} x {args.prompt_len} fresh prompt tokens, {device}, "
          f"dense backend {engines['dense chunk'].model.chunk_backend}")  # fmt: skip
    print("| path | best s | prompt tokens/s |")
    print("|---|---:|---:|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.3f} | {tokens / seconds:,.0f} |")
    print(f"dense chunk / paged prefill throughput: {best['paged prefill'] / best['dense chunk']:.2f}x")


if __name__ == "__main__":
    main()

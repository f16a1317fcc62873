"""n-gram speculative decoding against plain decoding on CPU: the same greedy requests, drafts off and on.

Same prompts, same machine, one process, SmolLM2-135M-Instruct in float32 on one thread. Two workloads:

- copy: requests whose answers copy from their prompt ("repeat this passage", "return this function with the
  typo fixed"), where prompt-lookup drafts are accepted;
- chat: the mixed chat workload of ``bench_engine.py`` (``scheduler.entrypoints.workload.chat_workload``), where
  they mostly are not: what drafting costs when it does not pay.

Each runs with ``speculative_config`` None (the baseline) and with n-gram drafts (``k`` = 3 by default: on a CPU
a step's time grows with every token it runs, drafts included, so a rejected draft is paid in full; 3 keeps that
waste small on the chat workload while a copied answer still gets up to 4 tokens a step). Printed per workload:
generated tokens per second of both, their ratio, the acceptance rate (accepted / drafted tokens), the mean
tokens a verification emits (1 + accepted drafts per drafting sequence-step, vLLM's mean acceptance length) and
the engine steps of both; the answers must be token-identical (greedy: drafts never change a token).

    .venv/bin/python benchmarks/bench_spec_decode.py [--num-requests 16] [--max-tokens 96] [--batch 8] [--k 3]
    .venv/bin/python -m pytest benchmarks/bench_spec_decode.py --benchmark-only -s
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

from scheduler import CacheConfig, EngineConfig, LLMEngine, SchedulerConfig  # noqa: E402
from scheduler.core.params import SamplingParams  # noqa: E402
from scheduler.core.speculative_config import SpeculativeConfig  # noqa: E402
from scheduler.entrypoints.workload import SYSTEM_PROMPT, ChatRequest, chat_workload  # noqa: E402
from scheduler.model.loader import load_smollm2  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 1024  # 16k token slots: no preemption at these sizes, so both sides run the same batches

PASSAGES = [s.strip() + "." for s in SYSTEM_PROMPT.split(".") if len(s.split()) > 12]
CODE = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(vaules)\n",
    "def is_even(n):\n    if n % 2 == 0:\n        return True\n    else:\n        retrun False\n",
    "def greet(name):\n    message = 'Hello, ' + name + '!'\n    print(mesage)\n    return message\n",
    "def largest(items):\n    best = items[0]\n    for item in items:\n        if item > best:\n"
    "            bset = item\n    return best\n",
]
COPY_TEMPLATES = [
    lambda i: f"Repeat the following text exactly, word for word:\n\n{PASSAGES[i % len(PASSAGES)]}",
    lambda i: f"Fix the typo in this Python function and return the whole corrected function:\n\n{CODE[i % len(CODE)]}",
    lambda i: f"Copy this sentence and then copy it once more:\n\n{PASSAGES[(i + 3) % len(PASSAGES)]}",
]


def copy_workload(tokenizer, num_requests: int, max_tokens: int) -> list[ChatRequest]:
    """``num_requests`` greedy requests whose answers copy from their prompts, ``max_tokens`` each (or EOS)."""
    requests = []
    for i in range(num_requests):
        messages = [{"role": "user", "content": COPY_TEMPLATES[i % len(COPY_TEMPLATES)](i)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        requests.append(ChatRequest(f"copy-{i}", messages, ids, SamplingParams(max_tokens=max_tokens)))
    return requests


def run(hf, requests: list[ChatRequest], batch: int, spec: SpeculativeConfig | None) -> dict:
    """Wall seconds, answers, engine steps and (with drafts) the spec-decode counters of one engine run."""
    cache = CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS)
    config = EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_seqs=batch), device="cpu",
                          speculative_config=spec)  # fmt: skip
    engine = LLMEngine.from_hf(hf, config)
    start = time.perf_counter()
    outs = engine.generate([r.prompt_token_ids for r in requests], [r.params for r in requests], use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = engine.spec.stats.copy() if engine.spec is not None else None
    return {"s": seconds, "answers": [o.outputs[0].token_ids for o in outs], "steps": len(engine.metrics.steps),
            "stats": stats}  # fmt: skip


def compare_workload(hf, requests: list[ChatRequest], batch: int, spec: SpeculativeConfig, repeat: int) -> dict:
    """Both sides on one workload (ABBA order over ``repeat`` rounds, best time each); the figures."""
    assert all(r.params.greedy for r in requests), "the outputs are compared token for token: greedy only"
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for i in range(repeat):
        for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
            runs[name].append(run(hf, requests, batch, spec if name == "on" else None))
    off, on = (min(runs[name], key=lambda r: r["s"]) for name in ("off", "on"))
    assert on["answers"] == off["answers"], "greedy answers differ with drafts"
    tokens, stats = sum(map(len, off["answers"])), on["stats"]
    return {
        "requests": len(requests), "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests), "tokens": tokens,
        "off_s": off["s"], "on_s": on["s"], "off_tok_s": tokens / off["s"], "on_tok_s": tokens / on["s"],
        "off_steps": off["steps"], "on_steps": on["steps"], "acceptance_rate": stats.acceptance_rate,
        "draft_tokens": stats.num_draft_tokens, "accepted_tokens": stats.num_accepted_tokens,
        "mean_tokens_per_verification": 1 + stats.num_accepted_tokens / max(1, stats.num_drafts),
    }  # fmt: skip


def compare(num_requests: int = 16, max_tokens: int = 96, batch: int = 8, k: int = 3, lookup_min: int = 2,
            lookup_max: int = 4, repeat: int = 1, seed: int = 0) -> dict[str, dict]:  # fmt: skip
    """Drafts off and on for the copy and the chat workloads; the figures of each."""
    torch.set_num_threads(1)
    hf, tokenizer = load_smollm2()
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max)
    workloads = {
        "copy": copy_workload(tokenizer, num_requests, max_tokens),
        "chat": chat_workload(tokenizer, num_requests, max_tokens, seed=seed),
    }
    figures = {name: compare_workload(hf, reqs, batch, spec, repeat) for name, reqs in workloads.items()}
    return {"config": {"k": k, "lookup": (lookup_min, lookup_max), "batch": batch, "max_tokens": max_tokens}} | figures


def report(figures: dict[str, dict]) -> str:
    """The figures as printed lines."""
    c = figures["config"]
    lines = [
        f"machine: {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, 1 thread",
        f"n-gram drafts: k {c['k']}, prompt lookup {c['lookup'][0]}..{c['lookup'][1]}; batch {c['batch']}, "
        f"max_tokens {c['max_tokens']}; greedy",
    ]
    for name in ("copy", "chat"):
        f = figures[name]
        lines += [
            f"{name}: {f['requests']} requests, {f['prompt_tokens']} prompt tokens, {f['tokens']} generated tokens "
            f"(identical with and without drafts)",
            f"  drafts off: {f['off_s']:.1f} s = {f['off_tok_s']:.1f} tok/s in {f['off_steps']} steps; "
            f"drafts on: {f['on_s']:.1f} s = {f['on_tok_s']:.1f} tok/s in {f['on_steps']} steps; "
            f"ratio {f['on_tok_s'] / f['off_tok_s']:.2f}x",
            f"  acceptance rate {f['acceptance_rate']:.1%} ({f['accepted_tokens']} of {f['draft_tokens']} drafts); "
            f"mean tokens per verification {f['mean_tokens_per_verification']:.2f}",
        ]  # fmt: skip
    return "\n".join(lines)


def test_spec_decode_vs_plain_decoding(benchmark):
    """pytest-benchmark entry: one round of both workloads, figures printed."""
    figures = benchmark.pedantic(compare, rounds=1, iterations=1)
    print("\n" + report(figures))
    benchmark.extra_info.update(figures)


def main() -> None:
    """Command-line entry."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=16, help="requests of each workload")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=8, help="max_num_seqs")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1, help="rounds of both sides, alternating order; best time each")
    p.add_argument("--seed", type=int, default=0, help="chat workload seed")
    a = p.parse_args()
    figures = compare(a.num_requests, a.max_tokens, a.batch, a.k, a.prompt_lookup_min, a.prompt_lookup_max, a.repeat,
                      a.seed)  # fmt: skip
    print(report(figures))


if __name__ == "__main__":
    main()

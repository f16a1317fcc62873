"""Continuous batching through the engine API: requests join while others decode, answers stream out.

Runs SmolLM2-135M-Instruct on the CPU (about half a minute, most of it loading
the model): four chat requests, one of them with two parallel samples that
share the prompt's KV blocks, and one aborted mid-answer.
"""

from __future__ import annotations

import torch

from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler.model.loader import load_smollm2

QUESTIONS = ["What is the capital of Italy?", "Name two planets.", "Why is the sea salty?", "Count from one to ten."]


def main() -> None:
    """Serve a few chat requests step by step and print each answer as it finishes."""
    torch.set_num_threads(1)
    hf_model, tokenizer = load_smollm2()
    config = EngineConfig(cache=CacheConfig(num_gpu_blocks=64), scheduler=SchedulerConfig(max_num_seqs=8))
    engine = LLMEngine.from_hf(hf_model, config)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS]  # fmt: skip
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    arrivals = {0: [0, 1], 3: [2], 6: [3]}  # step -> requests joining then
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            sampled = SamplingParams(max_tokens=40, n=2, temperature=0.8, seed=0)  # two samples, shared prompt
            params = sampled if i == 1 else SamplingParams(max_tokens=40)
            engine.add_request(f"q{i}", prompts[i], params)
            print(f"step {step}: q{i} joins ({len(prompts[i])} prompt tokens)")
        if step == 10:
            out = engine.abort("q3")
            print(f"step {step}: q3 aborted after {len(out.outputs[0].token_ids)} tokens")
        for out in engine.step():
            for sample in out.outputs:
                text = tokenizer.decode(sample.token_ids, skip_special_tokens=True).strip()
                print(f"step {step}: {out.request_id}#{sample.index} done ({sample.finish_reason}): {text!r}")
        step += 1
    print("\n" + engine.metrics_summary().format())


if __name__ == "__main__":
    main()

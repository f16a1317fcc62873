"""What the logits controls cost the sampler: a step of 64 rows over SmolLM2's vocabulary, without and with them.

Side by side in one run, best of REPEATS (the cases alternate, so a loaded machine drifts alike for all):
greedy rows and random rows (temperature 0.8, top-p 0.95) with no control (the fast path: nothing is
built), then the same rows with every control before temperature (penalties, logit bias, bad words,
min_tokens, allowed ids on every 8th row), their penalty counts kept on the device across steps (the
engine's way) or, for the greedy rows, rebuilt from the token lists every step (the alternative: one
upload of every history a step), and the random rows with min-p 0.05 too (it leaves top-p fewer tokens
to sort). Each controlled case prints its ratio to the same rows without controls.
Each timed run is STEPS sampler steps over histories of PROMPT_LEN + OUTPUT_LEN tokens that grow by the
sampled tokens, as in the engine. On the CPU torch runs on one thread and the clock is that thread's CPU
time, so other processes on a shared machine slow the figures little.

Run: ``PYTHONPATH=. python benchmarks/bench_sampler.py [--device cuda]``
"""

from __future__ import annotations

import argparse
import time

import torch

from scheduler import SamplingParams
from scheduler.core.sequence import Sequence
from scheduler.runner.sampler import Sampler, SampleRow

BATCH, VOCAB = 64, 49152  # SmolLM2's vocabulary
PROMPT_LEN, OUTPUT_LEN, STEPS, REPEATS = 512, 256, 8, 5

RANDOM = dict(temperature=0.8, top_p=0.95, max_tokens=4096)
CONTROLS = dict(
    repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3, min_tokens=1024,
    logit_bias={t: 2.0 for t in range(100, 110)}, bad_words_token_ids=[(5, 6), (7,), (8, 9, 10), (11, 12), (13,)],
)  # fmt: skip
ALLOWED = tuple(range(0, VOCAB, 48))  # 1024 ids, on every 8th row


def _params(kind: str) -> list[SamplingParams]:
    """64 rows: greedy or random, with every control before temperature ("+"), and min-p ("+min_p"), or none."""
    base = dict(max_tokens=4096) if kind.startswith("greedy") else RANDOM
    if "+" not in kind:
        return [SamplingParams(**base)] * BATCH
    min_p = 0.05 if kind.endswith("min_p") else 0.0
    return [SamplingParams(**base, **CONTROLS, min_p=min_p, allowed_token_ids=ALLOWED if i % 8 == 0 else None)
            for i in range(BATCH)]  # fmt: skip


def _histories(seed: int) -> list[Sequence]:
    """64 sequences of PROMPT_LEN random prompt tokens and OUTPUT_LEN random outputs, seeded."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(BATCH):
        seq = Sequence(i, 0, torch.randint(0, VOCAB, (PROMPT_LEN,), generator=g).tolist())
        seq.token_ids += torch.randint(0, VOCAB, (OUTPUT_LEN,), generator=g).tolist()
        seqs.append(seq)
    return seqs


def _run(device: torch.device, kind: str, keep_counts: bool) -> float:
    """Seconds for STEPS sampler steps (fresh histories; the sampler made before the clock starts)."""
    params, hist = _params(kind), _histories(0)
    logits = [torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(s)).to(device) for s in range(STEPS)]
    sampler = Sampler(VOCAB, device)
    if keep_counts:  # the engine's steady state: counts built at a sequence's first sample, not timed
        warm = sampler(logits[0], [SampleRow(p, None, h) for p, h in zip(params, hist)])
        for h, t in zip(hist, warm.token_ids):
            h.token_ids.append(t)
    clock = time.thread_time if device.type == "cpu" else time.perf_counter  # a GPU's time is wall time
    start = clock()
    for step in range(STEPS):
        s = sampler if keep_counts else Sampler(VOCAB, device)
        out = s(logits[step], [SampleRow(p, None, h) for p, h in zip(params, hist)])
        for h, t in zip(hist, out.token_ids):
            h.token_ids.append(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - start


CASES = {  # name: (rows, counts kept across steps, the case it is compared with)
    "greedy, no control": ("greedy", True, None),
    "greedy + controls, counts kept": ("greedy+", True, "greedy, no control"),
    "greedy + controls, counts rebuilt": ("greedy+", False, "greedy, no control"),
    "random, no control": ("random", True, None),
    "random + controls, counts kept": ("random+", True, "random, no control"),
    "random + controls + min-p, counts kept": ("random+min_p", True, "random, no control"),
}


def main() -> None:
    """Time every case, best of REPEATS, and print them with their ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    device = torch.device(parser.parse_args().device)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    best = {name: float("inf") for name in CASES}
    for _ in range(REPEATS):
        for name, (kind, keep, _) in CASES.items():
            best[name] = min(best[name], _run(device, kind, keep))
    print(f"sampler step: batch {BATCH} x vocab {VOCAB}, {device}, {torch.get_num_threads()} thread, "
          f"histories {PROMPT_LEN}+{OUTPUT_LEN} tokens, best of {REPEATS} x {STEPS} steps")  # fmt: skip
    for name, (_, _, base) in CASES.items():
        ratio = f"x{best[name] / best[base]:.2f} of {base}" if base else ""
        print(f"{name:40s} {best[name] / STEPS * 1e3:8.2f} ms/step   {ratio}")


if __name__ == "__main__":
    main()

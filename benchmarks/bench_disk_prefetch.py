"""Decoding while returning prompts are read from the disk tier: a blocking read at admission against a background read.

A first engine computes ``--docs`` long documents and shuts down, so their blocks are on disk.
Then, for each mode, a fresh engine on the same directory runs ``--busy`` requests that
decode, and the documents come back (plus a question) while they do. "blocking" waits for
each read at admission on the scheduler's thread (what the engine did before reads moved to
a background thread); "background" is the engine as it is. Figures: the decoding requests'
inter-token gaps while the reads were in flight (the stall), the returning prompts' TTFT, and
whether both modes give the same answers. The files are in the page cache in both modes
(the first engine just wrote them): this measures the read's CPU cost (checksums, copies),
not a cold disk.

    .venv/bin/python benchmarks/bench_disk_prefetch.py [--docs 2] [--doc-tokens 3000] [--busy 4]
"""

from __future__ import annotations

import argparse
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from scheduler.entrypoints.llm import LLM  # noqa: E402
from scheduler.model.loader import LoadedModel, load_smollm2  # noqa: E402

BLOCK = 16


class Blocking:
    """The engine's prefetcher, each read waited for at admission (the engine before reads moved to the background)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def prefetch(self, key, token_ids, hashes, cache_salt, *, wait=False) -> bool:
        return self.inner.prefetch(key, token_ids, hashes, cache_salt, wait=True)

    def forget(self, key) -> None:
        self.inner.forget(key)


def engine(loaded: LoadedModel, disk_dir: str) -> LLMEngine:
    """An engine with a host tier and a disk tier in ``disk_dir``."""
    cache = CacheConfig(block_size=BLOCK, num_gpu_blocks=1024, watermark=0.0, kv_offloading_bytes=1 << 30,
                        kv_disk_dir=disk_dir, kv_disk_bytes=4 << 30)  # fmt: skip
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024)
    return LLM(loaded, engine_config=EngineConfig(cache=cache, scheduler=sched, device="cpu")).engine


def run(eng: LLMEngine, busy: list[list[int]], returning: list[list[int]], answer: int) -> dict:
    """Busy requests decode; after a few steps the returning prompts arrive. Step times and outputs."""
    greedy = SamplingParams(max_tokens=answer, ignore_eos=True, temperature=0.0)
    for i, p in enumerate(busy):
        eng.add_request(f"busy{i}", p, SamplingParams(max_tokens=4 * answer, ignore_eos=True, temperature=0.0))
    for _ in range(3):
        eng.step()
    arrival = time.perf_counter()
    for i, p in enumerate(returning):
        eng.add_request(f"back{i}", p, greedy)
    steps, outs, admitted = [], {}, None
    while eng.has_unfinished_requests():
        start = time.perf_counter()
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        steps.append(time.perf_counter() - start)
        running = {g.request_id for g in eng.scheduler.running}
        if admitted is None and all(f"back{i}" in running or f"back{i}" in outs for i in range(len(returning))):
            admitted = len(steps)
    reading = steps[:admitted]  # the steps from the arrival to the last admission: the reads were in flight
    ttft = [outs[f"back{i}"].first_token_time - arrival for i in range(len(returning))]
    cached = sum(outs[f"back{i}"].num_cached_tokens for i in range(len(returning)))
    return dict(reading=reading, rest=steps[admitted:], ttft=ttft, cached=cached,
                answers={k: o.outputs[0].token_ids for k, o in outs.items()})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=2)
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--busy", type=int, default=4)
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731
    docs = [ids(args.doc_tokens) for _ in range(args.docs)]
    busy, returning = [ids(32) for _ in range(args.busy)], [d + ids(16) for d in docs]
    loaded = LoadedModel(*load_smollm2(), "SmolLM2")
    disk_dir = tempfile.mkdtemp(prefix="paged-kv-bench-prefetch-")
    first = engine(loaded, disk_dir)
    first.generate(docs, SamplingParams(max_tokens=1), use_tqdm=False)
    first.shutdown()  # the documents' blocks spill to disk
    per_token = first.runner.gpu_cache.spec.bytes_per_block / BLOCK
    print(f"machine: {platform.machine()} {platform.processor()}, torch {torch.__version__}, {args.threads} thread(s)")
    print(f"workload: SmolLM2-135M float32, {args.busy} decoding requests; {args.docs} documents of {args.doc_tokens} "
          f"tokens return ({args.docs * args.doc_tokens * per_token / 1e6:.0f} MB of K/V on disk)")  # fmt: skip
    figures = {}
    for mode in ("blocking", "background"):
        copy = shutil.copytree(disk_dir, tempfile.mkdtemp(prefix=f"paged-kv-bench-{mode}-"), dirs_exist_ok=True)
        eng = engine(loaded, copy)  # a copy each: an engine's shutdown spills its own blocks
        if mode == "blocking":
            eng.scheduler.prefetch = Blocking(eng.scheduler.prefetch)
        figures[mode] = run(eng, busy, returning, args.answer)
        eng.shutdown()
    report(figures)


def report(figures: dict[str, dict]) -> None:
    """The table of both modes and the ratios."""
    same = figures["blocking"]["answers"] == figures["background"]["answers"]
    print(f"answers identical: {same}")
    print("| read | steps while reading | longest gap ms | median gap while reading ms | median gap after ms "
          "| TTFT of the returning prompts ms | tokens cached |\n|---|---:|---:|---:|---:|---:|---:|")
    for mode, f in figures.items():
        r = f["reading"]
        print(f"| {mode} | {len(r)} | {max(r) * 1e3:.0f} | {statistics.median(r) * 1e3:.0f} "
              f"| {statistics.median(f['rest']) * 1e3:.0f} | {' / '.join(f'{t * 1e3:.0f}' for t in f['ttft'])} "
              f"| {f['cached']} |")  # fmt: skip
    b, g = figures["blocking"], figures["background"]
    print(f"longest decode gap while reading: {max(b['reading']) / max(g['reading']):.2f}x shorter in the background; "
          f"TTFT of the last returning prompt {max(g['ttft']) / max(b['ttft']):.2f}x of blocking")


if __name__ == "__main__":
    main()

"""Cascade decode vs plain paged decode on sequences that share a long prompt: K/V bytes read and time.

Run ``python benchmarks/bench_cascade.py [--quick]``. Two cases. "beams": each request is a
prompt of ``prompt`` tokens in shared blocks plus ``width`` beams. "system": ``requests``
requests of one sequence each open with the same ``prompt``-token system prompt (the cached
blocks prefix caching hands them). Every sequence has its own suffix of 64-512 tokens (a seeded
draw; 16-64 on the CPU). The groups come from the engine's planner (scheduler.runner.cascade_plan;
plan_ms is its host time). Plain decode reads every sequence's whole length; cascade decode
reads each group's prompt once and each suffix once. Both run their prepared (sync-free)
paths: on a GPU the Triton kernels in bf16 (triton.testing.do_bench), on the CPU the torch
paths in float32 (torch.utils.benchmark). Shape: 32 query heads, 8 KV heads, head_dim 128,
block size 16, shuffled blocks. ``run(device, quick)`` returns the rows for other scripts. Last,
the planner's host time alone on tables of 256 sequences (no caches built): 256 requests on an
8k system prompt, 32 x 8 and 64 x 4 beams on 32k prompts.

``--engine`` instead runs the CPU main workload (bench_engine.py's chat requests on SmolLM2-135M,
half behind one ~300-token system prompt) through the engine with cascade decode off, on (with
the default byte floor) and on at any saving, in rotating order, best time each: the end-to-end
trade-off, answers compared.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

from benchmarks.bench_attention import timer  # noqa: E402
from kernels.cascade_attention import cascade_decode_attention_prepared  # noqa: E402
from kernels.decode_attention import paged_decode_attention_prepared  # noqa: E402
from kernels.metadata import prepare_attention_metadata, prepare_cascade_metadata  # noqa: E402
from scheduler.runner.cascade_plan import plan_cascade  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def make_tables(requests: int, width: int, prompt: int, suffix: tuple[int, int], across: bool, seed: int = 0):
    """(tables [S, W], lens [S], blocks used) of ``requests`` x ``width`` sequences after a ``prompt``-token
    prompt, one per request or (``across``) one for all of them, each with its own suffix; shuffled block ids."""
    rng = np.random.default_rng(seed)
    shared = prompt // BLOCK_SIZE
    lens = prompt + rng.integers(suffix[0], suffix[1] + 1, size=requests * width)  # [S]
    own = -(-lens // BLOCK_SIZE) - shared  # blocks each sequence holds alone
    perm = rng.permutation((1 if across else requests) * shared + int(own.sum()))
    tables, used = [], 0
    for r in range(requests):
        if r == 0 or not across:
            prefix = perm[used : used + shared].tolist()
            used += shared
        for b in range(width):
            s = r * width + b
            tables.append(prefix + perm[used : used + own[s]].tolist())
            used += int(own[s])
    cols = max(map(len, tables))
    return np.array([t + [0] * (cols - len(t)) for t in tables], dtype=np.int64), lens, len(perm)


def timed_plan(table: np.ndarray, lens: np.ndarray, repeats: int = 1):
    """The planner's groups of a batch and its best host time in ms over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_cascade(table, lens, BLOCK_SIZE)
        times.append((time.perf_counter() - start) * 1e3)
    assert plan.pays, "the planner found no group worth a cascade step"
    return plan, min(times)


def make_batch(requests: int, width: int, prompt: int, suffix: tuple[int, int], across: bool, dtype, device,
               seed: int = 0) -> dict:  # fmt: skip
    """Caches, tables, lengths and the planner's groups of a :func:`make_tables` batch."""
    table, lens, num_blocks = make_tables(requests, width, prompt, suffix, across, seed)
    plan, plan_ms = timed_plan(table, lens)
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    q = torch.randn(len(lens), NUM_Q_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    meta = prepare_attention_metadata(table.tolist(), (lens - 1).tolist(), [1] * len(lens), block_size=BLOCK_SIZE,
                                      num_blocks=num_blocks, device=device)  # fmt: skip
    cascade = prepare_cascade_metadata(
        table, lens, plan.seq_groups, plan.prefix_lens, block_size=BLOCK_SIZE, num_blocks=num_blocks, device=device
    )  # fmt: skip
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, meta=meta, cascade=cascade, lens=lens, plan_ms=plan_ms)


def read_bytes(x: dict, dtype: torch.dtype) -> tuple[int, int]:
    """(plain, cascade) K+V bytes: sum of lengths vs one prompt per request plus every suffix."""
    per_token = 2 * NUM_KV_HEADS * HEAD_DIM * torch.finfo(dtype).bits // 8  # a float cache has no scales
    cascade_tokens = x["cascade"].host.prefix_lens.sum() + x["cascade"].host.suffix_lens.sum()
    return int(x["lens"].sum()) * per_token, int(cascade_tokens) * per_token


def run_case(case, requests, width, prompt, suffix, dtype, device, time_ms) -> dict:
    """Time plain and cascade decode on one batch (case "beams" or "system"); return a table row."""
    x = make_batch(requests, width, prompt, suffix, case == "system", dtype, device)
    caches = (x["q"], x["k_cache"], x["v_cache"])

    def plain():
        return paged_decode_attention_prepared(*caches, x["meta"])

    def cascade():
        return cascade_decode_attention_prepared(*caches, x["cascade"])

    err = (plain().float() - cascade().float()).abs().max().item()
    t_plain, t_cascade = time_ms(plain), time_ms(cascade)
    plain_bytes, cascade_bytes = read_bytes(x, dtype)
    return dict(case=case, requests=requests, width=width, prompt=prompt, suffix=f"{suffix[0]}-{suffix[1]}",
                groups=x["cascade"].prefix.num_groups, plan_ms=x["plan_ms"],
                plain_mb=plain_bytes / 2**20, cascade_mb=cascade_bytes / 2**20, bytes_ratio=cascade_bytes / plain_bytes,
                plain_ms=t_plain, cascade_ms=t_cascade, time_ratio=t_cascade / t_plain, max_err=err)  # fmt: skip


def run(device: torch.device, quick: bool) -> list[dict]:
    """Rows of the grid on ``device``. beams (width 4 and 8): GPU 8k/32k prompts x 1/8 requests, CPU 1k/4k x 1
    (--quick: the first of each); system: 16 requests on a 2k prompt (GPU, not --quick: also 64)."""
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if on_gpu:
        prompts, suffix, requests = ((8192,) if quick else (8192, 32768)), (64, 512), ((1,) if quick else (1, 8))
    else:
        prompts, suffix, requests = ((1024,) if quick else (1024, 4096)), (16, 64), (1,)
    system = (16,) if quick or not on_gpu else (16, 64)
    time_ms = timer(device, quick)
    cases = [("beams", r, w, p) for r in requests for p in prompts for w in (4, 8)]
    cases += [("system", r, 1, 2048) for r in system]
    return [run_case(c, r, w, p, suffix, dtype, device, time_ms) for c, r, w, p in cases]


# (case, requests, width, prompt) of the planner-only rows: 256 sequences each
PLAN_SHAPES = [("system", 256, 1, 8192), ("beams", 32, 8, 32768), ("beams", 64, 4, 32768)]


def plan_rows() -> list[dict]:
    """The planner's host time alone on batches of 256 sequences (tables only, no caches), suffixes 64-512."""
    rows = []
    for case, requests, width, prompt in PLAN_SHAPES:
        table, lens, _ = make_tables(requests, width, prompt, (64, 512), case == "system")
        plan, ms = timed_plan(table, lens, repeats=20)
        shape = "x".join(map(str, table.shape))
        rows.append(dict(case=case, requests=requests, width=width, prompt=prompt, table=shape, groups=plan.num_groups,
                         saved=plan.saved_tokens / plan.plain_tokens, plan_ms=ms))  # fmt: skip
    return rows


ENGINE_MODES = {"off": (False, None), "on": (True, None), "on, no floor": (True, 0)}  # (cascade, min saved bytes)


def engine_ab(rounds: int = 2) -> str:
    """The CPU chat workload through the engine with cascade off, on, and on at any saving (the byte floor at 0),
    in rotating order, best time each; as printed lines."""
    from benchmarks.bench_engine import BLOCK_SIZE as ENGINE_BLOCK
    from benchmarks.bench_engine import BUDGET_SEQS, MAX_SEQ_LEN
    from scheduler import CacheConfig, EngineConfig, LLMEngine, SchedulerConfig
    from scheduler.entrypoints.workload import chat_workload
    from scheduler.model.loader import load_smollm2

    torch.set_num_threads(1)
    hf, tokenizer = load_smollm2()
    requests = chat_workload(tokenizer, 64, 64, seed=0)

    def serve(cascade: bool, floor: int | None) -> tuple[float, list[list[int]], int]:
        cache = CacheConfig(block_size=ENGINE_BLOCK, num_gpu_blocks=BUDGET_SEQS * MAX_SEQ_LEN // ENGINE_BLOCK,
                            enable_cascade_attention=cascade, cascade_min_saved_bytes=floor)  # fmt: skip
        config = EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_seqs=16), device="cpu")
        engine = LLMEngine.from_hf(hf, config)
        build, steps = engine.runner.inputs.build, []
        engine.runner.inputs.build = lambda out: steps.append(build(out)) or steps[-1]  # count the cascade steps
        start = time.perf_counter()
        outs = engine.generate([r.prompt_token_ids for r in requests], [r.params for r in requests], use_tqdm=False)
        cascade_steps = sum(s.meta.cascade is not None for s in steps)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs], cascade_steps

    names = list(ENGINE_MODES)
    runs: dict[str, list] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            runs[name].append(serve(*ENGINE_MODES[name]))
    best = {name: min(r, key=lambda x: x[0]) for name, r in runs.items()}
    off_s, off_answers = best["off"][0], best["off"][1]
    tokens = sum(map(len, off_answers))
    lines = [f"# engine, CPU chat workload: 64 requests, max_tokens 64, max_num_seqs 16, {tokens} generated tokens"]
    for name in names:
        seconds, answers, steps = best[name]
        same = sum(a == b for a, b in zip(answers, off_answers))
        lines.append(f"cascade {name}: {', '.join(f'{r[0]:.1f}' for r in runs[name])} s, best {tokens / seconds:.1f} "
                     f"tok/s, time / off {seconds / off_s:.2f}, {steps} cascade steps, answers as off {same}/64")
    return "\n".join(lines)


COLUMNS = [
    ("case", "{:>6}"), ("requests", "{:>8}"), ("width", "{:>5}"), ("prompt", "{:>6}"), ("suffix", "{:>7}"),
    ("groups", "{:>6}"), ("plan_ms", "{:>7.2f}"), ("plain_mb", "{:>9.1f}"),
    ("cascade_mb", "{:>10.1f}"), ("bytes_ratio", "{:>11.2f}"), ("plain_ms", "{:>9.3f}"), ("cascade_ms", "{:>10.3f}"),
    ("time_ratio", "{:>10.2f}"), ("max_err", "{:>8.1e}"),
]  # fmt: skip


def main() -> None:
    """Parse arguments, run the grid and the planner rows, print markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small grid, short timing")
    parser.add_argument("--engine", action="store_true", help="the CPU chat workload with cascade off / on instead")
    args = parser.parse_args()
    if args.engine:
        print(engine_ab())
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# cascade vs plain decode, {name}; Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block={BLOCK_SIZE}")
    print("# *_mb: K+V bytes read; *_ratio = cascade / plain (< 1: cascade reads less / is faster)")
    rows = run(device, args.quick)
    print("| " + " | ".join(name for name, _ in COLUMNS) + " |")
    print("|" + "|".join("---:" for _ in COLUMNS) + "|")
    for row in rows:
        print("| " + " | ".join(fmt.format(row[name]) for name, fmt in COLUMNS) + " |")
    print("\n# planner host time alone (best of 20), 256 sequences; saved = fraction of plain decode's K/V tokens")
    print("| case | requests | width | prompt | table | groups | saved | plan_ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in plan_rows():
        print(f"| {r['case']} | {r['requests']} | {r['width']} | {r['prompt']} | {r['table']} | {r['groups']} | "
              f"{r['saved']:.2f} | {r['plan_ms']:.2f} |")


if __name__ == "__main__":
    main()

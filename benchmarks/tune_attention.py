"""Tune the attention kernels' tiles on the GPU at hand and write them to ``kernels/configs/<gpu>.json``.

Run ``python benchmarks/tune_attention.py [--quick] [--write]`` on a CUDA machine. For each
tuned case (decode over bf16, int8 and fp8 e4m3 caches at 64 x 8k; causal prefill 4 x 2048; the
cascade prefix kernel, 16 groups of 8 queries over 8k-token prefixes;
32 query heads, 8 KV heads, head_dim 128, block 16) it times every candidate tile with
``triton.testing.do_bench`` through the same lookup the kernels use (:func:`kernels.tile_configs.overriding`),
keeps the fastest whose output matches the built-in tile's within 16-bit rounding, and prints
it against the built-in heuristic, side by side, with the ratio. Decode first picks
(BLOCK_N, warps, stages), then the split waves for that tile. ``--write`` merges the winners
into the GPU's table, which the kernels read from then on. Candidates that fail to build
(shared memory, registers) are skipped and counted.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

from benchmarks.bench_attention import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, paged_from_lens  # noqa: E402
from kernels.attention_triton import dot_dtype  # noqa: E402
from kernels.decode_attention import decode_tile_key, paged_decode_attention  # noqa: E402
from kernels.prefill_attention import paged_prefill_attention, prefill_tile_key  # noqa: E402
from kernels.prefix_attention import paged_prefix_attention, prefix_tile_key  # noqa: E402
from kernels.quant import quantize_per_token_head  # noqa: E402
from kernels.tile_configs import config_path, gpu_name, overriding, save_table  # noqa: E402

D_PAD = 128  # next power of two of HEAD_DIM
TOLERANCE = 2e-2  # max |candidate - built-in| on outputs of size ~1: bf16 rounding differs by tile order


def candidates(space: dict[str, tuple[int, ...]]) -> list[dict[str, int]]:
    """Every combination of the values in ``space`` as launch entries."""
    return [dict(zip(space, values)) for values in itertools.product(*space.values())]


def tune(key: str, run: Callable[[], torch.Tensor], entries: list[dict[str, int]], quick: bool) -> dict:
    """Time ``run`` under each entry for ``key``; the fastest correct one against the built-in tile."""
    from triton.testing import do_bench

    reps = dict(warmup=5, rep=20) if quick else dict(warmup=25, rep=100)
    expected = run()
    base_ms = do_bench(run, **reps)
    best, best_ms, failed = None, base_ms, 0
    for entry in entries:
        with overriding({key: entry}):
            try:
                out = run()
                if (out.float() - expected.float()).abs().max().item() > TOLERANCE:
                    failed += 1
                    continue
                ms = do_bench(run, **reps)
            except Exception:  # noqa: BLE001 - a tile that does not build here (resources) is skipped
                failed += 1
                continue
        if ms < best_ms:
            best, best_ms = entry, ms
    return dict(key=key, builtin_ms=base_ms, tuned_ms=best_ms, speedup=base_ms / best_ms, entry=best, skipped=failed)


def decode_cases(quick: bool) -> list[tuple[str, Callable[[], torch.Tensor], int]]:
    """(table key, a decode call, cache bytes) for bf16, int8 and fp8 e4m3 caches."""
    batch, context = (16, 4096) if quick else (64, 8192)
    x = paged_from_lens([context] * batch, torch.bfloat16, "cuda")
    cases = [(x["k"], x["v"], None, None)]
    for dtype in (torch.int8, torch.float8_e4m3fn):
        (k, ks), (v, vs) = (quantize_per_token_head(x[n], dtype) for n in ("k", "v"))
        cases.append((k, v, ks, vs))
    out = []
    for k, v, ks, vs in cases:
        key = decode_tile_key(D_PAD, k.element_size(), dot_dtype(x["q"], k))
        call = (lambda k=k, v=v, ks=ks, vs=vs: paged_decode_attention(
            x["q"], k, v, x["tables"], x["lens"], k_scale=ks, v_scale=vs))  # fmt: skip
        out.append((key, call, k.element_size()))
    return out


def prefill_case(quick: bool) -> tuple[str, Callable[[], torch.Tensor]]:
    """(table key, a causal prefill call) over 4 x 2048 new tokens (2 x 1024 quick)."""
    batch, new = (2, 1024) if quick else (4, 2048)
    x = paged_from_lens([new] * batch, torch.bfloat16, "cuda")
    q = torch.randn(batch * new, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device="cuda")
    key = prefill_tile_key(D_PAD, NUM_Q_HEADS // NUM_KV_HEADS, dot_dtype(q, x["k"]))
    return key, lambda: paged_prefill_attention(q, x["k"], x["v"], x["tables"], x["lens"], cu)


def prefix_case(quick: bool) -> tuple[str, Callable[[], torch.Tensor]]:
    """(table key, a shared-prefix call): 16 groups of 8 queries (beams) over 8k-token prefixes (4 x 2k quick)."""
    groups, prefix = (4, 2048) if quick else (16, 8192)
    x = paged_from_lens([prefix] * groups, torch.bfloat16, "cuda")
    q = torch.randn(groups * 8, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, groups * 8 + 1, 8, dtype=torch.int32, device="cuda")
    key = prefix_tile_key(D_PAD, x["k"].element_size(), dot_dtype(q, x["k"]))
    return key, lambda: paged_prefix_attention(q, x["k"], x["v"], x["tables"], x["lens"], cu)[0]


def tune_decode(quick: bool) -> list[dict]:
    """Decode: the tile first (at the built-in waves), then the waves for the winning tile."""
    rows = []
    for key, call, cache_bytes in decode_cases(quick):
        widths = (32, 64, 128) + ((256,) if cache_bytes == 1 else ())
        tile = tune(key, call, candidates({"BLOCK_N": widths, "num_warps": (4, 8), "num_stages": (2, 3, 4)}), quick)
        chosen = tile["entry"] or {}
        waves = tune(key, call, [dict(chosen, waves=w) for w in (1, 2, 4, 8)], quick)
        best = waves if waves["entry"] else tile
        rows.append(dict(best, builtin_ms=tile["builtin_ms"], speedup=tile["builtin_ms"] / best["tuned_ms"]))
    return rows


def tune_prefill(quick: bool) -> list[dict]:
    """Prefill: query and key tiles, warps and stages; the shared-prefix (cascade) kernel: key tiles."""
    key, call = prefill_case(quick)
    space = {"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
    prefix_key, prefix_call = prefix_case(quick)
    prefix_space = {"BLOCK_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
    return [tune(key, call, candidates(space), quick), tune(prefix_key, prefix_call, candidates(prefix_space), quick)]


def main() -> None:
    """Tune on the CUDA device, print the table, write the winners with --write."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, shorter timing")
    parser.add_argument("--write", action="store_true", help="merge the winners into kernels/configs/<gpu>.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_attention.py needs a CUDA device: tiles are chosen by timing them")
    device = torch.device("cuda")
    path = config_path(gpu_name(device))
    print(f"# {torch.cuda.get_device_name()} -> {path.name}; block size {BLOCK_SIZE}")
    rows = tune_decode(args.quick) + tune_prefill(args.quick)
    print("| key | built-in ms | tuned ms | speedup | entry | skipped |")
    print("|---|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['key']} | {r['builtin_ms']:.4g} | {r['tuned_ms']:.4g} | {r['speedup']:.3g} | {r['entry']} | "
              f"{r['skipped']} |")  # fmt: skip
    winners = {r["key"]: r["entry"] for r in rows if r["entry"]}
    if args.write and winners:
        save_table(path, winners)
        print(f"wrote {len(winners)} entries to {path}")


if __name__ == "__main__":
    main()

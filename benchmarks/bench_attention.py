"""Decode attention benchmark: paged attention vs contiguous SDPA and gather-then-SDPA.

Run ``python benchmarks/bench_attention.py [--quick]``. On a GPU it times the Triton
kernel (bf16, triton.testing.do_bench); on CPU the torch path the CPU engine uses
(float32, torch.utils.benchmark). Shape: 32 query heads, 8 KV heads, head_dim 128,
block size 16, over a batch x context grid, with shuffled block tables. Bandwidth counts
the bytes the kernel must move (K/V, scales, q, out, block tables, lengths) and is
compared with a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

from kernels.decode_attention import paged_decode_attention  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


@dataclass(frozen=True, kw_only=True)
class Case:
    """One decode configuration of the grid: uniform context length across the batch."""

    batch: int
    context: int

    def __post_init__(self) -> None:
        if self.batch < 1 or self.context < 1 or self.context % BLOCK_SIZE:
            raise ValueError(f"bad case {self}: batch >= 1 and context a multiple of {BLOCK_SIZE}")


def timer(device: torch.device, quick: bool):
    """Return ``time_ms(fn)``: do_bench median on CUDA; on CPU the best torch.utils.benchmark block.

    CPU machines are often shared: the best block estimates the cost without other tenants' noise.
    """
    if device.type == "cuda":
        import triton.testing

        warmup, rep = (10, 50) if quick else (25, 200)
        return lambda fn: triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    import torch.utils.benchmark as tb

    def time_ms(fn) -> float:
        for _ in range(3):
            fn()  # warm-up: first-call allocation and kernel selection
        timer = tb.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        return min(timer.blocked_autorange(min_run_time=0.3 if quick else 1.0).times) * 1e3

    return time_ms


def copy_bandwidth(device: torch.device, time_ms) -> float:
    """Bytes/s of a device-to-device copy (read + write) of a 256 MiB (GPU) / 64 MiB (CPU) buffer."""
    numel = (256 if device.type == "cuda" else 64) * 2**20 // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (time_ms(lambda: dst.copy_(src)) * 1e-3)


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """Paged caches with shuffled blocks, plus the same K/V as a contiguous [B, Hkv, L, D] copy."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = case.context // BLOCK_SIZE
    shape = (case.batch * blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    tables = torch.randperm(shape[0], generator=gen, device=device).view(case.batch, blocks).to(torch.int32)
    q = torch.randn(case.batch, NUM_Q_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    lens = torch.full((case.batch,), case.context, dtype=torch.int32, device=device)

    def dense(cache):  # [B, Hkv, L, D]
        return cache[tables.long()].reshape(case.batch, case.context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)

    return dict(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, lens=lens,
                k_dense=dense(k_cache).contiguous(), v_dense=dense(v_cache).contiguous())  # fmt: skip


def moved_bytes(inputs: dict) -> int:
    """Bytes the decode must move: K and V of every token, q in, out, block tables, lengths."""
    kv = inputs["k_dense"].numel() * inputs["k_dense"].element_size() * 2
    q = inputs["q"].numel() * inputs["q"].element_size()
    return kv + 2 * q + inputs["tables"].numel() * 4 + inputs["lens"].numel() * 4


def run_case(case: Case, dtype, device, time_ms, copy_bw: float) -> dict:
    """Time ours, contiguous SDPA and gather-then-SDPA on one case; return a table row."""
    x = make_inputs(case, dtype, device)
    q4 = x["q"][:, :, None]  # [B, Hq, 1, D]

    def ours():
        return paged_decode_attention(x["q"], x["k_cache"], x["v_cache"], x["tables"], x["lens"])

    def sdpa():
        return F.scaled_dot_product_attention(q4, x["k_dense"], x["v_dense"], enable_gqa=True)

    def gather_sdpa():
        k = x["k_cache"][x["tables"].long()].view(case.batch, case.context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = x["v_cache"][x["tables"].long()].view(case.batch, case.context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    err = (ours().float() - sdpa()[:, :, 0].float()).abs().max().item()
    t_ours, t_sdpa, t_gather = time_ms(ours), time_ms(sdpa), time_ms(gather_sdpa)
    bandwidth = moved_bytes(x) / (t_ours * 1e-3)
    return dict(batch=case.batch, context=case.context, ours_ms=t_ours, gbps=bandwidth / 1e9,
                copy_frac=bandwidth / copy_bw, sdpa_ms=t_sdpa, gather_ms=t_gather,
                vs_sdpa=t_ours / t_sdpa, vs_gather=t_ours / t_gather, max_err=err)  # fmt: skip


COLUMNS = [
    ("batch", "{:>5}"), ("context", "{:>7}"), ("ours_ms", "{:>9.3f}"), ("gbps", "{:>8.1f}"),
    ("copy_frac", "{:>9.2f}"), ("sdpa_ms", "{:>9.3f}"), ("gather_ms", "{:>9.3f}"),
    ("vs_sdpa", "{:>7.2f}"), ("vs_gather", "{:>9.2f}"), ("max_err", "{:>8.1e}"),
]  # fmt: skip


def print_table(rows: list[dict]) -> None:
    """Print rows as a markdown table."""
    print("| " + " | ".join(name for name, _ in COLUMNS) + " |")
    print("|" + "|".join("---:" for _ in COLUMNS) + "|")
    for row in rows:
        print("| " + " | ".join(fmt.format(row[name]) for name, fmt in COLUMNS) + " |")


def grid(quick: bool, on_gpu: bool) -> list[Case]:
    """Batch x context grid; skips cases above 4 GiB (GPU) / 1 GiB (CPU) of K + V."""
    if on_gpu:
        batches, contexts = ((1, 16, 64), (1024, 8192)) if quick else ((1, 8, 32, 128), (512, 2048, 8192, 32768))
        limit = 4 * 2**30
    else:
        batches, contexts = ((1, 8), (512, 2048)) if quick else ((1, 8, 32), (512, 2048, 8192))
        limit = 2**30
    kv_bytes = 2 * NUM_KV_HEADS * HEAD_DIM * (2 if on_gpu else 4)
    return [Case(batch=b, context=c) for b in batches for c in contexts if b * c * kv_bytes <= limit]


def main() -> None:
    """Parse arguments, measure copy bandwidth, run the grid and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small grid, short timing")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    time_ms = timer(device, args.quick)
    copy_bw = copy_bandwidth(device, time_ms)
    name = torch.cuda.get_device_name(device) if on_gpu else f"CPU, {torch.get_num_threads()} threads"
    path = "Triton kernel" if on_gpu else "torch reference path"
    print(f"# decode attention, {name}, {dtype}, ours = {path}")
    shape = f"Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block={BLOCK_SIZE}"
    print(f"# {shape}; device-to-device copy bandwidth {copy_bw / 1e9:.1f} GB/s")
    timing = "do_bench median" if on_gpu else "best torch.utils.benchmark block"
    print(f"# times: {timing}; gbps = moved bytes / ours time; copy_frac = gbps / copy bandwidth;")
    print("# vs_x = ours time / x time (< 1: ours faster); max_err = |ours - contiguous SDPA|")
    print_table([run_case(case, dtype, device, time_ms, copy_bw) for case in grid(args.quick, on_gpu)])


if __name__ == "__main__":
    main()

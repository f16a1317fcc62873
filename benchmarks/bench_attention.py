"""Attention benchmark (issue 13): paged decode, ragged, quantized and prefill vs SDPA and vLLM.

Run ``python benchmarks/bench_attention.py [--quick] [--only decode,ragged,quantized,prefill]``;
sections live in SECTIONS (name -> function), so another section (e.g. cascade) is one entry more.
vLLM's Triton unified attention runs side by side when ``third_party/vllm_attention`` holds it
(``bash benchmarks/setup_vllm_attention.sh``; CUDA only). On a GPU it times the Triton
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

from kernels.chunk_attention import best_chunk_backend, dense_chunk_attention_prepared  # noqa: E402
from kernels.decode_attention import paged_decode_attention  # noqa: E402
from kernels.metadata import prepare_chunk_metadata  # noqa: E402
from kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from kernels.quant import quantize_per_token_head  # noqa: E402

VLLM_DIR = Path(__file__).resolve().parents[1] / "third_party" / "vllm_attention"

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


def load_vllm(device: torch.device):
    """``make(hq, hkv, d, max_seqs) -> VllmDecode`` when the baseline folder exists and we are on CUDA, else None."""
    if device.type != "cuda" or not (VLLM_DIR / "vllm_unified.py").exists():
        return None
    sys.path.insert(0, str(VLLM_DIR))
    from vllm_unified import VllmDecode, load_unified  # git-ignored shim, copied by setup_vllm_attention.sh

    ua, modes = load_unified(str(VLLM_DIR))
    return lambda hq, hkv, d, max_seqs: VllmDecode(ua, modes, hq, hkv, d, max_seqs, device)


def print_rows(rows: list[dict]) -> None:
    """Print dict rows as a markdown table (floats with 3 significant digits)."""
    if not rows:
        return
    names = list(rows[0])
    print("| " + " | ".join(names) + " |")
    print("|" + "|".join("---:" for _ in names) + "|")
    for row in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


def paged_from_lens(lens: list[int], dtype, device, seed: int = 0) -> dict:
    """Paged caches (shuffled blocks) holding sequences of the given lengths, with a query per sequence."""
    gen = torch.Generator(device=device).manual_seed(seed)
    counts = [-(-n // BLOCK_SIZE) for n in lens]
    width, total = max(counts), sum(counts)
    shape = (total, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    perm = torch.randperm(total, generator=gen, device=device).to(torch.int32)
    tables = torch.zeros(len(lens), width, dtype=torch.int32, device=device)
    start = 0
    for s, c in enumerate(counts):
        tables[s, :c] = perm[start : start + c]
        start += c
    k = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    q = torch.randn(len(lens), NUM_Q_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    return dict(q=q, k=k, v=v, tables=tables, lens=torch.tensor(lens, dtype=torch.int32, device=device))


def _decode_row(name, x, time_ms, copy_bw, vllm, k_scale=None, v_scale=None, mode="none") -> dict:
    """Time our decode (and vLLM's when loaded) on a paged batch ``x``; one table row."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    ours = time_ms(lambda: paged_decode_attention(x["q"], x["k"], x["v"], x["tables"], x["lens"], **scales))
    tokens = int(x["lens"].sum())
    kv_bytes = 2 * tokens * NUM_KV_HEADS * HEAD_DIM * x["k"].element_size()
    kv_bytes += 0 if k_scale is None else 2 * tokens * NUM_KV_HEADS * 4
    row = dict(case=name, ours_ms=ours, copy_frac=kv_bytes / (ours * 1e-3) / copy_bw)
    if vllm is not None:
        run = vllm(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, x["q"].shape[0])
        out = torch.empty_like(x["q"])
        max_len = int(x["lens"].max())
        t = time_ms(lambda: run(x["q"], x["k"], x["v"], x["tables"], x["lens"], max_len, out, k_scale, v_scale, mode))
        row.update(vllm_ms=t, ours_vs_vllm=ours / t)
    return row


def section_decode(ctx: dict) -> None:
    """Uniform decode grid vs contiguous SDPA, gather-then-SDPA (and vLLM)."""
    device, dtype, time_ms, copy_bw = ctx["device"], ctx["dtype"], ctx["time_ms"], ctx["copy_bw"]
    print_table([run_case(case, dtype, device, time_ms, copy_bw) for case in grid(ctx["quick"], ctx["on_gpu"])])
    if ctx["vllm"] is not None:
        rows = []
        for case in grid(ctx["quick"], True):
            x = paged_from_lens([case.context] * case.batch, dtype, device)
            rows.append(_decode_row(f"{case.batch}x{case.context}", x, time_ms, copy_bw, ctx["vllm"]))
        print_rows(rows)


def section_ragged(ctx: dict) -> None:
    """Ragged decode batches: lengths spread over two decades (split count from total tokens)."""
    gen = torch.Generator().manual_seed(1)
    top = 32768 if ctx["on_gpu"] else 2048
    shapes = [(16, 16, top), (64, 16, top // 4), (4, 16, top)] if not ctx["quick"] else [(16, 16, top)]
    rows = []
    for n, lo, hi in shapes:
        lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
        lens[0] = hi  # one sequence at the longest length
        x = paged_from_lens(lens, ctx["dtype"], ctx["device"])
        rows.append(_decode_row(f"{n} seqs {lo}-{hi}", x, ctx["time_ms"], ctx["copy_bw"], ctx["vllm"]))
    print_rows(rows)


def section_quantized(ctx: dict) -> None:
    """Quantized KV (int8, e4m3, e5m2) decode vs our decode of the same tokens in q's dtype."""
    batch, context = ((64, 8192) if ctx["on_gpu"] else (4, 1024)) if not ctx["quick"] else (4, 512)
    x = paged_from_lens([context] * batch, ctx["dtype"], ctx["device"])
    base = _decode_row(f"{batch}x{context} {ctx['dtype']}", x, ctx["time_ms"], ctx["copy_bw"], ctx["vllm"])
    rows = [dict(base, speedup_vs_16bit=1.0)]
    for cache_dtype, mode in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8"), (torch.float8_e5m2, None)):
        (k, ks), (v, vs) = (quantize_per_token_head(x[n], cache_dtype) for n in ("k", "v"))
        xq = dict(x, k=k, v=v)
        vllm = ctx["vllm"] if mode is not None else None
        row = _decode_row(f"{batch}x{context} {cache_dtype}", xq, ctx["time_ms"], ctx["copy_bw"], vllm, ks, vs,
                          mode or "none")  # fmt: skip
        rows.append(dict(row, speedup_vs_16bit=base["ours_ms"] / row["ours_ms"]))
    print_rows(rows)


def section_prefill(ctx: dict) -> None:
    """Causal prefill (no cached prefix) and extend over a cached prefix, TFLOPS vs SDPA on contiguous K/V."""
    device, dtype, time_ms = ctx["device"], ctx["dtype"], ctx["time_ms"]
    cases = [(4, 2048, 0), (4, 512, 4096)] if ctx["on_gpu"] else [(2, 128, 0), (2, 64, 256)]
    rows = []
    for batch, new, cached in cases[:1] if ctx["quick"] else cases:
        x = paged_from_lens([new + cached] * batch, dtype, device)
        q = torch.randn(batch * new, NUM_Q_HEADS, HEAD_DIM, device=device, dtype=dtype)
        cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=device)
        ours = time_ms(lambda: paged_prefill_attention(q, x["k"], x["v"], x["tables"], x["lens"], cu))
        flops = 4 * batch * NUM_Q_HEADS * HEAD_DIM * (new * cached + new * (new + 1) / 2)  # causal pairs
        row = dict(case=f"{batch}x{new} over {cached}", ours_ms=ours, tflops=flops / (ours * 1e-3) / 1e12)
        q4 = q.view(batch, new, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
        if cached == 0:
            kd = torch.randn(batch, NUM_KV_HEADS, new, HEAD_DIM, device=device, dtype=dtype)
            sdpa = time_ms(lambda: F.scaled_dot_product_attention(q4, kd, kd, is_causal=True, enable_gqa=True))
            row.update(sdpa_ms=sdpa, ours_vs_sdpa=ours / sdpa, **_dense_chunk_row(q, kd, new, time_ms, sdpa))
        if ctx["vllm"] is not None:
            run = ctx["vllm"](NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, batch)
            out = torch.empty_like(q)
            t = time_ms(lambda: run(q, x["k"], x["v"], x["tables"], x["lens"], new + cached, out, cu_q=cu, max_q=new))
            row.update(vllm_ms=t, ours_vs_vllm=ours / t)
        rows.append(row)
    print_rows(rows)


def _dense_chunk_row(q, kd, new: int, time_ms, sdpa_ms: float) -> dict:
    """The engine's path for a fresh prompt: dense chunk attention on the packed K/V (target: <= 2x SDPA's time)."""
    batch, hkv = kd.shape[0], kd.shape[1]
    kp = kd.transpose(1, 2).reshape(batch * new, hkv, HEAD_DIM)  # [T, Hkv, D] packed like the queries
    backend = best_chunk_backend(q.device, q.dtype, q.shape[1], hkv, HEAD_DIM) or "torch"
    meta = prepare_chunk_metadata([new] * batch, q.device)
    t = time_ms(lambda: dense_chunk_attention_prepared(q, kp, kp, meta, backend=backend))
    return dict(chunk_backend=backend, chunk_ms=t, chunk_vs_sdpa=t / sdpa_ms)


def section_cascade(ctx: dict) -> None:
    """Cascade vs plain decode: beams sharing a long prompt, requests sharing a system prompt (bench_cascade.py)."""
    from bench_cascade import run  # benchmarks/ is this script's directory, first on sys.path

    print_rows(run(ctx["device"], ctx["quick"]))


SECTIONS = {"decode": section_decode, "ragged": section_ragged, "quantized": section_quantized,
            "prefill": section_prefill, "cascade": section_cascade}  # fmt: skip


def main() -> None:
    """Parse arguments, measure copy bandwidth, run the chosen sections and print their tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small grid, short timing")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {list(SECTIONS)}")
    args = parser.parse_args()
    chosen = args.only.split(",")
    unknown = [name for name in chosen if name not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
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
    vllm = load_vllm(device)
    print(f"# vLLM unified attention: {'side by side' if vllm else 'absent (CUDA + third_party/vllm_attention)'}")
    ctx = dict(device=device, dtype=dtype, time_ms=time_ms, copy_bw=copy_bw, quick=args.quick, on_gpu=on_gpu,
               vllm=vllm)  # fmt: skip
    for name in chosen:
        print(f"\n## {name}: {SECTIONS[name].__doc__}")
        SECTIONS[name](ctx)


if __name__ == "__main__":
    main()

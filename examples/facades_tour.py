"""A tour of the compatibility facades: five documented cache APIs, stored in paged-kv pages.

Each facade below is driven in a few lines the way a user of its documented API
would: a model-shaped cache (layers x KV heads x head_dim) takes a prompt and
some decoded tokens while ``max_seq_len`` allows far more. The tour prints the
bytes of the pages each cache holds against what a contiguous buffer
preallocated for ``max_seq_len`` in the same storage format would take, then
shows copy-on-write sharing (a beam of copies) and a sliding window.

    python examples/facades_tour.py [--prompt 256] [--decode 44] [--max-seq-len 4096] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

LAYERS, HEADS, HEAD_DIM, BLOCK = 4, 4, 64, 16
KV_DIM = HEADS * HEAD_DIM


@dataclass(frozen=True, kw_only=True)
class Row:
    """One line of the memory table."""

    facade: str
    storage: str
    tokens: int
    held: int  # bytes of the pages held
    contiguous: int  # bytes of a max_seq_len preallocation in the same format


def rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random float32 K (or V) rows of one layer: [n, HEADS, HEAD_DIM]."""
    return rng.standard_normal((n, HEADS, HEAD_DIM)).astype(np.float32)


def tour_ndarray(rng, prompt: int, decode: int, max_len: int) -> Row:
    """000: append a prompt, then one token at a time, per layer."""
    from paged_kv.compat.ndarray_kv import KvCache

    cache = KvCache(LAYERS, HEADS, HEAD_DIM, max_len, block_size=BLOCK)
    for n in [prompt] + [1] * decode:
        for layer in range(LAYERS):
            cache.append_kv(layer, rows(rng, n).astype(np.float64), rows(rng, n).astype(np.float64))
    full = 2 * LAYERS * max_len * HEADS * HEAD_DIM * 8
    return Row(facade="000 ndarray_kv.KvCache", storage="float64", tokens=cache.current_len(),
               held=cache.memory_usage_bytes(), contiguous=full)


def tour_contiguous(rng, prompt: int, decode: int, max_len: int) -> Row:
    """001: store_kv per layer then advance, token by token; speculative rollback with truncate."""
    from paged_kv.compat.contiguous import KvCache

    cache = KvCache(LAYERS, max_len, KV_DIM, num_kv_heads=HEADS, block_size=BLOCK)
    for _ in range(prompt + decode + 5):
        for layer in range(LAYERS):
            cache.store_kv(layer, rng.standard_normal(KV_DIM), rng.standard_normal(KV_DIM))
        cache.advance()
    cache.truncate(prompt + decode)  # five draft tokens rejected
    payload = cache.to_payload().to_bytes()  # safetensors bytes, restorable anywhere
    assert len(payload) > 2 * LAYERS * cache.seq_len() * KV_DIM * 4
    return Row(facade="001 contiguous.KvCache", storage="float32", tokens=cache.seq_len(),
               held=cache.memory_usage_bytes(), contiguous=2 * LAYERS * max_len * KV_DIM * 4)


def tour_compressed(rng, prompt: int, decode: int, max_len: int) -> Row:
    """002: one MultiHeadKvCache per layer, all sharing one pool; push_token per token."""
    from paged_kv.compat.compressed import KvCacheConfig, MultiHeadKvCache, compressed_pool

    config = KvCacheConfig(HEAD_DIM, 4, 64, 7)
    pool = compressed_pool(config, block_size=BLOCK)
    caches = [MultiHeadKvCache(HEADS, config, pool=pool) for _ in range(LAYERS)]
    for _ in range(prompt + decode):
        for cache in caches:
            cache.push_token(rows(rng, 1)[0], rows(rng, 1)[0])
    held = sum(cache.nbytes for cache in caches)
    full = 2 * LAYERS * HEADS * max_len * config.record_bytes
    return Row(facade="002 compressed.MultiHeadKvCache", storage=f"{config.bits}-bit codes + QJL",
               tokens=caches[0].len(), held=held, contiguous=full)


def tour_quantized(rng, prompt: int, decode: int, max_len: int) -> Row:
    """003: write_kv per layer and position, INT8 with per-(position, head) scales."""
    from paged_kv.compat.quantized import KVCacheFormat, QuantizedKVCache

    cache = QuantizedKVCache(LAYERS, HEADS, max_len, HEAD_DIM, KVCacheFormat.INT8, block_size=BLOCK)
    fill_quantized(cache, rng, 0, prompt + decode)
    full = 2 * LAYERS * max_len * HEADS * (HEAD_DIM + 4)  # int8 codes + float32 scales
    return Row(facade="003 quantized.QuantizedKVCache", storage="int8 + scales", tokens=cache.seq_len,
               held=cache.memory_usage(), contiguous=full)


def fill_quantized(cache, rng, start: int, end: int) -> None:
    """Write positions ``[start, end)`` of every layer of a QuantizedKVCache."""
    for pos in range(start, end):
        for layer in range(LAYERS):
            cache.write_kv(layer, pos, rng.standard_normal(KV_DIM), rng.standard_normal(KV_DIM))


def tour_dynamic(rng, prompt: int, decode: int, max_len: int) -> Row:
    """004: transformers-style update(layer, key, value) with (batch, heads, seq, head_dim) tensors."""
    from paged_kv.compat.dynamic import KVCache

    cache = KVCache(block_size=BLOCK)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    for n in [prompt] + [1] * decode:
        for layer in range(LAYERS):
            k, v = torch.randn(2, 1, HEADS, n, HEAD_DIM, generator=gen)
            cache.update(layer, k, v)
    full = 2 * LAYERS * HEADS * max_len * HEAD_DIM * 4  # a static float32 cache of max_seq_len
    return Row(facade="004 dynamic.KVCache", storage="float32", tokens=cache.seq_len(), held=cache.nbytes,
               contiguous=full)


TOURS: list[Callable[..., Row]] = [tour_ndarray, tour_contiguous, tour_compressed, tour_quantized, tour_dynamic]


def beam_and_window(rng, prompt: int, max_len: int) -> list[Row]:
    """copy() for a beam of 4 (pages shared copy-on-write) and shift_left for a 128-token window."""
    from paged_kv.compat.quantized import KVCacheFormat, QuantizedKVCache

    base = QuantizedKVCache(LAYERS, HEADS, max_len, HEAD_DIM, KVCacheFormat.INT8, block_size=BLOCK)
    fill_quantized(base, rng, 0, prompt)
    beams = [base] + [base.copy() for _ in range(3)]
    for beam in beams:  # each beam decodes its own 3 tokens
        fill_quantized(beam, rng, prompt, prompt + 3)
    pool = base.pool
    used = (pool.manager.gpu.num_blocks - pool.manager.gpu.num_free) * pool.bytes_per_page
    per_copy = 2 * LAYERS * max_len * HEADS * (HEAD_DIM + 4)
    window = QuantizedKVCache(LAYERS, HEADS, max_len, HEAD_DIM, KVCacheFormat.INT8, block_size=BLOCK)
    for pos in range(prompt):
        fill_quantized(window, rng, window.seq_len, window.seq_len + 1)
        if window.seq_len > 128:
            window.shift_left(window.seq_len - 128)
    return [
        Row(facade="003 beam: original + 3 copy()", storage="int8 + scales", tokens=4 * (prompt + 3),
            held=used, contiguous=4 * per_copy),
        Row(facade="003 window 128 via shift_left", storage="int8 + scales", tokens=window.seq_len,
            held=window.memory_usage(), contiguous=per_copy),
    ]


def mib(n: int) -> str:
    """Bytes as MiB with two decimals."""
    return f"{n / 2**20:.2f} MiB"


def table(rows_: list[Row]) -> list[str]:
    """The memory comparison as markdown lines."""
    lines = ["| facade | storage | tokens held | pages held | contiguous at max_seq_len | held / contiguous |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows_:
        lines.append(f"| {r.facade} | {r.storage} | {r.tokens} | {mib(r.held)} | {mib(r.contiguous)} | "
                     f"{r.held / r.contiguous:.1%} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    """Drive every facade, then print (and optionally write) the memory table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--decode", type=int, default=44)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--markdown", help="also write the table (and the command) to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one token at a time: tiny tensors, where intra-op threads only add overhead
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    results = [tour(rng, args.prompt, args.decode, args.max_seq_len) for tour in TOURS]
    results += beam_and_window(rng, args.prompt, args.max_seq_len)
    lines = table(results)
    print("\n".join(lines))
    print(f"\n{LAYERS} layers x {HEADS} KV heads x head_dim {HEAD_DIM}, block_size {BLOCK}, "
          f"max_seq_len {args.max_seq_len}; ran in {time.perf_counter() - started:.1f} s")
    if args.markdown:
        command = "python examples/facades_tour.py " + shlex.join(sys.argv[1:] if argv is None else argv)
        header = [f"Produced by `{command.strip()}` ({LAYERS} layers x {HEADS} KV heads x head_dim {HEAD_DIM}, "
                  f"block_size {BLOCK}, max_seq_len {args.max_seq_len}; pages held = bytes of the pages the "
                  "cache references, scales included).", ""]
        with open(args.markdown, "w") as out:
            out.write("\n".join(header + lines) + "\n")


if __name__ == "__main__":
    main()

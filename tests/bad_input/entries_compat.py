"""Bad-input rows of the compatibility facades: ``paged_kv.compat`` (the pool and the five cache APIs)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from bad_input_machinery import (
    BAD_DTYPE,
    NAN,
    NAN_INF,
    NOT_NEGATIVE,
    OUT_OF_RANGE,
    WRONG_TYPE,
    Arg,
    Entry,
    with_shared_pools,
)
from entries_paged_kv import kv

from paged_kv.compat import compressed, contiguous, dynamic, ndarray_kv, quantized, turboquant
from paged_kv.compat.pool import KVPool, PagedSeq

# a facade's pool=: not a pool, or a pool of another geometry (head_dim 3 fits no facade here)
POOL = Arg("obj", None, bad={WRONG_TYPE: ["x", 3, KVPool(num_layers=1, num_kv_heads=1, head_dim=3, num_blocks=4)]})


# -- subjects --------------------------------------------------------------------------------------
def pool() -> KVPool:
    """A fixed pool of 8 pages of 4 slots."""
    return KVPool(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, num_blocks=8)


def paged_seq() -> PagedSeq:
    """A sequence of 6 positions, written."""
    s = pool().new_seq()
    s.extend(6)
    s.write(0, 0, kv(6), kv(6))
    return s


def ndarray_cache() -> ndarray_kv.KvCache:
    """An ndarray_kv cache of 2 layers, layer 0 holding 3 positions."""
    c = ndarray_kv.KvCache(2, 2, 4, 16, block_size=4)
    c.append_kv(0, torch.ones(3, 2, 4).numpy(), torch.ones(3, 2, 4).numpy())
    return c


def contiguous_cache() -> contiguous.KvCache:
    """A contiguous cache of 2 layers holding one position."""
    c = contiguous.KvCache(2, 16, 8, num_kv_heads=2, block_size=4)
    for layer in range(2):
        c.store_kv(layer, [1.0] * 8, [2.0] * 8)
    c.advance()
    return c


TQ = dict(head_dim=8, bits=3, projections=8, seed=1)


def compressor() -> compressed.KvCacheCompressor:
    """A one-head compressed cache holding one key/value."""
    c = compressed.KvCacheCompressor(turboquant.KvCacheConfig(**TQ), block_size=4)
    c.push([1.0] * 8, [0.5] * 8)
    return c


def multi_head() -> compressed.MultiHeadKvCache:
    """A two-head compressed cache holding one token."""
    c = compressed.MultiHeadKvCache(2, turboquant.KvCacheConfig(**TQ), block_size=4)
    c.push_token([[1.0] * 8] * 2, [[0.5] * 8] * 2)
    return c


def quantized_cache() -> quantized.QuantizedKVCache:
    """An INT8 cache of 2 layers, position 0 written."""
    c = quantized.QuantizedKVCache(2, 2, 16, 4, "INT8", block_size=4)
    c.write_kv(0, 0, [1.0] * 8, [2.0] * 8)
    return c


def dynamic_cache() -> dynamic.KVCache:
    """A transformers-style cache: layer 0 holds 3 positions of 2 rows."""
    c = dynamic.KVCache(block_size=4)
    c.update(0, torch.ones(2, 2, 3, 4), torch.ones(2, 2, 3, 4))
    return c


def dyn_kv(seq: int = 1) -> torch.Tensor:
    """``(batch=2, heads=2, seq, head_dim=4)`` states."""
    return torch.ones(2, 2, seq, 4)


def pool_of(dtype: torch.dtype, num_layers: int = 2) -> Callable[[], KVPool]:
    """A factory of empty growable pools of the facades' geometry (2 KV heads of 4, blocks of 4)."""
    return lambda: KVPool(num_layers=num_layers, num_kv_heads=2, head_dim=4, dtype=dtype, block_size=4)


# A constructor that raises must leave a pool it was given as it was (no sequence, no page taken).
SHARED_POOLS: dict[str, Callable[[], KVPool]] = {
    "paged_kv.compat.ndarray_kv.KvCache": pool_of(torch.float64),
    "paged_kv.compat.contiguous.KvCache": pool_of(torch.float32),
    "paged_kv.compat.quantized.QuantizedKVCache": pool_of(torch.int8),
    "paged_kv.compat.compressed.KvCacheCompressor": lambda: compressed.compressed_pool(
        turboquant.KvCacheConfig(**TQ), block_size=4
    ),
    "paged_kv.compat.compressed.MultiHeadKvCache": lambda: compressed.compressed_pool(
        turboquant.KvCacheConfig(**TQ), block_size=4
    ),
    "paged_kv.compat.dynamic.KVCache": pool_of(torch.float32, num_layers=1),
}


def entries() -> list[Entry]:
    """The facades' entry points with a valid call, and their constructors again over a shared pool."""
    return with_shared_pools(_rows(), SHARED_POOLS)


def _rows() -> list[Entry]:
    """The entries, as a table."""
    # a table: one entry point per entry, its arguments side by side
    # fmt: off
    return [
        # ---- paged_kv.compat.pool -----------------------------------------------------------------------
        Entry("paged_kv.compat.pool.KVPool", KVPool, {
            "num_layers": Arg("int", 1, bad={OUT_OF_RANGE: [0]}),
            "num_kv_heads": Arg("int", 2, bad={OUT_OF_RANGE: [0]}),
            "head_dim": Arg("int", 4, bad={OUT_OF_RANGE: [0]}), "dtype": Arg("dtype", torch.float32),
            "block_size": Arg("int", 4, bad={OUT_OF_RANGE: [0]}),
            "num_blocks": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            "device": Arg("device", "cpu")}),
        Entry("paged_kv.compat.pool.KVPool.add_layers", "add_layers", {"num_layers": Arg("int", 1)}, pool),
        Entry("paged_kv.compat.pool.KVPool.ensure_free", "ensure_free",
            {"num_blocks": Arg("int", 2, bad={OUT_OF_RANGE: [-1, 9]})}, pool),
        Entry("paged_kv.compat.pool.KVPool.compatible", "compatible", {
            "num_layers": Arg("int", 2, bad={OUT_OF_RANGE: [3]}), "head_dim": Arg("int", 4, bad={OUT_OF_RANGE: [5]})},
                pool),
        Entry("paged_kv.compat.pool.PagedSeq", PagedSeq, {
            "pool": Arg("obj", pool), "parent": Arg("obj", None, bad={WRONG_TYPE: ["x", 3]})}),
        Entry("paged_kv.compat.pool.PagedSeq.extend", "extend", {"n": Arg("int", 2, bad={OUT_OF_RANGE: [-1, 1000]})},
            paged_seq),
        Entry("paged_kv.compat.pool.PagedSeq.pages_to_append", "pages_to_append",
            {"n": Arg("int", 2, bad=NOT_NEGATIVE)}, paged_seq),
        Entry("paged_kv.compat.pool.PagedSeq.truncate", "truncate", {"n": Arg("int", 2, bad={OUT_OF_RANGE: [-1, 7]})},
            paged_seq),
        Entry("paged_kv.compat.pool.PagedSeq.drop_front", "drop_front",
            {"num_pages": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 3]})}, paged_seq),
        Entry("paged_kv.compat.pool.PagedSeq.read", "read", {
            "layer": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 2]}), "start": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 5]}),
            "end": Arg("opt_int", 4, bad={OUT_OF_RANGE: [-1, 7]}), "dtype": Arg("dtype", torch.float32)}, paged_seq),
        Entry("paged_kv.compat.pool.PagedSeq.write", "write", {
            "layer": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 2]}), "start": Arg("int", 2, bad={OUT_OF_RANGE: [-1, 5]}),
            "key": Arg("tensor", lambda: kv(2)), "value": Arg("tensor", lambda: kv(2))}, paged_seq),
        # ---- paged_kv.compat facades ------------------------------------------------------------------
        Entry("paged_kv.compat.ndarray_kv.KvCache", ndarray_kv.KvCache, {
            "num_layers": Arg("int", 2, bad={OUT_OF_RANGE: [0, -1]}),
            "num_heads": Arg("int", 2, bad={OUT_OF_RANGE: [0]}),
            "head_dim": Arg("int", 4, bad={OUT_OF_RANGE: [0]}), "max_seq_len": Arg("int", 8, bad=NOT_NEGATIVE),
            "block_size": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0, 1 << 62]}), "device": Arg("device", "cpu"),
            "pool": POOL}),
        Entry("paged_kv.compat.ndarray_kv.KvCache.append_kv", "append_kv", {
            "layer": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 2]}),
            "new_k": Arg("float_tensor", lambda: torch.ones(2, 2, 4, dtype=torch.float64), skip=(NAN_INF, BAD_DTYPE)),
            "new_v": Arg("float_tensor", lambda: torch.ones(2, 2, 4, dtype=torch.float64), skip=(NAN_INF, BAD_DTYPE))},
            ndarray_cache),  # any real dtype is converted to float64; NaN is data to this documented API
        Entry("paged_kv.compat.ndarray_kv.KvCache.get_kv", "get_kv", {"layer": Arg("int", 1, skip=(OUT_OF_RANGE,))},
            ndarray_cache),
        Entry("paged_kv.compat.contiguous.KvCache", contiguous.KvCache, {
            "num_layers": Arg("int", 2, bad={OUT_OF_RANGE: [0, -1]}), "max_seq_len": Arg("int", 8, bad=NOT_NEGATIVE),
            "kv_dim": Arg("int", 8, bad={OUT_OF_RANGE: [0, -1]}),
            "num_kv_heads": Arg("opt_int", 2, bad={OUT_OF_RANGE: [0, 3]}),
            "block_size": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0]}), "device": Arg("device", "cpu"),
            "pool": POOL}),
        Entry("paged_kv.compat.contiguous.KvCache.store_kv", "store_kv", {
            "layer": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 2]}),
            "key": Arg("float_tensor", lambda: torch.ones(8), skip=(NAN_INF, BAD_DTYPE)),
            "value": Arg("float_tensor", lambda: torch.ones(8), skip=(NAN_INF, BAD_DTYPE))}, contiguous_cache),
        *[Entry(f"paged_kv.compat.contiguous.KvCache.{name}", name,
            {"layer": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 2]})},
                contiguous_cache) for name in ("get_keys", "get_values")],
        *[Entry(f"paged_kv.compat.contiguous.KvCache.{name}", name, {
            "layer": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 2]}), "f": Arg("obj", lambda: lambda i, x: None)},
            contiguous_cache) for name in ("for_each_key", "for_each_value")],
        Entry("paged_kv.compat.contiguous.KvCache.truncate", "truncate", {"n": Arg("int", 0, bad=NOT_NEGATIVE)},
            contiguous_cache),
        Entry("paged_kv.compat.contiguous.KvCache.restore_from_snapshot", "restore_from_snapshot", {
            "keys": Arg("obj", lambda: [[1.0] * 8] * 2,
                bad={WRONG_TYPE: [None, 3, [[1.0] * 8]], NAN_INF: [[[NAN] * 8] * 2]},
                        skip=(NAN_INF,)),
            "values": Arg("obj", lambda: [[1.0] * 8] * 2, bad={WRONG_TYPE: [None, 3, [[1.0] * 7] * 2]}),
            "seq_len": Arg("int", 1)}, contiguous_cache),
        Entry("paged_kv.compat.contiguous.KvCache.restore_from_payload", "restore_from_payload", {
            "payload": Arg("obj", lambda: contiguous_cache().to_payload(), bad={
                WRONG_TYPE: [None, "x", contiguous.KvCache(1, 4, 8).to_payload()]})}, contiguous_cache),
        Entry("paged_kv.compat.contiguous.KvStatePayload", contiguous.KvStatePayload, {
            "num_layers": Arg("int", 1, bad={OUT_OF_RANGE: [0, -1]}),
            "kv_dim": Arg("int", 2, bad={OUT_OF_RANGE: [0, -1]}),
            "seq_len": Arg("int", 1, bad=NOT_NEGATIVE),
            "keys": Arg("obj", [[1.0, 2.0]], bad={WRONG_TYPE: [None, 3, [[1.0]]]}),
            "values": Arg("obj", [[1.0, 2.0]], bad={WRONG_TYPE: [None, [[True, False]]]})}),
        Entry("paged_kv.compat.contiguous.KvStatePayload.from_bytes", contiguous.KvStatePayload.from_bytes, {
            "data": Arg("obj", lambda: contiguous_cache().to_payload().to_bytes(),
                bad={WRONG_TYPE: [None, "x", 3, b"junk"]})}),
        Entry("paged_kv.compat.turboquant.KvCacheConfig", turboquant.KvCacheConfig, {
            "head_dim": Arg("int", 8, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            "bits": Arg("int", 3, bad={OUT_OF_RANGE: [0, 17]}),
            "projections": Arg("int", 8, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            "seed": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 1 << 64]})}),
        Entry("paged_kv.compat.compressed.compressed_pool", compressed.compressed_pool, {
            "config": Arg("obj", lambda: turboquant.KvCacheConfig(**TQ), bad={WRONG_TYPE: [None, TQ]}),
            "block_size": Arg("int", 4, bad={OUT_OF_RANGE: [0]}),
            "num_blocks": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0]}),
            "device": Arg("device", "cpu")}),
        Entry("paged_kv.compat.compressed.KvCacheCompressor", compressed.KvCacheCompressor, {
            "config": Arg("obj", lambda: turboquant.KvCacheConfig(**TQ), bad={WRONG_TYPE: [None, TQ]}),
            "block_size": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0]}), "device": Arg("device", "cpu"),
            "pool": POOL}),
        Entry("paged_kv.compat.compressed.KvCacheCompressor.push", "push", {
            "key": Arg("float_tensor", lambda: torch.ones(8), skip=(BAD_DTYPE,)),
            "value": Arg("float_tensor", lambda: torch.ones(8), skip=(BAD_DTYPE,))}, compressor),
        Entry("paged_kv.compat.compressed.KvCacheCompressor.attention_scores", "attention_scores", {
            "query": Arg("float_tensor", lambda: torch.ones(8), skip=(BAD_DTYPE,))}, compressor),
        *[Entry(f"paged_kv.compat.compressed.KvCacheCompressor.{name}", name, {"with_residual": Arg("bool", True)},
            compressor)
          for name in ("decode_keys", "decode_values")],
        Entry("paged_kv.compat.compressed.KvCacheCompressor.evict_outside_window", "evict_outside_window",
              {"window_size": Arg("int", 1, bad=NOT_NEGATIVE)}, compressor),
        Entry("paged_kv.compat.compressed.MultiHeadKvCache", compressed.MultiHeadKvCache, {
            "num_heads": Arg("int", 2, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            "config": Arg("obj", lambda: turboquant.KvCacheConfig(**TQ), bad={WRONG_TYPE: [None, TQ]}),
            "block_size": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0]}), "device": Arg("device", "cpu"),
            "pool": POOL}),
        Entry("paged_kv.compat.compressed.MultiHeadKvCache.push_token", "push_token", {
            "keys": Arg("float_tensor", lambda: torch.ones(2, 8), skip=(BAD_DTYPE,)),
            "values": Arg("float_tensor", lambda: torch.ones(2, 8), skip=(BAD_DTYPE,))}, multi_head),
        Entry("paged_kv.compat.compressed.MultiHeadKvCache.attention_scores", "attention_scores", {
            "queries": Arg("float_tensor", lambda: torch.ones(2, 8), skip=(BAD_DTYPE,))}, multi_head),
        Entry("paged_kv.compat.compressed.MultiHeadKvCache.head", "head",
            {"index": Arg("int", 1, skip=(OUT_OF_RANGE,))}, multi_head),
        Entry("paged_kv.compat.compressed.MultiHeadKvCache.evict_outside_window", "evict_outside_window",
              {"window_size": Arg("int", 1, bad=NOT_NEGATIVE)}, multi_head),
        Entry("paged_kv.compat.quantized.QuantizedKVCache", quantized.QuantizedKVCache, {
            "num_layers": Arg("int", 2, bad={OUT_OF_RANGE: [0, -1]}),
            "num_kv_heads": Arg("int", 2, bad={OUT_OF_RANGE: [0]}),
            "max_seq_len": Arg("int", 8, bad=NOT_NEGATIVE), "head_dim": Arg("int", 4, bad={OUT_OF_RANGE: [0]}),
            "format": Arg("obj", "INT8", bad={WRONG_TYPE: [None, 3, "int4", torch.int8]}),
            "block_size": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0]}), "device": Arg("device", "cpu"),
            "pool": POOL}),
        Entry("paged_kv.compat.quantized.QuantizedKVCache.write_kv", "write_kv", {
            "layer": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 2]}), "pos": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 16]}),
            "k_data": Arg("float_tensor", lambda: torch.ones(8), skip=(BAD_DTYPE,)),
            "v_data": Arg("float_tensor", lambda: torch.ones(8), skip=(BAD_DTYPE,))}, quantized_cache),
        *[Entry(f"paged_kv.compat.quantized.QuantizedKVCache.{name}", name, {
            "layer": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 2]}), "head": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 2]}),
            "pos": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 1]})}, quantized_cache) for name in ("read_k", "read_v")],
        *[Entry(f"paged_kv.compat.quantized.QuantizedKVCache.{name}", name, {
            "layer": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 2]}), "head": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 2]}),
            "start_pos": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 2]}),
            "end_pos": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 2]})},
            quantized_cache) for name in ("read_k_range", "read_v_range")],
        Entry("paged_kv.compat.quantized.QuantizedKVCache.truncate", "truncate",
            {"new_len": Arg("int", 0, bad=NOT_NEGATIVE)},
              quantized_cache),
        Entry("paged_kv.compat.quantized.QuantizedKVCache.shift_left", "shift_left",
            {"amount": Arg("int", 1, bad=NOT_NEGATIVE)},
              quantized_cache),
        Entry("paged_kv.compat.dynamic.KVCache", dynamic.KVCache, {
            "pool": Arg("obj", None, bad={WRONG_TYPE: ["x", 3]}),
            "block_size": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0]}),
            "device": Arg("device", "cpu"), "dtype": Arg("dtype", torch.float32)}),
        Entry("paged_kv.compat.dynamic.KVCache.with_num_layers", dynamic.KVCache.with_num_layers, {
            "num_layers": Arg("int", 2, bad={OUT_OF_RANGE: [-1, 1 << 62]}),
            "block_size": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0]}),
            "device": Arg("device", "cpu")}),
        Entry("paged_kv.compat.dynamic.KVCache.get", "get", {"layer_idx": Arg("int", 0, skip=(OUT_OF_RANGE,))},
            dynamic_cache),
        Entry("paged_kv.compat.dynamic.KVCache.update", "update", {
            "layer_idx": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 1 << 62]}),
            "key": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)), "value": Arg("float_tensor", dyn_kv, skip=(NAN_INF,))},
            dynamic_cache),  # NaN states are the model's business (transformers caches store them)
        Entry("paged_kv.compat.dynamic.KVCache.select_rows", "select_rows", {
            "indices": Arg("ids", [1, 0], bad={OUT_OF_RANGE: [[-1], [2]], WRONG_TYPE: ["ab", None, []]})},
                dynamic_cache),
        Entry("paged_kv.compat.dynamic.KVCache.truncate", "truncate", {
            "new_len": Arg("int", 1, bad=NOT_NEGATIVE), "layer_idx": Arg("opt_int", 0, bad={OUT_OF_RANGE: [-1, 5]})},
                dynamic_cache),
        Entry("paged_kv.compat.dynamic.KVCache.droppable_pages", "droppable_pages", {
            "keep_last": Arg("int", 1, bad=NOT_NEGATIVE)}, dynamic_cache),
        Entry("paged_kv.compat.dynamic.KVCache.drop_front", "drop_front", {
            "num_pages": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 1]})},
                dynamic_cache),  # 3 positions: no whole page to drop
        Entry("paged_kv.compat.dynamic.KVCacheEntry", dynamic.KVCacheEntry, {
            "key": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)), "value": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)),
            "block_size": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0]}), "device": Arg("device", "cpu")}),
        # KVCacheEntry.update delegates to KVCache.update, whose errors name the states key / value
        Entry("paged_kv.compat.dynamic.KVCacheEntry.update", "update", {
            "new_key": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)),
            "new_value": Arg("float_tensor", dyn_kv, skip=(NAN_INF,))},
            lambda: dynamic.KVCacheEntry(dyn_kv(2), dyn_kv(2), block_size=4),
                named={"new_key": "key", "new_value": "value"}),
    ]
    # fmt: on


# Public names that are not entry points for bad input, each with the reason.
EXEMPT: dict[str, str] = {
    "paged_kv.compat.contiguous.KvCacheSnapshot": "a record snapshot() builds; restore_from_snapshot checks its parts",
    "paged_kv.compat.contiguous.KvCacheAccess": "an abstract interface (ABC): its methods are rows of KvCache",
    "paged_kv.compat.quantized.KVCacheFormat": (
        "an Enum: KVCacheFormat('x') is Python's Enum lookup; the facade's format argument (names too) is a row"
    ),
}

"""Bad-input rows of the allocator and the paged storage: ``paged_kv.BlockManager*`` and ``paged_kv.kv_cache``."""

from __future__ import annotations

import torch
from bad_input_machinery import (
    BAD_ID,
    BOOL_FOR_INT,
    INF,
    NAN,
    NAN_INF,
    NONINTEGRAL,
    NOT_NEGATIVE,
    OUT_OF_RANGE,
    WRONG_TYPE,
    Arg,
    Entry,
)

from paged_kv import BlockHashes, BlockManager, BlockManagerConfig
from paged_kv.host_tier import BlockRecord
from paged_kv.kv_cache import KVCacheSpec, PagedKVCache


# -- subjects --------------------------------------------------------------------------------------
def manager() -> BlockManager:
    """gpu 8 blocks of 4, cpu 4: 'a' = 6 tokens, 'b' its fork, 's' swapped out."""
    m = BlockManager(BlockManagerConfig(num_blocks=8, block_size=4, num_cpu_blocks=4, watermark=0.0))
    m.allocate("a", list(range(6)))
    m.fork("a", "b")
    m.allocate("s", list(range(10, 15)))
    m.swap_out(["s"])
    return m


def pinned() -> BlockManager:
    """``manager()`` with 'q' pinning the cached block of ids 0..3."""
    m = manager()
    m.pin("q", list(range(5)))
    return m


def tiered() -> BlockManager:
    """8 device blocks of 4 over a 4-block host tier; ids 0..8 were computed and freed (2 cached blocks)."""
    m = BlockManager(BlockManagerConfig(num_blocks=8, block_size=4, watermark=0.0, num_host_blocks=4))
    m.allocate("a", list(range(9)))
    m.free("a")
    return m


def record() -> BlockRecord:
    """A block a lower tier could hold: ids 8..11 chained after ids 0..7."""
    h = stream(12)
    return BlockRecord(h.hashes[2], h.hashes[1], h.contents[2])


def bad_records() -> list[list[BlockRecord]]:
    """Records whose fields a block pool cannot index: a hash or parent not 32 bytes, tokens not one block of int64."""
    r = record()
    return [[BlockRecord(None, r.parent, r.tokens)], [BlockRecord(r.hash.hex(), r.parent, r.tokens)],
            [BlockRecord(r.hash, r.parent[:8], r.tokens)], [BlockRecord(r.hash, r.parent, r.tokens[:8])],
            [r, BlockRecord(r.hash, r.parent, list(r.tokens))]]


def stream(num_tokens: int = 5, cache_salt: str | None = None, block_size: int = 4) -> BlockHashes:
    """The hashes of ids ``0..num_tokens-1`` (the manager's prompts start so)."""
    h = BlockHashes(block_size, cache_salt=cache_salt)
    h.extend(list(range(num_tokens)))
    return h


# a kept hashes argument that is None or a BlockHashes of the manager's block size (4) and the call's salt
SALT = {WRONG_TYPE: [3, ["x"], 1.5]}  # a cache salt is a str, or bytes (the engine's own keys: a LoRA adapter's)
OTHER_STREAMS = {WRONG_TYPE: ["x", 3, [b"h" * 32]], BAD_ID: [BlockHashes(8), BlockHashes(4, cache_salt="other")]}


SPEC = dict(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)


def spec(dtype: torch.dtype = torch.float32) -> KVCacheSpec:
    """A small cache geometry."""
    return KVCacheSpec(**SPEC, dtype=dtype)


def cache(dtype: torch.dtype = torch.float32) -> PagedKVCache:
    """8 blocks, written with a ramp so copies are visible."""
    c = PagedKVCache(spec(dtype), 8)
    for t in c.tensors():
        t.copy_(torch.arange(t.numel()).reshape(t.shape).to(t.dtype))
    return c


def kv(n: int = 2, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """K or V of ``n`` tokens ``[n, H, D]``."""
    return torch.ones(n, SPEC["num_kv_heads"], SPEC["head_dim"], dtype=dtype)


def entries() -> list[Entry]:
    """The block manager's and the paged KV cache's entry points, each with a valid call."""
    seq_id = lambda v: Arg("seq_id", v)  # noqa: E731
    m = manager
    # a table: one entry point per entry, its arguments side by side
    # fmt: off
    return [
        # ---- paged_kv ----------------------------------------------------------------------------
        Entry("paged_kv.BlockManager", BlockManager, {"config": Arg("obj", lambda: BlockManagerConfig(num_blocks=4)),
                                                      "track_changes": Arg("bool", True)}),
        Entry("paged_kv.BlockManagerConfig", BlockManagerConfig, {
            "num_blocks": Arg("int", 8, bad={OUT_OF_RANGE: [0, -1, 1 << 62]}),
            "block_size": Arg("int", 4, bad={OUT_OF_RANGE: [0, 1 << 20]}),
            "num_cpu_blocks": Arg("int", 0), "watermark": Arg("real", 0.01, bad={OUT_OF_RANGE: [1.0, -0.5]}),
            "enable_prefix_caching": Arg("bool", True), "num_host_blocks": Arg("int", 0),
            "host_store": Arg("obj", "evict", bad={WRONG_TYPE: [None, 3, "lru"]}),
            "track_cache_events": Arg("bool", False)}),
        Entry("paged_kv.BlockManager.pin", "pin", {
            "pin_id": Arg("new_seq_id", "p", bad={BAD_ID: [["l"], "q"]}),
            "token_ids": Arg("ids", [0, 1, 2, 3, 4], bad={WRONG_TYPE: ["ab", {1: 2}, None, 3]}),
            "cache_salt": Arg("opt_str", None, bad=SALT)}, pinned),
        Entry("paged_kv.BlockManager.unpin", "unpin", {"pin_id": Arg("seq_id", "q")}, pinned),
        Entry("paged_kv.BlockManager.reset_prefix_cache", "reset_prefix_cache", {
            "keep_pinned": Arg("bool", True)}, pinned),
        Entry("paged_kv.BlockManager.num_pinned_blocks_apart", "num_pinned_blocks_apart", {
            "token_ids": Arg("ids", [0, 1, 2, 3, 9]), "cache_salt": Arg("opt_str", None, bad=SALT)}, pinned),
        Entry("paged_kv.BlockManager.chain_past_cache", "chain_past_cache", {
            "token_ids": Arg("ids", [0, 1, 2, 3, 4, 5, 6, 7, 8]), "cache_salt": Arg("opt_str", None, bad=SALT),
            "hashes": Arg("obj", lambda: stream(9), bad=OTHER_STREAMS)}, tiered),
        Entry("paged_kv.BlockManager.fill_host", "fill_host", {
            "records": Arg("obj", lambda: [record()], bad={WRONG_TYPE: [None, "x", 3, ["x"], [(b"h", b"p", b"t")],
                                                                   *bad_records()]}),
            "payload": Arg("obj", None, skip=(WRONG_TYPE,))}, tiered),  # the reader's data: opaque to the manager
        Entry("paged_kv.BlockManager.add_blocks", "add_blocks", {"num_blocks": Arg("int", 2)}, m),
        Entry("paged_kv.BlockManager.allocate", "allocate", {
            "seq_id": Arg("new_seq_id", "n", bad={BAD_ID: [["l"], "a", "s"]}), "token_ids": Arg("ids", [0, 1, 2]),
            "cache_salt": Arg("opt_str", None, bad=SALT), "hashes": Arg("obj", lambda: stream(2), bad=OTHER_STREAMS),
            "num_lookahead_slots": Arg("int", 0),
            "num_queried": Arg("opt_int", 5, bad={OUT_OF_RANGE: [2, -1, 1 << 62]}),  # at least the 3 tokens
            "priority": Arg("int", -3, bad={OUT_OF_RANGE: [1 << 63, -(1 << 63) - 1]})}, m),  # any int64 (vLLM's)
        Entry("paged_kv.BlockManager.append", "append", {
            "seq_id": Arg("seq_id", "a", bad={BAD_ID: [["l"], "zz", "s"]}), "token_ids": Arg("ids", [7]),
            "num_lookahead_slots": Arg("int", 0)}, m),
        Entry("paged_kv.BlockManager.block_table", "block_table", {
            "seq_id": seq_id("a"), "start": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 99]})}, m),
        Entry("paged_kv.BlockManager.num_tokens", "num_tokens", {"seq_id": seq_id("a")}, m),
        Entry("paged_kv.BlockManager.is_swapped", "is_swapped", {"seq_id": seq_id("s")}, m),
        Entry("paged_kv.BlockManager.free", "free", {"seq_id": seq_id("a")}, m),
        Entry("paged_kv.BlockManager.append_all", "append_all", {
            "requests": Arg("obj", [("a", [7]), ("b", [8])], bad={
                WRONG_TYPE: [None, "ab", 3, [("a",)]], BAD_ID: [[("zz", [7])], [("s", [7])], [("a", [7]), ("a", [8])]],
                BOOL_FOR_INT: [[("a", [True])]], NONINTEGRAL: [[("a", [1.5])]], OUT_OF_RANGE: [[("a", [-1])]]})}, m,
            named={"requests": ("requests", "seq_id", "token_ids")}),
        Entry("paged_kv.BlockManager.can_append_all", "can_append_all", {
            "requests": Arg("obj", [("a", 1), ("b", 2)], bad={
                WRONG_TYPE: [None, "ab", 3, [("a",)], ["a1"]], BOOL_FOR_INT: [[("a", True)]], NAN_INF: [[("a", NAN)]],
                BAD_ID: [[("zz", 1)], [("s", 1)], [(["l"], 1)], [("a", 1), ("a", 2)]],
                NONINTEGRAL: [[("a", 1.5)]], OUT_OF_RANGE: [[("a", -1)]]})}, m,
            named={"requests": ("requests", "seq_id", "num_new_tokens")}),  # errors name the pair's field
        *[Entry(f"paged_kv.BlockManager.{name}", name, {"seq_ids": Arg("obj", valid, bad={
            WRONG_TYPE: [None, "ab", 3], BAD_ID: [["zz"], [["l"]], *extra]})}, m,
            named={"seq_ids": ("seq_ids", "seq_id")})
          for name, valid, extra in (
              ("swap_out", ["a", "b"], [["s"], ["a", "a"]]), ("swap_in", ["s"], [["a"], ["s", "s"]]),
              # a query about a sequence in the other state answers False: only unknown ids are bad
              ("can_swap_out", ["a", "b"], [["s"]]), ("can_swap_in", ["s"], []))],
        Entry("paged_kv.BlockManager.can_allocate", "can_allocate", {
            "token_ids": Arg("ids", [0, 1]), "cache_salt": Arg("opt_str", None, bad=SALT),
            "hashes": Arg("obj", lambda: stream(2), bad=OTHER_STREAMS), "num_lookahead_slots": Arg("int", 0)}, m),
        Entry("paged_kv.BlockManager.num_cached_tokens", "num_cached_tokens", {
            "token_ids": Arg("ids", [0, 1, 2, 3, 4]), "cache_salt": Arg("opt_str", "t", bad=SALT),
            "hashes": Arg("obj", lambda: stream(5, "t"), bad={**OTHER_STREAMS, BAD_ID: [BlockHashes(4)]})}, m),
        Entry("paged_kv.BlockManager.admission", "admission", {
            "requests": Arg("obj", lambda: [([0, 1, 2, 3, 4], stream(5)), (3, None)], bad={
                WRONG_TYPE: [None, 3, [([1],)], [("ab", None)], [([1], "x")], [(3.5, None)]],
                BOOL_FOR_INT: [[([True], None)]], NONINTEGRAL: [[([1.5], None)]], OUT_OF_RANGE: [[([-1], None)]],
                BAD_ID: [[([1], BlockHashes(8))], [([1], BlockHashes(4, cache_salt="t"))]]}),
            "cache_salt": Arg("opt_str", None, bad=SALT)}, m,
            named={"requests": ("requests", "token_ids", "hashes")}),  # errors name the pair's field
        Entry("paged_kv.Admission.fits", "fits", {
            "num_tokens": Arg("obj", [5, 3], bad={
                WRONG_TYPE: [None, 3, "ab", [5], [5, 3, 1]], BOOL_FOR_INT: [[True, 3]], NONINTEGRAL: [[5, 2.5]],
                NAN_INF: [[5, NAN]], OUT_OF_RANGE: [[3, 3], [6, 3], [5, 4], [5, -1]]})},
              lambda: manager().admission([([0, 1, 2, 3, 4], None), (3, None)])),  # cached: (4, 0)
        Entry("paged_kv.BlockHashes", BlockHashes, {
            "block_size": Arg("int", 4, bad={OUT_OF_RANGE: [0, -1, 1 << 62]}),
            "cache_salt": Arg("opt_str", "t", bad=SALT)}),
        Entry("paged_kv.BlockHashes.extend", "extend", {
            "token_ids": Arg("ids", [5, 6, 7, 8], bad={WRONG_TYPE: ["ab", {1: 2}, None, 3]})}, stream),
        Entry("paged_kv.BlockHashes.copy", "copy", {
            "num_tokens": Arg("opt_int", 3, bad={OUT_OF_RANGE: [-1, 6]})}, stream),
        Entry("paged_kv.BlockHashes.drop_front", "drop_front", {
            "num_blocks": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 2]})}, stream),
        # a huge count is a valid question (the answer is "no" / a large number): only a negative one is bad
        Entry("paged_kv.BlockManager.can_append", "can_append", {
            "seq_id": seq_id("a"), "num_new_tokens": Arg("int", 1, bad=NOT_NEGATIVE),
            "num_lookahead_slots": Arg("int", 0)}, m),
        Entry("paged_kv.BlockManager.num_blocks_to_append", "num_blocks_to_append", {
            "seq_id": seq_id("a"), "num_new_tokens": Arg("int", 1, bad=NOT_NEGATIVE),
            "num_lookahead_slots": Arg("int", 0)}, m),
        Entry("paged_kv.BlockManager.num_blocks_to_write_all", "num_blocks_to_write_all", {
            "requests": Arg("obj", [("a", 0, 6)], bad={
                WRONG_TYPE: [None, 3, [("a", 1)]], BOOL_FOR_INT: [[("a", False, 2)]], NONINTEGRAL: [[("a", 0, 2.5)]],
                NAN_INF: [[("a", 0, INF)]], OUT_OF_RANGE: [[("a", 3, 1)], [("a", -1, 2)]], BAD_ID: [[("zz", 0, 1)]]})},
                    m,
              named={"requests": ("requests", "seq_id", "start", "end")}),  # errors name the triple's field
        Entry("paged_kv.BlockManager.can_prepare_write", "can_prepare_write", {
            "seq_id": seq_id("a"), "start": Arg("int", 1), "end": Arg("int", 5)}, m),
        Entry("paged_kv.BlockManager.prepare_write", "prepare_write", {
            "seq_id": seq_id("a"), "start": Arg("int", 1), "end": Arg("int", 5)}, m),
        Entry("paged_kv.BlockManager.drop_front", "drop_front", {"seq_id": seq_id("a"), "num_blocks": Arg("int", 1)},
            m),
        Entry("paged_kv.BlockManager.truncate", "truncate", {"seq_id": seq_id("a"), "num_tokens": Arg("int", 2)}, m),
        Entry("paged_kv.BlockManager.fork", "fork", {
            "parent_id": Arg("seq_id", "a", bad={BAD_ID: [["l"], "zz", "s"]}),
            "child_id": Arg("new_seq_id", "c", bad={BAD_ID: [["l"], "b"]}),
            "num_tokens": Arg("opt_int", 5, bad={OUT_OF_RANGE: [-1, 7]}),
            "hashes": Arg("obj", lambda: stream(6), bad={**OTHER_STREAMS, OUT_OF_RANGE: [stream(4)]})}, m,
              named={"parent_id": ("parent_id", "seq_id")}),  # the manager's lookup names any id it cannot find seq_id
        # ---- paged_kv.kv_cache / batch -------------------------------------------------------------
        Entry("paged_kv.kv_cache.KVCacheSpec", KVCacheSpec, {
            "num_layers": Arg("int", 2, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            "num_kv_heads": Arg("int", 2, bad={OUT_OF_RANGE: [0]}),
            "head_dim": Arg("int", 4, bad={OUT_OF_RANGE: [0]}), "block_size": Arg("int", 4, bad={OUT_OF_RANGE: [0]}),
            "dtype": Arg("dtype", torch.float16)}),
        Entry("paged_kv.kv_cache.KVCacheSpec.num_blocks_for_bytes", "num_blocks_for_bytes",
              {"budget_bytes": Arg("int", 1 << 20, bad={OUT_OF_RANGE: [-1, 1]})}, spec),
        Entry("paged_kv.kv_cache.PagedKVCache", PagedKVCache, {
            "spec": Arg("obj", spec, bad={WRONG_TYPE: [None, SPEC]}),
            "num_blocks": Arg("int", 4, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            "device": Arg("device", "cpu"), "pin_memory": Arg("bool", False)}),
        Entry("paged_kv.kv_cache.PagedKVCache.read_blocks", "read_blocks", {
            "blocks": Arg("ids", [1, 3], bad={OUT_OF_RANGE: [[-1], [8], [1 << 40]], BAD_ID: [[1, 1]]})}, cache),
        Entry("paged_kv.kv_cache.PagedKVCache.write_blocks", "write_blocks", {
            "blocks": Arg("ids", [1, 3], bad={OUT_OF_RANGE: [[-1, 3], [8, 3]], BAD_ID: [[1, 1]]}),
            "kv": Arg("tensor", lambda: cache().read_blocks([0, 2])[0]),
            "scales": Arg("obj", None, bad={WRONG_TYPE: [torch.ones(2, 2, 2, 4, 2)]})}, cache),
        Entry("paged_kv.kv_cache.PagedKVCache.from_bytes", PagedKVCache.from_bytes, {
            "spec": Arg("obj", spec, bad={WRONG_TYPE: [None, SPEC]}),
            "budget_bytes": Arg("int", 4096, bad={OUT_OF_RANGE: [-1, 2]}),
            "device": Arg("device", "cpu")}),
        Entry("paged_kv.kv_cache.PagedKVCache.add_layers", "add_layers", {"num_layers": Arg("int", 1)}, cache),
        Entry("paged_kv.kv_cache.PagedKVCache.grow", "grow", {"num_blocks": Arg("int", 2)}, cache),
        Entry("paged_kv.kv_cache.PagedKVCache.layer", "layer", {"index": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 2]})},
            cache,
              named={"index": "layer"}),
        Entry("paged_kv.kv_cache.PagedKVCache.copy_blocks", "copy_blocks", {"mapping": Arg("pairs", [(0, 1)])}, cache),
        Entry("paged_kv.kv_cache.PagedKVCache.copy_blocks[tensor]", "copy_blocks",
              {"mapping": Arg("pairs", lambda: torch.tensor([[0, 1], [0, 2]]))}, cache),
        Entry("paged_kv.kv_cache.PagedKVCache.swap_from", "swap_from", {
            "other": Arg("obj", cache, bad={WRONG_TYPE: [None, "x", PagedKVCache(spec(torch.float16), 8)]}),
            "mapping": Arg("pairs", [(0, 1)])}, cache),
        Entry("paged_kv.kv_cache.PagedKVCache.slots", "slots", {
            "block_table": Arg("ids", [3, 1], bad={OUT_OF_RANGE: [[-1, 1], [8, 1]]}), "start": Arg("int", 1),
            "end": Arg("int", 6)}, cache),
        Entry("paged_kv.kv_cache.PagedKVCache.gather", "gather", {
            "layer": Arg("int", 0), "block_table": Arg("ids", [3, 1], bad={OUT_OF_RANGE: [[-1, 1], [8, 1]]}),
            "start": Arg("int", 1), "end": Arg("int", 6), "dtype": Arg("dtype", torch.float32)}, cache),
        *[Entry(f"paged_kv.kv_cache.PagedKVCache.write[{str(dt)[6:]}]", "write", {
            "layer": Arg("int", 1), "key": Arg("tensor", lambda dt=dt: kv(2, dt)),
            "value": Arg("tensor", lambda dt=dt: kv(2, dt)),
            "slot_mapping": Arg("tensor", lambda: torch.tensor([3, 9]), bad={OUT_OF_RANGE: [torch.tensor([3, 32])]})},
            lambda dt=dt: cache(dt)) for dt in (torch.float32, torch.float64, torch.uint8)],
    ]
    # fmt: on


# Public names that are not entry points for bad input, each with the reason.
EXEMPT: dict[str, str] = {
    "paged_kv.SeqId": "a type alias (Hashable), not callable",
    "paged_kv.CopyOp": "a type alias (tuple[int, int]), not callable",
    "paged_kv.BlockManagerStats": "a result record the manager builds; never built from user input",
    "paged_kv.Admission": "a result record BlockManager.admission builds; never built from user input",
    "paged_kv.TableEntry": "a type alias (tuple[SeqId, int, int]), not callable",
    "paged_kv.RELEASED": "an int constant (the journal's release marker), not callable",
    "paged_kv.kv_cache.LayerKV": "a NamedTuple of one layer's tensors that PagedKVCache builds",
}

"""The rows of the bad-input matrix: every public entry point with a valid call, and the justified exemptions."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from bad_input_machinery import (
    BAD_DEVICE,
    BAD_DTYPE,
    BAD_ID,
    BOOL_FOR_INT,
    INF,
    NAN,
    NAN_INF,
    NONINTEGRAL,
    OUT_OF_RANGE,
    WRONG_SHAPE,
    WRONG_TYPE,
    Arg,
    Entry,
)

import kernels
import scheduler
from paged_kv import BlockManager, BlockManagerConfig
from paged_kv.compat import compressed, contiguous, dynamic, ndarray_kv, quantized, turboquant
from paged_kv.compat.pool import KVPool, PagedSeq
from paged_kv.kv_cache import KVCacheSpec, PagedKVCache

NOT_NEGATIVE = {OUT_OF_RANGE: [-1]}  # counts with no upper bound: only a negative one is out of range
NO_OPT = {WRONG_TYPE: ["3", [1]]}  # an int argument where None means "the default"
# a facade's pool=: not a pool, or a pool of another geometry (head_dim 3 fits no facade here)
POOL = Arg("obj", None, bad={WRONG_TYPE: ["x", 3, KVPool(num_layers=1, num_kv_heads=1, head_dim=3, num_blocks=4)]})


# -- subjects --------------------------------------------------------------------------------------
def manager() -> BlockManager:
    """gpu 8 blocks of 4, cpu 4: 'a' = 6 tokens, 'b' its fork, 's' swapped out."""
    m = BlockManager(BlockManagerConfig(num_blocks=8, block_size=4, num_cpu_blocks=4, watermark=0.0))
    m.allocate("a", list(range(6)))
    m.fork("a", "b")
    m.allocate("s", list(range(10, 15)))
    m.swap_out("s")
    return m


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


def _transformers():
    """The integration module (imported only when an entry needs it)."""
    import paged_kv.integrations.transformers as t

    return t


class _NoLayers:
    """A config object without num_hidden_layers."""


def paged_cache():
    """A transformers cache of one layer holding 3 positions of 2 rows."""
    c = _transformers().PagedCache(block_size=4)
    c.update(torch.ones(2, 2, 3, 4), torch.ones(2, 2, 3, 4), 0)
    return c


# -- kernels' inputs --------------------------------------------------------------------------------
def kcache() -> torch.Tensor:
    """A K or V cache ``[8 blocks, 4, 2 heads, 4]``."""
    return torch.zeros(8, 4, 2, 4)


def decode_args() -> dict[str, Arg]:
    """Valid arguments of paged decode attention (prefill adds its own)."""
    return {
        "q": Arg("float_tensor", lambda: torch.ones(2, 4, 4), skip=(NAN_INF,)),  # NaN queries give NaN outputs
        "k_cache": Arg("tensor", kcache),
        "v_cache": Arg("tensor", kcache),
        "block_tables": Arg(
            "tensor",
            lambda: torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
            bad={OUT_OF_RANGE: [torch.tensor([[0, 9], [2, 3]], dtype=torch.int32)]},
        ),
        "seq_lens": Arg(
            "tensor",
            lambda: torch.tensor([5, 3], dtype=torch.int32),
            bad={OUT_OF_RANGE: [torch.tensor([5, 30], dtype=torch.int32)]},
        ),
        "scale": Arg("real", 0.5, bad={WRONG_TYPE: ["0.5"]}),  # None: 1 / sqrt(head_dim)
        "sliding_window": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0, -1]}),
        "soft_cap": Arg("real", 10.0, bad={OUT_OF_RANGE: [0.0, -1.0], WRONG_TYPE: ["0.5"]}),  # None: no cap
        "backend": Arg("obj", "torch", bad={WRONG_TYPE: ["cuda", 3, None]}),
        # a float cache takes no scales
        "k_scale": Arg("obj", None, bad={WRONG_TYPE: ["x", torch.zeros(8, 4, 2)]}),
        "v_scale": Arg("obj", None, bad={WRONG_TYPE: ["x", torch.zeros(8, 4, 2)]}),
    }


def prepared_meta(q_lens: list[int] | None = None, num_blocks: int = 8) -> kernels.AttentionMetadata:
    """Host-validated metadata of two sequences of 5 and 3 tokens over blocks [0, 1] and [2, 3]."""
    q_lens = q_lens or [1, 1]
    return kernels.prepare_attention_metadata([[0, 1], [2, 3]], [5 - q_lens[0], 3 - q_lens[1]], q_lens,
                                              block_size=4, num_blocks=num_blocks)  # fmt: skip


def prepared_args() -> dict[str, Arg]:
    """Valid arguments of the prepared decode attention (prefill replaces q and meta)."""
    args = {k: v for k, v in decode_args().items() if k not in ("block_tables", "seq_lens")}
    args["meta"] = Arg("obj", prepared_meta, bad={WRONG_TYPE: [None, "x", prepared_meta([2, 1])],
                                                  OUT_OF_RANGE: [prepared_meta(num_blocks=16)]})  # fmt: skip
    return args


def prefix_args() -> dict[str, Arg]:
    """Valid arguments of shared-prefix attention: 3 query rows in groups of 2 and 1 over prefixes of 8 and 4."""
    args = {k: v for k, v in decode_args().items() if k not in ("seq_lens", "sliding_window")}
    return {
        **args, "q": Arg("float_tensor", lambda: torch.ones(3, 4, 4), skip=(NAN_INF,)),
        "prefix_lens": Arg("tensor", lambda: torch.tensor([8, 4], dtype=torch.int32),
                           bad={OUT_OF_RANGE: [torch.tensor([8, 30], dtype=torch.int32)]}),
        "cu_seqlens_q": Arg("tensor", lambda: torch.tensor([0, 2, 3], dtype=torch.int32),
                            bad={OUT_OF_RANGE: [torch.tensor([0, 2, 9], dtype=torch.int32)]}),
        "num_splits": Arg("opt_int", 2, bad={OUT_OF_RANGE: [0, -1]}),
    }  # fmt: skip


def prefix_meta(num_blocks: int = 8):
    """Host-validated prefix metadata matching prefix_args."""
    from kernels.prefix_attention import prepare_prefix_metadata

    return prepare_prefix_metadata([[0, 1], [2, 3]], [8, 4], [2, 1], block_size=4, num_blocks=num_blocks,
                                   device="cpu")  # fmt: skip


def cascade_args() -> dict[str, Arg]:
    """Valid arguments of cascade decode: sequences of 9 and 7 tokens sharing their first block."""
    args = {k: v for k, v in decode_args().items() if k != "sliding_window"}
    return {
        **args,
        "block_tables": Arg("tensor", lambda: torch.tensor([[0, 1, 2], [0, 3, 4]], dtype=torch.int32),
                            bad={OUT_OF_RANGE: [torch.tensor([[0, 1, 9], [0, 3, 4]], dtype=torch.int32),
                                                torch.tensor([[0, 1, 2], [5, 3, 4]], dtype=torch.int32)]}),
        "seq_lens": Arg("tensor", lambda: torch.tensor([9, 7], dtype=torch.int32),
                        bad={OUT_OF_RANGE: [torch.tensor([9, 30], dtype=torch.int32)]}),
        "seq_groups": Arg("tensor", lambda: torch.tensor([0, 0]), bad={OUT_OF_RANGE: [torch.tensor([0, 5])]}),
        "prefix_lens": Arg("tensor", lambda: torch.tensor([4]),
                           bad={OUT_OF_RANGE: [torch.tensor([8]), torch.tensor([3])]}),
        "return_lse": Arg("bool", False),
    }  # fmt: skip


def chunk_args() -> dict[str, Arg]:
    """Valid arguments of dense chunk attention: chunks of 2 and 3 new tokens, 4 query heads over 2 KV heads."""
    return {
        "q": Arg("float_tensor", lambda: torch.ones(5, 4, 4), skip=(NAN_INF,)),
        "k": Arg("tensor", lambda: torch.ones(5, 2, 4)),
        "v": Arg("tensor", lambda: torch.ones(5, 2, 4)),
        "query_lens": Arg("ids", [2, 3], bad={WRONG_TYPE: ["ab", {1: 2}, None, torch.tensor([2, 3])],
                                              OUT_OF_RANGE: [[-1, 6], [2, 2]]}),  # negative, or not q's rows
        "scale": Arg("real", 0.5, bad={WRONG_TYPE: ["0.5"]}),  # None: 1 / sqrt(head_dim)
        "backend": Arg("obj", "torch", bad={WRONG_TYPE: ["cuda", 3, None, "flash"]}),  # flash needs CUDA tensors
    }  # fmt: skip


def cascade_meta():
    """Host-validated cascade metadata matching cascade_args."""
    return kernels.prepare_cascade_metadata([[0, 1, 2], [0, 3, 4]], [9, 7], [0, 0], [4], block_size=4, num_blocks=8)


# -- scheduler ----------------------------------------------------------------------------------------
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, head_dim=8, max_position_embeddings=128)


def tiny_model() -> scheduler.LlamaModel:
    """A one-layer Llama, seeded (2 query heads, 1 KV head)."""
    torch.manual_seed(0)
    return scheduler.LlamaModel(scheduler.ModelConfig(**TINY, num_layers=1, num_heads=2, num_kv_heads=1))


def engine_config() -> scheduler.EngineConfig:
    """A small CPU engine configuration: 32 blocks of 4, swap space 4."""
    cache_cfg = scheduler.CacheConfig(block_size=4, num_gpu_blocks=32, num_cpu_blocks=4, watermark=0.0)
    return scheduler.EngineConfig(cache=cache_cfg, device="cpu")


def engine() -> scheduler.LLMEngine:
    """An engine holding one waiting request 'r0'."""
    e = scheduler.LLMEngine(tiny_model(), engine_config(), eos_token_id=2)
    e.add_request("r0", [1, 2, 3], scheduler.SamplingParams(max_tokens=2))
    return e


@functools.cache
def _tiny_text_model() -> tuple[object, object]:
    """(transformers model, tokenizer): the scheduler tests' tiny Llama and BPE tokenizer, built once."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scheduler"))
    from text_helpers import tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return LlamaForCausalLM(cfg).eval(), tokenizer


def loaded_tiny() -> object:
    """The tiny model and tokenizer as the loader hands them to LLM."""
    from scheduler.model.loader import LoadedModel

    hf, tokenizer = _tiny_text_model()
    return LoadedModel(hf_model=hf, tokenizer=tokenizer, name="tiny")


def tiny_llm() -> scheduler.LLM:
    """A text-level LLM over the tiny model (a fresh engine each time)."""
    return scheduler.LLM(loaded_tiny(), engine_config=engine_config())


BAD_ROPE = [
    scheduler.ModelConfig(**TINY, num_layers=1, num_heads=2, num_kv_heads=1, rope_scaling=scaling)
    for scaling in (
        {"rope_type": "linear"},
        {"rope_type": "linear", "factor": "x"},
        {"rope_type": "yarn"},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 4.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 64,
        },
    )
]
TOKENS = {OUT_OF_RANGE: [[-1], [1, 10_000]]}  # prompt ids past the vocab too


# entries whose valid call builds a transformers model or config (the optional hf extra)
NEEDS_TRANSFORMERS = (
    "paged_kv.integrations.transformers.",
    "scheduler.ModelConfig.from_hf",
    "scheduler.LLMEngine.from_hf",
    "scheduler.from_hf_model",
    "scheduler.from_state_dict",
)


def entries() -> list[Entry]:
    """Every public entry point with a valid call, and the facades' constructors again over a shared pool."""
    out = _entries()
    by_name = {e.name: e for e in out}
    out += [by_name[name].with_subject_as("pool", make) for name, make in SHARED_POOLS.items()]
    return [replace(e, requires="transformers") if e.name.startswith(NEEDS_TRANSFORMERS) else e for e in out]


def _pool_of(dtype: torch.dtype, num_layers: int = 2) -> Callable[[], KVPool]:
    """A factory of empty growable pools of the facades' geometry (2 KV heads of 4, blocks of 4)."""
    return lambda: KVPool(num_layers=num_layers, num_kv_heads=2, head_dim=4, dtype=dtype, block_size=4)


# A constructor that raises must leave a pool it was given as it was (no sequence, no page taken).
SHARED_POOLS: dict[str, Callable[[], KVPool]] = {
    "paged_kv.compat.ndarray_kv.KvCache": _pool_of(torch.float64),
    "paged_kv.compat.contiguous.KvCache": _pool_of(torch.float32),
    "paged_kv.compat.quantized.QuantizedKVCache": _pool_of(torch.int8),
    "paged_kv.compat.compressed.KvCacheCompressor": lambda: compressed.compressed_pool(
        turboquant.KvCacheConfig(**TQ), block_size=4
    ),
    "paged_kv.compat.compressed.MultiHeadKvCache": lambda: compressed.compressed_pool(
        turboquant.KvCacheConfig(**TQ), block_size=4
    ),
    "paged_kv.compat.dynamic.KVCache": _pool_of(torch.float32, num_layers=1),
    "paged_kv.integrations.transformers.PagedCache": _pool_of(torch.float32, num_layers=1),
}


def _entries() -> list[Entry]:
    """The entries, before marking those that need transformers."""
    seq_id = lambda v: Arg("seq_id", v)  # noqa: E731
    m = manager
    # a table: one entry point per entry, its arguments side by side
    # fmt: off
    return [
        # ---- paged_kv ----------------------------------------------------------------------------
        Entry("paged_kv.BlockManager", BlockManager, {"config": Arg("obj", lambda: BlockManagerConfig(num_blocks=4))}),
        Entry("paged_kv.BlockManagerConfig", BlockManagerConfig, {
            "num_blocks": Arg("int", 8, bad={OUT_OF_RANGE: [0, -1, 1 << 62]}),
            "block_size": Arg("int", 4, bad={OUT_OF_RANGE: [0, 1 << 20]}),
            "num_cpu_blocks": Arg("int", 0), "watermark": Arg("real", 0.01, bad={OUT_OF_RANGE: [1.0, -0.5]}),
            "enable_prefix_caching": Arg("bool", True)}),
        Entry("paged_kv.BlockManager.add_blocks", "add_blocks", {"num_blocks": Arg("int", 2)}, m),
        Entry("paged_kv.BlockManager.allocate", "allocate", {
            "seq_id": Arg("new_seq_id", "n", bad={BAD_ID: [["l"], "a", "s"]}), "token_ids": Arg("ids", [1, 2, 3]),
            "cache_salt": Arg("opt_str", None), "num_lookahead_slots": Arg("int", 0)}, m),
        Entry("paged_kv.BlockManager.append", "append", {
            "seq_id": Arg("seq_id", "a", bad={BAD_ID: [["l"], "zz", "s"]}), "token_ids": Arg("ids", [7]),
            "num_lookahead_slots": Arg("int", 0)}, m),
        Entry("paged_kv.BlockManager.block_table", "block_table", {
            "seq_id": seq_id("a"), "start": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 99]})}, m),
        Entry("paged_kv.BlockManager.num_tokens", "num_tokens", {"seq_id": seq_id("a")}, m),
        Entry("paged_kv.BlockManager.is_swapped", "is_swapped", {"seq_id": seq_id("s")}, m),
        Entry("paged_kv.BlockManager.free", "free", {"seq_id": seq_id("a")}, m),
        Entry("paged_kv.BlockManager.can_swap_out", "can_swap_out",
            {"seq_id": Arg("seq_id", "a", bad={BAD_ID: [["l"], "zz", "s"]})}, m),
        Entry("paged_kv.BlockManager.swap_out", "swap_out",
            {"seq_id": Arg("seq_id", "a", bad={BAD_ID: [["l"], "zz", "s"]})}, m),
        # a query about a sequence in the other state answers False: only unknown ids are bad
        Entry("paged_kv.BlockManager.can_swap_in", "can_swap_in", {"seq_id": seq_id("s")}, m),
        Entry("paged_kv.BlockManager.swap_in", "swap_in",
            {"seq_id": Arg("seq_id", "s", bad={BAD_ID: [["l"], "zz", "a"]})}, m),
        Entry("paged_kv.BlockManager.append_all", "append_all", {
            "requests": Arg("obj", [("a", [7]), ("b", [8])], bad={
                WRONG_TYPE: [None, "ab", 3, [("a",)]], BAD_ID: [[("zz", [7])], [("s", [7])], [("a", [7]), ("a", [8])]],
                BOOL_FOR_INT: [[("a", [True])]], NONINTEGRAL: [[("a", [1.5])]], OUT_OF_RANGE: [[("a", [-1])]]}),
            "changed": Arg("obj", None, bad={WRONG_TYPE: ["x", 3, ()]})}, m,
            named={"requests": ("requests", "seq_id", "token_ids")}),
        Entry("paged_kv.BlockManager.can_append_all", "can_append_all", {
            "requests": Arg("obj", [("a", 1), ("b", 2)], bad={
                WRONG_TYPE: [None, "ab", 3], BAD_ID: [[("zz", 1)], [("s", 1)]], BOOL_FOR_INT: [[("a", True)]],
                NONINTEGRAL: [[("a", 1.5)]], OUT_OF_RANGE: [[("a", -1)]]})}, m,
            named={"requests": ("requests", "seq_id", "num_new_tokens")}),
        *[Entry(f"paged_kv.BlockManager.{name}", name, {"seq_ids": Arg("obj", valid, bad={
            WRONG_TYPE: [None, "ab", 3], BAD_ID: [["zz"], [["l"]], *extra]})}, m,
            named={"seq_ids": ("seq_ids", "seq_id")})
          for name, valid, extra in (
              ("swap_out_group", ["a", "b"], [["s"], ["a", "a"]]), ("swap_in_group", ["s"], [["a"], ["s", "s"]]),
              ("can_swap_out_group", ["a", "b"], [["s"]]), ("can_swap_in_group", ["s"], []),
              ("num_distinct_blocks", ["a", "b"], []))],
        Entry("paged_kv.BlockManager.can_allocate", "can_allocate", {
            "token_ids": Arg("ids", [1, 2]), "cache_salt": Arg("opt_str", None), "num_lookahead_slots": Arg("int", 0)},
                m),
        Entry("paged_kv.BlockManager.num_cached_tokens", "num_cached_tokens", {
            "token_ids": Arg("ids", [0, 1, 2, 3, 4]), "cache_salt": Arg("opt_str", "t")}, m),
        # a huge count is a valid question (the answer is "no" / a large number): only a negative one is bad
        Entry("paged_kv.BlockManager.can_append", "can_append", {
            "seq_id": seq_id("a"), "num_new_tokens": Arg("int", 1, bad=NOT_NEGATIVE),
            "num_lookahead_slots": Arg("int", 0)}, m),
        Entry("paged_kv.BlockManager.num_blocks_to_append", "num_blocks_to_append", {
            "seq_id": seq_id("a"), "num_new_tokens": Arg("int", 1, bad=NOT_NEGATIVE),
            "num_lookahead_slots": Arg("int", 0)}, m),
        Entry("paged_kv.BlockManager.num_blocks_to_append_all", "num_blocks_to_append_all", {
            "requests": Arg("obj", [("a", 1), ("b", 2)], bad={
                WRONG_TYPE: [None, 3, [("a",)], ["a1"]], BOOL_FOR_INT: [[("a", True)]], NONINTEGRAL: [[("a", 1.5)]],
                NAN_INF: [[("a", NAN)]], OUT_OF_RANGE: [[("a", -1)]], BAD_ID: [[("zz", 1)], [(["l"], 1)]]})}, m,
              named={"requests": ("requests", "seq_id", "num_new_tokens")}),  # errors name the pair's field
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
            "child_id": Arg("new_seq_id", "c", bad={BAD_ID: [["l"], "b"]})}, m,
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
            "device": Arg("device", "cpu")}),
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
        Entry("paged_kv.compat.dynamic.KVCacheEntry", dynamic.KVCacheEntry, {
            "key": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)), "value": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)),
            "block_size": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0]}), "device": Arg("device", "cpu")}),
        # KVCacheEntry.update delegates to KVCache.update, whose errors name the states key / value
        Entry("paged_kv.compat.dynamic.KVCacheEntry.update", "update", {
            "new_key": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)),
            "new_value": Arg("float_tensor", dyn_kv, skip=(NAN_INF,))},
            lambda: dynamic.KVCacheEntry(dyn_kv(2), dyn_kv(2), block_size=4),
                named={"new_key": "key", "new_value": "value"}),
        # ---- paged_kv.integrations.transformers ------------------------------------------------------------
        Entry("paged_kv.integrations.transformers.PagedCache", lambda **kw: _transformers().PagedCache(**kw), {
            "config": Arg("obj", lambda: _hf_config(), bad={WRONG_TYPE: [_NoLayers(), "x"]}),
            "pool": Arg("obj", None, bad={WRONG_TYPE: ["x", 3]}),
            "block_size": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0]}),
            "dtype": Arg("dtype", torch.float32), "device": Arg("device", "cpu")},
            named={"config": ("config", "num_hidden_layers")}),
        Entry("paged_kv.integrations.transformers.PagedCache.update", "update", {
            "key_states": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)),
            "value_states": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)),
            "layer_idx": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 1 << 62]})}, paged_cache,
            named={"key_states": "key", "value_states": "value"}),  # the paged store names the states key / value
        *[Entry(f"paged_kv.integrations.transformers.PagedCache.{name}", name, {
            "beam_idx" if name == "reorder_cache" else "indices": Arg("ids", [1, 0], bad={OUT_OF_RANGE: [[-1], [2]],
                                                                                         WRONG_TYPE: ["ab", None,
                                                                                             []]})},
            paged_cache, named={"beam_idx": "indices"}) for name in ("reorder_cache", "batch_select_indices")],
        Entry("paged_kv.integrations.transformers.PagedCache.batch_repeat_interleave", "batch_repeat_interleave",
              {"repeats": Arg("int", 2, bad={OUT_OF_RANGE: [0, -1]})}, paged_cache),
        Entry("paged_kv.integrations.transformers.PagedCache.crop", "crop",
            {"max_length": Arg("int", 2, skip=(OUT_OF_RANGE,))},
              paged_cache),  # any int is a valid crop (negative: drop from the end, past the length: keep all)
        Entry("paged_kv.integrations.transformers.PagedLayer", lambda **kw: _transformers().PagedLayer(**kw), {
            "store": Arg("obj", lambda: paged_cache().kv, bad={WRONG_TYPE: [None, "x"]}),
            "layer_idx": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 2]})}),
        Entry("paged_kv.integrations.transformers.PagedLayer.update", "update", {
            "key_states": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)),
            "value_states": Arg("float_tensor", dyn_kv, skip=(NAN_INF,))},
            lambda: paged_cache().layers[0], named={"key_states": "key", "value_states": "value"}),
        Entry("paged_kv.integrations.transformers.PagedLayer.lazy_initialization", "lazy_initialization", {
            "key_states": Arg("tensor", dyn_kv), "value_states": Arg("tensor", dyn_kv)},
            lambda: _transformers().PagedCache(_hf_config(), block_size=4).layers[0],  # not initialized yet
            named={"key_states": "key", "value_states": "value"}),
        Entry("paged_kv.integrations.transformers.PagedLayer.get_mask_sizes", "get_mask_sizes",
              {"query_length": Arg("int", 3, bad=NOT_NEGATIVE)}, lambda: paged_cache().layers[0]),
        Entry("paged_kv.integrations.transformers.PagedLayer.crop", "crop",
            {"max_length": Arg("int", 2, skip=(OUT_OF_RANGE,))},
              lambda: paged_cache().layers[0]),
        # ---- kernels ------------------------------------------------------------------------------------
        Entry("kernels.copy_blocks", kernels.copy_blocks, {
            "caches": Arg("obj", lambda: [kcache(), kcache()], bad={WRONG_TYPE: [None, kcache(), [], ["x"]],
                          WRONG_SHAPE: [[kcache(), torch.zeros(4, 4)]], BAD_DEVICE: [[kcache(), kcache().to("meta")]]}),
            "block_mapping": Arg("pairs", [(0, 1)]),
            "backend": Arg("obj", "torch", bad={WRONG_TYPE: ["cuda", 3, None]})}),
        Entry("kernels.swap_blocks", kernels.swap_blocks, {
            "src_caches": Arg("obj", lambda: [kcache()], bad={WRONG_TYPE: [None, kcache(), []]}),
            "dst_caches": Arg("obj", lambda: [torch.zeros(4, 4, 2, 4)], bad={WRONG_TYPE: [None, [kcache().half()]],
                              WRONG_SHAPE: [[torch.zeros(4, 4, 2, 5)]]}),
            "block_mapping": Arg("pairs", [(5, 1)], bad={OUT_OF_RANGE: [[(0, 4)], [(8, 1)]]})}),
        Entry("kernels.write_kv", kernels.write_kv, {
            "key": Arg("tensor", lambda: kv(2)), "value": Arg("tensor", lambda: kv(2)),
            "k_cache": Arg("tensor", kcache), "v_cache": Arg("tensor", kcache),
            "slot_mapping": Arg("tensor", lambda: torch.tensor([3, 9]), bad={OUT_OF_RANGE: [torch.tensor([3, 32])]}),
            "k_scale": Arg("obj", None, bad={WRONG_TYPE: ["x", torch.zeros(8, 4, 2)]}),
            "v_scale": Arg("obj", None, bad={WRONG_TYPE: ["x", torch.zeros(8, 4, 2)]}),
            "backend": Arg("obj", "torch", bad={WRONG_TYPE: ["cuda", 3, None]})}),
        Entry("kernels.paged_decode_attention", kernels.paged_decode_attention, {
            **decode_args(), "num_splits": Arg("opt_int", 2, bad={OUT_OF_RANGE: [0, -1]}),
            "return_lse": Arg("bool", False)}),
        Entry("kernels.paged_prefill_attention", kernels.paged_prefill_attention, {
            **decode_args(), "q": Arg("float_tensor", lambda: torch.ones(3, 4, 4), skip=(NAN_INF,)),
            "cu_seqlens_q": Arg("tensor", lambda: torch.tensor([0, 2, 3], dtype=torch.int32),
                                bad={OUT_OF_RANGE: [torch.tensor([0, 2, 9], dtype=torch.int32)]}),
            "return_lse": Arg("bool", False)}),
        Entry("kernels.prepare_attention_metadata", kernels.prepare_attention_metadata, {
            "tables": Arg("obj", [[0, 1], [2, 3]], bad={
                WRONG_TYPE: ["ab", None, torch.zeros(2, 2, dtype=torch.int32), [[0, 1], "ab"]],
                OUT_OF_RANGE: [[[0, 9], [2, 3]], [[-1, 1], [2, 3]]], BOOL_FOR_INT: [[[True, 1], [2, 3]]],
                NONINTEGRAL: [[[0.5, 1], [2, 3]]], WRONG_SHAPE: [[[0], [2, 3]], [[0, 1]]]}),
            "num_computed": Arg("obj", [4, 2], bad={WRONG_TYPE: [None, "ab", torch.tensor([4, 2])],
                WRONG_SHAPE: [[4]], BOOL_FOR_INT: [[True, 2]], NONINTEGRAL: [[4.5, 2]], OUT_OF_RANGE: [[-1, 2]]}),
            "num_new": Arg("obj", [1, 1], bad={WRONG_TYPE: [None, "ab"], WRONG_SHAPE: [[1, 1, 1]],
                BOOL_FOR_INT: [[True, 1]], NONINTEGRAL: [[1.5, 1]], OUT_OF_RANGE: [[-1, 1], [9, 1]]}),
            "block_size": Arg("int", 4, bad={OUT_OF_RANGE: [0, -1]}),
            "num_blocks": Arg("int", 8, bad={OUT_OF_RANGE: [0, -1, 1]}),
            "device": Arg("device", "cpu")},
            named={"tables": "tables", "num_computed": ("num_computed", "tables"), "num_new": ("num_new", "tables"),
                   "num_blocks": ("num_blocks", "tables")}),
        Entry("kernels.paged_decode_attention_prepared", kernels.paged_decode_attention_prepared, {
            **prepared_args(), "num_splits": Arg("opt_int", 2, bad={OUT_OF_RANGE: [0, -1]}),
            "return_lse": Arg("bool", False)}),
        Entry("kernels.paged_prefill_attention_prepared", kernels.paged_prefill_attention_prepared, {
            **prepared_args(), "q": Arg("float_tensor", lambda: torch.ones(3, 4, 4), skip=(NAN_INF,)),
            "meta": Arg("obj", lambda: prepared_meta([2, 1]), bad={WRONG_TYPE: [None, "x", prepared_meta()],
                OUT_OF_RANGE: [prepared_meta([2, 1], num_blocks=16)]})}),
        Entry("kernels.write_kv_prepared", kernels.write_kv_prepared, {
            "key": Arg("tensor", lambda: kv(2)), "value": Arg("tensor", lambda: kv(2)),
            "k_cache": Arg("tensor", kcache), "v_cache": Arg("tensor", kcache),
            "meta": Arg("obj", prepared_meta, bad={WRONG_TYPE: [None, "x", prepared_meta([2, 1])],
                OUT_OF_RANGE: [prepared_meta(num_blocks=16)]}),
            "k_scale": Arg("obj", None, bad={WRONG_TYPE: ["x", torch.zeros(8, 4, 2)]}),
            "v_scale": Arg("obj", None, bad={WRONG_TYPE: ["x", torch.zeros(8, 4, 2)]}),
            "backend": Arg("obj", "torch", bad={WRONG_TYPE: ["cuda", 3, None]})},
            named={"meta": ("meta", "slot_mapping")}),
        Entry("kernels.paged_prefix_attention", kernels.paged_prefix_attention, prefix_args()),
        Entry("kernels.paged_prefix_attention_prepared", kernels.paged_prefix_attention_prepared, {
            **{k: v for k, v in prefix_args().items() if k not in ("block_tables", "prefix_lens", "cu_seqlens_q")},
            "meta": Arg("obj", prefix_meta, bad={WRONG_TYPE: [None, "x", prepared_meta()],
                                                 OUT_OF_RANGE: [lambda: prefix_meta(num_blocks=16)]})}),
        # block ids are checked on the host copy, prepare_cascade_metadata's tables
        Entry("kernels.cascade_decode_attention", kernels.cascade_decode_attention, cascade_args(),
              named={"block_tables": "tables"}),
        Entry("kernels.cascade_decode_attention_prepared", kernels.cascade_decode_attention_prepared, {
            **{k: v for k, v in cascade_args().items() if k not in ("block_tables", "seq_lens", "seq_groups",
                                                                     "prefix_lens")},
            "cascade": Arg("obj", cascade_meta, bad={WRONG_TYPE: [None, "x", prepared_meta()]})}),
        Entry("kernels.prepare_cascade_metadata", kernels.prepare_cascade_metadata, {
            "tables": Arg("obj", [[0, 1, 2], [0, 3, 4]], bad={
                WRONG_TYPE: ["ab", None, torch.zeros(2, 3, dtype=torch.int32), [[0, 1, 2], [0, 3]]],
                OUT_OF_RANGE: [[[0, 9, 2], [0, 3, 4]]], BOOL_FOR_INT: [[[True, 1, 2], [0, 3, 4]]],
                NONINTEGRAL: [[[0.5, 1, 2], [0, 3, 4]]], WRONG_SHAPE: [[[0, 1, 2]], [0, 1, 2]]}),
            "seq_lens": Arg("obj", [9, 7], bad={WRONG_TYPE: ["ab", None], OUT_OF_RANGE: [[9, 0], [9, 70]],
                                                WRONG_SHAPE: [[9]]}),
            "seq_groups": Arg("obj", [0, 0], bad={WRONG_TYPE: ["ab", None], OUT_OF_RANGE: [[0, 3], [-2, 0]],
                                                  WRONG_SHAPE: [[0]]}),
            "prefix_lens": Arg("obj", [4], bad={WRONG_TYPE: ["ab", None], OUT_OF_RANGE: [[8], [3], [0]]}),
            "block_size": Arg("int", 4, bad={OUT_OF_RANGE: [0, -1]}),
            "num_blocks": Arg("int", 8, bad={OUT_OF_RANGE: [0, -1]}),
            "device": Arg("device", "cpu")}),
        Entry("kernels.merge_attention_states", kernels.merge_attention_states, {
            "out_a": Arg("tensor", lambda: torch.ones(2, 2, 4)), "lse_a": Arg("tensor", lambda: torch.zeros(2, 2)),
            "out_b": Arg("tensor", lambda: torch.ones(2, 2, 4)), "lse_b": Arg("tensor", lambda: torch.zeros(2, 2)),
            "backend": Arg("obj", "torch", bad={WRONG_TYPE: ["cuda", 3, None]})}),
        Entry("kernels.dense_chunk_attention", kernels.dense_chunk_attention, chunk_args()),
        Entry("kernels.dense_chunk_attention_prepared", kernels.dense_chunk_attention_prepared, {
            **{k: v for k, v in chunk_args().items() if k != "query_lens"},
            "meta": Arg("obj", lambda: kernels.prepare_chunk_metadata([2, 3], "cpu"), bad={
                WRONG_TYPE: [None, "x", prepared_meta()],
                OUT_OF_RANGE: [lambda: kernels.prepare_chunk_metadata([2, 2], "cpu")]})}),
        Entry("kernels.prepare_chunk_metadata", kernels.prepare_chunk_metadata, {
            "query_lens": Arg("ids", [2, 3], bad={WRONG_TYPE: ["ab", {1: 2}, None, torch.tensor([2, 3])]}),
            "device": Arg("device", "cpu")}),
        Entry("kernels.quantize_per_token_head", kernels.quantize_per_token_head, {
            "x": Arg("tensor", lambda: torch.ones(2, 2, 4), skip=(WRONG_SHAPE,)),  # any [..., D] shape is valid
            "dtype": Arg("dtype", torch.int8, bad={BAD_DTYPE: [torch.float16, torch.complex64]})}),
        Entry("kernels.dequantize", kernels.dequantize, {
            "codes": Arg("tensor", lambda: torch.ones(2, 2, 4, dtype=torch.int8), skip=(WRONG_SHAPE,),
                         bad={BAD_DTYPE: [torch.ones(2, 2, 4, dtype=torch.complex64),
                             torch.ones(2, 2, 4, dtype=torch.bool)]}),
            "scales": Arg("tensor", lambda: torch.ones(2, 2)),
            "out_dtype": Arg("dtype", torch.float32, bad={BAD_DTYPE: [torch.int8, torch.complex64]})}),
        Entry("kernels.is_quantized", kernels.is_quantized, {"dtype": Arg("dtype", torch.int8, skip=(BAD_DTYPE,))}),
        # ---- scheduler ------------------------------------------------------------------------------------
        Entry("scheduler.SamplingParams", scheduler.SamplingParams, {
            "max_tokens": Arg("int", 4, bad={OUT_OF_RANGE: [0, -1]}),
            "temperature": Arg("real", 0.7, bad={OUT_OF_RANGE: [-0.1]}),
            "top_k": Arg("int", 0, bad=NOT_NEGATIVE), "top_p": Arg("real", 0.9, bad={OUT_OF_RANGE: [0.0, 1.5]}),
            "seed": Arg("opt_int", 3, bad={OUT_OF_RANGE: [-1, 1 << 63]}),
            "n": Arg("int", 1, bad={OUT_OF_RANGE: [0, 1 << 20]}),
            "stop_token_ids": Arg("ids", (5,), bad={WRONG_TYPE: ["12", 5, None]}), "ignore_eos": Arg("bool", False),
            "logprobs": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 1000]}),
            "stop": Arg("obj", ("\n",), bad={WRONG_TYPE: [3, [""], ["a", 3], b"x"]}),
            "cache_salt": Arg("obj", None, bad={WRONG_TYPE: [3, "", ["x"]]})}),
        Entry("scheduler.SchedulerConfig", scheduler.SchedulerConfig, {
            "max_num_batched_tokens": Arg("int", 64, bad={OUT_OF_RANGE: [1, 1 << 62]}),
            "max_num_seqs": Arg("int", 8, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            "enable_chunked_prefill": Arg("bool", True),
            "preemption_mode": Arg("obj", "swap", bad={WRONG_TYPE: ["drop", None, ["swap"]]})}),
        Entry("scheduler.CacheConfig", scheduler.CacheConfig, {
            "block_size": Arg("int", 4, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            "num_gpu_blocks": Arg("opt_int", 8, bad={OUT_OF_RANGE: [0, 1 << 62]}),
            "kv_cache_bytes": Arg("int", 1 << 20, bad={OUT_OF_RANGE: [0]}), "num_cpu_blocks": Arg("int", 0),
            "watermark": Arg("real", 0.01, bad={OUT_OF_RANGE: [1.0, -0.1]}), "enable_prefix_caching": Arg("bool", True),
            "enable_cascade_attention": Arg("bool", True), "enable_chunk_attention": Arg("bool", True),
            "cascade_min_saved_bytes": Arg("opt_int", 0, bad={OUT_OF_RANGE: [-1]}),
            "dtype": Arg("dtype", torch.float16, bad={BAD_DTYPE: [torch.complex64, torch.int16, torch.float64]}),
            "gpu_memory_utilization": Arg("real", None, skip=(WRONG_TYPE,),
                                          bad={OUT_OF_RANGE: [0.0, 1.5, -0.5], WRONG_TYPE: ["0.5"]})}),
        Entry("scheduler.EngineConfig", scheduler.EngineConfig, {
            "cache": Arg("obj", lambda: scheduler.CacheConfig(num_cpu_blocks=1), bad={WRONG_TYPE: [None, {}]}),
            "scheduler": Arg("obj", lambda: scheduler.SchedulerConfig(), bad={WRONG_TYPE: [None, {}]}),
            "device": Arg("device", "cpu"), "enforce_eager": Arg("bool", False),
            "tensor_parallel_size": Arg("int", 1, bad={OUT_OF_RANGE: [0, -1, 1 << 62]}),
            "distributed_timeout_s": Arg("real", 60.0, bad={OUT_OF_RANGE: [0.0, -1.0]})}),
        Entry("scheduler.ModelConfig", scheduler.ModelConfig, {
            "vocab_size": Arg("int", 64, bad={OUT_OF_RANGE: [0]}),
            "hidden_size": Arg("int", 16, bad={OUT_OF_RANGE: [0]}),
            "intermediate_size": Arg("int", 32, bad={OUT_OF_RANGE: [0]}),
            "num_layers": Arg("int", 1, bad={OUT_OF_RANGE: [0]}),
            "num_heads": Arg("int", 2, bad={OUT_OF_RANGE: [0]}),
            "num_kv_heads": Arg("int", 1, bad={OUT_OF_RANGE: [0, 3]}),
            "head_dim": Arg("int", 8, bad={OUT_OF_RANGE: [0]}),
            "rms_norm_eps": Arg("real", 1e-5, bad={OUT_OF_RANGE: [0.0, -1.0]}),
            "rope_theta": Arg("real", 10000.0, bad={OUT_OF_RANGE: [0.0, -1.0]}),
            "rope_scaling": Arg("obj", None, bad={WRONG_TYPE: ["linear", 3, ["linear"]]}),
            "max_position_embeddings": Arg("int", 128, bad={OUT_OF_RANGE: [0]}),
            "tie_word_embeddings": Arg("bool", False), "attention_bias": Arg("bool", False)}),
        Entry("scheduler.ModelConfig.from_hf", scheduler.ModelConfig.from_hf, {
            "hf_config": Arg("obj", lambda: _hf_config(), bad={WRONG_TYPE: [None, "x", 3]})}),
        Entry("scheduler.BeamSearchParams", scheduler.BeamSearchParams, {
            "width": Arg("int", 2, bad={OUT_OF_RANGE: [0, -1, 1 << 62]}),
            "max_tokens": Arg("int", 4, bad={OUT_OF_RANGE: [0]}),
            "length_penalty": Arg("real", 1.0),
            "early_stopping": Arg("bool", False, bad={WRONG_TYPE: [1, "always", None]}),
            "stop_token_ids": Arg("ids", (5,), bad={WRONG_TYPE: ["12", 5, None]}), "ignore_eos": Arg("bool", False)}),
        Entry("scheduler.LlamaModel", scheduler.LlamaModel, {"cfg": Arg("obj", lambda: tiny_model().config,
            bad={WRONG_TYPE: [None, {}, "x"], OUT_OF_RANGE: BAD_ROPE}),
            "shard": Arg("obj", None, bad={WRONG_TYPE: ["x", 3, (0, 2)]})},  # scalings the model cannot build
              named={"cfg": ("cfg", "rope_scaling")}),
        Entry("scheduler.LlamaModel.kv_cache_spec", "kv_cache_spec", {
            "block_size": Arg("int", 4, bad={OUT_OF_RANGE: [0, -1]}), "dtype": Arg("dtype", torch.float16)},
                tiny_model),
        Entry("scheduler.LlamaModel.enable_chunk_attention", "enable_chunk_attention", {
            "enabled": Arg("bool", True)}, tiny_model),
        Entry("scheduler.LLMEngine", scheduler.LLMEngine, {
            "model": Arg("obj", tiny_model, bad={WRONG_TYPE: [None, "x"]}),
            "config": Arg("obj", engine_config, bad={WRONG_TYPE: ["x", {}]}),
            "eos_token_id": Arg("opt_int", 2,
                bad={OUT_OF_RANGE: [-1], WRONG_TYPE: ["3", {1: 2}], NONINTEGRAL: [1.5, [2.5]],
                    BOOL_FOR_INT: [True, [True]]})}),
        Entry("scheduler.LLMEngine.add_request", "add_request", {
            "request_id": Arg("obj", "x", bad={WRONG_TYPE: [None, 7, ["x"]], BAD_ID: ["r0"]}),
            "prompt_token_ids": Arg("ids", [1, 2], bad={**TOKENS, WRONG_TYPE: ["ab", 5, None, []]}),
            "sampling_params": Arg("obj", None, bad={WRONG_TYPE: [{"max_tokens": 3}, "x"]})}, engine),
        Entry("scheduler.LLMEngine.check_request", "check_request", {
            "request_id": Arg("obj", "x", bad={WRONG_TYPE: [None, 7], BAD_ID: ["r0"]}),
            "prompt_token_ids": Arg("ids", [1, 2], bad={**TOKENS, WRONG_TYPE: ["ab", 5, None, []]}),
            "sampling_params": Arg("obj", None, bad={WRONG_TYPE: [{"max_tokens": 3}]})}, engine),
        Entry("scheduler.LLMEngine.request_output", "request_output", {
            "request_id": Arg("obj", "r0", bad={WRONG_TYPE: [None, 7, ["x"]], BAD_ID: ["zz"]})}, engine),
        Entry("scheduler.LLM", scheduler.LLM, {
            "model": Arg("obj", loaded_tiny, bad={WRONG_TYPE: [3, ["x"], 2.5],
                BAD_ID: ["/no/such/model", "/no/such/model.gguf"]}),
            "engine_config": Arg("obj", engine_config, bad={WRONG_TYPE: ["x", {}, 3]})},
            named={"model": ("model",)}),
        Entry("scheduler.LLM.encode", "encode", {
            "prompt": Arg("obj", "hello", bad={WRONG_TYPE: [None, 3, b"hi"], BOOL_FOR_INT: [[True]],
                NONINTEGRAL: [[1.5]], OUT_OF_RANGE: [[-1]]})}, tiny_llm),
        Entry("scheduler.LLM.chat_prompt", "chat_prompt", {
            "messages": Arg("obj", lambda: [{"role": "user", "content": "hi"}],
                bad={WRONG_TYPE: [None, "hi", [], [{"role": "user"}], [{"role": 3, "content": "x"}]]})}, tiny_llm),
        Entry("scheduler.LLM.generate", "generate", {
            "prompts": Arg("obj", lambda: ["hello"], bad={WRONG_TYPE: [None, 3, [3.5], [None]],
                BOOL_FOR_INT: [[[True]]], NONINTEGRAL: [[[1.5]]], OUT_OF_RANGE: [[[-1]], [[10**6]]]}),
            "sampling_params": Arg("obj", None, bad={WRONG_TYPE: ["x", {"max_tokens": 2}]}),
            "use_tqdm": Arg("bool", False)}, tiny_llm, named={"prompts": ("prompt", "prompts")}),
        Entry("scheduler.LLM.chat", "chat", {
            "messages": Arg("obj", lambda: [{"role": "user", "content": "hi"}],
                bad={WRONG_TYPE: [None, "hi", [], [{"role": "user"}]]}),
            "sampling_params": Arg("obj", None, bad={WRONG_TYPE: ["x", {"max_tokens": 2}]}),
            "use_tqdm": Arg("bool", False)}, tiny_llm),
        Entry("scheduler.LLMEngine.abort", "abort",
            {"request_id": Arg("obj", "r0", bad={BAD_ID: ["zz", ["r0"], None]})}, engine),
        Entry("scheduler.LLMEngine.generate", "generate", {
            "prompts": Arg("obj", [[1, 2]], bad={WRONG_TYPE: [None, "ab", iter([[1]]), [5]], BOOL_FOR_INT: [[[True]]],
                                                NONINTEGRAL: [[[1.5]]], OUT_OF_RANGE: [[[1], [-1]], [[99]]]}),
            "sampling_params": Arg("obj", lambda: scheduler.SamplingParams(max_tokens=1),
                                   bad={WRONG_TYPE: ["x", [scheduler.SamplingParams(), scheduler.SamplingParams()]]}),
            "use_tqdm": Arg("bool", False)}, engine, named={"prompts": ("prompts", "prompt_token_ids")}),
                 # per-prompt checks
        Entry("scheduler.LLMEngine.from_hf", scheduler.LLMEngine.from_hf, {
            "hf_model": Arg("obj", lambda: _hf_model(), bad={WRONG_TYPE: [None, "x", torch.nn.Linear(2, 2)]}),
            "config": Arg("obj", engine_config, bad={WRONG_TYPE: ["x", {}]})}),
        Entry("scheduler.BeamSearch", scheduler.BeamSearch,
            {"engine": Arg("obj", engine, bad={WRONG_TYPE: [None, "x"]})}),
        Entry("scheduler.BeamSearch.generate", "generate", {
            "prompts": Arg("obj", [[1, 2]], bad={WRONG_TYPE: [None, "ab", [5]], BOOL_FOR_INT: [[[True]]],
                                                NONINTEGRAL: [[[1.5]]], OUT_OF_RANGE: [[[-1]], [[99]]]}),
            "params": Arg("obj", lambda: scheduler.BeamSearchParams(width=2, max_tokens=2), bad={WRONG_TYPE: ["x", 3]}),
            "use_tqdm": Arg("bool", False)}, lambda: scheduler.BeamSearch(_idle_engine()),
            named={"prompts": ("prompts", "prompt_token_ids")}),  # the per-prompt checks name the prompt
        Entry("scheduler.from_state_dict", scheduler.from_state_dict, {
            "cfg": Arg("obj", lambda: tiny_model().config, bad={WRONG_TYPE: [None, {}]}),
            "state": Arg("obj", lambda: _hf_state(), bad={WRONG_TYPE: [None, "x", {"x": 1}]}),
            "dtype": Arg("dtype", torch.float32), "device": Arg("device", "cpu")}),
        Entry("scheduler.from_hf_model", scheduler.from_hf_model, {
            "hf_model": Arg("obj", lambda: _hf_model(), bad={WRONG_TYPE: [None, "x", torch.nn.Linear(2, 2)]}),
            "dtype": Arg("dtype", torch.float32), "device": Arg("device", "cpu")}),
    ]
    # fmt: on


def _idle_engine() -> scheduler.LLMEngine:
    """An engine with no request (beam search needs an idle one)."""
    return scheduler.LLMEngine(tiny_model(), engine_config(), eos_token_id=2)


def _hf_config():
    """The tiny model's transformers LlamaConfig."""
    from transformers import LlamaConfig

    return LlamaConfig(**TINY, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def _hf_model():
    """A seeded transformers Llama of the tiny shape."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_hf_config())


def _hf_state() -> dict[str, torch.Tensor]:
    """A transformers-named state dict of the tiny shape."""
    return _hf_model().state_dict()


# Public names that are not entry points for bad input, each with the reason.
EXEMPT: dict[str, str] = {
    "paged_kv.SeqId": "a type alias (Hashable), not callable",
    "paged_kv.CopyOp": "a type alias (tuple[int, int]), not callable",
    "paged_kv.BlockManagerStats": "a result record the manager builds; never built from user input",
    "paged_kv.kv_cache.LayerKV": "a NamedTuple of one layer's tensors that PagedKVCache builds",
    "paged_kv.compat.contiguous.KvCacheSnapshot": "a record snapshot() builds; restore_from_snapshot checks its parts",
    "paged_kv.compat.contiguous.KvCacheAccess": "an abstract interface (ABC): its methods are rows of KvCache",
    "paged_kv.compat.quantized.KVCacheFormat": (
        "an Enum: KVCacheFormat('x') is Python's Enum lookup; the facade's format argument (names too) is a row"
    ),
    "scheduler.CompletionOutput": "a result record the engine builds",
    "scheduler.RequestOutput": "a result record the engine builds",
    "scheduler.RequestOutput.from_group": "builds a record from an engine-made SequenceGroup (engine internals)",
    "scheduler.BeamSearchOutput": "a result record beam search builds",
    "scheduler.LlamaModel.forward": "the model's forward pass over engine-made batch tensors (a torch.nn.Module "
    "call inside the runner; its kernels are rows of kernels.*)",
    "scheduler.LlamaModel.hidden_states": "the decoder layers of forward (what CUDA graphs capture), same inputs",
    "scheduler.LlamaModel.compute_logits": "the LM head of forward over the model's own hidden states",
    "kernels.AttentionMetadata": "a record prepare_attention_metadata (a row) builds and validates; the prepared "
    "kernels' meta rows check what they are given",
    "scheduler.LLMEngine.add_group": "custom-decoder API over engine-made SequenceGroup objects (engine internals)",
    "scheduler.LLMEngine.append_token": "custom-decoder API over engine-made Sequence objects (engine internals)",
    "scheduler.LLMEngine.finish_sequence": "custom-decoder API over engine-made Sequence objects (engine internals)",
    "scheduler.LLMEngine.fork": "custom-decoder API over engine-made Sequence objects (engine internals)",
    "scheduler.LLMEngine.run_model": "custom-decoder API over an engine-made SchedulerOutput (engine internals)",
    "paged_kv.integrations.transformers.PagedLayer.reorder_cache": (
        "raises NotImplementedError by design: rows are shared by every layer (PagedCache.reorder_cache is a row)"
    ),
}

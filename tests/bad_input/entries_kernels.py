"""Bad-input rows of ``kernels``: the block copies, the K/V writes, the attention kernels and their metadata."""

from __future__ import annotations

import torch
from bad_input_machinery import (
    BAD_DEVICE,
    BAD_DTYPE,
    BOOL_FOR_INT,
    NAN_INF,
    NONINTEGRAL,
    OUT_OF_RANGE,
    WRONG_SHAPE,
    WRONG_TYPE,
    Arg,
    Entry,
)
from entries_paged_kv import kv

import kernels


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
    from kernels.metadata import prepare_prefix_metadata

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


def entries() -> list[Entry]:
    """The kernels' host entry points, each with a valid call."""
    # a table: one entry point per entry, its arguments side by side
    # fmt: off
    return [
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
    ]
    # fmt: on


# Public names that are not entry points for bad input, each with the reason.
EXEMPT: dict[str, str] = {
    "kernels.AttentionMetadata": "a record prepare_attention_metadata (a row) builds and validates; the prepared "
    "kernels' meta rows check what they are given",
}

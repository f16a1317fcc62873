"""Triton kernels over the paged KV layout, each with a torch reference.

Every public function validates its inputs (shapes, dtypes, devices, block ids)
before launching anything, and dispatches on ``backend``: "auto" runs Triton
for CUDA tensors and the torch reference for CPU tensors; "triton" and "torch"
force one path (tests run "triton" on CPU through the Triton interpreter).

The ``*_prepared`` variants take an :class:`AttentionMetadata` validated on the
host (:func:`prepare_attention_metadata`; every record and builder lives in
:mod:`kernels.metadata`) and read no device value: the serving loop's hot path, and
what CUDA graphs capture. Their ``bind_*`` twins run those host checks once per step
and return a :class:`~kernels.checks.BoundCall` that each layer runs unchecked.
"""

from kernels.block_copy import copy_blocks, swap_blocks
from kernels.cache_write import write_kv, write_kv_prepared
from kernels.cascade_attention import cascade_decode_attention, cascade_decode_attention_prepared
from kernels.chunk_attention import dense_chunk_attention, dense_chunk_attention_prepared
from kernels.decode_attention import paged_decode_attention, paged_decode_attention_prepared
from kernels.merge_states import merge_attention_states
from kernels.metadata import (
    AttentionMetadata,
    prepare_attention_metadata,
    prepare_cascade_metadata,
    prepare_chunk_metadata,
)
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_prepared
from kernels.prefix_attention import paged_prefix_attention, paged_prefix_attention_prepared
from kernels.quant import dequantize, is_quantized, quantize_per_token_head

__all__ = [
    "AttentionMetadata", "prepare_attention_metadata",
    "copy_blocks", "swap_blocks", "paged_decode_attention", "paged_decode_attention_prepared",
    "paged_prefill_attention", "paged_prefill_attention_prepared", "merge_attention_states",
    "paged_prefix_attention", "paged_prefix_attention_prepared", "cascade_decode_attention",
    "cascade_decode_attention_prepared", "prepare_cascade_metadata",
    "dense_chunk_attention", "dense_chunk_attention_prepared", "prepare_chunk_metadata",
    "write_kv", "write_kv_prepared", "quantize_per_token_head", "dequantize", "is_quantized",
]

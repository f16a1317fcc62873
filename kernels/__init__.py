"""Triton kernels over the paged KV layout, each with a torch reference.

Every public function validates its inputs (shapes, dtypes, devices, block ids)
before launching anything, and dispatches on ``backend``: "auto" runs Triton
for CUDA tensors and the torch reference for CPU tensors; "triton" and "torch"
force one path (tests run "triton" on CPU through the Triton interpreter).
"""

from kernels.copy_blocks import copy_blocks, swap_blocks
from kernels.decode_attention import paged_decode_attention
from kernels.merge_states import merge_attention_states
from kernels.prefill_attention import paged_prefill_attention
from kernels.quant import dequantize, is_quantized, quantize_per_token_head
from kernels.write_kv import write_kv

__all__ = [
    "copy_blocks", "swap_blocks", "paged_decode_attention", "paged_prefill_attention",
    "merge_attention_states", "write_kv", "quantize_per_token_head", "dequantize", "is_quantized",
]

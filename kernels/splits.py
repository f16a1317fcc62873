"""Flash-decoding splits, shared by the decode and shared-prefix kernels: how many, how long, and their merge.

A split kernel walks one share of a KV range per program and writes a partial output and its
lse ``[rows, Hq, splits, D]`` / ``[rows, Hq, splits]``; :func:`merge_splits` combines them by
their lse weights (an empty split has lse -inf and weighs 0). With one split the kernel writes
the output directly. Both kernels take their built-in tile from :func:`split_tile`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_SPLITS = 128
MIN_TOKENS_PER_SPLIT = 256
WAVES = 2  # split programs per SM the automatic split size aims for


@triton.jit
def _merge_splits_kernel(
    part_ptr, plse_ptr, out_ptr, lse_ptr,
    sp_s, sp_h, sp_p, sp_d, spl_s, spl_h, spl_p, so_s, so_h, so_d, sl_s, sl_h, num_splits,
    S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    """Grid (seq, q_head): combine num_splits (<= S_PAD) partial outputs by their lse weights."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    p_mask = offs_p < num_splits
    lse = tl.load(plse_ptr + seq * spl_s + head * spl_h + offs_p * spl_p, mask=p_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2((lse - m_use) * 1.4426950408889634)  # [S_PAD]; empty splits weigh 0
    total = tl.sum(w, 0)
    offs = seq * sp_s + head * sp_h + offs_p[:, None] * sp_p + offs_d[None, :] * sp_d
    part = tl.load(part_ptr + offs, mask=p_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)  # [D_PAD]
    out_ptrs = out_ptr + seq * so_s + head * so_h + offs_d * so_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
    merged = tl.where(total > 0, m_use + tl.log2(tl.where(total > 0, total, 1.0)) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + seq * sl_s + head * sl_h, merged)


def split_outputs(q: torch.Tensor, splits: int) -> tuple[torch.Tensor, ...]:
    """(out ``[N, Hq, D]``, lse ``[N, Hq]``, part ``[N, Hq, splits, D]``, part_lse ``[N, Hq, splits]``) of a launch.

    With one split the parts are views of out and lse (the kernel writes the result directly).
    """
    rows, heads, head_dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(rows, heads, device=q.device, dtype=torch.float32)
    if splits == 1:
        return out, lse, out.unsqueeze(2), lse.unsqueeze(2)
    part = torch.empty(rows, heads, splits, head_dim, device=q.device, dtype=torch.float32)
    return out, lse, part, torch.empty(rows, heads, splits, device=q.device, dtype=torch.float32)


def merge_splits(out, lse, part, part_lse, d_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the splits of :func:`split_outputs` into out and lse (nothing to do for one split); returns both."""
    splits = part.shape[2]
    if splits > 1:
        _merge_splits_kernel[(out.shape[0], out.shape[1])](
            part, part_lse, out, lse, *part.stride(), *part_lse.stride(), *out.stride(), *lse.stride(), splits,
            S_PAD=triton.next_power_of_2(splits), HEAD_DIM=out.shape[2], D_PAD=d_pad,
        )  # fmt: skip
    return out, lse


def split_tile(d_pad: int, cache_bytes: int, dtype: tl.dtype) -> tuple[int, int, int]:
    """Built-in (BLOCK_N, num_warps, num_stages) of a split kernel per head size, cache element size and dot dtype.

    1-byte caches converted to 16-bit tiles move half the bytes per token, so they take twice the
    tokens per tile; every choice builds for sm80/sm90 without register spills (tests/kernels: build_for_gpu).
    """
    block_n = 64 if d_pad <= 128 else 32
    if dtype != tl.float32 and cache_bytes == 1:
        return 2 * block_n, 8, 3 if d_pad <= 128 else 2  # head 256: a third 128 x 256 stage would spill
    if dtype != tl.float32:
        return block_n, 8, 3
    if cache_bytes == 1:  # float32 operands over 1-byte codes: 64 tokens spill on sm80/sm90 with Triton 3.6-3.7
        return block_n // 2, 8, 1
    return block_n, 8, 3  # float32 operands


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """A fixed split count (CUDA-graph capture): fill about two waves of SMs, >= MIN_TOKENS_PER_SPLIT per split."""
    by_len = max(1, max_len // MIN_TOKENS_PER_SPLIT)
    if device.type != "cuda":
        return min(2, by_len)  # interpreter: few programs are cheapest
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    wanted = -(-2 * sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, by_len, 32))


@functools.cache
def _num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (queried once: the query costs microseconds)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_split_tokens(
    total_tokens: int, max_cols: int, num_kv_heads: int, block_n: int, device, waves: int = WAVES
) -> int:
    """Tokens per decode split, a multiple of ``block_n``: about ``waves`` split programs per SM over the batch.

    ``total_tokens`` is the KV positions the batch attends (all sequences), ``max_cols`` the longest
    range one sequence walks. At least MIN_TOKENS_PER_SPLIT, and that range needs <= MAX_SPLITS splits.
    """
    if device.type != "cuda":
        tokens = -(-max_cols // 2)  # interpreter: few programs are cheapest (at most two splits)
    else:
        sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        tokens = -(-total_tokens * num_kv_heads // (waves * sms))
    tokens = max(tokens, MIN_TOKENS_PER_SPLIT, -(-max_cols // MAX_SPLITS))
    return -(-tokens // block_n) * block_n

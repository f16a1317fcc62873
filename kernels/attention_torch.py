"""The torch core of the paged attention references: gather K/V through block tables, attend densely.

The decode and prefill torch paths (the CPU engine's paths) both gather each cache into a
dense float32 cache by whole blocks and run one masked softmax attention over it; they differ
only in where their queries sit (``q_pos``). Decode attends the token-major ``[S, L, Hkv, D]``
gather with SDPA directly; prefill copies it head-major ``[Hkv, S, L, D]`` for its bmm chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.quant import as_storage


def gather_blocks(cache, scale, block_tables, seq_lens, kv_start, max_len: int, *, zero_invalid: bool = True):
    """Dense float32 ``[S, L, Hkv, D]`` (L = max_len rounded up to whole blocks) of the cache through block tables.

    Whole blocks are gathered (one contiguous row per block). Table entries covering no position of
    ``[kv_start, seq_len)`` are never read; positions outside that range are 0 unless the caller
    knows there are none (``zero_invalid=False``): stale slots may hold NaN, and 0 * NaN is NaN.
    The result is a fresh tensor, safe to modify in place.
    """
    num_seqs, block_size = block_tables.shape[0], cache.shape[1]
    num_logical = -(-max_len // block_size)
    pos = torch.arange(num_logical * block_size, device=cache.device)  # [L]
    valid = (pos[None, :] >= kv_start[:, None]) & (pos[None, :] < seq_lens[:, None].long())  # [S, L]
    in_use = valid.view(num_seqs, num_logical, block_size).any(-1)  # [S, num_logical]
    ids = torch.where(in_use, block_tables[:, :num_logical].long(), 0).flatten()  # padding entries never read
    x = as_storage(cache).index_select(0, ids).view(cache.dtype)  # [S*num_logical, bs, Hkv, D]
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    if scale is not None:
        x.mul_(scale.index_select(0, ids)[..., None])  # scale: [num_blocks, bs, Hkv]
    x = x.view(num_seqs, num_logical * block_size, *cache.shape[2:])  # [S, L, Hkv, D]
    if zero_invalid:
        bad = (~valid).flatten().nonzero().squeeze(1)  # [n_bad] invalid (s, l) rows
        x.view(valid.numel(), -1).index_fill_(0, bad, 0.0)
    return x


def gather_kv(cache, scale, block_tables, seq_lens, kv_start, max_len: int) -> torch.Tensor:
    """Dense float32 head-major ``[Hkv, S, L, D]`` (contiguous) of :func:`gather_blocks`; invalid positions are 0.

    Head-major so that a prefix view ``[:, :, :keys]`` still collapses its (Hkv, S) batch for bmm.
    """
    x = gather_blocks(cache, scale, block_tables, seq_lens, kv_start, max_len)  # [S, L, Hkv, D]
    return x.permute(2, 0, 1, 3).contiguous()


def _visible(q_pos, seq_lens, length: int, sliding_window: int | None) -> torch.Tensor:
    """Mask ``[S, M, L]``: key l is visible to query m when l <= pos, l < seq_len and inside the window."""
    kpos = torch.arange(length, device=q_pos.device)[None, None, :]
    visible = (kpos <= q_pos[:, :, None]) & (kpos < seq_lens[:, None, None].long())
    if sliding_window is not None:
        visible &= kpos > q_pos[:, :, None] - sliding_window
    return visible


def dense_attention(q, k, v, q_pos, seq_lens, *, scale, sliding_window, soft_cap, need_lse=True):
    """Masked float32 softmax attention: q ``[S, M, Hq, D]`` at positions q_pos ``[S, M]``, k/v ``[Hkv, S, L, D]``.

    Returns (out ``[S, M, Hq, D]``, lse ``[S, M, Hq]`` or None when not ``need_lse``), float32. Without
    soft cap and lse it runs torch SDPA with the mask; otherwise explicit matmuls, where rows with no
    visible key give 0 and -inf. K and V must be finite (gather_kv zeroes stale positions).
    """
    num_seqs, m, num_q_heads, head_dim = q.shape
    num_kv_heads, length = k.shape[0], k.shape[2]
    group = num_q_heads // num_kv_heads
    visible = _visible(q_pos, seq_lens, length, sliding_window)  # [S, M, L]
    if soft_cap is None and not need_lse:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible[:, None], scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        return out.transpose(1, 2), None  # [S, M, Hq, D]
    qh = q.reshape(num_seqs, m, num_kv_heads, group, head_dim).permute(2, 0, 3, 1, 4)  # [Hkv, S, G, M, D]
    qh = qh.reshape(num_kv_heads, num_seqs, group * m, head_dim)
    logits = torch.matmul(qh, k.transpose(-1, -2)).mul_(scale)  # [Hkv, S, G*M, L]
    if soft_cap is not None:
        logits.div_(soft_cap).tanh_().mul_(soft_cap)
    logits = logits.view(num_kv_heads, num_seqs, group, m, length)
    logits.masked_fill_(~visible[None, :, None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [Hkv, S, G, M]
    probs = logits.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_()
    out = torch.matmul(probs.view(num_kv_heads, num_seqs, group * m, length), v)  # [Hkv, S, G*M, D]
    out = out.view(num_kv_heads, num_seqs, group, m, head_dim).permute(1, 3, 0, 2, 4)  # [S, M, Hkv, G, D]
    lse = lse.permute(1, 3, 0, 2).reshape(num_seqs, m, num_q_heads)
    return out.reshape(num_seqs, m, num_q_heads, head_dim), lse

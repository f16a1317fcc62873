"""The torch core of the paged attention references: gather K/V through block tables, attend densely.

The decode and prefill torch paths (the CPU engine's paths) both gather each cache into a
dense head-major float32 ``[Hkv, S, L, D]`` and run one masked softmax attention over it;
they differ only in where their queries sit (``q_pos``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.quant import as_storage


def gather_kv(cache, scale, block_tables, seq_lens, kv_start, max_len: int) -> torch.Tensor:
    """Dense float32 ``[Hkv, S, L, D]`` (L = max_len rounded up to whole blocks) of the cache through block tables.

    Table entries covering no position of ``[kv_start, seq_len)`` are never read, and positions
    outside that range are 0: stale slots may hold NaN, and 0 * NaN is NaN.
    """
    num_seqs, block_size = block_tables.shape[0], cache.shape[1]
    num_logical = -(-max_len // block_size)
    pos = torch.arange(num_logical * block_size, device=cache.device)  # [L]
    valid = (pos[None, :] >= kv_start[:, None]) & (pos[None, :] < seq_lens[:, None].long())  # [S, L]
    in_use = valid.view(num_seqs, num_logical, block_size).any(-1)  # [S, num_logical]
    ids = torch.where(in_use, block_tables[:, :num_logical].long(), 0)  # padding entries never read
    # One row gather straight into head-major [Hkv, S, L, D]: its (Hkv, S) batch collapses for bmm.
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    heads = torch.arange(num_kv_heads, device=ids.device)[:, None]
    slots = (ids[:, :, None] * block_size + torch.arange(block_size, device=ids.device)).flatten()  # [S*L]
    rows = (slots[None] * num_kv_heads + heads).flatten()  # [Hkv*S*L] rows of the [N*bs*Hkv, D] cache
    x = as_storage(cache).reshape(-1, head_dim).index_select(0, rows).view(cache.dtype)  # [Hkv*S*L, D]
    x = x.to(torch.float32)  # a fresh tensor either way: safe to modify in place
    if scale is not None:
        x.mul_(scale.reshape(-1).index_select(0, rows)[:, None])
    bad = (~valid).flatten().nonzero().squeeze(1)  # [n_bad] invalid (s, l) of each head
    x.index_fill_(0, (heads * valid.numel() + bad[None]).flatten(), 0.0)
    return x.view(num_kv_heads, num_seqs, -1, head_dim)


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

"""The torch core of the paged attention references: gather K/V through block tables, attend densely.

Both torch paths (the CPU engine's) read the cache token by token: ``token_slots`` maps each
sequence's positions to cache slots, and one ``index_select`` on the cache viewed as
``[num_blocks * block_size * Hkv, D]`` rows gathers them head-major ``[Hkv, S, L, D]``, the
layout whose (Hkv, S) batch collapses for bmm. A position a sequence does not attend (past its
length, before its window) reads the nearest position it does attend instead, so every row
read is a written, finite value and no stale slot (which may hold NaN) is ever read: masking
the logits suffices, nothing is zeroed. Decode (one query per sequence) gathers only K; its
float32 values are summed straight from the cache by ``embedding_bag`` with the softmax
weights, with no dense copy. Large buffers come from per-thread scratch (see ``scratch``).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.quant import as_storage

SCRATCH_MAX_BYTES = 16 * 2**20  # largest CPU buffer kept for reuse, per (role, dtype) and thread


class _Scratch(threading.local):
    """Per-thread CPU buffers the torch paths reuse, one per (role, dtype).

    A fresh tensor of a few MB is mmap'd by the C allocator and page-faulted on first write,
    which on the 2-core machine costs several times the copy that fills it; reused buffers
    are already mapped. A thread keeps a handful (K, V, logits; codes and scales when
    quantized), each at most SCRATCH_MAX_BYTES, which bounds a decode group's dense K too.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}


_SCRATCH = _Scratch()


def scratch(role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised ``shape`` tensor: on CPU a view of this thread's ``role`` buffer (valid until its next use).

    Sizes above SCRATCH_MAX_BYTES, and other devices (whose allocators cache), get a fresh tensor.
    """
    numel = math.prod(shape)
    if device.type != "cpu" or numel * dtype.itemsize > SCRATCH_MAX_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = _SCRATCH.buffers.get((role, dtype))
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buf = _SCRATCH.buffers[(role, dtype)] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)


def token_slots(
    block_tables, seq_lens, kv_start, length: int, block_size: int, *, from_start: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots ``[S, length]`` of column positions and the mask ``[S, length]`` of those in ``[kv_start, seq_len)``.

    Column j holds position j, or ``kv_start + j`` with ``from_start`` (a window then needs only
    ``length = window`` columns). A position outside ``[kv_start, seq_len)`` is clamped into it
    (the slot of the sequence's first or last token; slot 0 for an empty sequence), so only the
    table entries covering ``[kv_start, seq_len)`` are read.
    """
    pos = torch.arange(length, device=block_tables.device)[None, :]  # [1, L]
    lens = seq_lens.long()[:, None]  # [S, 1]
    start = kv_start[:, None]  # [S, 1]
    if from_start:
        pos = pos + start  # [S, L], every position >= kv_start
        inside = pos < lens
    else:
        inside = (pos >= start) & (pos < lens)  # [S, L]
    pos = torch.clamp(pos, min=start, max=lens - 1).clamp_(min=0)  # [S, L] inside [kv_start, seq_len) (or 0)
    slots = block_tables.gather(1, pos // block_size).long() * block_size + pos % block_size
    return torch.where(lens > 0, slots, 0), inside


def head_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Head-major row ids ``[Hkv * S * L]`` (``slot * Hkv + head``) of slots ``[S, L]`` in the cache as D-rows."""
    heads = torch.arange(num_kv_heads, device=slots.device)[:, None, None]  # [Hkv, 1, 1]
    return (slots[None] * num_kv_heads + heads).flatten()


def _select_rows(t: torch.Tensor, rows: torch.Tensor, role: str) -> torch.Tensor:
    """Rows ``[N, ...]`` of ``t`` ``[num_blocks, block_size, Hkv, ...]`` at :func:`head_rows` ids (in scratch)."""
    num_blocks, block_size, num_heads = t.shape[:3]
    if t.stride(0) != block_size * t.stride(1) or t.stride(1) != num_heads * t.stride(2):  # no (slot, head) rows
        return t[rows // (block_size * num_heads), rows // num_heads % block_size, rows % num_heads]
    out = scratch(role, (rows.shape[0], *t.shape[3:]), t.dtype, t.device)
    return torch.index_select(t.flatten(0, 2), 0, rows, out=out)


def gather_heads(cache, scale, rows, shape: tuple[int, int, int], role: str) -> torch.Tensor:
    """Float32 head-major ``[*shape, D]`` = ``[Hkv, S, L, D]`` (contiguous) of the cache at :func:`head_rows` ids.

    One ``index_select`` of ``D``-value rows reads each (slot, head) once, then quantized codes are
    dequantized in place. The result may live in the ``role`` scratch buffer: use it before the
    next gather of that role.
    """
    x = _select_rows(as_storage(cache), rows, role).view(cache.dtype)  # [Hkv * S * L, D]
    if x.dtype != torch.float32:
        x = scratch(role, x.shape, torch.float32, x.device).copy_(x)
    if scale is not None:
        x.mul_(_select_rows(scale, rows, role + "_scale")[:, None])  # scale: [num_blocks, bs, Hkv]
    return x.view(*shape, cache.shape[3])


def gather_kv(cache, scale, block_tables, seq_lens, kv_start, max_len: int, role: str) -> torch.Tensor:
    """Dense float32 head-major ``[Hkv, S, L, D]`` (contiguous, L = max_len) of the cache, in ``role`` scratch.

    Head-major so that a prefix view ``[:, :, :keys]`` still collapses its (Hkv, S) batch for bmm.
    Every value is finite: positions outside ``[kv_start, seq_len)`` hold the sequence's last token.
    """
    slots, _ = token_slots(block_tables, seq_lens, kv_start, max_len, cache.shape[1])
    rows = head_rows(slots, cache.shape[2])
    return gather_heads(cache, scale, rows, (cache.shape[2], *slots.shape), role)


@dataclass(frozen=True)
class DecodeLayout:
    """Where a decode batch's keys lie in the cache: the same for every layer of a step."""

    slots: torch.Tensor  # [S, L] int64 cache slot of column l of sequence s
    inside: torch.Tensor | None  # [S, L] bool visible columns; None when all are
    rows: torch.Tensor  # [Hkv * S * L] int64 head_rows(slots)
    bag_rows: torch.Tensor  # [Hkv * S * G * L] int64: rows again for each query head of a group
    bag_offsets: torch.Tensor  # [Hkv * S * G] int64 first entry of each (head, seq, query head) bag

    @property
    def shape(self) -> tuple[int, int, int]:
        """(Hkv, S, L) of the gathered K."""
        return self.rows.shape[0] // self.slots.numel(), *self.slots.shape


def decode_layout(slots, inside, num_kv_heads: int, group: int) -> DecodeLayout:
    """The :class:`DecodeLayout` of ``slots`` / ``inside`` ``[S, L]`` (from :func:`token_slots`) for Hkv x G heads."""
    rows = head_rows(slots, num_kv_heads)  # [Hkv * S * L]
    num_seqs, length = slots.shape
    bag_rows = rows.view(num_kv_heads, num_seqs, 1, length).expand(-1, -1, group, -1).flatten()
    offsets = torch.arange(0, bag_rows.numel(), length, device=slots.device)
    return DecodeLayout(slots, inside, rows, bag_rows, offsets)


def decode_attention(q, k_cache, v_cache, k_scale, v_scale, layout: DecodeLayout, *, scale, soft_cap, need_lse):
    """One query per sequence: q ``[S, Hq, D]`` over the cache where ``layout`` says -> (out ``[S, Hq, D]``, lse).

    Every sequence must see at least one key. out and lse ``[S, Hq]`` (None unless ``need_lse``)
    are float32.
    """
    k = gather_heads(k_cache, k_scale, layout.rows, layout.shape, "k")  # [Hkv, S, L, D]
    probs, lse = _decode_probs(q, k, layout.inside, scale=scale, soft_cap=soft_cap, need_lse=need_lse)
    return _weighted_values(probs, v_cache, v_scale, layout), lse


def _decode_probs(q, k, inside, *, scale, soft_cap, need_lse):
    """Softmax weights ``[Hkv, S, G, L]`` of q ``[S, Hq, D]`` over k ``[Hkv, S, L, D]`` and lse ``[S, Hq]`` (or None).

    One bmm over the (Hkv, S) batch: ``[G, D] x [D, L]`` per (head, sequence).
    """
    num_kv_heads, num_seqs, length, head_dim = k.shape
    qh = q.to(torch.float32).unflatten(1, (num_kv_heads, -1)).transpose(0, 1)  # [Hkv, S, G, D]
    group = qh.shape[2]
    logits = scratch("logits", (num_kv_heads * num_seqs, group, length), torch.float32, q.device)
    torch.bmm(qh.reshape(-1, group, head_dim), k.view(-1, length, head_dim).transpose(1, 2), out=logits)
    logits = logits.view(num_kv_heads, num_seqs, group, length).mul_(scale)  # [Hkv, S, G, L]
    if soft_cap is not None:
        logits.div_(soft_cap).tanh_().mul_(soft_cap)
    if inside is not None:
        logits.masked_fill_(~inside[:, None, :], float("-inf"))  # [S, 1, L] against [Hkv, S, G, L]
    lse = torch.logsumexp(logits, -1).transpose(0, 1).reshape(num_seqs, -1) if need_lse else None  # [S, Hq]
    return torch.softmax(logits, -1), lse  # finite: every row sees a key


def _weighted_values(probs, v_cache, v_scale, layout: DecodeLayout) -> torch.Tensor:
    """``sum_l probs[h, s, g, l] * V[slots[s, l], h]`` as ``[S, Hq, D]`` float32.

    A contiguous float32 cache is summed in place by ``embedding_bag`` (one bag of L weighted
    rows per query head), copying nothing; other caches are gathered (and dequantized), then bmm.
    """
    num_kv_heads, num_seqs, group, length = probs.shape
    head_dim = v_cache.shape[3]
    if v_cache.dtype == torch.float32 and v_cache.is_contiguous():
        out = F.embedding_bag(
            layout.bag_rows, v_cache.view(-1, head_dim), layout.bag_offsets, mode="sum",
            per_sample_weights=probs.flatten(),
        )  # fmt: skip
    else:
        v = gather_heads(v_cache, v_scale, layout.rows, layout.shape, "v")  # [Hkv, S, L, D]
        out = torch.bmm(probs.view(-1, group, length), v.view(-1, length, head_dim))  # [Hkv * S, G, D]
    return out.view(num_kv_heads, num_seqs, group, head_dim).transpose(0, 1).reshape(num_seqs, -1, head_dim)


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
    visible key give 0 and -inf. K and V must be finite (gather_kv gathers written slots only).
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

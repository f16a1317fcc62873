"""Causal attention of each sequence's new tokens over their own contiguous K/V (a fresh prefill chunk).

A prefill chunk's K/V are in hand before they reach the pages, packed like its queries
(``[T, H, D]`` with offsets ``cu_seqlens``), so a sequence with no cached prefix needs no
block table: the best dense variable-length kernel of the device attends it.

- ``"flash"``: PyTorch's FlashAttention-2 varlen op (``aten._flash_attention_forward`` with
  ``cu_seqlens``) on CUDA, 16-bit inputs, GQA native, one launch for the whole batch.
- ``"sdpa"``: PyTorch's flash CPU op (``aten._scaled_dot_product_flash_attention_for_cpu``),
  one call per sequence (the op has no varlen form), GQA native.
- ``"torch"``: the float32 dense reference, one sequence at a time.

Each returns the natural-log logsumexp too, so a chunk's part can be merged with paged
attention over a cached prefix (:func:`kernels.merge_states.merge_attention_states`). The fast
ops are private PyTorch ops: :func:`best_chunk_backend` probes one once per (device, dtype,
heads, head_dim) against the reference and answers None when neither passes; ``"auto"``
then falls back to the reference. The probe reads device values: call it at start-up, not on
the hot path (the engine's model runner does).
"""

from __future__ import annotations

from typing import Literal

import torch

from kernels.checks import check_options
from kernels.metadata import ChunkMetadata, check_metadata, prepare_chunk_metadata
from paged_kv.errors import InvalidArgumentError, check_int, describe
from paged_kv.tensor_checks import FLOAT_DTYPES, check_device, check_dtype, check_shape, check_tensor

ChunkBackend = Literal["auto", "flash", "sdpa", "torch"]
CHUNK_BACKENDS = ("auto", "flash", "sdpa", "torch")
PROBE_LENS = (1, 3, 19, 40)  # ragged chunk lengths of the probe batch
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}  # max |out - reference|
_probed: dict[tuple, str | None] = {}  # (device, dtype, Hq, Hkv, D) -> the backend that passed, or None


def dense_chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_lens: object,
    *,
    scale: float | None = None,
    backend: ChunkBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each sequence's packed tokens over themselves -> (out ``[T, Hq, D]``, lse ``[T, Hq]``).

    q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` of one float dtype; ``query_lens[s]`` (host ints)
    tokens of sequence s, packed in order. Query j of a sequence sees its keys 0..j. out has q's
    dtype, lse is float32. Query head h uses KV head ``h // (Hq // Hkv)``; logits ``scale * q.k``.
    ``backend="torch"`` is the dense float32 reference, one sequence at a time.
    """
    _check_qkv(q, k, v)
    meta = prepare_chunk_metadata(query_lens, q.device)
    if meta.num_tokens != q.shape[0]:
        raise InvalidArgumentError(describe("query_lens", meta.host_cu_seqlens[-1], f"a sum of q's {q.shape[0]} rows"))
    return dense_chunk_attention_prepared(q, k, v, meta, scale=scale, backend=backend)


def dense_chunk_attention_prepared(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: ChunkMetadata,
    *,
    scale: float | None = None,
    backend: ChunkBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dense_chunk_attention` over host-validated :class:`ChunkMetadata`: host checks only, no device read."""
    _check_qkv(q, k, v)
    check_metadata(meta, ChunkMetadata, device=q.device)
    if meta.num_tokens != q.shape[0]:
        raise InvalidArgumentError(describe("meta.num_tokens", meta.num_tokens, f"q's {q.shape[0]} rows"))
    scale = check_options(q.shape[2], scale, None, None)[0]
    chosen = _resolve(backend, q, k)
    if q.shape[0] == 0:
        return torch.empty_like(q), torch.empty(0, q.shape[1], device=q.device, dtype=torch.float32)
    return _RUNNERS[chosen](q, k.contiguous(), v.contiguous(), meta, scale)


def best_chunk_backend(
    device: torch.device | str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> str | None:
    """The fastest backend that matches the reference on a probe batch of this geometry ("flash", "sdpa"), or None.

    Probed once per (device, dtype, heads, head_dim) and remembered; reads device values.
    """
    device = check_device("device", device)
    check_dtype("dtype", dtype, FLOAT_DTYPES)
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        check_int(name, value, low=1)
    if num_heads % num_kv_heads:
        raise InvalidArgumentError(describe("num_kv_heads", num_kv_heads, f"a divisor of num_heads {num_heads}"))
    key = (str(device), dtype, num_heads, num_kv_heads, head_dim)
    if key not in _probed:
        candidates = ("flash",) if device.type == "cuda" else ("sdpa",)
        geometry = (device, dtype, num_heads, num_kv_heads, head_dim)
        _probed[key] = next((b for b in candidates if _passes(b, *geometry)), None)
    return _probed[key]


def _check_qkv(q: object, k: object, v: object) -> None:
    """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``: one float dtype, one device, Hkv divides Hq."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_shape("v", v, tuple(k.shape))
    if q.shape[1] == 0 or q.shape[2] == 0:
        raise InvalidArgumentError(describe("q.shape", tuple(q.shape), "[T, Hq, D] with Hq >= 1 and D >= 1"))
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise InvalidArgumentError(describe("k.shape", tuple(k.shape), f"[{q.shape[0]}, Hkv, {q.shape[2]}] like q"))
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise InvalidArgumentError(describe("k.shape[1]", k.shape[1], f"a divisor of q's {q.shape[1]} heads"))


def _resolve(backend: object, q: torch.Tensor, k: torch.Tensor) -> str:
    """The backend that runs: 'auto' is the probed fast one for this geometry, else the reference."""
    if backend not in CHUNK_BACKENDS:
        raise InvalidArgumentError(describe("backend", backend, f"one of {CHUNK_BACKENDS}"))
    if backend == "auto":
        return best_chunk_backend(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2]) or "torch"
    if backend == "flash" and not q.is_cuda:
        raise InvalidArgumentError(describe("backend", backend, "CUDA tensors"))
    return backend


def _flash(q, k, v, meta: ChunkMetadata, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One varlen FlashAttention-2 launch; its lse comes as ``[Hq, T]``."""
    cu, n = meta.cu_seqlens, meta.max_len
    flash = torch.ops.aten._flash_attention_forward  # (q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug)
    out, lse = flash(q.contiguous(), k, v, cu, cu, n, n, 0.0, True, False, scale=scale)[:2]
    return out, lse.t()  # [T, Hq, D], [T, Hq] (a transposed view)


def _per_sequence(q, k, v, meta: ChunkMetadata, attend) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend(q_s, k_s, v_s) -> (out [L, Hq, D], lse [L, Hq])`` on each sequence's rows, packed back."""
    out = torch.empty_like(q)  # [T, Hq, D]
    lse = torch.empty(q.shape[:2], device=q.device, dtype=torch.float32)  # [T, Hq]
    cu = meta.host_cu_seqlens
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a < b:
            out[a:b], lse[a:b] = attend(q[a:b], k[a:b], v[a:b])
    return out, lse


def _sdpa(q, k, v, meta: ChunkMetadata, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash CPU op per sequence on ``[1, H, L, D]`` views."""

    def attend(qs, ks, vs):
        views = (t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))  # [1, H, L, D]
        o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*views, 0.0, True, scale=scale)
        return o[0].transpose(0, 1), m[0].t()

    return _per_sequence(q, k, v, meta, attend)


def _dense(q, k, v, meta: ChunkMetadata, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 dense causal attention per sequence (the reference)."""
    group = q.shape[1] // k.shape[1]

    def attend(qs, ks, vs):
        n = qs.shape[0]
        qs = qs.float().transpose(0, 1)  # [Hq, L, D]
        ks, vs = (t.float().transpose(0, 1).repeat_interleave(group, 0) for t in (ks, vs))  # [Hq, L, D]
        s = scale * qs @ ks.transpose(1, 2)  # [Hq, L, L]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=qs.device).triu(1), float("-inf"))
        return (torch.softmax(s, -1) @ vs).transpose(0, 1).to(q.dtype), torch.logsumexp(s, -1).t()

    return _per_sequence(q, k, v, meta, attend)


_RUNNERS = {"flash": _flash, "sdpa": _sdpa, "torch": _dense}


def _passes(backend: str, device, dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether ``backend`` runs and matches the reference on a seeded ragged batch of this geometry."""
    gen = torch.Generator().manual_seed(0)
    total = sum(PROBE_LENS)
    heads = (num_heads, num_kv_heads, num_kv_heads)
    q, k, v = (torch.randn(total, h, head_dim, generator=gen).to(device, dtype) for h in heads)
    meta = prepare_chunk_metadata(list(PROBE_LENS), device)
    scale = head_dim**-0.5
    try:
        out, lse = _RUNNERS[backend](q, k, v, meta, scale)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # op missing or geometry unsupported
        return False
    ref_out, ref_lse = _dense(q, k, v, meta, scale)
    tol = PROBE_TOLERANCE.get(dtype, 5e-2)
    return bool((out.float() - ref_out.float()).abs().max() <= tol and (lse - ref_lse).abs().max() <= 1e-2)

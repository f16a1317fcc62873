"""Merge two partial attention states (output, natural-log lse) over disjoint key sets.

If ``out_a, lse_a`` is softmax attention over key set A and ``out_b, lse_b`` over a
disjoint set B, the merge is the attention over A ∪ B:
``lse = log(exp(lse_a) + exp(lse_b))`` and ``out = w_a * out_a + w_b * out_b`` with
``w_x = exp(lse_x - lse)``. An empty part has lse = -inf and weight 0 (its output, even
NaN, is ignored); when both are empty the result is 0 with lse -inf. Typical use: attend a
shared prefix once for many sequences, attend each sequence's own suffix, merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import Backend, check_triton_device, use_triton
from paged_kv.tensor_checks import FLOAT_DTYPES, check_shape, check_tensor

ROWS_PER_PROGRAM = 16


@triton.jit
def _merge_kernel(
    oa_ptr, la_ptr, ob_ptr, lb_ptr, out_ptr, lse_ptr, num_rows, num_heads,
    soa_n, soa_h, soa_d, sla_n, sla_h, sob_n, sob_h, sob_d, slb_n, slb_h,
    so_n, so_h, so_d, sl_n, sl_h,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N * H, ROWS),): each program merges ROWS (token, head) rows."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, D_PAD)
    r_mask = rows < num_rows
    n = (rows // num_heads).to(tl.int64)
    h = rows % num_heads
    lse_a = tl.load(la_ptr + n * sla_n + h * sla_h, mask=r_mask, other=float("-inf"))
    lse_b = tl.load(lb_ptr + n * slb_n + h * slb_h, mask=r_mask, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m_use = tl.where(m == float("-inf"), 0.0, m)  # both empty: weights 0, no NaN
    w_a = tl.exp2((lse_a - m_use) * 1.4426950408889634)
    w_b = tl.exp2((lse_b - m_use) * 1.4426950408889634)
    total = w_a + w_b
    inv = 1.0 / tl.where(total > 0, total, 1.0)
    mask = r_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    d = offs_d[None, :]
    oa = tl.load(oa_ptr + n[:, None] * soa_n + h[:, None] * soa_h + d * soa_d, mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + n[:, None] * sob_n + h[:, None] * sob_h + d * sob_d, mask=mask, other=0.0).to(tl.float32)
    oa = tl.where((w_a > 0)[:, None], oa * (w_a * inv)[:, None], 0.0)  # an empty part's output never leaks
    ob = tl.where((w_b > 0)[:, None], ob * (w_b * inv)[:, None], 0.0)
    out = oa + ob  # [ROWS, D_PAD]
    tl.store(out_ptr + n[:, None] * so_n + h[:, None] * so_h + d * so_d, out.to(out_ptr.dtype.element_ty), mask=mask)
    lse = tl.where(total > 0, m_use + tl.log2(tl.where(total > 0, total, 1.0)) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + n * sl_n + h * sl_h, lse, mask=r_mask)


def _check_states(out_a, lse_a, out_b, lse_b) -> None:
    """Validate two states: outputs ``[N, H, D]`` of one float dtype, lse ``[N, H]`` float32, one device."""
    check_tensor("out_a", out_a, ndim=3, dtypes=FLOAT_DTYPES)
    device = out_a.device
    check_tensor("out_b", out_b, ndim=3, dtypes=(out_a.dtype,), device=device)
    check_shape("out_b", out_b, tuple(out_a.shape))
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(name, lse, ndim=2, dtypes=(torch.float32,), device=device)
        check_shape(name, lse, tuple(out_a.shape[:2]))


def _merge_torch(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch path in float32: weights from the lse pair, -inf parts weigh 0."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isneginf(m), 0.0, m)  # [N, H]
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    safe = torch.where(total > 0, total, 1.0)
    part_a = torch.where((w_a > 0)[..., None], out_a.float() * (w_a / safe)[..., None], 0.0)
    part_b = torch.where((w_b > 0)[..., None], out_b.float() * (w_b / safe)[..., None], 0.0)
    out = part_a + part_b  # an empty part's output (even NaN) never leaks
    lse = torch.where(total > 0, m + torch.log(safe), float("-inf"))
    return out.to(out_a.dtype), lse


def _merge_triton(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the merge kernel over N * H rows."""
    num_tokens, num_heads, head_dim = out_a.shape
    out = torch.empty_like(out_a, memory_format=torch.contiguous_format)
    lse = torch.empty(num_tokens, num_heads, device=out_a.device, dtype=torch.float32)
    num_rows = num_tokens * num_heads
    _merge_kernel[(triton.cdiv(num_rows, ROWS_PER_PROGRAM),)](
        out_a, lse_a, out_b, lse_b, out, lse, num_rows, num_heads,
        *out_a.stride(), *lse_a.stride(), *out_b.stride(), *lse_b.stride(), *out.stride(), *lse.stride(),
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), ROWS=ROWS_PER_PROGRAM,
    )  # fmt: skip
    return out, lse


def merge_attention_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over two disjoint key sets: outs ``[N, H, D]``, lse ``[N, H]`` -> (out, lse float32).

    The output has out_a's dtype; the lse is natural-log, -inf for a row whose both parts are empty.
    ``backend="torch"`` is the float32 torch reference.
    """
    _check_states(out_a, lse_a, out_b, lse_b)
    run_triton = use_triton(backend, out_a, lse_a, out_b, lse_b)
    if out_a.numel() == 0:
        return _merge_torch(out_a, lse_a, out_b, lse_b)  # nothing to launch
    if run_triton:
        check_triton_device(out_a)
        return _merge_triton(out_a, lse_a, out_b, lse_b)
    return _merge_torch(out_a, lse_a, out_b, lse_b)


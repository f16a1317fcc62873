"""Sparse mixture-of-experts feed-forward: Mixtral, Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE.

A sparse layer replaces the dense SwiGLU MLP by ``num_experts`` SwiGLU experts and a router: each token's
router logits go through a softmax (float32), the ``num_experts_per_tok`` largest probabilities pick its
experts (``torch.topk``, as transformers: ties go the same way), optionally renormalized to sum to 1
(``norm_topk_prob``; Mixtral always), and the token's output is the weighted sum of its experts' outputs.
Qwen2-MoE adds a shared expert every token runs through, scaled by ``sigmoid(shared_expert_gate(x))``.
Which layers are sparse is ``ModelConfig.sparse_layers`` (Qwen's ``decoder_sparse_step`` and
``mlp_only_layers``); the others keep the dense MLP of ``intermediate_size``.

Tensor parallelism shards every expert's intermediate rows (and the shared expert's) across the ranks as the
dense MLP's; the router and the shared-expert gate are replicated, so every rank routes every token alike,
and one all-reduce sums the block's partial outputs. There is no expert parallelism (vLLM's
``--enable-expert-parallel``, which places whole experts on ranks).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from paged_kv.errors import InvalidArgumentError, check_bool, check_int, describe
from scheduler.distributed.parallel_state import TPShard, all_reduce
from scheduler.model.parallel_layers import ColumnParallelLinear

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")  # transformers model types whose sparse layers this block runs


class MoEConfig(Protocol):
    """The ``ModelConfig`` fields this module reads (a protocol: llama.py imports this module, not the reverse)."""

    num_layers: int
    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int
    sparse_layers: tuple[int, ...]


def check_moe_fields(cfg: MoEConfig) -> None:
    """Validate a config's MoE fields: experts only with a router top-k and expert size, sparse layers in range."""
    check_int("num_experts", cfg.num_experts, low=0)
    check_int("num_experts_per_tok", cfg.num_experts_per_tok, low=0, high=cfg.num_experts)
    check_int("moe_intermediate_size", cfg.moe_intermediate_size, low=0)
    check_int("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size, low=0)
    check_bool("norm_topk_prob", cfg.norm_topk_prob)
    if not isinstance(cfg.sparse_layers, tuple):
        raise InvalidArgumentError(describe("sparse_layers", cfg.sparse_layers, "a tuple of layer indices"))
    for i in cfg.sparse_layers:
        check_int("sparse_layers", i, low=0, high=cfg.num_layers - 1)
    if list(cfg.sparse_layers) != sorted(set(cfg.sparse_layers)):
        raise InvalidArgumentError(describe("sparse_layers", cfg.sparse_layers, "increasing layer indices"))
    if cfg.sparse_layers and cfg.num_experts == 0:
        raise InvalidArgumentError(describe("num_experts", 0, "at least 1 when some layer is sparse (sparse_layers)"))
    if cfg.sparse_layers:  # a sparse layer routes each token to at least one expert of at least one row
        check_int("num_experts_per_tok", cfg.num_experts_per_tok, low=1, high=cfg.num_experts)
        check_int("moe_intermediate_size", cfg.moe_intermediate_size, low=1)


def moe_fields(c: object, model_type: str) -> dict:
    """The ModelConfig MoE fields of a transformers Mixtral, Qwen2-MoE or Qwen3-MoE config ({} for a dense one)."""
    if model_type == "mixtral":  # every layer sparse; experts of intermediate_size; top-k always renormalized
        return dict(
            num_experts=c.num_local_experts, num_experts_per_tok=c.num_experts_per_tok,
            moe_intermediate_size=c.intermediate_size, norm_topk_prob=True,
            sparse_layers=tuple(range(c.num_hidden_layers)),
        )  # fmt: skip
    if model_type not in ("qwen2_moe", "qwen3_moe") or c.num_experts == 0:  # no experts: every layer dense
        return {}
    dense = set(getattr(c, "mlp_only_layers", None) or ())
    step = check_int("hf_config.decoder_sparse_step", getattr(c, "decoder_sparse_step", 1), low=1)
    sparse = tuple(i for i in range(c.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return dict(
        num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=bool(c.norm_topk_prob),
        shared_expert_intermediate_size=getattr(c, "shared_expert_intermediate_size", 0) or 0,
        sparse_layers=sparse,
    )  # fmt: skip


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype):
    """Router logits [T, E] -> (weights [T, k] in ``dtype``, expert ids [T, k]): softmax in float32, then top-k."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class Experts(nn.Module):
    """Every expert's SwiGLU weights stacked (this rank's intermediate rows), run grouped by expert.

    Grouping: the ``T * k`` (token, slot) pairs are sorted by expert (a stable argsort), so each expert's
    rows are one contiguous run of the gathered rows, its run end the cumulative per-expert count. Each
    expert's weights are read in place once per step (no gathered copy per token, as a batched gather +
    bmm would make), and the compute is exactly the routed rows (no padding to a capacity, no dense
    all-experts pass). The slot outputs are put back in token order and summed over the k slots without
    atomics (deterministic, unlike an ``index_add_``).

    The runs are multiplied by ``F.grouped_mm``, which takes the run ends as a tensor on the rows' device:
    no device value is read on the host here, and the shapes depend on ``T`` only (a decode step stays
    capturable in a CUDA graph where torch's fused kernel runs: bf16 on sm90/sm100; other dtypes and
    GPUs go through torch's own per-group loop, which copies the ends to the host; on the CPU that loop
    is about as fast as one of our own). ``F.grouped_mm`` needs rows of a multiple of 16 bytes; experts
    whose sizes are not (tiny test models) run :meth:`looped`, one matmul pair per picked expert, which
    reads the run ends on the host.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        # small random values until a checkpoint loads (as nn.Linear's own init, never uninitialized memory)
        self.gate_up = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) * 0.02)  # gate rows, then up rows
        self.down = nn.Parameter(torch.randn(num_experts, hidden, inter) * 0.02)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; weights, ids: [T, k] -> sum over slots of weight * expert(x): [T, hidden]."""
        num_tokens, top_k = ids.shape
        flat = ids.flatten()  # [T*k], slot s of token t at t*k + s
        order = flat.argsort(stable=True)  # slots grouped by expert, token order within each expert
        counts = torch.zeros(self.num_experts, dtype=flat.dtype, device=flat.device)
        ends = counts.scatter_add_(0, flat, torch.ones_like(flat)).cumsum(0)  # [E] run ends (bincount syncs on CUDA)
        rows = x[order // top_k]  # [T*k, hidden], each slot's token
        out = self.grouped(rows, ends) if self.aligned(x) else self.looped(rows, ends)  # [T*k, hidden]
        slots = torch.empty_like(out).index_copy_(0, order, out).view(num_tokens, top_k, x.shape[1])  # token order
        return (slots * weights.unsqueeze(-1)).sum(dim=1)

    def aligned(self, x: torch.Tensor) -> bool:
        """Whether ``F.grouped_mm`` takes these shapes: hidden and expert rows of a multiple of 16 bytes."""
        return all(n * x.element_size() % 16 == 0 for n in (self.down.shape[1], self.down.shape[2]))

    def grouped(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """rows [N, hidden] sorted by expert, ends [E] -> the experts' outputs [N, hidden] by grouped GEMMs."""
        ends = ends.to(torch.int32)
        gate, up = F.grouped_mm(rows, self.gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=ends)

    def looped(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """The same by one matmul pair per picked expert (reads ``ends`` on the host)."""
        out = torch.empty_like(rows)
        start = 0
        for e, end in enumerate(ends.tolist()):
            if end > start:  # experts no slot picked are skipped
                gate, up = F.linear(rows[start:end], self.gate_up[e]).chunk(2, dim=-1)
                out[start:end] = F.linear(F.silu(gate) * up, self.down[e])
            start = end
        return out


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared SwiGLU expert over this rank's intermediate rows; its output is a partial sum (no reduce)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up = ColumnParallelLinear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)  # this rank's input columns; the block all-reduces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> this rank's part of the shared expert's output [T, hidden]."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Router, routed experts and (Qwen2-MoE) the gated shared expert of one sparse layer; one all-reduce."""

    def __init__(self, cfg: MoEConfig, shard: TPShard) -> None:
        super().__init__()
        i0, i1 = shard.split(cfg.moe_intermediate_size, "moe_intermediate_size")
        self.top_k, self.renormalize, self.tp_size = cfg.num_experts_per_tok, cfg.norm_topk_prob, shard.size
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # replicated on every rank
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, i1 - i0)
        self.shared = None
        if cfg.shared_expert_intermediate_size:
            s0, s1 = shard.split(cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size")
            self.shared = SharedExpert(cfg.hidden_size, s1 - s0)
            self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)  # replicated on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        weights, ids = route(self.router(x), self.top_k, self.renormalize, x.dtype)  # same on every rank
        out = self.experts(x, weights, ids)  # this rank's partial sum
        if self.shared is not None:  # the gate scales each rank's partial shared output alike: the sum is exact
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out if self.tp_size == 1 else all_reduce(out)

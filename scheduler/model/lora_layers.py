"""LoRA adapters applied per token in the model's projections, from fixed device slots.

:func:`attach_lora` gives each target projection of a :class:`~scheduler.model.llama.LlamaModel`
(the fused q/k/v, o, the fused gate/up, down) a :class:`LoRAProjection`: the A and B matrices of
``max_loras`` slots, every adapter padded to ``max_lora_rank`` (zeros), so shapes never change
with the adapters loaded. A fused projection stacks its slices' A matrices (``[slots, n R, in]``)
and holds their B matrices block-diagonally (``[slots, out, n R]``, each slice's rows against its
own rank columns), scale folded into B: one pair of matmuls computes every slice's update.

A tensor-parallel shard holds its part, as its base weights: a column-parallel projection (q/k/v,
gate/up) this rank's rows of each B (A whole), a row-parallel one (o, down) this rank's input
columns of A (B whole); its partial update ``(x_cols A_cols^T) B^T`` is added before the layer's
all-reduce, which sums it with the other ranks' into the whole update.

A step tells the model which tokens go through which slot with a :class:`LoRABatch` (built on the
host, uploaded with the step's input); set as ``LoRASlots.batch`` for the forward, it makes each
projection add ``(x_rows A^T) B^T`` to its output rows, one slot after the other. A step without
adapters leaves ``batch`` None: the projections do what they do without LoRA (one attribute read).
The slot tensors are plain attributes, not parameters or buffers: the model's state dict (and the
tiers' model identity) is the base model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.model.lora_adapter import TARGETS, LoRAAdapter, module_shape


@dataclass(frozen=True, eq=False)
class LoRABatch:
    """A step's tokens per adapter slot: (slot, row indices [n] int64, or None for every token of the step)."""

    groups: tuple[tuple[int, torch.Tensor | None], ...]


class LoRASlots:
    """The device slots of every projection and the step's token groups (read by the projections)."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.projections: dict[tuple[int, str], LoRAProjection] = {}  # (layer, fused name) -> its slots
        self.batch: LoRABatch | None = None  # set for one forward by the runner; None: base model only

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write ``adapter`` (whole-model weights; each projection keeps its shard) into ``slot`` everywhere."""
        for p in self.projections.values():
            p.clear(slot)
        for (layer, module), w in adapter.weights.items():
            fused, index = TARGETS[module]
            self.projections[(layer, fused)].write(slot, index, w.a, w.b * w.scale)


class LoRAProjection:
    """One projection's adapter slots: A ``[slots, n R, in]``, B ``[slots, out, n R]`` (slices block-diagonal).

    ``rows[i]``: this rank's output rows of slice ``i`` (column-parallel) or None (all); ``cols``: this rank's
    input columns (row-parallel) or None (all)."""

    def __init__(self, slots: LoRASlots, rows: list[range | None], sizes: list[int], cols: range | None,
                 fan_in: int, like: torch.Tensor) -> None:  # fmt: skip
        n, r = len(sizes), slots.max_rank
        self.slots, self.rows, self.sizes, self.cols, self.rank = slots, rows, sizes, cols, r
        self.offsets = [sum(sizes[:i]) for i in range(n)]  # each slice's first output row here
        self.a = torch.zeros(slots.max_loras, n * r, fan_in, dtype=like.dtype, device=like.device)
        self.b = torch.zeros(slots.max_loras, sum(sizes), n * r, dtype=like.dtype, device=like.device)

    def clear(self, slot: int) -> None:
        """Zero one slot (an adapter without this projection adds nothing)."""
        self.a[slot].zero_()
        self.b[slot].zero_()

    def write(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slice ``index``'s whole A ``[r, in]`` and scaled B ``[out_i, r]`` into ``slot``, this rank's part of them."""
        rows, cols = self.rows[index], self.cols
        a = a if cols is None else a[:, cols.start : cols.stop]
        b = b if rows is None else b[rows.start : rows.stop]
        r, at, first = a.shape[0], index * self.rank, self.offsets[index]
        self.a[slot, at : at + r].copy_(a)
        self.b[slot, first : first + self.sizes[index], at : at + r].copy_(b)

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, out] += each token group's update from x [T, in] through its slot."""
        batch = self.slots.batch
        if batch is None:
            return out
        for slot, rows in batch.groups:
            xs = x if rows is None else x.index_select(0, rows)
            delta = (xs @ self.a[slot].T) @ self.b[slot].T  # [n, out]
            if rows is None:
                out.add_(delta)
            else:
                out.index_add_(0, rows, delta)
        return out


def attach_lora(model: torch.nn.Module, max_loras: int, max_rank: int) -> LoRASlots:
    """Give every target projection of ``model`` (its tensor-parallel shard) adapter slots; returns them, also kept
    as ``model.lora_slots``."""
    cfg, shard, slots = model.config, model.shard, LoRASlots(max_loras, max_rank)
    d = cfg.head_dim
    q0, q1 = shard.split(cfg.num_heads, "num_heads")
    k0, k1 = shard.kv_heads(cfg.num_kv_heads, cfg.num_heads)
    i0, i1 = shard.split(cfg.intermediate_size, "intermediate_size")
    q, kv, inter = range(q0 * d, q1 * d), range(k0 * d, k1 * d), range(i0, i1)
    for i, layer in enumerate(model.layers):
        targets = [("qkv", layer.attn.qkv, [q, kv, kv], None, "q_proj"), ("o", layer.attn.o, [None], q, "o_proj")]
        if i not in cfg.sparse_layers:  # a mixture-of-experts layer's experts take no adapter (refused at load)
            targets += [("gate_up", layer.mlp.gate_up, [inter, inter], None, "gate_proj"),
                        ("down", layer.mlp.down, [None], inter, "down_proj")]  # fmt: skip
        for name, linear, rows, cols, module in targets:
            fan_in, fan_out = module_shape(cfg, module)
            sizes = [len(r) if r is not None else fan_out for r in rows]
            projection = LoRAProjection(slots, rows, sizes, cols, len(cols) if cols else fan_in, linear.weight)
            linear.lora = slots.projections[(i, name)] = projection
    model.lora_slots = slots
    return slots

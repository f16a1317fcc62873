"""Megatron-style parallel layers; with ``TPShard()`` (one rank) each is exactly its torch base layer.

* :class:`ColumnParallelLinear`: this rank's rows of the weight (output features); no collective.
* :class:`RowParallelLinear`: this rank's columns (input features); the partial outputs are
  summed with one all-reduce, and its bias (whole on every rank) is added once, after the sum.
* :class:`VocabParallelEmbedding`: this rank's part of the vocabulary; ids outside it embed
  to zero and one all-reduce sums the parts.
* :class:`ParallelLMHead`: this rank's vocabulary rows; the logits are gathered so every
  rank (the driver samples) holds ``[R, vocab]``.

The parameter names are the base layers' (``weight``), so a shard loads a sliced state dict
with the same keys (:func:`scheduler.model.sharding.shard_state_dict`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scheduler.distributed.parallel_state import TPShard, all_gather_last, all_reduce


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear`` holding ``out_features / size`` of the output features (already divided by the caller)."""

    lora = None  # a LoRAProjection once LoRA is attached (scheduler.model.lora_layers): adds each token's update

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out / size] (plus the step's LoRA updates, if any)."""
        out = super().forward(x)
        return out if self.lora is None else self.lora.add(x, out)


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` over this rank's input features; the outputs of every rank are summed, then the bias added."""

    def __init__(self, in_features: int, out_features: int, *, shard: TPShard, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp_size = shard.size
        self.lora = None  # a LoRAProjection once LoRA is attached: its partial update joins the same all-reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in / size] -> [T, out], summed over the ranks, plus the bias."""
        out = F.linear(x, self.weight)  # this rank's partial sum: no bias, which every rank holds whole
        if self.lora is not None:
            out = self.lora.add(x, out)  # a partial update too: it joins the same all-reduce
        if self.tp_size > 1:
            out = all_reduce(out)
        return out if self.bias is None else out + self.bias  # once, after the sum


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` over this rank's vocabulary rows ``[start, end)``; the ranks' lookups are summed."""

    def __init__(self, vocab_size: int, hidden: int, *, shard: TPShard) -> None:
        self.start, self.end = shard.vocab(vocab_size)
        super().__init__(self.end - self.start, hidden)
        self.tp_size = shard.size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] -> [T, hidden]."""
        if self.tp_size == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)  # ids another rank embeds
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(nn.Linear):
    """The LM head over this rank's vocabulary rows; logits gathered to ``[R, vocab]`` on every rank."""

    def __init__(self, hidden: int, vocab_size: int, *, shard: TPShard) -> None:
        start, end = shard.vocab(vocab_size)
        super().__init__(hidden, end - start, bias=False)
        self.vocab_size, self.tp_size = vocab_size, shard.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [R, hidden] -> logits [R, vocab]; every rank holds the same R (no collective when R == 0)."""
        out = super().forward(x)  # [R, vocab / size], the last rank's padded rows included
        if self.tp_size == 1 or x.shape[0] == 0:
            return out if self.tp_size == 1 else out.new_empty(0, self.vocab_size)
        return all_gather_last(out, self.tp_size)[:, : self.vocab_size]

"""Rotary position embeddings, with the "linear" and "llama3" frequency scalings.

Pairs are (i, i + D/2) ("rotate half" layout, as in transformers' Llama). The
angles are computed per step from the positions in float32, so no table
bounds the context length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from paged_kv.errors import InvalidArgumentError, check_real, describe

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, theta: float, scaling: Mapping[str, object] | None = None) -> torch.Tensor:
    """Per-pair rotation speeds ``[D/2]`` float32, scaled as ``scaling['rope_type']`` says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    try:
        if rope_type == "linear":
            return inv_freq / check_real("rope_scaling['factor']", scaling["factor"], low=0.0, open_low=True)
        if rope_type == "llama3":
            return _llama3_scaled(inv_freq, scaling)
    except KeyError as missing:  # a field the scaling needs
        expected = f"a {rope_type} scaling with {missing}"
        raise InvalidArgumentError(describe("rope_scaling", dict(scaling), expected)) from None
    raise InvalidArgumentError(describe("rope_scaling.rope_type", rope_type, f"one of {SUPPORTED_ROPE_TYPES}"))


def _llama3_scaled(inv_freq: torch.Tensor, scaling: Mapping[str, object]) -> torch.Tensor:
    """Llama 3.1 long-context scaling: slow pairs divided by ``factor``, fast pairs kept, a linear blend between."""
    factor, low, high, old_len = (
        check_real(f"rope_scaling[{k!r}]", scaling[k], low=0.0, open_low=True)
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    if not low < high:
        raise InvalidArgumentError(describe("rope_scaling['high_freq_factor']", high, f"> low_freq_factor={low}"))
    wavelen = 2 * math.pi / inv_freq
    # blend = 0 at wavelengths >= old_len / low (fully scaled), 1 at <= old_len / high (unscaled)
    blend = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    keep_fast = wavelen < old_len / high
    slow = wavelen > old_len / low
    return torch.where(keep_fast, inv_freq, torch.where(slow, inv_freq / factor, scaled))


class RotaryEmbedding(torch.nn.Module):
    """The model's rotation speeds; a step's cos and sin of its positions, which :func:`rotate` applies to q and k."""

    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, object] | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise InvalidArgumentError(describe("head_dim", head_dim, "an even number"))
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, D]`` in ``dtype`` of positions ``[T]`` (once per forward; the layers share them)."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # [T, 1, D]: pair (i, i + D/2) shares an angle
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, H, D]`` rotated by cos, sin ``[T, 1, D]``: ``x * cos + rotate_half(x) * sin``, as transformers does.

    One pass serves q and k together when they are one tensor (their heads side by side).
    """
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin

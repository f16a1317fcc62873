"""Rotary position embeddings, with the "linear", "llama3" and "yarn" frequency scalings.

Pairs are (i, i + D/2) ("rotate half" layout, as in transformers' Llama). The
angles are computed per step from the positions in float32, so no table
bounds the context length.

YaRN (Qwen2.5/Qwen3 long context, Llama-family fine-tunes) follows transformers'
``_compute_yarn_parameters`` key for key: each pair's speed blends the interpolated
(``/ factor``) and the original speed along a linear ramp between the correction pairs of
``beta_fast`` and ``beta_slow`` turns in ``original_max_position_embeddings`` positions, and cos
and sin are multiplied by its attention factor in float32 before the cast, where transformers
multiplies them. The model's context under YaRN is ``original_max_position_embeddings * factor``
(:func:`context_length`), as vLLM derives it; transformers bounds no context.

"dynamic" (NTK) and "longrope" are refused: their frequencies depend on the length of the
sequence being run (transformers recomputes them per forward; vLLM fixes dynamic's at
``max_position_embeddings * factor``), and keys already in the paged cache keep the rotation
they were written with, so no fixed choice equals transformers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from paged_kv.errors import InvalidArgumentError, check_bool, check_real, describe

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REFUSED_ROPE_TYPES = {  # rope_type: why it is refused
    "dynamic": "frequencies that change with the sequence length (transformers recomputes them per forward, "
    "vLLM fixes them at max_position_embeddings * factor): cached keys keep their rotation, so no fixed "
    "choice equals transformers",
    "longrope": "short or long factors chosen by the sequence length (transformers switches them per forward)",
}


def rope_type(scaling: Mapping[str, object] | None) -> object:
    """The scaling's ``rope_type`` (or its older name ``type``); "default" without a scaling."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_parameters(
    head_dim: int, theta: float, scaling: Mapping[str, object] | None = None,
    max_position_embeddings: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Per-pair rotation speeds ``[D/2]`` float32 and the factor cos and sin are multiplied by (1.0: none).

    ``max_position_embeddings`` is the fallback of yarn's ``original_max_position_embeddings``.
    """  # fmt: skip
    period = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # 1 / speed, per pair
    inv_freq = 1.0 / period
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "yarn":
        yarn = yarn_scaling(scaling, max_position_embeddings)
        return _yarn_scaled(period, head_dim, theta, yarn), yarn.attention_factor
    try:
        if kind == "linear":
            return inv_freq / check_real("rope_scaling.factor", scaling["factor"], low=0.0, open_low=True), 1.0
        if kind == "llama3":
            return _llama3_scaled(inv_freq, scaling), 1.0
    except KeyError as missing:  # a field the scaling needs
        expected = f"a {kind} scaling with {missing}"
        raise InvalidArgumentError(describe("rope_scaling", dict(scaling), expected)) from None
    expected = f"one of {SUPPORTED_ROPE_TYPES}"
    if kind in REFUSED_ROPE_TYPES:
        expected += f"; {kind} is not supported: {REFUSED_ROPE_TYPES[kind]}"
    raise InvalidArgumentError(describe("rope_scaling.rope_type", kind, expected))


def inverse_frequencies(
    head_dim: int, theta: float, scaling: Mapping[str, object] | None = None,
    max_position_embeddings: int | None = None,
) -> torch.Tensor:
    """Per-pair rotation speeds ``[D/2]`` float32, scaled as ``scaling['rope_type']`` says."""  # fmt: skip
    return rope_parameters(head_dim, theta, scaling, max_position_embeddings)[0]


def context_length(scaling: Mapping[str, object] | None, max_position_embeddings: int) -> int:
    """The longest sequence the model serves: ``original_max_position_embeddings * factor`` under yarn (vLLM's
    derivation), else ``max_position_embeddings``."""
    if rope_type(scaling) != "yarn":
        return max_position_embeddings
    yarn = yarn_scaling(scaling, max_position_embeddings)
    return int(yarn.original_max_position_embeddings * yarn.factor)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: Mapping[str, object]) -> torch.Tensor:
    """Llama 3.1 long-context scaling: slow pairs divided by ``factor``, fast pairs kept, a linear blend between."""
    factor, low, high, old_len = (
        check_real(f"rope_scaling.{k}", scaling[k], low=0.0, open_low=True)
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    if not low < high:
        raise InvalidArgumentError(describe("rope_scaling.high_freq_factor", high, f"> low_freq_factor={low}"))
    wavelen = 2 * math.pi / inv_freq
    # blend = 0 at wavelengths >= old_len / low (fully scaled), 1 at <= old_len / high (unscaled)
    blend = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    keep_fast = wavelen < old_len / high
    slow = wavelen > old_len / low
    return torch.where(keep_fast, inv_freq, torch.where(slow, inv_freq / factor, scaled))


@dataclass(frozen=True)
class YarnScaling:
    """A validated yarn ``rope_scaling``, its defaults and fallbacks resolved."""

    factor: float
    original_max_position_embeddings: float
    beta_fast: float  # turns in the original context above which a pair keeps its speed
    beta_slow: float  # turns below which a pair is divided by factor
    truncate: bool  # round the ramp's ends outwards to whole pairs
    attention_factor: float  # cos and sin are multiplied by it


def yarn_scaling(scaling: Mapping[str, object], max_position_embeddings: int | None = None) -> YarnScaling:
    """Read a yarn scaling as transformers does; a bad value raises InvalidArgumentError naming its key.

    Absent or None, ``original_max_position_embeddings`` is ``max_position_embeddings``, ``beta_fast`` and
    ``beta_slow`` are 32 and 1; a ``factor`` of None is the ratio of the two contexts (a missing ``factor``
    is refused, as transformers' validation does); ``truncate`` defaults to True. transformers takes a
    ``beta_fast`` or ``beta_slow`` of 0 for its default; here it is refused (no pair turns 0 times).
    """
    old_len = _yarn_number(scaling, "original_max_position_embeddings", max_position_embeddings)
    if "factor" not in scaling:
        raise InvalidArgumentError(describe("rope_scaling.factor", "missing", "a number >= 1 (yarn requires it)"))
    factor = scaling["factor"]
    if factor is None and max_position_embeddings is not None:  # DeepSeek-V3 style: the contexts' ratio
        factor = max_position_embeddings / old_len
    factor = check_real("rope_scaling.factor", factor, low=1.0)
    fast = _yarn_number(scaling, "beta_fast", 32.0)
    slow = _yarn_number(scaling, "beta_slow", 1.0)
    if fast < slow:
        raise InvalidArgumentError(describe("rope_scaling.beta_fast", fast, f">= beta_slow={slow}"))
    truncate = scaling.get("truncate", True)
    check_bool("rope_scaling.truncate", truncate)
    return YarnScaling(factor, old_len, fast, slow, truncate, _yarn_attention_factor(scaling, factor))


def _yarn_number(scaling: Mapping[str, object], key: str, default: float | None) -> float:
    """``scaling[key]`` as a finite number > 0; ``default`` when absent or None."""
    value = scaling.get(key)
    return check_real(f"rope_scaling.{key}", default if value is None else value, low=0.0, open_low=True)


def _yarn_attention_factor(scaling: Mapping[str, object], factor: float) -> float:
    """``attention_factor`` if given, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both
    are set and non-zero (DeepSeek), else ``mscale(factor)``: 0.1 ln(factor) + 1 (1.0 at factor 1)."""
    mscale, mscale_all_dim = (check_real(f"rope_scaling.{k}", scaling.get(k) or 0.0, low=0.0)
                              for k in ("mscale", "mscale_all_dim"))  # fmt: skip
    if scaling.get("attention_factor") is not None:
        return _yarn_number(scaling, "attention_factor", None)
    if mscale and mscale_all_dim:
        return _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
    return _mscale(factor, 1.0)


def _mscale(factor: float, weight: float) -> float:
    """YaRN's magnitude correction of a ``factor`` times longer context."""
    return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0


def _yarn_scaled(period: torch.Tensor, head_dim: int, theta: float, yarn: YarnScaling) -> torch.Tensor:
    """Pairs below the fast correction pair keep their speed (``1 / period``), pairs past the slow one are divided
    by factor, and the speeds between blend linearly (the ramp over pair indices, as transformers computes it)."""
    low, high = (_correction_pair(turns, head_dim, theta, yarn.original_max_position_embeddings)
                 for turns in (yarn.beta_fast, yarn.beta_slow))  # fmt: skip
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step rather than a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: scale
    keep = 1 - ramp
    return 1.0 / (yarn.factor * period) * (1 - keep) + 1.0 / period * keep


def _correction_pair(turns: float, head_dim: int, theta: float, old_len: float) -> float:
    """The (fractional) pair index that turns ``turns`` times in ``old_len`` positions."""
    return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))


class RotaryEmbedding(torch.nn.Module):
    """The model's rotation speeds; a step's cos and sin of its positions, which :func:`rotate` applies to q and k."""

    def __init__(
        self, head_dim: int, theta: float, scaling: Mapping[str, object] | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if head_dim % 2:
            raise InvalidArgumentError(describe("head_dim", head_dim, "an even number"))
        inv_freq, self.attention_factor = rope_parameters(head_dim, theta, scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, D]`` in ``dtype`` of positions ``[T]`` (once per forward; the layers share them)."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # [T, 1, D]: pair (i, i + D/2) shares an angle
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:  # yarn: scaled in float32 before the cast, as transformers does
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, H, D]`` rotated by cos, sin ``[T, 1, D]``: ``x * cos + rotate_half(x) * sin``, as transformers does.

    One pass serves q and k together when they are one tensor (their heads side by side).
    """
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin

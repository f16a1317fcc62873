"""PEFT LoRA adapters read from disk and checked against the model they adapt.

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` with keys like
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (A: ``[r, in]``) and
``...lora_B.weight`` (B: ``[out, r]``). A target projection then computes
``y = x W^T + scale * (x A^T) B^T`` with ``scale = lora_alpha / r`` (``use_rslora``:
``lora_alpha / sqrt(r)``). Targets: the q/k/v/o attention projections and the gate/up/down MLP
projections of any layer.

Refused, by the config field that would make the adapter compute differently (never silently
ignored): ``use_dora``, ``modules_to_save``, ``bias`` other than "none", ``fan_in_fan_out``,
``rank_pattern`` / ``alpha_pattern`` (per-module ranks), embedding or LM-head targets, any weight
that is not a target's A or B, a rank above ``max_lora_rank``, shapes that do not match the model,
and a missing or unreadable file.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_kv.errors import InvalidArgumentError, describe
from scheduler.model.llama import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module names -> (the fused layer of this model, which of its slices)
TARGETS = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}  # fmt: skip
MLP_PARTS = ("gate_up", "down")  # the fused layers of a dense MLP (a sparse MoE layer has neither)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True, kw_only=True)
class LoRAWeights:
    """One target projection's low-rank update: A ``[r, in]``, B ``[out, r]``, and its scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True, kw_only=True)
class LoRAAdapter:
    """A loaded adapter: its rank and, per (layer, PEFT module name), its weights on the host."""

    rank: int
    weights: dict[tuple[int, str], LoRAWeights]
    fingerprint: str  # SHA-256 over the config and the weights files


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a PEFT target module of the whole (unsharded) model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv), "v_proj": (cfg.hidden_size, kv),
        "o_proj": (q, cfg.hidden_size), "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size), "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }[module]  # fmt: skip


def load_adapter(path: str, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check the PEFT adapter in folder ``path`` for a model of ``cfg``; typed errors name the bad field."""
    folder = Path(path)
    raw = _read(folder / CONFIG_FILE)
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidArgumentError(describe("lora_request.path", path, f"a readable {CONFIG_FILE} ({e})")) from e
    if not isinstance(config, dict):
        raise InvalidArgumentError(describe(CONFIG_FILE, type(config).__name__, "a JSON object"))
    rank, scale = _check_config(config, max_rank)
    blob = _read(folder / WEIGHTS_FILE)
    tensors = _tensors(blob, path)
    weights = _pair(tensors, cfg, rank, scale)
    fingerprint = hashlib.sha256(hashlib.sha256(raw).digest() + hashlib.sha256(blob).digest()).hexdigest()
    return LoRAAdapter(rank=rank, weights=weights, fingerprint=fingerprint)


def _read(file: Path) -> bytes:
    """A file's bytes, or InvalidArgumentError naming it."""
    try:
        return file.read_bytes()
    except OSError as e:
        raise InvalidArgumentError(describe("lora_request.path", str(file.parent), f"a folder with {file.name} "
                                            f"({type(e).__name__}: {e.strerror or e})")) from e


def _check_config(config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a PEFT LoRA config, after refusing every field it would compute differently with."""
    refusals = {
        "peft_type": (config.get("peft_type", "LORA"), lambda v: v == "LORA", '"LORA"'),
        "use_dora": (config.get("use_dora", False), lambda v: not v, "false (DoRA is not supported)"),
        "modules_to_save": (config.get("modules_to_save"), lambda v: not v, "null (no fully trained modules)"),
        "bias": (config.get("bias", "none"), lambda v: v == "none", '"none" (no trained biases)'),
        "fan_in_fan_out": (config.get("fan_in_fan_out", False), lambda v: not v, "false"),
        "rank_pattern": (config.get("rank_pattern"), lambda v: not v, "empty (one rank for every module)"),
        "alpha_pattern": (config.get("alpha_pattern"), lambda v: not v, "empty (one alpha for every module)"),
    }  # fmt: skip
    for field, (value, ok, expected) in refusals.items():
        if not ok(value):
            raise InvalidArgumentError(describe(f"{CONFIG_FILE}.{field}", value, expected))
    _check_targets(config.get("target_modules"))
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise InvalidArgumentError(describe(f"{CONFIG_FILE}.r", rank, f"an integer in [1, {max_rank}] (max_lora_rank)"))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise InvalidArgumentError(describe(f"{CONFIG_FILE}.lora_alpha", alpha, "a finite number"))
    rslora = config.get("use_rslora", False)
    return rank, alpha / (math.sqrt(rank) if rslora else rank)


def _check_targets(targets: object) -> None:
    """Refuse target modules other than the seven projections (embeddings, the LM head, anything else)."""
    if isinstance(targets, str):  # a regex or "all-linear": the weights' keys say which modules it matched
        return
    names = targets if isinstance(targets, list) else []
    bad = next((t for t in names if not isinstance(t, str) or t.split(".")[-1] not in TARGETS), None)
    if bad is not None or not names:
        expected = f"a non-empty list of {sorted(TARGETS)} (embedding and lm_head targets are not supported)"
        raise InvalidArgumentError(describe(f"{CONFIG_FILE}.target_modules", targets, expected))


def _tensors(blob: bytes, path: str) -> dict[str, torch.Tensor]:
    """The safetensors file's tensors, or InvalidArgumentError naming the folder."""
    from safetensors.torch import load

    try:
        return load(blob)
    except Exception as e:  # safetensors raises its own SafetensorError (and others) on a corrupt file
        raise InvalidArgumentError(describe("lora_request.path", path, f"a readable {WEIGHTS_FILE} ({e})")) from e


def _pair(tensors: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, scale: float) -> dict:
    """Every (layer, module)'s A and B, checked against the model's shapes and the rank."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in TARGETS or int(m.group(1)) >= cfg.num_layers:
            expected = "a q/k/v/o/gate/up/down projection's lora_A or lora_B weight of a layer of the model"
            raise InvalidArgumentError(describe(f"{WEIGHTS_FILE} key", key, expected))
        layer, module = int(m.group(1)), m.group(2)
        if TARGETS[module][0] in MLP_PARTS and layer in cfg.sparse_layers:
            expected = "no MLP projection of a mixture-of-experts layer (LoRA on experts is not supported)"
            raise InvalidArgumentError(describe(f"{WEIGHTS_FILE} key", key, expected))
        found.setdefault((layer, module), {})[m.group(3)] = t
    if not found:
        raise InvalidArgumentError(describe(WEIGHTS_FILE, "<no LoRA weights>", "at least one lora_A/lora_B pair"))
    return {where: _checked(where, ab, cfg, rank, scale) for where, ab in sorted(found.items())}


def _checked(where: tuple[int, str], ab: dict, cfg: ModelConfig, rank: int, scale: float) -> LoRAWeights:
    """One module's weights, their shapes checked: A ``[r, in]``, B ``[out, r]``."""
    layer, module = where
    fan_in, fan_out = module_shape(cfg, module)
    for part, shape in (("A", (rank, fan_in)), ("B", (fan_out, rank))):
        t = ab.get(part)
        got = tuple(t.shape) if t is not None else "<missing>"
        if got != shape:
            name = f"{WEIGHTS_FILE} layers.{layer}.{module}.lora_{part}.weight shape"
            raise InvalidArgumentError(describe(name, got, f"{shape} (r and the model's {module})"))
    return LoRAWeights(a=ab["A"].float(), b=ab["B"].float(), scale=scale)

"""A compact Llama-family decoder over packed variable-length batches and a paged KV cache.

One forward runs every new token of a mixed prefill + decode batch: tokens are
packed ``[T]``; each layer writes its K/V to the slots of the step and then
attends through the block tables (causal within the new tokens, full over the
cached prefix). Only the rows in ``logits_indices`` go through the LM head.
Weights load from a transformers ``LlamaForCausalLM`` or its state dict
(:mod:`scheduler.model.weights`).

The same layers run the checkpoints that are a Llama with one attention change: Mistral
(no sliding window in use), Qwen2/Qwen2.5 (q/k/v biases, always on) and dense Qwen3 (a
per-head RMSNorm on q and on k before RoPE, ``ModelConfig.qk_norm``); and their mixture-of-experts
kin, Mixtral, Qwen2-MoE and Qwen3-MoE, whose ``ModelConfig.sparse_layers`` run the sparse block of
:mod:`scheduler.model.moe` instead of the MLP. Llama, Qwen3 and Qwen3-MoE with ``attention_bias`` bias
o_proj as well as q/k/v (``ModelConfig.o_bias``), as transformers does. :meth:`ModelConfig.from_hf`
refuses anything else by the config field that would make it compute differently: another
``model_type`` (Gemma...), activation, MLP biases, a ``partial_rotary_factor`` below 1 (transformers'
Llama and Qwen3 ignore it or fail; vLLM rotates that part of each head), or a sliding window some
layer attends through (vLLM runs Qwen's per-layer windows; this model has no windowed attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kernels.chunk_attention import best_chunk_backend
from kernels.metadata import AttentionMetadata
from paged_kv.errors import InvalidArgumentError, check_bool, check_int, check_real, check_type, describe
from paged_kv.kv_cache import KVCacheSpec, PagedKVCache
from scheduler.distributed.parallel_state import TPShard
from scheduler.model.attention import AttentionPlan
from scheduler.model.moe import MOE_TYPES, SparseMoE, check_moe_fields, moe_fields
from scheduler.model.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from scheduler.model.rope import RotaryEmbedding, context_length, rope_type, rotate, yarn_scaling

Rotary = tuple[torch.Tensor, torch.Tensor]  # the step's (cos, sin) [T, 1, D], from RotaryEmbedding.cos_sin


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, object] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048  # the context the engine serves (from_hf: yarn's original * factor)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k and v
    o_bias: bool = False  # a bias on the output projection (Llama, Qwen3, Qwen3-MoE with attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every q and k head, after the projection, before RoPE
    # mixture of experts (scheduler.model.moe): the layers in sparse_layers run the MoE block, the others the MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize each token's top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert (0: none)
    sparse_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            check_int(name, getattr(self, name), low=1)
        check_int("num_kv_heads", self.num_kv_heads, low=1, high=self.num_heads)
        check_int("max_position_embeddings", self.max_position_embeddings, low=1)
        check_real("rms_norm_eps", self.rms_norm_eps, low=0.0, open_low=True)
        check_real("rope_theta", self.rope_theta, low=0.0, open_low=True)
        check_bool("tie_word_embeddings", self.tie_word_embeddings)
        check_bool("attention_bias", self.attention_bias)
        check_bool("o_bias", self.o_bias)
        check_bool("qk_norm", self.qk_norm)
        check_moe_fields(self)
        if self.rope_scaling is not None:
            check_type("rope_scaling", self.rope_scaling, Mapping, "a mapping (transformers' rope_scaling) or None")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(describe("num_kv_heads", self.num_kv_heads, f"a divisor of {self.num_heads}"))

    @classmethod
    def from_hf(cls, hf_config: object) -> ModelConfig:
        """Read a transformers config of ``LLAMA_FAMILY`` (v4 ``rope_scaling`` or v5 ``rope_parameters``)."""
        c = hf_config
        if not all(hasattr(c, a) for a in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")):
            raise InvalidArgumentError(describe("hf_config", type(c).__name__, "a transformers LlamaConfig"))
        rope = _hf_rope(c)
        context = context_length(rope, c.max_position_embeddings)
        model_type = _check_llama_family(c, context)
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim=head_dim,
            rms_norm_eps=c.rms_norm_eps, rope_theta=float(theta), rope_scaling=rope or None,
            max_position_embeddings=context,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=_qkv_bias(c, model_type), o_bias=_o_bias(c, model_type),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **moe_fields(c, model_type),
        )  # fmt: skip


# model types whose layers are this model's: Qwen2's q/k/v biases are always on (its config has no
# attention_bias), Qwen3 adds q/k norms; Mistral and Qwen only without a sliding window in use; the MoE
# types (Mixtral, Qwen2-MoE, Qwen3-MoE) are these attentions with sparse MLP layers (scheduler.model.moe)
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", *MOE_TYPES)


def _qkv_bias(c: object, model_type: str) -> bool:
    """Whether q/k/v have biases: Qwen2 always, Qwen2-MoE per ``qkv_bias``, the others per ``attention_bias``."""
    if model_type == "qwen2":
        return True
    return bool(getattr(c, "qkv_bias" if model_type == "qwen2_moe" else "attention_bias", False))


# model types whose o_proj has a bias when attention_bias is set (transformers); Qwen2, Qwen2-MoE, Mistral
# and Mixtral never bias it
O_BIAS_TYPES = ("llama", "qwen3", "qwen3_moe")


def _o_bias(c: object, model_type: str) -> bool:
    """Whether o_proj has a bias: ``attention_bias`` of the ``O_BIAS_TYPES``."""
    return model_type in O_BIAS_TYPES and bool(getattr(c, "attention_bias", False))


def _hf_rope(c: object) -> dict:
    """The config's rope scaling (v4 ``rope_scaling`` or v5 ``rope_parameters``), yarn's fallbacks written in.

    As transformers' ``standardize_rope_params``: a top-level ``original_max_position_embeddings``
    (Phi-3 style) wins, else it defaults to ``max_position_embeddings``; a ``factor`` of None
    becomes their ratio, so the model config states the numbers it runs with.
    """
    rope = dict(getattr(c, "rope_scaling", None) or getattr(c, "rope_parameters", None) or {})
    if rope_type(rope) == "yarn":
        if hasattr(c, "original_max_position_embeddings"):
            rope["original_max_position_embeddings"] = c.original_max_position_embeddings
        if rope.get("original_max_position_embeddings") is None:
            rope["original_max_position_embeddings"] = c.max_position_embeddings
        rope["factor"] = yarn_scaling(rope, c.max_position_embeddings).factor  # validated; None: the ratio
    return rope


def _check_llama_family(c: object, context: int) -> str:
    """The config's model type, after refusing what this model would run with other math, never silently:
    another architecture, another activation, MLP biases, or a sliding window shorter than the ``context``."""
    model_type = getattr(c, "model_type", None) or "llama"
    if model_type not in LLAMA_FAMILY:
        raise InvalidArgumentError(describe("hf_config.model_type", model_type, f"one of {LLAMA_FAMILY}"))
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        raise InvalidArgumentError(describe("hf_config.hidden_act", act, '"silu" (a Llama MLP)'))
    if getattr(c, "mlp_bias", False):
        raise InvalidArgumentError(describe("hf_config.mlp_bias", True, "False (MLP biases are not supported)"))
    _check_full_rotary(c)
    window = _window_in_use(c)
    if window is not None and window < context:
        expected = (f"None or at least the model context {context} (max_position_embeddings; under yarn "
                    "original_max_position_embeddings * factor), or no layer sliding "
                    "(use_sliding_window, max_window_layers, layer_types): no sliding-window attention")
        raise InvalidArgumentError(describe("hf_config.sliding_window", window, expected))
    return model_type


def _check_full_rotary(c: object) -> None:
    """Refuse a ``partial_rotary_factor`` other than 1 (RoPE over part of each head), naming where it is set.

    transformers' Llama and Qwen3 have no partial rotary: their default RoPE rotates the whole head
    whatever the factor says, and the scaled types (linear, llama3, yarn...) build cos/sin over
    ``head_dim * factor`` and fail on the first forward. vLLM rotates the first ``head_dim * factor``
    dims; with no reference to equal, this model runs neither.
    """
    rope = getattr(c, "rope_scaling", None) or getattr(c, "rope_parameters", None) or {}
    for name, factor in (("rope_parameters.partial_rotary_factor", rope.get("partial_rotary_factor")),
                         ("partial_rotary_factor", getattr(c, "partial_rotary_factor", None))):  # fmt: skip
        if factor is not None and factor != 1:
            raise InvalidArgumentError(describe(f"hf_config.{name}", factor, "1 (RoPE over the whole head)"))


def _window_in_use(c: object) -> int | None:
    """The sliding window some layer attends through in transformers, or None.

    Mistral: every layer, when ``sliding_window`` is set. Qwen2/Qwen3: only when
    ``use_sliding_window``, and only the layers ``layer_types`` marks "sliding_attention"
    (transformers v5 derives them: the layers from ``max_window_layers`` on; v4 configs have no
    ``layer_types`` and the same rule applies).
    """
    window = getattr(c, "sliding_window", None)
    if window is None or not getattr(c, "use_sliding_window", True):
        return None
    layer_types = getattr(c, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    first = getattr(c, "max_window_layers", None)
    return window if first is None or first < c.num_hidden_layers else None


def local_kv_heads(cfg: ModelConfig, shard: TPShard) -> int:
    """KV heads one rank holds: ``num_kv_heads / size``, or one replicated head when there are fewer than ranks."""
    start, end = shard.kv_heads(cfg.num_kv_heads, cfg.num_heads)
    return end - start


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] -> [..., H] in x's dtype (a whole hidden state, or one head per row for q/k norms)."""
        h = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)  # transformers' x * rsqrt(mean(x^2) + eps), fused
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention reading and writing the paged KV cache of its layer (this rank's heads)."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: TPShard) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads // shard.size
        self.num_kv_heads, self.head_dim = local_kv_heads(cfg, shard), cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qk_size = q_size + kv_size  # q and k lead the fused projection's columns, v follows
        self.qkv = ColumnParallelLinear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o = RowParallelLinear(q_size, cfg.hidden_size, shard=shard, bias=cfg.o_bias)  # bias whole on every rank
        self.scale = cfg.head_dim**-0.5
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # weights over head_dim: every rank holds the whole of both (replicated)
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rotary: Rotary, cache: PagedKVCache, plan: AttentionPlan):
        """x: [T, hidden] -> [T, hidden]; rotary: the step's (cos, sin) [T, 1, D]."""
        qkv = self.qkv(x)  # [T, (Hq + 2 Hkv) D]
        qk = qkv[:, : self.qk_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = rotate(self.norm_heads(qk) if self.qk_norm else qk, *rotary)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, Hq, D], [T, Hkv, D] (strided)
        v = qkv[:, self.qk_size :].view(-1, self.num_kv_heads, self.head_dim).contiguous()  # [T, Hkv, D]
        kv = cache.layers[self.layer]
        plan.write(kv, k, v)
        out = plan.attend(q.contiguous(), k, v, kv, self.scale)  # [T, Hq, D]
        return self.o(out.reshape(out.shape[0], -1))

    def norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3's q/k norms: qk [T, Hq + Hkv, D] -> the same, each q head through q_norm, each k head k_norm."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), over this rank's intermediate rows."""

    def __init__(self, cfg: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        inter = cfg.intermediate_size // shard.size
        self.gate_up = ColumnParallelLinear(cfg.hidden_size, 2 * inter, bias=False)
        self.down = RowParallelLinear(inter, cfg.hidden_size, shard=shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: TPShard) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, shard)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, shard) if layer in cfg.sparse_layers else MLP(cfg, shard)

    def forward(self, x, rotary, cache, plan) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        x = x + self.attn(self.input_norm(x), rotary, cache, plan)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head over packed tokens.

    With ``shard=TPShard(rank, size)`` the model holds one tensor-parallel shard (its heads,
    intermediate rows and vocabulary rows; see :mod:`scheduler.model.parallel_layers`) and every
    rank of the group must run each forward together. ``config`` stays the whole model's.
    """

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        check_type("cfg", cfg, ModelConfig, "a ModelConfig")
        check_type("shard", shard, (TPShard, type(None)), "a TPShard or None")
        super().__init__()
        shard = shard or TPShard()
        self.config, self.shard = cfg, shard
        shard.split(cfg.intermediate_size, "intermediate_size")
        shard.kv_heads(cfg.num_kv_heads, cfg.num_heads)  # checks the heads split evenly
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard=shard)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, shard=shard)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.chunk_backend: str | None = None  # dense kernel of fresh prefill chunks; None: paged kernels only

    def enable_dense_prefill(self, enabled: bool = True) -> str | None:
        """Probe (once per geometry; reads device values) the dense kernel fresh prefill chunks use, or turn it off."""
        check_bool("enabled", enabled)
        attn, weight = self.layers[0].attn, self.embed.weight
        geometry = (weight.device, weight.dtype, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self.chunk_backend = best_chunk_backend(*geometry) if enabled else None
        return self.chunk_backend

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype | None = None) -> KVCacheSpec:
        """The paged cache geometry this model (this shard: its KV heads only) writes."""
        cfg = self.config
        return KVCacheSpec(
            num_layers=cfg.num_layers, num_kv_heads=local_kv_heads(cfg, self.shard), head_dim=cfg.head_dim,
            block_size=block_size, dtype=dtype or self.embed.weight.dtype,
        )  # fmt: skip

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, cache: PagedKVCache, meta: AttentionMetadata, logits_indices=None
    ) -> torch.Tensor:
        """input_ids, positions: [T]; logits_indices: [R] rows to score (None: all) -> logits [R, vocab] float32."""
        x = self.hidden_states(input_ids, positions, cache, meta)  # [T, hidden]
        return self.compute_logits(x if logits_indices is None else x[logits_indices])

    @torch.inference_mode()
    def hidden_states(self, input_ids, positions, cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """The decoder layers over packed tokens: input_ids, positions [T] -> [T, hidden].

        Reads no device value on the host, so a decode step's call can be captured in a CUDA graph.
        """
        x = self.embed(input_ids)  # [T, hidden]
        plan = AttentionPlan(meta, self.chunk_backend)
        rotary = self.rope.cos_sin(positions, x.dtype)  # once per step, not per layer
        for layer in self.layers:
            x = layer(x, rotary, cache, plan)
        return x

    @torch.inference_mode()
    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm alone (what embedding requests pool): hidden states [P, hidden] -> [P, hidden] float32."""
        return self.norm(x).float()

    @torch.inference_mode()
    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden states [R, hidden] -> logits [R, vocab] float32."""
        return self.lm_head(self.norm(x)).float()

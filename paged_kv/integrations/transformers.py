"""``PagedCache``: a transformers ``Cache`` whose K/V live in paged-kv pages.

Pass it to ``model.generate(..., past_key_values=PagedCache(model.config))``
or to a forward call. All layers share one :class:`~paged_kv.compat.dynamic.KVCache`:
each batch row is one paged sequence covering every layer, so the beam-search
``reorder_cache`` is a block-table edit (a beam picked twice is forked
copy-on-write, a dropped beam returns its pages) instead of an ``index_select``
copy of every layer's K/V, and beams that share a prefix share its pages.

Needs transformers 5.x (the layered ``Cache`` API); it is an optional extra,
imported only when this module is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_kv.compat.dynamic import KVCache
from paged_kv.compat.pool import KVPool
from paged_kv.errors import InvalidArgumentError, PagedKVError, check_int, check_type, describe
from paged_kv.tensor_checks import check_tensor

__all__ = ["PagedCache", "PagedLayer", "TransformersUnavailableError"]


class TransformersUnavailableError(PagedKVError, ImportError):
    """transformers is missing or too old for this integration."""


try:
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:
    raise TransformersUnavailableError(
        "paged_kv.integrations.transformers needs transformers>=5 (pip install 'paged-kv[hf]')"
    ) from exc
if int(transformers.__version__.split(".")[0]) < 5:
    raise TransformersUnavailableError(
        describe("transformers.__version__", transformers.__version__, "5.x or newer (the layered Cache API)")
    )


class PagedLayer(CacheLayerMixin):
    """One model layer of a :class:`PagedCache`: a view of that layer in the shared paged rows."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, store: KVCache, layer_idx: int) -> None:  # no super().__init__: keys/values are views
        check_type("store", store, KVCache, "a paged_kv.compat.dynamic.KVCache")
        self.store, self.layer_idx = store, check_int("layer_idx", layer_idx, low=0, high=store.num_layers() - 1)

    @property
    def keys(self) -> torch.Tensor | None:
        """Cached keys ``[batch, heads, seq, head_dim]`` (gathered from the pages), None before the first update."""
        entry = self.store.get(self.layer_idx)
        return None if entry is None else entry.key

    @property
    def values(self) -> torch.Tensor | None:
        """Cached values ``[batch, heads, seq, head_dim]`` (gathered from the pages), None before the first update."""
        entry = self.store.get(self.layer_idx)
        return None if entry is None else entry.value

    @property
    def is_initialized(self) -> bool:
        """Whether this layer has an entry (possibly of length 0)."""
        return self.store.get(self.layer_idx) is not None

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of the cached tensors (None while nothing is cached)."""
        return self.store._dtype

    @property
    def device(self) -> torch.device | None:
        """The device the pages live on (None before the first update)."""
        pool = self.store.pool
        return None if pool is None else pool.storage.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Set the layer to an empty entry of the given batch, heads, head size and dtype."""
        check_tensor("key_states", key_states, ndim=4)
        check_tensor("value_states", value_states, ndim=4)
        if not self.is_initialized:
            self.store.update(self.layer_idx, key_states[..., :0, :], value_states[..., :0, :])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[batch, heads, new, head_dim]`` states; return the layer's full keys and values."""
        return self.store.update(self.layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        """Positions cached in this layer."""
        entry = self.store.get(self.layer_idx)
        return 0 if entry is None else entry.seq_len()

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the mask; accepts a query length or (older API) a cache_position."""
        if isinstance(query_length, torch.Tensor):
            query_length = check_tensor("query_length", query_length, ndim=1).shape[0]
        query_length = check_int("query_length", query_length, low=0)
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        """-1: the layer grows without a maximum."""
        return -1

    def crop(self, max_length: int) -> None:
        """Drop ``-max_length`` tokens if negative, keep the first ``max_length`` if positive (0: no-op)."""
        self.store.truncate(_crop_target(max_length, self.get_seq_length()), layer_idx=self.layer_idx)

    def reset(self) -> None:
        """Empty this layer (its pages return once no layer uses them)."""
        if self.is_initialized:
            self.store.truncate(0, layer_idx=self.layer_idx)

    def offload(self) -> None:
        """No-op: the pages stay in their pool."""

    def prefetch(self) -> None:
        """No-op: the pages stay in their pool."""

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Not per layer: rows are shared by every layer (use :meth:`PagedCache.reorder_cache`)."""
        raise NotImplementedError("PagedLayer rows are shared by every layer: call PagedCache.reorder_cache")


class PagedCache(Cache):
    """A transformers ``Cache`` storing every layer's K/V in pages; beam reorders are block-table edits."""

    def __init__(
        self,
        config: object | None = None,
        *,
        pool: KVPool | None = None,
        block_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        num_layers = _num_layers(config)
        self.kv = KVCache.with_num_layers(num_layers, pool=pool, block_size=block_size, dtype=dtype, device=device)
        super().__init__(layers=[PagedLayer(self.kv, i) for i in range(num_layers)])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append the states of layer ``layer_idx`` (layers are added on demand); return its full K/V."""
        out = self.kv.update(layer_idx, key_states, value_states)  # checks everything first
        while len(self.layers) < self.kv.num_layers():
            self.layers.append(PagedLayer(self.kv, len(self.layers)))
        return out

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row ``j`` becomes row ``beam_idx[j]``, by forking/freeing pages (no K/V copy)."""
        if self.kv.batch_size():
            self.kv.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place (copy-on-write forks)."""
        repeats = check_int("repeats", repeats, low=1)
        if self.kv.batch_size():
            self.kv.select_rows([i for i in range(self.kv.batch_size()) for _ in range(repeats)])

    def batch_select_indices(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep only the rows ``indices`` (in that order)."""
        if self.kv.batch_size():
            self.kv.select_rows(indices)

    def crop(self, max_length: int) -> None:
        """Drop ``-max_length`` tokens if negative (5.x), keep the first ``max_length`` if positive (4.x); 0: no-op."""
        self.kv.truncate(_crop_target(max_length, self.get_seq_length()))

    def reset(self) -> None:
        """Empty every layer; all pages return to the pool."""
        self.kv.clear()

    @property
    def num_pages(self) -> int:
        """Distinct pages held by the cache's rows."""
        return self.kv.num_pages

    @property
    def nbytes(self) -> int:
        """Bytes of the pages actually held (all layers, K and V, scales included)."""
        return self.kv.nbytes


def _crop_target(max_length: object, seq_len: int) -> int:
    """The length to keep: ``seq_len + max_length`` for a negative argument, else ``max_length`` (0 keeps all)."""
    if isinstance(max_length, bool):
        raise InvalidArgumentError(describe("max_length", max_length, "an integer"))
    max_length = check_int("max_length", max_length, low=-(1 << 62))
    if max_length == 0:
        return seq_len
    return max(0, seq_len + max_length) if max_length < 0 else max_length


def _num_layers(config: object | None) -> int:
    """The decoder's layer count (0 without a config); only full-attention layers are supported."""
    if config is None:
        return 0
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    num_layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise InvalidArgumentError(describe("config.num_hidden_layers", num_layers, "an integer >= 1"))
    types = getattr(text, "layer_types", None)
    if types is None:  # as transformers infers them: a window or chunk size makes every layer local
        local = getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None)
        types = ["sliding_attention" if local is not None else "full_attention"] * num_layers
    odd = sorted({t for t in types if t != "full_attention"})
    if odd:
        raise InvalidArgumentError(describe("config.layer_types", odd, "full_attention only (all tokens are kept)"))
    return num_layers

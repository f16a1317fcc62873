"""``PagedCache``: a transformers ``Cache`` whose K/V live in paged-kv pages.

Pass it to ``model.generate(..., cache=PagedCache(model.config))`` or to a forward
call (``past_key_values=`` before transformers 5.24, which deprecates that name;
:func:`cache_keyword` says which one a model takes). The full-attention layers share one
:class:`~paged_kv.compat.dynamic.KVCache`: each batch row is one paged sequence
covering every such layer, so the beam-search ``reorder_cache`` is a block-table
edit (a beam picked twice is forked copy-on-write, a dropped beam returns its
pages) instead of an ``index_select`` copy of every layer's K/V, and beams that
share a prefix share its pages.

Sliding-window layers (``config.layer_types``, or every layer of a config with
a ``sliding_window``, as transformers' ``DynamicCache(config=...)`` decides)
share a second ``KVCache``, :class:`SlidingRows`. Each such layer behaves as
transformers' ``DynamicSlidingWindowLayer``: its next queries see its last
``sliding_window - 1`` positions, and a leading page goes back to the pool as
soon as no sliding layer's next query can see any position in it, so the pages
held stay bounded by the window however long the generation.

Needs transformers 5.x (the layered ``Cache`` API); it is an optional extra,
imported only when this module is.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence

import torch

from paged_kv.compat.dynamic import KVCache
from paged_kv.compat.pool import KVPool
from paged_kv.errors import (
    InvalidArgumentError,
    PagedKVError,
    SequenceStateError,
    check_bool,
    check_int,
    check_type,
    describe,
)
from paged_kv.tensor_checks import check_tensor

__all__ = [
    "PagedCache", "PagedLayer", "PagedSlidingLayer", "SlidingRows", "TransformersUnavailableError", "cache_keyword",
]


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


def cache_keyword(model: object) -> str:
    """The keyword ``model``'s forward and ``generate`` take a cache by: ``cache`` from transformers 5.24 on
    (``past_key_values`` is deprecated there), ``past_key_values`` before."""
    forward = getattr(model, "forward", None)
    if not callable(forward):
        raise InvalidArgumentError(describe("model", type(model).__name__, "a transformers model (with a forward)"))
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


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
        return self.get_seq_length() + _query_length(query_length), 0

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


class SlidingRows:
    """The paged rows shared by a cache's sliding-window layers; a leading page leaves once no window sees it."""

    def __init__(self, store: KVCache, sliding_window: int) -> None:
        check_type("store", store, KVCache, "a paged_kv.compat.dynamic.KVCache")
        self.store = store
        self.sliding_window = check_int("sliding_window", sliding_window, low=2)
        self.recording = False  # transformers' record_past: pages stay until the next crop (rollbacks need them)

    @property
    def visible(self) -> int:
        """Cached positions a query sees besides its own: ``sliding_window - 1``."""
        return self.sliding_window - 1

    def release(self) -> None:
        """Give back every leading page that no layer's next query can see."""
        # A layer of length n next queries position n, which sees positions [n - visible, n]: a page
        # holding only positions below every layer's n - visible is dead (a layer with no entry has n = 0).
        self.store.drop_front(self.store.droppable_pages(keep_last=self.visible))


class PagedSlidingLayer(PagedLayer):
    """A sliding-window layer of a :class:`PagedCache`, as transformers' ``DynamicSlidingWindowLayer``, on pages."""

    is_sliding = True

    def __init__(self, rows: SlidingRows, layer_idx: int) -> None:
        check_type("rows", rows, SlidingRows, "a SlidingRows")
        super().__init__(rows.store, layer_idx)
        self.rows = rows
        self.cumulative_length = 0  # positions ever cached (those of released pages included)

    @property
    def sliding_window(self) -> int:
        """The window: a query sees itself and the ``sliding_window - 1`` positions before it."""
        return self.rows.sliding_window

    @property
    def record_past(self) -> bool:
        """Whether pages are kept until the next ``crop`` (shared by every sliding layer of the cache)."""
        return self.rows.recording

    @record_past.setter
    def record_past(self, value: bool) -> None:
        self.rows.recording = check_bool("record_past", value)

    def activate_past_recording(self) -> None:
        """Keep every page until the next ``crop``, so that a rollback (assisted decoding) finds its positions."""
        self.rows.recording = True

    @property
    def keys(self) -> torch.Tensor | None:
        """The keys the next query sees ``[batch, heads, min(seq, sliding_window - 1), head_dim]``, or None."""
        keys = super().keys  # the positions still held
        return None if keys is None else self._last(keys, self._visible())

    @property
    def values(self) -> torch.Tensor | None:
        """The values the next query sees ``[batch, heads, min(seq, sliding_window - 1), head_dim]``, or None."""
        values = super().values  # the positions still held
        return None if values is None else self._last(values, self._visible())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[batch, heads, new, head_dim]`` states; return what the new queries see (window plus new)."""
        seen = self._visible()  # positions before the new ones that the first new query sees
        keys, values = self.store.update(self.layer_idx, key_states, value_states)  # checks everything first
        self.cumulative_length += key_states.shape[2]
        if not self.rows.recording:
            self.rows.release()
        return self._last(keys, seen + key_states.shape[2]), self._last(values, seen + key_states.shape[2])

    def get_seq_length(self) -> int:
        """Positions ever cached in this layer (released ones included), as transformers counts them."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the keys ``update`` returns for ``query_length`` queries, and the first's."""
        seen = self._visible()
        return seen + _query_length(query_length), self.cumulative_length - seen

    def get_max_length(self) -> int:
        """The window: no query sees more positions."""
        return self.sliding_window

    def crop(self, max_length: int) -> None:
        """As :meth:`PagedLayer.crop`; raises if a position the window then needs was already released."""
        self._crop_to(self._check_crop(max_length, _crop_target(max_length, self.cumulative_length)))
        self.rows.release()

    def _check_crop(self, max_length: object, target: int) -> int:
        """``target`` capped at the length, if cropping to it keeps every position the window needs; else raise."""
        target = min(target, self.cumulative_length)  # a crop never extends
        released = self._released()
        if released > max(target - self.rows.visible, 0):
            raise SequenceStateError(describe(
                "max_length", max_length,
                f"a crop to at least {released + self.rows.visible} positions: the {self.rows.visible} before the"
                f" crop point must still be held, and the first {released} went back to the pool",
            ))
        return target

    def _crop_to(self, target: int) -> None:
        """Keep the first ``target`` positions (checked by :meth:`_check_crop`); no page is released here."""
        self.store.truncate(target - self._released(), layer_idx=self.layer_idx)
        self.cumulative_length = target

    def reset(self) -> None:
        """Empty this layer (its pages return once no layer uses them)."""
        super().reset()
        self.cumulative_length = 0

    def _released(self) -> int:
        """Leading positions of this layer whose pages went back to the pool (the rows hold the rest)."""
        return self.cumulative_length - super().get_seq_length()

    def _visible(self) -> int:
        """Cached positions the next query sees besides itself."""
        return min(self.cumulative_length, self.rows.visible)

    @staticmethod
    def _last(t: torch.Tensor, n: int) -> torch.Tensor:
        """The last ``n`` positions of ``[batch, heads, seq, head_dim]`` (a contiguous tensor, as a concatenation)."""
        return t[:, :, t.shape[2] - n :].contiguous()


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
        slides, window = _layer_kinds(config)
        paging = {"pool": pool, "block_size": block_size, "dtype": dtype, "device": device}
        self.kv = KVCache.with_num_layers(slides.count(False), **paging)  # the full-attention layers
        self.sliding = None  # the sliding-window layers' rows, if the config has such layers
        if window is not None:
            self.sliding = SlidingRows(KVCache.with_num_layers(slides.count(True), **paging), window)
        super().__init__(layers=self._new_layers(slides))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append the states of layer ``layer_idx``; return what its attention reads (full K/V, or window plus new).

        Without sliding layers, layers past the config's are added on demand (full attention).
        """
        if self.sliding is not None:  # model layer i is not store layer i: the layers are the config's
            return self.layers[check_int("layer_idx", layer_idx, low=0, high=len(self.layers) - 1)].update(
                key_states, value_states
            )
        out = self.kv.update(layer_idx, key_states, value_states)  # checks everything first
        while len(self.layers) < self.kv.num_layers():
            self.layers.append(PagedLayer(self.kv, len(self.layers)))
        return out

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row ``j`` becomes row ``beam_idx[j]``, by forking/freeing pages (no K/V copy)."""
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place (copy-on-write forks)."""
        repeats = check_int("repeats", repeats, low=1)
        for store in self._stores():
            store.select_rows([i for i in range(store.batch_size()) for _ in range(repeats)])

    def batch_select_indices(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep only the rows ``indices`` (in that order)."""
        self._select_rows(indices)

    def crop(self, max_length: int) -> None:
        """Drop ``-max_length`` tokens if negative (5.x), keep the first ``max_length`` if positive (4.x); 0: no-op.

        A sliding layer raises (nothing cropped) if a position its window would then need was released.
        """
        target = _crop_target(max_length, self.get_seq_length())
        sliding = [layer for layer in self.layers if isinstance(layer, PagedSlidingLayer)]
        targets = [layer._check_crop(max_length, target) for layer in sliding]  # every check before any change
        self.kv.truncate(target)
        for layer, kept in zip(sliding, targets):
            layer._crop_to(kept)
        if self.sliding is not None:
            self.sliding.release()

    def reset(self) -> None:
        """Empty every layer; all pages return to the pool."""
        for store in self._stores(every=True):
            store.clear()
        for layer in self.layers:
            if isinstance(layer, PagedSlidingLayer):
                layer.cumulative_length = 0

    @property
    def num_pages(self) -> int:
        """Pages held by the cache's rows (a page shared by rows counted once)."""
        return sum(store.num_pages for store in self._stores(every=True))

    @property
    def nbytes(self) -> int:
        """Bytes of the pages actually held (all layers, K and V, scales included)."""
        return sum(store.nbytes for store in self._stores(every=True))

    def _new_layers(self, slides: list[bool]) -> list[PagedLayer]:
        """One layer per flag, in order: a sliding one indexes the sliding rows, the others the full store."""
        full, sliding = itertools.count(), itertools.count()  # store layer indices
        return [PagedSlidingLayer(self.sliding, next(sliding)) if s else PagedLayer(self.kv, next(full))
                for s in slides]  # fmt: skip

    def _stores(self, *, every: bool = False) -> list[KVCache]:
        """The paged stores holding rows (``every``: with or without): full layers', then sliding layers'."""
        stores = [self.kv] + ([] if self.sliding is None else [self.sliding.store])
        return stores if every else [store for store in stores if store.batch_size()]

    def _select_rows(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Row ``j`` of every store becomes its row ``indices[j]`` (a forward gives the stores one batch size)."""
        for store in self._stores():
            store.select_rows(indices)


def _query_length(query_length: object) -> int:
    """A query length, given as an int or (older API) as the cache_position tensor of the queries."""
    if isinstance(query_length, torch.Tensor):
        query_length = check_tensor("query_length", query_length, ndim=1).shape[0]
    return check_int("query_length", query_length, low=0)


def _crop_target(max_length: object, seq_len: int) -> int:
    """The length to keep: ``seq_len + max_length`` for a negative argument, else ``max_length`` (0 keeps all)."""
    if isinstance(max_length, bool):
        raise InvalidArgumentError(describe("max_length", max_length, "an integer"))
    max_length = check_int("max_length", max_length, low=-(1 << 62))
    if max_length == 0:
        return seq_len
    return max(0, seq_len + max_length) if max_length < 0 else max_length


def _layer_kinds(config: object | None) -> tuple[list[bool], int | None]:
    """Per decoder layer, whether it slides (as transformers' DynamicCache decides), and the window if any does."""
    if config is None:
        return [], None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    num_layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise InvalidArgumentError(describe("config.num_hidden_layers", num_layers, "an integer >= 1"))
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is None:  # as transformers infers them: a window makes every layer slide, a chunk size chunk
        chunked = getattr(text, "attention_chunk_size", None) is not None
        kind = "sliding_attention" if window is not None else "chunked_attention" if chunked else "full_attention"
        types = [kind] * num_layers
    if len(types) != num_layers:
        raise InvalidArgumentError(describe("config.layer_types", types, f"{num_layers} entries, one per layer"))
    odd = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if odd:
        raise InvalidArgumentError(describe("config.layer_types", odd, "full_attention or sliding_attention layers"))
    slides = [t == "sliding_attention" for t in types]
    if not any(slides):
        return slides, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        # a window of 1 is wrong in transformers itself: its sliding layer then keeps every position
        raise InvalidArgumentError(describe("config.sliding_window", window, "an integer >= 2 for sliding layers"))
    return slides, window

"""Bad-input rows of ``paged_kv.integrations.transformers`` (the transformers Cache API on pages)."""

from __future__ import annotations

import torch
from bad_input_machinery import (
    NAN_INF,
    NOT_NEGATIVE,
    OUT_OF_RANGE,
    WRONG_TYPE,
    Arg,
    Entry,
    requiring,
    with_shared_pools,
)
from entries_compat import dyn_kv, dynamic_cache, pool_of
from entries_scheduler import hf_config, hf_model


# -- subjects --------------------------------------------------------------------------------------
def _transformers():
    """The integration module (imported only when an entry needs it)."""
    import paged_kv.integrations.transformers as t

    return t


class _NoLayers:
    """A config object without num_hidden_layers."""


def paged_cache():
    """A transformers cache of one layer holding 3 positions of 2 rows."""
    c = _transformers().PagedCache(block_size=4)
    c.update(torch.ones(2, 2, 3, 4), torch.ones(2, 2, 3, 4), 0)
    return c


def sliding_rows():
    """The rows of two sliding layers with a window of 4, empty."""
    from paged_kv.compat.dynamic import KVCache

    return _transformers().SlidingRows(KVCache.with_num_layers(2, block_size=4), 4)


def sliding_layer(filled: bool = True):
    """Sliding layer 0 of :func:`sliding_rows`, holding 3 positions of 2 rows (or none)."""
    layer = _transformers().PagedSlidingLayer(sliding_rows(), 0)
    if filled:
        layer.update(torch.ones(2, 2, 3, 4), torch.ones(2, 2, 3, 4))
    return layer


def entries() -> list[Entry]:
    """The integration's entry points with a valid call (and PagedCache over a shared pool); all need transformers."""
    shared = {"paged_kv.integrations.transformers.PagedCache": pool_of(torch.float32, num_layers=1)}
    return requiring("transformers", with_shared_pools(_rows(), shared))


def _rows() -> list[Entry]:
    """The entries, as a table."""
    # a table: one entry point per entry, its arguments side by side
    # fmt: off
    return [
        Entry("paged_kv.integrations.transformers.PagedCache", lambda **kw: _transformers().PagedCache(**kw), {
            "config": Arg("obj", lambda: hf_config(), bad={WRONG_TYPE: [_NoLayers(), "x"]}),
            "pool": Arg("obj", None, bad={WRONG_TYPE: ["x", 3]}),
            "block_size": Arg("opt_int", 4, bad={OUT_OF_RANGE: [0]}),
            "dtype": Arg("dtype", torch.float32), "device": Arg("device", "cpu")},
            named={"config": ("config", "num_hidden_layers")}),
        Entry("paged_kv.integrations.transformers.PagedCache.update", "update", {
            "key_states": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)),
            "value_states": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)),
            "layer_idx": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 1 << 62]})}, paged_cache,
            named={"key_states": "key", "value_states": "value"}),  # the paged store names the states key / value
        *[Entry(f"paged_kv.integrations.transformers.PagedCache.{name}", name, {
            "beam_idx" if name == "reorder_cache" else "indices": Arg("ids", [1, 0], bad={OUT_OF_RANGE: [[-1], [2]],
                                                                                         WRONG_TYPE: ["ab", None,
                                                                                             []]})},
            paged_cache, named={"beam_idx": "indices"}) for name in ("reorder_cache", "batch_select_indices")],
        Entry("paged_kv.integrations.transformers.PagedCache.batch_repeat_interleave", "batch_repeat_interleave",
              {"repeats": Arg("int", 2, bad={OUT_OF_RANGE: [0, -1]})}, paged_cache),
        Entry("paged_kv.integrations.transformers.PagedCache.crop", "crop",
            {"max_length": Arg("int", 2, skip=(OUT_OF_RANGE,))},
              paged_cache),  # any int is a valid crop (negative: drop from the end, past the length: keep all)
        Entry("paged_kv.integrations.transformers.PagedLayer", lambda **kw: _transformers().PagedLayer(**kw), {
            "store": Arg("obj", lambda: paged_cache().kv, bad={WRONG_TYPE: [None, "x"]}),
            "layer_idx": Arg("int", 0, bad={OUT_OF_RANGE: [-1, 2]})}),
        Entry("paged_kv.integrations.transformers.PagedLayer.update", "update", {
            "key_states": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)),
            "value_states": Arg("float_tensor", dyn_kv, skip=(NAN_INF,))},
            lambda: paged_cache().layers[0], named={"key_states": "key", "value_states": "value"}),
        Entry("paged_kv.integrations.transformers.PagedLayer.lazy_initialization", "lazy_initialization", {
            "key_states": Arg("tensor", dyn_kv), "value_states": Arg("tensor", dyn_kv)},
            lambda: _transformers().PagedCache(hf_config(), block_size=4).layers[0],  # not initialized yet
            named={"key_states": "key", "value_states": "value"}),
        Entry("paged_kv.integrations.transformers.PagedLayer.get_mask_sizes", "get_mask_sizes",
              {"query_length": Arg("int", 3, bad=NOT_NEGATIVE)}, lambda: paged_cache().layers[0]),
        Entry("paged_kv.integrations.transformers.PagedLayer.crop", "crop",
            {"max_length": Arg("int", 2, skip=(OUT_OF_RANGE,))},
              lambda: paged_cache().layers[0]),
        Entry("paged_kv.integrations.transformers.SlidingRows", lambda **kw: _transformers().SlidingRows(**kw), {
            "store": Arg("obj", lambda: paged_cache().kv, bad={WRONG_TYPE: [None, "x"]}),
            "sliding_window": Arg("int", 4, bad={OUT_OF_RANGE: [-1, 1]})}),  # a window of 1 keeps nothing
        Entry("paged_kv.integrations.transformers.PagedSlidingLayer",
              lambda **kw: _transformers().PagedSlidingLayer(**kw), {
            "rows": Arg("obj", sliding_rows, bad={WRONG_TYPE: [None, "x", dynamic_cache()]}),  # a store is no rows
            "layer_idx": Arg("int", 1, bad={OUT_OF_RANGE: [-1, 2]})}),
        Entry("paged_kv.integrations.transformers.PagedSlidingLayer.update", "update", {
            "key_states": Arg("float_tensor", dyn_kv, skip=(NAN_INF,)),
            "value_states": Arg("float_tensor", dyn_kv, skip=(NAN_INF,))},
            sliding_layer, named={"key_states": "key", "value_states": "value"}),
        Entry("paged_kv.integrations.transformers.PagedSlidingLayer.lazy_initialization", "lazy_initialization", {
            "key_states": Arg("tensor", dyn_kv), "value_states": Arg("tensor", dyn_kv)},
            lambda: sliding_layer(filled=False), named={"key_states": "key", "value_states": "value"}),
        Entry("paged_kv.integrations.transformers.PagedSlidingLayer.get_mask_sizes", "get_mask_sizes",
              {"query_length": Arg("int", 3, bad=NOT_NEGATIVE)}, sliding_layer),
        Entry("paged_kv.integrations.transformers.PagedSlidingLayer.crop", "crop",
            {"max_length": Arg("int", 2, skip=(OUT_OF_RANGE,))},
              sliding_layer),  # nothing released yet: any int is a valid crop, as for PagedLayer.crop
        Entry("paged_kv.integrations.transformers.cache_keyword", lambda **kw: _transformers().cache_keyword(**kw), {
            "model": Arg("obj", hf_model, bad={WRONG_TYPE: [None, "x", 3]})}),
    ]
    # fmt: on


# Public names that are not entry points for bad input, each with the reason.
EXEMPT: dict[str, str] = {
    f"paged_kv.integrations.transformers.{layer}.reorder_cache": (
        "raises NotImplementedError by design: rows are shared by every layer (PagedCache.reorder_cache is a row)"
    )
    for layer in ("PagedLayer", "PagedSlidingLayer")
}

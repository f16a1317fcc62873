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
from entries_compat import dyn_kv, pool_of
from entries_scheduler import hf_config


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
    ]
    # fmt: on


# Public names that are not entry points for bad input, each with the reason.
EXEMPT: dict[str, str] = {
    "paged_kv.integrations.transformers.PagedLayer.reorder_cache": (
        "raises NotImplementedError by design: rows are shared by every layer (PagedCache.reorder_cache is a row)"
    ),
}

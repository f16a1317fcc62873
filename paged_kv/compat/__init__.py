"""Compatibility facades: five documented KV-cache APIs, stored in paged-kv pages.

Each module presents one documented cache API with its documented names, while
the data lives in pages handed out by a paged-kv block manager (see
:mod:`paged_kv.compat.pool`): memory follows the tokens held, caches can share
one pool, and ``copy()`` shares pages copy-on-write.

- ``ndarray_kv``  -- ``KvCache`` of float64 ``[seq_len, num_heads, head_dim]`` arrays (000)
- ``contiguous``  -- float32 ``KvCache`` with snapshots and payloads (001)
- ``compressed``  -- ``MultiHeadKvCache`` of quantised, sketched vectors (002)
- ``quantized``   -- ``QuantizedKVCache`` in F32 / INT8 / FP8 formats (003)
- ``dynamic``     -- transformers-style ``KVCache`` of torch tensors (004)

The modules are imported on first access (``paged_kv.compat.quantized``), not
here, so importing this package stays cheap.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FACADES = ("ndarray_kv", "contiguous", "compressed", "quantized", "dynamic")

__all__ = list(FACADES)


def __getattr__(name: str) -> ModuleType:
    """Import a facade module on first access."""
    if name in FACADES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The facade modules, listed whether imported yet or not."""
    return sorted(set(globals()) | set(FACADES))

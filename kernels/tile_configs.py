"""Measured tile choices per GPU model, read from ``kernels/configs/<gpu>.json``.

``benchmarks/tune_attention.py`` times candidate tiles of each attention kernel on the GPU at
hand and writes the fastest correct one per key; the kernels' host wrappers ask
:func:`tuned_tile` before their built-in heuristic (``decode_tile``, ``prefill_tile``). A file maps
``"<kernel>/<key>"`` to the launch values, for example::

    {"decode/d128-c2-bf16": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "waves": 2}}

No file, no key, or a CPU device: the heuristic. Files are read once per device; a malformed
file raises :class:`paged_kv.errors.InvalidArgumentError` naming it, so a bad table never goes
unnoticed. :func:`overriding` installs a table in memory (the tuner's candidates, tests).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from paged_kv.errors import InvalidArgumentError, describe

CONFIG_DIR = Path(__file__).with_name("configs")
TILE_FIELDS = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "waves"}  # what a tuned entry may set
POWER_OF_TWO_FIELDS = {"BLOCK_M", "BLOCK_N", "num_warps"}  # Triton's ranges and warp counts
_overrides: list[dict[str, dict[str, int]]] = []  # innermost last


def tile_key(kernel: str, *parts: object) -> str:
    """The table key of one kernel configuration, e.g. ``tile_key("decode", "d128", "c2", "bf16")``."""
    return "/".join((kernel, "-".join(str(p) for p in parts)))


def tuned_tile(key: str, device: torch.device) -> dict[str, int] | None:
    """The tuned launch values of ``key`` on ``device`` (an override first, then the GPU's file), or None."""
    for table in reversed(_overrides):
        if key in table:
            return table[key]
    if device.type != "cuda":
        return None
    return _device_table(device.index or 0).get(key)


def tuned_values(key: str, device: torch.device | None, defaults: dict[str, int]) -> dict[str, int]:
    """``defaults`` with the tuned entry of ``key`` on ``device`` laid over them (no device: the defaults)."""
    entry = tuned_tile(key, device) if device is not None else None
    return {**defaults, **(entry or {})}


def gpu_name(device: torch.device) -> str:
    """The CUDA device's model name as a file stem: 'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."""
    return re.sub(r"[^a-z0-9]+", "_", _device_name(device.index or 0).lower()).strip("_")


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def _device_table(index: int) -> dict[str, dict[str, int]]:
    """The table of CUDA device ``index``, resolved once (kernel launches look it up on the host path)."""
    return load_table(config_path(gpu_name(torch.device("cuda", index))))


def config_path(name: str) -> Path:
    """Where the table of GPU model ``name`` (see :func:`gpu_name`) lives."""
    return CONFIG_DIR / f"{name}.json"


@functools.cache
def load_table(path: Path) -> dict[str, dict[str, int]]:
    """The checked table in ``path`` (empty when there is no file); read once per path."""
    if not path.exists():
        return {}
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(describe(str(path), "invalid JSON", f"a tile table ({exc})")) from exc
    return check_table(table, str(path))


def check_table(table: object, name: str = "table") -> dict[str, dict[str, int]]:
    """``table`` if it maps keys to ``{field: positive int}`` with fields from TILE_FIELDS (tile sizes and warps
    powers of two), else a typed error."""
    if not isinstance(table, Mapping):
        raise InvalidArgumentError(describe(name, type(table).__name__, "a mapping of tile keys to launch values"))
    for key, entry in table.items():
        if not isinstance(key, str) or not isinstance(entry, Mapping) or not entry:
            raise InvalidArgumentError(describe(f"{name}[{key!r}]", entry, "a non-empty mapping of launch values"))
        for field, value in entry.items():
            if field not in TILE_FIELDS or isinstance(value, bool) or not isinstance(value, int) or value < 1:
                expected = f"a positive int of a field in {sorted(TILE_FIELDS)}"
                raise InvalidArgumentError(describe(f"{name}[{key!r}][{field!r}]", value, expected))
            if field in POWER_OF_TWO_FIELDS and value & (value - 1):  # else the launch fails, untyped
                raise InvalidArgumentError(describe(f"{name}[{key!r}][{field!r}]", value, "a power of two"))
    return {key: dict(entry) for key, entry in table.items()}


@contextmanager
def overriding(table: Mapping[str, Mapping[str, int]]) -> Iterator[None]:
    """Use ``table`` before any file while the block runs (nests; the innermost wins)."""
    _overrides.append(check_table(table, "overrides"))
    try:
        yield
    finally:
        _overrides.pop()


def save_table(path: Path, table: Mapping[str, Mapping[str, int]]) -> None:
    """Merge ``table`` into the file at ``path`` (keys it names are replaced) and forget the cached reads."""
    merged = {**load_table(path), **check_table(table)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(sorted(merged.items())), indent=2) + "\n")
    load_table.cache_clear()
    _device_table.cache_clear()

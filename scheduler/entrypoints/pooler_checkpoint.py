"""The pooling a checkpoint declares: sentence-transformers' ``modules.json`` (a ``Normalize`` module: normalized)
and its pooling module's ``config.json`` (``1_Pooling/config.json``: ``pooling_mode_lasttoken`` is LAST,
``pooling_mode_mean_tokens`` MEAN), and Matryoshka support from the model config (``is_matryoshka``,
``matryoshka_dimensions``, as vLLM reads them). ``LLM`` uses it when its engine config sets no pooling
(``EngineConfig.pooler_config`` None); an explicit ``PoolerConfig``, the default one too, wins over it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from paged_kv.errors import InvalidArgumentError, describe
from scheduler.core.pooling_params import PoolerConfig

# sentence-transformers' pooling modes -> ours (any other mode set is refused)
MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN"}


def checkpoint_pooler_config(folder: str | os.PathLike | None, hf_config: object) -> PoolerConfig | None:
    """The pooling ``folder`` (a transformers checkpoint) and ``hf_config`` declare; None when they declare none."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or dims)
    modules = _read_json(Path(folder) / "modules.json") if folder is not None else None
    if modules is None and not matryoshka:
        return None
    pooling_type, normalize = "LAST", True
    if modules is not None:
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
        normalize = "Normalize" in kinds
        if "Pooling" in kinds:
            pooling_type = _pooling_type(Path(folder) / str(kinds["Pooling"].get("path", "")) / "config.json")
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize, is_matryoshka=matryoshka,
                        matryoshka_dimensions=tuple(dims) if dims else None)  # fmt: skip


def _pooling_type(path: Path) -> str:
    """The pooling type a sentence-transformers pooling config sets (LAST when it has no config)."""
    config = _read_json(path)
    if config is None:
        return "LAST"
    if not isinstance(config, dict):
        raise InvalidArgumentError(describe(str(path), type(config).__name__, "a JSON object"))
    chosen = [mode for mode, on in config.items() if mode.startswith("pooling_mode_") and on is True]
    if len(chosen) != 1 or chosen[0] not in MODES:
        raise InvalidArgumentError(describe(str(path), chosen, f"exactly one of {sorted(MODES)}"))
    return MODES[chosen[0]]


def _read_json(path: Path) -> object:
    """A JSON file's value, None when there is no such file; a malformed one raises naming it."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidArgumentError(describe(str(path), "unreadable", f"a JSON file ({e})")) from None

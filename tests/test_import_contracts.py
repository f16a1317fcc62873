"""The package layers of pyproject.toml's import-linter contracts hold.

Top to bottom: scheduler, paged_kv.integrations, paged_kv.compat, paged_kv.kv_cache
(storage), kernels, the tensor checks / tokens / config, paged_kv.errors; and the
allocator (block manager, pool, hashing) imports neither torch nor numpy nor the kernels.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("contract", ["layers", "allocator"])
def test_import_contract_is_kept(contract: str) -> None:
    """``lint-imports`` reports the contract kept (its output names the broken import otherwise)."""
    script = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(" \
        f"limit_to_contracts=({contract!r},), no_cache=True, no_logo=True))"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "KEPT" in done.stdout


def test_every_exported_name_means_one_thing() -> None:
    """No package exports a function under the name of one of its own modules.

    (``import pkg.name as m`` would be the module, not the function.)
    """
    import importlib
    import importlib.util
    import pkgutil

    for package_name in ("paged_kv", "kernels", "scheduler"):
        package = importlib.import_module(package_name)
        modules = {m.name for m in pkgutil.iter_modules(package.__path__)}
        clashes = sorted(modules & set(getattr(package, "__all__", ())))
        assert not clashes, f"{package_name} exports {clashes}, which are also its module names"

"""Benchmark collection: ``pytest benchmarks`` (``make bench``) collects the ``bench_*.py`` files.

pytest's default pattern (``test_*.py``) skips them when a directory is given, and
the project's ``testpaths`` keeps a plain ``pytest`` on ``tests/``, so benchmarks
never run with the test suite. A bench file named on the command line is
collected by pytest itself; this hook leaves those alone so nothing runs twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Collect ``bench_*.py`` modules found while walking the benchmarks directory."""
    if file_path.suffix != ".py" or not file_path.name.startswith("bench_"):
        return None
    if parent.session.isinitpath(file_path):
        return None  # given explicitly: pytest's own collector already takes it
    return pytest.Module.from_parent(parent, path=file_path)

"""The import contracts: pyproject.toml's import-linter layers, no import cycle, no test module imported.

Top to bottom: scheduler, paged_kv.integrations, paged_kv.compat, paged_kv.kv_cache
(storage), kernels, the tensor checks / tokens / config, paged_kv.errors; and the
allocator (block manager, pool, hashing) imports neither torch nor numpy nor the kernels.
No product module takes part in an import cycle, and no module imports a ``test_*`` module
(shared test code lives in helper modules; fixtures come from conftest.py).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("paged_kv", "kernels", "scheduler")


@pytest.mark.parametrize("contract", ["layers", "kernel-tiers", "allocator"])
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


# -- no import cycle ------------------------------------------------------------------------------------
def module_graph(*packages: str) -> dict[str, set[str]]:
    """Module -> the modules it imports (TYPE_CHECKING and function-level imports included), within ``packages``.

    A package's ``__init__`` importing its own submodules is re-export, not a dependency between
    concepts: those edges are left out. Every other import counts, a submodule importing its package too.
    """
    graph = grimp.build_graph(*packages, cache_dir=None)
    return {
        module: {imported for imported in graph.find_modules_directly_imported_by(module)
                 if not imported.startswith(module + ".")}
        for module in graph.modules
    }  # fmt: skip


def strongly_connected_components(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of a directed graph, iteratively (no recursion limit); each sorted."""
    index: dict[str, int] = {}  # discovery order
    low: dict[str, int] = {}  # smallest index reachable through the DFS subtree and one back edge
    stack: list[str] = []  # visited nodes whose component is not closed yet
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]  # the DFS path: each node with its unvisited successors
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            child = next((s for s in successors if s not in index or s in on_stack), None)
            if child is not None and child not in index:  # descend
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child is not None:  # a back or cross edge into the open component
                low[node] = min(low[node], index[child])
            else:  # all successors done: close the component rooted here, report low to the parent
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    components.append(sorted(component))
    return components


def import_cycles(*packages: str) -> list[list[str]]:
    """The import cycles among the modules of ``packages``: strongly connected components of more than one module."""
    return sorted(c for c in strongly_connected_components(module_graph(*packages)) if len(c) > 1)


def describe_cycles(cycles: list[list[str]]) -> str:
    """One line per cycle, listing its modules."""
    return "import cycles:\n" + "\n".join(f"  {len(c)} modules: {', '.join(c)}" for c in cycles)


def test_no_import_cycle_among_the_product_modules() -> None:
    """No product module imports, directly or through others, a module that imports it back."""
    cycles = import_cycles(*PRODUCT)
    assert not cycles, describe_cycles(cycles)


def write_package(root: Path, name: str, files: dict[str, str]) -> None:
    """A package ``name`` under ``root`` with the given modules (file name -> source)."""
    (root / name).mkdir()
    for file, source in files.items():
        (root / name / file).write_text(textwrap.dedent(source))


def test_the_cycle_checker_finds_a_cycle_and_only_a_cycle(tmp_path, monkeypatch) -> None:
    """On tiny packages: a -> b -> a (b's import under TYPE_CHECKING) is a cycle; a package's re-exports are not."""
    write_package(tmp_path, "cyclic_demo", {
        "__init__.py": "from cyclic_demo.a import f\nfrom cyclic_demo.b import g\n",
        "a.py": "from cyclic_demo.b import g\n\ndef f():\n    return g()\n",
        "b.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from cyclic_demo.a import f
            def g():
                return 1
            """,
        "c.py": "import cyclic_demo.a\n",
    })  # fmt: skip
    write_package(tmp_path, "acyclic_demo", {  # b imports its package, whose __init__ re-exports a, which imports b
        "__init__.py": "from acyclic_demo.a import f\n",
        "a.py": "from acyclic_demo.b import g\n\ndef f():\n    return g()\n",
        "b.py": "import acyclic_demo\nimport acyclic_demo.c\n\ndef g():\n    return acyclic_demo.c.X\n",
        "c.py": "X = 1\n",
    })  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    cycles = import_cycles("cyclic_demo", "acyclic_demo")
    assert cycles == [["cyclic_demo.a", "cyclic_demo.b"]]
    assert "cyclic_demo.a, cyclic_demo.b" in describe_cycles(cycles)
    assert import_cycles("acyclic_demo") == []
    graph = module_graph("acyclic_demo")  # the edges are there, but for the __init__'s re-export
    assert graph["acyclic_demo.b"] == {"acyclic_demo", "acyclic_demo.c"} and graph["acyclic_demo"] == set()


def test_strongly_connected_components_of_known_graphs() -> None:
    """Two cycles, a self-contained chain and a 5,000-module ring (deeper than Python's recursion limit)."""
    edges = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["e"], "e": ["d", "f"], "f": [], "g": ["a"]}
    assert sorted(strongly_connected_components(edges)) == [["a", "b", "c"], ["d", "e"], ["f"], ["g"]]
    ring = {f"m{i:04}": [f"m{(i + 1) % 5000:04}"] for i in range(5000)}
    assert [len(c) for c in strongly_connected_components(ring)] == [5000]
    chain = {f"m{i:04}": [f"m{i + 1:04}"] if i < 4999 else [] for i in range(5000)}
    assert len(strongly_connected_components(chain)) == 5000


# -- no test module imported ----------------------------------------------------------------------------
SCANNED = ("paged_kv", "kernels", "scheduler", "tests", "benchmarks", "examples")


def _is_test_module(name: str) -> bool:
    """Whether a dotted module name is or lies inside a ``test_*`` module."""
    return any(part.startswith("test_") for part in name.split("."))


def imported_test_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of each import of a test module: ``test_x``, ``tests.test_x``, ``from tests import test_x``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if _is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            package = "." * node.level + (node.module or "")
            if node.module and _is_test_module(node.module):
                found.append((node.lineno, package))
            elif node.level or package.split(".")[0] == "tests":  # names imported from a test package are modules
                prefix = package if package.endswith(".") else package + "."
                found += [(node.lineno, prefix + alias.name) for alias in node.names if _is_test_module(alias.name)]
    return found


def imports_of_test_modules(root: Path) -> list[str]:
    """``path:line: module`` for every import of a test module in the scanned folders under ``root``."""
    return [
        f"{path.relative_to(root)}:{line}: imports {module}"
        for folder in SCANNED
        for path in sorted((root / folder).rglob("*.py"))
        for line, module in imported_test_modules(path.read_text())
    ]


def test_no_module_imports_a_test_module() -> None:
    """Shared test code lives in helper modules: nothing imports a ``test_*`` module (a test module is no library)."""
    offenders = imports_of_test_modules(ROOT)
    assert not offenders, "imports of test modules:\n" + "\n".join(offenders)


def test_the_test_module_import_scan_finds_every_form(tmp_path) -> None:
    """Each form of importing a test module is found, with its line; helpers, conftest and test-named names are not."""
    source = textwrap.dedent("""\
        import test_a
        import tests.test_b as b
        from test_c import helper
        from tests.scheduler.test_d import helper
        from tests import test_e, helpers
        from . import test_f
        from .test_g import helper
        import beam_helpers, conftest
        from sched_helpers import test_prompts
        from tests.scheduler import sched_helpers
        """)  # fmt: skip
    assert imported_test_modules(source) == [
        (1, "test_a"), (2, "tests.test_b"), (3, "test_c"), (4, "tests.scheduler.test_d"), (5, "tests.test_e"),
        (6, ".test_f"), (7, ".test_g"),
    ]  # fmt: skip
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("from test_y import z\n")
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "demo.py").write_text("import beam_helpers\n")
    assert imports_of_test_modules(tmp_path) == ["tests/test_x.py:1: imports test_y"]

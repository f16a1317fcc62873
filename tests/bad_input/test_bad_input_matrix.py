"""The bad-input matrix: every public entry point x every kind of bad value.

Each row replaces one argument of a valid call by one bad value; the call must raise a
``PagedKVError`` whose message names the argument, and the object it was called on must be
exactly as before (a deep snapshot of everything reachable from it). The valid call itself
must succeed, so a row never passes for the wrong reason. A public name with neither an
entry nor a justified exemption fails :func:`test_every_public_entry_point_is_in_the_matrix`.
The rows and exemptions live in one helper module per package, ``entries_<package>.py``.
"""

from __future__ import annotations

import importlib
import inspect

import entries_compat
import entries_integrations
import entries_kernels
import entries_paged_kv
import entries_scheduler
import pytest
from bad_input_machinery import KINDS, Entry, state

from paged_kv.errors import PagedKVError

OURS = ("paged_kv", "kernels", "scheduler")
# The public modules: packages with __all__, and the modules a user imports names from.
MODULES = (
    "paged_kv", "paged_kv.kv_cache", "paged_kv.compat.pool", "paged_kv.compat.ndarray_kv",
    "paged_kv.compat.contiguous", "paged_kv.compat.compressed", "paged_kv.compat.quantized", "paged_kv.compat.dynamic",
    "paged_kv.compat.turboquant", "paged_kv.integrations.transformers", "kernels", "scheduler",
)  # fmt: skip

# the rows, one helper module per package: each has entries() and EXEMPT
PACKAGES = (entries_paged_kv, entries_compat, entries_integrations, entries_kernels, entries_scheduler)
ENTRIES = [e for package in PACKAGES for e in package.entries()]
EXEMPT = {name: why for package in PACKAGES for name, why in package.EXEMPT.items()}
UNIMPORTABLE: list[str] = []  # public modules whose optional library is missing here
BY_NAME = {e.name: e for e in ENTRIES}


def _rows() -> list[tuple[Entry, str, str, int]]:
    """(entry, argument, kind, index of the bad value) for every bad value of every argument."""
    return [
        (e, arg, kind, i)
        for e in ENTRIES
        for arg, spec in e.args.items()
        for kind, values in spec.bad_values().items()
        for i in range(len(values))
    ]


ROWS = _rows()
# one test per (entry, argument) runs its rows: pytest's per-test overhead would dominate 2,600 tests
CELLS = sorted({(e.name, arg) for e, arg, _, _ in ROWS})


def _kwargs(entry: Entry) -> dict[str, object]:
    """Fresh valid arguments of an entry."""
    return {name: arg.make_valid() for name, arg in entry.args.items()}


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_the_valid_call_succeeds(entry):
    # the baseline of every row: with all arguments valid, the call goes through
    if entry.requires:
        pytest.importorskip(entry.requires)
    entry.call(entry.make(), _kwargs(entry))


@pytest.mark.parametrize(("name", "arg"), CELLS, ids=[f"{n}-{a}" for n, a in CELLS])
def test_bad_input_raises_a_typed_error_naming_the_argument_and_changes_nothing(name, arg):
    entry = BY_NAME[name]
    if entry.requires:
        pytest.importorskip(entry.requires)
    failures = [
        problem
        for kind, values in entry.args[arg].bad_values().items()
        for bad in values
        if (problem := _check_row(entry, arg, kind, bad))
    ]
    assert not failures, "\n".join(failures)


def _check_row(entry: Entry, arg: str, kind: str, bad: object) -> str | None:
    """Run one row; a description of what went wrong, or None."""
    subject = entry.make()
    kwargs = _kwargs(entry)
    kwargs[arg] = bad
    before = state(subject)
    row = f"{entry.name}({arg}={bad!r:.60}) [{kind}]"
    try:
        entry.call(subject, kwargs)
    except PagedKVError as e:
        names = entry.named.get(arg, arg)
        if not any(n in str(e) for n in ((names,) if isinstance(names, str) else names)):
            return f"{row}: the message does not name {arg!r}: {e}"
    except Exception as e:  # noqa: BLE001 (the point: anything but a PagedKVError is a failure)
        return f"{row}: raised {type(e).__name__}: {e}"
    else:
        return f"{row}: accepted"
    return None if state(subject) == before else f"{row}: the rejected call changed the object"


def public_entry_points() -> set[str]:
    """Every public callable with arguments: functions, constructors, and methods defined in our packages."""
    names: set[str] = set()
    UNIMPORTABLE.clear()
    for mod_name in MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # an integration whose library is not installed (its rows skip too)
            UNIMPORTABLE.append(mod_name)
            continue
        public = getattr(mod, "__all__", None) or [
            n for n, v in vars(mod).items() if not n.startswith("_") and getattr(v, "__module__", None) == mod_name
        ]
        for n in public:
            v = getattr(mod, n)
            if inspect.isclass(v) and issubclass(v, BaseException):
                continue  # the error classes themselves
            names.add(f"{mod_name}.{n}")
            if inspect.isclass(v):
                names |= {f"{mod_name}.{n}.{m}" for m in _methods_with_arguments(v)}
    return names


def _methods_with_arguments(cls: type) -> list[str]:
    """Public methods of ``cls`` defined in our packages that take at least one argument."""
    out = []
    for name in dir(cls):
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if name.startswith("_") or owner is None or not owner.__module__.startswith(OURS):
            continue
        attr = vars(owner)[name]
        fn = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
        if inspect.isfunction(fn) and [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]:
            out.append(name)
    return out


def test_every_public_entry_point_is_in_the_matrix():
    covered = {e.name.split("[")[0] for e in ENTRIES} | set(EXEMPT)
    exempt_class = lambda name: name.rsplit(".", 1)[0] in EXEMPT  # noqa: E731  (its methods are exempt too)
    public = public_entry_points()
    missing = sorted(n for n in public - covered if not exempt_class(n))
    assert not missing, f"public entry points with no bad-input rows and no exemption: {missing}"
    stale = sorted(n for n in covered - public if not n.startswith(tuple(UNIMPORTABLE)))
    assert not stale, f"matrix entries or exemptions for names that are not public entry points: {stale}"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_every_argument_of_an_entry_point_has_rows(entry):
    # a new parameter of a public entry point must join its rows (an Arg, possibly with documented skips)
    if entry.requires:
        pytest.importorskip(entry.requires)
    fn = getattr(entry.make(), entry.target) if isinstance(entry.target, str) else entry.target
    if not isinstance(entry.target, str) and entry.target.__name__ == "<lambda>":  # a lazily imported class
        module, name = entry.name.split("[")[0].rsplit(".", 1)
        fn = getattr(importlib.import_module(module), name)
    params = inspect.signature(fn).parameters.values()
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self", "cls"}
    covered = set(entry.args) | {entry.subject_as}
    assert named <= covered, f"arguments with no rows: {sorted(named - covered)}"


def test_every_entry_has_rows_and_the_matrix_spans_every_kind():
    assert all(any(arg.bad_values() for arg in e.args.values()) for e in ENTRIES)
    assert {k for _, _, k, _ in ROWS} == set(KINDS)

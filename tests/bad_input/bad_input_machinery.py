"""The machinery of the bad-input matrix: argument families, their bad values, entries and full state snapshots.

An :class:`Entry` is one public entry point with a valid call: a factory for the object it is
called on, and for every argument a valid value and its :class:`Arg` family. A row of the
matrix replaces ONE argument by one bad value of one kind; the call must raise a
``PagedKVError`` whose message names the argument, and leave the object exactly as it was.
"""

from __future__ import annotations

import array
import dataclasses
import enum
import math
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

NAN, INF = math.nan, math.inf

# Kinds of bad input (the matrix's columns).
WRONG_TYPE = "wrong_type"
BOOL_FOR_INT = "bool_for_int"
NONINTEGRAL = "nonintegral_float"
NAN_INF = "nan_inf"
OUT_OF_RANGE = "out_of_range"
BAD_ID = "bad_id"  # unknown, unhashable or already-taken sequence ids
BAD_DEVICE = "bad_device"
BAD_DTYPE = "bad_dtype"
WRONG_SHAPE = "wrong_shape"
KINDS = (WRONG_TYPE, BOOL_FOR_INT, NONINTEGRAL, NAN_INF, OUT_OF_RANGE, BAD_ID, BAD_DEVICE, BAD_DTYPE, WRONG_SHAPE)
NOT_NEGATIVE = {OUT_OF_RANGE: [-1]}  # counts with no upper bound: only a negative one is out of range


def _device_values() -> list[object]:
    """Device strings that are no device here: a typo, an absent backend, a device without data."""
    absent = "cuda:0" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    return ["gpu0", absent, "meta"]


# The bad values of each argument family, by kind. An Arg may replace a kind's values or skip it.
FAMILIES: dict[str, dict[str, list[object]]] = {
    "int": {
        WRONG_TYPE: ["3", None, [1]],
        BOOL_FOR_INT: [True, False, np.bool_(True)],
        NONINTEGRAL: [1.5, 2.0, np.float64(2.0)],
        NAN_INF: [NAN, INF],
        OUT_OF_RANGE: [-1, 1 << 62],
    },
    "opt_int": {
        WRONG_TYPE: ["3", [1]],
        BOOL_FOR_INT: [True],
        NONINTEGRAL: [1.5],
        NAN_INF: [NAN],
        OUT_OF_RANGE: [-1, 1 << 62],
    },
    "real": {WRONG_TYPE: ["0.5", None], BOOL_FOR_INT: [True, False], NAN_INF: [NAN, INF, -INF]},
    "bool": {WRONG_TYPE: [1, "yes", None]},
    "ids": {
        WRONG_TYPE: ["ab", {1: 2}, None],
        BOOL_FOR_INT: [[True, False], [3, True], np.array([True, False])],
        NONINTEGRAL: [[1.7], [2.0], np.array([1.5, 2.0])],
        NAN_INF: [[NAN]],
        OUT_OF_RANGE: [[-1]],
    },
    "seq_id": {BAD_ID: [["unhashable"], "unknown"]},
    "new_seq_id": {BAD_ID: [["unhashable"]]},
    "device": {WRONG_TYPE: [3.5, [0]], BAD_DEVICE: _device_values()},
    "dtype": {WRONG_TYPE: ["float16", 3], BAD_DTYPE: [torch.complex64, torch.int16]},
    "opt_str": {WRONG_TYPE: [3, b"salt", ["x"]]},
    "obj": {WRONG_TYPE: [None, "x", 3]},
    "pairs": {
        WRONG_TYPE: ["ab", 3, [(1, 2, 3)]],
        BOOL_FOR_INT: [[(True, 2)], [(1, False)]],
        NONINTEGRAL: [[(1.7, 2)]],
        NAN_INF: [[(NAN, 2)]],
        OUT_OF_RANGE: [[(0, 1 << 20)], [(-1, 2)], [(0, 1 << 63)]],
        BAD_DTYPE: [torch.tensor([[1.0, 2.0]]), torch.tensor([[True, False]])],
        WRONG_SHAPE: [torch.tensor([1, 2]), torch.tensor([[1, 2, 3]])],
    },
    # tensors: a family's values come from the valid tensor (see bad_tensors); only these kinds apply
    "tensor": {},
    "float_tensor": {},  # a float tensor whose values must also be finite
}
TENSOR_KINDS = (WRONG_TYPE, BAD_DTYPE, WRONG_SHAPE)


def bad_tensors(valid: torch.Tensor, finite: bool) -> dict[str, list[object]]:
    """Bad versions of a valid tensor: not a tensor, another dtype, another rank (and NaN/inf if finite)."""
    other = torch.int32 if valid.is_floating_point() else torch.float32
    out: dict[str, list[object]] = {
        WRONG_TYPE: [None, "x"],
        BAD_DTYPE: [valid.to(other), valid.to(torch.complex64) if valid.is_floating_point() else valid.bool()],
        WRONG_SHAPE: [valid.unsqueeze(0), valid.reshape(-1)[:1].reshape(()) if valid.numel() else valid[None]],
    }
    if finite:
        out[NAN_INF] = [torch.full_like(valid, NAN), torch.full_like(valid, INF)]
    return out


@dataclass(frozen=True)
class Arg:
    """One argument of an entry point: its family, a valid value (or a factory of one) and adjustments."""

    family: str
    valid: object
    bad: dict[str, list[object]] = field(default_factory=dict)  # replaces the family's values of a kind
    skip: tuple[str, ...] = ()  # kinds that are valid for this argument (each one documented where used)

    def make_valid(self) -> object:
        """A fresh valid value (factories are called: tensors must not be shared between rows)."""
        return self.valid() if callable(self.valid) and not isinstance(self.valid, type) else self.valid

    def bad_values(self) -> dict[str, list[object]]:
        """Kind -> bad values of this argument."""
        if self.family in ("tensor", "float_tensor"):
            values = bad_tensors(self.make_valid(), self.family == "float_tensor")
        else:
            values = {k: list(v) for k, v in FAMILIES[self.family].items()}
        values.update(self.bad)
        return {k: v for k, v in values.items() if k not in self.skip and v}


@dataclass(frozen=True)
class Entry:
    """A public entry point and a valid call of it."""

    name: str  # as enumerated: "paged_kv.BlockManager.append", "kernels.copy_blocks", "scheduler.SamplingParams"
    target: Callable[..., object] | str  # a callable, or the method name to call on the subject
    args: dict[str, Arg]
    make: Callable[[], object] = lambda: None  # the subject (None for functions and constructors)
    named: dict[str, str | tuple[str, ...]] = field(default_factory=dict)  # arg -> name(s) its errors use instead
    requires: str | None = None  # an optional package the entry needs (skipped without it)
    subject_as: str | None = None  # a constructor given the subject as this argument (e.g. a shared pool)

    def call(self, subject: object, kwargs: dict[str, object]) -> object:
        """Run the entry point on ``subject`` (or with it, as argument ``subject_as``)."""
        if self.subject_as is not None:
            kwargs = {**kwargs, self.subject_as: subject}
        fn = getattr(subject, self.target) if isinstance(self.target, str) else self.target
        return fn(**kwargs)

    def with_subject_as(self, name: str, make: Callable[[], object]) -> Entry:
        """This constructor called with ``make()`` as argument ``name``: rows then check that object is unchanged."""
        args = {k: v for k, v in self.args.items() if k != name}
        return dataclasses.replace(self, name=f"{self.name}[{name}]", args=args, make=make, subject_as=name)


def with_shared_pools(entries: list[Entry], pools: dict[str, Callable[[], object]]) -> list[Entry]:
    """The entries, then each constructor named in ``pools`` again, given a shared pool as ``pool``."""
    by_name = {e.name: e for e in entries}
    return entries + [by_name[name].with_subject_as("pool", make) for name, make in pools.items()]


def requiring(package: str, entries: list[Entry], prefixes: tuple[str, ...] = ("",)) -> list[Entry]:
    """The entries, those whose name starts with one of ``prefixes`` (all by default) needing ``package``."""
    return [dataclasses.replace(e, requires=package) if e.name.startswith(prefixes) else e for e in entries]


def state(x: object) -> object:
    """A deep, comparable copy of everything reachable from ``x`` (tensors and arrays by bytes)."""
    return _state(x, {})


def _state(x: object, seen: dict[int, int]) -> object:
    """``state`` with the ids of the objects already seen (cycles, shared objects)."""
    if x is None or isinstance(x, (bool, int, float, str, bytes, complex, enum.Enum, torch.dtype, torch.device)):
        return x if not (isinstance(x, float) and math.isnan(x)) else "nan"
    if isinstance(x, (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return repr(x)
    if id(x) in seen:
        return ("ref", seen[id(x)])
    seen[id(x)] = len(seen)
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").contiguous()
        return ("T", t.dtype, tuple(t.shape), bytes(t.view(torch.uint8).numpy()) if t.numel() else b"")
    if isinstance(x, np.ndarray):
        return ("A", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, array.array):
        return ("a", x.typecode, x.tobytes())
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_state(v, seen) for v in x))
    if isinstance(x, (set, frozenset)):
        return ("set", tuple(sorted(repr(v) for v in x)))
    if isinstance(x, dict):
        return ("dict", tuple((repr(k), _state(v, seen)) for k, v in x.items()))
    if isinstance(x, (weakref.finalize, weakref.ref)) or type(x).__module__ in ("itertools", "_thread"):
        return type(x).__name__  # bookkeeping with no observable state of its own
    if isinstance(x, torch.nn.Module):
        return ("M", type(x).__name__, tuple((k, _state(v, seen)) for k, v in x.state_dict().items()))
    fields = _fields(x)
    if fields is None:
        return ("repr", repr(x))
    return (type(x).__name__, tuple((k, _state(v, seen)) for k, v in fields.items()))


def _fields(x: object) -> dict[str, object] | None:
    """An object's attributes (``__dict__`` and ``__slots__``), or None for opaque objects."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    out: dict[str, object] = {}
    for cls in type(x).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if hasattr(x, slot):
                out[slot] = getattr(x, slot)
    if hasattr(x, "__dict__"):
        out.update(vars(x))
    return out or None

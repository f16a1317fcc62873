"""Triton launches without the JIT's per-launch dispatch when nothing it specializes on has changed.

``kernel[grid](*args, **kwargs)`` re-derives the specialization of every argument and looks
the compiled kernel up on each launch. On the H100 with Triton 3.6 that took most of a decode
call's host time: ~28 arguments re-specialized per launch (docs/benchmarks.md, "On the H100").
A step launches each kernel once per layer with the same ints, floats, dtypes, grid and
constexprs; only the tensors differ. Of a tensor the JIT specializes on its dtype and on whether
its address is 16-byte aligned.

:func:`launch` keys a launch on exactly those host values (every non-tensor argument by its
exact value, so the key is never looser than Triton's own), plus the grid, the keyword
arguments and the device. A launch whose key was seen relaunches that compiled kernel directly,
through ``CompiledKernel[grid](*params)``, the same call on Triton 3.6 to 3.9. Any other launch
goes through the JIT, and so does every launch under the interpreter.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

MAX_ENTRIES = 1024  # compiled kernels remembered; the oldest key goes first (keys hold ints such as lengths)
OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl"})

_compiled: dict[Hashable, tuple[Any, tuple[str, ...]]] = {}  # key -> (compiled kernel, constexpr names in order)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, through the compiled kernel directly when this key was launched before.

    ``args`` are the kernel's leading parameters in order; ``kwargs`` its remaining (constexpr)
    parameters by name and the launch options (``num_warps``, ``num_stages``).
    """
    key = _key(kernel, grid, args, kwargs)
    entry = _compiled.get(key)
    if entry is not None:
        compiled, names = entry
        compiled[(*grid, 1, 1)[:3]](*args, *[kwargs[n] for n in names])  # its runner reads grid[0], [1] and [2]
        return
    result = kernel[grid](*args, **kwargs)
    names = _constexpr_names(kernel, len(args), kwargs)
    if names is not None and callable(getattr(result, "__getitem__", None)) and hasattr(result, "run"):
        if len(_compiled) >= MAX_ENTRIES:
            del _compiled[next(iter(_compiled))]
        _compiled[key] = (result, names)


def forget() -> None:
    """Drop every remembered compiled kernel (the next launch of each goes through the JIT)."""
    _compiled.clear()


def _key(kernel: Any, grid: tuple[int, ...], args: Sequence[Any], kwargs: dict[str, Any]) -> Hashable:
    """What the JIT's specialization depends on, as host values; the device of the first tensor."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    spec = tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args)
    return kernel, grid, device, spec, tuple(kwargs.items())


def _constexpr_names(kernel: Any, num_args: int, kwargs: dict[str, Any]) -> tuple[str, ...] | None:
    """The names of the parameters after ``args`` in signature order, if ``kwargs`` gives each; else None."""
    names = getattr(kernel, "arg_names", None)
    if names is None:
        return None
    rest = tuple(names[num_args:])
    if any(n not in kwargs or n in OPTIONS for n in rest):
        return None
    return rest

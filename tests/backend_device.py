"""Where a kernel backend runs in the tests: Triton on the GPU when there is one, else on CPU.

``tests/conftest.py`` turns on Triton's interpreter (TRITON_INTERPRET=1) only on machines
without a GPU; on a GPU machine ``backend="triton"`` needs CUDA tensors. The kernel tests build
their inputs and truths on the CPU (seeded CPU generators, float64 references) and call the
kernels through :func:`call_on_backend`, which runs the call on the backend's device and hands
back CPU tensors. Without a GPU it calls the function unchanged, so the CPU suite runs exactly
what it ran before.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

CPU = torch.device("cpu")
HAS_CUDA = torch.cuda.is_available()
# The device backend="triton" runs on here: CUDA, or the CPU through the interpreter.
TRITON_DEVICE = torch.device("cuda") if HAS_CUDA else CPU

# A test that needs a CUDA device: marked `gpu`, skipped without one.
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def gpu_test(fn: Callable) -> Callable:
    """Mark a test as needing CUDA (`-m gpu` selects it) and skip it without a GPU."""
    return pytest.mark.gpu(needs_cuda(fn))


def backend_device(backend: str) -> torch.device:
    """The device a test puts a backend's inputs on: TRITON_DEVICE for 'triton', else the CPU."""
    return TRITON_DEVICE if backend == "triton" else CPU


def call_on_backend(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with its CPU tensors on the device of ``kwargs['backend']``.

    Tensors are moved (nested lists, tuples and dicts too) keeping their strides, each distinct
    tensor once, so an argument passed twice stays one tensor. Afterwards, even when ``fn``
    raises, every moved tensor is copied back into its CPU original (kernels write caches in
    place), and tensors in the result come back on the CPU. Tensors on other devices (``meta``
    in the validation tests) are passed as they are. Arguments must not be different views of
    one storage that the call writes: the copies back would overwrite each other.
    """
    global _calls_inside
    device = backend_device(kwargs.get("backend", "auto"))
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(cpu tensor) -> (cpu, on device)
    _calls_inside += 1
    try:
        if device == CPU:
            return fn(*args, **kwargs)
        return _to_cpu(fn(*_move(args, device, moved), **_move(kwargs, device, moved)))
    finally:
        _calls_inside -= 1
        for original, on_device in moved.values():
            if not _broadcast(original):  # a broadcast view is read-only: nothing to bring back
                original.copy_(on_device)


_calls_inside = 0  # call_on_backend calls under way (the guard below lets their Triton launches through)


def guard_triton_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU, fail a Triton launch on CPU tensors that did not come through ``call_on_backend``.

    Such a test passes here, under the interpreter, and fails on every GPU machine ("expected CUDA
    tensors"). Tests that switch the interpreter off (TRITON_INTERPRET=0) to check that refusal
    are let through.
    """
    if HAS_CUDA:
        return
    for name, module in list(sys.modules.items()):
        check = getattr(module, "check_triton_device", None) if name.startswith("kernels") else None
        if check is not None:
            monkeypatch.setattr(module, "check_triton_device", _guarded(check))


def _guarded(check: Callable[..., None]) -> Callable[..., None]:
    """``check`` that first refuses an interpreted launch made outside ``call_on_backend``."""

    def guarded(*tensors: torch.Tensor) -> None:
        if _calls_inside == 0 and os.environ.get("TRITON_INTERPRET") == "1":
            raise AssertionError(
                "backend='triton' on CPU tensors outside tests/backend_device.call_on_backend: this test would fail "
                "on a GPU machine, where the interpreter is off; call the kernel through call_on_backend"
            )
        check(*tensors)

    return guarded


def _move(x: Any, device: torch.device, moved: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """``x`` with every CPU tensor in it replaced by a same-strided copy on ``device``."""
    if isinstance(x, torch.Tensor):
        if x.device != CPU:
            return x
        if id(x) not in moved:
            moved[id(x)] = (x, _strided_copy(x, device))
        return moved[id(x)][1]
    if isinstance(x, (list, tuple)):
        return type(x)(_move(item, device, moved) for item in x)
    if isinstance(x, dict):
        return {key: _move(value, device, moved) for key, value in x.items()}
    return x


def _strided_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``t`` on ``device`` with the same sizes and strides (a strided view stays strided)."""
    if _broadcast(t):
        return t.to(device)  # empty_strided cannot be written through stride-0 dimensions
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.copy_(t)


def _broadcast(t: torch.Tensor) -> bool:
    """Whether ``t`` repeats memory along a dimension (stride 0 over more than one element)."""
    return any(stride == 0 for size, stride in zip(t.shape, t.stride()) if size > 1)


def _to_cpu(x: Any) -> Any:
    """``x`` with every tensor (also inside tuples and lists) on the CPU."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(item) for item in x)
    return x

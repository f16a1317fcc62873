"""A guard that fails any read of a tensor's values on the host: the hot path's sync-free discipline.

On a GPU each of these reads waits for the device (and breaks CUDA-graph capture). On the CPU
they cost nothing, so the discipline is checked by making them raise inside the guarded block.
"""

from __future__ import annotations

import contextlib

import torch

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


class HostReadError(AssertionError):
    """A tensor value was read on the host inside :func:`forbid_host_reads`."""


@contextlib.contextmanager
def forbid_host_reads():
    """Make every ``Tensor`` method in HOST_READS raise HostReadError inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def failing(name):
        def fail(self, *args, **kwargs):
            raise HostReadError(f"Tensor.{name} on a {tuple(self.shape)} {self.dtype} tensor read it on the host")

        return fail

    for name in HOST_READS:
        setattr(torch.Tensor, name, failing(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


class LaunchRecorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` records the call instead of running it."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, tuple, dict]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))

        return launch

"""kernels.launch: a repeated launch key relaunches the compiled kernel; any change goes through the JIT."""

from __future__ import annotations

import pytest
import torch
from backend_device import gpu_test

import kernels.launch as launches
from kernels import paged_decode_attention
from kernels.launch import launch


class FakeCompiled:
    """What the JIT returns: a compiled kernel launched as ``compiled[grid](*all_params)``."""

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, *args):  # present on Triton's CompiledKernel; launch checks for it
        raise AssertionError("launch calls compiled[grid](...), not run")

    def __getitem__(self, grid):
        grid = (grid[0], grid[1], grid[2])  # as Triton's runner reads it: three dimensions, always
        return lambda *params: self.log.append(("compiled", grid, params))


class FakeKernel:
    """A JIT function with parameters (x_ptr, n, BLOCK, DTYPE): logs each launch by path."""

    arg_names = ["x_ptr", "n", "BLOCK", "DTYPE"]

    def __init__(self, returns_compiled: bool = True) -> None:
        self.log: list = []
        self.returns_compiled = returns_compiled

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.log) if self.returns_compiled else None

        return run


@pytest.fixture(autouse=True)
def _empty_cache():
    launches.forget()
    yield
    launches.forget()


def paths(kernel: FakeKernel) -> list[str]:
    return [entry[0] for entry in kernel.log]


def test_a_repeated_key_relaunches_the_compiled_kernel_with_every_parameter_in_order():
    kernel, x, y = FakeKernel(), torch.zeros(64), torch.ones(64)
    launch(kernel, (4, 2), x, 7, BLOCK=32, DTYPE="fp32", num_warps=4)
    launch(kernel, (4, 2), y, 7, BLOCK=32, DTYPE="fp32", num_warps=4)  # another tensor, same specialization
    assert paths(kernel) == ["jit", "compiled"]
    _, grid, params = kernel.log[1]
    assert grid == (4, 2, 1) and params[0] is y and params[1:] == (7, 32, "fp32")


@pytest.mark.parametrize(
    "change",
    [
        dict(n=8),  # an int: the JIT specializes on its value (== 1, divisible by 16)
        dict(x=torch.zeros(64)[1:]),  # a tensor 4 bytes off a 16-byte boundary
        dict(x=torch.zeros(64, dtype=torch.float64)),  # another dtype
        dict(grid=(5, 2)),
        dict(BLOCK=64),  # a constexpr
        dict(num_warps=8),  # an option
    ],
    ids=["int", "alignment", "dtype", "grid", "constexpr", "option"],
)
def test_any_change_the_jit_specializes_on_goes_through_the_jit(change):
    kernel = FakeKernel()
    base = dict(grid=(4, 2), x=torch.zeros(64), n=7, BLOCK=32, num_warps=4)
    launch(kernel, base["grid"], base["x"], base["n"], BLOCK=base["BLOCK"], DTYPE="fp32", num_warps=base["num_warps"])
    new = base | change
    launch(kernel, new["grid"], new["x"], new["n"], BLOCK=new["BLOCK"], DTYPE="fp32", num_warps=new["num_warps"])
    assert paths(kernel) == ["jit", "jit"]


def test_without_a_compiled_kernel_or_every_constexpr_named_each_launch_goes_through_the_jit():
    interpreted, x = FakeKernel(returns_compiled=False), torch.zeros(64)  # the interpreter returns no kernel
    for _ in range(2):
        launch(interpreted, (1,), x, 7, BLOCK=32, DTYPE="fp32")
    assert paths(interpreted) == ["jit", "jit"]
    defaulted = FakeKernel()  # DTYPE left to its default: its position in the parameters is unknown
    for _ in range(2):
        launch(defaulted, (1,), x, 7, BLOCK=32)
    assert paths(defaulted) == ["jit", "jit"]


def test_the_cache_keeps_at_most_max_entries_dropping_the_oldest(monkeypatch):
    monkeypatch.setattr(launches, "MAX_ENTRIES", 2)
    kernel, x = FakeKernel(), torch.zeros(64)
    for n in (1, 2, 3):
        launch(kernel, (1,), x, n, BLOCK=32, DTYPE="fp32")
    assert len(launches._compiled) == 2
    launch(kernel, (1,), x, 1, BLOCK=32, DTYPE="fp32")  # the oldest, dropped: through the JIT again
    launch(kernel, (1,), x, 3, BLOCK=32, DTYPE="fp32")  # kept
    assert paths(kernel)[3:] == ["jit", "compiled"]


@gpu_test
def test_a_relaunched_decode_kernel_computes_what_the_jit_launch_does():
    """On CUDA: the second decode over new data takes the compiled path and still matches the torch reference."""
    gen = torch.Generator().manual_seed(0)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([20, 31], dtype=torch.int32, device="cuda")
    for round_ in range(2):
        q = torch.randn(2, 4, 64, generator=gen).cuda()
        k, v = (torch.randn(4, 16, 2, 64, generator=gen).cuda() for _ in range(2))
        out = paged_decode_attention(q, k, v, tables, lens, backend="triton")
        ref = paged_decode_attention(q.cpu(), k.cpu(), v.cpu(), tables.cpu(), lens.cpu(), backend="torch")
        torch.testing.assert_close(out.cpu(), ref, atol=2e-3, rtol=2e-3)
        assert launches._compiled, f"round {round_}: no compiled kernel remembered"

"""Test set-up: Triton runs through its interpreter on machines without a GPU.

TRITON_INTERPRET must be set before any kernel module is imported, so it is set
here, at the top of the root conftest, before the test modules are collected.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from backend_device import guard_triton_calls  # noqa: E402  (after TRITON_INTERPRET, like every kernel import)

# Under pytest-xdist every worker gets one intra-op thread: the workers already
# fill the cores, and oversubscribed torch threads slow small ops down ~30x.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _triton_calls_run_on_the_backend_device(monkeypatch):
    """Without a GPU, a Triton launch on CPU tensors must come through call_on_backend (else it fails on a GPU)."""
    guard_triton_calls(monkeypatch)

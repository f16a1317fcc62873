"""Test set-up: Triton runs through its interpreter on machines without a GPU.

TRITON_INTERPRET must be set before any kernel module is imported, so it is set
here, at the top of the root conftest, before the test modules are collected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every worker gets one intra-op thread: the workers already
# fill the cores, and oversubscribed torch threads slow small ops down ~30x.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

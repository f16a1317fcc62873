"""Test set-up: Triton runs through its interpreter on machines without a GPU.

TRITON_INTERPRET must be set before any kernel module is imported, so it is set
here, at the top of the root conftest, before the test modules are collected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

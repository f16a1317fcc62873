"""Host checks shared by the kernel wrappers: attention options, and a call bound once and run per layer."""

from __future__ import annotations

import math

import pytest
import torch
from no_host_reads import forbid_host_reads

from kernels.checks import BoundCall, check_options
from paged_kv.errors import InvalidArgumentError


def test_options_resolve_the_default_scale_and_reject_bad_values():
    assert check_options(16, None, None, None) == (0.25, None, None)
    assert check_options(16, -2, 5, 3) == (-2.0, 5, 3.0)  # any finite scale; ints become floats
    for scale, window, cap in ((math.nan, None, None), (True, None, None), (1.0, 0, None), (1.0, None, 0.0)):
        with pytest.raises(InvalidArgumentError):
            check_options(16, scale, window, cap)


def test_a_bound_call_runs_layers_shaped_like_the_checked_one_and_rejects_others():
    calls = []
    first, other = torch.zeros(2, 4, 8), torch.ones(2, 4, 8)
    bound = BoundCall(lambda q, k: calls.append((q, k)) or q.shape[0], first, None)
    with forbid_host_reads():  # the comparison reads shapes, strides and dtypes, never values
        assert bound(other, None) == 2 and calls[-1][0] is other
    strided = torch.zeros(2, 8, 4).transpose(1, 2)  # first's shape, other strides
    for q, k in ((torch.zeros(3, 4, 8), None), (first.half(), None), (strided, None), (first, first)):
        with pytest.raises(InvalidArgumentError, match="tensors="):
            bound(q, k)
    assert len(calls) == 1  # nothing ran for the rejected layers
    assert bound.run(torch.zeros(5, 1, 1), None) == 5  # the checked caller runs the launch directly

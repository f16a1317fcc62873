"""as_token_list: the token-spec check shared by allocate, append and the cache queries."""

from __future__ import annotations

import numpy as np
import pytest

from paged_kv import tokens as tokens_mod
from paged_kv.errors import InvalidArgumentError
from paged_kv.tokens import MAX_TOKENS_PER_CALL, as_token_list

INT64_MAX = (1 << 63) - 1


@pytest.mark.parametrize(
    "spec", [[3, 1, 2], (3, 1, 2), range(3, 0, -1), np.array([3, 1, 2]), np.array([3, 1, 2], dtype=np.int32)]
)
def test_sequences_become_a_list_of_python_ints(spec):
    out = as_token_list("token_ids", spec)
    assert out == list(spec)
    assert type(out) is list and all(type(t) is int for t in out)


def test_result_is_a_copy():
    ids = [1, 2, 3]
    out = as_token_list("token_ids", ids)
    out.append(4)
    assert ids == [1, 2, 3]


def test_extreme_valid_ids_and_empty_list():
    assert as_token_list("t", [0, INT64_MAX]) == [0, INT64_MAX]
    assert as_token_list("t", []) == []


@pytest.mark.parametrize("count", [0, 1, 17, MAX_TOKENS_PER_CALL])
def test_a_count_is_anonymous_tokens(count):
    assert as_token_list("token_ids", count) is None


@pytest.mark.parametrize("count", [-1, MAX_TOKENS_PER_CALL + 1, 1 << 70])
def test_count_out_of_range(count):
    with pytest.raises(InvalidArgumentError, match=rf"^token_ids={count}: expected a count in \[0, "):
        as_token_list("token_ids", count)


@pytest.mark.parametrize(
    ("spec", "shown"),
    [("abc", "'str'"), (b"ab", "'bytes'"), (None, "'NoneType'"), (2.0, "'float'"), ({1, 2}, "'set'"),
     ({1: 2}, "'dict'"), (True, "'bool'"), (iter([1, 2]), "'list_iterator'")],
)
def test_non_sequences_are_rejected_naming_the_type(spec, shown):
    with pytest.raises(InvalidArgumentError, match=rf"^prompt={shown}: expected a sequence of token ids or a count$"):
        as_token_list("prompt", spec)


@pytest.mark.parametrize(
    ("spec", "bad"),
    [([1, 2.0, 3], "2.0"), ([1, "2"], "'2'"), ([None], "None"), ([1, 1 << 63], str(1 << 63)),
     ([-(1 << 64)], str(-(1 << 64))), ([[1]], r"\[1\]"), (np.array([0.5, 1.5]), "0.5"),
     ([True, False], "True"), ([5, 0, False], "False"), (np.array([True]), "True"),
     (list(range(300)) + [True], "True")],
)
def test_non_int64_ids_are_rejected_naming_the_first_bad_one(spec, bad):
    with pytest.raises(InvalidArgumentError, match=rf"^token_ids={bad}: expected token ids as int64 integers$"):
        as_token_list("token_ids", spec)


def test_negative_ids_are_rejected_naming_the_smallest():
    with pytest.raises(InvalidArgumentError, match=r"^token_ids=-5: expected non-negative token ids$"):
        as_token_list("token_ids", [3, -1, -5, 2])


def test_too_long_a_list_is_rejected(monkeypatch):
    monkeypatch.setattr(tokens_mod, "MAX_TOKENS_PER_CALL", 4)
    assert tokens_mod.as_token_list("t", [0] * 4) == [0] * 4
    with pytest.raises(InvalidArgumentError, match=r"^len\(t\)=5: expected at most 4$"):
        tokens_mod.as_token_list("t", [0] * 5)


@pytest.mark.parametrize("spec", [[True, False], [7, 1, True], (0, False), [256, 1, 0, 257, True]])
def test_bools_are_not_ids_on_the_packed_fast_path(spec):
    # bools pack as int64 0 / 1, so the fast path must look at the ids packed as 0 or 1
    with pytest.raises(InvalidArgumentError, match=r"^token_ids=(True|False): expected token ids as int64 integers$"):
        tokens_mod.as_token_array("token_ids", spec)
    assert tokens_mod.as_token_array("token_ids", [int(t) for t in spec]).tolist() == [int(t) for t in spec]

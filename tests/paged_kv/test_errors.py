"""The exception hierarchy and the shared argument checks of paged_kv.errors."""

from __future__ import annotations

import numpy as np
import pytest

from paged_kv.errors import (
    ClosedError,
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfBlocksError,
    OutOfRangeError,
    PagedKVError,
    SequenceStateError,
    UnknownSequenceError,
    check_bool,
    check_int,
    check_real,
    check_type,
    describe,
)


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (InvalidArgumentError, ValueError),
        (OutOfRangeError, IndexError),
        (UnknownSequenceError, KeyError),
        (DuplicateSequenceError, ValueError),
        (SequenceStateError, ValueError),
        (OutOfBlocksError, MemoryError),
        (ClosedError, ValueError),
    ],
)
def test_every_error_is_a_paged_kv_error_and_its_builtin(cls, builtin):
    err = cls("x")
    assert isinstance(err, PagedKVError)
    assert isinstance(err, builtin)
    with pytest.raises(builtin):
        raise err


def test_unknown_sequence_error_str_is_the_plain_message():
    # KeyError.__str__ would repr() the message and wrap it in quotes
    assert str(UnknownSequenceError("seq_id=3: expected x")) == "seq_id=3: expected x"
    assert str(UnknownSequenceError()) == ""


def test_describe_names_argument_value_and_expectation():
    assert describe("block_size", -3, "an integer >= 1") == "block_size=-3: expected an integer >= 1"
    assert describe("name", "a", "b") == "name='a': expected b"


class _Index:
    def __index__(self) -> int:
        return 7


@pytest.mark.parametrize("value", [0, 5, 10, np.int64(5), np.int32(3), _Index()])
def test_check_int_accepts_integers_and_index_types(value):
    out = check_int("n", value, low=0, high=10)
    assert type(out) is int
    assert out == int(value.__index__())


@pytest.mark.parametrize("value", [1.0, 1.5, "3", None, [1], np.float64(2.0)])
def test_check_int_rejects_non_integers(value):
    with pytest.raises(InvalidArgumentError, match=r"^count=.*: expected an integer$"):
        check_int("count", value)


@pytest.mark.parametrize("value", [True, False])
def test_check_int_rejects_bools(value):
    with pytest.raises(InvalidArgumentError, match=r"^count=.*: expected an integer$"):
        check_int("count", value)


def test_check_int_below_low_without_high_is_invalid_argument():
    with pytest.raises(InvalidArgumentError, match=r"^n=-1: expected an integer >= 0$") as info:
        check_int("n", -1)
    assert not isinstance(info.value, OutOfRangeError)
    with pytest.raises(InvalidArgumentError, match=r"^n=2: expected an integer >= 3$"):
        check_int("n", 2, low=3)


@pytest.mark.parametrize("value", [-1, 11, 1 << 70])
def test_check_int_outside_bounds_is_out_of_range(value):
    with pytest.raises(OutOfRangeError, match=rf"^idx={value}: expected an integer in \[0, 10\]$"):
        check_int("idx", value, low=0, high=10)


def test_check_int_bounds_are_inclusive():
    assert check_int("i", 3, low=3, high=3) == 3


@pytest.mark.parametrize("value", [0, 0.5, np.float32(0.25), np.float64(0.75), -0.0])
def test_check_real_accepts_finite_reals_in_the_interval(value):
    assert check_real("w", value, low=0.0, high=1.0, open_high=True) == float(value)


@pytest.mark.parametrize(
    "value", [True, False, np.bool_(True), "0.5", None, float("nan"), float("inf"), -float("inf"), 1.0, -0.1, 1 + 0j]
)
def test_check_real_rejects_bools_non_numbers_non_finite_and_out_of_interval(value):
    with pytest.raises(InvalidArgumentError, match=r"^w=.*: expected a finite number in \[0.0, 1.0\)$"):
        check_real("w", value, low=0.0, high=1.0, open_high=True)


def test_check_real_without_bounds_names_no_interval():
    with pytest.raises(InvalidArgumentError, match=r"^s=nan: expected a finite number$"):
        check_real("s", float("nan"))


def test_check_real_open_and_closed_ends():
    assert check_real("t", 1.0, low=0.0, high=1.0) == 1.0
    with pytest.raises(InvalidArgumentError, match=r"in \(0.0, 1.0\]"):
        check_real("t", 0.0, low=0.0, high=1.0, open_low=True)


@pytest.mark.parametrize("value", [1, 0, "yes", None, np.bool_(True)])
def test_check_bool_takes_only_bools(value):
    with pytest.raises(InvalidArgumentError, match=r"^flag=.*: expected a bool$"):
        check_bool("flag", value)
    assert check_bool("flag", True) is True and check_bool("flag", False) is False


def test_check_type_names_the_type_given():
    check_type("cfg", 3, int, "an int")
    with pytest.raises(InvalidArgumentError, match=r"^cfg='str': expected a config$"):
        check_type("cfg", "x", (int, float), "a config")

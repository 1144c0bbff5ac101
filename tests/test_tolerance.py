"""Default tolerances by dtype (tolerance.py): what verify, export and ``map`` count as equal
when no --atol/--rtol is given. How compare applies them (atol AND rtol) is in test_compare.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fusectl.tolerance import DEFAULT_TOLERANCES, FP8_TOLERANCE, default_tolerance


@pytest.mark.parametrize("dtype, expected", [
    (np.float64, (1e-5, 1e-5)), (np.float32, (1e-5, 1e-5)), (np.float16, (1e-3, 1e-3)),
    (ml_dtypes.bfloat16, (1e-2, 1e-2)),
    (ml_dtypes.float8_e4m3fn, (1e-1, 1e-1)), (ml_dtypes.float8_e5m2, (1e-1, 1e-1)),
    (ml_dtypes.float8_e4m3fnuz, (1e-1, 1e-1)), (ml_dtypes.float8_e5m2fnuz, (1e-1, 1e-1)),
])
def test_each_float_dtype_has_its_tolerance(dtype, expected):
    assert default_tolerance(dtype) == expected


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8, np.uint64, np.bool_])
def test_integers_and_bools_must_match_exactly(dtype):
    assert default_tolerance(dtype) == (0.0, 0.0)


def test_a_dtype_can_be_named_or_given_as_an_array_dtype():
    assert default_tolerance("float16") == default_tolerance(np.zeros(1, np.float16).dtype) == (1e-3, 1e-3)


def test_wider_floats_are_held_tighter():
    order = ["float32", "float16", "bfloat16"]
    atols = [DEFAULT_TOLERANCES[n][0] for n in order] + [FP8_TOLERANCE[0]]
    assert atols == sorted(atols) and len(set(atols)) == len(atols)


def test_each_tolerance_covers_one_rounding_of_its_dtype_near_one():
    """A value rounded once to the dtype lies within its default tolerance of the exact one."""
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
        atol, rtol = default_tolerance(dtype)
        exact = np.float64(1) / 3 + 1
        rounded = np.float64(np.array(exact).astype(dtype))
        assert abs(rounded - exact) <= atol + rtol * abs(exact), dtype

"""The error metric (core/metric.py) against values worked out by hand."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from amp_rewrite.core.metric import (ZERO_SCALE, difference, peak_magnitude, relative_error,
                                     worst_relative_error)

nan, inf = math.nan, math.inf


def test_error_is_the_largest_difference_over_the_largest_reference_magnitude():
    # |diff| = 0.5, 0, 1; max|ref| = 4
    d = difference([1.0, -2.0, 4.0], [1.5, -2.0, 3.0])
    assert (d.max_abs, d.max_rel, d.new_nonfinite) == (1.0, 0.25, False)
    assert d.error == 0.25


def test_an_all_zero_reference_divides_by_the_documented_epsilon():
    assert relative_error([0.0, 0.0], [0.0, 0.0]) == 0.0
    assert relative_error([0.0, 0.0], [0.0, 1e-3]) == pytest.approx(1e-3 / 1e-30)
    assert ZERO_SCALE == 1e-30


def test_nan_or_inf_the_reference_has_at_the_same_place_is_not_an_error():
    # the NaN position is left out: |diff| = 0.1 at 1.0, max|ref| over finite = 2
    assert relative_error([1.0, nan, 2.0], [1.1, nan, 2.0]) == pytest.approx(0.05)
    assert relative_error([1.0, inf, -inf], [1.0, inf, -inf]) == 0.0
    # where FP32 itself is not finite, nothing is known: whatever the low run gives
    assert relative_error([2.0, inf], [2.0, 5.0]) == 0.0


def test_a_new_nan_or_inf_is_infinite():
    d = difference([1.0, 2.0], [1.0, inf])
    assert d.new_nonfinite and d.max_abs == 0.0 and d.error == inf
    assert relative_error([1.0, 2.0], [nan, 2.0]) == inf
    assert relative_error([0.0], [-inf]) == inf


def test_worst_over_several_outputs():
    references = [np.array([1.0, 2.0]), np.array([10.0, 0.0])]
    got = [np.array([1.0, 2.5]), np.array([10.0, 1.0])]
    # 0.5 / 2 = 0.25 and 1 / 10 = 0.1
    assert worst_relative_error(references, got) == 0.25
    assert worst_relative_error(references, [got[0], np.array([10.0, inf])]) == inf
    assert worst_relative_error(references, got[:1]) == inf  # an output went missing
    assert worst_relative_error([], []) == 0.0


def test_changed_shapes_and_non_float_outputs():
    assert relative_error(np.ones((2, 3)), np.ones((3, 2))) == inf
    assert relative_error(np.array([1, 2]), np.array([1, 2])) == 0.0
    assert relative_error(np.array([1, 2]), np.array([1, 3])) == inf


def test_low_precision_outputs_are_compared_as_floats():
    ref = np.array([1.0, 3.0, 4.0], np.float32)
    assert relative_error(ref, ref.astype(ml_dtypes.bfloat16)) == 0.0
    # 1/3 in float16 is 0.333251953125: |diff| = 8.138e-5, over max|ref| = 1
    third = np.array([1 / 3, 1.0], np.float32)
    assert relative_error(third, third.astype(np.float16)) == pytest.approx(
        abs(0.333251953125 - float(np.float32(1 / 3))), rel=1e-6)


def test_peak_magnitude_leaves_out_non_finite_values_and_the_sentinel():
    f32max = float(np.finfo(np.float32).max)
    assert peak_magnitude([np.array([1.0, -5.0, inf, nan])]) == 5.0
    assert peak_magnitude([np.array([-f32max, 7.0])]) == f32max
    assert peak_magnitude([np.array([-f32max, 7.0])], sentinel=f32max) == 7.0
    assert peak_magnitude([np.array([1, 900])]) == 0.0  # integers carry no range risk
    assert peak_magnitude([]) == 0.0

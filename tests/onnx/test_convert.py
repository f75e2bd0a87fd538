"""Weight conversion through onnxruntime's Cast gives numpy's float16 bits exactly."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from amp_rewrite.onnx import convert


def _awkward_floats(n: int) -> np.ndarray:
    """Random values of every magnitude plus the edge cases of fp16 rounding."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal(n).astype(np.float32) * np.float32(2.0) ** rng.integers(
        -30, 20, n).astype(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.99, 65520.0, -65520.0,
                      6.0e-8, 2.98e-8, 2.99e-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1e30],
                     dtype=np.float32)
    values[:len(edges)] = edges
    return values


@pytest.mark.parametrize("shape", [(20,), (1 << 17,), (256, 1024)])
def test_to_float16_has_numpy_bits(shape):
    array = _awkward_floats(int(np.prod(shape))).reshape(shape)
    with np.errstate(over="ignore"):
        want = array.astype(np.float16)
    got, overflowed = convert.to_float16(array)
    assert got.shape == shape and got.dtype == np.float16
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert overflowed == bool(np.isinf(want).any())
    in_range = np.where(np.abs(array) < 65504, array, np.float32(np.nan))  # NaN is no inf
    assert not convert.to_float16(in_range)[1]


def test_to_float16_of_a_strided_view():
    array = _awkward_floats(1 << 18).reshape(512, 512)[:, ::2]
    with np.errstate(over="ignore"):
        want = array.astype(np.float16)
    assert np.array_equal(convert.to_float16(array)[0].view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_has_inf_reads_the_bits(dtype):
    finite = np.array([0.0, -1.5, 3e4, np.nan], dtype=np.float32).astype(dtype)
    assert not convert.has_inf(finite)
    for inf in (np.inf, -np.inf):
        assert convert.has_inf(np.append(finite, np.float32(inf).astype(dtype)))

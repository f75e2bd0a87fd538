"""The error metric: how far a low-precision output is from the FP32 one.

One definition serves ``--validate``, the accuracy budget (``--max-error E``, ``max_error=``)
and its per-node estimate, on both paths (docs/design.md §5, decisions 0028 and 0035):

* per output: max|got − ref| / max|ref|, both maxima over the elements where the reference
  is finite. Relative to the output's scale, not element by element: values near zero would
  otherwise blow the ratio up;
* over outputs: the worst one;
* a NaN or Inf in ``got`` where the reference is finite makes the error infinite; a NaN or
  Inf the reference has itself is left out (it is not the low precision's doing);
* an all-zero (or all non-finite) reference has no scale: the difference is divided by
  ``ZERO_SCALE``, so an exact match is 0 and any other value an error beyond every budget;
* a changed shape, a changed number of outputs, or a non-float output that differs at all
  is infinite.

Framework-free: anything ``np.asarray`` takes (a torch caller passes
``t.detach().float().cpu().numpy()``). Computed in float64.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# The scale of an all-zero reference: tiny, so that any deviation from an exact zero is an
# error far above any budget, yet finite, so that ``--validate`` reports a number.
ZERO_SCALE = 1e-30


@dataclass(frozen=True)
class Difference:
    """One output pair compared."""

    max_abs: float  # max|got − ref| where both are finite
    max_rel: float  # max_abs / max|ref| (module docstring)
    new_nonfinite: bool  # NaN/Inf in ``got`` where the reference is finite

    @property
    def error(self) -> float:
        """The metric: ``max_rel``, infinite with a new NaN/Inf."""
        return math.inf if self.new_nonfinite else self.max_rel


_CHANGED = Difference(math.inf, math.inf, False)


def difference(reference: object, got: object) -> Difference:
    """``got`` against ``reference`` (module docstring)."""
    ref, out = np.asarray(reference), np.asarray(got)
    if ref.shape != out.shape:
        return _CHANGED
    if not _is_float(ref.dtype):
        return Difference(0.0, 0.0, False) if np.array_equal(ref, out) else _CHANGED
    ref64, out64 = ref.astype(np.float64), out.astype(np.float64)
    finite = np.isfinite(ref64)
    out_finite = np.isfinite(out64)
    new_nonfinite = bool((finite & ~out_finite).any())
    both = finite & out_finite
    diff = np.abs(ref64[both] - out64[both])
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(ref64[finite]).max()) if finite.any() else 0.0
    return Difference(max_abs, max_abs / max(scale, ZERO_SCALE), new_nonfinite)


def relative_error(reference: object, got: object) -> float:
    """The metric of one output pair."""
    return difference(reference, got).error


def worst_relative_error(references: Sequence, got: Sequence) -> float:
    """The metric over outputs in order: the worst pair; infinite when the counts differ,
    0 with no outputs."""
    if len(references) != len(got):
        return math.inf
    return max((relative_error(r, g) for r, g in zip(references, got)), default=0.0)


def peak_magnitude(arrays: Sequence, sentinel: float | None = None) -> float:
    """The largest finite |x| of the float ``arrays`` (0 with none); with ``sentinel``,
    magnitudes at or above it are left out (a mask's ±float32-max that the adapter gives
    the low dtype's own extreme)."""
    top = 0.0
    for a in arrays:
        a = np.asarray(a)
        if not a.size or not _is_float(a.dtype):
            continue
        magnitude = np.abs(a.astype(np.float64, copy=False))
        keep = np.isfinite(magnitude)
        if sentinel is not None:
            keep &= magnitude < sentinel
        if keep.any():
            top = max(top, float(magnitude[keep].max()))
    return top


def _is_float(dtype: np.dtype) -> bool:
    # ml_dtypes' bfloat16 and float8 types are not np.floating subtypes
    return np.issubdtype(dtype, np.floating) or dtype.name.startswith(("bfloat", "float"))

"""Calibration keeps hot activations finite: zoo T5 and Llama exports whose FFN intermediates
reach 3e5 (beyond fp16) rewrite to outputs within 1e-2 of FP32, under onnxruntime and
onnx.reference (true fp16 rounding), with and without ``clamp_constants``.
"""
from __future__ import annotations

import onnx
import pytest

pytestmark = pytest.mark.slow  # exports zoo models


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_hot_ffn_activations_with_calibration_are_finite_and_close(name):
    from tests.models import hot
    from amp_rewrite.onnx import rewrite_onnx_model, validate

    path, feeds = hot.cached_hot_onnx(name, 3e5)
    fp32 = onnx.load(path)
    maxima = validate.value_maxima(fp32, feeds)
    assert 2e5 < max(v for v in maxima.values() if v < 1e38) < 4e5  # hot, as trained T5s
    expected = validate.run(fp32, feeds)
    # clamp_constants: constants are stored as before, so calibration alone must hold.
    for clamp in (False, True):
        result = rewrite_onnx_model(path, calibration_data=feeds, clamp_constants=clamp)
        mixed = result.proto()
        for run in (validate.run, validate.reference_run):  # ORT, then true fp16 rounding
            for e in validate.compare(expected, run(mixed, feeds)):
                assert not e.new_nonfinite and e.max_rel < 1e-2, (clamp, run.__name__, e)
    # The reader of a hot FFN intermediate (the down-projection) is what calibration missed
    # (without clamping, its tiny compensating weights keep it fp32 on their own account).
    readers = [r for r in result.report["nodes"]
               if r["op_type"] == "MatMul" and "(its input)" in r["reason"]]
    assert readers and all(r["precision"] == "high" for r in readers)

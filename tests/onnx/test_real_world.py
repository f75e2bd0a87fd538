"""Models users really have (issue 17): trained constants beyond the fp16 range, hot
activations under calibration, models the checker rejects but runtimes run, IR versions the
installed onnxruntime loads, bf16 on old opsets, control flow, opset-27 Scan bodies.

Every rewritten model is compared with its FP32 original (or the test case's expected
outputs) under onnx.reference, which computes each op in its declared dtype, and under
onnxruntime where it can load the model.
"""
from __future__ import annotations

import importlib

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

from amp_rewrite.onnx import rewrite_onnx


def rel_error(expected: np.ndarray, got: np.ndarray) -> float:
    expected, got = np.asarray(expected, np.float64), np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "NaN/Inf where FP32 had none"
    return float(np.abs(expected - got).max() / max(np.abs(expected).max(), 1e-12))


def linear_attention_cases() -> list:
    """onnx's LinearAttention node tests (opset 27), expanded to Scan bodies.

    Collecting all node tests takes 13 s; importing the one module registers its cases in a
    second (``_TargetOpType`` is how ``collect_testcases`` filters, a module global).
    """
    node_cases = importlib.import_module("onnx.backend.test.case.node")
    saved, node_cases._TargetOpType = node_cases._TargetOpType, "LinearAttention"
    try:  # a no-op where an earlier collect_testcases() imported it already
        importlib.import_module("onnx.backend.test.case.node.linear_attention")
    finally:
        node_cases._TargetOpType = saved
    cases = [c for c in node_cases._NodeTestCases if c.name.startswith("test_linear_attention")]
    return [c for c in cases if c.name.endswith("_expanded")]


def test_opset27_scan_bodies_with_untyped_inputs_pass_our_output_check():
    cases = linear_attention_cases()
    assert len(cases) >= 10
    for case in cases:
        onnx.checker.check_model(case.model, full_check=True)  # the input is valid
        mixed = rewrite_onnx(case.model)  # raised "B has inconsistent type" before
        onnx.checker.check_model(mixed, full_check=True)
        inputs, expected = case.data_sets[0]
        names = [i.name for i in case.model.graph.input]
        got = ReferenceEvaluator(mixed).run(None, dict(zip(names, inputs)))
        for e, g in zip(expected, got):
            assert rel_error(e, g) < 1e-2, case.name

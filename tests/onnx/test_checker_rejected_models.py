"""Models the checker rejects but runtimes run, and IR versions the installed onnxruntime loads.

Untyped graph outputs, branch outputs and opset-27 Scan bodies are typed and rewritten; the
output is held to the check its input passed; an IR version newer than onnxruntime loads is
written at the lowest one the opsets allow. Every rewritten model is compared with its FP32
original (or the test case's expected outputs) under onnx.reference, which computes each op
in its declared dtype, and under onnxruntime where it can load the model.
"""
from __future__ import annotations

import importlib

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

from amp_rewrite.onnx import rewrite_onnx

from ._helpers import if_model, ort_run, rel_error


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


def test_untyped_graph_outputs_that_ort_runs_are_typed_and_rewritten():
    fp32 = if_model()
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(fp32)
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    mixed = rewrite_onnx(fp32)  # refused as an invalid model before
    onnx.checker.check_model(mixed, full_check=True)
    assert mixed.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert "MatMul" in [n.op_type for a in mixed.graph.node[-2].attribute for n in a.g.node]
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        (expected,) = ort_run(fp32, feeds)
        for got in (ort_run(mixed, feeds)[0], ReferenceEvaluator(mixed).run(None, feeds)[0]):
            assert rel_error(expected, got) < 1e-2


def test_output_is_checked_as_strictly_as_the_input_passed(monkeypatch, caplog):
    from onnx import helper as h

    calls = []
    real_check = onnx.checker.check_model

    def spy(model, full_check=False, **kw):
        calls.append(full_check)
        return real_check(model, full_check=full_check, **kw)

    monkeypatch.setattr(onnx.checker, "check_model", spy)
    valid = if_model(h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8]))
    rewrite_onnx(valid)
    assert True in calls  # the output got the full check the input passes
    # A value_info contradicting the real type fails only the full check (ORT ignores it):
    # the output is held to the plain check the input passed, and the user is told.
    contradicting = if_model(h.make_tensor_value_info("y", onnx.TensorProto.INT64, [2, 8]))
    with pytest.raises(Exception):
        real_check(contradicting, full_check=True)
    calls.clear()
    rewrite_onnx(contradicting)
    assert calls[-2:] == [True, False]  # full check failed as the input's does; plain passed
    assert "fails the full ONNX check as the input does" in caplog.text


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_ir14_from_make_model_is_written_at_the_lowest_ir_ort_loads(tmp_path, dtype):
    from amp_rewrite.cli import main

    fp32 = if_model(onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8]),
                    ir_version=onnx.IR_VERSION, opset=21)
    assert fp32.ir_version == 14  # what onnx 1.23's make_model writes; ORT 1.31 refuses it
    src, out = tmp_path / "m.onnx", tmp_path / "m.amp.onnx"
    onnx.save(fp32, src)
    assert main([str(src), "-o", str(out), "--dtype", dtype, "--validate", "-q"]) == 0
    mixed = onnx.load(out)
    assert mixed.ir_version == onnx.helper.find_min_ir_version_for(list(fp32.opset_import)) == 10
    feeds = {"x": np.ones((2, 8), np.float32), "c": np.array(True)}
    fp32.ir_version = 10
    assert rel_error(ort_run(fp32, feeds)[0], ReferenceEvaluator(mixed).run(None, feeds)[0]) < (
        1e-2 if dtype == "fp16" else 5e-2)
    if dtype == "fp16":  # ORT-CPU has no bf16 MatMul kernel
        assert rel_error(ort_run(fp32, feeds)[0], ort_run(mixed, feeds)[0]) < 1e-2

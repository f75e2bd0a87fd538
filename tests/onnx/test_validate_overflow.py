"""``--validate`` measures what a GPU computes: every op rounding its outputs to its dtype.

onnxruntime's CPU provider runs many float16 ops in float32 and folds the cast pairs around
them, so a float16 overflow can pass its comparison. The per-op run (onnx.reference) finds the
low-precision nodes whose outputs turn inf/NaN where the FP32 model's are finite; one that
reaches a graph output fails validation (exit 4) naming the node and a fix. The oracle is the
FP32 model's own values.
"""
from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from amp_rewrite.core import LowDtype
from amp_rewrite.onnx import validate

from ._helpers import T, rewritten, save
from .test_cli import digest, run_cli

FP16_MAX = float(np.finfo(np.float16).max)


def conv_stack(gain: float, seed: int = 0) -> onnx.ModelProto:
    """Conv ×3 → Concat(all three) → Conv; each conv multiplies the activations' scale by
    about ``gain`` (1: normalised weights)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def conv(name: str, x: str, c_in: int, c_out: int = 8) -> str:
        w = rng.standard_normal((c_out, c_in, 3, 3)) * gain / np.sqrt(c_in * 9)
        inits.append(onh.from_array(w.astype(np.float32), f"{name}.w"))
        inits.append(onh.from_array(np.zeros(c_out, np.float32), f"{name}.b"))
        nodes.append(oh.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [f"{name}.y"],
                                  name=name, pads=[1, 1, 1, 1]))
        return f"{name}.y"

    a = conv("conv1", "x", 3)
    b = conv("conv2", a, 8)
    c = conv("conv3", b, 8)
    nodes.append(oh.make_node("Concat", [a, b, c], ["cat"], name="concat", axis=1))
    conv("conv4", "cat", 24)
    graph = oh.make_graph(nodes, "conv_stack",
                          [oh.make_tensor_value_info("x", T.FLOAT, [1, 3, 16, 16])],
                          [oh.make_tensor_value_info("conv4.y", T.FLOAT, [1, 8, 16, 16])],
                          inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def hot_stack() -> onnx.ModelProto:
    model = conv_stack(gain=100.0)
    typed = onnx.shape_inference.infer_shapes(model)  # value_maxima reads typed values
    maxima = validate.value_maxima(typed, validate.random_feeds(model))
    # the premise: conv3 leaves the float16 range, the graph output is finite in FP32
    assert maxima["conv2.y"] < FP16_MAX < maxima["conv3.y"] < 1e38
    return model


def test_onnxruntime_alone_misses_the_overflow(hot_stack):
    """The comparison --validate used to make passes this model."""
    errors, tolerance = validate.validate(hot_stack, rewritten(hot_stack), LowDtype.FLOAT16)
    assert all(e.ok(tolerance) for e in errors)


def test_overflowing_conv_fails_validation_and_is_named(hot_stack, tmp_path, capsys):
    src = save(tmp_path, hot_stack)
    before = digest(src)
    report = tmp_path / "r.json"
    code, out, err = run_cli([src, "--validate", "--report", report], capsys)
    assert code == 4, err
    assert err.count("\n") == 1, err
    assert err.startswith("amp-rewrite: error: float16 overflow at Conv 'conv3'"), err
    assert "'conv4.y'" in err and "--calibrate" in err and "--keep-fp32 conv3" in err
    assert "NaN/Inf!" in out
    assert not list(tmp_path.glob("*.amp.onnx")) and digest(src) == before
    written = json.loads(report.read_text())
    assert written["output"] is None
    assert [o["node"] for o in written["validation_overflows"]] == ["conv3"]
    assert written["validation_overflows"][0]["fp32_max"] > FP16_MAX
    assert written["validation"][0]["new_nonfinite"] is True


def test_normalised_weights_pass(tmp_path, capsys):
    src = save(tmp_path, conv_stack(gain=1.0))
    code, out, err = run_cli([src, "--validate"], capsys)
    assert code == 0, err
    assert "NaN/Inf" not in out and (tmp_path / "m.amp.onnx").exists()


def test_calibration_data_fixes_what_validation_found(hot_stack, tmp_path, capsys):
    """The fix the message gives first: calibration keeps the hot convs fp32."""
    src = save(tmp_path, hot_stack)
    data = tmp_path / "x.npz"
    np.savez(data, **validate.random_feeds(hot_stack))
    code, _, err = run_cli([src, "--validate", "--calibrate", data, "-q"], capsys)
    assert code == 0, err


def test_a_kept_node_too_large_for_its_low_readers_names_the_readers(hot_stack):
    """conv3 kept fp32: its output still overflows in the cast the rewrite inserts for the
    float16 Concat, which is the node to keep fp32 next."""
    mixed = rewritten(hot_stack, keep_fp32=["conv3"])
    result = validate.validate_rewrite(hot_stack, mixed, LowDtype.FLOAT16)
    assert not result.ok()
    (overflow,) = result.overflows
    assert (overflow.op_type, overflow.value, overflow.readers) == ("Cast", "conv3.y",
                                                                      ("concat",))
    assert "--keep-fp32 concat" in result.overflow_fix()


def test_inf_of_the_fp32_model_itself_is_not_an_overflow():
    """x / d with zeros in d: inf in FP32 already, and through the float16 MatMul after it."""
    d = np.ones(8, np.float32)
    d[::3] = 0.0
    graph = oh.make_graph(
        [oh.make_node("Div", ["x", "d"], ["q"], name="div"),
         oh.make_node("MatMul", ["q", "w"], ["h"], name="mm"),
         oh.make_node("Relu", ["h"], ["y"], name="relu")], "g",
        [oh.make_tensor_value_info("x", T.FLOAT, [2, 8])],
        [oh.make_tensor_value_info("y", T.FLOAT, [2, 4])],
        [onh.from_array(d, "d"),
         onh.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")])
    fp32 = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    feeds = validate.random_feeds(fp32)
    assert not np.isfinite(validate.run(fp32, feeds)["y"]).all()  # the premise
    mixed = rewritten(fp32)
    low = validate._per_op_run(mixed, feeds)
    assert "h" in low.low and "h" in low.nonfinite  # the premise: inf in the float16 MatMul
    result = validate.validate_rewrite(fp32, mixed, LowDtype.FLOAT16, feeds)
    assert result.ok() and not result.overflows, result


def _masked_softmax(mask_value: float) -> onnx.ModelProto:
    """softmax(x·w + mask): the mask's large negative entries push masked scores past the
    float16 range (-inf), which the softmax turns into the same zeros as in FP32."""
    mask = np.zeros((1, 8), np.float32)
    mask[0, 5:] = mask_value
    w = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32) * 10
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w"], ["s"], name="scores"),
         oh.make_node("Add", ["s", "mask"], ["m"], name="masked"),
         oh.make_node("Softmax", ["m"], ["y"], name="softmax", axis=-1)], "g",
        [oh.make_tensor_value_info("x", T.FLOAT, [4, 8])],
        [oh.make_tensor_value_info("y", T.FLOAT, [4, 8])],
        [onh.from_array(w, "w"), onh.from_array(mask, "mask")])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def test_an_overflow_the_graph_absorbs_does_not_fail():
    fp32 = _masked_softmax(-FP16_MAX)
    mixed = rewritten(fp32)
    feeds = validate.random_feeds(fp32)
    low = validate._per_op_run(mixed, feeds)
    assert "m" in low.low and "m" in low.nonfinite  # the premise: -inf in the float16 Add
    result = validate.validate_rewrite(fp32, mixed, LowDtype.FLOAT16, feeds)
    assert result.ok() and not result.overflows, result


def test_bfloat16_validation_runs_the_reference_evaluator_once(monkeypatch):
    """onnxruntime has no bfloat16 CPU kernels: the per-op run is also the compared run."""
    fp32 = conv_stack(gain=1.0)
    mixed = rewritten(fp32, dtype="bf16")
    calls = []
    real = validate.reference_evaluator
    monkeypatch.setattr(validate, "reference_evaluator",
                        lambda model: calls.append(model) or real(model))
    result = validate.validate_rewrite(fp32, mixed, LowDtype.BFLOAT16)
    assert result.ok(), result
    assert len(calls) == 1


def test_a_model_onnx_reference_cannot_run_is_compared_in_onnxruntime(caplog):
    """com.microsoft::FusedMatMul has no onnx.reference kernel: the overflow check is skipped
    with a warning, onnxruntime's comparison still decides."""
    w = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    graph = oh.make_graph(
        [oh.make_node("FusedMatMul", ["x", "w"], ["h"], name="fmm", domain="com.microsoft",
                      alpha=0.5),
         oh.make_node("MatMul", ["h", "w"], ["y"], name="mm")], "g",
        [oh.make_tensor_value_info("x", T.FLOAT, [2, 8])],
        [oh.make_tensor_value_info("y", T.FLOAT, [2, 8])], [onh.from_array(w, "w")])
    fp32 = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17),
                                               oh.make_opsetid("com.microsoft", 1)])
    mixed = rewritten(fp32)
    with caplog.at_level(logging.WARNING, logger="amp_rewrite.onnx.validate"):
        result = validate.validate_rewrite(fp32, mixed, LowDtype.FLOAT16)
    assert result.ok() and result.per_op_skipped and "FusedMatMul" in result.per_op_skipped
    assert "onnxruntime's outputs only" in caplog.text


def test_value_maxima_sees_the_values_of_a_model_exported_without_types():
    """paddle2onnx and older exporters write no value_info: the intermediate value is still
    measured (max |x| by hand: (-2.5)² = 6.25)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "x"], ["h"]), helper.make_node("Neg", ["h"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    maxima = validate.value_maxima(model, {"x": np.array([2.0, -2.5], np.float32)})
    assert maxima == {"y": 6.25, "h": 6.25}

"""Constants beyond the low dtype's range: their readers stay fp32 unless clamping is asked for.

Trained BatchNorm variances above fp16's maximum, weights that underflow it, tiny biases that
are only added, finfo(float32).min mask sentinels, and the ``--clamp-constants`` option that
clamps and counts. Oracle: the FP32 model under onnxruntime and onnx.reference (each op in
its declared dtype).
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx_ir as ir
from onnx.reference import ReferenceEvaluator

from amp_rewrite.onnx import rewrite_onnx, rewrite_onnx_model

from .conftest import parse
from ._helpers import conv_bn_model, ort_run, rel_error, with_weights


def test_clamp_constants_option_clamps_and_counts(rng):
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, 8] x, bool[2, 8] keep) => (float[2, 8] y) <float[8, 8] w, float big> {
        h = MatMul(x, w)
        m = Where(keep, h, big)
        y = MatMul(m, w)
    }""")
    fp32 = with_weights(model, rng)
    big = next(i for i in fp32.graph.initializer if i.name == "big")
    big.CopyFrom(onnx.numpy_helper.from_array(np.array(-3.4e38, np.float32), "big"))
    with warnings.catch_warnings():  # the overflow is counted, not warned about
        warnings.simplefilter("error", RuntimeWarning)
        result = rewrite_onnx_model(fp32, clamp_constants=True)
    assert result.report["values_clamped"] == 1 and result.report["clamped_constants"] == ["big"]
    mixed = ir.to_proto(result.model)
    big16 = next(i for i in mixed.graph.initializer if i.name == "big")
    assert onnx.numpy_helper.to_array(big16) == np.float16(-65504)


def test_batchnorm_variance_beyond_fp16_range_keeps_bn_fp32_not_clamped(rng):
    from amp_rewrite.onnx import rewrite_onnx_model

    fp32 = conv_bn_model(10 ** rng.uniform(7, 8, 8), rng)
    feeds = {"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)}
    (expected,) = ort_run(fp32, feeds)
    result = rewrite_onnx_model(fp32)
    mixed = result.proto()
    report = result.report
    assert report["values_clamped"] == 0
    assert any(k.startswith("var (values up to") for k in report["constants_kept_fp32"])
    assert "reads var" in " ".join(result.explain("bn"))  # the reason, for --explain
    assert [n.op_type for n in mixed.graph.node].count("Conv") == 2
    var = next(i for i in mixed.graph.initializer if i.name == "var")
    assert var.data_type == onnx.TensorProto.FLOAT
    for got in (ort_run(mixed, feeds)[0], ReferenceEvaluator(mixed).run(None, feeds)[0]):
        assert rel_error(expected, got) < 1e-2
    # The explicit option still clamps, and that is what made the output useless.
    clamped = rewrite_onnx(fp32, clamp_constants=True)
    assert rel_error(expected, ReferenceEvaluator(clamped).run(None, feeds)[0]) > 0.5


def test_constants_whose_significant_values_underflow_fp16_keep_readers_fp32(rng):
    from onnx import TensorProto as T
    from onnx import helper as h

    # A weight trained (or folded) to ~1e-8: fp16 flushes every entry to zero.
    w = (rng.standard_normal((8, 8)) * 1e-8).astype(np.float32)
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "w"], ["y"], name="tiny")], "g",
        [h.make_tensor_value_info("x", T.FLOAT, [2, 8])],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 8])], [onnx.numpy_helper.from_array(w, "w")])
    fp32 = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    fp32.ir_version = 8
    feeds = {"x": rng.standard_normal((2, 8)).astype(np.float32)}
    mixed = rewrite_onnx(fp32)
    assert [n.op_type for n in mixed.graph.node] == ["MatMul"]  # kept fp32: nothing to cast
    (expected,) = ort_run(fp32, feeds)
    assert rel_error(expected, ReferenceEvaluator(mixed).run(None, feeds)[0]) < 1e-3
    flushed = rewrite_onnx(fp32, clamp_constants=True)  # the old conversion: all zeros
    assert np.abs(ReferenceEvaluator(flushed).run(None, feeds)[0]).max() == 0


def test_tiny_conv_bias_that_underflows_fp16_runs_low_since_it_is_only_added(rng):
    from onnx import TensorProto as T
    from onnx import helper as h

    # Folded-BatchNorm biases of 1e-10..1e-6 (MobileNetV2's zoo export): a bias is only
    # added, so its underflow moves the fp16 sum by at most 2**-25, within the sum's own
    # rounding. The tiny *weight* beside it still keeps its reader fp32.
    w = (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    b = (10.0 ** rng.uniform(-10, -6, 8)).astype(np.float32)
    tiny_w = (rng.standard_normal((8, 8, 1, 1)) * 1e-8).astype(np.float32)
    inits = [onnx.numpy_helper.from_array(a, n) for a, n in ((w, "w"), (b, "b"), (tiny_w, "tw"))]
    graph = h.make_graph(
        [h.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         h.make_node("Relu", ["c"], ["r"], name="relu"),
         h.make_node("Conv", ["r", "tw"], ["y"], name="tiny_conv")], "g",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 3, 8, 8])],
        [h.make_tensor_value_info("r", T.FLOAT, [1, 8, 8, 8]),
         h.make_tensor_value_info("y", T.FLOAT, [1, 8, 8, 8])], inits)
    fp32 = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    fp32.ir_version = 8
    mixed = rewrite_onnx(fp32)
    stored = {i.name: i.data_type for i in mixed.graph.initializer}
    assert stored["w"] == stored["b"] == T.FLOAT16  # the conv and its bias run low
    assert stored["tw"] == T.FLOAT  # a tiny weight is multiplied: kept fp32 with its reader
    feeds = {"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}
    expected = ort_run(fp32, feeds)
    for got in (ort_run(mixed, feeds), ReferenceEvaluator(mixed).run(None, feeds)):
        assert rel_error(expected[0], got[0]) < 2e-3
        assert rel_error(expected[1], got[1]) < 2e-3


def test_cli_opset_and_clamp_constants_flags(rng, tmp_path):
    import json

    from amp_rewrite.cli import main

    src, out, report = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "r.json"
    onnx.save(conv_bn_model(10 ** rng.uniform(7, 8, 8), rng, opset=13), src)
    assert main([str(src), "-o", str(out), "--report", str(report), "-q"]) == 0
    assert json.loads(report.read_text())["values_clamped"] == 0  # default: no clamp
    assert main([str(src), "-o", str(out), "--report", str(report), "-q", "--clamp-constants",
                 "--opset", "22", "--dtype", "bf16"]) == 0
    assert onnx.load(out).opset_import[0].version == 22
    # bf16 holds 1e8, so nothing is clamped even when asked; fp16 clamps the variance
    assert json.loads(report.read_text())["values_clamped"] == 0
    assert main([str(src), "-o", str(out), "--report", str(report), "-q",
                 "--clamp-constants"]) == 0
    assert json.loads(report.read_text())["values_clamped"] == 8


def test_float32_extreme_mask_sentinel_maps_to_the_low_extreme_and_stays_low():
    """HF exports write finfo(float32).min for masked positions: a sentinel for -inf, not a
    value that needs fp32. It is stored as fp16's -65504 (softmax weight still 0) and its
    readers run low; a real out-of-range value beside it keeps the old fp32 decision."""
    from onnx import helper as oh
    from onnx import numpy_helper as onh

    from amp_rewrite.onnx import validate

    lowest = np.finfo(np.float32).min
    mask = np.where(np.triu(np.ones((4, 4), bool), 1), lowest, 0).astype(np.float32)
    nodes = [oh.make_node("MatMul", ["x", "w"], ["s"]),
             oh.make_node("Add", ["s", "mask"], ["m"]),
             oh.make_node("Softmax", ["m"], ["y"], axis=-1)]
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 4])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 4])],
        [onh.from_array(np.eye(4, dtype=np.float32), "w"), onh.from_array(mask, "mask")])
    fp32 = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    fp32.ir_version = 8
    result = rewrite_onnx_model(fp32)
    assert result.report["constants_kept_fp32"] == []
    assert result.report["values_clamped"] == 0
    add = next(n for n in result.report["nodes"] if n["op_type"] == "Add")
    assert add["precision"] == "low"
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)}
    expected = validate.run(fp32, feeds)
    out = result.proto()
    for run in (validate.run, validate.reference_run):
        got = run(out, validate.as_declared(out, feeds))["y"].astype(np.float32)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected["y"], atol=2e-3)

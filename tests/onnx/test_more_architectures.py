"""Regressions from a sweep of transformers architectures outside the zoo (tiny random
weights, torch.onnx.export(dynamo=True) with dynamic batch/sequence axes).

EfficientNet's head is ``nn.AvgPool2d(hidden_dim, ceil_mode=True)``: a pooling kernel far
larger than the feature map, which exports as AveragePool(kernel 1280, ceil_mode=1).
onnxruntime and torch average the feature map; onnx.reference returned 0, so a bf16 rewrite
(validated in onnx.reference, ORT-CPU having no bf16 kernels) failed ``--validate`` with a
relative error of 1.0 although the model was right. The graphs here are built by hand in the
exported form so that each test runs in well under a second; expected values always come from
the FP32 model in onnxruntime.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx_ir as ir
import pytest
from onnx import TensorProto

from amp_rewrite.cli import main
from amp_rewrite.core import LowDtype
from amp_rewrite.onnx import rewrite_onnx_model, validate

from ._helpers import ort_run


def _pool_model(shape, elem=TensorProto.FLOAT, **attrs) -> onnx.ModelProto:
    node = oh.make_node("AveragePool", ["x"], ["y"], **attrs)
    graph = oh.make_graph([node], "pool", [oh.make_tensor_value_info("x", elem, shape)],
                          [oh.make_tensor_value_info("y", elem, None)])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 19)], ir_version=9)


POOLS = [
    # EfficientNet's head: kernel (and stride) far beyond a 2x2 map, ceil_mode
    ((2, 3, 2, 2), dict(kernel_shape=[320, 320], strides=[320, 320], ceil_mode=1,
                        count_include_pad=1, pads=[0, 0, 0, 0])),
    ((2, 3, 2, 3), dict(kernel_shape=[4, 4], strides=[4, 4], ceil_mode=1, count_include_pad=0)),
    # ceil_mode windows running past the padding, both divisor conventions
    ((1, 2, 5, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1,
                        count_include_pad=1)),
    ((1, 2, 5, 7), dict(kernel_shape=[3, 2], strides=[2, 3], pads=[1, 0, 0, 1], ceil_mode=1,
                        count_include_pad=0)),
    ((1, 2, 8, 6), dict(kernel_shape=[3, 3], strides=[2, 1], dilations=[2, 1], ceil_mode=0)),
    ((1, 2, 7, 5), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER",
                        count_include_pad=1)),
    ((1, 2, 7, 5), dict(kernel_shape=[2, 3], strides=[2, 2], auto_pad="SAME_LOWER")),
    ((2, 3, 9), dict(kernel_shape=[4], strides=[3], ceil_mode=1, pads=[2, 1],
                     count_include_pad=1)),                                     # 1-D
    ((1, 2, 3, 4, 5), dict(kernel_shape=[2, 3, 9], strides=[2, 2, 9], ceil_mode=1)),  # 3-D
]


@pytest.mark.parametrize("shape, attrs", POOLS)
def test_reference_average_pool_matches_onnxruntime(shape, attrs):
    model = _pool_model(list(shape), **attrs)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    (want,) = ort_run(model, {"x": x})
    (got,) = validate.reference_evaluator(model).run(None, {"x": x})
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_reference_average_pool_of_oversized_kernel_is_the_mean():
    """torch's AvgPool2d(320, ceil_mode=True) on a 2x2 map is the map's mean, in its dtype."""
    for elem, dtype in ((TensorProto.FLOAT, np.float32), (TensorProto.FLOAT16, np.float16)):
        model = _pool_model([1, 2, 2, 2], elem, **POOLS[0][1])
        x = np.arange(8, dtype=dtype).reshape(1, 2, 2, 2) + 1
        (got,) = validate.reference_evaluator(model).run(None, {"x": x})
        assert got.dtype == dtype
        np.testing.assert_allclose(got.ravel(), [2.5, 6.5])


def _efficientnet_head(rng, hidden: int = 16, pool: int = 320) -> onnx.ModelProto:
    """Conv → BatchNorm → SiLU → AvgPool2d(pool, ceil_mode=True) → flatten → Linear, as
    EfficientNetForImageClassification exports it (dynamic batch)."""
    w = (rng.standard_normal((hidden, 3, 3, 3)) * 0.3).astype(np.float32)
    inits = [onh.from_array(w, "w"),
             onh.from_array((0.5 + rng.random(hidden)).astype(np.float32), "gamma"),
             onh.from_array((0.1 * rng.standard_normal(hidden)).astype(np.float32), "beta"),
             onh.from_array((0.1 * rng.standard_normal(hidden)).astype(np.float32), "mean"),
             onh.from_array((0.5 + rng.random(hidden)).astype(np.float32), "var"),
             onh.from_array((rng.standard_normal((5, hidden)) * 0.2).astype(np.float32), "fc"),
             onh.from_array(np.zeros(5, np.float32), "fc_b"),
             onh.from_array(np.array([0, -1], np.int64), "flat")]
    nodes = [
        oh.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], strides=[4, 4],
                     pads=[1, 1, 1, 1]),
        oh.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["bn"],
                     epsilon=1e-3),
        oh.make_node("Sigmoid", ["bn"], ["sig"]),
        oh.make_node("Mul", ["bn", "sig"], ["act"]),
        oh.make_node("AveragePool", ["act"], ["pooled"], kernel_shape=[pool, pool],
                     strides=[pool, pool], pads=[0, 0, 0, 0], ceil_mode=1, count_include_pad=1),
        oh.make_node("Reshape", ["pooled", "flat"], ["feat"]),
        oh.make_node("Gemm", ["feat", "fc", "fc_b"], ["logits"], transB=1),
    ]
    graph = oh.make_graph(
        nodes, "efficientnet_head",
        [oh.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [oh.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])], inits)
    graph.node[0].input[0] = "pixel_values"
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)], ir_version=9)
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("dtype, tolerance", [("fp16", 5e-2), ("bf16", 2.5e-1)])
def test_efficientnet_head_rewrites_and_validates(dtype, tolerance):
    rng = np.random.default_rng(0)
    fp32 = _efficientnet_head(rng)
    mixed = ir.to_proto(rewrite_onnx_model(fp32, dtype=dtype).model)
    for batch in (3, 1):  # the batch axis is symbolic
        feeds = {"pixel_values": rng.standard_normal((batch, 3, 8, 8)).astype(np.float32)}
        (want,) = ort_run(fp32, feeds)
        assert np.abs(want).max() > 1e-2  # a live head, not all zeros
        runs = [validate.reference_run(mixed, feeds)["logits"]]
        if dtype == "fp16":
            runs.append(ort_run(mixed, feeds)[0])
        for got in runs:
            assert got.shape == want.shape and np.isfinite(got).all()
            rel = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
            assert rel <= tolerance, rel
    errors, tol = validate.validate(fp32, mixed, LowDtype.parse(dtype))
    assert all(e.ok(tol) for e in errors), errors


def test_cli_validates_bf16_efficientnet_head(tmp_path, capsys):
    """The sweep's failure: exit 4 'rewritten outputs differ ... 1.0' on a correct model."""
    path = tmp_path / "head.onnx"
    onnx.save(_efficientnet_head(np.random.default_rng(1)), path)
    out = tmp_path / "head.bf16.onnx"
    code = main([str(path), "-o", str(out), "--dtype", "bf16", "--validate", "-q"])
    assert code == 0, capsys.readouterr().err
    assert out.exists()

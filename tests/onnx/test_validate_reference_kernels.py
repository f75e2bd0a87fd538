"""The standard GEMMs and normalisations of ``validate.reference_evaluator`` compute as a GPU
kernel does: low-precision inputs read as they are, arithmetic in float32, each output
rounded once (``reference_ops.FLOAT32_KERNELS``). The oracle is numpy in float64."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx.reference import ReferenceEvaluator

from amp_rewrite.onnx import validate

from ._helpers import BF16, F16, F32

LOW = {F16: np.float16, BF16: ml_dtypes.bfloat16}


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "g", inputs, outputs, list(inits))
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])


def _layer_norm(elem: int) -> onnx.ModelProto:
    """LayerNormalization with its Mean output omitted, then a Clip with its min omitted:
    the omitted output must not fill the omitted input."""
    scale = onh.from_array(np.ones(8, LOW[elem]), "s")
    high = onh.from_array(np.array(0.5, LOW[elem]), "hi")
    return _model([oh.make_node("LayerNormalization", ["x", "s"], ["y", "", "inv"]),
                   oh.make_node("Clip", ["y", "", "hi"], ["z"])],
                  [oh.make_tensor_value_info("x", elem, [2, 8])],
                  [oh.make_tensor_value_info("z", elem, [2, 8]),
                   oh.make_tensor_value_info("inv", F32, [2, 1])], [scale, high])


@pytest.mark.parametrize("elem", [F16, BF16])
def test_layer_norm_statistics_in_float32(elem):
    x = (np.random.default_rng(0).standard_normal((2, 8)) * 1000).astype(LOW[elem])
    z, inv = validate.reference_evaluator(_layer_norm(elem)).run(None, {"x": x})
    v = x.astype(np.float64)
    normalised = (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + 1e-5)
    assert z.dtype == LOW[elem] and inv.dtype == np.float32
    np.testing.assert_array_equal(z, np.minimum(normalised, 0.5).astype(LOW[elem]))
    np.testing.assert_allclose(inv, 1 / np.sqrt(v.var(-1, keepdims=True) + 1e-5), rtol=1e-6)


def test_onnx_reference_alone_overflows_the_float16_variance():
    """Why the kernel exists: (x - mean)² overflows float16 for |x - mean| > 256."""
    x = (np.random.default_rng(0).standard_normal((2, 8)) * 1000).astype(np.float16)
    model = _model([oh.make_node("LayerNormalization", ["x", "s"], ["y"])],
                   [oh.make_tensor_value_info("x", F16, [2, 8])],
                   [oh.make_tensor_value_info("y", F16, [2, 8])],
                   [onh.from_array(np.ones(8, np.float16), "s")])
    with np.errstate(all="ignore"):
        (plain,) = ReferenceEvaluator(model).run(None, {"x": x})
        (ours,) = validate.reference_evaluator(model).run(None, {"x": x})
    assert not plain.any() and np.abs(ours).max() > 1  # the variance was inf: y = 0


def _ulps(got: np.ndarray, want: np.ndarray) -> float:
    """|got - want| in units of the low dtype's spacing at want."""
    spacing = np.spacing(np.abs(want.astype(np.float32)).astype(got.dtype)).astype(np.float64)
    return float((np.abs(got.astype(np.float64) - want) / spacing).max())


@pytest.mark.parametrize("elem", [F16, BF16])
def test_gemms_accumulate_in_float32_and_round_once(elem):
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(s).astype(LOW[elem]) for s in ((4, 64), (64, 8)))
    c = rng.standard_normal(8).astype(LOW[elem])
    x, w = (rng.standard_normal(s).astype(LOW[elem]) for s in ((1, 4, 6, 6), (8, 4, 3, 3)))
    model = _model([oh.make_node("MatMul", ["a", "b"], ["mm"]),
                    oh.make_node("Gemm", ["a", "b", "c"], ["gemm"], alpha=2.0),
                    oh.make_node("Conv", ["x", "w"], ["conv"])],
                   [oh.make_tensor_value_info(n, elem, None) for n in "abcxw"],
                   [oh.make_tensor_value_info(n, elem, None) for n in ("mm", "gemm", "conv")])
    mm, gemm, conv = validate.reference_evaluator(model).run(
        None, {"a": a, "b": b, "c": c, "x": x, "w": w})
    a64, b64, c64 = (t.astype(np.float64) for t in (a, b, c))
    windows = np.lib.stride_tricks.sliding_window_view(x.astype(np.float64), (3, 3), (2, 3))
    want_conv = np.einsum("nchwij,kcij->nkhw", windows, w.astype(np.float64))
    for got, want in ((mm, a64 @ b64), (gemm, 2 * a64 @ b64 + c64), (conv, want_conv)):
        assert got.dtype == LOW[elem] and got.shape == want.shape
        assert _ulps(got, want) <= 1.0  # float32 sums, one rounding


def test_opset6_gemm_broadcast_attribute_is_accepted():
    rng = np.random.default_rng(2)
    a, b, c = (rng.standard_normal(s).astype(np.float16) for s in ((2, 4), (4, 3), (3,)))
    model = _model([oh.make_node("Gemm", ["a", "b", "c"], ["y"], broadcast=1)],
                   [oh.make_tensor_value_info(n, F16, None) for n in "abc"],
                   [oh.make_tensor_value_info("y", F16, None)], opset=6)
    (y,) = validate.reference_evaluator(model).run(None, {"a": a, "b": b, "c": c})
    want = a.astype(np.float64) @ b.astype(np.float64) + c.astype(np.float64)
    assert y.dtype == np.float16 and _ulps(y, want) <= 1.0


@pytest.mark.parametrize("op", ["RMSNormalization", "InstanceNormalization"])
def test_other_norms_keep_their_statistics_in_float32(op):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 3, 8)) * 1000).astype(np.float16)
    v = x.astype(np.float64)
    if op == "RMSNormalization":
        inits = [onh.from_array(np.ones(8, np.float16), "s")]
        want = v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-5)
    else:
        inits = [onh.from_array(np.ones(3, np.float16), "s"),
                 onh.from_array(np.zeros(3, np.float16), "b")]
        want = (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + 1e-5)
    model = _model([oh.make_node(op, ["x"] + [t.name for t in inits], ["y"])],
                   [oh.make_tensor_value_info("x", F16, [2, 3, 8])],
                   [oh.make_tensor_value_info("y", F16, [2, 3, 8])], inits, opset=23)
    (y,) = validate.reference_evaluator(model).run(None, {"x": x})
    assert y.dtype == np.float16 and _ulps(y, want) <= 1.0

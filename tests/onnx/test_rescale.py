"""``--dtype mixed`` rescales hot GEMM chains into fp16's range (onnx/rescale.py, the decision
in core/rescale.py): exactly, so the FP32 model computes the same, and the chain then runs
fp16 where it ran bf16.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.onnx import rewrite_onnx_model, validate
from amp_rewrite.onnx.rescale import rescale_hot_chains

F32 = TensorProto.FLOAT


def _weights():
    # W2 small: y stays within fp16 (an fp16 graph output past 65504 is no chain's matter)
    rng = np.random.default_rng(0)
    return (rng.standard_normal((8, 16)).astype(np.float32),
            (rng.standard_normal((16, 4)) * 0.01).astype(np.float32))


def chain_model(second_reader: bool = False) -> onnx.ModelProto:
    """x[4,8] → MatMul(W1) → h → Relu → r → MatMul(W2) → y; ``second_reader``: h is also
    returned through a Neg, so scaling the chain would change it."""
    w1, w2 = _weights()
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="up"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["y"], name="down")]
    outputs = [helper.make_tensor_value_info("y", F32, [4, 4])]
    if second_reader:
        nodes.append(helper.make_node("Neg", ["h"], ["n"], name="neg"))
        outputs.append(helper.make_tensor_value_info("n", F32, [4, 16]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F32, [4, 8])], outputs,
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _hot_feeds() -> dict[str, np.ndarray]:
    # x scaled 1e4: |h| ~ √8·1e4, past fp16's 4096 threshold and far within bf16's
    return {"x": (np.random.default_rng(1).standard_normal((4, 8)) * 1e4).astype(np.float32)}


def _peak() -> float:
    """The largest |h| calibration sees (Relu's output is no larger)."""
    w1, _ = _weights()
    return float(np.abs(_hot_feeds()["x"] @ w1).max())


def _expected_shift() -> int:
    """By hand: the smallest k with peak·2^-k ≤ 4096; W1's entries ~1 stay normal fp16 at
    2^-k, and W2's ~0.03 times 2^k stay far within 4096."""
    return math.ceil(math.log2(_peak() / 4096.0))


def _dtypes(result) -> dict[str, str]:
    return {r["name"]: r["dtype"] for r in result.report["nodes"]}


def test_rescaling_leaves_the_fp32_outputs_bit_for_bit_the_same():
    original = chain_model()
    model = ir.from_proto(original)
    k = _expected_shift()
    done = rescale_hot_chains(model.graph, {"h": _peak(), "r": _peak()})
    assert [(r.up, r.down, r.shift) for r in done] == [("up", "down", k)]
    rescaled = ir.to_proto(model)
    w1, w2 = _weights()
    stored = {t.name: numpy_helper.to_array(t) for t in rescaled.graph.initializer}
    assert np.array_equal(stored["W1"], w1 * np.float32(2.0 ** -k))
    assert np.array_equal(stored["W2"], w2 * np.float32(2.0 ** k))
    feeds = _hot_feeds()
    before, after = validate.run(original, feeds), validate.run(rescaled, feeds)
    assert before.keys() == after.keys() == {"y"}
    assert np.array_equal(before["y"], after["y"])


def test_the_hot_chain_runs_fp16_in_a_mixed_plan_where_it_ran_bf16(monkeypatch):
    data = _hot_feeds()
    k = _expected_shift()
    result = rewrite_onnx_model(chain_model(), dtype="mixed", calibration_data=data)
    assert result.report["rescaled"] == [{"node": "up", "shift": k, "down": "down"}]
    assert _dtypes(result) == {"up": "float16", "relu": "float16", "down": "float16"}
    assert result.report["mixed"]["bf16_by_calibration"] == []
    # the stored fp16 weights are the originals times 2^-k / 2^k, rounded once to fp16
    w1, w2 = _weights()
    stored = {t.name: numpy_helper.to_array(t) for t in result.proto().graph.initializer}
    assert np.array_equal(stored["W1"], (w1 * np.float32(2.0 ** -k)).astype(np.float16))
    assert np.array_equal(stored["W2"], (w2 * np.float32(2.0 ** k)).astype(np.float16))
    assert f"weights scaled by 2^-{k}" in "\n".join(result.explain("up"))
    assert f"weights scaled by 2^{k}" in "\n".join(result.explain("down"))
    # fp16 under per-op rounding stays close to the FP32 model on the calibrated rows
    expected = validate.run(chain_model(), data)["y"]
    got = validate.reference_run(result.proto(), data)["y"]
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-2
    # without the rescaling, calibration sends the chain to bf16
    monkeypatch.setattr("amp_rewrite.onnx.passes.rescale_hot_chains", lambda graph, m: [])
    before = rewrite_onnx_model(chain_model(), dtype="mixed", calibration_data=data)
    assert _dtypes(before) == {"up": "bfloat16", "relu": "bfloat16", "down": "bfloat16"}
    assert before.report["rescaled"] == []


def test_a_chain_whose_middle_value_has_a_second_reader_is_left_alone():
    data = _hot_feeds()
    result = rewrite_onnx_model(chain_model(second_reader=True), dtype="mixed",
                                calibration_data=data)
    assert result.report["rescaled"] == []
    assert _dtypes(result)["up"] == "bfloat16"
    assert "h" in result.report["mixed"]["bf16_by_calibration"]


def test_no_calibration_or_an_fp16_plan_rescales_nothing():
    assert rewrite_onnx_model(chain_model(), dtype="mixed").report["rescaled"] == []
    fp16 = rewrite_onnx_model(chain_model(), dtype="fp16", calibration_data=_hot_feeds())
    assert fp16.report["rescaled"] == []


def conv_bn_constants_model(opset: int = 12) -> onnx.ModelProto:
    """x → Conv(W, B) → h → BatchNormalization(variance up to 1e8) → Relu → y, the weights and
    statistics as Constant nodes (paddle2onnx writes them so): a trained detector's head."""
    rng = np.random.default_rng(2)
    arrays = {"W": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
              "B": rng.standard_normal(8).astype(np.float32),
              "scale": rng.uniform(0.5, 1.5, 8).astype(np.float32),
              "bias": rng.uniform(-0.5, 0.5, 8).astype(np.float32),
              "mean": rng.uniform(-100, 100, 8).astype(np.float32),
              "var": rng.uniform(1e7, 1e8, 8).astype(np.float32)}
    nodes = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(a, n))
             for n, a in arrays.items()]
    nodes += [helper.make_node("Conv", ["x", "W", "B"], ["h"], name="conv", pads=[1, 1, 1, 1]),
              helper.make_node("BatchNormalization", ["h", "scale", "bias", "mean", "var"],
                               ["n"], name="bn", epsilon=1e-5, momentum=0.9),
              helper.make_node("Relu", ["n"], ["y"], name="relu")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F32, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("y", F32, [2, 8, 8, 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _conv_feeds(seed: int = 3) -> dict[str, np.ndarray]:
    # |h| up to ~1e4 · √27: past the 4096 threshold, as the detector's first conv writes
    x = np.random.default_rng(seed).standard_normal((2, 3, 8, 8)) * 3e3
    return {"x": x.astype(np.float32)}


def test_a_conv_normalised_at_once_is_rescaled_exactly_through_its_statistics():
    """Conv → BatchNorm: W and B × 2^-k, the mean × 2^-k, the variance and epsilon × 2^-2k;
    √(2^-2k·(var + ε)) = 2^-k·√(var + ε) exactly, so the FP32 outputs stay bit for bit."""
    original = onnx.shape_inference.infer_shapes(conv_bn_constants_model())  # typed, as loaded
    model = ir.from_proto(original)
    peak = validate.value_maxima(original, _conv_feeds())["h"]
    k = math.ceil(math.log2(peak / 4096.0))  # by hand: W's entries ~1 stay normal fp16
    done = rescale_hot_chains(model.graph, {"h": peak})
    assert [(r.up, r.down, r.shift) for r in done] == [("conv", "bn", k)]
    bn = next(n for n in model.graph if n.name == "bn")
    assert bn.attributes["epsilon"].as_float() == np.float32(1e-5) * np.float32(4.0 ** -k)
    rescaled = ir.to_proto(model)
    before, after = validate.run(original, _conv_feeds(4)), validate.run(rescaled, _conv_feeds(4))
    assert np.array_equal(before["y"], after["y"])


def test_the_rescaled_conv_runs_fp16_in_a_mixed_plan_without_an_opset_conversion():
    """Unscaled, the conv's output needs range: bf16, which Conv has from opset 22 only (a
    conversion). Rescaled, it runs fp16 at opset 12; the BatchNorm, whose variance is still
    beyond fp16 and which onnxruntime's CUDA provider has no bf16 kernel for, runs fp32."""
    result = rewrite_onnx_model(conv_bn_constants_model(), dtype="mixed",
                                calibration_data=_conv_feeds())
    assert _dtypes(result) == {"conv": "float16", "bn": "float32", "relu": "float32"}
    assert [r["node"] for r in result.report["rescaled"]] == ["conv"]
    assert result.report["opset_conversion"] is None
    expected = validate.run(conv_bn_constants_model(), _conv_feeds(5))["y"]
    got = validate.reference_run(result.proto(), _conv_feeds(5))["y"]
    assert np.abs(got - expected).max() / np.abs(expected).max() < 5e-3

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

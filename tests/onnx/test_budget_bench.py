"""``python -m benchmarks budget``: the FLOP-weighted low-precision share on a
hand-made model with known FLOPs, and a ``--quick`` run on one tiny model."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from benchmarks import budget as bench

T = onnx.TensorProto

def two_node_model(low: int) -> onnx.ModelProto:
    """x float[N, 8] → Cast(low) → MatMul(w low [8, 16]) → Cast(float) → Add(b float [16]).
    At N = 4: MatMul 2·4·16·8 = 1024 FLOPs, low; Add 4·16 = 64 FLOPs, fp32; Casts ignored."""
    w = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    w_low = (onh.from_array(w.astype(np.float16), "w") if low == T.FLOAT16
             else _bf16_tensor("w", w))
    b = onh.from_array(np.ones(16, np.float32), "b")
    nodes = [oh.make_node("Cast", ["x"], ["x_low"], to=low, name="cast_in"),
             oh.make_node("MatMul", ["x_low", "w"], ["h_low"], name="mm"),
             oh.make_node("Cast", ["h_low"], ["h"], to=T.FLOAT, name="cast_out"),
             oh.make_node("Add", ["h", "b"], ["y"], name="add")]
    graph = oh.make_graph(nodes, "two", [oh.make_tensor_value_info("x", T.FLOAT, ["N", 8])],
                          [oh.make_tensor_value_info("y", T.FLOAT, ["N", 16])], [w_low, b])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def _bf16_tensor(name: str, array: np.ndarray) -> onnx.TensorProto:
    bits = (array.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return oh.make_tensor(name, T.BFLOAT16, list(array.shape), bits.tobytes(), raw=True)


@pytest.mark.parametrize("low", [T.FLOAT16, T.BFLOAT16])
def test_share_counts_flops_of_low_nodes(low):
    feeds = {"x": np.ones((4, 8), np.float32)}
    share, low_flops, total = bench.low_flop_share(two_node_model(low), feeds)
    assert low_flops == 1024.0
    assert total == 1024.0 + 64.0
    assert share == pytest.approx(1024 / 1088)


def test_share_of_an_fp32_model_is_zero_and_shapes_follow_the_feeds():
    model = bench.as_float32(two_node_model(T.FLOAT16))
    share, low_flops, total = bench.low_flop_share(model, {"x": np.ones((2, 8), np.float32)})
    assert (share, low_flops, total) == (0.0, 0.0, 512.0 + 32.0)
    shapes = bench.concrete_shapes(two_node_model(T.BFLOAT16), {"x": np.ones((3, 8), np.float32)})
    assert shapes["h_low"] == (3, 16) and shapes["w"] == (8, 16)


def test_separate_read_outputs_gives_read_outputs_an_identity():
    x = oh.make_tensor_value_info("x", T.FLOAT, [2])
    nodes = [oh.make_node("Relu", ["x"], ["a"]), oh.make_node("Neg", ["a"], ["b"])]
    graph = oh.make_graph(nodes, "g", [x], [oh.make_tensor_value_info("a", T.FLOAT, [2]),
                                            oh.make_tensor_value_info("b", T.FLOAT, [2])])
    model = bench._separate_read_outputs(oh.make_model(graph))
    assert [o.name for o in model.graph.output] == ["a.output", "b"]
    assert model.graph.node[-1].op_type == "Identity"


def test_quick_run_writes_a_row(tmp_path, capsys):
    path = tmp_path / "budget.json"
    assert bench.main(["--quick", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    (row,) = report["rows"]
    assert (row["model"], row["dtype"], row["max_error"]) == ("bert", "float16", 1e-2)
    ours = row["ours"]
    assert ours["reachable"] is True and ours["evaluations"] >= 1
    for key in ("achieved", "held_out", "held_out_onnxruntime", "held_out_reference"):
        assert 0 <= float(ours[key]) <= 1e-2, key
    assert 0.5 < ours["share"] <= 1.0
    assert row["default_calibrated"]["threshold"] == 4096.0
    assert row["modelopt"]["status"].startswith("not run")
    assert "| bert | float16 | 0.01 |" in capsys.readouterr().out

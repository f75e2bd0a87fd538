"""``python -m benchmarks mixed``: its cast count and bytes, and its verdict on the issue's
criteria, against values derived by hand."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from benchmarks import mixed


def _fp32() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((8, 4), np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_casts_and_their_bytes_are_counted_on_the_rows_shapes():
    # the fp16 rewrite by hand: x fp32 -> fp16 (2·8 elements · 4 B = 64 B), the MatMul fp16,
    # its output fp16 -> fp32 (2·4 · 2 B = 16 B)
    w = numpy_helper.from_array(np.ones((8, 4), np.float16), "W")
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
         helper.make_node("MatMul", ["x16", "W"], ["y16"]),
         helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    low = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    shapes = {"x": (2, 8), "y16": (2, 4)}
    assert mixed.cast_count_and_bytes(low, _fp32(), shapes) == (2, 64 + 16)


def _row(plan: str, error: float, share: float) -> dict:
    return {"plan": plan, "held_out_error": error, "low_flop_share": share}


def test_the_verdict_is_the_issues_three_criteria():
    rows = [_row("ours-fp16", 4e-3, 0.67), _row("ours-bf16", 2e-2, 0.999),
            _row("ours-mixed", 5e-3, 0.999), {"plan": "modelopt-fp16", "status": "skipped"}]
    assert mixed.verdict(rows) == {"fp16_keeps_fp32": True, "mixed_low_share": 0.999,
                                   "mixed_vs_fp16_error": 1.25, "mixed_vs_bf16_error": 0.25}
    failed = [*rows[:2], {"plan": "ours-mixed", "failed": "ValueError: x"}]
    assert mixed.verdict(failed) == {"verdict": "incomplete"}

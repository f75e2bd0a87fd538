"""Control flow: If branches, Loop-carried values and Scan state are retyped like any port.

Casts cross branch boundaries instead of being inserted inside them, carried values keep one
dtype through a body, and branches may capture outer values. Oracle: the FP32 model under
onnxruntime and onnx.reference, on both branches.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator

from amp_rewrite.onnx import rewrite_onnx

from .conftest import IF_CAPTURES_OUTER, ops, parse
from ._helpers import check_close, ort_run, rel_error, rewritten, with_weights


def test_if_branches_are_rewritten_and_capture_outer_values(rng):
    model = parse(IF_CAPTURES_OUTER)
    fp32 = with_weights(model, rng)
    mixed = rewritten(fp32)
    then = next(n for n in mixed.graph.node if n.op_type == "If").attribute
    branch = {a.name: a.g for a in then}["then_branch"]
    # The If output is retyped like any port: the branches end low, one Cast after the If.
    assert [n.op_type for n in branch.node] == ["MatMul"]
    assert ops(mixed) == ["Cast", "MatMul", "If", "Cast"]
    x = rng.standard_normal((2, 8)).astype(np.float32)
    for c in (True, False):
        check_close(fp32, mixed, {"x": x, "c": np.array(c)})


def count_casts(graph: onnx.GraphProto) -> int:
    return sum(n.op_type == "Cast" for n in graph.node) + sum(
        count_casts(a.g) for n in graph.node for a in n.attribute if a.HasField("g"))


def test_if_heavy_vad_model_casts_across_branch_boundaries():
    from tests.models.control_flow import vad_feeds, vad_like_model
    from amp_rewrite.onnx import rewrite_onnx_model, validate

    fp32 = vad_like_model()
    mixed = rewrite_onnx(fp32)
    # One cast per graph input and output: the If outputs, the branch outputs and the
    # captured inputs are retyped like any port (12 casts when the If boundary was fixed).
    assert count_casts(mixed.graph) <= 4
    top_if = next(n for n in mixed.graph.node if n.op_type == "If")
    then = next(a.g for a in top_if.attribute if a.name == "then_branch")
    assert {o.type.tensor_type.elem_type for o in then.output} == {onnx.TensorProto.FLOAT16}
    assert rewrite_onnx_model(mixed).report["modified"] is False  # a second run: no change
    for sr in (16000, 8000):  # both branches
        feeds = vad_feeds(sr)
        expected = validate.run(fp32, feeds)
        for run in (validate.run, validate.reference_run):
            for e in validate.compare(expected, run(mixed, feeds)):
                assert not e.new_nonfinite and e.max_rel < 1e-2, (sr, run.__name__, e)


def test_loop_carried_values_and_scan_state_are_retyped_consistently(rng):
    from onnx import TensorProto as T
    from onnx import helper as h

    # Loop: acc = acc @ w + x, three times; Scan: running sum of rows through MatMul.
    w = onnx.numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), "w")
    body = h.make_graph(
        [h.make_node("MatMul", ["acc_in", "w"], ["mm"]),
         h.make_node("Add", ["mm", "x"], ["acc_out"]),
         h.make_node("Identity", ["cond_in"], ["cond_out"])], "loop_body",
        [h.make_tensor_value_info("i", T.INT64, []),
         h.make_tensor_value_info("cond_in", T.BOOL, []),
         h.make_tensor_value_info("acc_in", T.FLOAT, [2, 8])],
        [h.make_tensor_value_info("cond_out", T.BOOL, []),
         h.make_tensor_value_info("acc_out", T.FLOAT, [2, 8])])
    scan_body = h.make_graph(
        [h.make_node("MatMul", ["row", "w"], ["rw"]), h.make_node("Add", ["s_in", "rw"], ["s_out"]),
         h.make_node("Identity", ["s_out"], ["emit"])], "scan_body",
        [h.make_tensor_value_info("s_in", T.FLOAT, [8]),
         h.make_tensor_value_info("row", T.FLOAT, [8])],
        [h.make_tensor_value_info("s_out", T.FLOAT, [8]),
         h.make_tensor_value_info("emit", T.FLOAT, [8])])
    graph = h.make_graph(
        # An explicit condition: onnx.reference mis-runs a Loop whose condition is omitted.
        [h.make_node("Loop", ["n", "c", "x"], ["acc"], body=body),
         h.make_node("ReduceSum", ["acc", "axis0"], ["s0"], keepdims=0),
         h.make_node("Scan", ["s0", "acc"], ["s", "rows"], body=scan_body, num_scan_inputs=1),
         h.make_node("MatMul", ["rows", "w"], ["y"])], "g",
        [h.make_tensor_value_info("x", T.FLOAT, [2, 8]),
         h.make_tensor_value_info("n", T.INT64, [])],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 8]),
         h.make_tensor_value_info("s", T.FLOAT, [8])],
        [w, onnx.numpy_helper.from_array(np.array([0], np.int64), "axis0"),
         onnx.numpy_helper.from_array(np.array(True), "c")])
    fp32 = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    fp32.ir_version = 8
    onnx.checker.check_model(fp32, full_check=True)
    mixed = rewrite_onnx(fp32)
    onnx.checker.check_model(mixed, full_check=True)
    loop = next(n for n in mixed.graph.node if n.op_type == "Loop")
    loop_body = loop.attribute[0].g
    # The carried value is one dtype at the Loop input, body input, body output and output.
    carried = (loop_body.input[2], loop_body.output[1])
    assert len({v.type.tensor_type.elem_type for v in carried}) == 1
    feeds = {"x": rng.standard_normal((2, 8)).astype(np.float32), "n": np.array(3, np.int64)}
    expected = ort_run(fp32, feeds)
    for got in (ort_run(mixed, feeds), ReferenceEvaluator(mixed).run(None, feeds)):
        for e, g in zip(expected, got):
            assert rel_error(e, g) < 1e-2

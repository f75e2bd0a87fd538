"""Where the ONNX pass runs each op and where it puts casts, on golden graphs in ONNX text.

One test per case of the pass's docstrings: boundary casts, deny ops and what follows them,
graph outputs that also feed nodes, options (dtype, keep_io_types, keep_fp32), unknown ops,
models with nothing to change, local functions, and a second run that changes nothing. Each
test checks the rewritten model with the full checker, and numerics against the FP32 model
evaluated by onnx.reference (every op in its declared dtype).
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from amp_rewrite.onnx import rewrite_onnx, rewrite_onnx_model

from .conftest import cast_targets, ops, parse
from ._helpers import BF16, F16, F32, MLP, check_close, rewritten, with_weights


def test_mlp_runs_low_with_two_casts(rng):
    fp32 = with_weights(parse(MLP), rng)
    mixed = rewritten(fp32)
    assert ops(mixed) == ["Cast", "MatMul", "Relu", "MatMul", "Cast"]
    assert all(i.data_type == F16 for i in mixed.graph.initializer)
    assert [i.name for i in mixed.graph.input] == ["x"] and mixed.graph.output[0].name == "y"
    assert mixed.graph.output[0].type.tensor_type.elem_type == F32
    check_close(fp32, mixed, {"x": rng.standard_normal((2, 8)).astype(np.float32)})


def test_second_run_changes_nothing(rng):
    once = rewrite_onnx(with_weights(parse(MLP), rng))
    result = rewrite_onnx_model(once)
    assert result.report["modified"] is False
    assert ir.to_proto(result.model).SerializeToString() == ir.to_proto(
        ir.from_proto(once)).SerializeToString()


def test_bf16_target(rng):
    fp32 = with_weights(parse(MLP), rng)
    mixed = rewritten(fp32, dtype="bf16")
    assert cast_targets(mixed) == [BF16, F32]
    check_close(fp32, mixed, {"x": rng.standard_normal((2, 8)).astype(np.float32)}, rtol=5e-2)


def test_deny_op_stays_fp32_and_downstream_gray_follows(rng):
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, 8] x) => (float[2, 8] y) <float[8, 8] w> {
        h = MatMul(x, w)
        e = Exp(h)
        y = Add(e, h)
    }""")
    mixed = rewrite_onnx(with_weights(model, rng, 0.1))
    kinds = {n.op_type: n for n in mixed.graph.node}
    assert ops(mixed) == ["Cast", "MatMul", "Cast", "Exp", "Add"]
    report = rewrite_onnx_model(with_weights(model, rng, 0.1)).report
    add = next(r for r in report["nodes"] if r["op_type"] == "Add")
    assert add["precision"] == "high" and "Exp" in add["reason"]
    assert kinds["Exp"].output[0]


def test_graph_output_that_feeds_nodes_keeps_name_and_dtype(rng):
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, 8] x) => (float[2, 8] h, float[2, 8] y) <float[8, 8] w, float[8, 8] w2> {
        h = MatMul(x, w)
        y = MatMul(h, w2)
    }""")
    fp32 = with_weights(model, rng)
    mixed = rewritten(fp32)
    assert [o.name for o in mixed.graph.output] == ["h", "y"]
    assert all(o.type.tensor_type.elem_type == F32 for o in mixed.graph.output)
    assert cast_targets(mixed).count(F32) == 2  # h and y leave as fp32, h still feeds w2 low
    check_close(fp32, mixed, {"x": rng.standard_normal((2, 8)).astype(np.float32)})


def test_unknown_custom_op_is_kept_fp32_and_reported(rng):
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18, "my.domain" : 1]>
    g (float[2, 8] x) => (float[2, 8] y) <float[8, 8] w> {
        h = MatMul(x, w)
        y = my.domain.Mystery(h)
    }""")
    result = rewrite_onnx_model(with_weights(model, rng), check=False)
    assert result.report["unlisted_ops"] == ["my.domain::Mystery"]
    mystery = next(r for r in result.report["nodes"] if r["op_type"] == "my.domain::Mystery")
    assert mystery["precision"] == "high"


def test_model_without_float_tensors_is_unchanged():
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (int64[4] a, int64[4] b) => (int64[4] c) { c = Add(a, b) }""")
    result = rewrite_onnx_model(model)
    assert result.report["modified"] is False and result.report["nodes"] == []


def test_keep_io_types_off_retypes_inputs_and_outputs(rng):
    mixed = rewrite_onnx(with_weights(parse(MLP), rng), keep_io_types=False)
    assert ops(mixed) == ["MatMul", "Relu", "MatMul"]
    assert mixed.graph.input[0].type.tensor_type.elem_type == F16


def test_keep_fp32_pattern_pins_a_node(rng):
    model = with_weights(parse(MLP), rng)
    for i, node in enumerate(model.graph.node):
        node.name = f"n{i}"
    report = rewrite_onnx_model(model, keep_fp32=["n2"]).report
    assert {r["name"]: r["precision"] for r in report["nodes"]} == {
        "n0": "low", "n1": "low", "n2": "high"}


def test_model_local_functions_are_inlined_and_their_bodies_planned(rng):
    """A body is shared by its calls and each call site may need another precision, so calls
    are inlined first; before, ``local.Block`` was an unknown op and everything stayed fp32."""
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18, "local" : 1]>
    g (float[2, 8] x) => (float[2, 8] y) <float[8, 8] w> {
        h = local.Block(x, w)
        y = local.Block(h, w)
    }
    <domain: "local", opset_import: ["" : 18]>
    Block (a, b) => (c) {
        m = MatMul(a, b)
        c = Relu(m)
    }""")
    fp32 = with_weights(model, rng, scale=0.3)
    result = rewrite_onnx_model(fp32)
    assert result.report["unlisted_ops"] == []
    assert result.report["precision_counts"] == {"low": 4, "high": 0}
    mixed = rewritten(fp32)
    assert ops(mixed) == ["Cast", "MatMul", "Relu", "MatMul", "Relu", "Cast"]
    assert len(fp32.functions) == 1  # the input is not mutated
    check_close(fp32, mixed, {"x": rng.standard_normal((2, 8)).astype(np.float32)})

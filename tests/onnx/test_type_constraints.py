"""Value types after the rewrite: type variables follow the data, ports that must stay
float32 do, untyped values get dtypes from the schemas, and the output describes its values
as much as the input did. Checked with the full checker and against the FP32 model under
onnx.reference.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from amp_rewrite.onnx import rewrite_onnx, rewrite_onnx_model

from .conftest import ops, parse
from ._helpers import F16, F32, MLP, check_close, rewritten, with_weights


def test_batchnorm_type_variables_follow_the_data(rng):
    model = parse("""
    <ir_version: 9, opset_import: ["" : 15]>
    g (float[1, 4, 3, 3] x) => (float[1, 4, 3, 3] y)
      <float[4, 4, 1, 1] w, float[4] s, float[4] b, float[4] m, float[4] v> {
        c = Conv(x, w)
        y = BatchNormalization(c, s, b, m, v)
    }""")
    fp32 = with_weights(model, rng)
    v = next(i for i in fp32.graph.initializer if i.name == "v")
    v.CopyFrom(onnx.numpy_helper.from_array(np.abs(onnx.numpy_helper.to_array(v)) + 0.5, "v"))
    mixed = rewritten(fp32)
    assert {i.name: i.data_type for i in mixed.graph.initializer} == dict.fromkeys("wsbmv", F16)
    check_close(fp32, mixed, {"x": rng.standard_normal((1, 4, 3, 3)).astype(np.float32)})


def test_layernorm_statistics_stay_fp32(rng):
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, 8] x) => (float[2, 8] y, float[2, 1] mean) <float[8, 8] w, float[8] s> {
        h = MatMul(x, w)
        y, mean = LayerNormalization <axis = -1> (h, s)
    }""")
    mixed = rewrite_onnx(with_weights(model, rng))
    onnx.checker.check_model(mixed, full_check=True)
    ln = next(n for n in mixed.graph.node if n.op_type == "LayerNormalization")
    types = {vi.name: vi.type.tensor_type.elem_type for vi in
             [*mixed.graph.value_info, *mixed.graph.output]}
    assert types["mean"] == F32 and ln.output[1] == "mean"


def test_resize_scales_stay_float32(rng):
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[1, 2, 4, 4] x) => (float[1, 2, 8, 8] y) <float[2, 2, 1, 1] w, float[4] sc = {1.0, 1.0, 2.0, 2.0}> {
        c = Conv(x, w)
        y = Resize <mode = "nearest"> (c, , sc)
    }""")
    fp32 = with_weights(model, rng)
    sc = next(i for i in fp32.graph.initializer if i.name == "sc")
    sc.CopyFrom(onnx.numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "sc"))
    mixed = rewritten(fp32)
    inits = {i.name: i.data_type for i in mixed.graph.initializer}
    assert inits["sc"] == F32 and inits["w"] == F16
    check_close(fp32, mixed, {"x": rng.standard_normal((1, 2, 4, 4)).astype(np.float32)})


def test_untyped_values_get_dtypes_from_schemas(rng):
    """The pass on an IR model whose intermediate values carry no type (as when shape
    inference is skipped for a large model): dtypes propagate through the schemas."""
    from amp_rewrite.onnx.passes import MixedPrecisionPass, OnnxOptions

    fp32 = with_weights(parse(MLP), rng)
    model = ir.from_proto(fp32)
    assert model.graph.node(0).outputs[0].type is None
    result = MixedPrecisionPass(OnnxOptions())(model)
    assert result.modified
    mixed = ir.to_proto(model)
    onnx.checker.check_model(mixed, full_check=True)
    assert ops(mixed) == ["Cast", "MatMul", "Relu", "MatMul", "Cast"]


def test_output_describes_values_as_much_as_the_input(rng):
    """An input without value_info gets none back (loading inferred the dtypes only for the
    pass; onnx_ir would describe every initializer); one that declares its values gets them
    back with the new dtypes. Only the nodes the pass created carry metadata."""
    bare = with_weights(parse(MLP), rng)
    described = {vi.name for vi in rewritten(bare).graph.value_info}
    assert not described & {"h", "a", "w1", "w2"}
    result = rewrite_onnx_model(bare)
    result.proto()
    assert result.model.graph.initializers["w1"].dtype == ir.DataType.FLOAT16  # IR keeps it
    described = onnx.shape_inference.infer_shapes(bare)
    described.graph.value_info.append(onnx.helper.make_tensor_value_info("w1", F32, [8, 16]))
    mixed = rewritten(described)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in mixed.graph.value_info}
    assert types == {"h": F16, "a": F16, "w1": F16, "x_float16": F16, "y_float16": F16}
    for node in mixed.graph.node:
        tags = {p.key for p in node.metadata_props}
        assert tags == ({"amp_rewrite.inserted", "amp_rewrite.reason"}
                        if node.op_type == "Cast" else set())


def test_initializer_that_is_a_graph_output_keeps_its_type(rng):
    """Graph outputs must be typed, so an initializer that is one keeps its description."""
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, 8] x) => (float[2, 8] y, float[8, 8] w) <float[8, 8] w> {
        y = MatMul(x, w)
    }""")
    mixed = rewritten(with_weights(model, rng))
    assert [(o.name, o.type.tensor_type.elem_type) for o in mixed.graph.output] == \
        [("y", F32), ("w", F32)]

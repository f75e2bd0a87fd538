"""The ONNX pass on golden graphs: one test per case of the pass's docstrings.

Each test checks the rewritten model with the full checker, and numerics against the FP32
model evaluated by onnx.reference (every op in its declared dtype).
"""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto

from amp_rewrite.errors import ModelError
from amp_rewrite.onnx import rewrite_onnx, rewrite_onnx_model

from .conftest import IF_CAPTURES_OUTER, cast_targets, ops, parse, run_reference

F16, F32, BF16 = TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.BFLOAT16
MLP = """
<ir_version: 9, opset_import: ["" : 18]>
mlp (float[2, 8] x) => (float[2, 4] y) <float[8, 16] w1, float[16, 4] w2> {
    h = MatMul(x, w1)
    a = Relu(h)
    y = MatMul(a, w2)
}
"""


def with_weights(model: onnx.ModelProto, rng, scale=1.0) -> onnx.ModelProto:
    for init in model.graph.initializer:
        if init.data_type != F32:
            continue
        shape = list(init.dims)
        arr = (rng.standard_normal(shape) * scale).astype(np.float32)
        init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
    return model


def rewritten(fp32: onnx.ModelProto, **options) -> onnx.ModelProto:
    """``rewrite_onnx`` output that passes the full checker (every test needs both)."""
    mixed = rewrite_onnx(fp32, **options)
    onnx.checker.check_model(mixed, full_check=True)
    return mixed


def check_close(fp32, mixed, feeds, rtol=2e-2):
    ref, got = run_reference(fp32, feeds), run_reference(mixed, feeds)
    for r, g in zip(ref, got):
        assert g.dtype == r.dtype
        assert np.isfinite(g).all()
        assert np.abs(r - g).max() <= rtol * np.abs(r).max() + 1e-3


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


def test_model_cast_from_int_is_retyped_not_duplicated(rng):
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (int64[2, 8] ids, float[2, 8] x) => (float[2, 8] y) <float[8, 8] w> {
        f = Cast <to = 1> (ids)
        s = Add(x, f)
        h = MatMul(f, w)
        y = Add(h, s)
    }""")
    fp32 = with_weights(model, rng)
    mixed = rewritten(fp32)
    own = next(n for n in mixed.graph.node if n.op_type == "Cast" and n.input[0] == "ids")
    assert own.attribute[0].i == F16  # retyped: its readers are low
    feeds = {"ids": rng.integers(0, 5, (2, 8)), "x": rng.standard_normal((2, 8)).astype(np.float32)}
    check_close(fp32, mixed, feeds)


def test_constant_of_shape_value_is_retyped(rng):
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, 8] x) => (float[2, 8] y) <float[8, 8] w, int64[2] shp = {2, 8}> {
        z = ConstantOfShape <value = float[1] {0.5}> (shp)
        h = MatMul(x, w)
        y2 = Add(h, z)
        y = MatMul(y2, w)
    }""")
    fp32 = with_weights(model, rng)
    mixed = rewritten(fp32)
    cos = next(n for n in mixed.graph.node if n.op_type == "ConstantOfShape")
    assert cos.attribute[0].t.data_type == F16
    check_close(fp32, mixed, {"x": rng.standard_normal((2, 8)).astype(np.float32)})


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


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("width", [8, 256])  # 256 KiB of fp32: past the small-tensor form
def test_stored_weights_equal_a_direct_conversion(rng, dtype, width):
    model = parse(f"""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, {width}] x) => (float[2, {width}] y) <float[{width}, {width}] w> {{
        y = MatMul(x, w)
    }}""")
    fp32 = with_weights(model, rng)
    mixed = rewritten(fp32, dtype=dtype)
    (w,) = mixed.graph.initializer
    expected = onnx.numpy_helper.to_array(fp32.graph.initializer[0]).astype(
        ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    assert w.data_type == (BF16 if dtype == "bfloat16" else F16)
    assert w.raw_data == expected.tobytes() and list(w.dims) == [width, width]


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


CONV_18 = """
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[1, 2, 4, 4] x) => (float[1, 2, 4, 4] y) <float[2, 2, 1, 1] w> { y = Conv(x, w) }"""


def test_bf16_converts_an_opset_that_does_not_admit_it(rng):
    """Conv admits bfloat16 from opset 22: asked for bf16, an opset-18 model is converted
    (and says so); fp16 needs no conversion."""
    fp16 = rewrite_onnx_model(with_weights(parse(CONV_18), rng), dtype="fp16")
    assert fp16.report["nodes"][0]["precision"] == "low"
    assert fp16.report["opset_conversion"] is None
    bf16 = rewrite_onnx_model(with_weights(parse(CONV_18), rng), dtype="bf16")
    assert bf16.report["nodes"][0]["precision"] == "low"
    assert "18 -> 22" in bf16.report["opset_conversion"]
    assert bf16.proto().opset_import[0].version == 22
    onnx.checker.check_model(bf16.proto(), full_check=True)


def test_bf16_at_an_explicit_old_opset_keeps_conv_fp32_and_keep_opset_refuses(rng):
    pinned = rewrite_onnx_model(with_weights(parse(CONV_18), rng), dtype="bf16", opset=18)
    conv = pinned.report["nodes"][0]
    assert conv["precision"] == "high"
    assert "does not admit bfloat16" in conv["reason"]
    with pytest.raises(ModelError, match="keep-opset"):
        rewrite_onnx_model(with_weights(parse(CONV_18), rng), dtype="bf16", keep_opset=True)


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


def test_constant_in_attribute_form_read_low_gets_a_runtime_cast(rng):
    """``Constant(value_float=...)`` is kept as written; a low reader gets it through a Cast
    (it used to raise KeyError: only the ``value`` form can be stored converted)."""
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, 8] x) => (float[2, 8] y) <float[8, 8] w1, float[8, 8] w2> {
        c = Constant <value_float: float = 0.5> ()
        h = MatMul(x, w1)
        s = Add(h, c)
        y = MatMul(s, w2)
    }""")
    fp32 = with_weights(model, rng)
    mixed = rewritten(fp32)
    add = next(n for n in mixed.graph.node if n.op_type == "Add")
    cast_of = {n.input[0]: n.attribute[0].i for n in mixed.graph.node if n.op_type == "Cast"}
    assert cast_of["c"] == F16 and add.input[1] != "c"
    check_close(fp32, mixed, {"x": rng.standard_normal((2, 8)).astype(np.float32)})


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


def test_initializer_that_is_also_an_input_stays_overridable(rng):
    """Before IR 4 weights were listed as inputs too; the initializer is then only a default,
    so a low reader gets a runtime Cast of the input, never a stored copy that ignores it."""
    w = onnx.numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    h = onnx.helper
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Relu", ["m"], ["y"])], "g",
        [h.make_tensor_value_info("x", F32, [2, 8]), h.make_tensor_value_info("w", F32, [8, 8])],
        [h.make_tensor_value_info("y", F32, [2, 8])], [w])
    fp32 = h.make_model(graph, opset_imports=[h.make_opsetid("", 9)], ir_version=4)
    mixed = rewritten(fp32)
    assert [i.name for i in mixed.graph.initializer] == ["w"]
    assert {n.input[0] for n in mixed.graph.node if n.op_type == "Cast"} >= {"x", "w"}
    override = {"x": rng.standard_normal((2, 8)).astype(np.float32),
                "w": rng.standard_normal((8, 8)).astype(np.float32)}
    check_close(fp32, mixed, override)


def test_model_cast_retyped_into_an_identity_is_bypassed(rng):
    """``Cast<to=float>`` between two low ops would become Cast(fp16 -> fp16): removed, so only
    the two boundary casts remain; a second run finds nothing more to remove."""
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, 8] x) => (float[2, 8] y) <float[8, 8] w1, float[8, 8] w2> {
        h = MatMul(x, w1)
        hf = Cast <to = 1> (h)
        a = Relu(hf)
        y = MatMul(a, w2)
    }""")
    fp32 = with_weights(model, rng)
    result = rewrite_onnx_model(fp32)
    mixed = result.proto()
    onnx.checker.check_model(mixed, full_check=True)
    assert ops(mixed) == ["Cast", "MatMul", "Relu", "MatMul", "Cast"]
    assert result.report["identity_casts_removed"] == 1
    check_close(fp32, mixed, {"x": rng.standard_normal((2, 8)).astype(np.float32)})
    again = rewrite_onnx_model(mixed).report
    assert not again["modified"] and again["identity_casts_removed"] == 0


def test_identity_cast_the_rewrite_leaves_alone_is_kept(rng):
    """Only casts whose dtypes the rewrite changed are removed: an fp32 -> fp32 Cast in front
    of a deny op stays as the model wrote it."""
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, 8] x) => (float[2, 8] y) {
        c = Cast <to = 1> (x)
        y = Exp(c)
    }""")
    result = rewrite_onnx_model(model)
    assert ops(result.proto()) == ["Cast", "Exp"]
    assert result.report["identity_casts_removed"] == 0 and not result.report["modified"]


@pytest.mark.parametrize("op", ["Cast <to = 10> (c)", "CastLike (c, x16)"])
def test_cast_reads_its_input_as_produced_when_savings_count(rng, op):
    """A Cast or CastLike converts whatever it reads, so at savings weight 1 the constant goes
    in as fp32; a Cast in front of it (fp32 -> fp16 -> fp16) would only add a kernel."""
    model = parse(f"""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, 8] x) => (float[2, 8] y) {{
        c = Constant <value_float: float = 0.5> ()
        x16 = Cast <to = 10> (x)
        k = {op}
        s = Mul(x16, k)
        y = Cast <to = 1> (s)
    }}""")
    mixed = rewritten(model, savings_weight=1.0)
    assert ops(mixed) == ops(model)  # nothing inserted, nothing removed
    converter = mixed.graph.node[2]
    assert converter.input[0] == "c"
    check_close(model, mixed, {"x": rng.standard_normal((2, 8)).astype(np.float32)})

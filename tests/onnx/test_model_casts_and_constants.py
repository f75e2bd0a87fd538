"""The model's own casts and constants: retyped where their readers run low, never duplicated.

A model Cast retyped into an identity is bypassed, one the rewrite leaves alone is kept;
Constant/ConstantOfShape values are stored converted or read through a runtime Cast; stored
weights equal a direct numpy/ml_dtypes conversion; an initializer that is also an input stays
overridable. Oracle: the FP32 model under onnx.reference.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest

from amp_rewrite.onnx import rewrite_onnx_model

from .conftest import ops, parse
from ._helpers import BF16, F16, F32, check_close, rewritten, with_weights


@pytest.mark.parametrize(("int_type", "kept_fp32"), [("int64", True), ("uint8", False)])
def test_model_cast_from_int_keeps_fp32_above_8_bits_else_is_retyped(rng, int_type, kept_fp32):
    """int64 values above 2048 are not exact in fp16 (positions, timesteps): that Cast keeps
    float32 (decision 0032); uint8 values are exact, so that Cast is retyped, not duplicated."""
    model = parse(f"""
    <ir_version: 9, opset_import: ["" : 18]>
    g ({int_type}[2, 8] ids, float[2, 8] x) => (float[2, 8] y) <float[8, 8] w> {{
        f = Cast <to = 1> (ids)
        s = Add(x, f)
        h = MatMul(f, w)
        y = Add(h, s)
    }}""")
    fp32 = with_weights(model, rng)
    mixed = rewritten(fp32)
    own = next(n for n in mixed.graph.node if n.op_type == "Cast" and n.input[0] == "ids")
    assert own.attribute[0].i == (F32 if kept_fp32 else F16)
    high = 3000 if kept_fp32 else 250  # large positions, or the top of uint8
    feeds = {"ids": (high + rng.integers(0, 5, (2, 8))).astype(int_type),
             "x": rng.standard_normal((2, 8)).astype(np.float32)}
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

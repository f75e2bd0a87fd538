"""Pattern fusion before the plan (amp_rewrite.onnx.fusion) and the contrib-op kernels that
let onnx.reference check the fused ops in their declared dtype."""
from __future__ import annotations

import math

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest

from amp_rewrite import rewrite_onnx
from amp_rewrite.core import OpClass, load_rules
from amp_rewrite.onnx import reference_ops, validate
from amp_rewrite.onnx.api import rewrite_onnx_model
from amp_rewrite.onnx.fusion import FUSED_OPS, FUSED_TAG, FusionPass, op_key
from benchmarks.peers import ort_optimized_graph

HEADER = '<ir_version: 10, opset_import: ["" : {opset}]>'
X = "float[2, 8, 32] x"


def model_of(body: str, outputs: str = "float[2, 8, 32] y", inputs: str = X,
             opset: int = 18, weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    text = f"{HEADER.format(opset=opset)}\ng ({inputs}) => ({outputs}) {{\n{body}\n}}"
    model = onnx.parser.parse_model(text)
    for name, array in (weights or {}).items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(array, name))
    onnx.checker.check_model(model, full_check=True)
    return model


def const(name: str, value: float) -> str:
    return f"{name} = Constant <value = float {{{value!r}}}> ()"


ERF_GELU = "\n".join([
    const("sqrt2", math.sqrt(2.0)), const("one", 1.0), const("half", 0.5),
    "d = Div(x, sqrt2)", "e = Erf(d)", "p = Add(e, one)", "h = Mul(x, half)", "y = Mul(h, p)"])
# HF gelu_new / GPT-2: 0.5·x first, Pow(x, 3), constants as exported (fp32-rounded)
TANH_GELU = "\n".join([
    const("half", 0.5), const("three", 3.0), const("c", 0.044714998453855515),
    const("k", 0.7978845834732056), const("one", 1.0),
    "h = Mul(x, half)", "p3 = Pow(x, three)", "m = Mul(p3, c)", "a = Add(x, m)",
    "s = Mul(a, k)", "t = Tanh(s)", "u = Add(t, one)", "y = Mul(h, u)"])
QUICK_GELU = "\n".join([const("alpha", 1.702), "s = Mul(x, alpha)", "g = Sigmoid(s)",
                        "y = Mul(x, g)"])
SILU = "g = Sigmoid(x)\ny = Mul(x, g)"


def rms_norm_body(src: str = "x") -> str:
    return "\n".join([
        const("two", 2.0), const("eps", 1e-6), "axes = Constant <value = int64[1] {-1}> ()",
        f"sq = Pow({src}, two)", "ms = ReduceMean <keepdims = 1, noop_with_empty_axes = 0> (sq, axes)",
        "me = Add(ms, eps)", "r = Sqrt(me)", "ir_ = Reciprocal(r)", f"n = Mul({src}, ir_)",
        "y = Mul(n, w)"])


def layer_norm_body(src: str = "x") -> str:
    return "\n".join([
        const("eps", 1e-5), const("two", 2.0), "axes = Constant <value = int64[1] {-1}> ()",
        f"mu = ReduceMean <keepdims = 1> ({src}, axes)", f"d = Sub({src}, mu)",
        "sq = Pow(d, two)", "var = ReduceMean <keepdims = 1> (sq, axes)", "ve = Add(var, eps)",
        "sd = Sqrt(ve)", "n = Div(d, sd)", "sc = Mul(n, w)", "y = Add(sc, b)"])


def fused(model: onnx.ModelProto, target: str = "ort") -> tuple[onnx.ModelProto, FusionPass]:
    from amp_rewrite.onnx.load import load_model

    m = load_model(model).model  # shape inference, as the rewrite loads models
    step = FusionPass(target)
    step(m)
    return ir.to_proto(m), step


def ort_outputs(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return list(validate.run(model, feeds).values())


@pytest.fixture
def feeds():
    return {"x": np.random.default_rng(0).standard_normal((2, 8, 32)).astype(np.float32)}


@pytest.fixture
def weights():
    rng = np.random.default_rng(1)
    return {"w": (1 + 0.1 * rng.standard_normal(32)).astype(np.float32),
            "b": (0.1 * rng.standard_normal(32)).astype(np.float32)}


@pytest.mark.parametrize("body, expected", [
    (ERF_GELU, "com.microsoft::Gelu"),
    (TANH_GELU, "com.microsoft::FastGelu"),
    (QUICK_GELU, "com.microsoft::QuickGelu"),
    (SILU, "com.microsoft::QuickGelu"),
])
def test_activation_chain_becomes_one_fused_op_with_the_same_values(body, expected, feeds):
    model = model_of(body)
    out, step = fused(model)
    assert step.fused == {expected: 1}
    assert [op_key(n) for n in ir.from_proto(out).graph] == [expected]
    np.testing.assert_allclose(ort_outputs(out, feeds)[0], ort_outputs(model, feeds)[0],
                               rtol=1e-5, atol=1e-5)


def test_gelu_with_a_wrong_constant_is_not_fused(feeds):
    """0.6 where GELU has 0.5 is another function: the chain must stay as it is."""
    model = model_of(ERF_GELU.replace("0.5", "0.6"))
    out, step = fused(model)
    assert step.fused == {} and not step.rule_hits
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("body, expected", [
    (rms_norm_body(), "SimplifiedLayerNormalization"),
    (layer_norm_body(), "LayerNormalization"),
])
def test_norm_chain_becomes_a_norm_op(body, expected, feeds, weights):
    model = model_of(body, weights=weights)
    out, step = fused(model)
    assert step.fused == {expected: 1}
    np.testing.assert_allclose(ort_outputs(out, feeds)[0], ort_outputs(model, feeds)[0],
                               rtol=1e-4, atol=1e-5)


def test_residual_add_and_rms_norm_become_skip_norm_keeping_the_sum(feeds, weights):
    """The residual sum feeds the next block too: the fused op's 4th output must carry it."""
    body = "res = Add(x, z)\n" + rms_norm_body("res") + "\nout2 = Relu(res)"
    model = model_of(body, inputs=f"{X}, float[2, 8, 32] z",
                     outputs="float[2, 8, 32] y, float[2, 8, 32] out2", weights=weights)
    out, step = fused(model)
    assert step.fused == {"com.microsoft::SkipSimplifiedLayerNormalization": 1}
    skip = [n for n in out.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"][0]
    assert list(skip.output)[1:3] == ["", ""]  # unused fp32 statistics are not produced
    feeds = dict(feeds, z=np.random.default_rng(2).standard_normal((2, 8, 32), np.float32))
    for got, want in zip(ort_outputs(out, feeds), ort_outputs(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_bias_add_then_gelu_becomes_bias_gelu(feeds, weights):
    body = "\n".join([
        "xb = Add(x, b)", const("sqrt2", math.sqrt(2.0)), const("one", 1.0), const("half", 0.5),
        "d = Div(xb, sqrt2)", "e = Erf(d)", "p = Add(e, one)", "h = Mul(xb, half)",
        "y = Mul(h, p)"])
    model = model_of(body, weights=weights)
    out, step = fused(model)
    assert step.fused == {"com.microsoft::BiasGelu": 1}
    np.testing.assert_allclose(ort_outputs(out, feeds)[0], ort_outputs(model, feeds)[0],
                               rtol=1e-5, atol=1e-5)


def test_onnx_target_emits_standard_ops_only_as_the_opset_allows(feeds, weights):
    """Gelu is standard from opset 20: at 18 the erf chain stays, at 20 it becomes Gelu."""
    at18, step18 = fused(model_of(ERF_GELU), target="onnx")
    assert step18.fused == {}
    at20, step20 = fused(model_of(ERF_GELU, opset=20), target="onnx")
    assert step20.fused == {"Gelu": 1}
    assert all(n.domain in ("", "ai.onnx") for n in at20.graph.node)
    tanh20, step_t = fused(model_of(TANH_GELU, opset=20), target="onnx")
    assert step_t.fused == {"Gelu": 1}
    (gelu,) = tanh20.graph.node
    assert onnx.helper.get_attribute_value(gelu.attribute[0]) == b"tanh"
    np.testing.assert_allclose(ort_outputs(tanh20, feeds)[0],
                               ort_outputs(model_of(TANH_GELU, opset=20), feeds)[0],
                               rtol=1e-5, atol=1e-5)
    ln, step_ln = fused(model_of(layer_norm_body(), weights=weights), target="onnx")
    assert step_ln.fused == {"LayerNormalization": 1}
    assert all(n.domain in ("", "ai.onnx") for n in ln.graph.node)


def test_unknown_target_is_a_usage_error():
    from amp_rewrite.errors import UsageError

    with pytest.raises(UsageError, match="target='trt': expected one of 'ort', 'onnx'"):
        rewrite_onnx(model_of(SILU), target="trt")


def test_fused_gelu_runs_low_without_casts_where_the_chain_needed_an_fp32_island(feeds):
    """The tanh chain has Pow (deny): unfused, it keeps fp32 ops; fused, nothing stays high."""
    model = model_of("mm = MatMul(x, w)\n" + TANH_GELU.replace("(x,", "(mm,").replace(
        "Pow(x", "Pow(mm").replace("Add(x", "Add(mm") + "\nz = MatMul(y, w)",
        outputs="float[2, 8, 32] z",
        weights={"w": np.random.default_rng(3).standard_normal((32, 32), np.float32) / 6})
    unfused = rewrite_onnx_model(model, fuse=False)
    fused_result = rewrite_onnx_model(model)
    assert unfused.report["precision_counts"]["high"] > 0
    assert fused_result.report["precision_counts"]["high"] == 0
    assert fused_result.report["casts_inserted"] < unfused.report["casts_inserted"]
    assert fused_result.report["fused"] == {"com.microsoft::FastGelu": 1}
    ref = validate.run(model, feeds)
    out = fused_result.proto()
    for run in (validate.run, validate.reference_run):
        (err,) = validate.compare(ref, run(out, validate.as_declared(out, feeds)))
        assert err.ok(1e-2), err


def test_no_fuse_leaves_every_chain_spelled_out(feeds):
    out = rewrite_onnx(model_of(TANH_GELU), fuse=False)
    assert not [n for n in out.graph.node if n.domain == "com.microsoft"]
    assert "Tanh" in [n.op_type for n in out.graph.node]


def test_model_without_fusible_chains_is_rewritten_the_same_with_and_without_fusion():
    model = model_of("h = MatMul(x, w)\ny = Relu(h)",
                     weights={"w": np.ones((32, 32), np.float32)})
    assert rewrite_onnx(model) == rewrite_onnx(model, fuse=False)


def test_explain_names_the_rule_that_fused_a_node():
    result = rewrite_onnx_model(model_of(QUICK_GELU))
    node = [n for n in result.model.graph if n.op_type == "QuickGelu"][0]
    assert node.metadata_props[FUSED_TAG] == "amp_rewrite.quick_gelu"
    assert result.explain(node.name)[0].endswith("created by fusion rule amp_rewrite.quick_gelu")


def test_every_fused_op_is_classified_with_a_reason_and_has_a_reference_kernel():
    rules = load_rules("onnx")
    for key in FUSED_OPS:
        entry = rules.classify(key)
        assert entry is not None and entry.reason, key
        assert rules.class_of(key) in (OpClass.ALLOW, OpClass.GRAY), key
    kernels = {(k.op_domain, k.__name__) for k in reference_ops.CONTRIB_OPS}
    contrib = {tuple(k.split("::")) for k in FUSED_OPS if "::" in k}
    assert contrib <= kernels
    assert ("", "SimplifiedLayerNormalization") in kernels


def _contrib_model(op: str, inputs: list[tuple[str, list[int]]], dtype: int, attrs=None,
                   outputs: int = 1, domain: str = "com.microsoft") -> onnx.ModelProto:
    h = onnx.helper
    node = h.make_node(op, [n for n, _ in inputs], [f"o{i}" for i in range(outputs)],
                       domain=domain, **(attrs or {}))
    graph = h.make_graph([node], "g", [h.make_tensor_value_info(n, dtype, s) for n, s in inputs],
                         [h.make_tensor_value_info("o0", dtype, None)])
    return h.make_model(graph, ir_version=10, opset_imports=[
        h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)])


KERNEL_CASES = [
    ("Gelu", [("x", [2, 8, 32])], {}),
    ("FastGelu", [("x", [2, 8, 32]), ("b", [32])], {}),
    ("BiasGelu", [("x", [2, 8, 32]), ("b", [32])], {}),
    ("QuickGelu", [("x", [2, 8, 32])], {"alpha": 1.702}),
    ("SkipLayerNormalization", [("x", [2, 8, 32]), ("s", [2, 8, 32]), ("g", [32]), ("b", [32])],
     {"epsilon": 1e-5}),
    ("SkipSimplifiedLayerNormalization", [("x", [2, 8, 32]), ("s", [2, 8, 32]), ("g", [32])],
     {"epsilon": 1e-6}),
    ("MultiHeadAttention", [("q", [2, 8, 32]), ("k", [2, 8, 32]), ("v", [2, 8, 32])],
     {"num_heads": 4}),
]


@pytest.mark.parametrize("op, inputs, attrs", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_reference_kernel_matches_onnxruntime_in_fp32_and_fp16(op, inputs, attrs):
    rng = np.random.default_rng(4)
    for dtype, np_dtype, tol in ((onnx.TensorProto.FLOAT, np.float32, 1e-5),
                                 (onnx.TensorProto.FLOAT16, np.float16, 2e-3)):
        model = _contrib_model(op, inputs, dtype, attrs)
        feeds = {n: rng.standard_normal(s).astype(np_dtype) for n, s in inputs}
        got = validate.reference_run(model, feeds)["o0"]
        want = validate.run(model, feeds)["o0"]
        assert got.dtype == want.dtype == np_dtype
        scale = float(np.abs(want.astype(np.float64)).max())
        assert float(np.abs(got.astype(np.float64) - want).max()) <= tol * scale, op


def test_reference_rms_norm_rounds_to_bfloat16_like_the_declared_type():
    """bf16 has 8 mantissa bits: the kernel's output must carry bf16 rounding, not fp32's."""
    model = _contrib_model("SimplifiedLayerNormalization", [("x", [4, 32]), ("w", [32])],
                           onnx.TensorProto.BFLOAT16, {"epsilon": 1e-6}, domain="")
    from ml_dtypes import bfloat16

    x = np.random.default_rng(5).standard_normal((4, 32)).astype(bfloat16)
    w = np.ones(32, bfloat16)
    got = validate.reference_run(model, {"x": x, "w": w})["o0"]
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)
    assert got.dtype == bfloat16
    assert np.abs(got.astype(np.float64) - want).max() <= 2 ** -8 * np.abs(want).max()
    assert not np.array_equal(got.astype(np.float64), want)  # rounded: not the exact values


def test_skip_norm_statistics_ports_stay_fp32():
    """ORT's SkipLayerNormalization types mean/inv_std as U = float32 only."""
    from amp_rewrite.core import LowDtype
    from amp_rewrite.onnx.ports import port_groups

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 4]))
    node = ir.Node("com.microsoft", "SkipLayerNormalization", [x, x, x], num_outputs=4)
    for i, v in enumerate(node.outputs):
        v.name, v.dtype = f"o{i}", ir.DataType.FLOAT
    groups = port_groups(node, 1, LowDtype.FLOAT16)
    stats = [g for g in groups if g.outputs == (1, 2)]
    assert len(stats) == 1 and stats[0].fixed_reason
    free = [g for g in groups if 0 in g.outputs]
    assert free[0].fixed_reason is None and free[0].inputs == (0, 1, 2) and 3 in free[0].outputs


# ------------------------------------------------------------------ real architectures

@pytest.fixture(scope="module")
def zoo_case():
    from tests.models import zoo

    cache = {}

    def get(name: str):
        if name not in cache:
            path = zoo.cached_onnx(name)
            cache[name] = (path, zoo.onnx_inputs(zoo.build(name), path))
        return cache[name]
    return get


def _ort_session_fused(model: onnx.ModelProto) -> int:
    kinds = {k.split("::")[-1] for k in FUSED_OPS}
    return sum(n.domain == "com.microsoft" or n.op_type in kinds
               for n in ort_optimized_graph(model).graph.node)


def _inside_ort_fused_chains(fp32: onnx.ModelProto) -> set[str]:
    """Values ORT's optimiser fuses away in the FP32 model (fusions keep boundary values)."""
    kept = {v for n in ort_optimized_graph(fp32).graph.node for v in (*n.input, *n.output)}
    return {o for n in fp32.graph.node if n.op_type != "Constant" for o in n.output
            if o not in kept}


@pytest.mark.slow
@pytest.mark.parametrize("name, kinds", [
    ("bert", {"com.microsoft::SkipLayerNormalization", "com.microsoft::BiasGelu",
              "com.microsoft::MultiHeadAttention"}),
    ("t5", {"SimplifiedLayerNormalization", "com.microsoft::SkipSimplifiedLayerNormalization"}),
])
def test_zoo_model_fuses_runs_all_low_and_keeps_ort_fusions(name, kinds, zoo_case):
    path, feeds = zoo_case(name)
    fp32 = onnx.load(path)
    result = rewrite_onnx_model(path)
    assert set(result.report["fused"]) == kinds
    assert result.report["precision_counts"]["high"] == 0
    out = result.proto()
    ref = validate.run(fp32, feeds)
    for run in (validate.run, validate.reference_run):
        for err in validate.compare(ref, run(out, validate.as_declared(out, feeds))):
            assert err.ok(1e-2), (run.__name__, err)
    assert _ort_session_fused(out) >= _ort_session_fused(fp32)
    inside = _inside_ort_fused_chains(fp32)
    assert inside  # the control: ORT does fuse chains of the FP32 model
    assert not [n.input[0] for n in out.graph.node if n.op_type == "Cast" and n.input[0] in inside]


@pytest.mark.slow
def test_rewriting_a_fused_output_again_changes_nothing(zoo_case):
    path, _ = zoo_case("bert")
    once = rewrite_onnx(path)
    again = rewrite_onnx_model(once)
    assert not again.report["modified"] and not again.report["fusion_rules"]
    assert again.proto() == once or rewrite_onnx(once) == once


@pytest.mark.slow
def test_onnx_target_fuses_attention_into_the_standard_op_at_opset_23():
    """Standard-domain output only: eager attention → Attention (23), checked in both runtimes."""
    from tests.models import zoo

    path = zoo.cached_onnx("bert", opset=23)
    feeds = zoo.onnx_inputs(zoo.build("bert"), path)
    result = rewrite_onnx_model(path, target="onnx")
    assert result.report["fused"] == {"Attention": 2}
    out = result.proto()
    assert {n.domain for n in out.graph.node} <= {"", "ai.onnx"}
    ref = validate.run(onnx.load(path), feeds)
    for run in (validate.run, validate.reference_run):
        for err in validate.compare(ref, run(out, validate.as_declared(out, feeds))):
            assert err.ok(1e-2), (run.__name__, err)


def test_cli_flags_and_summary_row(tmp_path, capsys):
    from amp_rewrite.cli import main

    src = tmp_path / "m.onnx"
    onnx.save(model_of(QUICK_GELU), src)
    assert main([str(src), "-o", str(tmp_path / "a.onnx")]) == 0
    assert "fused chains              QuickGelu 1" in capsys.readouterr().out
    assert main([str(src), "-o", str(tmp_path / "b.onnx"), "--no-fuse"]) == 0
    assert "fused chains              none" in capsys.readouterr().out
    assert main([str(src), "-o", str(tmp_path / "c.onnx"), "--target", "onnx"]) == 0
    assert {n.domain for n in onnx.load(tmp_path / "c.onnx").graph.node} <= {""}

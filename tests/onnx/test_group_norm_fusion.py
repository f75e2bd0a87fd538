"""GroupNorm as torch exports it (Reshape → InstanceNormalization → Reshape → ·γ → +β) fused
into the standard GroupNormalization-21, whose stash_type keeps the statistics in fp32 where
a bf16 InstanceNormalization would accumulate them in bf16."""
from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest

from amp_rewrite import cli
from amp_rewrite.onnx import validate
from amp_rewrite.onnx.fusion import FUSED_TAG, FusionPass
from amp_rewrite.onnx.load import load_model
from tests.models import zoo

C, G = 32, 8
X = f"float[N, {C}, 4, 5] x"
RNG = np.random.default_rng(0)
GAMMA = RNG.standard_normal((C, 1, 1)).astype(np.float32)
BETA = RNG.standard_normal((C, 1, 1)).astype(np.float32)


def model_of(body: str, outputs: str, inputs: str, opset: int,
             weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    header = f'<ir_version: 10, opset_import: ["" : {opset}]>'
    model = onnx.parser.parse_model(f"{header}\ng ({inputs}) => ({outputs}) {{\n{body}\n}}")
    for name, array in weights.items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(array, name))
    onnx.checker.check_model(model, full_check=True)
    return model


def fused(model: onnx.ModelProto, target: str) -> tuple[onnx.ModelProto, FusionPass]:
    m = load_model(model).model  # shape inference, as the rewrite loads models
    step = FusionPass(target)
    step(m)
    return ir.to_proto(m), step


def ort(model: onnx.ModelProto, x: dict[str, np.ndarray]) -> np.ndarray:
    """onnxruntime CPU itself (validate.run would fall back to onnx.reference)."""
    return validate.session(model).run(None, x)[0]


def group_norm_model(opset: int = 22, in_scale: float = 1.0, eps: float = 1e-5,
                     group_shape: str = f"0, {G}, -1", gamma=GAMMA, beta=BETA,
                     back: str = "Shape(x)", out: str = "4, 5") -> onnx.ModelProto:
    body = "\n".join([
        f"gs = Constant <value = int64[3] {{{group_shape}}}> ()",
        "g = Reshape(x, gs)",
        f"s = Constant <value = float[{G}] {{{', '.join([repr(in_scale)] * G)}}}> ()",
        f"b = Constant <value = float[{G}] {{{', '.join(['0.0'] * G)}}}> ()",
        f"n = InstanceNormalization <epsilon = {eps!r}> (g, s, b)",
        f"bs = {back}", "r = Reshape(n, bs)", "m = Mul(r, gamma)", "y = Add(m, beta)"])
    return model_of(body, outputs=f"float[N, {C}, {out}] y", inputs=X, opset=opset,
                    weights={"gamma": gamma, "beta": beta})


def feeds(batch: int = 3) -> dict[str, np.ndarray]:
    return {"x": (RNG.standard_normal((batch, C, 4, 5)) * 4 + 3).astype(np.float32)}


def group_norms(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "GroupNormalization"]


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_chain_fuses_into_group_normalization_21_exact_in_fp32(target):
    model = group_norm_model()
    out, step = fused(model, target)
    onnx.checker.check_model(out, full_check=True)
    (node,) = group_norms(out)
    assert not [n for n in out.graph.node if n.op_type == "InstanceNormalization"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["num_groups"] == G and attrs["stash_type"] == 1
    assert attrs["epsilon"] == pytest.approx(1e-5)
    assert {p.key: p.value for p in node.metadata_props}[FUSED_TAG] == "amp_rewrite.group_norm"
    assert step.fused == {"GroupNormalization": 1}
    x = feeds()
    want = ort(model, x)
    for got in (ort(out, x),  # onnxruntime CPU runs GroupNormalization-21
                validate.reference_run(out, x)["y"]):
        assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5


def test_static_reshapes_and_per_channel_1d_affine_fuse():
    model = group_norm_model(group_shape=f"2, {G}, {C // G * 20}",
                             back=f"Constant <value = int64[4] {{2, {C}, 4, 5}}> ()",
                             gamma=GAMMA.reshape(1, C, 1, 1), beta=BETA.reshape(1, C, 1, 1))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 2
    out, _ = fused(model, "onnx")
    assert len(group_norms(out)) == 1
    x = feeds(2)
    want = ort(model, x)
    assert np.abs(ort(out, x) - want).max() / np.abs(want).max() <= 1e-5


@pytest.mark.parametrize("case", [
    "opset_18",  # GroupNormalization-18 takes per-group scale/bias: left alone
    "instance_norm_scale",  # InstanceNormalization scale is not all ones
    "channels_not_grouped",  # Reshape (N, G, -1) with G not dividing C
    "not_restored",  # second Reshape transposes the spatial dims instead of restoring x's
    "per_element_gamma",  # gamma varies over the spatial axes
])
def test_declines_where_the_chain_is_not_exactly_a_group_norm(case):
    model = {
        "opset_18": lambda: group_norm_model(opset=18),
        "instance_norm_scale": lambda: group_norm_model(in_scale=2.0),
        "channels_not_grouped": lambda: _regrouped(5),
        "not_restored": lambda: group_norm_model(
            back=f"Constant <value = int64[4] {{0, {C}, 5, 4}}> ()", out="5, 4"),
        "per_element_gamma": lambda: group_norm_model(
            gamma=RNG.standard_normal((C, 4, 5)).astype(np.float32)),
    }[case]()
    for target in ("ort", "onnx"):
        out, _ = fused(model, target)
        assert not group_norms(out), (case, target)
        assert [n for n in out.graph.node if n.op_type == "InstanceNormalization"]


def _regrouped(groups: int) -> onnx.ModelProto:
    """(N, 5, -1): 5 groups of 32 channels · 20 pixels = 128 elements, not channel-aligned."""
    body = "\n".join([
        f"gs = Constant <value = int64[3] {{0, {groups}, -1}}> ()", "g = Reshape(x, gs)",
        f"s = Constant <value = float[{groups}] {{{', '.join(['1.0'] * groups)}}}> ()",
        f"b = Constant <value = float[{groups}] {{{', '.join(['0.0'] * groups)}}}> ()",
        "n = InstanceNormalization(g, s, b)", "bs = Shape(x)", "r = Reshape(n, bs)",
        "m = Mul(r, gamma)", "y = Add(m, beta)"])
    return model_of(body, outputs=f"float[N, {C}, 4, 5] y", inputs=X, opset=22,
                    weights={"gamma": GAMMA, "beta": BETA})


def test_reference_group_normalization_keeps_bf16_statistics_in_fp32():
    """onnx.reference expands GroupNormalization-21's function body, which casts to
    stash_type: bf16 in and out, statistics in fp32, as a numpy computation of the spec."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    h = onnx.helper
    t = onnx.TensorProto.BFLOAT16
    node = h.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=G,
                       epsilon=1e-5, stash_type=1)
    graph = h.make_graph([node], "g", [h.make_tensor_value_info("x", t, [2, C, 8, 8]),
                                       h.make_tensor_value_info("s", t, [C]),
                                       h.make_tensor_value_info("b", t, [C])],
                         [h.make_tensor_value_info("y", t, [2, C, 8, 8])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 22)])
    x = (RNG.standard_normal((2, C, 8, 8)) * 3 + 20).astype(bf16)  # offset: bf16 sums drift
    s, b = RNG.standard_normal(C).astype(bf16), RNG.standard_normal(C).astype(bf16)
    got = validate.reference_run(model, {"x": x, "s": s, "b": b})["y"]
    v = x.astype(np.float32).reshape(2, G, -1)
    mean = v.mean(-1, keepdims=True)
    var = ((v - mean) ** 2).mean(-1, keepdims=True)
    normed = ((v - mean) / np.sqrt(var + np.float32(1e-5))).reshape(x.shape).astype(bf16)
    scaled = (normed.astype(np.float32) * s.astype(np.float32)[:, None, None]).astype(bf16)
    want = (scaled.astype(np.float32) + b.astype(np.float32)[:, None, None]).astype(bf16)
    assert got.dtype == bf16
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_unet_block_bf16_error_drops_below_1e_2(tmp_path, target):
    path = zoo.cached_onnx("unet_block", attn_implementation="sdpa", dynamic=True)
    out = tmp_path / "o.onnx"
    assert cli.main([str(path), "-o", str(out), "--dtype", "bf16", "--target", target,
                     "-q"]) == 0
    model = onnx.load(str(out))
    assert len(group_norms(model)) == 4
    assert not [n for n in model.graph.node if n.op_type == "InstanceNormalization"]
    m = zoo.build("unet_block", attn_implementation="sdpa", batch=3)
    want = m.run().numpy()
    got = next(iter(validate.reference_run(model, zoo.onnx_inputs(m, path)).values()))
    error = np.abs(got.astype(np.float32) - want).max() / np.abs(want).max()
    assert error < 1e-2  # 0.146 with the bf16 InstanceNormalization; 0.007 fused


@pytest.mark.slow
def test_unet_block_fusion_is_exact_in_fp32_at_opset_22():
    from amp_rewrite.onnx import versions

    path = zoo.cached_onnx("unet_block", attn_implementation="sdpa", dynamic=True)
    model = ir.to_proto(versions.convert_opset(load_model(onnx.load(str(path))).model, 22))
    model.ir_version = min(model.ir_version, 10)
    out, step = fused(model, "onnx")
    assert step.fused.get("GroupNormalization") == 4
    m = zoo.build("unet_block", attn_implementation="sdpa", batch=3)
    x = zoo.onnx_inputs(m, path)
    want, got = ort(model, x), ort(out, x)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5

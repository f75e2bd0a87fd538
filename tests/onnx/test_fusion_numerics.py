"""Numerics of fused ops: the reference kernels round once from float32 math, a fused model
is no less accurate than the unfused one under true fp16, and the comparison tool counts an
fp16 ``FusedConv`` (which no onnxruntime provider has a kernel for) as such."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as h
from scipy.special import erf

from amp_rewrite import rewrite_onnx
from amp_rewrite.onnx import validate

MS = "com.microsoft"
HIDDEN, HEADS = 32, 4
RNG = np.random.default_rng(7)


def _half_ulp(truth: np.ndarray) -> np.ndarray:
    """Half a float16 ulp at each value (normal range; the subnormal spacing below it)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(truth), 2.0 ** -14)))
    return 2.0 ** (exponent - 11)


def _layer_norm64(x: np.ndarray, eps: float, centred: bool) -> np.ndarray:
    mean = x.mean(-1, keepdims=True) if centred else 0.0
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)


def _mha64(q, k, v, heads):
    b, s, hidden = q.shape
    split = lambda t: t.reshape(b, -1, heads, hidden // heads).transpose(0, 2, 1, 3)  # noqa: E731
    scores = split(q) @ split(k).transpose(0, 1, 3, 2) / math.sqrt(hidden // heads)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    out = (weights / weights.sum(-1, keepdims=True)) @ split(v)
    return out.transpose(0, 2, 1, 3).reshape(b, s, hidden)


def _x():
    return (RNG.standard_normal((2, 5, HIDDEN)) * 2).astype(np.float16)


def _w():
    return (1 + 0.1 * RNG.standard_normal(HIDDEN)).astype(np.float16)


def _cases():
    """(op, domain, inputs, attrs, float64 truth of output 0 from the fp16 inputs)."""
    x, s, g, b = _x(), _x(), _w(), (0.1 * _w()).astype(np.float16)
    x64, s64, g64, b64 = (t.astype(np.float64) for t in (x, s, g, b))
    gelu = lambda t: 0.5 * t * (1 + erf(t / math.sqrt(2)))  # noqa: E731
    tanh_gelu = lambda t: 0.5 * t * (1 + np.tanh(math.sqrt(2 / math.pi)  # noqa: E731
                                                 * (t + 0.044715 * t ** 3)))
    q, k, v = _x(), _x(), _x()
    return [
        ("Gelu", MS, [x], {}, gelu(x64)),
        ("FastGelu", MS, [x, b], {}, tanh_gelu(x64 + b64)),
        ("BiasGelu", MS, [x, b], {}, gelu(x64 + b64)),
        ("QuickGelu", MS, [x], {"alpha": 1.702}, x64 / (1 + np.exp(-1.702 * x64))),
        ("SkipLayerNormalization", MS, [x, s, g, b], {"epsilon": 1e-5},
         _layer_norm64(x64 + s64, 1e-5, True) * g64 + b64),
        ("SkipSimplifiedLayerNormalization", MS, [x, s, g], {"epsilon": 1e-5},
         _layer_norm64(x64 + s64, 1e-5, False) * g64),
        ("SimplifiedLayerNormalization", "", [x, g], {"epsilon": 1e-5, "axis": -1},
         _layer_norm64(x64, 1e-5, False) * g64),
        ("MultiHeadAttention", MS, [q, k, v], {"num_heads": HEADS},
         _mha64(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), HEADS)),
    ]


def _one_node(op, domain, inputs, attrs) -> onnx.ModelProto:
    names = [f"in{i}" for i in range(len(inputs))]
    node = h.make_node(op, names, ["y"], domain=domain, **attrs)
    graph = h.make_graph([node], op, [h.make_tensor_value_info(n, TensorProto.FLOAT16, a.shape)
                                      for n, a in zip(names, inputs)],
                         [h.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    return h.make_model(graph, ir_version=10, opset_imports=[h.make_opsetid("", 18),
                                                             h.make_opsetid(MS, 1)])


@pytest.mark.parametrize("op,domain,inputs,attrs,truth", _cases(), ids=lambda c: (
    c if isinstance(c, str) and c and c != MS else None))
def test_reference_kernel_rounds_once_like_an_fp32_accumulating_kernel(op, domain, inputs,
                                                                        attrs, truth):
    """Every output element within half an fp16 ulp (plus float32 slack) of the float64
    result: one rounding at the end, as ORT's fp16 kernels with fp32 registers. A kernel that
    rounded an intermediate (the skip sum, a GELU's inner term, the attention scores) to fp16
    lands up to several ulps away."""
    model = _one_node(op, domain, inputs, attrs)
    got = validate.reference_run(model, {f"in{i}": a for i, a in enumerate(inputs)})["y"]
    assert got.dtype == np.float16
    excess = np.abs(got.astype(np.float64) - truth) - _half_ulp(truth) * 1.002 - 1e-6
    assert excess.max() <= 0, f"{op}: {int((excess > 0).sum())} values beyond half an ulp"


def test_half_ulp_bound_rejects_a_kernel_that_rounds_the_skip_sum_first():
    """The bound above can fail: rounding x + skip to fp16 before the norm breaks it."""
    x, s, g = _x(), _x(), _w()
    truth = _layer_norm64(x.astype(np.float64) + s.astype(np.float64), 1e-5, False) * g
    rounded_sum = (x.astype(np.float32) + s.astype(np.float32)).astype(np.float16)
    early = (_layer_norm64(rounded_sum.astype(np.float64), 1e-5, False) * g).astype(np.float16)
    assert (np.abs(early.astype(np.float64) - truth) > _half_ulp(truth) * 1.002 + 1e-6).any()


# --------------------------------------------------------------- fused vs unfused, zoo BERT

def _exposed(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    present = {o.name for o in model.graph.output}
    model.graph.output.extend(h.make_empty_tensor_value_info(n) for n in names
                              if n not in present)
    return model


def _rms_rel(got: np.ndarray, ref: np.ndarray) -> float:
    ref64 = ref.astype(np.float64)
    return float(np.sqrt(np.mean((got.astype(np.float64) - ref64) ** 2))
                 / max(np.sqrt(np.mean(ref64 ** 2)), 1e-30))


# A value's rms error moves by -7% to +15% from one input draw to the next: the mean of 8
# draws is what the 2% margin can judge
DRAWS = 8


@pytest.mark.slow
def test_fused_bert_is_no_less_accurate_than_unfused_at_every_value_under_true_fp16():
    """Same casts and share with and without fusion on BERT, so the only difference is the
    fused kernels: under onnx.reference (true fp16 rounding) every value both graphs compute
    (the fused chains' boundaries, the projections, the output) is at least as close to FP32
    with fusion, averaged over ``DRAWS`` input draws (rms, within 2%)."""
    from tests.models import zoo

    path = zoo.cached_onnx("bert")
    fp32 = onnx.load(path)
    fused = rewrite_onnx(onnx.load(path), dtype="float16")
    unfused = rewrite_onnx(onnx.load(path), dtype="float16", fuse=False)
    float_values = {o for n in fp32.graph.node for o in n.output
                    if n.op_type not in ("Constant", "Shape", "Cast")}
    shared = [o for n in fused.graph.node for o in n.output
              if o in float_values and o in {x for m in unfused.graph.node for x in m.output}]
    shared += [o.name for o in fp32.graph.output]
    models = [_exposed(m, shared) for m in (fp32, fused, unfused)]
    errors = {name: [[], []] for name in shared}
    for seed in range(DRAWS):
        feeds = zoo.onnx_inputs(zoo.build("bert", seed=seed), path)
        ref, *outs = [validate.reference_run(m, validate.as_declared(m, feeds)) for m in models]
        for name in shared:
            if np.issubdtype(ref[name].dtype, np.floating):
                for errs, out in zip(errors[name], outs):
                    errs.append(_rms_rel(out[name], ref[name]))
    worse = {n: (np.mean(f), np.mean(u)) for n, (f, u) in errors.items()
             if f and np.mean(f) > 1.02 * np.mean(u) + 1e-7}
    assert len([n for n in errors if errors[n][0]]) > 20  # projections, norms, attention, output
    assert not worse, f"fused less accurate than unfused at {worse}"


# ------------------------------------------------- python -m benchmarks compare fusion

@pytest.fixture(scope="module")
def compare_fusion():
    from benchmarks import fusion_compare

    return fusion_compare


WEIGHT = RNG.standard_normal((4, 3, 3, 3))


def _conv_relu(fused: bool, elem: int) -> onnx.ModelProto:
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
    w = onnx.numpy_helper.from_array(WEIGHT.astype(dtype), "w")
    if fused:
        nodes = [h.make_node("FusedConv", ["x", "w"], ["y"], domain=MS, activation="Relu",
                             pads=[1, 1, 1, 1])]
    else:
        nodes = [h.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                 h.make_node("Relu", ["c"], ["y"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", elem, [1, 3, 5, 5])],
                         [h.make_tensor_value_info("y", elem, [1, 4, 5, 5])], [w])
    return h.make_model(graph, ir_version=10, opset_imports=[h.make_opsetid("", 18),
                                                             h.make_opsetid(MS, 1)])


def test_fp16_fused_conv_is_counted_as_a_fusion_without_a_kernel(compare_fusion):
    low, high = _conv_relu(True, TensorProto.FLOAT16), _conv_relu(True, TensorProto.FLOAT)
    assert compare_fusion.fused_ops(low) == 1
    assert compare_fusion.fused_without_low_kernel(low) == 1
    assert compare_fusion.fused_without_low_kernel(high) == 0


def test_fused_conv_reference_kernel_equals_conv_then_relu(compare_fusion):
    x = RNG.standard_normal((1, 3, 5, 5)).astype(np.float16)
    fused = compare_fusion.sorted_reference_run(_conv_relu(True, TensorProto.FLOAT16), {"x": x})
    spelled = validate.reference_run(_conv_relu(False, TensorProto.FLOAT16), {"x": x})
    assert fused["y"].dtype == np.float16 and (fused["y"] == 0).any()
    np.testing.assert_array_equal(fused["y"], spelled["y"])


def test_errors_differing_by_seed_noise_are_not_called_worse(compare_fusion):
    """The comparison's paired test: draw-to-draw noise either way is a tie, a consistent
    excess is not."""
    rng = np.random.default_rng(3)
    peer = list(1e-3 * (1 + 0.3 * rng.standard_normal(12)))
    noisy = [p * (1 + 0.05 * s) for p, s in zip(peer, rng.standard_normal(12))]
    assert not compare_fusion.significantly_worse(noisy, peer)
    assert compare_fusion.significantly_worse([p * 1.2 for p in peer], peer)
    assert not compare_fusion.significantly_worse([p * 0.8 for p in peer], peer)

"""BatchNormalization, GlobalAveragePool, the reductions, Softmax/LogSoftmax, LpNormalization,
Einsum and Attention in ``validate.reference_evaluator`` compute as the GPU kernels do: inference
BatchNorm from the given statistics, arithmetic in float32, each output rounded once
(``reference_ops.FLOAT32_KERNELS``). The oracle is numpy in float64, rounded once to the low
dtype. numpy sums bfloat16 in bfloat16 along any axis, and float16 in float16 along a strided
one: the reductions below run over axis 0 of a (4096, 4) input, where onnx.reference alone
is 7 to 370 ulps off for both dtypes."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx.reference import ReferenceEvaluator

from amp_rewrite.onnx import reference_ops, validate

from ._helpers import BF16, F16

LOW = {F16: np.float16, BF16: ml_dtypes.bfloat16}


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "g", inputs, outputs, list(inits))
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])


def _ulps(got: np.ndarray, want: np.ndarray) -> float:
    """|got - want| in units of the low dtype's spacing at want."""
    spacing = np.spacing(np.abs(want.astype(np.float32)).astype(got.dtype)).astype(np.float64)
    return float((np.abs(got.astype(np.float64) - want) / spacing).max())


def _batch_norm(elem: int, opset: int, **attrs):
    """PP-OCRv4's first BatchNorm in miniature: a conv output near 1e4, running variance
    near 1e8, so that scale·(x − mean) leaves float16's range though Y does not."""
    rng = np.random.default_rng(0)
    low = LOW[elem]
    x = (rng.standard_normal((2, 3, 4, 5)) * 1e4).astype(low)
    params = {"s": rng.uniform(5, 10, 3), "b": rng.standard_normal(3),
              "m": rng.standard_normal(3) * 1e4, "v": rng.uniform(0.5e8, 1e8, 3)}
    if elem == F16:  # float16 holds no 1e8; scale·(x − mean) still reaches ~5e5
        params["v"] = rng.uniform(2e4, 6e4, 3)
    inits = [onh.from_array(np.asarray(a).astype(low), n) for n, a in params.items()]
    model = _model([oh.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"],
                                 **attrs)],
                   [oh.make_tensor_value_info("x", elem, [2, 3, 4, 5])],
                   [oh.make_tensor_value_info("y", elem, [2, 3, 4, 5])], inits, opset=opset)
    r = lambda a: np.asarray(a).astype(low).astype(np.float64).reshape(-1, 1, 1)  # noqa: E731
    v = x.astype(np.float64)
    eps = np.float64(np.float32(attrs.get("epsilon", 1e-5)))
    want = r(params["s"]) * (v - r(params["m"])) / np.sqrt(r(params["v"]) + eps) + r(params["b"])
    return model, x, want


# bfloat16 BatchNormalization needs opset 15
@pytest.mark.parametrize("elem,opset", [(F16, 9), (F16, 12), (F16, 15), (BF16, 15)])
def test_batch_norm_is_inference_in_float32(elem, opset):
    """With ``momentum`` set (as PaddlePaddle exports it), at the model's opset."""
    model, x, want = _batch_norm(elem, opset, momentum=0.9, epsilon=1e-5)
    with np.errstate(all="ignore"):
        (y,) = validate.reference_evaluator(model).run(None, {"x": x})
    assert y.dtype == LOW[elem] and np.isfinite(y).all()
    assert _ulps(y, want) <= 1.0


def test_onnx_reference_alone_normalises_with_the_batch_statistics():
    """Why the kernel exists: at opsets 9-13 onnx.reference reads ``momentum`` as training
    mode, so even the float32 model's BatchNorm mixes in this batch's mean and variance."""
    model, x, want = _batch_norm(F16, 12, momentum=0.9)
    for t in model.graph.initializer:
        t.CopyFrom(onh.from_array(onh.to_array(t).astype(np.float32), t.name))
    for v in (*model.graph.input, *model.graph.output):
        v.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    x32 = x.astype(np.float32)
    (plain,) = ReferenceEvaluator(model).run(None, {"x": x32})
    (ours,) = validate.reference_evaluator(model).run(None, {"x": x32})
    scale = np.abs(want).max()
    assert np.abs(plain - want).max() > 0.1 * scale
    assert np.abs(ours - want).max() < 1e-5 * scale


def test_batch_norm_training_mode_is_refused():
    model, x, _ = _batch_norm(F16, 15, training_mode=1)
    with pytest.raises(NotImplementedError, match="inference mode only"):
        validate.reference_evaluator(model).run(None, {"x": x})


def test_batch_norm_spatial_0_has_a_statistic_per_element():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4)).astype(np.float16)
    p = {n: rng.uniform(0.5, 2.0, (3, 4)).astype(np.float16) for n in "sbmv"}
    model = _model([oh.make_node("BatchNormalization", ["x", *p], ["y"], spatial=0,
                                 is_test=1)],
                   [oh.make_tensor_value_info("x", F16, [2, 3, 4])],
                   [oh.make_tensor_value_info("y", F16, [2, 3, 4])],
                   [onh.from_array(a, n) for n, a in p.items()], opset=7)
    (y,) = validate.reference_evaluator(model).run(None, {"x": x})
    f = {n: a.astype(np.float64) for n, a in p.items()}
    want = f["s"] * (x.astype(np.float64) - f["m"]) / np.sqrt(f["v"] + 1e-5) + f["b"]
    assert _ulps(y, want) <= 1.0


@pytest.mark.parametrize("elem", [F16, BF16])
def test_global_average_pool_sums_in_float32(elem):
    """4096 values near 1: a bfloat16 sum would stop growing at 256."""
    x = np.random.default_rng(2).uniform(0.9, 1.1, (2, 3, 64, 64)).astype(LOW[elem])
    model = _model([oh.make_node("GlobalAveragePool", ["x"], ["y"])],
                   [oh.make_tensor_value_info("x", elem, [2, 3, 64, 64])],
                   [oh.make_tensor_value_info("y", elem, [2, 3, 1, 1])])
    (y,) = validate.reference_evaluator(model).run(None, {"x": x})
    want = x.astype(np.float64).mean(axis=(2, 3), keepdims=True)
    assert y.dtype == LOW[elem] and y.shape == want.shape
    assert _ulps(y, want) <= 1.0


def _unary(op: str, elem: int, x: np.ndarray, opset: int, inputs=(), **attrs):
    """One ``op`` node on ``x`` with constant extra ``inputs`` (name, array); output shape
    left to the evaluator."""
    node = oh.make_node(op, ["x", *(n for n, _ in inputs)], ["y"], **attrs)
    return _model([node], [oh.make_tensor_value_info("x", elem, list(x.shape))],
                  [oh.make_tensor_value_info("y", elem, None)],
                  [onh.from_array(a, n) for n, a in inputs], opset=opset)


def _softmax64(v: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(v - v.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


_AXIS0 = [("axes", np.array([0], np.int64))]
#: id: (op, opset, extra inputs, attributes, input scale, float64 oracle over axis 0)
_REDUCTIONS = {
    "ReduceSum": ("ReduceSum", 13, _AXIS0, {}, 1.0, lambda v: v.sum(0, keepdims=True)),
    "ReduceSum-opset11": ("ReduceSum", 11, (), {"axes": [0]}, 1.0,
                          lambda v: v.sum(0, keepdims=True)),
    "ReduceMean": ("ReduceMean", 18, _AXIS0, {}, 1.0, lambda v: v.mean(0, keepdims=True)),
    "ReduceMean-opset13-keepdims0": ("ReduceMean", 13, (), {"axes": [0], "keepdims": 0}, 1.0,
                                     lambda v: v.mean(0)),
    "ReduceSumSquare": ("ReduceSumSquare", 18, _AXIS0, {}, 1.0,
                        lambda v: (v * v).sum(0, keepdims=True)),
    "ReduceL1": ("ReduceL1", 18, _AXIS0, {}, -1.0, lambda v: np.abs(v).sum(0, keepdims=True)),
    "ReduceL2": ("ReduceL2", 18, _AXIS0, {}, 1.0,
                 lambda v: np.sqrt((v * v).sum(0, keepdims=True))),
    # a sum near 1.5, where the log's ulp is small
    "ReduceLogSum": ("ReduceLogSum", 18, _AXIS0, {}, 1.5 / 4096,
                     lambda v: np.log(v.sum(0, keepdims=True))),
    "ReduceLogSumExp": ("ReduceLogSumExp", 18, _AXIS0, {}, 1.0,
                        lambda v: np.log(np.exp(v).sum(0, keepdims=True))),
    "Softmax": ("Softmax", 13, (), {"axis": 0}, 1.0, lambda v: _softmax64(v, 0)),
    "LogSoftmax": ("LogSoftmax", 13, (), {"axis": 0}, 1.0, lambda v: np.log(_softmax64(v, 0))),
    "LpNormalization-p2": ("LpNormalization", 13, (), {"axis": 0, "p": 2}, 1.0,
                           lambda v: v / np.sqrt((v * v).sum(0, keepdims=True))),
    "LpNormalization-p1": ("LpNormalization", 13, (), {"axis": 0, "p": 1}, 1.0,
                           lambda v: v / np.abs(v).sum(0, keepdims=True)),
    "Einsum": ("Einsum", 12, (), {"equation": "ij->j"}, 1.0, lambda v: v.sum(0)),
}


@pytest.mark.parametrize("elem", [F16, BF16])
@pytest.mark.parametrize("case", list(_REDUCTIONS))
def test_reductions_accumulate_in_float32(case, elem):
    """4096 values near 1 (scaled) reduced over the strided axis 0; bfloat16 Einsum alone
    passes without the kernel (onnx.reference promotes bfloat16 there itself)."""
    op, opset, inputs, attrs, scale, oracle = _REDUCTIONS[case]
    x = (np.random.default_rng(3).uniform(0.9, 1.1, (4096, 4)) * scale).astype(LOW[elem])
    if op in ("Softmax", "LogSoftmax"):
        x = np.random.default_rng(3).standard_normal((4096, 4)).astype(LOW[elem])
    (y,) = validate.reference_evaluator(_unary(op, elem, x, opset, inputs, **attrs)).run(
        None, {"x": x})
    want = oracle(x.astype(np.float64))
    assert y.dtype == LOW[elem] and y.shape == want.shape
    assert _ulps(y, want) <= 1.0


@pytest.mark.parametrize("elem", [F16, BF16])
def test_reduce_prod_multiplies_in_float32(elem):
    """256 factors near 1: each product rounded to 8 or 11 bits drifts by many ulps."""
    x = np.random.default_rng(4).uniform(0.99, 1.01, (256, 4)).astype(LOW[elem])
    model = _unary("ReduceProd", elem, x, 18, _AXIS0)
    (y,) = validate.reference_evaluator(model).run(None, {"x": x})
    want = x.astype(np.float64).prod(0, keepdims=True)
    assert y.dtype == LOW[elem] and _ulps(y, want) <= 1.0


@pytest.mark.parametrize("elem", [F16, BF16])
def test_log_softmax_is_finite_where_the_probability_underflows(elem):
    """x − max − log Σ exp: a logit 200 below the max has log-probability ≈ −200, not the
    log of a probability that underflows to 0 (−inf)."""
    x = np.array([[0.0, -200.0, 1.0, -3.0]], dtype=LOW[elem])
    (y,) = validate.reference_evaluator(_unary("LogSoftmax", elem, x, 13, axis=1)).run(
        None, {"x": x})
    v = x.astype(np.float64)
    want = v - v.max() - np.log(np.exp(v - v.max()).sum())
    assert np.isfinite(y).all() and _ulps(y, want) <= 1.0


@pytest.mark.parametrize("case", [*_REDUCTIONS, "ReduceProd"])
def test_float32_models_compute_as_onnx_reference_does(case):
    """The kernels change only 16-bit inputs: a float32 model gives onnx.reference's result
    bit for bit."""
    op, opset, inputs, attrs, *_ = _REDUCTIONS.get(case, ("ReduceProd", 18, _AXIS0, {}))
    x = np.random.default_rng(5).uniform(0.5, 1.5, (64, 4)).astype(np.float32)
    model = _unary(op, onnx.TensorProto.FLOAT, x, opset, inputs, **attrs)
    (ours,) = validate.reference_evaluator(model).run(None, {"x": x})
    (plain,) = ReferenceEvaluator(model).run(None, {"x": x})
    assert ours.dtype == plain.dtype == np.float32
    np.testing.assert_array_equal(ours, plain)


# Attention (opset 23): onnx.reference computes QKᵀ, the softmax and the product with V in
# Q's dtype, 19 to 37 ulps off in these cases; cuDNN/flash attention and onnxruntime's CUDA
# Attention accumulate in float32 and round Y once. Scores of spread ~9 (Q and K scaled by 3,
# so the exponentials span a wide range) over a non-negative V: Y is a convex combination of
# V, with no cancellation, so float32 rounded once is within an ulp of float64.
_B, _H, _S, _D = 1, 2, 256, 64
_PAST = 192  # the past-KV case: 192 cached keys, 64 new query/key rows


def _attention_case(case: str, low, rng):
    """(inputs, attributes, output names) of one Attention node: 4-D (B, H, S, D) tensors."""
    s = _S - _PAST if case == "past-causal" else _S
    t = _S
    feeds = {"q": (rng.standard_normal((_B, _H, s, _D)) * 3).astype(low),
             "k": (rng.standard_normal((_B, _H, s, _D)) * 3).astype(low),
             "v": rng.uniform(0.0, 1.5, (_B, _H, s, _D)).astype(low)}
    attrs, outputs = {}, ["y"]
    if case == "float-mask":  # an additive bias with a quarter of the keys at -inf
        mask = rng.standard_normal((s, t)) * 2
        mask[rng.uniform(size=(s, t)) < 0.25] = -np.inf
        mask[:, 0] = 0.0  # every row keeps a key
        feeds["mask"] = mask.astype(low)
    elif case == "bool-mask":
        mask = rng.uniform(size=(1, 1, s, t)) < 0.75
        mask[..., 0] = True
        feeds["mask"] = mask
    elif case == "past-causal":
        feeds["mask"] = None  # no attn_mask: the past follows as the 5th and 6th inputs
        feeds["past_k"] = (rng.standard_normal((_B, _H, _PAST, _D)) * 3).astype(low)
        feeds["past_v"] = rng.uniform(0.0, 1.5, (_B, _H, _PAST, _D)).astype(low)
        outputs += ["present_k", "present_v"]
    if case in ("causal", "past-causal"):
        attrs["is_causal"] = 1
    return feeds, attrs, outputs


def _attention_model(feeds: dict, elem: int, attrs: dict, outputs: list) -> onnx.ModelProto:
    names = [n if a is not None else "" for n, a in feeds.items()]
    bool_mask = feeds.get("mask") is not None and feeds["mask"].dtype == np.bool_
    inputs = [oh.make_tensor_value_info(
        n, onnx.TensorProto.BOOL if n == "mask" and bool_mask else elem, list(a.shape))
        for n, a in feeds.items() if a is not None]
    return _model([oh.make_node("Attention", names, outputs, **attrs)], inputs,
                  [oh.make_tensor_value_info(n, elem, None) for n in outputs], opset=23)


def _attention64(feeds: dict, causal: bool) -> np.ndarray:
    f = {n: a.astype(np.float64) for n, a in feeds.items()
         if a is not None and a.dtype != np.bool_}
    k, v = f["k"], f["v"]
    if "past_k" in f:
        k = np.concatenate([f["past_k"], k], axis=2)
        v = np.concatenate([f["past_v"], v], axis=2)
    scores = f["q"] @ np.swapaxes(k, -1, -2) / np.sqrt(_D)
    s, t = scores.shape[-2:]
    if "mask" in f:
        scores = scores + f["mask"]
    elif feeds.get("mask") is not None:  # boolean: False masks the key
        scores = np.where(feeds["mask"], scores, -np.inf)
    if causal:  # bottom-right: the past keys all precede the new rows
        scores = np.where(np.tril(np.ones((s, t), bool), k=t - s), scores, -np.inf)
    return _softmax64(scores, -1) @ v


_ATTENTION_CASES = ["plain", "causal", "float-mask", "bool-mask", "past-causal"]
_needs_attention = pytest.mark.skipif(not hasattr(reference_ops, "Attention"),
                                      reason="onnx.reference without Attention (onnx < 1.18)")


@_needs_attention
@pytest.mark.parametrize("elem", [F16, BF16])
@pytest.mark.parametrize("case", _ATTENTION_CASES)
def test_attention_accumulates_in_float32(case, elem):
    """Y within an ulp of float64; present_key/present_value are the past and the new K/V
    concatenated, bit for bit, in their own dtype."""
    low = LOW[elem]
    feeds, attrs, outputs = _attention_case(case, low, np.random.default_rng(6))
    model = _attention_model(feeds, elem, attrs, outputs)
    got = validate.reference_evaluator(model).run(None, {n: a for n, a in feeds.items()
                                                        if a is not None})
    want = _attention64(feeds, bool(attrs.get("is_causal")))
    y = got[0]
    assert y.dtype == low and y.shape == want.shape
    assert _ulps(y, want) <= 1.0
    if case == "past-causal":
        for present, past, new in zip(got[1:], ("past_k", "past_v"), "kv"):
            assert present.dtype == low
            np.testing.assert_array_equal(present, np.concatenate([feeds[past], feeds[new]], 2))


@_needs_attention
@pytest.mark.parametrize("case", _ATTENTION_CASES)
def test_float32_attention_computes_as_onnx_reference_does(case):
    feeds, attrs, outputs = _attention_case(case, np.float32, np.random.default_rng(7))
    model = _attention_model(feeds, onnx.TensorProto.FLOAT, attrs, outputs)
    run = {n: a for n, a in feeds.items() if a is not None}
    ours = validate.reference_evaluator(model).run(None, run)
    plain = ReferenceEvaluator(model).run(None, run)
    assert len(ours) == len(plain) == len(outputs)
    for o, p in zip(ours, plain):
        assert o.dtype == p.dtype == np.float32
        np.testing.assert_array_equal(o, p)

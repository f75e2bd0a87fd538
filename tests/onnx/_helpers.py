"""Models, files and comparisons shared by the ONNX tests."""
from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
from onnx import TensorProto

from amp_rewrite.onnx import rewrite_onnx

from .conftest import run_reference


T = onnx.TensorProto


def small_model(nodes=None, inits=None, inputs=None, outputs=None, functions=(), ir_version=9,
                extra_opsets=()) -> onnx.ModelProto:
    x = oh.make_tensor_value_info("x", T.FLOAT, [2, 8])
    y = oh.make_tensor_value_info("y", T.FLOAT, [2, 8])
    w = onh.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), "w")
    graph = oh.make_graph(nodes or [oh.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          inputs or [x], outputs if outputs is not None else [y],
                          [w] if inits is None else inits)
    model = oh.make_model(graph, functions=list(functions),
                          opset_imports=[oh.make_opsetid("", 18), *extra_opsets])
    model.ir_version = ir_version
    return model


def save(tmp_path, model: onnx.ModelProto | bytes, name="m.onnx"):
    path = tmp_path / name
    path.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    return path


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


def rel_error(expected: np.ndarray, got: np.ndarray) -> float:
    expected, got = np.asarray(expected, np.float64), np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "NaN/Inf where FP32 had none"
    return float(np.abs(expected - got).max() / max(np.abs(expected).max(), 1e-12))


def if_model(output_type: onnx.ValueInfoProto | None = None, ir_version: int = 8,
             opset: int = 17) -> onnx.ModelProto:
    """y = If(c) then MatMul(x, w) else Relu(x); branch outputs and y left untyped, as
    exporters write them (onnxruntime infers them; the checker refuses the model)."""
    from onnx import TensorProto as T
    from onnx import helper as h

    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    then = h.make_graph([h.make_node("MatMul", ["x", "w"], ["a"])], "then", [],
                        [onnx.ValueInfoProto(name="a")])
    other = h.make_graph([h.make_node("Relu", ["x"], ["b"])], "else", [],
                         [onnx.ValueInfoProto(name="b")])
    graph = h.make_graph(
        [h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
        [h.make_tensor_value_info("x", T.FLOAT, [2, 8]), h.make_tensor_value_info("c", T.BOOL, [])],
        [output_type or onnx.ValueInfoProto(name="y")], [w])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


def ort_run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def conv_bn_model(variance: np.ndarray, rng, opset: int = 17) -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu -> Conv, with BatchNorm statistics like a trained
    detection backbone's: running variance 1e7-1e8 (activations of ~1e4 before the norm)."""
    from onnx import TensorProto as T
    from onnx import helper as h

    c = variance.size
    arrays = {
        "w1": rng.standard_normal((c, 3, 3, 3)).astype(np.float32) * 1500,
        "scale": rng.uniform(0.5, 1.5, c).astype(np.float32),
        "bias": rng.uniform(-0.5, 0.5, c).astype(np.float32),
        "mean": rng.uniform(-500, 500, c).astype(np.float32),
        "var": variance.astype(np.float32),
        "w2": rng.standard_normal((4, c, 3, 3)).astype(np.float32) * 0.1,
    }
    inits = [onnx.numpy_helper.from_array(a, n) for n, a in arrays.items()]
    nodes = [h.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             h.make_node("BatchNormalization", ["c1", "scale", "bias", "mean", "var"], ["bn"],
                         name="bn"),
             h.make_node("Relu", ["bn"], ["r"]),
             h.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1])]
    graph = h.make_graph(nodes, "detector",
                         [h.make_tensor_value_info("x", T.FLOAT, [1, 3, 16, 16])],
                         [h.make_tensor_value_info("y", T.FLOAT, [1, 4, 16, 16])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 8
    return model

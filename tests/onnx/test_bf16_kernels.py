"""For onnxruntime (``target="ort"``), bf16 goes only where its CUDA provider has a bf16 kernel
(``onnx/kernels.py``, decision 0039); ``target="onnx"`` plans by the schema.

The kernel facts are onnxruntime-gpu 1.31.1's, read from its listing (the packaged registry,
``tests/onnx/test_cuda_registry.py`` checks the file): BatchNormalization and Clip have no
bf16 CUDA kernel at any opset, Conv has one from opset 22, Relu from 14, MatMul from 13. The
outputs are checked against that registry by ``validate.cuda_kernels`` and against FP32 under
onnx.reference.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.onnx import rewrite_onnx_model, validate
from amp_rewrite.onnx.kernels import lacks_bf16_kernel

CUDA = "CUDAExecutionProvider"


@pytest.mark.parametrize("domain, op, opset, lacks", [
    ("", "BatchNormalization", 15, True),  # the schema admits bf16 from 15; CUDA never
    ("", "BatchNormalization", 22, True),
    ("", "Clip", 13, True),
    ("", "Conv", 18, True),   # neither the schema nor CUDA before 22
    ("", "Conv", 22, False),
    ("", "Relu", 14, False),
    ("", "MatMul", 13, False),
    ("ai.onnx", "MatMul", 13, False),
    ("com.microsoft", "SkipLayerNormalization", 1, False),
    ("com.microsoft", "BiasSplitGelu", 1, True),  # fp16 only
    ("my.custom", "Anything", 1, False),  # a domain the registry does not cover: the rules
    ("", "Gelu", 20, False),  # a function op: onnxruntime expands it into ops with kernels
])
def test_lacks_bf16_kernel_agrees_with_onnxruntimes_registry(domain, op, opset, lacks):
    assert lacks_bf16_kernel(domain, op, opset) is lacks


def _conv_clip_bn(opset: int = 22) -> onnx.ModelProto:
    """x → Conv → Clip(0, 6) → BatchNormalization → Relu → y: a MobileNet block's ops."""
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3,
              "lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32),
              "scale": rng.uniform(0.5, 1.5, 8).astype(np.float32),
              "bias": rng.uniform(-0.5, 0.5, 8).astype(np.float32),
              "mean": rng.uniform(0, 1, 8).astype(np.float32),
              "var": rng.uniform(0.5, 2, 8).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c", "lo", "hi"], ["r6"], name="clip"),
             helper.make_node("BatchNormalization", ["r6", "scale", "bias", "mean", "var"],
                              ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["y"], name="relu")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])],
        [numpy_helper.from_array(a, n) for n, a in arrays.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _dtypes(result) -> dict[str, str]:
    return {r["name"]: r["dtype"] if "dtype" in r else r["precision"]
            for r in result.report["nodes"]}


def _error(fp32: onnx.ModelProto, model: onnx.ModelProto) -> float:
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    expected = validate.run(fp32, {"x": x})["y"]
    got = validate.reference_run(model, {"x": x})["y"]
    assert np.isfinite(got).all()
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def test_a_bf16_plan_for_onnxruntime_keeps_ops_without_a_cuda_kernel_fp32_and_loads():
    fp32 = _conv_clip_bn()
    result = rewrite_onnx_model(fp32, dtype="bf16")
    precision = {r["name"]: r["precision"] for r in result.report["nodes"]}
    # Relu reads the fp32 BatchNorm and writes the fp32 graph output: fp32 costs no cast
    assert precision == {"conv": "low", "clip": "high", "bn": "high", "relu": "high"}
    reasons = {r["name"]: r["reason"] for r in result.report["nodes"]}
    assert "no bfloat16 Clip kernel at opset 22" in reasons["clip"]
    assert "no bfloat16 BatchNormalization kernel" in reasons["bn"]
    runs_on = validate.cuda_kernels(ir.from_proto(result.proto()))
    assert runs_on[CUDA] is True, runs_on
    assert _error(fp32, result.proto()) < 5e-2


def test_a_bf16_plan_for_other_runtimes_follows_the_schema_and_the_registry_says_so():
    fp32 = _conv_clip_bn()
    result = rewrite_onnx_model(fp32, dtype="bf16", target="onnx")
    assert {r["precision"] for r in result.report["nodes"]} == {"low"}
    runs_on = validate.cuda_kernels(ir.from_proto(result.proto()))
    assert runs_on[CUDA] is False
    assert runs_on["missing"] == ["BatchNormalization(bfloat16) opset 22",
                                  "Clip(bfloat16) opset 22"]
    assert _error(fp32, result.proto()) < 5e-2


def test_a_mixed_plan_for_onnxruntime_loads_on_its_cuda_provider():
    # The BatchNorm reads a variance fp16 cannot hold: range says bf16, the CUDA provider has
    # no bf16 BatchNormalization, so it runs fp32 and says why; the rest runs fp16.
    fp32 = _conv_clip_bn()
    for init in fp32.graph.initializer:
        if init.name == "var":
            init.CopyFrom(numpy_helper.from_array(np.full(8, 1e5, np.float32), "var"))
    result = rewrite_onnx_model(fp32, dtype="mixed")
    records = {r["name"]: r for r in result.report["nodes"]}
    assert records["bn"]["dtype"] == "float32"
    assert "kernel takes no bf16" in records["bn"]["reason"]
    assert {records[n]["dtype"] for n in ("conv", "clip")} == {"float16"}
    assert validate.cuda_kernels(ir.from_proto(result.proto()))[CUDA] is True
    schema_only = rewrite_onnx_model(fp32, dtype="mixed", target="onnx")
    # by the schema bf16 is open to it, and loses on casts alone: BatchNorm → Relu → the
    # fp32 output costs one cast fp32, two bf16
    bn = next(r for r in schema_only.report["nodes"] if r["name"] == "bn")
    assert bn["dtype"] == "float32" and "fewer cast bytes than bf16" in bn["reason"]
    assert _error(fp32, result.proto()) < 1e-2


def test_a_float32_port_the_schema_fixes_does_not_hide_a_16_bit_kernel():
    # Resize's scales are tensor(float) by its schema; onnxruntime's CUDA provider has an fp16
    # Resize from opset 19 on (its T1 type list names float16 only)
    graph = helper.make_graph(
        [helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 2, 8, 8])],
        [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)]))
    assert validate.cuda_kernels(model)[CUDA] is True

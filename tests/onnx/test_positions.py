"""An outer product of positions and frequencies (RoPE angles written as MatMul, Gemm or Einsum
with a summed dimension of 1) keeps the positions fp32: it is gray, not a GEMM to lower.

At position 3000 an fp16 position is off by up to 1 (bf16: 8), so lowering the product rotates
features at random; the oracle is the FP32 model in onnxruntime and onnx.reference."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.onnx import validate
from amp_rewrite.onnx.api import rewrite_onnx_model

SEQ, HALF, WIDTH = 32, 8, 16


def _angles_model(form: str) -> onnx.ModelProto:
    """y = (x @ W) * cos(angles) + (x @ W) * sin(angles), angles = concat(t ⊗ f, t ⊗ f) with
    t = start + [0, SEQ) as float, f the RoPE frequencies."""
    freqs = 1.0 / 10000 ** (np.arange(0, 2 * HALF, 2, dtype=np.float32) / (2 * HALF))
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(freqs[None, :], "f_row"),
             numpy_helper.from_array(freqs, "f"),
             numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([0, SEQ, 1], np.int64)[0:1].reshape(()), "zero"),
             numpy_helper.from_array(np.array(SEQ, np.int64), "seq"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    nodes = [helper.make_node("Range", ["zero", "seq", "one"], ["ramp"]),
             helper.make_node("Add", ["ramp", "start"], ["pos_int"]),
             helper.make_node("Cast", ["pos_int"], ["t"], to=TensorProto.FLOAT)]
    if form == "einsum":
        nodes.append(helper.make_node("Einsum", ["t", "f"], ["angles"], equation="i,j->ij"))
    else:
        nodes.append(helper.make_node("Unsqueeze", ["t", "axis1"], ["t_col"]))
        op = "MatMul" if form == "matmul" else "Gemm"
        nodes.append(helper.make_node(op, ["t_col", "f_row"], ["angles"]))
    nodes += [helper.make_node("Concat", ["angles", "angles"], ["emb"], axis=-1),
              helper.make_node("Cos", ["emb"], ["cos"]),
              helper.make_node("Sin", ["emb"], ["sin"]),
              helper.make_node("MatMul", ["x", "w"], ["h"]),
              helper.make_node("Mul", ["h", "cos"], ["a"]),
              helper.make_node("Mul", ["h", "sin"], ["b"]),
              helper.make_node("Add", ["a", "b"], ["y"])]
    graph = helper.make_graph(
        nodes, f"angles_{form}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [SEQ, WIDTH]),
         helper.make_tensor_value_info("start", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [SEQ, WIDTH])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("form", ["matmul", "gemm", "einsum"])
def test_outer_product_of_positions_stays_fp32(form: str) -> None:
    model = _angles_model(form)
    onnx.checker.check_model(model, full_check=True)
    feeds = {"x": np.random.default_rng(1).standard_normal((SEQ, WIDTH)).astype(np.float32),
             "start": np.array(3000, np.int64)}
    want = validate.session(model).run(None, feeds)[0]
    result = rewrite_onnx_model(model, dtype="fp16")
    rewritten = result.model
    if not isinstance(rewritten, onnx.ModelProto):
        import onnx_ir as ir

        rewritten = ir.serde.serialize_model(rewritten)
    for got in (validate.session(rewritten).run(None, feeds)[0],
                validate.reference_run(rewritten, feeds)["y"]):
        error = float(np.abs(got.astype(np.float32) - want).max() / np.abs(want).max())
        assert error <= 5e-3, error
    # the outer product is gray and runs fp32; the model's GEMM of activations runs low
    products = {(r["op_type"], r["class"], r["precision"]) for r in result.report["nodes"]
                if r["op_type"] in ("MatMul", "Gemm", "Einsum")}
    assert products == {(form.capitalize() if form != "matmul" else "MatMul", "gray", "high"),
                        ("MatMul", "allow", "low")}, products

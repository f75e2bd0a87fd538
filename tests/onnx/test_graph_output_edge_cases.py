"""Graph outputs at the edge of what the checker and runtimes accept.

Cases: a model with no graph outputs (onnxruntime loads it and refuses every run) is refused
with exit 3; an untyped output of an If whose branches agree on the element type but not the
shape ([1] against [], as in onnxconverter-common's test suite) is typed float32 with the
shape left unset and rewritten. Oracle: the FP32 model under onnxruntime.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx.reference import ReferenceEvaluator

from amp_rewrite.cli import main
from amp_rewrite.errors import ModelError
from amp_rewrite.onnx import rewrite_onnx

from ._helpers import ort_run, rel_error, small_model

T = onnx.TensorProto


def run_cli_process(*args) -> subprocess.CompletedProcess:
    """The CLI in its own process: its stderr as a user sees it, logging included."""
    return subprocess.run([sys.executable, "-m", "amp_rewrite.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


# ----------------------------------------------------------------------------- no outputs


def test_model_without_graph_outputs_is_refused_with_exit_3(tmp_path):
    src = tmp_path / "no_outputs.onnx"
    onnx.save(small_model(outputs=[]), src)
    out = tmp_path / "out.onnx"
    run = run_cli_process(src, "-o", out)
    assert run.returncode == 3, run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("amp-rewrite: error:")
    assert str(src) in run.stderr and "no graph outputs" in run.stderr
    assert "make_tensor_value_info" in run.stderr  # the fix
    assert not out.exists()


def test_model_without_graph_outputs_is_a_model_error_in_the_api():
    with pytest.raises(ModelError, match="no graph outputs"):
        rewrite_onnx(small_model(outputs=[]))


# ----------------------------------------------------------------------------- If output


def if_output_of_two_ranks() -> onnx.ModelProto:
    """y = If(c): then ReduceSum(MatMul(h, w2)) reshaped to [1], else ReduceMax(Relu(h)), a
    scalar; y is declared by name only, so shape inference types it float32 and no shape."""
    rng = np.random.default_rng(0)
    w = onh.from_array((rng.standard_normal((4, 4)) / 2).astype(np.float32), "w")
    w2 = onh.from_array((rng.standard_normal((4, 4)) / 2).astype(np.float32), "w2")
    one = onh.from_array(np.array([1], np.int64), "one")
    then = oh.make_graph([oh.make_node("MatMul", ["h", "w2"], ["g"]),
                          oh.make_node("ReduceSum", ["g"], ["s"], keepdims=0),
                          oh.make_node("Reshape", ["s", "one"], ["then_out"])],
                         "then", [], [oh.make_tensor_value_info("then_out", T.FLOAT, [1])])
    other = oh.make_graph([oh.make_node("Relu", ["h"], ["r"]),
                           oh.make_node("ReduceMax", ["r"], ["else_out"], keepdims=0)],
                          "else", [], [oh.make_tensor_value_info("else_out", T.FLOAT, [])])
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
         oh.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)],
        "g", [oh.make_tensor_value_info("x", T.FLOAT, [2, 4]),
              oh.make_tensor_value_info("c", T.BOOL, [])],
        [onnx.ValueInfoProto(name="y")], [w, w2, one])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize("dtype, tolerance", [("fp16", 1e-2), ("bf16", 3e-2)])
def test_untyped_if_output_whose_branch_shapes_disagree_is_rewritten(tmp_path, capsys,
                                                                     dtype, tolerance):
    fp32 = if_output_of_two_ranks()
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(fp32)
    src, out = tmp_path / "m.onnx", tmp_path / "m.amp.onnx"
    onnx.save(fp32, src)
    assert main([str(src), "--dtype", dtype, "-o", str(out), "-q"]) == 0, capsys.readouterr()
    mixed = onnx.load(str(out))
    (y,) = mixed.graph.output
    assert y.type.tensor_type.elem_type == T.FLOAT  # what both branches agree on
    assert not y.type.tensor_type.HasField("shape")  # [1] or []: no shape fits both
    assert any(i.data_type == (T.FLOAT16 if dtype == "fp16" else T.BFLOAT16)
               for i in mixed.graph.initializer)  # the rewrite did lower something
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    for c, shape in ((True, (1,)), (False, ())):
        feeds = {"x": x, "c": np.array(c)}
        (expected,) = ort_run(fp32, feeds)
        runs = [ReferenceEvaluator(mixed).run(None, feeds)[0]]
        if dtype == "fp16":  # onnxruntime's CPU provider has no bf16 MatMul
            runs.append(ort_run(mixed, feeds)[0])
        for got in runs:
            assert got.shape == shape and got.dtype == np.float32
            assert rel_error(expected, got) <= tolerance

"""A failing CLI run prints exactly one line on stderr, its error, whatever it logged before.

Run in a subprocess: in-process, pytest's handlers catch the log and stderr would pass for
clean. Cases: validation that cannot run (onnxruntime refuses the random feeds: a Slice step
of 0, negative Resize scales), each logging a warning first; a warning of loading (text that
is not valid UTF-8) before such a failure; a refused model after a warning about the rules. A
successful run still prints its warnings.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from ._helpers import T, small_model

MARKER = "ONELINEFAILUREMARKER"


def run_cli_process(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amp_rewrite.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120, env=env)


def slice_with_step_input() -> onnx.ModelProto:
    """Random int64 feeds give the Slice step 0, which onnxruntime refuses."""
    inits = [onh.from_array(np.array([0], np.int64), "starts"),
             onh.from_array(np.array([4], np.int64), "ends"),
             onh.from_array(np.array([0], np.int64), "axes"),
             onh.from_array(np.ones((8, 8), np.float32), "w")]
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             oh.make_node("Slice", ["h", "starts", "ends", "axes", "steps"], ["y"])]
    return small_model(nodes=nodes, inits=inits,
                       inputs=[oh.make_tensor_value_info("x", T.FLOAT, [4, 8]),
                               oh.make_tensor_value_info("steps", T.INT64, [1])],
                       outputs=[oh.make_tensor_value_info("y", T.FLOAT, [None, 8])])


def resize_with_scales_input() -> onnx.ModelProto:
    """Random normal feeds give negative Resize scales, which onnxruntime refuses."""
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             oh.make_node("Resize", ["h", "", "scales"], ["y"], mode="nearest")]
    return small_model(nodes=nodes,
                       inputs=[oh.make_tensor_value_info("x", T.FLOAT, [1, 1, 2, 8]),
                               oh.make_tensor_value_info("scales", T.FLOAT, [4])],
                       outputs=[oh.make_tensor_value_info("y", T.FLOAT, list("nchw"))])


def with_invalid_utf8_graph_name(model: onnx.ModelProto) -> bytes:
    model.graph.name = MARKER
    return model.SerializeToString().replace(MARKER.encode(),
                                             b"bad\xff".ljust(len(MARKER), b"x"))


def assert_one_error_line(run: subprocess.CompletedProcess, code: int, needle: str) -> None:
    assert run.returncode == code, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("amp-rewrite: error:") and needle in lines[0], run.stderr


@pytest.mark.parametrize("model", [slice_with_step_input(), resize_with_scales_input(),
                                   with_invalid_utf8_graph_name(slice_with_step_input())],
                         ids=["slice_step", "resize_scales", "invalid_utf8_then_slice_step"])
def test_validation_that_cannot_run_prints_one_line(tmp_path, model):
    src = tmp_path / "m.onnx"
    src.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    run = run_cli_process(src, "--validate", "-q")
    assert_one_error_line(run, 4, "--calibrate")
    assert not (tmp_path / "m.amp.onnx").exists()


def test_model_refusal_after_a_rule_warning_prints_one_line(tmp_path):
    """The rules warn of an unknown op when they load; then --keep-opset refuses a bf16
    rewrite of an opset-18 Conv (exit 3)."""
    k = onh.from_array(np.ones((4, 3, 3, 3), np.float32), "k")
    model = small_model(nodes=[oh.make_node("Conv", ["x", "k"], ["y"], name="conv")],
                        inits=[k], inputs=[oh.make_tensor_value_info("x", T.FLOAT, [1, 3, 8, 8])],
                        outputs=[oh.make_tensor_value_info("y", T.FLOAT, [1, 4, 6, 6])])
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    env = {**os.environ, "AMP_REWRITE_DENY_ADD": "MatMull"}
    run = run_cli_process(src, "--dtype", "bf16", "--keep-opset", env=env)
    assert_one_error_line(run, 3, "--keep-opset")
    warned = run_cli_process(src, "--dtype", "bf16", "-q", "-o", tmp_path / "o.onnx", env=env)
    assert warned.returncode == 0 and "unknown op 'MatMull'" in warned.stderr  # warned indeed


def test_a_successful_run_still_prints_its_warnings(tmp_path):
    src = tmp_path / "m.onnx"
    src.write_bytes(with_invalid_utf8_graph_name(small_model()))
    run = run_cli_process(src, "-q")
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == [
        f"amp-rewrite: WARNING: {src}: 1 string fields are not valid UTF-8; written with the "
        "bad bytes escaped (\\xNN)"]

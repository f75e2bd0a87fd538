"""Graph outputs at the edge of what the checker and runtimes accept.

Cases: a model with no graph outputs (onnxruntime loads it and refuses every run) is refused
with exit 3.
"""
from __future__ import annotations

import subprocess
import sys

import onnx
import pytest

from amp_rewrite.errors import ModelError
from amp_rewrite.onnx import rewrite_onnx

from ._helpers import small_model


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
